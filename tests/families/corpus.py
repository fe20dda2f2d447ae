"""Serving llama.cpp's parser test cases as Tandem serves a request, and comparing the answers.

Each case of ``test-chat.cpp`` (``cpp_cases``) is a template, a request (tools,
thinking, parallel calls, a response format) and the text a model wrote. Here
the template is the model's: Tandem probes it (``make_profile``: detection,
switches), prepares the request through the pipeline (``build_chat``: the
rendered prompt, whether it opens reasoning, the parser), then parses the
text. What llama.cpp expects is compared with what Tandem's parser read:

- content and reasoning without the whitespace at their edges (Tandem trims
  each stretch; llama.cpp keeps what the model wrote);
- the calls' names and decoded arguments, in order (not their ids: Tandem
  makes its own, ``Family.call_id``).

The text loses the template's end-of-turn marker at its end, as the engine stops
there and never hands that token to the parser. Cases whose difference is
deliberate (``DIFFERENCES``) are counted apart; docs/guides/tool-calls.md lists them.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

from app.config.schema import ChatParams, ModelCapabilities
from app.messages import Message, ToolCall
from app.parsers import collect, make_parser
from app.pipeline.pipeline import build_chat
from app.pipeline.prompting import ModelProfile, make_profile
from app.pipeline.request import ChatRequest, Options, OutputFormat, Tool, ToolChoice
from tests.families.cpp_cases import Case, Msg


@dataclass(frozen=True)
class Outcome:
    """One case served: what Tandem read, and whether it is what llama.cpp expects."""

    case: Case
    family: str
    got: dict[str, Any]
    want: dict[str, Any]
    difference: str | None  # the deliberate difference the case shows, if any

    @property
    def passed(self) -> bool:
        return self.got == self.want


def _reasoning_without(want: str, got: str, markers: tuple[str, ...]) -> bool:
    """Whether ``want`` is ``got`` with some of ``markers`` in it (ignoring whitespace)."""
    for marker in markers:
        want = want.replace(marker, "")
    return want.split() == got.split() and bool(markers)


# Deliberate differences: a name (the docs' table lists each) and the cases that show it.
DIFFERENCES: dict[str, Callable[[Case, dict[str, Any]], bool]] = {
    # A reasoning opener the model repeats inside the block its prompt opened is dropped, not
    # kept as reasoning text (llama.cpp keeps Qwen3.5's "<think>" when no reasoning is sent back).
    "repeated-opener-dropped": lambda case, got: case.expect.reasoning_content.strip() != got["reasoning"]
    and _reasoning_without(case.expect.reasoning_content, got["reasoning"], ("<think>",)),
    # The text a generation prompt opens reasoning with is the template's, not reasoning the model
    # wrote (Apriel 1.6's "Here are my reasoning steps:"; llama.cpp returns it as reasoning).
    "prompt-opener-not-reasoning": lambda case, got: _reasoning_without(
        case.expect.reasoning_content, got["reasoning"], ("Here are my reasoning steps:",))
    and case.expect.reasoning_content.strip() != got["reasoning"],
    # With a response format the grammar forces the bare value, so a model cannot wrap it in a
    # Markdown fence; llama.cpp, which lets the model write the fence, strips it.
    "no-fence-under-a-grammar": lambda case, got: bool(case.params.get("json_schema")) and "```" in case.input,
    # llama.cpp's reasoning_format "none" leaves reasoning in the content, markers and all;
    # Tandem always reads a reasoning model's reasoning out of the content.
    "reasoning-always-separated": lambda case, got: case.params.get("reasoning_format", "none") == "none"
    and bool(got["reasoning"]),
    # A call cut off by max_tokens is an error event and no call, never half a call.
    "no-partial-calls": lambda case, got: bool(case.params.get("is_partial")) and bool(case.expect.tool_calls),
    # Continuing a final assistant message (prefill) is not a Tandem request shape.
    "no-continuation": lambda case, got: case.params.get("continue_final_message", "none") != "none",
}


def profile_for(tokenizer: Any, template: str, name: str) -> ModelProfile:
    """What Tandem makes of a model with this template (detection and all): the demo
    tokenizer's vocabulary with the case's template, as a model that ships it loads. The
    tokenizer is the one of every template (so one grammar compiler serves them all): a
    profile is good until the next template's is made."""
    getattr(tokenizer, "_tokenizer", tokenizer).chat_template = template
    return make_profile(name, tokenizer, ChatParams(), 32768, ModelCapabilities())


def request_for(case: Case) -> ChatRequest:
    """The case's request, as a wire format would hand it to the pipeline."""
    tools = tuple(Tool(t["name"], t.get("description"), t.get("parameters") or {"type": "object", "properties": {}})
                  for t in case.tools)
    choice = case.params.get("tool_choice", "auto")
    schema = case.params.get("json_schema")
    output = OutputFormat("json_schema", json.loads(schema)) if schema else OutputFormat()
    return ChatRequest(
        Options("corpus"), tuple(_message(m) for m in case.messages or [Msg("user", "Hey there!")]), tools,
        ToolChoice(choice if choice in ("auto", "none", "required") else "auto"),
        parallel_tool_calls=bool(case.params.get("parallel_tool_calls", False)), output=output,
        thinking=bool(case.params.get("enable_thinking", True)))


def _message(m: Msg) -> Message:
    calls = tuple(ToolCall(c["id"] or f"call{i}", c["name"], c["arguments"] or "{}")
                  for i, c in enumerate(m.tool_calls))
    text = m.content or "\n".join(p["text"] for p in m.content_parts if p["type"] == "text")
    return Message.of(m.role, text, tool_calls=calls, tool_call_id=m.tool_call_id or None,  # type: ignore[arg-type]
                      name=m.tool_name or None, reasoning=m.reasoning_content or None)


def serve(profile: ModelProfile, case: Case, chunks: list[str] | None = None) -> dict[str, Any]:
    """Prepare the case's request as the pipeline does, then parse the case's text."""
    prepared = build_chat(profile, request_for(case))
    text = _text_of(profile, case)
    parser = make_parser(prepared.parser or "generic", reasoning=prepared.parse_reasoning,
                         starts_in_reasoning=prepared.starts_in_reasoning, tools_offered=prepared.tools_offered,
                         tools=prepared.tools, primer=prepared.primer)
    events = [ev for chunk in (chunks if chunks is not None else [text]) for ev in parser.feed(chunk)]
    out = collect([*events, *parser.finish()])
    return {
        "content": out.content.strip(),
        "reasoning": out.reasoning.strip(),
        "tool_calls": [(c.name, json.loads(c.arguments_json)) for c in out.tool_calls],
    }


def split_alike(profile: ModelProfile, case: Case) -> str:
    """"" when the case's text reads the same fed whole and a character at a time, else its id."""
    try:
        whole, chars = serve(profile, case), serve(profile, case, list(_text_of(profile, case)))
    except Exception:  # noqa: BLE001 - a request Tandem refuses: nothing to split
        return ""
    return "" if whole == chars else case.id


def _text_of(profile: ModelProfile, case: Case) -> str:
    end = profile.detection.turn_end if profile.detection else ""
    return case.input[: -len(end)] if end and case.input.endswith(end) else case.input


def expected(case: Case) -> dict[str, Any]:
    e = case.expect
    return {
        "content": e.content.strip(),
        "reasoning": e.reasoning_content.strip(),
        "tool_calls": [(c["name"], _arguments(c["arguments"])) for c in e.tool_calls],
    }


def _arguments(text: str) -> Any:
    try:
        return json.loads(text) if text else {}
    except ValueError:
        return text  # a partial call's cut arguments


def run_case(profile: ModelProfile, case: Case) -> Outcome:
    try:
        got = serve(profile, case)
    except Exception as exc:  # noqa: BLE001 - a request Tandem refuses is an outcome too
        got = {"error": f"{type(exc).__name__}: {exc}"}
    want = expected(case)
    difference = None
    if got != want and "error" not in got:
        difference = next((name for name, shows in DIFFERENCES.items() if shows(case, got)), None)
    elif "error" in got:
        difference = next((name for name, shows in DIFFERENCES.items()
                           if name == "no-continuation" and shows(case, got)), None)
    return Outcome(case, profile.parser, got, want, difference)


@cache
def template_text(root: Path, name: str) -> str:
    return (root / "templates" / name).read_text(encoding="utf-8")
