"""Constrained decoding: llguidance grammars, applied per sequence inside the continuous batch.

    request path (any thread)                       MLX thread, each decode step
    compiler_for(tokenizer)          once per tokenizer (~0.5 s)
    .compile(spec, reasoning) -> Grammar            checked and cached; an invalid
                                                    schema is a 400 here, before any model time
    GenerationRequest(constraint=grammar)
        engine: grammar.processor(len(prompt))  ->  GrammarProcessor(context, logits) -> logits

The processor reads the tokens generated since its last call from the context
(by length, so a sequence paused and re-inserted with its tokens catches up),
advances its matcher, and sets every token the grammar does not allow to -inf;
once the grammar is complete only EOS is left. Why llguidance and not
xgrammar: ``scripts/bench_grammar.py`` (numbers in its docstring).
"""

from __future__ import annotations

import logging
import threading
import weakref
from collections import OrderedDict
from typing import Any

import llguidance
import llguidance.hf
import mlx.core as mx
import numpy as np

from app.engine.constraints import (
    Constraint,
    JsonSchema,
    Reasoning,
    ToolCalls,
    arguments_schema,
    json_item,
    to_lark,
)
from app.errors import InvalidRequestError

log = logging.getLogger("tandem.engine")

# Compiled grammars kept per tokenizer: an agent sends the same schema or tools every turn.
GRAMMAR_CACHE_SIZE = 64
# Long llguidance errors (with grammar context) are cut to this in the 400 message.
_MAX_ERROR_CHARS = 600


# Row b: the logit biases (0 allowed, -inf not) of the 8 tokens whose bits make mask byte b.
_BYTE_BIAS = np.where(
    np.unpackbits(np.arange(256, dtype=np.uint8)[:, None], axis=1, bitorder="little") == 1,
    np.float32(0), np.float32(-np.inf),
).astype(np.float32)


class GrammarProcessor:
    """One sequence's grammar state; an mlx-lm logits processor ``(context, logits) -> logits``.

    ``context`` holds the prompt and every token generated so far, the last one
    just fed to the model. Never raises (an exception would fail the whole
    batch): a matcher in error allows only EOS and keeps the reason in ``error``.
    """

    def __init__(
        self,
        matcher: llguidance.LLMatcher,
        vocab_size: int,
        eos: list[int],
        prompt_len: int,
        live: weakref.WeakSet[GrammarProcessor] | None = None,
    ) -> None:
        self._matcher = matcher
        self._bitmask = np.zeros((vocab_size + 31) // 32, dtype=np.int32)
        self._bias = np.empty((self._bitmask.nbytes, 8), dtype=np.float32)
        self._vocab_size = vocab_size
        self._eos = eos
        self._start = prompt_len
        self._fed = 0
        self._ended = False
        self.error: str | None = None
        # The processors of one model that are in flight (dropped ones leave by themselves).
        self._live = live if live is not None else weakref.WeakSet()
        self._live.add(self)

    def __call__(self, tokens: mx.array, logits: mx.array) -> mx.array:
        self._catch_up(tokens)
        if self._ended:
            self._live.discard(self)
            return logits
        if len(self._live) == 1:
            # Alone: the forward pass runs while the mask is computed. Not with others in
            # the batch: their token reads would queue behind it on the one stream.
            mx.async_eval(logits)
        # An added bias: mx.where costs several times more on the CPU backend.
        return logits + mx.array(self._logit_bias(logits.shape[-1]), dtype=logits.dtype)

    def _catch_up(self, tokens: mx.array) -> None:
        """Feed the matcher what was generated since the last call, or roll it back."""
        generated = tokens.shape[0] - self._start
        if generated > self._fed and not self._ended:
            new: list[int] = tokens[self._start + self._fed :].tolist()  # type: ignore[assignment]
            # The batch runs one step past a sequence's EOS before it sees the EOS;
            # that step's mask is thrown away, so the matcher is not fed it.
            cut = next((i for i, t in enumerate(new) if t in self._eos), None)
            self._ended = cut is not None
            self._matcher.consume_tokens(new[:cut])
        elif generated < self._fed:
            self._matcher.rollback(self._fed - generated)
        self._fed = generated

    def _logit_bias(self, width: int) -> np.ndarray:
        """0 for each token the grammar allows next, -inf for the others; ids past the
        tokenizer's vocabulary (the model's padding) are never allowed."""
        if not self._matcher.is_error():
            self._matcher.unsafe_compute_mask_ptr(self._bitmask.ctypes.data, self._bitmask.nbytes)
        if self._matcher.is_error():
            if self.error is None:
                self.error = self._matcher.get_error()
                log.warning("constrained generation ended early: %s", self.error)
            bias = np.full(width, -np.inf, dtype=np.float32)
            bias[[t for t in self._eos if t < width]] = 0
            return bias[None]
        np.take(_BYTE_BIAS, self._bitmask.view(np.uint8), axis=0, out=self._bias)
        bias = self._bias.reshape(-1)
        bias[self._vocab_size :] = -np.inf
        if width > bias.size:
            bias = np.concatenate([bias, np.full(width - bias.size, -np.inf, dtype=np.float32)])
        return bias[None, :width]


class Grammar:
    """A compiled, checked grammar for one tokenizer; shared by the requests that use it."""

    def __init__(self, compiler: GrammarCompiler, matcher: llguidance.LLMatcher, lark: str) -> None:
        self._compiler = compiler
        self._matcher = matcher
        self._lock = threading.Lock()
        self.lark = lark

    def processor(self, prompt_len: int) -> GrammarProcessor:
        """A fresh processor for one sequence whose first ``prompt_len`` context tokens are prompt."""
        with self._lock:
            matcher = self._matcher.deep_copy()
        c = self._compiler
        return GrammarProcessor(matcher, c.lltok.vocab_size, c.eos, prompt_len, c.live)


class GrammarCompiler:
    """Compiles constraints for one tokenizer (an mlx-lm ``TokenizerWrapper`` or a fast HF tokenizer)."""

    def __init__(self, tokenizer: Any) -> None:
        hf = getattr(tokenizer, "_tokenizer", tokenizer)
        self.eos = sorted(getattr(tokenizer, "eos_token_ids", None) or [hf.eos_token_id])
        self.lltok = llguidance.hf.from_tokenizer(hf, eos_token=self.eos)
        self._special = {
            added.content: tid for tid, added in hf.added_tokens_decoder.items()
            if tid < self.lltok.vocab_size and self.lltok.is_special_token(tid)
        }
        self._cache: OrderedDict[str, Grammar] = OrderedDict()
        self._lock = threading.Lock()
        self.live: weakref.WeakSet[GrammarProcessor] = weakref.WeakSet()

    def compile(self, spec: Constraint, reasoning: Reasoning | None = None) -> Grammar:
        """The grammar for ``spec`` (after optional ``reasoning``); ``InvalidRequestError`` if it cannot be."""
        _check_shapes(spec)
        try:
            lark = to_lark(spec, reasoning, self._special.get, list(self._special), self.eos)
        except (TypeError, ValueError) as exc:  # a schema json.dumps cannot write
            raise _rejection(spec, str(exc)) from exc
        with self._lock:
            grammar = self._cache.get(lark)
            if grammar is not None:
                self._cache.move_to_end(lark)
                return grammar
        matcher = llguidance.LLMatcher(self.lltok, llguidance.LLMatcher.grammar_from_lark(lark), log_level=0)
        if matcher.is_error():
            raise _rejection(spec, matcher.get_error())
        for warning in matcher.get_grammar_warnings():
            log.debug("grammar warning: %s", warning)
        grammar = Grammar(self, matcher, lark)
        with self._lock:
            self._cache[lark] = grammar
            while len(self._cache) > GRAMMAR_CACHE_SIZE:
                self._cache.popitem(last=False)
        return grammar


def _check_shapes(spec: Constraint) -> None:
    """Schemas must be JSON objects (llguidance would take a list for a schema)."""
    answer = spec.answer if isinstance(spec, ToolCalls) else spec
    if isinstance(answer, JsonSchema) and not isinstance(answer.schema, dict):
        raise InvalidRequestError("the JSON schema must be a JSON object", param="response_format")
    for tool in spec.tools if isinstance(spec, ToolCalls) else ():
        if tool.parameters is not None and not isinstance(tool.parameters, dict):
            raise InvalidRequestError(f"tool {tool.name!r}: parameters must be a JSON object", param="tools")


def _rejection(spec: Constraint, error: str) -> InvalidRequestError:
    """The 400 for a grammar llguidance refused, naming the part of the request at fault."""
    if isinstance(spec, ToolCalls):
        for tool in spec.tools:
            lark = "start: " + json_item(arguments_schema(tool), tool.strict)
            problem = llguidance.LLMatcher.validate_grammar(llguidance.LLMatcher.grammar_from_lark(lark))
            if problem:
                return InvalidRequestError(_cut(f"tool {tool.name!r}: invalid parameters schema: {problem}"),
                                           param="tools")
        if spec.answer is None:
            return InvalidRequestError(_cut(f"cannot constrain tool calls: {error}"), param="tools")
    return InvalidRequestError(_cut(f"invalid JSON schema: {error}"), param="response_format")


def _cut(message: str) -> str:
    return message if len(message) <= _MAX_ERROR_CHARS else message[: _MAX_ERROR_CHARS - 3] + "..."


_compilers: weakref.WeakKeyDictionary[Any, GrammarCompiler] = weakref.WeakKeyDictionary()
_compilers_lock = threading.Lock()


def compiler_for(tokenizer: Any) -> GrammarCompiler:
    """The one compiler of ``tokenizer``, built on first use (about half a second for 49k tokens)."""
    with _compilers_lock:
        compiler = _compilers.get(tokenizer)
        if compiler is None:
            compiler = _compilers[tokenizer] = GrammarCompiler(tokenizer)
        return compiler
