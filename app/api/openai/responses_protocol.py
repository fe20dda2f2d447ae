"""OpenAI's Responses API request (pydantic, validated at the edge) and its typed request.

``input`` is a string or a list of items; each becomes a typed message:

    message (user)                    user turn: input_text -> text, input_image -> the vision path
    message (system, developer)       system turn (``instructions`` is one too, first)
    reasoning, message (assistant),   one assistant turn, folded together as the model wrote them:
      function_call                     reasoning, text, tool calls
    function_call_output              tool turn answering ``call_id``

Tools: ``function`` tools, and the function tools inside a ``namespace`` tool (the
model sees them as ``<namespace>__<name>``, and calls come back split into
``namespace`` and ``name``). Every other tool type (``web_search``, ``custom``,
``file_search``, ``mcp``, ...) is a tool OpenAI's servers run; this server
cannot, and ignores them, so a client's usual tool list (Codex sends
``web_search``) never fails a request. ``prompt_cache_key`` scopes the prefix cache as
``cache_salt`` does (and is echoed), and ``prompt_cache_breakpoint`` on input_text and
input_image parts marks what it should keep (``app.pipeline.breakpoints``). Unknown fields
are accepted and ignored; ``safety_identifier``, ``user``, ``service_tier`` and
``max_tool_calls`` are read only to be echoed. ``metadata`` is echoed and stored with the
response, within OpenAI's bounds: 16 keys, of at most 64 characters, with string
values of at most 512.
"""

from __future__ import annotations

import base64
import binascii
from typing import Annotated, Any, Literal

from pydantic import (
    BeforeValidator,
    Discriminator,
    Field,
    Tag,
    TypeAdapter,
    field_validator,
    model_validator,
)

from app.api.openai.protocol import JsonArguments, PromptCacheBreakpoint, PromptCacheOptions, cache_mark
from app.api.wire import UNSUPPORTED, JsonBool, Lenient, UnsupportedPart, part_tag
from app.errors import InvalidRequestError
from app.pipeline import request as typed

# Tandem's reasoning "encryption": the text, base64'd, behind this marker. Anything else
# (an OpenAI-encrypted blob from another provider) carries no reasoning we can read.
REASONING_MARK = "tandem.reasoning.v1:"


def encode_reasoning(text: str) -> str:
    """The ``encrypted_content`` of a reasoning item: opaque to clients, read back here."""
    return REASONING_MARK + base64.b64encode(text.encode()).decode()


def decode_reasoning(blob: str | None) -> str | None:
    if not blob or not blob.startswith(REASONING_MARK):
        return None
    try:
        return base64.b64decode(blob[len(REASONING_MARK):], validate=True).decode()
    except (binascii.Error, UnicodeDecodeError):
        return None


def flat_name(namespace: str | None, name: str) -> str:
    """The name the model sees for a function inside a namespace tool."""
    if not namespace:
        return name
    return f"{namespace}{name}" if namespace.endswith("_") else f"{namespace}__{name}"


# ---- input ----------------------------------------------------------------------------


class TextContent(Lenient):
    type: Literal["input_text", "output_text", "text"]
    text: str
    prompt_cache_breakpoint: PromptCacheBreakpoint | None = None


class ImageContent(Lenient):
    type: Literal["input_image"]
    image_url: str | None = None
    file_id: str | None = None
    detail: str | None = None
    prompt_cache_breakpoint: PromptCacheBreakpoint | None = None


class FileContent(Lenient):
    type: Literal["input_file"]


class RefusalContent(Lenient):
    type: Literal["refusal"]
    refusal: str


# Any other type (input_video, input_audio, vLLM's video_url) is an UnsupportedPart: a 400 that names it.
Content = Annotated[
    Annotated[TextContent, Tag("text")] | Annotated[ImageContent, Tag("input_image")]
    | Annotated[FileContent, Tag("input_file")] | Annotated[RefusalContent, Tag("refusal")]
    | Annotated[UnsupportedPart, Tag(UNSUPPORTED)],
    Discriminator(part_tag({"input_text": "text", "output_text": "text", "text": "text", "input_image": "input_image",
                            "input_file": "input_file", "refusal": "refusal"})),
]


def _text_list(v: Any, kind: str = "input_text") -> Any:
    """A bare string as one text part."""
    return [{"type": kind, "text": v}] if isinstance(v, str) else v


class MessageItem(Lenient):
    type: Literal["message"] = "message"
    role: Literal["user", "system", "developer", "assistant"]
    content: list[Content]

    @model_validator(mode="before")
    @classmethod
    def _string_content(cls, v: Any) -> Any:
        if isinstance(v, dict) and isinstance(v.get("content"), str):
            kind = "output_text" if v.get("role") == "assistant" else "input_text"
            return {**v, "content": _text_list(v["content"], kind)}
        return v


class FunctionCallItem(Lenient):
    type: Literal["function_call"]
    call_id: str = Field(min_length=1)
    name: str = Field(min_length=1)
    arguments: JsonArguments = "{}"
    namespace: str | None = None


class FunctionCallOutputItem(Lenient):
    type: Literal["function_call_output"]
    call_id: str = Field(min_length=1)
    output: list[Content]

    @field_validator("output", mode="before")
    @classmethod
    def _string_output(cls, v: Any) -> Any:
        return _text_list(v)


class ReasoningText(Lenient):
    text: str


class ReasoningItem(Lenient):
    type: Literal["reasoning"]
    summary: list[ReasoningText] = []
    content: list[ReasoningText] | None = None
    encrypted_content: str | None = None

    def text(self) -> str:
        """The reasoning as written: its content, else our own encrypted copy, else its summary."""
        if self.content:
            return "\n".join(p.text for p in self.content)
        decoded = decode_reasoning(self.encrypted_content)
        return decoded if decoded is not None else "\n".join(p.text for p in self.summary)


InputItem = Annotated[MessageItem | FunctionCallItem | FunctionCallOutputItem | ReasoningItem,
                      Field(discriminator="type")]
INPUT_ITEMS: TypeAdapter[list[InputItem]] = TypeAdapter(list[InputItem])


# ---- tools and options ----------------------------------------------------------------


class FunctionTool(Lenient):
    type: Literal["function"]
    name: str = Field(min_length=1, max_length=128)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: JsonBool | None = None

    def to_tool(self, namespace: str | None = None) -> typed.Tool:
        parameters = self.parameters if self.parameters is not None else {"type": "object", "properties": {}}
        return typed.Tool(flat_name(namespace, self.name), self.description, parameters, bool(self.strict))

    def echo(self) -> dict[str, Any]:
        """The tool as a response object lists it: every field of the spec's ``FunctionTool``,
        ``strict`` as it was applied (absent: not strict)."""
        return {**self.model_dump(by_alias=True, exclude_none=True), "description": self.description,
                "parameters": self.parameters, "strict": bool(self.strict)}


class OtherTool(Lenient):
    """A tool OpenAI's servers run (web_search, custom, mcp, ...): accepted, not served."""

    type: str


def _tool_kind(v: Any) -> str:
    kind = v.get("type") if isinstance(v, dict) else getattr(v, "type", None)
    return kind if kind in ("function", "namespace") else "other"


class NamespaceTool(Lenient):
    type: Literal["namespace"]
    name: str = Field(min_length=1, max_length=128)
    description: str | None = None
    tools: list[Annotated[Annotated[FunctionTool, Tag("function")] | Annotated[OtherTool, Tag("other")],
                          Discriminator(lambda v: "function" if _tool_kind(v) == "function" else "other")]] = []


ToolDef = Annotated[
    Annotated[FunctionTool, Tag("function")] | Annotated[NamespaceTool, Tag("namespace")]
    | Annotated[OtherTool, Tag("other")],
    Discriminator(_tool_kind),
]


class TextFormat(Lenient):
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    json_schema: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: JsonBool | None = None

    @model_validator(mode="after")
    def _schema_given(self) -> TextFormat:
        if self.type == "json_schema" and self.json_schema is None:
            raise ValueError("a json_schema format needs a schema")
        return self


class TextConfig(Lenient):
    format: TextFormat | None = None


class ReasoningConfig(Lenient):
    # "none" turns thinking off; any other effort turns it on; absent takes the model's default.
    effort: str | None = None
    summary: str | None = None
    # OpenRouter's explicit thinking budget in tokens; wins over effort's.
    max_tokens: int | None = Field(default=None, ge=0)


# OpenAI's bounds on a response's metadata: it is echoed, and kept as long as the response is.
METADATA_KEYS, METADATA_KEY_CHARS, METADATA_VALUE_CHARS = 16, 64, 512


def _bounded_metadata(v: Any) -> Any:
    """Counted before each value's type is checked, so a huge object costs no per-key errors."""
    if not isinstance(v, dict):
        return v
    if len(v) > METADATA_KEYS:
        raise ValueError(f"at most {METADATA_KEYS} keys are allowed, got {len(v)}")
    for key, value in v.items():
        if len(key) > METADATA_KEY_CHARS:
            raise ValueError(f"keys are at most {METADATA_KEY_CHARS} characters, one has {len(key)}")
        if isinstance(value, str) and len(value) > METADATA_VALUE_CHARS:
            raise ValueError(f"values are at most {METADATA_VALUE_CHARS} characters; {key!r} has {len(value)}")
    return v


Metadata = Annotated[dict[str, str], BeforeValidator(_bounded_metadata)]


class ResponsesRequest(Lenient):
    model: str = Field(min_length=1)
    input: list[InputItem] = []
    instructions: str | None = None
    tools: list[ToolDef] = []
    # "none" | "auto" | "required" | {"type": "function", "name"} | {"type": "allowed_tools", ...}
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: JsonBool | None = None
    max_output_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    presence_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    text: TextConfig | None = None
    reasoning: ReasoningConfig | None = None
    store: JsonBool | None = True
    previous_response_id: str | None = None
    metadata: Metadata | None = None
    include: list[str] | None = None
    # The most likely alternatives to each output token; logprobs themselves come with
    # include: ["message.output_text.logprobs"] (without it, OpenAI's ``logprobs`` stay empty).
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    stream: JsonBool = False
    background: JsonBool | None = None
    conversation: Any = None
    prompt: Any = None
    # Echoed in the response, as OpenAI's are; none but prompt_cache_key (the prefix cache's
    # scope, below) changes how it is served. max_tool_calls bounds calls to built-in tools,
    # and this server runs none; every request is served at the one service tier there is.
    max_tool_calls: int | None = Field(default=None, ge=1)
    service_tier: str | None = None
    safety_identifier: str | None = Field(default=None, max_length=64)
    user: str | None = Field(default=None, max_length=512)
    # Tandem extensions, as on chat completions.
    priority: Literal["interactive", "background"] = "interactive"
    extensions: JsonBool = False
    # vLLM's, as on chat completions: requests with different salts never share cached prefixes.
    cache_salt: str | None = None
    # OpenAI's: scopes cached prefixes as cache_salt does; and the breakpoints' mode and TTL.
    prompt_cache_key: str | None = Field(default=None, max_length=512)
    prompt_cache_options: PromptCacheOptions | None = None

    @field_validator("input", mode="before")
    @classmethod
    def _items(cls, v: Any) -> Any:
        if isinstance(v, str):
            return [{"type": "message", "role": "user", "content": v}]
        if isinstance(v, list):  # an "easy" message has a role and no type
            return [{**i, "type": "message"} if isinstance(i, dict) and "type" not in i and "role" in i else i
                    for i in v]
        return v

    @model_validator(mode="after")
    def _served_here(self) -> ResponsesRequest:
        if self.background:
            raise ValueError("background responses are not supported: this server answers while you wait")
        if self.conversation is not None:
            raise ValueError("conversation is not supported: chain requests with previous_response_id")
        if self.prompt is not None:
            raise ValueError("prompt templates live on OpenAI's servers: send instructions and input instead")
        return self

    @property
    def stores(self) -> bool:
        return self.store is not False

    @property
    def with_logprobs(self) -> bool:
        """Output text carries the log-probability of each token (and ``top_logprobs`` alternatives)."""
        return "message.output_text.logprobs" in (self.include or ())

    @property
    def encrypted_reasoning(self) -> bool:
        """Reasoning items carry ``encrypted_content`` (Codex asks, with ``store: false``)."""
        return "reasoning.encrypted_content" in (self.include or ())

    def thinking_requested(self) -> bool | None:
        """``reasoning.effort`` "none" is off, any other effort on; absent is the model's default."""
        if self.reasoning is None or self.reasoning.effort is None:
            return None
        return self.reasoning.effort != "none"

    def namespaces(self) -> dict[str, tuple[str, str]]:
        """The model's name of each namespaced function -> (namespace, name)."""
        return {flat_name(t.name, f.name): (t.name, f.name) for t in self.tools if isinstance(t, NamespaceTool)
                for f in t.tools if isinstance(f, FunctionTool)}

    def served_tools(self) -> tuple[typed.Tool, ...]:
        """The function tools, namespaced ones flattened; the rest are not served here."""
        out: list[typed.Tool] = []
        for t in self.tools:
            if isinstance(t, FunctionTool):
                out.append(t.to_tool())
            elif isinstance(t, NamespaceTool):
                out += [f.to_tool(t.name) for f in t.tools if isinstance(f, FunctionTool)]
        return tuple(out)

    def echoed_tools(self) -> list[dict[str, Any]]:
        """``tools`` as the response lists them: function tools with every field, the rest as sent."""
        return [t.echo() if isinstance(t, FunctionTool) else t.model_dump(by_alias=True, exclude_none=True)
                for t in self.tools]

    def output_format(self) -> typed.OutputFormat:
        f = self.text.format if self.text is not None else None
        if f is None or f.type == "text":
            return typed.OutputFormat()
        return typed.OutputFormat(f.type, f.json_schema, f.name, bool(f.strict), param="text.format")

    def to_request(self, history: list[dict[str, Any]]) -> typed.ChatRequest:
        """This body, after the stored conversation ``history``, as the pipeline's typed request."""
        items = [("previous_response_id", i) for i in INPUT_ITEMS.validate_python(history)]
        items += [(f"input[{n}]", i) for n, i in enumerate(self.input)]
        messages = to_messages(items, self.prompt_cache_options)
        if not messages:
            raise InvalidRequestError("input: give at least one input item (or a previous_response_id)",
                                      param="input")
        if self.instructions:
            messages.insert(0, typed.Message.of("system", self.instructions, param="instructions"))
        choice, tools = tool_choice(self.tool_choice, self.served_tools())
        sampling = typed.Sampling(temperature=self.temperature, top_p=self.top_p,
                                  presence_penalty=self.presence_penalty, frequency_penalty=self.frequency_penalty)
        implicit = self.prompt_cache_options is None or self.prompt_cache_options.mode == "implicit"
        options = typed.Options(self.model, sampling, self.max_output_tokens, max_tokens_param="max_output_tokens",
                                priority=self.priority, extensions=self.extensions, cache_salt=self.cache_salt,
                                prompt_cache_key=self.prompt_cache_key, cache_implicit=implicit,
                                logprobs=(self.top_logprobs or 0) if self.with_logprobs else None)
        return typed.ChatRequest(options, tuple(messages), tools=tools, tool_choice=choice,
                                 parallel_tool_calls=self.parallel_tool_calls,
                                 output=self.output_format(), thinking=self.thinking_requested(),
                                 reasoning_effort=self.reasoning.effort if self.reasoning else None,
                                 reasoning_budget=self.reasoning.max_tokens if self.reasoning else None,
                                 messages_param="input")


def tool_choice(v: str | dict[str, Any] | None, tools: tuple[typed.Tool, ...]
                ) -> tuple[typed.ToolChoice, tuple[typed.Tool, ...]]:
    """The typed tool choice, and the tools it leaves offered (``allowed_tools`` narrows them)."""
    if v is None:
        return typed.ToolChoice(), tools
    if isinstance(v, str):
        if v not in ("none", "auto", "required"):
            raise InvalidRequestError(f"tool_choice {v!r} is not one of none, auto, required", param="tool_choice")
        return typed.ToolChoice(v), tools  # type: ignore[arg-type]  # checked just above
    kind = v.get("type")
    if kind == "function" and isinstance(v.get("name"), str):
        return typed.ToolChoice("named", _named(v)), tools
    if kind == "allowed_tools" and v.get("mode") in ("auto", "required") and isinstance(v.get("tools"), list):
        names = {_named(t) for t in v["tools"] if isinstance(t, dict) and isinstance(t.get("name"), str)}
        return typed.ToolChoice(v["mode"]), tuple(t for t in tools if t.name in names)
    raise InvalidRequestError(f"tool_choice of type {kind!r} cannot be served here: only function tools run "
                              "on this server", param="tool_choice")


def _named(choice: dict[str, Any]) -> str:
    """The model's name of the function a tool choice names (``namespace`` optional)."""
    namespace = choice.get("namespace")
    return flat_name(namespace if isinstance(namespace, str) else None, choice["name"])


class _Turn:
    """An assistant turn being folded from its items."""

    def __init__(self, param: str) -> None:
        self.param = param
        self.parts: list[typed.Part] = []
        self.calls: list[typed.ToolCall] = []
        self.reasoning: list[str] = []

    def message(self) -> typed.Message:
        reasoning = "\n".join(r for r in self.reasoning if r) or None
        return typed.Message("assistant", tuple(self.parts), tool_calls=tuple(self.calls), reasoning=reasoning,
                             param=self.param)


def to_messages(items: list[tuple[str, Any]], cache: PromptCacheOptions | None = None) -> list[typed.Message]:
    """Input items (each with where it sits, for errors) as typed messages; ``cache``: the
    request's prompt_cache_options, its breakpoints' default TTL."""
    out: list[typed.Message] = []
    turn: _Turn | None = None
    for where, item in items:
        if isinstance(item, (ReasoningItem, FunctionCallItem)) or (
                isinstance(item, MessageItem) and item.role == "assistant"):
            turn = turn or _Turn(where)
            if isinstance(item, ReasoningItem):
                turn.reasoning.append(item.text())
            elif isinstance(item, FunctionCallItem):
                turn.calls.append(typed.ToolCall(item.call_id, flat_name(item.namespace, item.name), item.arguments))
            else:
                turn.parts += _parts(item.content, where, cache)
            continue
        if turn is not None:
            out.append(turn.message())
            turn = None
        if isinstance(item, FunctionCallOutputItem):
            out.append(typed.Message("tool", tuple(_parts(item.output, f"{where}.output", cache)),
                                     tool_call_id=item.call_id, param=where))
        else:
            role: typed.Role = "user" if item.role == "user" else "system"
            out.append(typed.Message(role, tuple(_parts(item.content, f"{where}.content", cache)), param=where))
    if turn is not None:
        out.append(turn.message())
    return out


def _parts(content: list[Any], where: str, cache: PromptCacheOptions | None = None) -> list[typed.Part]:
    parts: list[typed.Part] = []
    for j, p in enumerate(content):
        at = f"{where}[{j}]"
        if isinstance(p, TextContent):
            parts.append(typed.TextPart(p.text, cache_mark(p.prompt_cache_breakpoint, cache)))
        elif isinstance(p, RefusalContent):
            parts.append(typed.TextPart(p.refusal))
        elif isinstance(p, ImageContent) and p.image_url:
            detail = p.detail if p.detail in ("auto", "low", "high") else None  # "original" and newer: the default
            mark = cache_mark(p.prompt_cache_breakpoint, cache)
            parts.append(typed.ImagePart(p.image_url, f"{at}.image_url", detail, mark))
        elif isinstance(p, ImageContent):
            raise InvalidRequestError(f"{at}: an input_image needs image_url (a data: URL); file_id needs the "
                                      "Files API, which this server does not have", param=at)
        elif isinstance(p, UnsupportedPart):
            raise p.refused(at, "input_text and input_image parts")
        else:
            raise InvalidRequestError(f"{at}: input_file parts are not supported; send the text as input_text",
                                      param=at)
    return parts
