"""OpenAI wire models for requests (pydantic, validated at the edge).

Responses are built as plain dicts by each endpoint: they are produced per
token and need no validation. Unknown request fields are accepted and ignored,
as OpenAI clients send many (``user``, ``store``, ``metadata``, ...).
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Discriminator, Field, Tag, field_validator, model_validator

from app.api.wire import UNSUPPORTED, JsonBool, Lenient, UnsupportedPart, part_tag
from app.pipeline import request as typed


def _arguments_to_json(v: Any) -> Any:
    if isinstance(v, (dict, list)):
        return json.dumps(v, ensure_ascii=False)
    return "{}" if v is None else v


# A tool call's arguments: a JSON string as OpenAI sends it; an object is accepted and serialized.
JsonArguments = Annotated[str, BeforeValidator(_arguments_to_json)]

Role = Literal["system", "developer", "user", "assistant", "tool", "function"]


# OpenAI's prompt-cache lifetimes, in seconds; a breakpoint without one takes the request's.
CACHE_TTLS = {"30m": 30 * 60, "12h": 12 * 3600}
CacheTTL = Literal["30m", "12h"]


class PromptCacheBreakpoint(Lenient):
    """``prompt_cache_breakpoint`` on a content part: the prompt up to its end is worth keeping."""

    mode: Literal["explicit"]
    ttl: CacheTTL | None = None


class PromptCacheOptions(Lenient):
    """``prompt_cache_options``: "implicit" lets the cache keep what it chooses besides the
    breakpoints, "explicit" asks for the breakpoints alone; ``ttl`` is their default lifetime."""

    mode: Literal["implicit", "explicit"] = "implicit"
    ttl: CacheTTL = "30m"


def cache_mark(breakpoint: PromptCacheBreakpoint | None, options: PromptCacheOptions | None) -> typed.CacheMark | None:
    """A part's breakpoint as the pipeline's mark, its TTL or else the request's."""
    if breakpoint is None:
        return None
    return typed.CacheMark(CACHE_TTLS[breakpoint.ttl or (options.ttl if options else "30m")])


class ImageURL(Lenient):
    url: str = Field(min_length=1)
    detail: Literal["auto", "low", "high"] | None = None


class TextPart(Lenient):
    type: Literal["text", "input_text"]
    text: str
    prompt_cache_breakpoint: PromptCacheBreakpoint | None = None


class ImagePart(Lenient):
    type: Literal["image_url", "input_image"]
    image_url: ImageURL
    prompt_cache_breakpoint: PromptCacheBreakpoint | None = None

    @field_validator("image_url", mode="before")
    @classmethod
    def _bare_url(cls, v: Any) -> Any:
        return {"url": v} if isinstance(v, str) else v


# vLLM's video_url, OpenAI's input_audio and file parts are parsed as UnsupportedPart: a 400 that names them.
ContentPart = Annotated[
    Annotated[TextPart, Tag("text")] | Annotated[ImagePart, Tag("image")]
    | Annotated[UnsupportedPart, Tag(UNSUPPORTED)],
    Discriminator(part_tag({"text": "text", "input_text": "text", "image_url": "image", "input_image": "image"})),
]
# The part types a message may hold, as the refusal of any other lists them.
SERVED_PARTS = "text and image_url parts"


def _as_parts(v: Any) -> Any:
    """A string content is one text part: one shape to validate, so a bad part's error points
    at it (``messages[0].content[1]``), not at the string the content also is not."""
    return [{"type": "text", "text": v}] if isinstance(v, str) else v


class FunctionCall(Lenient):
    name: str = Field(min_length=1)
    arguments: JsonArguments = "{}"


class ToolCall(Lenient):
    id: str = ""
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(Lenient):
    role: Role
    content: list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None
    # Earlier assistant turns may carry their reasoning back.
    reasoning_content: str | None = None

    _parts = field_validator("content", mode="before")(_as_parts)

    @model_validator(mode="after")
    def _content_rules(self) -> ChatMessage:
        if self.role == "tool" and not self.tool_call_id:
            raise ValueError("a 'tool' message needs tool_call_id")
        if self.role != "assistant" and self.content is None:
            raise ValueError(f"a '{self.role}' message needs content")
        if self.role == "assistant" and self.content is None and not self.tool_calls:
            raise ValueError("an 'assistant' message needs content or tool_calls")
        return self

    def to_message(self, i: int, cache: PromptCacheOptions | None = None) -> typed.Message:
        """This message as the pipeline's typed one (``i``: its index, for error params;
        ``cache``: the request's prompt_cache_options, its breakpoints' default TTL)."""
        where = f"messages[{i}]"
        parts: list[typed.Part] = []
        for j, p in enumerate(self.content or ()):
            if isinstance(p, TextPart):
                parts.append(typed.TextPart(p.text, cache_mark(p.prompt_cache_breakpoint, cache)))
            elif isinstance(p, ImagePart):  # image_url, and input_image (the Responses API's image part) alike
                parts.append(typed.ImagePart(p.image_url.url, f"{where}.content[{j}].image_url", p.image_url.detail,
                                             cache_mark(p.prompt_cache_breakpoint, cache)))
            else:
                raise p.refused(f"{where}.content[{j}]", SERVED_PARTS)
        calls = tuple(typed.ToolCall(tc.id, tc.function.name, tc.function.arguments) for tc in self.tool_calls or ())
        role = "system" if self.role == "developer" else "tool" if self.role == "function" else self.role
        return typed.Message(role, tuple(parts), name=self.name, tool_calls=calls,
                             tool_call_id=self.tool_call_id, reasoning=self.reasoning_content, param=where)


class FunctionDef(Lenient):
    name: str = Field(min_length=1, max_length=64)
    description: str | None = None
    parameters: dict[str, Any] = Field(default_factory=lambda: {"type": "object", "properties": {}})
    strict: JsonBool | None = None


class ToolDef(Lenient):
    type: Literal["function"] = "function"
    function: FunctionDef


class NamedToolChoice(Lenient):
    type: Literal["function"] = "function"
    function: dict[str, str]


class JsonSchemaFormat(Lenient):
    model_config = ConfigDict(extra="allow", populate_by_name=True)

    name: str | None = None
    description: str | None = None
    # "schema" shadows a pydantic BaseModel attribute, so it is read by alias.
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: JsonBool | None = None


class ResponseFormat(Lenient):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_given(self) -> ResponseFormat:
        if self.type == "json_schema" and self.json_schema is None:
            raise ValueError("response_format of type json_schema needs a json_schema object")
        return self

    def to_output(self) -> typed.OutputFormat:
        """The pipeline's output format."""
        js = self.json_schema
        if self.type != "json_schema" or js is None:
            return typed.OutputFormat(self.type)
        return typed.OutputFormat("json_schema", js.schema_, js.name, bool(js.strict))


class PredictionText(Lenient):
    type: Literal["text"]
    text: str


class Prediction(Lenient):
    """OpenAI's Predicted Outputs: text the answer is expected to be close to (a file being
    rewritten). Tandem proposes it to the model, which keeps what it would have written anyway."""

    type: Literal["content"]
    content: str | list[PredictionText]

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)


class SpeculativeSwitches(BaseModel):
    """Tandem extension ``speculative``: the model's drafters (models.yaml ``speculative``) for this
    request. Strict: a misspelt switch is a 400, not silently the default."""

    model_config = ConfigDict(extra="forbid")

    prompt_lookup: JsonBool | None = None
    draft: JsonBool | None = None


class StreamOptions(Lenient):
    include_usage: JsonBool = False


class ChatTemplateKwargs(Lenient):
    enable_thinking: JsonBool | None = None


class _SamplingFields(Lenient):
    model: str = Field(min_length=1)
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    top_k: int | None = Field(default=None, ge=0)
    min_p: float | None = Field(default=None, ge=0.0, le=1.0)
    frequency_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    presence_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    # Below 0.01 the penalty divides logits into overflow: refused, not garbage.
    repetition_penalty: float | None = Field(default=None, ge=0.01, le=3.0)
    # Token id (as a string, OpenAI's JSON) -> bias added to its logit.
    logit_bias: dict[int, float] | None = Field(default=None, max_length=1024)
    # vLLM's: requests with different salts never share cached prompt prefixes.
    cache_salt: str | None = None
    # OpenAI's: scopes cached prefixes as cache_salt does; and the breakpoints' mode and TTL.
    prompt_cache_key: str | None = None
    prompt_cache_options: PromptCacheOptions | None = None
    # Any 64-bit seed, signed or not; MLX takes it unsigned, so negatives wrap (-1 -> 2**64 - 1).
    seed: int | None = Field(default=None, ge=-(2**63), lt=2**64)
    stop: str | list[str] | None = None
    stream: JsonBool = False
    stream_options: StreamOptions | None = None
    # Choices from one prompt (its KV computed once); usage sums their completion tokens.
    n: int = Field(default=1, ge=1, le=16)
    # Tandem (and vLLM) extension: "background" work (titles, tags, follow-ups) yields to
    # interactive requests. Open WebUI's "### Task:" prompts are background without it.
    priority: Literal["interactive", "background"] = "interactive"
    # Tandem extension: {"prompt_lookup": false, "draft": false} switches the model's drafters
    # off for this request (speculation never changes the answer, only its speed).
    speculative: SpeculativeSwitches | None = None

    @field_validator("seed")
    @classmethod
    def _unsigned_seed(cls, v: int | None) -> int | None:
        return None if v is None else v % 2**64

    @field_validator("logit_bias")
    @classmethod
    def _bias_range(cls, v: dict[int, float] | None) -> dict[int, float] | None:
        for token, bias in (v or {}).items():
            if not -100 <= bias <= 100:
                raise ValueError(f"bias {bias} for token {token} is outside -100..100")
        return v

    @field_validator("stop")
    @classmethod
    def _stop_list(cls, v: Any) -> Any:
        if isinstance(v, list) and len(v) > 16:
            raise ValueError("at most 16 stop sequences")
        return v

    @property
    def cache_implicit(self) -> bool:
        return self.prompt_cache_options is None or self.prompt_cache_options.mode == "implicit"

    def stop_list(self) -> tuple[str, ...]:
        if self.stop is None:
            return ()
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)

    def to_options(self, max_tokens: int | None = None, extensions: bool = False,
                   logprobs: int | None = None, prediction: str | None = None) -> typed.Options:
        """The pipeline's options for this request."""
        switches = self.speculative or SpeculativeSwitches()
        sampling = typed.Sampling(
            temperature=self.temperature, top_p=self.top_p, top_k=self.top_k, min_p=self.min_p,
            frequency_penalty=self.frequency_penalty, presence_penalty=self.presence_penalty,
            repetition_penalty=self.repetition_penalty, seed=self.seed,
            logit_bias=tuple(sorted((self.logit_bias or {}).items())),
        )
        return typed.Options(self.model, sampling, max_tokens if max_tokens is not None else self.max_tokens,
                             stop=self.stop_list(), priority=self.priority, cache_salt=self.cache_salt,
                             prompt_cache_key=self.prompt_cache_key, cache_implicit=self.cache_implicit,
                             extensions=extensions, n=self.n, logprobs=logprobs,
                             speculation=typed.Speculation(prediction, switches.prompt_lookup, switches.draft))


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    tools: list[ToolDef] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: JsonBool | None = None
    response_format: ResponseFormat | None = None
    # Thinking switches: Tandem's own, vLLM/Qwen's template kwargs, OpenAI's effort.
    thinking: JsonBool | None = None
    chat_template_kwargs: ChatTemplateKwargs | None = None
    # Also a thinking budget: the model's reasoning_budgets entry for the level (xhigh reads as high).
    reasoning_effort: Literal["none", "minimal", "low", "medium", "high", "xhigh"] | None = None
    # Tandem extension: return captions, warnings and parser chunks.
    extensions: JsonBool = False
    # The chosen tokens' log-probabilities, with top_logprobs alternatives each.
    logprobs: JsonBool | None = None
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    # OpenAI's Predicted Outputs. OpenAI refuses it with n > 1, logprobs, tools, penalties and
    # max_completion_tokens (limits of its implementation); here the verify step keeps the
    # answer exactly what it would have been, so each of those works with it.
    prediction: Prediction | None = None

    @model_validator(mode="after")
    def _top_needs_logprobs(self) -> ChatCompletionRequest:
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs: true")
        return self

    def thinking_requested(self) -> bool | None:
        if self.thinking is not None:
            return self.thinking
        if self.chat_template_kwargs and self.chat_template_kwargs.enable_thinking is not None:
            return self.chat_template_kwargs.enable_thinking
        if self.reasoning_effort is not None:
            return self.reasoning_effort != "none"
        return None

    def to_request(self) -> typed.ChatRequest:
        """This body as the pipeline's typed request."""
        choice = typed.ToolChoice()
        if isinstance(self.tool_choice, str):
            choice = typed.ToolChoice(self.tool_choice)
        elif self.tool_choice is not None:
            choice = typed.ToolChoice("named", self.tool_choice.function.get("name"))
        tools = tuple(typed.Tool(t.function.name, t.function.description, t.function.parameters,
                                 bool(t.function.strict)) for t in self.tools or ())
        logprobs = (self.top_logprobs or 0) if self.logprobs else None
        return typed.ChatRequest(
            self.to_options(self.max_completion_tokens or self.max_tokens, self.extensions, logprobs,
                            self.prediction.text() if self.prediction is not None else None),
            tuple(m.to_message(i, self.prompt_cache_options) for i, m in enumerate(self.messages)),
            tools=tools, tool_choice=choice, parallel_tool_calls=self.parallel_tool_calls,
            output=self.response_format.to_output() if self.response_format else typed.OutputFormat(),
            thinking=self.thinking_requested(), reasoning_effort=self.reasoning_effort,
        )


class CompletionRequest(_SamplingFields):
    prompt: str | list[str] = Field(min_length=1)
    echo: JsonBool = False
    # The legacy completions form: how many alternatives per token (0: the chosen token's only).
    logprobs: int | None = Field(default=None, ge=0, le=5)

    @field_validator("prompt")
    @classmethod
    def _one_prompt(cls, v: Any) -> Any:
        if isinstance(v, list):
            if len(v) != 1:
                raise ValueError("exactly one prompt is supported")
            return v[0]
        return v

    def to_request(self) -> typed.TextRequest:
        """This body as the pipeline's typed request."""
        assert isinstance(self.prompt, str)
        return typed.TextRequest(self.to_options(logprobs=self.logprobs), self.prompt, echo=self.echo)
