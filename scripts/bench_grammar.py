#!/usr/bin/env python
"""Grammar engines for constrained decoding, measured on the demo model's vocabulary.

    .venv/bin/python scripts/bench_grammar.py          # llguidance, in the project's venv
    .venv/bin/python scripts/bench_grammar.py --tiny   # the decode cost on a fast random model

xgrammar pulls torch and CUDA wheels, so it is measured from a venv of its own
(the demo model's directory is what ``python -m app models prepare-demo`` prints):

    python -m venv /tmp/xgr && /tmp/xgr/bin/pip install "mlx[cpu]==0.32.4" mlx-lm==0.32.2 llguidance xgrammar
    /tmp/xgr/bin/python scripts/bench_grammar.py --model ~/.cache/tandem/models/smollm2-135m-instruct

For each engine: tokenizer setup time; per schema, compile time and time to
the first mask; mask time per token along a valid document; and decode
tokens/s in a real mlx-lm ``BatchGenerator`` on the demo model, constrained
over unconstrained, at 1 and 8 streams. Both engines run Tandem's own
``GrammarProcessor`` (xgrammar's matcher behind an adapter).
xgrammar is skipped when it is not importable.

``processor_us_per_token`` is the processor's own time once the previous token
is in; a sequence alone in the batch overlaps it with the forward pass.

Measured on the 2-core CPU dev box shared with other jobs (load 3-6; mlx[cpu]
0.32.4, SmolLM2-135M Q4, 49,152 tokens, llguidance 1.9.1, xgrammar 0.2.8),
2026-11-23, ``--runs 3 --max-tokens 32`` (medians):

    cold compile, ms           llguidance  xgrammar
    pydantic-ai output             1.3       783     (xgrammar: ~15 ms without the maxLength strings)
    tool call, nested args         1.4        29
    any JSON object                0.9        20
    mask per token p50 / p99, us
    pydantic-ai output          22 / 252    17 / 5057
    tool call                   12 / 84      2 / 62
    tokenizer setup, s             0.30      0.31
    decode constrained / free, demo model (wall, then CPU time; wall is noise-bound here)
    1 stream (187 ms/step)      1.33, 1.04  1.01, 0.98
    8 streams (1.55 s/step)     1.03, 1.00  0.91, 0.99

The demo model's steps dwarf any mask. ``--tiny`` (a 5 ms step on this box) shows the
cost where it is largest, llguidance, ``--max-tokens 200 --runs 7``: 0.92 at 1 stream,
0.83 at 8 (415 us per token, mostly the mask of a maxLength-bounded string).
Picked llguidance: compile times 15-600x shorter at equal mask times and decode cost,
no torch (xgrammar pulls torch and ~4 GB of CUDA wheels), and mlx-vlm already needs it.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import statistics
import sys
import time
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

import mlx.core as mx  # noqa: E402 - after the sys.path insert
import numpy as np  # noqa: E402 - after the sys.path insert

from app.engine.constrain.constraints import JSON_WHITESPACE, JsonSchema  # noqa: E402 - after the sys.path insert
from app.engine.constrain.grammar import GrammarCompiler, GrammarProcessor  # noqa: E402 - after the sys.path insert

# A pydantic-ai output type: enums in $defs, booleans, bounded strings, a list.
PYDANTIC_OUTPUT = {
    "$defs": {
        "Sentiment": {"enum": ["positive", "neutral", "negative"], "title": "Sentiment", "type": "string"},
        "Priority": {"enum": ["low", "medium", "high"], "title": "Priority", "type": "string"},
    },
    "properties": {
        "summary": {"maxLength": 120, "title": "Summary", "type": "string"},
        "sentiment": {"$ref": "#/$defs/Sentiment"},
        "priority": {"$ref": "#/$defs/Priority"},
        "needs_reply": {"title": "Needs Reply", "type": "boolean"},
        "topics": {"items": {"maxLength": 30, "type": "string"}, "maxItems": 5, "title": "Topics", "type": "array"},
        "confidence": {"maximum": 1, "minimum": 0, "title": "Confidence", "type": "number"},
    },
    "required": ["summary", "sentiment", "priority", "needs_reply", "topics", "confidence"],
    "title": "TicketTriage",
    "type": "object",
    "additionalProperties": False,
}
PYDANTIC_DOC = {
    "summary": "Customer cannot log in after the password reset email expired.",
    "sentiment": "negative", "priority": "high", "needs_reply": True,
    "topics": ["login", "password reset", "email"], "confidence": 0.87,
}
# A tool call whose arguments nest objects and arrays of objects.
TOOL_CALL = {
    "type": "object",
    "properties": {
        "name": {"const": "book_flight"},
        "arguments": {
            "type": "object",
            "properties": {
                "origin": {"type": "string", "pattern": "^[A-Z]{3}$"},
                "destination": {"type": "string", "pattern": "^[A-Z]{3}$"},
                "date": {"type": "string", "format": "date"},
                "cabin": {"enum": ["economy", "premium", "business", "first"]},
                "passengers": {
                    "type": "array", "minItems": 1, "maxItems": 9,
                    "items": {
                        "type": "object",
                        "properties": {
                            "name": {"type": "string"},
                            "age": {"type": "integer", "minimum": 0, "maximum": 120},
                            "bags": {"type": "integer", "minimum": 0, "maximum": 3},
                        },
                        "required": ["name", "age"],
                        "additionalProperties": False,
                    },
                },
                "flexible": {"type": "boolean"},
            },
            "required": ["origin", "destination", "date", "passengers"],
            "additionalProperties": False,
        },
    },
    "required": ["name", "arguments"],
    "additionalProperties": False,
}
TOOL_DOC = {
    "name": "book_flight",
    "arguments": {
        "origin": "CDG", "destination": "JFK", "date": "2025-03-14", "cabin": "economy",
        "passengers": [{"name": "Ada Lovelace", "age": 36, "bags": 1}, {"name": "Alan Turing", "age": 41}],
        "flexible": False,
    },
}
# For decode throughput: output that cannot be complete within the token budget,
# so every stream decodes the same number of tokens with and without the grammar.
LONG_LIST = {
    "type": "object",
    "properties": {"fruits": {"type": "array", "items": {"type": "string", "maxLength": 24}, "minItems": 200}},
    "required": ["fruits"],
}
SCHEMAS = {"pydantic_output": (PYDANTIC_OUTPUT, PYDANTIC_DOC), "tool_call": (TOOL_CALL, TOOL_DOC),
           "json_object": ({"type": "object"}, {"a": [1, 2, {"b": None}], "c": "d"})}


class Engine:
    """One grammar library behind the few calls the benchmark makes."""

    name = ""

    def setup(self, tokenizer: Any) -> None: ...
    def compile(self, schema: dict) -> Any: ...
    def matcher(self, compiled: Any) -> Any: ...
    def fill(self, matcher: Any, bitmask: np.ndarray) -> None: ...
    def consume(self, matcher: Any, tokens: list[int]) -> None: ...
    def processor(self, compiled: Any, prompt_len: int) -> Callable: ...


class Llguidance(Engine):
    name = "llguidance"

    def setup(self, tokenizer: Any) -> None:
        self.compiler = GrammarCompiler(tokenizer)

    def compile(self, schema: dict) -> Any:
        self.compiler._cache.clear()  # cold: measure the compile, not the cache
        return self.compiler.compile(JsonSchema(schema, strict=True))

    def matcher(self, compiled: Any) -> Any:
        return compiled._matcher.deep_copy()

    def fill(self, matcher: Any, bitmask: np.ndarray) -> None:
        matcher.unsafe_compute_mask_ptr(bitmask.ctypes.data, bitmask.nbytes)

    def consume(self, matcher: Any, tokens: list[int]) -> None:
        assert matcher.consume_tokens(tokens), matcher.get_error()

    def processor(self, compiled: Any, prompt_len: int) -> Callable:
        return compiled.processor(prompt_len)


class Xgrammar(Engine):
    name = "xgrammar"

    def setup(self, tokenizer: Any) -> None:
        import xgrammar as xgr

        self.xgr = xgr
        hf = tokenizer._tokenizer
        self.eos = sorted(tokenizer.eos_token_ids)
        self.info = xgr.TokenizerInfo.from_huggingface(hf, vocab_size=len(hf), stop_token_ids=self.eos)
        self.live: weakref.WeakSet = weakref.WeakSet()

    def compile(self, schema: dict) -> Any:
        # A fresh compiler without a cache: a cold compile. max_whitespace_cnt is the
        # nearest xgrammar has to Tandem's bounded JSON whitespace.
        compiler = self.xgr.GrammarCompiler(self.info, cache_enabled=False)
        return compiler.compile_json_schema(json.dumps(schema), any_whitespace=True, max_whitespace_cnt=33)

    def matcher(self, compiled: Any) -> Any:
        return self.xgr.GrammarMatcher(compiled)

    def fill(self, matcher: Any, bitmask: np.ndarray) -> None:
        matcher.fill_next_token_bitmask(bitmask.reshape(1, -1), 0)

    def consume(self, matcher: Any, tokens: list[int]) -> None:
        for t in tokens:
            assert matcher.accept_token(t)

    def processor(self, compiled: Any, prompt_len: int) -> Callable:
        return GrammarProcessor(_XgrammarMatcher(self.matcher(compiled)), self.info.vocab_size, self.eos, prompt_len,
                                self.live)


class _XgrammarMatcher:
    """An xgrammar matcher behind the llguidance calls ``GrammarProcessor`` makes, so both
    engines run the very same processor."""

    def __init__(self, matcher: Any) -> None:
        self.matcher = matcher

    def consume_tokens(self, tokens: list[int]) -> bool:
        return all(self.matcher.accept_token(t) for t in tokens)

    def rollback(self, n: int) -> None:
        self.matcher.rollback(n)

    def is_error(self) -> bool:
        return False

    def unsafe_compute_mask_ptr(self, pointer: int, nbytes: int) -> None:
        words = np.ctypeslib.as_array((ctypes.c_int32 * (nbytes // 4)).from_address(pointer))
        self.matcher.fill_next_token_bitmask(words.reshape(1, -1), 0)


def mask_times(engine: Engine, compiled: Any, tokens: list[int], vocab: int) -> list[float]:
    """Seconds per mask along ``tokens`` (plus the one after the last token)."""
    matcher = engine.matcher(compiled)
    bitmask = np.full((vocab + 31) // 32, -1, dtype=np.int32)
    out = []
    for t in [*tokens, None]:
        start = time.perf_counter()
        engine.fill(matcher, bitmask)
        out.append(time.perf_counter() - start)
        if t is not None:
            engine.consume(matcher, [t])
    return out


def decode(model: Any, prompts: list[list[int]], max_tokens: int, processors: list[list[Callable]]) -> dict:
    """One BatchGenerator run: tokens decoded after prefill, and the wall and CPU seconds they took."""
    from mlx_lm.generate import BatchGenerator

    bg = BatchGenerator(model, max_tokens=max_tokens, stop_tokens=None, completion_batch_size=len(prompts),
                        prefill_batch_size=len(prompts))
    bg.insert(prompts, max_tokens=[max_tokens] * len(prompts), logits_processors=processors)
    wall = cpu = 0.0
    count, live = 0, len(prompts)
    while live:
        _, gen = bg.next()
        if gen and not wall:  # the first tokens close prefill
            wall, cpu = time.perf_counter(), time.process_time()
        else:
            count += len(gen)
        live -= sum(r.finish_reason is not None for r in gen)
    bg.close()
    return {"tokens": count, "wall": time.perf_counter() - wall, "cpu": time.process_time() - cpu}


class _Timed:
    """A processor, timed once the previous step's token is in (a wait the batch pays anyway)."""

    def __init__(self, inner: Callable, spent: list[float]) -> None:
        self.inner, self.spent = inner, spent

    def __call__(self, tokens: mx.array, logits: mx.array) -> mx.array:
        mx.eval(tokens)
        start = time.perf_counter()
        out = self.inner(tokens, logits)
        self.spent.append(time.perf_counter() - start)
        return out


def decode_ratio(engine: Engine, compiled: Any, model: Any, prompts: list[list[int]], args: argparse.Namespace) -> dict:
    """Constrained over unconstrained decode tokens/s (wall and CPU time), runs interleaved so
    that other load on the machine hits both alike; and the processor's own time per token."""
    free, constrained = [], []
    for _ in range(args.runs):
        free.append(decode(model, prompts, args.max_tokens, [[] for _ in prompts]))
        procs = [[engine.processor(compiled, len(p))] for p in prompts]
        constrained.append(decode(model, prompts, args.max_tokens, procs))
        print(f"{engine.name} x{len(prompts)}: free {free[-1]}, constrained {constrained[-1]}", file=sys.stderr)
    spent: list[float] = []
    decode(model, prompts, args.max_tokens, [[_Timed(engine.processor(compiled, len(p)), spent)] for p in prompts])

    def tps(runs: list[dict], clock: str) -> float:
        return statistics.median(r["tokens"] / r[clock] for r in runs)

    return {
        "free_tps": round(tps(free, "wall"), 2), "constrained_tps": round(tps(constrained, "wall"), 2),
        "ratio": round(tps(constrained, "wall") / tps(free, "wall"), 3),
        "cpu_ratio": round(tps(constrained, "cpu") / tps(free, "cpu"), 3),
        "ms_per_step": round(statistics.median(r["wall"] * len(prompts) / r["tokens"] for r in free) * 1e3, 1),
        "processor_us_per_token": round(statistics.mean(spent) * 1e6, 1),
    }


def run_engine(engine: Engine, tokenizer: Any, model: Any, args: argparse.Namespace) -> dict:
    vocab = len(tokenizer._tokenizer)
    start = time.perf_counter()
    engine.setup(tokenizer)
    setup_s = time.perf_counter() - start
    result: dict[str, Any] = {"tokenizer_setup_s": round(setup_s, 3), "schemas": {}}
    for name, (schema, doc) in SCHEMAS.items():
        compiles, firsts = [], []
        for _ in range(args.runs):
            start = time.perf_counter()
            compiled = engine.compile(schema)
            compiles.append(time.perf_counter() - start)
            matcher = engine.matcher(compiled)
            bitmask = np.full((vocab + 31) // 32, -1, dtype=np.int32)
            start = time.perf_counter()
            engine.fill(matcher, bitmask)
            firsts.append(time.perf_counter() - start)
        tokens = tokenizer.encode(json.dumps(doc), add_special_tokens=False)
        masks = sorted(mask_times(engine, compiled, tokens, vocab))
        result["schemas"][name] = {
            "compile_ms": round(statistics.median(compiles) * 1e3, 2),
            "first_mask_ms": round(statistics.median(firsts) * 1e3, 2),
            "mask_us_p50": round(masks[len(masks) // 2] * 1e6, 1),
            "mask_us_p99": round(masks[int(len(masks) * 0.99)] * 1e6, 1),
            "mask_us_mean": round(statistics.mean(masks) * 1e6, 1),
            "doc_tokens": len(tokens),
        }
    print(f"{engine.name}: {json.dumps(result)}", file=sys.stderr, flush=True)
    compiled = engine.compile(LONG_LIST)
    for streams in args.streams:
        prompts = [tokenizer.apply_chat_template(
            [{"role": "user", "content": f"List {60 + i} fruit names as a JSON object with a 'fruits' array."}],
            add_generation_prompt=True) for i in range(streams)]
        result[f"decode_x{streams}"] = decode_ratio(engine, compiled, model, prompts, args)
    return result


def tiny_model(vocab: int) -> Any:
    """A seeded random llama (hidden 64, 2 layers), as tests/conftest.py's ``tiny_model_dir``."""
    from mlx_lm.models import llama

    mx.random.seed(0)
    model = llama.Model(llama.ModelArgs.from_dict({
        "model_type": "llama", "hidden_size": 64, "num_hidden_layers": 2, "intermediate_size": 128,
        "num_attention_heads": 4, "num_key_value_heads": 2, "rms_norm_eps": 1e-5, "vocab_size": vocab,
        "rope_theta": 10000.0, "max_position_embeddings": 2048, "tie_word_embeddings": True,
    }))
    mx.eval(model.parameters())
    return model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="model directory (default: the embedded demo model)")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--streams", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--tiny", action="store_true",
                        help="decode on a seeded random 2-layer model with the same tokenizer: a step of a few ms, "
                             "where the grammar's cost per token shows most")
    parser.add_argument("--engines", nargs="+", default=["llguidance", "xgrammar"])
    args = parser.parse_args()
    if args.model is None:
        from app.engine.models.demo_model import ensure_demo_model

        args.model = str(ensure_demo_model(progress=False))
    from mlx_lm import load

    model, tokenizer = load(args.model)
    if args.tiny:
        model = tiny_model(len(tokenizer._tokenizer))
    engines: list[Engine] = [Llguidance()] if "llguidance" in args.engines else []
    if "xgrammar" in args.engines:
        try:
            import xgrammar  # noqa: F401

            engines.append(Xgrammar())
        except ImportError:
            print("xgrammar is not installed here: measuring llguidance only", file=sys.stderr)
    results = {e.name: run_engine(e, tokenizer, model, args) for e in engines}
    print(json.dumps({"model": "tiny" if args.tiny else args.model, "vocab": len(tokenizer._tokenizer),
                      "max_tokens": args.max_tokens,
                      "runs": args.runs, "json_whitespace": JSON_WHITESPACE, "results": results}, indent=2))


if __name__ == "__main__":
    main()
