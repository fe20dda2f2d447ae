"""OpenAI's Decisions request (``openai/types/decision_create_params.py``), validated at the
edge, and its typed request (``app.pipeline.decisions.request``).

``input`` is a string or a list of items, each a typed message of the conversation the
questions are about:

    message (user)                    input_text, input_image (-> the vision path), input_json (as text)
    message (system, developer)       a system turn
    message (assistant)               output_text and refusal parts
    function_call, custom_tool_call   an assistant turn calling the tool (``call_id``)
    function_call_output,             a tool turn answering a call made before it: one that
      custom_tool_call_output           names no earlier call is a 400

``questions``: 1 to 400 of ``predicate`` (``instructions``), ``choice`` (2 to 255 unique
``choices``, each a string or boolean ``value``) and ``score`` (2 to 10 ``levels``, each a
``label``); instructions are a string or input_text, input_image and input_json parts.
``prompt_cache_key`` scopes the prefix cache as ``cache_salt`` does, and
``prompt_cache_breakpoint`` on input parts marks what it should keep. ``safety_identifier``
and other unknown fields are accepted and ignored.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import Discriminator, Field, StrictStr, Tag, field_validator

from app.api.openai.protocol import PromptCacheBreakpoint, PromptCacheOptions, cache_mark
from app.api.wire import UNSUPPORTED, JsonBool, Lenient, UnsupportedPart, part_tag
from app.errors import InvalidRequestError
from app.pipeline import request as typed
from app.pipeline.decisions import request as decided

# ---- input ------------------------------------------------------------------------------


class InputText(Lenient):
    type: Literal["input_text"]
    text: str
    prompt_cache_breakpoint: PromptCacheBreakpoint | None = None


class InputImage(Lenient):
    type: Literal["input_image"]
    image_url: str = Field(min_length=1)
    detail: Literal["low", "high", "auto", "original"] | None = None
    prompt_cache_breakpoint: PromptCacheBreakpoint | None = None


class InputJson(Lenient):
    """A JSON object (or a list of them), read by the model as its compact JSON text."""

    type: Literal["input_json"]
    data: dict[str, Any] | list[dict[str, Any]]


class OutputText(Lenient):
    type: Literal["output_text"]
    text: str


class RefusalPart(Lenient):
    type: Literal["refusal"]
    refusal: str


# Any other part type is an UnsupportedPart: a 400 that names it.
Part = Annotated[
    Annotated[InputText, Tag("input_text")] | Annotated[InputImage, Tag("input_image")]
    | Annotated[InputJson, Tag("input_json")] | Annotated[OutputText, Tag("output_text")]
    | Annotated[RefusalPart, Tag("refusal")] | Annotated[UnsupportedPart, Tag(UNSUPPORTED)],
    Discriminator(part_tag({t: t for t in ("input_text", "input_image", "input_json", "output_text", "refusal")})),
]
# The parts each role and item may hold, and their wire names.
USER_PARTS = (InputText, InputImage, InputJson)
TEXT_PARTS = (InputText,)
ASSISTANT_PARTS = (OutputText, RefusalPart)
OUTPUT_PARTS = (InputText, InputImage)
PART_TYPES: dict[type, str] = {InputText: "input_text", InputImage: "input_image", InputJson: "input_json",
                               OutputText: "output_text", RefusalPart: "refusal"}


class MessageItem(Lenient):
    type: Literal["message"] = "message"
    role: Literal["user", "system", "developer", "assistant"]
    content: list[Part]

    @field_validator("content", mode="before")
    @classmethod
    def _string(cls, v: Any, info: Any) -> Any:
        if isinstance(v, str):
            kind = "output_text" if info.data.get("role") == "assistant" else "input_text"
            return [{"type": kind, "text": v}]
        return v


class CallItem(Lenient):
    type: Literal["function_call", "custom_tool_call"]
    call_id: str = Field(min_length=1)
    name: str = Field(min_length=1)
    # function_call's arguments (JSON text); custom_tool_call's free-form input.
    arguments: str | None = None
    input: str | None = None
    namespace: str | None = None


class OutputItem(Lenient):
    type: Literal["function_call_output", "custom_tool_call_output"]
    call_id: str = Field(min_length=1)
    output: list[Part]

    @field_validator("output", mode="before")
    @classmethod
    def _string(cls, v: Any) -> Any:
        return [{"type": "input_text", "text": v}] if isinstance(v, str) else v


def _item_kind(v: Any) -> str:
    kind = v.get("type", "message") if isinstance(v, dict) else getattr(v, "type", "message")
    return {"function_call": "call", "custom_tool_call": "call", "function_call_output": "output",
            "custom_tool_call_output": "output"}.get(kind, "message")


InputItem = Annotated[
    Annotated[MessageItem, Tag("message")] | Annotated[CallItem, Tag("call")] | Annotated[OutputItem, Tag("output")],
    Discriminator(_item_kind),
]

# ---- questions --------------------------------------------------------------------------

QuestionPart = Annotated[
    Annotated[InputText, Tag("input_text")] | Annotated[InputImage, Tag("input_image")]
    | Annotated[InputJson, Tag("input_json")] | Annotated[UnsupportedPart, Tag(UNSUPPORTED)],
    Discriminator(part_tag({t: t for t in ("input_text", "input_image", "input_json")})),
]


class _Question(Lenient):
    instructions: str | list[QuestionPart]
    name: str | None = None

    def parts(self, where: str) -> tuple[typed.Part, ...]:
        if isinstance(self.instructions, str):
            return (typed.TextPart(self.instructions),)
        return tuple(_part(p, f"{where}.instructions[{j}]", OUTPUT_PARTS + (InputJson,), None)
                     for j, p in enumerate(self.instructions))


class PredicateQuestion(_Question):
    type: Literal["predicate"]

    def to_question(self, where: str) -> decided.Question:
        return decided.Question("predicate", self.parts(where), self.name, param=where)


class ChoiceOption(Lenient):
    # Typed: the string "true" and the boolean true are different choices.
    value: StrictStr | JsonBool  # (JsonBool: 1 is no boolean, in any validation mode)
    description: str | None = None


class ChoiceQuestion(_Question):
    type: Literal["choice"]
    choices: list[ChoiceOption]

    def to_question(self, where: str) -> decided.Question:
        choices = tuple(decided.Choice(c.value, c.description) for c in self.choices)
        return decided.Question("choice", self.parts(where), self.name, choices=choices, param=where)


class ScoreLevel(Lenient):
    label: str
    description: str | None = None


class ScoreQuestion(_Question):
    type: Literal["score"]
    levels: list[ScoreLevel]

    def to_question(self, where: str) -> decided.Question:
        levels = tuple(decided.Level(lv.label, lv.description) for lv in self.levels)
        return decided.Question("score", self.parts(where), self.name, levels=levels, param=where)


Question = Annotated[PredicateQuestion | ChoiceQuestion | ScoreQuestion, Field(discriminator="type")]

# ---- the request ------------------------------------------------------------------------


class DecisionCreateRequest(Lenient):
    model: str = Field(min_length=1)
    input: str | list[InputItem]
    questions: list[Question] = Field(min_length=1, max_length=decided.MAX_QUESTIONS)
    prompt_cache_key: str | None = None
    prompt_cache_options: PromptCacheOptions | None = None
    # Tandem extensions, as on chat completions.
    cache_salt: str | None = None
    priority: Literal["interactive", "background"] = "interactive"

    def to_request(self) -> decided.DecisionRequest:
        """This body as the pipeline's typed request."""
        cache = self.prompt_cache_options
        options = typed.Options(self.model, priority=self.priority, cache_salt=self.cache_salt,
                                prompt_cache_key=self.prompt_cache_key,
                                cache_implicit=cache is None or cache.mode == "implicit")
        messages = ((typed.Message.of("user", self.input, param="input"),) if isinstance(self.input, str)
                    else to_messages(self.input, cache))
        questions = tuple(q.to_question(f"questions[{i}]") for i, q in enumerate(self.questions))
        return decided.DecisionRequest(options, messages, questions)


def to_messages(items: list[Any], cache: PromptCacheOptions | None) -> tuple[typed.Message, ...]:
    """Input items as the conversation's typed messages; a tool output must answer a call made before it."""
    out: list[typed.Message] = []
    calls: set[str] = set()
    for i, item in enumerate(items):
        where = f"input[{i}]"
        if isinstance(item, CallItem):
            arguments = item.arguments if item.type == "function_call" else item.input
            name = f"{item.namespace}.{item.name}" if item.namespace else item.name
            out.append(typed.Message("assistant", tool_calls=(typed.ToolCall(item.call_id, name, arguments or ""),),
                                     param=where))
            calls.add(item.call_id)
        elif isinstance(item, OutputItem):
            if item.call_id not in calls:
                raise InvalidRequestError(f"{where}.call_id: {item.call_id!r} answers no call made before it",
                                          param=f"{where}.call_id")
            parts = tuple(_part(p, f"{where}.output[{j}]", OUTPUT_PARTS, cache) for j, p in enumerate(item.output))
            out.append(typed.Message("tool", parts, tool_call_id=item.call_id, param=where))
        else:
            allowed = {"user": USER_PARTS, "assistant": ASSISTANT_PARTS}.get(item.role, TEXT_PARTS)
            parts = tuple(_part(p, f"{where}.content[{j}]", allowed, cache) for j, p in enumerate(item.content))
            role: typed.Role = "system" if item.role == "developer" else item.role
            out.append(typed.Message(role, parts, param=where))
    return tuple(out)


def _part(p: Any, where: str, allowed: tuple[type, ...], cache: PromptCacheOptions | None) -> typed.Part:
    """One wire part as the pipeline's, if this place takes its type."""
    if isinstance(p, UnsupportedPart) or not isinstance(p, allowed):
        kind = getattr(p, "type", type(p).__name__)
        takes = ", ".join(PART_TYPES[a] for a in allowed)
        raise InvalidRequestError(f"{where}: a part of type {kind!r} is not allowed here; this place takes {takes}",
                                  param=where)
    if isinstance(p, InputText):
        return typed.TextPart(p.text, cache_mark(p.prompt_cache_breakpoint, cache))
    if isinstance(p, InputImage):
        detail = p.detail if p.detail in ("low", "high", "auto") else None  # "original": the default
        return typed.ImagePart(p.image_url, f"{where}.image_url", detail, cache_mark(p.prompt_cache_breakpoint, cache))
    if isinstance(p, InputJson):
        return typed.TextPart(json.dumps(p.data, ensure_ascii=False, separators=(",", ":")))
    if isinstance(p, OutputText):
        return typed.TextPart(p.text)
    assert isinstance(p, RefusalPart)
    return typed.TextPart(p.refusal)
