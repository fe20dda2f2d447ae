"""Typed messages -> the model's prompt: chat template, tools, system prompt, thinking.

Plain CPU work on the tokenizer (no MLX), run off the event loop. The chat
template comes from the tokenizer (mlx-lm's TokenizerWrapper); what it can do
is probed once per model (``make_profile``): whether it renders tools, whether
``enable_thinking`` changes anything, the default system prompt it inserts
when the client sends none, and whether it refuses two user turns in a row
(Mistral's templates do: their turns are then merged, ``app.messages.merge_turns``).
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

from app.config.schema import ChatParams, ModelCapabilities
from app.engine import PromptBuilder, TextPrompts, has_thinking, think_markers
from app.errors import ConfigError, InvalidRequestError
from app.families import BARE_JSON, THINK, CallSyntax, Family, Syntax
from app.parsers import PARSERS, is_reasoning_model, template_opens_reasoning
from app.pipeline.detection import SWITCHES, Detection, detect
from app.pipeline.request import ImagePart, Message, TextPart, Tool, ToolChoice
from app.pipeline.tokenizing import check_within, encode_within

_PROBE = "\u2063probe\u2063"


@dataclass(frozen=True)
class ModelProfile:
    """What the pipeline needs to know about a served chat model."""

    name: str
    tokenizer: Any
    params: ChatParams  # sampling defaults and max_tokens
    max_model_len: int
    parser: str
    reasoning: bool
    template_takes_tools: bool
    # Whether enable_thinking changes the rendered prompt (Qwen3 yes; Ministral, SmolLM2 no).
    thinking_switch: bool = False
    # Whether the template refuses consecutive user (or assistant) turns: they are merged first.
    alternating: bool = False
    # The system prompt the template inserts when the request has none ("" if none).
    default_system_prompt: str = ""
    # What a client's system prompt does to the default: "append" or "replace".
    system_prompt: str = "replace"
    # The model's vocabulary size, when its config says (bounds top_k).
    vocab_size: int | None = None
    # Tokens the KV budget holds: prompt + completion never go beyond it.
    kv_budget_tokens: int | None = None
    # How the model writes a tool call when told about tools (forced calls are held to it).
    call_syntax: Syntax = BARE_JSON
    # Its reasoning block's markers (a constrained request may reason inside them first).
    reasoning_markers: tuple[str, str] = THINK
    # Whether the opener is one token: a model trained to reason chooses it deliberately,
    # where a multi-token opener is reached by drifting through "<" (see constraining).
    reasoning_opener_is_token: bool = False
    # Thinking budget per effort level (capabilities.reasoning_budgets), each within the context.
    reasoning_budgets: tuple[tuple[str, int], ...] = ()
    # Renders every request of this model into a Prompt (app.engine.prompt): its chat template
    # and its tokens, or a native VLM's processor too. None: the tokenizer's (TextPrompts).
    prompts: PromptBuilder = None  # type: ignore[assignment]
    # The template variables that turn reasoning on or off or set its effort or budget
    # (app.pipeline.detection.SWITCHES), each of which changes what this template writes.
    switches: tuple[str, ...] = ()
    # What the template says about the model, and why the parser was chosen (/health, the load log).
    detection: Detection | None = None

    def __post_init__(self) -> None:
        if self.prompts is None:
            object.__setattr__(self, "prompts", TextPrompts(self.tokenizer))

    @property
    def family(self) -> Family:
        """The parser family's data."""
        return PARSERS[self.parser]

    def opened_call(self, prompt_text: str) -> str:
        """The call marker ``prompt_text`` ends with, where the family's generation prompt opens
        a recipient header (Functionary's ``>>>``); "" for none."""
        tail = prompt_text.rstrip()
        for syntax in self.family.reads:
            if isinstance(syntax, CallSyntax) and syntax.content_header and tail.endswith(syntax.begin.strip()):
                return syntax.begin.strip()
        return ""

    def opens_reasoning(self, prompt_text: str) -> bool:
        """Whether ``prompt_text`` ends inside an open reasoning block of this model's family."""
        return template_opens_reasoning(prompt_text, self.family.reasoning_pairs)


def make_profile(name: str, tokenizer: Any, params: ChatParams, max_model_len: int, caps: ModelCapabilities, *,
                 vocab_size: int | None = None, kv_budget_tokens: int | None = None,
                 prompts: PromptBuilder | None = None) -> ModelProfile:
    """Probe the chat template once and settle the model's parser and prompt policies;
    ``prompts`` is the model's prompt builder (default: its tokenizer's, ``TextPrompts``)."""
    template = getattr(tokenizer, "chat_template", None) or ""
    if not isinstance(template, str):
        template = json.dumps(template)
    declared = caps.reasoning_parser
    for key, value in (("tool_parser", caps.tool_parser), ("reasoning_parser", declared)):
        if value not in (None, "none") and value not in PARSERS:
            known = ", ".join(sorted(PARSERS))
            raise ConfigError(f"model {name!r}: capabilities.{key} {value!r} is not a parser; known: {known}")
    prompts = prompts or TextPrompts(tokenizer)
    found = detect(_renderer(prompts), template, name)
    parser = caps.tool_parser or (declared if declared not in (None, "none") else found.family)
    if parser != found.family:
        found = replace(found, why=f"models.yaml says {parser} ({found.why})")
    if declared is None:
        # mlx-lm's tokenizer wrapper knows the single-token think markers of many families.
        reasoning = (has_thinking(tokenizer) or is_reasoning_model(name, template) or found.reasoning is not None
                     or bool(found.switches))
    else:
        reasoning = declared != "none"
    default_system = _default_system_prompt(tokenizer)
    takes_tools = "tools" in template
    family = PARSERS[parser]
    # What the template writes, when it writes the parser's syntax; the tool note's otherwise.
    syntax = found.syntax if found.syntax is not None and parser == found.family and takes_tools else \
        family.call_syntax(template, takes_tools)
    markers = found.reasoning if found.reasoning is not None and parser == found.family else \
        _reasoning_markers(family, template, think_markers(tokenizer))
    return ModelProfile(
        name, tokenizer, params, max_model_len, parser, reasoning, takes_tools,
        thinking_switch=bool(found.switches),
        alternating=_requires_alternation(tokenizer),
        default_system_prompt=default_system,
        system_prompt=caps.system_prompt or ("append" if default_system else "replace"),
        vocab_size=vocab_size, kv_budget_tokens=kv_budget_tokens,
        call_syntax=syntax,
        reasoning_markers=markers,
        reasoning_opener_is_token=_is_one_token(tokenizer, markers[0]),
        reasoning_budgets=tuple((level, min(tokens, max_model_len))
                                for level, tokens in caps.reasoning_budgets.model_dump().items()),
        prompts=prompts,
        switches=found.switches,
        detection=found,
    )


def _renderer(prompts: PromptBuilder) -> Any:
    """The template as detection renders it (with the empty tool list ``render`` falls back on)."""
    def run(messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None, generation_prompt: bool,
            switches: dict[str, Any]) -> str:
        try:
            return prompts.render(messages, tools=tools, switches=switches, generation_prompt=generation_prompt)
        except InvalidRequestError:
            if tools is not None:
                raise
            return prompts.render(messages, tools=[], switches=switches, generation_prompt=generation_prompt)
    return run


def _reasoning_markers(family: Family, template: str, tokenizer_markers: tuple[str, str] | None) -> tuple[str, str]:
    """The reasoning block's markers for this model: the template's, mlx-lm's, else the family's."""
    for opener, closer in family.reasoning_pairs:
        if opener in template:
            return opener, closer
    if tokenizer_markers is not None:
        return tokenizer_markers
    return family.reasoning[0]


def _is_one_token(tokenizer: Any, text: str) -> bool:
    try:
        return len(tokenizer.encode(text, add_special_tokens=False)) == 1
    except Exception:  # noqa: BLE001 - a tokenizer that cannot say: assume not
        return False


def _render_probe(tokenizer: Any, messages: list[dict[str, Any]], **kw: Any) -> str | None:
    try:
        return str(tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False, **kw))
    except Exception:  # noqa: BLE001 - a template that refuses a probe has no such feature
        return None


def _default_system_prompt(tokenizer: Any) -> str:
    """The system prompt the template writes when the request has none.

    Rendered once with a marker system prompt and once without: when the second
    has the first's frame around other text, that text is the default
    (Ministral's reasoning instructions, SmolLM2's and Qwen2.5's identity line).
    """
    user = {"role": "user", "content": _PROBE}
    framed = _render_probe(tokenizer, [{"role": "system", "content": _PROBE + "S"}, user])
    bare = _render_probe(tokenizer, [user])
    if framed is None or bare is None or _PROBE + "S" not in framed:
        return ""
    head, _, tail = framed.partition(_PROBE + "S")
    if not (bare.startswith(head) and bare.endswith(tail)) or len(bare) <= len(head) + len(tail):
        return ""
    return bare[len(head) : len(bare) - len(tail)]


def _requires_alternation(tokenizer: Any) -> bool:
    """Whether the template refuses two user turns, or two assistant turns, in a row, where it
    renders them alternating. Asked of the template itself rather than of the model's family:
    the template is what raises (Mistral's "conversation roles must alternate", Gemma's and
    Llama 2's likewise, whatever family their parser is), and a fine-tune that dropped the
    check keeps its turns as the client sent them."""
    user, assistant = {"role": "user", "content": _PROBE}, {"role": "assistant", "content": _PROBE}
    if _render_probe(tokenizer, [user, assistant, user]) is None:
        return False  # a template that refuses even this: nothing to learn from it
    return _render_probe(tokenizer, [user, user]) is None or _render_probe(tokenizer, [user, assistant, assistant,
                                                                                       user]) is None


# Claude Code's first system block: billing metadata for Anthropic's servers, not an instruction.
# Its hash changes with the prompt (cc_version=2.1.197.6e2, then ...73f), and at the very start
# of the prompt it would make every new session miss the whole prefix cache.
_BILLING_LINE = re.compile(r"\A\s*x-anthropic-billing-header:[^\n]*(?:\n|\Z)")


def without_billing_line(text: str) -> str:
    """A system text without Claude Code's leading ``x-anthropic-billing-header: cc_version=…;
    cc_entrypoint=…;`` line (on /v1/messages, or forwarded by a proxy to another format)."""
    return _BILLING_LINE.sub("", text, count=1)


def gather_system(profile: ModelProfile, messages: tuple[Message, ...]) -> list[Message]:
    """One system message first, holding every system message's text in order, without
    Claude Code's billing line (``without_billing_line``).

    Many templates accept a system message only at the start (Ministral raises
    otherwise) and clients send them elsewhere too (Claude Code after the user's
    turn). With the "append" policy the template's default system prompt comes
    first, so a client's own system prompt does not silently remove the model's
    instructions (Ministral's [THINK] format).
    """
    systems = [text for m in messages if m.role == "system" if (text := without_billing_line(m.text()))]
    rest = [m for m in messages if m.role != "system"]
    if not systems:
        return rest
    text = "\n\n".join(systems)
    if profile.system_prompt == "append" and profile.default_system_prompt:
        text = f"{profile.default_system_prompt}\n\n{text}"
    return [Message.of("system", text), *rest]


def template_message(m: Message, fit_id: Callable[[str], str] = str, *, images: bool = False) -> dict[str, Any]:
    """A typed message as chat templates take it; ``fit_id`` rewrites call ids the model
    family's template would refuse (``Family.fit_call_id``). With ``images`` (a builder that
    takes them), a message with images has mlx-vlm's parts as its content: ``{"type":
    "image"}`` where the client put each image, text parts next to each other joined by a
    newline (``Message.text``'s rule), so the template places the model's placeholders.
    An assistant turn's reasoning is ``reasoning_content`` (templates that render earlier
    thinking read it, gpt-oss's as ``thinking``: the renderer passes both)."""
    content: Any = _image_parts(m.content) if images and m.images() else m.text()
    out: dict[str, Any] = {"role": m.role, "content": content}
    if m.name:
        out["name"] = m.name
    if m.tool_calls:
        out["tool_calls"] = [replace(tc, id=fit_id(tc.id)).as_dict(arguments_as_object=True) for tc in m.tool_calls]
    if m.tool_call_id:
        out["tool_call_id"] = fit_id(m.tool_call_id)
    if m.role == "assistant" and m.reasoning:
        out["reasoning_content"] = m.reasoning
    return out


def template_messages(messages: list[Message], family: Family, *, images: bool = False) -> list[dict[str, Any]]:
    """A conversation as the family's template takes it (``template_message`` each): call ids
    as the template writes them (Kimi's ``functions.NAME:N``, ``Family.call_id_format``) or
    as it accepts them (``Family.fit_call_id``), each tool result under its call's id, and
    named after the function it answers where the client left the name out (Gemma 4's and
    Kimi's templates write it)."""
    ids: dict[str, str] = {}
    names: dict[str, str] = {}
    for m in messages:
        for i, tc in enumerate(m.tool_calls):
            ids[tc.id] = family.call_id_format.format(name=tc.name, index=i) if family.call_id_format \
                else family.fit_call_id(tc.id)
            names[tc.id] = tc.name
    out = []
    for m in messages:
        if m.role == "tool" and m.tool_call_id and not m.name and m.tool_call_id in names:
            m = replace(m, name=names[m.tool_call_id])
        out.append(template_message(m, lambda cid: ids.get(cid) or family.fit_call_id(cid), images=images))
    return out


def _image_parts(content: tuple[TextPart | ImagePart, ...]) -> list[dict[str, Any]]:
    parts: list[dict[str, Any]] = []
    for p in content:
        if isinstance(p, ImagePart):
            parts.append({"type": "image"})
        elif parts and parts[-1]["type"] == "text":
            parts[-1] = {"type": "text", "text": f"{parts[-1]['text']}\n{p.text}"}
        else:
            parts.append({"type": "text", "text": p.text})
    return parts


def offered_tools(tools: tuple[Tool, ...], choice: ToolChoice, param: str = "tool_choice") -> tuple[Tool, ...]:
    """The tools the model is shown: none for "none", the named one for a named choice."""
    if not tools or choice.mode == "none":
        return ()
    if choice.mode == "named":
        named = tuple(t for t in tools if t.name == choice.name)
        if not named:
            raise InvalidRequestError(f"tool_choice names {choice.name!r}, which is not in tools", param=param)
        return named
    return tools


def tool_note(tools: tuple[Tool, ...], required: bool, syntax: CallSyntax) -> str:
    """For templates with no tool support: the tools, one compact line each, after the
    sentence that asks for the family's ``syntax`` (``ModelProfile.call_syntax``).

    A name, the first sentence of the description and the parameter names with
    simple types, so the note grows slowly with the tool count (Open WebUI sends
    36 tools with every chat; their full schemas alone overflow an 8k context).
    """
    lines = [f"You can call these functions. {syntax.note}"]
    if required:
        lines.append("You must call one of them.")
    lines += [f"- {_signature(t)}" + (f": {_first_sentence(t.description)}" if t.description else "") for t in tools]
    return "\n".join(lines)


def _signature(tool: Tool) -> str:
    props = tool.parameters.get("properties") if isinstance(tool.parameters, dict) else None
    required = set(tool.parameters.get("required") or ()) if isinstance(tool.parameters, dict) else set()
    args = []
    for name, schema in (props or {}).items() if isinstance(props, dict) else ():
        mark = "" if name in required else "?"
        args.append(f"{name}{mark}: {_type_of(schema)}")
    return f"{tool.name}({', '.join(args)})"


def _type_of(schema: Any) -> str:
    if not isinstance(schema, dict):
        return "any"
    if isinstance(schema.get("enum"), list) and len(schema["enum"]) <= 6:
        return "|".join(json.dumps(v, ensure_ascii=False) for v in schema["enum"])
    kind = schema.get("type")
    if isinstance(kind, list):
        kind = "|".join(str(k) for k in kind)
    if kind == "array" and isinstance(schema.get("items"), dict):
        return f"{_type_of(schema['items'])}[]"
    return str(kind) if kind else "any"


_SENTENCE_END = re.compile(r"(?<=[.!?])\s")


def _first_sentence(text: str, limit: int = 120) -> str:
    first = _SENTENCE_END.split(" ".join(text.split()), maxsplit=1)[0]
    return first if len(first) <= limit else first[: limit - 1].rstrip() + "\u2026"


def render(profile: ModelProfile, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None,
           thinking: bool, *, generation_prompt: bool = True, effort: str | None = None,
           budget: int | None = None) -> str:
    """The chat template applied, by the model's prompt builder, with its reasoning switches set
    from the request (``template_switches``); a template that rejects the messages is the client's 400."""
    switches = template_switches(profile, thinking, effort, budget)
    try:
        return profile.prompts.render(messages, tools=tools, generation_prompt=generation_prompt, switches=switches)
    except InvalidRequestError:
        if tools is not None:
            raise
        # Some tool-use templates (Hermes 3's, Command R+'s) iterate over tools unconditionally:
        # an empty list is what they need when the request offers none.
        try:
            return profile.prompts.render(messages, tools=[], generation_prompt=generation_prompt, switches=switches)
        except InvalidRequestError:
            pass
        raise


# Effort levels as templates name them, from the names clients send.
_EFFORTS = {"minimal": "low", "low": "low", "medium": "medium", "high": "high", "xhigh": "high", "max": "high"}


def template_switches(profile: ModelProfile, thinking: bool, effort: str | None = None,
                      budget: int | None = None) -> dict[str, Any]:
    """The request's thinking, effort and budget as the template's own variables
    (``ModelProfile.switches``): an on/off switch (``enable_thinking``, DeepSeek's ``thinking``,
    Command A's ``reasoning``) follows ``thinking``; an effort (gpt-oss's ``reasoning_effort``,
    Kimi K3's ``thinking_effort``) the request's effort, "low" with thinking off (gpt-oss cannot
    stop reasoning); a budget (Seed's ``thinking_budget``) the request's budget, 0 with thinking off.
    A model that does not reason gets none; one whose template has no switch gets
    ``enable_thinking`` (templates ignore a variable they do not read)."""
    if not profile.reasoning:
        return {}
    if not profile.switches:
        return {"enable_thinking": thinking}
    out: dict[str, Any] = {}
    for name in profile.switches:
        kind = SWITCHES[name]
        if kind == "bool":
            out[name] = thinking
        elif kind == "effort":
            level = "low" if not thinking else _EFFORTS.get(effort or "")
            if level is not None:
                out[name] = level
        elif kind == "budget":
            if not thinking:
                out[name] = 0
            elif budget is not None:
                out[name] = budget
    return out


def encode(profile: ModelProfile, text: str, param: str | None = None, *, special_tokens: bool = False) -> list[int]:
    """Token ids of a prompt without images: a rendered one by the model's prompt builder (the
    one tokenization rule of the model; its special tokens are in the text already), a plain
    one (``special_tokens``, completions) with the tokenizer's BOS and the like. Past the
    context, ``ContextLengthError`` on ``param`` after about a context's worth of tokenizing."""
    if special_tokens:
        return encode_within(profile.tokenizer, text, profile.max_model_len, param, special_tokens=True)
    check_within(profile.tokenizer, text, profile.max_model_len, param)
    return profile.prompts.build(text).tokens
