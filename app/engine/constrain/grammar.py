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

llguidance builds its lexer lazily, so a schema can compile and still hit one of
its limits while generating: a pattern whose automaton explodes
(``^(.*a.{15})|(.*b.{15})|(.*c.{15})$``: "too many expressions constructed") or an
``anyOf`` wider than a parser row ("max is 2000"). A limit met while compiling is a
400 ``grammar_limit_exceeded`` from ``compile``. One met while generating: the
processor allows only EOS and reports it, and the engine ends that choice with the
same 400 (the schema is the request's and the same request fails the same way, so
not a 5xx to retry; once a stream has started, its error event), never a normal
stop with half a JSON value.
"""

from __future__ import annotations

import logging
import threading
import weakref
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Any

import llguidance
import llguidance.hf
import mlx.core as mx
import numpy as np
import transformers

from app.engine.constrain.constraints import (
    Constraint,
    JsonSchema,
    Reasoning,
    ToolCalls,
    arguments_schema,
    json_item,
    to_lark,
)
from app.errors import AppError, EngineError, InvalidRequestError

log = logging.getLogger("tandem.engine")

# Compiled grammars kept per tokenizer: an agent sends the same schema or tools every turn.
GRAMMAR_CACHE_SIZE = 64
# Long llguidance errors (with grammar context) are cut to this in the 400 message.
_MAX_ERROR_CHARS = 600
# How llguidance words a resource limit (lexer states and expressions, fuel, row width,
# grammar size), as opposed to a schema it cannot read.
_LIMIT_WORDS = ("too many", "too big", "fuel", "max is", "limit")


# Row b: the logit biases (0 allowed, -inf not) of the 8 tokens whose bits make mask byte b.
_BYTE_BIAS = np.where(
    np.unpackbits(np.arange(256, dtype=np.uint8)[:, None], axis=1, bitorder="little") == 1,
    np.float32(0), np.float32(-np.inf),
).astype(np.float32)


class GrammarProcessor:
    """One sequence's grammar state; an mlx-lm logits processor ``(context, logits) -> logits``.

    ``context`` holds the prompt and every token generated so far, the last one
    just fed to the model. Never raises (an exception would fail the whole
    batch): a matcher in error allows only EOS, keeps the reason in ``error``,
    and ``failure()`` turns it into the error that ends the sequence.
    """

    def __init__(
        self,
        matcher: llguidance.LLMatcher,
        vocab_size: int,
        eos: list[int],
        prompt_len: int,
        live: weakref.WeakSet[GrammarProcessor] | None = None,
        subject: str = "the JSON schema",
        on_limit: Callable[[str], None] | None = None,
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
        self._failed_at = 0
        self._subject = subject
        self._on_limit = on_limit
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

    def allowed(self, tokens: Sequence[int], draft: Sequence[int]) -> int:
        """How many of ``draft``'s tokens the grammar accepts after ``tokens`` (the row's
        context, its last token not yet fed): the speculative verify step cuts a proposal
        there, so the matcher is never fed a token it refuses. EOS is never proposed."""
        if self._ended or self.error is not None:
            return 0
        pending = list(tokens[self._start + self._fed:])
        cut = next((i for i, t in enumerate(draft) if t in self._eos), len(draft))
        if any(t in self._eos for t in pending) or not cut:
            return 0
        return max(0, self._matcher.validate_tokens(pending + list(draft[:cut])) - len(pending))

    def rewind(self, context_len: int) -> None:
        """The row's context is now ``context_len`` tokens (a verify step rejected the
        rest of what it fed): the matcher gives back what it consumed beyond them."""
        generated = context_len - self._start
        if generated < self._fed and not self._ended:
            self._matcher.rollback(self._fed - generated)
            self._fed = generated

    def _logit_bias(self, width: int) -> np.ndarray:
        """0 for each token the grammar allows next, -inf for the others; ids past the
        tokenizer's vocabulary (the model's padding) are never allowed."""
        if not self._matcher.is_error():
            self._matcher.unsafe_compute_mask_ptr(self._bitmask.ctypes.data, self._bitmask.nbytes)
        if self._matcher.is_error():
            if self.error is None:
                self.error = _first_line(self._matcher.get_error())
                self._failed_at = self._fed
                log.warning("constrained generation failed after %d tokens: %s", self._fed, self.error)
                if self._on_limit is not None and _is_limit(self.error):
                    self._on_limit(self.error)
            bias = np.full(width, -np.inf, dtype=np.float32)
            bias[[t for t in self._eos if t < width]] = 0
            return bias[None]
        np.take(_BYTE_BIAS, self._bitmask.view(np.uint8), axis=0, out=self._bias)
        bias = self._bias.reshape(-1)
        bias[self._vocab_size :] = -np.inf
        if width > bias.size:
            bias = np.concatenate([bias, np.full(width - bias.size, -np.inf, dtype=np.float32)])
        return bias[None, :width]

    def failure(self) -> AppError | None:
        """The error that ends this sequence once its matcher failed: a 400 naming the
        schema's limit, or (a token outside the grammar: a bug here) a generation error."""
        if self.error is None:
            return None
        if _is_limit(self.error):
            return InvalidRequestError(
                _cut(f"{self._subject} is beyond the grammar engine's limits (generation stopped after "
                     f"{self._failed_at} tokens: {self.error}); simplify it, e.g. fewer alternatives or "
                     "simpler patterns"), code="grammar_limit_exceeded")
        return EngineError(_cut(f"constrained generation failed: {self.error}"))


class Grammar:
    """A compiled, checked grammar for one tokenizer; shared by the requests that use it."""

    def __init__(self, compiler: GrammarCompiler, matcher: llguidance.LLMatcher, lark: str,
                 subject: str = "the JSON schema") -> None:
        self._compiler = compiler
        self._matcher = matcher
        self._lock = threading.Lock()
        self.lark = lark
        # What the client wrote that this grammar enforces, for errors.
        self.subject = subject
        # The limit a generation hit. The lexer is shared by every copy of the matcher, so
        # once it is out of room the next request would fail at once: it is refused instead.
        self.limit_hit: str | None = None

    def processor(self, prompt_len: int) -> GrammarProcessor:
        """A fresh processor for one sequence whose first ``prompt_len`` context tokens are prompt."""
        with self._lock:
            matcher = self._matcher.deep_copy()
        c = self._compiler
        return GrammarProcessor(matcher, c.lltok.vocab_size, c.eos, prompt_len, c.live, self.subject,
                                self._limit_hit)

    def _limit_hit(self, error: str) -> None:
        self.limit_hit = error


class GrammarCompiler:
    """Compiles constraints for one tokenizer (an mlx-lm ``TokenizerWrapper``, or a fast HF tokenizer
    such as a native VLM's)."""

    def __init__(self, tokenizer: Any) -> None:
        # mlx-lm's TokenizerWrapper holds the fast tokenizer in ``_tokenizer``; a transformers
        # tokenizer (a VLM processor's) is one, and its own ``_tokenizer`` is the Rust one below.
        hf = tokenizer if isinstance(tokenizer, transformers.PreTrainedTokenizerFast) else getattr(
            tokenizer, "_tokenizer", tokenizer)
        self.eos = eos_ids(tokenizer, hf)
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
        if grammar is not None:
            if grammar.limit_hit is not None:
                raise _rejection(spec, grammar.limit_hit)
            return grammar
        matcher = llguidance.LLMatcher(self.lltok, llguidance.LLMatcher.grammar_from_lark(lark), log_level=0)
        if matcher.is_error():
            raise _rejection(spec, matcher.get_error())
        for warning in matcher.get_grammar_warnings():
            log.debug("grammar warning: %s", warning)
        grammar = Grammar(self, matcher, lark, _subject(spec))
        with self._lock:
            self._cache[lark] = grammar
            while len(self._cache) > GRAMMAR_CACHE_SIZE:
                self._cache.popitem(last=False)
        return grammar


def eos_ids(tokenizer: Any, hf: Any) -> list[int]:
    """The tokens that end a generation, as a sorted list. mlx-lm's wrapper keeps a set in
    ``eos_token_ids``; an mlx-vlm processor's transformers tokenizer keeps one int there (the
    VLM engine stops on it and on more: a subset is what the grammar may offer)."""
    ids = getattr(tokenizer, "eos_token_ids", None)
    if ids is None or ids == []:
        ids = getattr(hf, "eos_token_id", None)
    found = [ids] if isinstance(ids, int) else list(ids or ())
    if not found or not all(isinstance(t, int) for t in found):
        raise EngineError("the tokenizer names no end-of-sequence token: output cannot be constrained")
    return sorted(set(found))


def _subject(spec: Constraint) -> str:
    """What the client wrote that ``spec`` enforces, as an error message names it."""
    if isinstance(spec, ToolCalls):
        return "the tools' parameter schemas" + (" or the response format" if spec.answer is not None else "")
    return "the JSON schema" if isinstance(spec, JsonSchema) else "the JSON object format"


def _first_line(error: str) -> str:
    """llguidance's message without the parser state it appends (which quotes the output)."""
    return error.strip().split("\n", 1)[0].strip()


def _is_limit(error: str) -> bool:
    return any(word in error.lower() for word in _LIMIT_WORDS)


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
    if _is_limit(error):
        param = "tools" if isinstance(spec, ToolCalls) and spec.answer is None else "response_format"
        return InvalidRequestError(_cut(f"{_subject(spec)} is beyond the grammar engine's limits "
                                        f"({_first_line(error)}); simplify it, e.g. fewer alternatives or "
                                        "simpler patterns"), param=param, code="grammar_limit_exceeded")
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
