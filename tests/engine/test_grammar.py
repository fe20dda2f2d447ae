"""Constrained decoding on real tiny models: schema-valid JSON, tool calls in each
family's syntax, bounded whitespace, 400s for bad schemas, reasoning left free."""

from __future__ import annotations

import asyncio
import json
import re
from dataclasses import replace
from pathlib import Path

import jsonschema
import mlx.core as mx
import numpy as np
import pytest

from app.engine.constrain.constraints import (
    JsonObject,
    JsonSchema,
    Reasoning,
    Tool,
    ToolCalls,
)
from app.engine.constrain.grammar import Grammar, compiler_for
from app.engine.prompt import TokenPrompt
from app.engine.types import GREEDY, GenerationRequest
from app.errors import InvalidRequestError
from app.families import BARE_JSON, CallSyntax, llama, mistral, qwen
from app.parsers import collect, make_parser
from tests.engine.engines import make_engine, run

TICKET = {
    "type": "object",
    "properties": {
        "sentiment": {"enum": ["positive", "neutral", "negative"]},
        "urgent": {"type": "boolean"},
        "summary": {"type": "string", "maxLength": 12},
        "stars": {"type": "integer", "minimum": 1, "maximum": 5},
        "tags": {"type": "array", "items": {"enum": ["bug", "billing", "login"]}, "maxItems": 2},
    },
    "required": ["sentiment", "urgent", "summary", "stars", "tags"],
    "additionalProperties": False,
}
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
HOT = replace(GREEDY, temperature=1.5, seed=7)
THINK_MARKERS = ["<think>", "</think>", "[TOOL_CALLS]", "[ARGS]"]


@pytest.fixture(scope="module")
def engine(tiny_model_dir):
    eng = make_engine(tiny_model_dir, max_num_seqs=8)
    yield eng
    eng.worker.stop()


@pytest.fixture(scope="module")
def marker_model_dir(tmp_path_factory: pytest.TempPathFactory, demo_model_dir: Path) -> Path:
    """A seeded tiny llama whose tokenizer is the demo one plus special tokens for reasoning
    and Mistral-style calls; its vocabulary (49,160) is wider than the tokenizer's (49,156),
    as Qwen's is, so the padding ids must never be sampled."""
    from tokenizers import AddedToken, Tokenizer

    from tests.fixtures.tiny_llama import TINY_LLAMA, build_tiny_llama

    out = build_tiny_llama(tmp_path_factory.mktemp("marker-llama"), demo_model_dir,
                           {**TINY_LLAMA, "vocab_size": 49160}, seed=1)
    tok = Tokenizer.from_file(str(demo_model_dir / "tokenizer.json"))
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in THINK_MARKERS])
    tok.save(str(out / "tokenizer.json"))
    return out


@pytest.fixture(scope="module")
def marker_engine(marker_model_dir):
    eng = make_engine(marker_model_dir)
    yield eng
    eng.worker.stop()


def prompt(engine, text: str) -> list[int]:
    return engine.tokenizer.encode(text)




def generate(engine, spec, text="Fill in the form.", sampling=GREEDY, reasoning=None, max_tokens=160, wrap=None):
    grammar = compiler_for(engine.tokenizer).compile(spec, reasoning)
    constraint = wrap(grammar) if wrap else grammar
    req = GenerationRequest(TokenPrompt(prompt(engine, text)), max_tokens=max_tokens,
                            sampling=sampling, constraint=constraint)
    return asyncio.run(run(engine, req))


def parse_calls(family: str, text: str, complete: bool = True) -> list[tuple[str, dict]]:
    """The calls Tandem's own stream parser reads from ``text``; ``complete=False`` for
    output cut by max_tokens, whose last call is unfinished."""
    parser = make_parser(family, reasoning=True, tools_offered=True)
    out = collect([*parser.feed(text), *parser.finish()])
    assert not (complete and out.errors), out.errors
    return [(c.name, json.loads(c.arguments_json)) for c in out.tool_calls]


# ---- JSON ---------------------------------------------------------------------------


@pytest.mark.parametrize("sampling", [GREEDY, HOT], ids=["greedy", "hot"])
def test_json_schema_output_is_valid(engine, sampling):
    text, last = generate(engine, JsonSchema(TICKET, strict=True), sampling=sampling)
    assert last.finish_reason == "stop", text
    jsonschema.validate(json.loads(text), TICKET)


def test_json_object_is_one_object(engine):
    text, last = generate(engine, JsonObject(), sampling=HOT, max_tokens=48)
    if last.finish_reason == "stop":
        assert isinstance(json.loads(text), dict)
    else:  # cut by max_tokens: still the start of an object
        assert text.startswith("{")


def test_batched_streams_each_follow_their_schema(engine):
    schemas = [TICKET, WEATHER.parameters, {"type": "array", "items": {"type": "boolean"}, "maxItems": 3}]
    compiler = compiler_for(engine.tokenizer)

    async def together():
        reqs = [GenerationRequest(TokenPrompt(prompt(engine, f"Answer {i}")), max_tokens=160, sampling=HOT,
                                  constraint=compiler.compile(JsonSchema(s)))
                for i, s in enumerate(schemas)]
        plain = GenerationRequest(TokenPrompt(prompt(engine, "Say anything")), max_tokens=8, sampling=HOT)
        return await asyncio.gather(*(run(engine, r) for r in [*reqs, plain]))

    *outs, (_, plain_last) = asyncio.run(together())
    for schema, (text, last) in zip(schemas, outs):
        assert last.finish_reason == "stop"
        jsonschema.validate(json.loads(text), schema)
    assert plain_last.completion_tokens == 8  # the unconstrained neighbour ran free
    assert not compiler.live  # finished sequences' processors are gone, none counts as in flight


class PadsWithWhitespace:
    """A model that would rather pad than answer: whitespace logits pushed far up,
    then the grammar. Fakes the model at the constraint seam only."""

    def __init__(self, grammar: Grammar, tokenizer) -> None:
        self.grammar = grammar
        # Byte-level BPE spells space, newline, tab and CR as these letters.
        vocab = tokenizer._tokenizer.get_vocab()
        self.ids = mx.array([i for t, i in vocab.items() if re.fullmatch("[ĠĊĉč]+", t)])

    def processor(self, prompt_len: int):
        inner = self.grammar.processor(prompt_len)
        boost = mx.zeros((1, 49152)).at[:, self.ids].add(30.0)
        return Wrapped(inner, lambda tokens, logits: inner(tokens, logits + boost[:, : logits.shape[-1]]))


class Wrapped:
    """A fake model's logits processor around the real grammar's, which still reports failures."""

    def __init__(self, inner, call) -> None:
        self.inner, self.call = inner, call

    def __call__(self, tokens, logits):
        return self.call(tokens, logits)

    def failure(self):
        return self.inner.failure() if self.inner is not None else None


def test_whitespace_is_bounded(engine):
    text, last = generate(engine, JsonSchema(TICKET), wrap=lambda g: PadsWithWhitespace(g, engine.tokenizer),
                          max_tokens=400)
    assert last.finish_reason == "stop", text
    jsonschema.validate(json.loads(text), TICKET)
    # One gap holds at most a line break (\r\n) and 32 spaces or tabs: JSON_WHITESPACE.
    longest = max(len(m) for m in re.findall(r"\s+", text))
    assert 4 < longest <= 34  # it did pad, up to the bound


# ---- tool calls -------------------------------------------------------------------------

# Each syntax, and the parser family that reads it.
SYNTAXES = {"mistral": ("mistral", mistral.CALLS), "qwen": ("qwen", qwen.CALLS), "generic": ("generic", BARE_JSON),
            "llama": ("llama", llama.FUNCTION_TAG), "llama-json": ("llama", llama.JSON_PARAMETERS)}


@pytest.mark.parametrize("syntax", sorted(SYNTAXES))
@pytest.mark.parametrize("sampling", [GREEDY, HOT], ids=["greedy", "hot"])
def test_tool_calls_in_each_syntax(engine, syntax, sampling):
    family, call_syntax = SYNTAXES[syntax]
    spec = ToolCalls((WEATHER, CLOCK), call_syntax, parallel=True)
    text, last = generate(engine, spec, sampling=sampling, max_tokens=200)
    # A random model may go on calling until max_tokens: parallel calls have no count limit.
    # Calls with markers are read one by one; a bare JSON list only when it is whole.
    done = last.finish_reason == "stop"
    calls = parse_calls(family, text, complete=done)
    assert calls or not (done or call_syntax.begin), text
    for name, args in calls:
        jsonschema.validate(args, TOOLS[name].parameters)


@pytest.mark.parametrize("syntax", sorted(SYNTAXES))
def test_one_named_call_when_parallel_is_off(engine, syntax):
    family, call_syntax = SYNTAXES[syntax]
    spec = ToolCalls((CLOCK,), call_syntax, parallel=False)
    text, last = generate(engine, spec, sampling=HOT, max_tokens=120)
    assert last.finish_reason == "stop", text
    [(name, args)] = parse_calls(family, text)
    assert name == "get_time"
    jsonschema.validate(args, CLOCK.parameters)


def test_mistral_markers_are_special_tokens(marker_engine):
    spec = ToolCalls((WEATHER, CLOCK), mistral.CALLS)
    grammar = compiler_for(marker_engine.tokenizer).compile(spec)
    assert "<[49154]>" in grammar.lark and "<[49155]>" in grammar.lark  # [TOOL_CALLS], [ARGS]
    text, last = generate(marker_engine, spec, sampling=HOT, max_tokens=120)
    assert last.finish_reason == "stop", text
    assert text.startswith("[TOOL_CALLS]")
    assert all(name in TOOLS for name, _ in parse_calls("mistral", text))


def test_calls_or_an_answer(engine):
    """tool_choice auto with a response_format: call a tool, or answer in the schema."""
    spec = ToolCalls((WEATHER,), qwen.CALLS, parallel=False, answer=JsonSchema(TICKET))
    branches = set()
    for seed in range(4):  # seeds 0-3 of the tiny model take both branches
        text, last = generate(engine, spec, sampling=replace(GREEDY, temperature=1.5, seed=seed), max_tokens=200)
        assert last.finish_reason == "stop", text
        if text.startswith("<tool_call>"):
            [(_, args)] = parse_calls("qwen", text)
            jsonschema.validate(args, WEATHER.parameters)
            branches.add("call")
        else:
            jsonschema.validate(json.loads(text), TICKET)
            branches.add("answer")
    assert branches == {"call", "answer"}


def test_tool_without_parameters_gets_an_object(engine):
    spec = ToolCalls((Tool("ping"),), CallSyntax(begin="<tool_call>\n", end="\n</tool_call>"), parallel=False)
    # A seed whose draw closes the object within 120 tokens (at 1.5 the random model may write a long key).
    text, last = generate(engine, spec, sampling=replace(HOT, seed=12), max_tokens=120)
    assert last.finish_reason == "stop", text
    [(name, args)] = parse_calls("qwen", text)
    assert name == "ping" and isinstance(args, dict)


# ---- the processor on scripted tokens -------------------------------------------------


def allowed_after(grammar: Grammar, tokenizer, text: str, width: int | None = None) -> set[int]:
    """Token ids the grammar allows after ``text``, fed one token per call as the batch does."""
    ids = tokenizer.encode(text, add_special_tokens=False)
    proc = grammar.processor(prompt_len=1)
    width = width or len(tokenizer._tokenizer)
    for n in range(1, len(ids) + 2):
        logits = proc(mx.array([0, *ids[: n - 1]]), mx.zeros((1, width)))
    return set(np.nonzero(np.array(logits[0]) > -np.inf)[0].tolist())


def test_only_eos_follows_a_complete_value(engine):
    tok = engine.tokenizer
    grammar = compiler_for(tok).compile(JsonSchema(TICKET))
    doc = '{"sentiment": "neutral", "urgent": false, "summary": "ok", "stars": 3, "tags": []}'
    assert allowed_after(grammar, tok, doc) == set(tok.eos_token_ids)
    # The batch computes one step past EOS before it sees it: that step leaves logits alone.
    proc = grammar.processor(prompt_len=1)
    context = [0, *tok.encode(doc, add_special_tokens=False), *tok.eos_token_ids]
    logits = mx.arange(len(tok._tokenizer), dtype=mx.float32)[None]
    assert np.array_equal(np.array(proc(mx.array(context), logits)), np.array(logits))
    assert proc.error is None


def test_parallel_calls_may_go_on_and_single_calls_may_not(engine):
    tok = engine.tokenizer
    call = '<tool_call>\n{"name": "get_time", "arguments": {"zone": {"utc": true}}}\n</tool_call>'
    single = compiler_for(tok).compile(ToolCalls((CLOCK,), qwen.CALLS, parallel=False))
    parallel = compiler_for(tok).compile(ToolCalls((CLOCK,), qwen.CALLS, parallel=True))
    assert allowed_after(single, tok, call) == set(tok.eos_token_ids)
    more = allowed_after(parallel, tok, call) - set(tok.eos_token_ids)
    assert more and all(tok.decode([t]).startswith("\n") for t in more)  # "\n<tool_call>" next


def test_catching_up_several_tokens_at_once_matches_one_by_one(engine):
    """A sequence paused and re-inserted brings its tokens back in one context."""
    tok = engine.tokenizer
    grammar = compiler_for(tok).compile(JsonSchema(TICKET))
    ids = tok.encode('{"sentiment": "positive", "urgent": true', add_special_tokens=False)
    zeros = mx.zeros((1, len(tok._tokenizer)))
    step = grammar.processor(prompt_len=1)
    masks = [np.array(step(mx.array([0, *ids[:n]]), zeros)) for n in range(len(ids) + 1)]
    jump = grammar.processor(prompt_len=1)
    jump(mx.array([0]), zeros)
    assert np.array_equal(np.array(jump(mx.array([0, *ids]), zeros)), masks[-1])
    assert np.array_equal(np.array(jump(mx.array([0, *ids[:3]]), zeros)), masks[3])  # rolled back


def test_model_padding_ids_are_never_allowed(marker_engine):
    tok = marker_engine.tokenizer
    grammar = compiler_for(tok).compile(JsonObject())
    allowed = allowed_after(grammar, tok, '{"a": "', width=49160)
    assert allowed and max(allowed) < len(tok._tokenizer)


def test_compiled_grammars_and_tokenizer_setup_are_cached(engine):
    compiler = compiler_for(engine.tokenizer)
    assert compiler_for(engine.tokenizer) is compiler
    assert compiler.compile(JsonSchema(dict(TICKET))) is compiler.compile(JsonSchema(dict(TICKET)))


# ---- invalid schemas: a 400 before any model time -----------------------------------------


@pytest.mark.parametrize("spec", [
    JsonSchema({"type": "strin"}),
    JsonSchema({"type": "object", "properties": {"a": {"$ref": "#/$defs/missing"}}}),
    JsonSchema({"type": "string", "format": "no-such-format"}, strict=True),
    JsonSchema({"type": "integer", "minimum": 5, "maximum": 1}),
    JsonSchema(["not", "an", "object"]),  # type: ignore[arg-type]
], ids=["bad-type", "dangling-ref", "unknown-format-strict", "empty-range", "not-an-object"])
def test_invalid_schema_is_a_400(engine, spec):
    with pytest.raises(InvalidRequestError) as err:
        compiler_for(engine.tokenizer).compile(spec)
    assert err.value.status_code == 400 and err.value.param == "response_format"


def test_unknown_format_is_ignored_when_not_strict(engine):
    compiler_for(engine.tokenizer).compile(JsonSchema({"type": "string", "format": "no-such-format"}))


def test_invalid_tool_parameters_name_the_tool(engine):
    bad = Tool("broken", {"type": "object", "properties": {"x": {"type": "nope"}}})
    with pytest.raises(InvalidRequestError, match="broken") as err:
        compiler_for(engine.tokenizer).compile(ToolCalls((WEATHER, bad), qwen.CALLS))
    assert err.value.param == "tools"


# ---- limits: llguidance's lexer and parser run out while generating ------------------------

# Compiles, but the lexer's automaton for this string explodes once the output is inside it.
EXPLODING = {"type": "object", "properties": {"a": {"type": "string",
                                                    "pattern": "^(.*a.{15})|(.*b.{15})|(.*c.{15})$"}},
             "required": ["a"]}


def test_a_limit_hit_mid_run_ends_the_sequence_with_an_error(engine):
    """It used to end as a normal "stop" with '{"a": "abc' for text: invalid JSON. The model
    is made to write that start (the lexer explodes on it); the grammar masks as ever."""
    compiler_for(engine.tokenizer).compile(JsonSchema(EXPLODING, strict=True))  # no error at compile time
    start = engine.tokenizer.encode('{"a": "abc', add_special_tokens=False)
    writes = lambda g: ForcesTokens(g, dict(enumerate(start)))  # noqa: E731
    with pytest.raises(InvalidRequestError) as err:
        generate(engine, JsonSchema(EXPLODING, strict=True), max_tokens=40, wrap=writes)
    assert err.value.status_code == 400 and err.value.code == "grammar_limit_exceeded"
    assert "too many expressions constructed" in err.value.message and "JSON schema" in err.value.message
    assert "<state>" not in err.value.message  # llguidance's parser dump (the output so far) stays out
    # Its lexer (shared by every request of the schema) is spent: the schema is now refused at compile time.
    with pytest.raises(InvalidRequestError) as again:
        compiler_for(engine.tokenizer).compile(JsonSchema(EXPLODING, strict=True))
    assert again.value.code == "grammar_limit_exceeded" and again.value.param == "response_format"
    text, _ = generate(engine, JsonSchema(TICKET))  # the engine goes on serving
    jsonschema.validate(json.loads(text), TICKET)


def test_a_limit_error_at_compile_time_names_the_limit():
    from app.engine.constrain.grammar import _rejection

    err = _rejection(JsonSchema({}), "Parser Error: Current row has 2500 items; max is 2000\n<state>...")
    assert err.code == "grammar_limit_exceeded" and err.param == "response_format"
    assert "max is 2000" in err.message and "<state>" not in err.message


# ---- reasoning: free until it ends, then the constraint --------------------------------------


class ForcesTokens:
    """A model that writes ``plan[i]`` as its i-th output token (opening or closing its
    reasoning) and is free otherwise; the grammar masks after it. A stand-in at the
    constraint seam for a reasoning model."""

    def __init__(self, grammar: Grammar | None, plan: dict[int, int]) -> None:
        self.grammar, self.plan = grammar, plan

    def processor(self, prompt_len: int):
        inner = self.grammar.processor(prompt_len) if self.grammar else None

        def force(tokens, logits):
            at = tokens.shape[0] - prompt_len
            if at in self.plan:
                logits = mx.where(mx.arange(logits.shape[-1]) == self.plan[at], logits, -mx.inf)
            return inner(tokens, logits) if inner else logits

        return Wrapped(inner, force)


def test_model_that_does_not_reason_answers_at_once(marker_engine):
    text, last = generate(marker_engine, JsonSchema(TICKET), sampling=HOT, reasoning=Reasoning("<think>", "</think>"))
    assert last.finish_reason == "stop"
    jsonschema.validate(json.loads(text), TICKET)


@pytest.mark.parametrize("started", [False, True], ids=["model-opens", "template-opened"])
def test_reasoning_is_free_and_the_answer_constrained(marker_engine, started):
    tok = marker_engine.tokenizer
    open_id, close_id = tok.convert_tokens_to_ids(["<think>", "</think>"])
    ask = prompt(marker_engine, "Think, then fill in the form.") + ([open_id] if started else [])
    plan = {4: close_id} if started else {0: open_id, 5: close_id}
    reasoning = Reasoning("<think>", "</think>", started=started)
    grammar = compiler_for(tok).compile(JsonSchema(TICKET), reasoning)
    text, last = asyncio.run(run(marker_engine, GenerationRequest(
        TokenPrompt(ask), max_tokens=200, constraint=ForcesTokens(grammar, plan))))
    free, _ = asyncio.run(run(marker_engine, GenerationRequest(TokenPrompt(ask), max_tokens=6,
                                                                 constraint=ForcesTokens(None, plan))))
    assert last.finish_reason == "stop", text
    thought, answer = text.split("</think>")
    assert thought == free.split("</think>")[0]  # the grammar left the reasoning alone
    jsonschema.validate(json.loads(answer), TICKET)


def test_reasoning_with_text_markers(engine):
    """Markers that are plain text (the demo tokenizer has no <think> token)."""
    tok = engine.tokenizer
    close = tok.encode("</think>", add_special_tokens=False)
    ask = prompt(engine, "Think, then fill in the form.<think>")
    plan = {3 + i: t for i, t in enumerate(close)}
    grammar = compiler_for(tok).compile(JsonSchema(TICKET), Reasoning("<think>", "</think>", started=True))
    text, last = asyncio.run(run(engine, GenerationRequest(TokenPrompt(ask), max_tokens=200,
                                                           constraint=ForcesTokens(grammar, plan))))
    assert last.finish_reason == "stop", text
    jsonschema.validate(json.loads(text.split("</think>", 1)[1]), TICKET)


def test_reasoning_cannot_end_the_output(marker_engine):
    tok = marker_engine.tokenizer
    grammar = compiler_for(tok).compile(JsonObject(), Reasoning("<think>", "</think>", started=True))
    allowed = allowed_after(grammar, tok, "some thoughts")
    assert not allowed & set(tok.eos_token_ids)
    assert tok.convert_tokens_to_ids("</think>") in allowed and len(allowed) > 40000
