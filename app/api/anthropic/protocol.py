"""Anthropic Messages wire models for requests (pydantic), and their mapping onto the typed request.

    system (a string or text blocks), role "system" messages -> system messages (the pipeline
                                                                gathers them into one, first);
                                                                Claude Code's billing header block
                                                                is left out (``BILLING_HEADER``)
    user: text, image (base64 or url source)                 -> a user message's parts
    user: tool_result blocks                                 -> role "tool" messages, before the
                                                                rest of the user's turn
    assistant: text, tool_use, thinking                      -> content, tool_calls, reasoning
    consecutive user (or assistant) turns                    -> one turn, as Anthropic combines them
                                                                (the pipeline's ``merge_turns``, which
                                                                every format gets for templates that
                                                                demand alternating turns)
    tools[] with input_schema                                -> Tool; Anthropic's server tools (web
                                                                search, code execution, tool search)
                                                                run on Anthropic's side: left out
    tool_choice auto / any / tool / none                     -> ToolChoice auto / required / named / none
    disable_parallel_tool_use                                -> parallel_tool_calls=False (else None: unsaid)
    thinking enabled / adaptive, between_tools / disabled    -> thinking True / None (the model's
             / absent                                           default) / False / False (Anthropic's
                                                                default: no thinking unless asked)
    thinking.budget_tokens (enabled), output_config.effort   -> reasoning_budget, reasoning_effort (the
                                                                model's budget for that level)
    output_config.format, output_format (json_schema)        -> OutputFormat json_schema
    max_tokens (required), stop_sequences, temperature,      -> Options; max_tokens is clamped to the
    top_p, top_k                                                context by the pipeline, never refused

Tool-call ids: the pipeline's parser makes them (``call_`` + 24 alphanumerics, or the
9 alphanumerics Mistral's templates demand); they go out as ``toolu_`` + the parser's
id without ``call_`` (``anthropic_tool_id``), and ids coming back lose ``toolu_``
(``pipeline_tool_id``), so a Mistral call id reaches its template as it was made.

``cache_control`` ({"type": "ephemeral", "ttl": "5m" | "1h"}) on a system block, a tool, a
content block, or the request itself (its last block) marks where the prefix cache should keep
the prompt (``app.pipeline.breakpoints``); a tool_use or thinking block's mark falls at the
end of its turn's text, and more than four marks are refused, as Anthropic does.

Fields Tandem does not use are accepted and ignored: ``metadata``, ``context_management``, ``service_tier``,
tools' ``defer_loading`` (deferred tools are offered like any other) and ``$schema``.
"""

from __future__ import annotations

import json
from dataclasses import replace
from typing import Annotated, Any, Literal

from pydantic import BaseModel, Discriminator, Field, Tag, field_validator

from app.api.wire import UNSUPPORTED, JsonBool, Lenient, UnsupportedPart, part_tag
from app.errors import InvalidRequestError
from app.pipeline import request as typed

TOOL_ID_PREFIX = "toolu_"
# cache_control's lifetimes, in seconds ("5m" is the default), and how many a request may mark.
CACHE_TTLS = {"5m": 5 * 60, "1h": 60 * 60}
MAX_CACHE_CONTROLS = 4


def anthropic_tool_id(pipeline_id: str) -> str:
    """A call id the pipeline's parser made, in Anthropic's style."""
    return TOOL_ID_PREFIX + pipeline_id.removeprefix("call_")


def pipeline_tool_id(anthropic_id: str) -> str:
    """A client's call id as the chat template gets it: ``anthropic_tool_id`` undone, so a
    Mistral call id is again the 9 alphanumerics its template checks."""
    return anthropic_id.removeprefix(TOOL_ID_PREFIX)


def _as_blocks(v: Any) -> Any:
    """A string where blocks may stand is one text block: one shape to validate, and errors
    that point at the block (``messages.0.content.1``), not at each member of a union."""
    return [{"type": "text", "text": v}] if isinstance(v, str) else v


# Claude Code (2.1.29 on) sends its billing header as the first system text block,
# ``x-anthropic-billing-header: cc_version=2.1.197.7a9; cc_entrypoint=cli; cch=...;``, with
# a hash that changes on every request: no text for the model, and at the head of the
# prompt it would make every request's prefix new to the prefix cache. Anthropic's own API
# does not show it to the model either.
BILLING_HEADER = "x-anthropic-billing-header:"


class CacheControl(Lenient):
    """``cache_control``: the prompt up to the end of what carries it is worth keeping."""

    type: Literal["ephemeral"]
    ttl: Literal["5m", "1h"] = "5m"

    def mark(self) -> typed.CacheMark:
        return typed.CacheMark(CACHE_TTLS[self.ttl])


def _mark(control: CacheControl | None) -> typed.CacheMark | None:
    return control.mark() if control is not None else None


def _marked_last(parts: list[typed.Part], mark: typed.CacheMark | None) -> list[typed.Part]:
    """``parts`` with ``mark`` on the last one; an empty text part carries it when there is
    none (it renders as nothing, so the prompt is the same with the mark or without)."""
    if mark is None:
        return parts
    if not parts:
        return [typed.TextPart("", mark)]
    return [*parts[:-1], replace(parts[-1], cache=mark)]


class TextBlock(Lenient):
    type: Literal["text"]
    text: str
    cache_control: CacheControl | None = None


class Base64Source(Lenient):
    type: Literal["base64"]
    media_type: str = Field(min_length=1)
    data: str


class URLSource(Lenient):
    type: Literal["url"]
    url: str = Field(min_length=1)


class ImageBlock(Lenient):
    type: Literal["image"]
    source: Annotated[Base64Source | URLSource, Field(discriminator="type")]
    cache_control: CacheControl | None = None

    def part(self, where: str) -> typed.ImagePart:
        """The image as the vision path takes it: a URL (``data:`` for base64 sources)."""
        src = self.source
        url = f"data:{src.media_type};base64,{src.data}" if isinstance(src, Base64Source) else src.url
        return typed.ImagePart(url, f"{where}.source", cache=_mark(self.cache_control))


class ToolUseBlock(Lenient):
    type: Literal["tool_use"]
    id: str = Field(min_length=1)
    name: str = Field(min_length=1)
    input: dict[str, Any] = Field(default_factory=dict)
    cache_control: CacheControl | None = None


class ToolResultBlock(Lenient):
    type: Literal["tool_result"]
    tool_use_id: str = Field(min_length=1)
    content: list[Annotated[TextBlock | ImageBlock, Field(discriminator="type")]] = Field(default_factory=list)
    is_error: JsonBool = False
    cache_control: CacheControl | None = None

    _blocks = field_validator("content", mode="before")(_as_blocks)


class ThinkingBlock(Lenient):
    type: Literal["thinking"]
    thinking: str
    # Anthropic's signature, or Tandem's: either way not checked, the text is the reasoning.
    signature: str = ""
    cache_control: CacheControl | None = None


class RedactedThinkingBlock(Lenient):
    type: Literal["redacted_thinking"]
    data: str = ""


# Any other block (document, search_result, a video) is an UnsupportedPart: a 400 that names it.
ContentBlock = Annotated[
    Annotated[TextBlock, Tag("text")] | Annotated[ImageBlock, Tag("image")] | Annotated[ToolUseBlock, Tag("tool_use")]
    | Annotated[ToolResultBlock, Tag("tool_result")] | Annotated[ThinkingBlock, Tag("thinking")]
    | Annotated[RedactedThinkingBlock, Tag("redacted_thinking")] | Annotated[UnsupportedPart, Tag(UNSUPPORTED)],
    Discriminator(part_tag({tag: tag for tag in ("text", "image", "tool_use", "tool_result", "thinking",
                                                 "redacted_thinking")})),
]


class InputMessage(Lenient):
    # Claude Code sends role "system" messages too, after the user's turn.
    role: Literal["user", "assistant", "system"]
    content: list[ContentBlock]

    _blocks = field_validator("content", mode="before")(_as_blocks)

    def to_messages(self, i: int) -> list[typed.Message]:
        """This turn as the pipeline's messages: tool results first, then the turn itself."""
        where = f"messages[{i}]"
        parts: list[typed.Part] = []
        results: list[typed.Message] = []
        calls: list[typed.ToolCall] = []
        reasoning: list[str] = []
        tail_mark = None  # a tool_use or thinking block's mark: the turn's text ends there
        for j, block in enumerate(self.content):
            at = f"{where}.content[{j}]"
            if isinstance(block, UnsupportedPart):
                raise block.refused(at, "text, image, tool_use, tool_result and thinking blocks")
            _check_role(self.role, block, at)
            if isinstance(block, TextBlock):
                parts.append(typed.TextPart(block.text, _mark(block.cache_control)))
            elif isinstance(block, ImageBlock):
                parts.append(block.part(at))
            elif isinstance(block, ToolUseBlock):
                arguments = json.dumps(block.input, ensure_ascii=False)
                calls.append(typed.ToolCall(pipeline_tool_id(block.id), block.name, arguments))
                tail_mark = _mark(block.cache_control) or tail_mark
            elif isinstance(block, ToolResultBlock):
                results.append(_tool_message(block, at))
            elif isinstance(block, ThinkingBlock):
                reasoning.append(block.thinking)
                tail_mark = _mark(block.cache_control) or tail_mark
            # A redacted thinking block holds nothing a local model can read.
        if results and not (parts or calls):
            return results
        parts = _marked_last(parts, tail_mark)
        turn = typed.Message(self.role, tuple(parts), tool_calls=tuple(calls),
                             reasoning="\n".join(reasoning) or None, param=where)
        return [*results, turn]


_ALLOWED: dict[str, tuple[type[BaseModel], ...]] = {
    "user": (TextBlock, ImageBlock, ToolResultBlock),
    "assistant": (TextBlock, ToolUseBlock, ThinkingBlock, RedactedThinkingBlock),
    "system": (TextBlock,),
}


def _check_role(role: str, block: BaseModel, where: str) -> None:
    if not isinstance(block, _ALLOWED[role]):
        kind = getattr(block, "type", type(block).__name__)
        raise InvalidRequestError(f"{where}: a {role!r} message cannot hold a {kind!r} block", param=where)


def _tool_message(block: ToolResultBlock, where: str) -> typed.Message:
    # A failed tool's output says so: the template has no field for it, the model must read it.
    parts: list[typed.Part] = [typed.TextPart("Error:")] if block.is_error else []
    for k, p in enumerate(block.content):
        parts.append(typed.TextPart(p.text, _mark(p.cache_control)) if isinstance(p, TextBlock)
                     else p.part(f"{where}.content[{k}]"))
    parts = _marked_last(parts, _mark(block.cache_control))
    return typed.Message("tool", tuple(parts), tool_call_id=pipeline_tool_id(block.tool_use_id), param=where)


class CustomTool(Lenient):
    type: Literal["custom"] | None = None
    name: str = Field(min_length=1, max_length=128)
    description: str | None = None
    input_schema: dict[str, Any]
    strict: JsonBool | None = None
    cache_control: CacheControl | None = None


class ServerTool(Lenient):
    """A tool Anthropic runs (web search, code execution, tool search) or one only its models
    know the schema of (bash, text editor): Tandem has none of them to offer."""

    type: str
    name: str = ""


def _tool_kind(v: Any) -> str:
    kind = v.get("type") if isinstance(v, dict) else getattr(v, "type", None)
    return "custom" if kind in (None, "custom") else "server"


AnyTool = Annotated[Annotated[CustomTool, Tag("custom")] | Annotated[ServerTool, Tag("server")],
                    Discriminator(_tool_kind)]


class ToolChoice(Lenient):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = Field(default=None, min_length=1)
    disable_parallel_tool_use: JsonBool = False

    def to_choice(self) -> typed.ToolChoice:
        if self.type == "tool":
            if self.name is None:
                raise InvalidRequestError("tool_choice.name: required when tool_choice.type is 'tool'",
                                          param="tool_choice.name")
            return typed.ToolChoice("named", self.name)
        if self.type == "any":
            return typed.ToolChoice("required")
        return typed.ToolChoice(self.type)


class ThinkingConfig(Lenient):
    type: Literal["enabled", "disabled", "adaptive", "between_tools"]
    # The thinking budget: at it, the engine closes the model's reasoning block (with enabled).
    budget_tokens: int | None = Field(default=None, ge=0)
    # "omitted": thinking blocks carry a signature and no text.
    display: Literal["summarized", "omitted"] | None = None

    def switch(self) -> bool | None:
        return {"enabled": True, "disabled": False}.get(self.type)


class JsonOutputFormat(Lenient):
    type: Literal["json_schema"]
    schema_: dict[str, Any] = Field(alias="schema")


class OutputConfig(Lenient):
    effort: str | None = None
    format: JsonOutputFormat | None = None


class _MessagesBody(Lenient):
    """What /v1/messages and /v1/messages/count_tokens share: the prompt."""

    model: str = Field(min_length=1)
    messages: list[InputMessage] = Field(min_length=1)
    system: list[TextBlock] | None = None
    tools: list[AnyTool] | None = None
    tool_choice: ToolChoice | None = None
    thinking: ThinkingConfig | None = None
    output_config: OutputConfig | None = None
    # The structured-outputs beta's name for output_config.format.
    output_format: JsonOutputFormat | None = None
    # Automatic caching: a mark on the request's last block.
    cache_control: CacheControl | None = None

    _blocks = field_validator("system", mode="before")(_as_blocks)

    def thinking_shown(self) -> bool:
        """Whether thinking blocks carry their text (``display: omitted`` keeps only signatures)."""
        return self.thinking is None or self.thinking.display != "omitted"

    def _cache_controls(self) -> int:
        """How many places the request marks with cache_control."""
        blocks: list[Any] = [*(self.system or ()), *(self.tools or ()), self]
        for m in self.messages:
            for b in m.content:
                blocks += [b, *(b.content if isinstance(b, ToolResultBlock) else ())]
        return sum(getattr(b, "cache_control", None) is not None for b in blocks)

    def _chat_request(self, options: typed.Options) -> typed.ChatRequest:
        marked = self._cache_controls()
        if marked > MAX_CACHE_CONTROLS:
            raise InvalidRequestError(f"A maximum of {MAX_CACHE_CONTROLS} blocks with cache_control may be provided. "
                                      f"Found {marked}.", param="cache_control")
        system: list[typed.Message] = []
        blocks = [b for b in self.system or () if not b.text.startswith(BILLING_HEADER)]
        if any(b.text for b in blocks):
            system.append(typed.Message("system", tuple(typed.TextPart(b.text, _mark(b.cache_control)) for b in blocks),
                                        param="system"))
        turns = [m for i, msg in enumerate(self.messages) for m in msg.to_messages(i)]
        if self.cache_control is not None and turns:
            last = turns[-1]
            turns[-1] = replace(last, content=tuple(_marked_last(list(last.content), self.cache_control.mark())))
        tools = tuple(typed.Tool(t.name, t.description, t.input_schema, bool(t.strict), _mark(t.cache_control))
                      for t in self.tools or () if isinstance(t, CustomTool))
        choice = self.tool_choice.to_choice() if self.tool_choice else typed.ToolChoice()
        fmt = self.output_format or (self.output_config.format if self.output_config else None)
        where = "output_format" if self.output_format else "output_config.format"
        output = typed.OutputFormat("json_schema", fmt.schema_, param=where) if fmt else typed.OutputFormat()
        return typed.ChatRequest(
            options, tuple(typed.merge_turns([*system, *turns])), tools=tools, tool_choice=choice,
            parallel_tool_calls=False if self.tool_choice and self.tool_choice.disable_parallel_tool_use else None,
            output=output, thinking=self.thinking.switch() if self.thinking else False,
            reasoning_effort=self.output_config.effort if self.output_config else None,
            reasoning_budget=self.thinking.budget_tokens if self.thinking and self.thinking.type == "enabled" else None,
        )


class CountTokensRequest(_MessagesBody):
    """``POST /v1/messages/count_tokens``: the prompt alone."""

    def to_request(self) -> typed.ChatRequest:
        """This body as the pipeline's typed request."""
        return self._chat_request(typed.Options(self.model))


class MessagesRequest(_MessagesBody):
    """``POST /v1/messages``."""

    max_tokens: int = Field(ge=1)
    stop_sequences: list[str] | None = Field(default=None, max_length=16)
    temperature: float | None = Field(default=None, ge=0.0, le=1.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    top_k: int | None = Field(default=None, ge=0)
    stream: JsonBool = False
    # Not Anthropic's: vLLM's extra body field, as on every format here (the prefix cache's scope).
    cache_salt: str | None = None

    def to_request(self) -> typed.ChatRequest:
        """This body as the pipeline's typed request."""
        sampling = typed.Sampling(temperature=self.temperature, top_p=self.top_p, top_k=self.top_k)
        return self._chat_request(typed.Options(self.model, sampling, self.max_tokens,
                                                stop=tuple(self.stop_sequences or ()), cache_salt=self.cache_salt))
