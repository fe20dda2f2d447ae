"""The typed internal request: what every wire format parses into.

Chat completions, text completions, AG-UI, Responses and Anthropic Messages are
five ways to ask for the same thing. Each adapter in ``app/api`` turns its body
into a ``ChatRequest`` (or ``TextRequest``) of these plain, frozen types; the
pipeline, the vision proxy and the prompt renderer only ever see these.

The conversation's own types (``Message``, its parts, ``ToolCall``) live in
``app.messages``, below the pipeline and vision both, and are re-exported here.
``param`` fields name where a thing sits in the client's own request
(``messages[1].content[0]``), so errors can point at it. Embeddings and rerank
requests are typed too: ``EmbedRequest.of`` / ``RerankRequest.of`` read the
client's JSON into texts and token ids (``EncoderInputs``), refusing a bad shape
with a 400 naming the item, so the engine never sees raw JSON.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Literal

from app.engine import EncoderInput, EncoderInputs, TokenIds
from app.errors import InvalidRequestError
from app.messages import CacheMark, ImagePart, Message, Part, Role, TextPart, ToolCall, merge_turns

__all__ = ["CacheMark", "ChatRequest", "EmbedRequest", "EncoderInputs", "ImagePart", "Message", "Options",
           "OutputFormat", "Part", "Priority", "RerankRequest", "Role", "Sampling", "Speculation", "TextPart",
           "TextRequest", "Tool", "ToolCall", "ToolChoice", "merge_turns"]

Priority = Literal["interactive", "background"]
# A salt is a tenant's name or a random token, not a document.
CACHE_SALT_MAX_CHARS = 256


@dataclass(frozen=True)
class Tool:
    """A function the model may call."""

    name: str
    description: str | None = None
    # JSON schema of the arguments object.
    parameters: dict[str, Any] = field(default_factory=lambda: {"type": "object", "properties": {}})
    strict: bool = False
    # A prompt-cache breakpoint after this tool's definition (Anthropic's ``cache_control``).
    cache: CacheMark | None = None

    def as_dict(self) -> dict[str, Any]:
        """OpenAI's ``tools[]`` item, as chat templates take it: with a description always
        ("" when the client sent none), since templates read it unguarded (gpt-oss's,
        Apertus's, Functionary's would refuse the tool)."""
        function = {"name": self.name, "description": self.description or "", "parameters": self.parameters}
        return {"type": "function", "function": function}


@dataclass(frozen=True)
class ToolChoice:
    """Whether and which tool the model must call."""

    mode: Literal["auto", "none", "required", "named"] = "auto"
    # The one function to call, when mode is "named".
    name: str | None = None


@dataclass(frozen=True)
class OutputFormat:
    """What shape the answer text must take (``response_format``, ``text.format``)."""

    kind: Literal["text", "json_object", "json_schema"] = "text"
    schema: dict[str, Any] | None = None
    name: str | None = None
    strict: bool = False
    # Where the format sits in the client's request, for errors.
    param: str = "response_format"


@dataclass(frozen=True)
class Sampling:
    """A request's sampling choices; None takes the model's default."""

    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    repetition_penalty: float | None = None
    seed: int | None = None
    # Token id -> bias added to its logit (OpenAI's logit_bias, -100..100).
    logit_bias: tuple[tuple[int, float], ...] = ()


@dataclass(frozen=True)
class Speculation:
    """What one request asks of speculative decoding (``app.engine.speculative``): proposals
    only change how fast the answer comes, never what it is."""

    # OpenAI's Predicted Outputs: text the answer is expected to repeat, proposed where the
    # output so far matches it (None: no prediction).
    prediction: str | None = None
    # Tandem extension: switch the model's drafters off (or on) for this request; None keeps
    # its models.yaml ``speculative`` setting.
    prompt_lookup: bool | None = None
    draft: bool | None = None


@dataclass(frozen=True)
class Options:
    """What any generation request may set, whatever its prompt."""

    model: str
    sampling: Sampling = Sampling()
    # The client's explicit completion limit; None takes the model's default (capped to the context).
    max_tokens: int | None = None
    # Where max_tokens came from in the client's request, for errors.
    max_tokens_param: str = "max_tokens"
    stop: tuple[str, ...] = ()
    # "background" work (titles, tags, follow-ups) yields to interactive requests.
    priority: Priority = "interactive"
    # vLLM's cache_salt, taken as a body field by every format (Anthropic's API has none):
    # prefixes with different salts never share KV. The pipeline's ``cache_namespace`` is the
    # one place that turns it (and the API key) into the prefix cache's scope.
    cache_salt: str | None = None
    # OpenAI's prompt_cache_key: scopes the prefix cache as cache_salt does (both may be given).
    prompt_cache_key: str | None = None
    # OpenAI's prompt_cache_options.mode: "implicit" (True, the default) lets the prefix cache keep
    # what it chooses besides the request's breakpoints; "explicit" (False) asks for the
    # breakpoints alone (``GenerationRequest.cache_implicit``).
    cache_implicit: bool = True
    # Choices to generate from the one prompt (its KV computed once and shared).
    n: int = 1
    # Per generated token: its logprob and this many most likely alternatives (None: none).
    logprobs: int | None = None
    # Tandem extension: captions, warnings, parser chunks and the exact prompt in the answer.
    extensions: bool = False
    speculation: Speculation = Speculation()

    def __post_init__(self) -> None:
        for name in ("cache_salt", "prompt_cache_key"):
            value = getattr(self, name)
            if value is not None and len(value) > CACHE_SALT_MAX_CHARS:
                raise InvalidRequestError(f"{name}: at most {CACHE_SALT_MAX_CHARS} characters", param=name)


@dataclass(frozen=True)
class ChatRequest:
    """A conversation to continue."""

    options: Options
    messages: tuple[Message, ...]
    tools: tuple[Tool, ...] = ()
    tool_choice: ToolChoice = ToolChoice()
    # Several calls in one answer: True / False as the client said, None when it did not say
    # (allowed, except under a named tool_choice: app.pipeline.constraining).
    parallel_tool_calls: bool | None = None
    output: OutputFormat = OutputFormat()
    # True / False switch the model's reasoning; None takes the model's default.
    thinking: bool | None = None
    # How much to reason: an effort level (minimal, low, medium, high; xhigh and max read as
    # high) looked up in the model's reasoning_budgets, or a budget in tokens, which wins.
    # Neither: the model reasons as long as it does, within max_tokens.
    reasoning_effort: str | None = None
    reasoning_budget: int | None = None
    # Where the messages sit in the client's request ("messages", "input"), for errors.
    messages_param: str = "messages"

    def texts(self) -> list[str]:
        """Every text that reaches the chat template: message text, tool-call names and
        arguments, tool names, descriptions and schemas. The prompt-size pre-check counts them."""
        out: list[str] = []
        for m in self.messages:
            out += [p.text for p in m.content if isinstance(p, TextPart)]
            out += [t for tc in m.tool_calls for t in (tc.name, tc.arguments)]
            if m.reasoning:
                out.append(m.reasoning)
        for tool in self.tools:
            out += [tool.name, tool.description or "", json.dumps(tool.parameters)]
        if self.output.schema is not None:
            out.append(json.dumps(self.output.schema))
        return out


@dataclass(frozen=True)
class TextRequest:
    """Plain text to continue (``/v1/completions``)."""

    options: Options
    prompt: str
    echo: bool = False


@dataclass(frozen=True)
class EmbedRequest:
    """Vectors of ``input`` from an embedding model (/v1/embeddings)."""

    model: str
    # Texts and token ids, in order (OpenAI's ``input``; ``EmbedRequest.of`` reads it).
    input: EncoderInputs
    # Cut inputs longer than the model takes instead of refusing them (TEI's ``truncate``);
    # None: the model's models.yaml ``truncate``.
    truncate: bool | None = None
    # The vector size asked for; only the model's own is served.
    dimensions: int | None = None

    @classmethod
    def of(cls, model: str, raw: object, *, truncate: bool | None = None,
           dimensions: int | None = None) -> EmbedRequest:
        """The request for OpenAI's ``input`` as the client sent it (a string, strings, token ids,
        or lists of token ids; see ``encoder_inputs``); a bad shape is a 400 naming the item."""
        return cls(model, encoder_inputs(raw), truncate=truncate, dimensions=dimensions)


@dataclass(frozen=True)
class RerankRequest:
    """Relevance of each document to ``query`` (/v1/rerank)."""

    model: str
    query: str
    documents: tuple[str, ...]
    # As ``EmbedRequest.truncate``.
    truncate: bool | None = None

    @classmethod
    def of(cls, model: str, query: object, documents: object, *, truncate: bool | None = None) -> RerankRequest:
        """The request for a query and documents as the client sent them: a non-empty string,
        and a non-empty list of them; a bad one is a 400 naming it."""
        return cls(model, _text(query, "query"), _texts(documents, "documents"), truncate=truncate)


# ---- encoder inputs: the client's JSON -> typed, shape errors named by item -----------------------


def encoder_inputs(raw: object, param: str = "input") -> EncoderInputs:
    """OpenAI's embeddings ``input`` as typed inputs: ``"text"``, ``["a", "b"]``, one input as
    token ids ``[101, 2023, 102]``, or several ``[[101, 102], [101, 7592]]`` (strings and id
    lists may mix). Whether ids are in the vocabulary, and how many inputs fit, is the
    model's to check (``app/engine/models/encoder_inputs.py``)."""
    # A string, or a flat list of ints (token ids), is one input.
    bare = isinstance(raw, str) or (isinstance(raw, (list, tuple)) and bool(raw) and all(map(_is_token, raw)))
    if bare:
        items: list[object] = [list(raw) if isinstance(raw, (list, tuple)) else raw]
    elif isinstance(raw, (list, tuple)):
        items = list(raw)
    else:
        raise InvalidRequestError(
            f"{param} must be a string, a list of strings, or a list of token-id lists", param=param
        )
    if not items:
        raise InvalidRequestError(f"{param} must not be empty", param=param)
    out: list[EncoderInput] = []
    for i, item in enumerate(items):
        where = param if bare else f"{param}[{i}]"
        if isinstance(item, str):
            out.append(_text(item, where))
        elif isinstance(item, (list, tuple)):
            out.append(_token_ids(item, where))
        elif item is None:
            raise InvalidRequestError(f"{where} is null", param=param)
        else:
            raise InvalidRequestError(f"{where} must be a string or a list of token ids", param=param)
    return EncoderInputs(tuple(out), param, bare=bare)


def _texts(raw: object, param: str) -> tuple[str, ...]:
    """``raw`` as a non-empty list of non-empty strings (rerank ``documents``)."""
    if not isinstance(raw, (list, tuple)):
        raise InvalidRequestError(f"{param} must be a list of strings", param=param)
    if not raw:
        raise InvalidRequestError(f"{param} must not be empty", param=param)
    for i, item in enumerate(raw):
        if not isinstance(item, str):
            what = "null" if item is None else "not a string"
            raise InvalidRequestError(f"{param}[{i}] is {what}", param=param)
        _text(item, f"{param}[{i}]")
    return tuple(raw)


def _text(value: object, where: str) -> str:
    """``value`` if it is a non-empty string."""
    param = where.split("[", 1)[0]
    if value is None:
        raise InvalidRequestError(f"{where} is null", param=param)
    if not isinstance(value, str):
        raise InvalidRequestError(f"{where} must be a string", param=param)
    if not value:
        raise InvalidRequestError(f"{where} is an empty string", param=param)
    return value


def _is_token(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _token_ids(item: list[object] | tuple[object, ...], where: str) -> TokenIds:
    """``item`` as token ids: a non-empty list of integers (the model checks its vocabulary)."""
    param = where.split("[", 1)[0]
    if not item:
        raise InvalidRequestError(f"{where} is an empty list of token ids", param=param)
    ids: list[int] = []
    for j, token in enumerate(item):
        if not isinstance(token, int) or isinstance(token, bool):
            raise InvalidRequestError(f"{where}[{j}] = {token!r} is not a token id (a whole number)", param=param)
        ids.append(token)
    return tuple(ids)
