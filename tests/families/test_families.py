"""Each family is one data module, and what its grammar forces its parser reads back.

For every family and every call syntax it may be told to write (``Family.writes``),
llguidance compiles the forced-call grammar and then:

- accepts calls written out in that syntax (``writers``), token by token, and the
  family's parser reads them back as the same calls;
- drives seeded random walks through the grammar (any allowed token, no model),
  and the parser reads each output as one call whose arguments follow the tool's schema.

Both run over the demo tokenizer (markers spelled in text) and the same one with
the markers as special tokens, as real tokenizers have them (random walks on the
second only: a walk is a few hundred mask computations).
"""

from __future__ import annotations

import importlib
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
from app.families import FAMILIES, CallSyntax, Syntax
from app.families.syntax import HarmonyCalls, PythonicCalls, RecipientCalls
from app.parsers import collect, make_parser
from tests.families.writers import write
from tests.fixtures.tiny_llama import TOKENIZER_FILES
from tests.parsers.streams import FIXTURES

PACKAGE = Path(app.families.__file__).parent
SHARED = {"__init__", "family", "syntax"}

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
    modules = {p.relative_to(PACKAGE).with_suffix("").as_posix().replace("/", "."): p.stem
               for p in PACKAGE.rglob("*.py") if p.stem not in SHARED}
    assert sorted(FAMILIES) == sorted(modules.values())
    for path, name in modules.items():
        module = importlib.import_module(f"app.families.{path}")
        assert module.FAMILY is FAMILIES[name] and FAMILIES[name].name == name


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_each_family_has_recorded_outputs(name: str) -> None:
    data = json.loads((FIXTURES / f"{name}.json").read_text(encoding="utf-8"))
    assert data["parser"] == name and data["cases"]


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_each_family_is_whole(name: str) -> None:
    """Its reasoning blocks are pairs of markers; what it may force it reads; its tool note
    has a sentence to ask for its syntax; its name hints compile."""
    family = FAMILIES[name]
    assert family.reasoning and all(opener and closer for opener, closer in family.reasoning)
    assert set(family.writes) <= set(family.reads)
    assert family.call_syntax("", template_takes_tools=False) is family.noted and family.noted.note
    assert not family.channels or family.noted not in family.writes
    for pattern in (family.name_hint, family.reasoning_names):
        re.compile(pattern)


# ---- forced calls parse back ----------------------------------------------------------

_MARKER = re.compile(r"<\|[^|<>\n]*\|>|<｜[^｜<>\n]*｜>|</?[\w:]+>|\[/?[A-Z_]+\]|<\|[\w\"]+>|<[\w\"]+\|>"
                     r"|\]<\]minimax\[>\[")


def _label(syntax: Syntax) -> str:
    if isinstance(syntax, CallSyntax):
        return syntax.begin.strip() or f"bare-json-{syntax.arguments_key}"
    return type(syntax).__name__


def _texts(syntax: Syntax) -> list[str]:
    """The literal strings a syntax is written with."""
    return [v for v in vars(syntax).values() if isinstance(v, str)] + \
        [m for v in vars(syntax).values() if isinstance(v, tuple) for m in v if isinstance(m, str)]


WRITES = [(name, syntax) for name, family in FAMILIES.items() for syntax in family.writes]
WRITE_IDS = [f"{name}:{_label(syntax)}" for name, syntax in WRITES]
# Tag-like markers, which real tokenizers have as single tokens ([TOOL_CALLS], <tool_call>, <|"|>).
MARKERS = sorted({m for family in FAMILIES.values() for s in family.reads for t in _texts(s)
                  for m in _MARKER.findall(t)} | {m for family in FAMILIES.values()
                                                 for pair in family.reasoning_pairs for m in pair
                                                 if _MARKER.fullmatch(m)})


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
    wrapped = load_tokenizer(out)
    wrapped.marker_tokens = True
    return wrapped


def parsed(family: str, text: str, *, reasoning: bool = False) -> list[tuple[str, dict[str, Any]]]:
    """The calls the family's own parser reads; nothing may be left over as text or error
    (nor as reasoning, unless the grammar writes some first: Harmony's analysis)."""
    parser = make_parser(family, reasoning=True, tools_offered=True,
                         tools={t.name: t.parameters for t in (WEATHER, CLOCK)})
    out = collect([*parser.feed(text), *parser.finish()])
    assert not out.errors and not out.content and (reasoning or not out.reasoning), (text, out)
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
    markers = set(tokenizer._tokenizer.added_tokens_decoder)
    ids: list[int] = []
    for _ in range(MAX_STEPS):
        options = [t for t in allowed(proc, ids, width).tolist() if t not in eos]
        if not options:
            return str(tokenizer.decode(ids))
        # A marker now and then, or free text (a reasoning block) would run for ever.
        structural = [t for t in options if t in markers]
        ids.append(rng.choice(structural if structural and rng.random() < 0.3 else options))
    raise AssertionError(f"no end after {MAX_STEPS} tokens: {tokenizer.decode(ids)!r}")


@pytest.mark.parametrize(("family", "syntax"), WRITES, ids=WRITE_IDS)
def test_written_calls_pass_the_grammar_and_parse_back(tokenizer: Any, family: str, syntax: Syntax) -> None:
    compiler = compiler_for(tokenizer)
    one, both = CALLS[:1], CALLS
    single = compiler.compile(ToolCalls((WEATHER, CLOCK), syntax, parallel=False))
    parallel = compiler.compile(ToolCalls((WEATHER, CLOCK), syntax, parallel=True))
    eos = set(tokenizer.eos_token_ids)
    assert next_after(single, tokenizer, write(syntax, one)) == eos  # complete: only EOS is left
    assert parsed(family, write(syntax, one)) == one
    if isinstance(syntax, (HarmonyCalls, RecipientCalls)):
        return  # one call a message: the message's end ends the generation
    after_both = next_after(parallel, tokenizer, write(syntax, both))
    assert after_both is not None and eos <= after_both  # it may end, or call again
    assert next_after(single, tokenizer, write(syntax, both)) is None
    assert parsed(family, write(syntax, both)) == both


@pytest.mark.parametrize(("family", "syntax"), WRITES, ids=WRITE_IDS)
def test_random_grammar_output_parses_as_a_call_of_its_schema(tokenizer: Any, family: str, syntax: Syntax) -> None:
    if not getattr(tokenizer, "marker_tokens", False):
        pytest.skip("walked with the markers as special tokens")
    grammar = compiler_for(tokenizer).compile(ToolCalls((WEATHER, CLOCK), syntax, parallel=False))
    for seed in range(2):
        text = walk(grammar, tokenizer, seed)
        ((name, args),) = parsed(family, text, reasoning=isinstance(syntax, (HarmonyCalls, RecipientCalls)))
        jsonschema.validate(args, TOOLS[name].parameters)


# ---- every shape, every family: what a model writes reads back in any chunking --------------

SEARCH = {"type": "object", "properties": {
    "query": {"type": "string"}, "filters": {"type": "object"}, "tags": {"type": "array", "items": {"type": "string"}}}}
PING: dict[str, Any] = {"type": "object", "properties": {}}
SHAPE_TOOLS = {"search": SEARCH, "ping": PING, "get_weather": WEATHER.parameters}
WRITTEN = {
    "no arguments": [("ping", {})],
    "nested objects and arrays": [("search", {"filters": {"a": {"b": [1, 2, None]}, "ok": True}, "tags": ["x", "y"]})],
    "unicode": [("search", {"query": "Zürich 東京 ☀ — “quoted”"})],
    "parallel": [("ping", {}), ("search", {"query": "two"})],
}


def _events(family: str, chunks: list[str]) -> Any:
    parser = make_parser(family, reasoning=True, tools_offered=True, tools=SHAPE_TOOLS)
    return collect([ev for chunk in chunks for ev in parser.feed(chunk)] + parser.finish())


@pytest.mark.parametrize(("family", "syntax"), WRITES, ids=WRITE_IDS)
def test_written_calls_read_back_in_any_chunking(family: str, syntax: Syntax) -> None:
    from tests.parsers.streams import chunkings

    for label, calls in WRITTEN.items():
        if label == "parallel" and isinstance(syntax, (HarmonyCalls, RecipientCalls)):
            continue  # one call a message
        text = write(syntax, calls)
        for way, chunks in chunkings(text, seeds=3).items():
            out = _events(family, chunks)
            got = [(c.name, json.loads(c.arguments_json)) for c in out.tool_calls]
            assert got == calls and not out.errors and not out.content.strip(), (label, way, text, out)


@pytest.mark.parametrize(("family", "syntax"), WRITES, ids=WRITE_IDS)
def test_a_call_cut_off_is_no_call(family: str, syntax: Syntax) -> None:
    """Output that max_tokens ends inside a call's arguments: no half call comes back; where
    markers said a call began, an error event says it was cut (a bare answer that never got
    to be a call may be content instead)."""
    text = write(syntax, [("search", {"query": "a long query that is cut"})])
    cut = text[: text.index("long") + 2]
    out = _events(family, [cut])
    assert not out.tool_calls, (cut, out)
    bare = (isinstance(syntax, CallSyntax) and syntax.bare) or (isinstance(syntax, PythonicCalls) and not syntax.begin)
    assert out.errors or bare, (cut, out)
