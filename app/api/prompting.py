"""Request -> engine conversion: chat template, tokens, limits, sampling.

Everything here is plain CPU work on the tokenizer (no MLX), run off the event
loop by the handlers. The chat template comes from the tokenizer through
mlx-lm's TokenizerWrapper, with tools when the template knows them.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from app.api.schemas import ChatCompletionRequest, ChatMessage, CompletionRequest, _SamplingFields
from app.config.schema import EngineParams
from app.engine.types import GenerationRequest, SamplingParams
from app.errors import ConfigError, ContextLengthError, InvalidRequestError
from app.parsers import PARSERS, detect_parser, is_reasoning_model, template_opens_reasoning


@dataclass(frozen=True)
class ModelProfile:
    """What the API needs to know about the served chat model."""

    name: str
    tokenizer: Any
    params: EngineParams
    max_model_len: int
    parser: str
    reasoning: bool
    template_takes_tools: bool


def make_profile(name: str, tokenizer: Any, params: EngineParams, max_model_len: int, caps: Any) -> ModelProfile:
    template = getattr(tokenizer, "chat_template", None) or ""
    if not isinstance(template, str):
        template = json.dumps(template)
    declared = caps.reasoning_parser
    for key, value in (("tool_parser", caps.tool_parser), ("reasoning_parser", declared)):
        if value not in (None, "none") and value not in PARSERS:
            raise ConfigError(f"model {name!r}: capabilities.{key} {value!r} is not a parser; known: {', '.join(sorted(PARSERS))}")
    if declared is None:
        # mlx-lm's tokenizer wrapper knows the single-token think markers of many families.
        reasoning = bool(getattr(tokenizer, "has_thinking", False)) or is_reasoning_model(name, template)
    else:
        reasoning = declared != "none"
    parser = caps.tool_parser or (declared if declared not in (None, "none") else detect_parser(name, template))
    return ModelProfile(name, tokenizer, params, max_model_len, parser, reasoning, "tools" in template)


@dataclass
class PreparedChat:
    gen: GenerationRequest
    prompt_text: str
    parser: str
    reasoning: bool
    starts_in_reasoning: bool
    tools_offered: bool
    warnings: list[str] = field(default_factory=list)


def message_dict(m: ChatMessage, text: str | None = None) -> dict[str, Any]:
    out: dict[str, Any] = {"role": "system" if m.role == "developer" else m.role}
    out["content"] = text if text is not None else m.text()
    if m.name:
        out["name"] = m.name
    if m.tool_calls:
        out["tool_calls"] = [
            {"id": tc.id, "type": "function", "function": {"name": tc.function.name, "arguments": _args(tc.function.arguments)}}
            for tc in m.tool_calls
        ]
    if m.tool_call_id:
        out["tool_call_id"] = m.tool_call_id
    return out


def _args(arguments: str) -> Any:
    # Most chat templates render arguments with `| tojson`: give them the object.
    try:
        return json.loads(arguments)
    except ValueError:
        return arguments


def _tools_for(req: ChatCompletionRequest) -> list[dict] | None:
    if not req.tools or req.tool_choice == "none":
        return None
    tools = [t.model_dump(exclude_none=True) for t in req.tools]
    if req.tool_choice is not None and not isinstance(req.tool_choice, str):
        wanted = req.tool_choice.function.get("name")
        tools = [t for t in tools if t["function"]["name"] == wanted]
        if not tools:
            raise InvalidRequestError(f"tool_choice names {wanted!r}, which is not in tools", param="tool_choice")
    return tools


def _tool_system_note(tools: list[dict], required: bool) -> str:
    """For templates with no tool support: describe the tools in the generic JSON format."""
    lines = [
        "You can call these functions. To call one, answer with only a JSON object "
        '{"name": <function name>, "arguments": <arguments object>}.'
    ]
    if required:
        lines.append("You must call one of them.")
    lines += [json.dumps(t["function"], ensure_ascii=False) for t in tools]
    return "\n".join(lines)


def render_chat(profile: ModelProfile, messages: list[dict], tools: list[dict] | None, thinking: bool, *, generation_prompt: bool = True) -> str:
    kwargs: dict[str, Any] = {"add_generation_prompt": generation_prompt, "tokenize": False}
    if tools:
        kwargs["tools"] = tools
    if profile.reasoning:
        kwargs["enable_thinking"] = thinking
    try:
        return profile.tokenizer.apply_chat_template(messages, **kwargs)
    except Exception as exc:  # noqa: BLE001 - jinja errors are the request's shape
        raise InvalidRequestError(f"the model's chat template rejected these messages: {exc}", param="messages") from exc


def _encode(profile: ModelProfile, text: str) -> list[int]:
    return list(profile.tokenizer.encode(text, add_special_tokens=False))


def sampling_for(req: _SamplingFields, params: EngineParams) -> SamplingParams:
    pick = lambda name: getattr(req, name) if getattr(req, name) is not None else getattr(params, name)  # noqa: E731
    return SamplingParams(
        temperature=pick("temperature"), top_p=pick("top_p"), top_k=pick("top_k"), min_p=pick("min_p"),
        frequency_penalty=pick("frequency_penalty"), presence_penalty=pick("presence_penalty"),
        repetition_penalty=pick("repetition_penalty"), seed=req.seed,
    )


def completion_budget(profile: ModelProfile, prompt_len: int, requested: int | None) -> int:
    """max_tokens capped to the context; an explicit request that cannot fit is a 400."""
    room = profile.max_model_len - prompt_len
    if room <= 0:
        raise ContextLengthError(
            f"this model's maximum context length is {profile.max_model_len} tokens, "
            f"but the prompt has {prompt_len} tokens",
            param="messages",
        )
    if requested is not None and requested > room:
        raise ContextLengthError(
            f"this model's maximum context length is {profile.max_model_len} tokens; the prompt has "
            f"{prompt_len} tokens and max_tokens asks for {requested}",
            param="max_tokens",
        )
    return requested if requested is not None else min(profile.params.max_tokens, room)


def _cache_prefix_len(profile: ModelProfile, messages: list[dict], tokens: list[int], thinking: bool) -> int | None:
    """Tokens of the system prompt (or first exchange) that stand alone as a prefix."""
    mode = profile.params.prompt_cache
    if mode == "off":
        return None
    upto = 1 if messages[0]["role"] == "system" else 0
    if mode == "first_message" and len(messages) > upto:
        upto += 1
    if upto == 0 or upto >= len(messages):
        return None
    head = _encode(profile, render_chat(profile, messages[:upto], None, thinking, generation_prompt=False))
    return len(head) if head and tokens[: len(head)] == head else None


def prepare_chat(profile: ModelProfile, req: ChatCompletionRequest, messages: list[dict] | None = None) -> PreparedChat:
    """Render, tokenize and bound a chat request. ``messages`` replaces the request's (vision proxy)."""
    msgs = messages if messages is not None else [message_dict(m) for m in req.messages]
    tools = _tools_for(req)
    thinking = req.thinking_requested()
    thinking = profile.reasoning if thinking is None else (thinking and profile.reasoning)
    if tools and not profile.template_takes_tools:
        note = _tool_system_note(tools, req.tool_choice == "required")
        if msgs and msgs[0]["role"] == "system":
            msgs = [{**msgs[0], "content": f"{msgs[0]['content']}\n\n{note}"}] + msgs[1:]
        else:
            msgs = [{"role": "system", "content": note}] + msgs
        template_tools = None
    else:
        template_tools = tools
    text = render_chat(profile, msgs, template_tools, thinking)
    tokens = _encode(profile, text)
    max_tokens = completion_budget(profile, len(tokens), req.completion_limit())
    gen = GenerationRequest(
        prompt_tokens=tokens,
        max_tokens=max_tokens,
        sampling=sampling_for(req, profile.params),
        stop=req.stop_list(),
        cache_prefix_len=_cache_prefix_len(profile, msgs, tokens, thinking) if len(msgs) > 1 else None,
    )
    return PreparedChat(
        gen, text, profile.parser, thinking,
        thinking and template_opens_reasoning(text), bool(tools),
    )


def prepare_completion(profile: ModelProfile, req: CompletionRequest) -> GenerationRequest:
    assert isinstance(req.prompt, str)
    tokens = list(profile.tokenizer.encode(req.prompt))
    if not tokens:
        raise InvalidRequestError("prompt is empty", param="prompt")
    return GenerationRequest(
        prompt_tokens=tokens,
        max_tokens=completion_budget(profile, len(tokens), req.max_tokens),
        sampling=sampling_for(req, profile.params),
        stop=req.stop_list(),
    )
