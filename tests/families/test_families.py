"""Each family is one data module, and what its grammar forces its parser reads back.

For every family and every call syntax its parser reads (which includes every
syntax ``Family.call_syntax`` may choose), llguidance compiles the forced-call
grammar and then:

- accepts calls written out in that syntax, token by token, and the family's
  parser reads them back as the same calls;
- drives seeded random walks through the grammar (any allowed token, no model),
  and the parser reads each output as exactly the call the grammar wrote.

Both run over the demo tokenizer (markers spelled in text) and the same one
with the markers as special tokens, as Mistral's and Qwen's tokenizers have them.
"""

from __future__ import annotations

import json
import random
import re
import shutil
from pathlib import Path
from typing import Any

import jsonschema
import mlx.core as mx
import numpy as np
import pytest

import app.families
from app.engine.constrain.constraints import Tool, ToolCalls
from app.engine.constrain.grammar import Grammar, compiler_for
from app.families import FAMILIES, REASONING_MARKERS, CallSyntax
from app.parsers import collect, make_parser
from tests.fixtures.tiny_llama import TOKENIZER_FILES
from tests.parsers.streams import FIXTURES

PACKAGE = Path(app.families.__file__).parent
SHARED = {"__init__", "family"}

WEATHER = Tool("get_weather", {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 10}, "unit": {"enum": ["c", "f"]}},
    "required": ["city", "unit"],
    "additionalProperties": False,
})
CLOCK = Tool("get_time", {
    "type": "object",
    "properties": {"zone": {"type": "object", "properties": {"utc": {"type": "boolean"}}, "required": ["utc"],
                            "additionalProperties": False}},
    "required": ["zone"],
    "additionalProperties": False,
})
TOOLS = {t.name: t for t in (WEATHER, CLOCK)}
CALLS = [("get_weather", {"city": "Nice \"N\"", "unit": "c"}), ("get_time", {"zone": {"utc": True}})]
MAX_STEPS = 400


# ---- the registry ---------------------------------------------------------------------


def test_each_module_is_one_registered_family_under_its_own_name() -> None:
    """A family's module name, registry key and models.yaml value are one string."""
    modules = {p.stem for p in PACKAGE.glob("*.py")} - SHARED
    assert set(FAMILIES) == modules
    for name, family in FAMILIES.items():
        module = __import__(f"app.families.{name}", fromlist=["FAMILY"])
        assert module.FAMILY is family and family.name == name


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_each_family_has_recorded_outputs(name: str) -> None:
    data = json.loads((FIXTURES / f"{name}.json").read_text(encoding="utf-8"))
    assert data["parser"] == name and data["cases"]


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_each_family_is_whole(name: str) -> None:
    """Its reasoning block is one the parsers read; what it may force it reads; its
    tool note has a sentence to ask for its syntax; its name hints compile."""
    family = FAMILIES[name]
    assert family.reasoning in REASONING_MARKERS
    assert set(family.writes) <= set(family.reads)
    assert family.call_syntax("", template_takes_tools=False) is family.noted and family.noted.note
    for pattern in (family.name_hint, family.reasoning_names):
        re.compile(pattern)


# ---- forced calls parse back ----------------------------------------------------------


def _label(syntax: CallSyntax) -> str:
    return syntax.begin.strip() or f"bare-json-{syntax.arguments_key}"


READS = [(name, syntax) for name, family in FAMILIES.items() for syntax in family.reads]
READ_IDS = [f"{name}:{_label(syntax)}" for name, syntax in READS]
# Tag-like markers, which real tokenizers have as single tokens ([TOOL_CALLS], <tool_call>, [THINK]).
MARKERS = sorted(m for m in {*(p for _, s in READS for p in (s.begin.strip(), s.args or "", s.end.strip())),
                             *(p for pair in REASONING_MARKERS for p in pair)}
                 if re.fullmatch(r"\[/?[A-Z_]+\]|</?\w+>", m))


@pytest.fixture(scope="module", params=["text-markers", "special-markers"])
def tokenizer(request: pytest.FixtureRequest, demo_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Any:
    """The demo tokenizer, or the same with every family marker as one special token."""
    from mlx_lm.utils import load_tokenizer

    if request.param == "text-markers":
        return load_tokenizer(demo_model_dir)
    from tokenizers import AddedToken, Tokenizer

    out = tmp_path_factory.mktemp("marker-tokenizer")
    for name in TOKENIZER_FILES:
        if (demo_model_dir / name).exists():
            shutil.copy(demo_model_dir / name, out / name)
    tok = Tokenizer.from_file(str(out / "tokenizer.json"))
    tok.add_special_tokens([AddedToken(m, special=True, normalized=False) for m in MARKERS])
    tok.save(str(out / "tokenizer.json"))
    return load_tokenizer(out)


def render(syntax: CallSyntax, calls: list[tuple[str, dict[str, Any]]]) -> str:
    """Calls written out in ``syntax``, as a model following it would."""
    objects = [{"name": name, syntax.arguments_key: args} for name, args in calls]
    if syntax.bare:
        return json.dumps(objects if len(objects) > 1 else objects[0])
    if syntax.args is not None:
        pieces = [f"{syntax.begin}{name}{syntax.args}{json.dumps(args)}{syntax.end}" for name, args in calls]
    else:
        pieces = [f"{syntax.begin}{json.dumps(obj)}{syntax.end}" for obj in objects]
    return syntax.separator.join(pieces)


def written_call(syntax: CallSyntax, text: str) -> tuple[str, dict[str, Any]]:
    """The one call in ``text`` as the grammar wrote it, read by the syntax's fields alone."""
    assert text.startswith(syntax.begin) and text.endswith(syntax.end), text
    body = text[len(syntax.begin) : len(text) - len(syntax.end)]
    if syntax.args is not None:
        name, marker, args = body.partition(syntax.args)
        assert marker, text
        return name, json.loads(args)
    obj = json.loads(body)
    return obj["name"], obj[syntax.arguments_key]


def parsed(family: str, text: str) -> list[tuple[str, dict[str, Any]]]:
    """The calls the family's own parser reads; nothing may be left over as text or error."""
    parser = make_parser(family, reasoning=True, tools_offered=True)
    out = collect([*parser.feed(text), *parser.finish()])
    assert not out.errors and not out.content and not out.reasoning, (text, out)
    return [(c.name, json.loads(c.arguments_json)) for c in out.tool_calls]


def allowed(proc: Any, context: list[int], width: int) -> np.ndarray:
    """The ids the grammar allows after ``context`` (the prompt is one token)."""
    bias = np.array(proc(mx.array([0, *context]), mx.zeros((1, width)))[0])
    return np.nonzero(bias > -np.inf)[0]


def next_after(grammar: Grammar, tokenizer: Any, text: str) -> set[int] | None:
    """The ids the grammar allows once ``text`` is through, token by token; None if it refuses a token."""
    ids = tokenizer.encode(text, add_special_tokens=False)
    proc, width = grammar.processor(prompt_len=1), len(tokenizer._tokenizer)
    for n, token in enumerate(ids):
        if token not in allowed(proc, ids[:n], width):
            return None
    return set(allowed(proc, ids, width).tolist())


def walk(grammar: Grammar, tokenizer: Any, seed: int) -> str:
    """One random path through the grammar: any allowed token, until only EOS is left."""
    rng = random.Random(seed)
    proc, width, eos = grammar.processor(prompt_len=1), len(tokenizer._tokenizer), set(tokenizer.eos_token_ids)
    ids: list[int] = []
    for _ in range(MAX_STEPS):
        options = [t for t in allowed(proc, ids, width).tolist() if t not in eos]
        if not options:
            return str(tokenizer.decode(ids))
        ids.append(rng.choice(options))
    raise AssertionError(f"no end after {MAX_STEPS} tokens: {tokenizer.decode(ids)!r}")


@pytest.mark.parametrize(("family", "syntax"), READS, ids=READ_IDS)
def test_written_calls_pass_the_grammar_and_parse_back(tokenizer: Any, family: str, syntax: CallSyntax) -> None:
    compiler = compiler_for(tokenizer)
    one, both = CALLS[:1], CALLS
    single = compiler.compile(ToolCalls((WEATHER, CLOCK), syntax, parallel=False))
    parallel = compiler.compile(ToolCalls((WEATHER, CLOCK), syntax, parallel=True))
    eos = set(tokenizer.eos_token_ids)
    assert next_after(single, tokenizer, render(syntax, one)) == eos  # complete: only EOS is left
    after_both = next_after(parallel, tokenizer, render(syntax, both))
    assert after_both is not None and eos <= after_both  # it may end, or call again
    assert next_after(single, tokenizer, render(syntax, both)) is None
    assert parsed(family, render(syntax, one)) == one
    assert parsed(family, render(syntax, both)) == both


@pytest.mark.parametrize(("family", "syntax"), READS, ids=READ_IDS)
def test_random_grammar_output_parses_as_the_call_it_wrote(tokenizer: Any, family: str, syntax: CallSyntax) -> None:
    grammar = compiler_for(tokenizer).compile(ToolCalls((WEATHER, CLOCK), syntax, parallel=False))
    for seed in range(3):
        text = walk(grammar, tokenizer, seed)
        name, args = written_call(syntax, text)
        assert parsed(family, text) == [(name, args)]
        jsonschema.validate(args, TOOLS[name].parameters)

