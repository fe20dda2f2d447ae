"""The typed internal request: what every wire format parses into.

Chat completions, text completions, AG-UI, Responses and Anthropic Messages are
five ways to ask for the same thing. Each adapter in ``app/api`` turns its body
into a ``ChatRequest`` (or ``TextRequest``) of these plain, frozen types; the
pipeline, the vision proxy and the prompt renderer only ever see these.

The conversation's own types (``Message``, its parts, ``ToolCall``) live in
``app.messages``, below the pipeline and vision both, and are re-exported here.
``param`` fields name where a thing sits in the client's own request
(``messages[1].content[0]``), so errors can point at it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Literal

from app.errors import InvalidRequestError
from app.messages import ImagePart, Message, Part, Role, TextPart, ToolCall, merge_turns

__all__ = ["ChatRequest", "EmbedRequest", "ImagePart", "JsonValue", "Message", "Options", "OutputFormat", "Part",
           "Priority", "RerankRequest", "Role", "Sampling", "TextPart", "TextRequest", "Tool", "ToolCall", "ToolChoice",
           "merge_turns"]

Priority = Literal["interactive", "background"]
# A JSON value as the client sent it: encoder inputs are checked item by item by the
# encoder (``app/engine/models/encoder_inputs.py``), so a 400 names the item that is wrong.
JsonValue = str | int | float | bool | None | list["JsonValue"] | dict[str, "JsonValue"]
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

    def as_dict(self) -> dict[str, Any]:
        """OpenAI's ``tools[]`` item, as chat templates take it."""
        function: dict[str, Any] = {"name": self.name, "parameters": self.parameters}
        if self.description is not None:
            function = {"name": self.name, "description": self.description, "parameters": self.parameters}
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
    # Choices to generate from the one prompt (its KV computed once and shared).
    n: int = 1
    # Per generated token: its logprob and this many most likely alternatives (None: none).
    logprobs: int | None = None
    # Tandem extension: captions, warnings, parser chunks and the exact prompt in the answer.
    extensions: bool = False

    def __post_init__(self) -> None:
        if self.cache_salt is not None and len(self.cache_salt) > CACHE_SALT_MAX_CHARS:
            raise InvalidRequestError(f"cache_salt: at most {CACHE_SALT_MAX_CHARS} characters", param="cache_salt")


@dataclass(frozen=True)
class ChatRequest:
    """A conversation to continue."""

    options: Options
    messages: tuple[Message, ...]
    tools: tuple[Tool, ...] = ()
    tool_choice: ToolChoice = ToolChoice()
    parallel_tool_calls: bool = True
    output: OutputFormat = OutputFormat()
    # True / False switch the model's reasoning; None takes the model's default.
    thinking: bool | None = None
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
    # A string, strings, token ids, or lists of token ids (OpenAI's ``input``).
    input: JsonValue
    # Cut inputs longer than the model takes instead of refusing them (TEI's ``truncate``).
    truncate: bool = False
    # The vector size asked for; only the model's own is served.
    dimensions: int | None = None


@dataclass(frozen=True)
class RerankRequest:
    """Relevance of each document to ``query`` (/v1/rerank)."""

    model: str
    query: JsonValue
    documents: tuple[JsonValue, ...]
    truncate: bool = False
