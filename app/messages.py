"""The conversation's typed messages: turns, their text and image parts, tool calls.

A leaf below the pipeline (``app.pipeline.request`` builds requests of them) and
vision (the proxy rewrites them, native vision reads their images), so neither
of those imports the other for them. Plain frozen data; no imports from ``app``.

Text parts of one message are joined with a newline (``Message.text``), the one
rule everywhere, images or not. A part may carry a ``CacheMark``: the client asked the
prefix cache to keep the prompt up to the end of that part (Anthropic's
``cache_control``, OpenAI's ``prompt_cache_breakpoint``). ``param`` fields name where a thing sits in the
client's own request (``messages[1].content[0]``), so errors can point at it.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any, Literal

Role = Literal["system", "user", "assistant", "tool"]


@dataclass(frozen=True)
class CacheMark:
    """A client's prompt-cache breakpoint after a part (or a tool): keep the prompt up to
    there for ``ttl_s`` seconds."""

    ttl_s: int


@dataclass(frozen=True)
class TextPart:
    """A piece of text in a message."""

    text: str
    cache: CacheMark | None = None


@dataclass(frozen=True)
class ImagePart:
    """An image in a message, by URL (``data:``, ``file://`` or ``http(s)://``)."""

    url: str
    # Where the part sits in the client's request, for errors: "messages[1].content[2]".
    param: str = ""
    detail: str | None = None
    cache: CacheMark | None = None


Part = TextPart | ImagePart


@dataclass(frozen=True)
class ToolCall:
    """A call an assistant made, as the conversation carries it back."""

    id: str
    name: str
    # The arguments as JSON text ("{}" when there are none).
    arguments: str = "{}"

    def as_dict(self, *, arguments_as_object: bool = False) -> dict[str, Any]:
        """OpenAI's ``tool_calls[]`` item. Chat templates render arguments with ``| tojson``,
        so they get the object (``arguments_as_object``) when the JSON parses."""
        arguments: Any = self.arguments
        if arguments_as_object:
            try:
                arguments = json.loads(self.arguments)
            except ValueError:
                pass
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": arguments}}


@dataclass(frozen=True)
class Message:
    """One conversation turn."""

    role: Role
    content: tuple[Part, ...] = ()
    name: str | None = None
    tool_calls: tuple[ToolCall, ...] = ()
    # For role "tool": which call this result answers.
    tool_call_id: str | None = None
    # Reasoning an earlier assistant turn carried back (templates may render it).
    reasoning: str | None = None
    # Where the message sits in the client's request, for errors: "messages[3]".
    param: str = ""

    @classmethod
    def of(cls, role: Role, text: str, **kw: Any) -> Message:
        """A text-only message."""
        return cls(role, (TextPart(text),), **kw)

    def text(self) -> str:
        """The text parts, joined with newlines; images are left out."""
        return "\n".join(p.text for p in self.content if isinstance(p, TextPart))

    def images(self) -> list[ImagePart]:
        return [p for p in self.content if isinstance(p, ImagePart)]

    def with_text(self, text: str) -> Message:
        """This message with its content replaced by ``text`` alone; a cache mark on a part it
        replaces (an image the vision proxy captioned) moves to the message's end."""
        marks = [p.cache for p in self.content if p.cache is not None]
        mark = max(marks, key=lambda m: m.ttl_s) if marks else None
        return replace(self, content=(TextPart(text, mark),))


def merge_turns(messages: Sequence[Message]) -> list[Message]:
    """Consecutive user (or assistant) turns as one: their parts, tool calls and reasoning in
    order. System messages in between do not separate them (``gather_system`` moves those to
    the front). Anthropic's Messages API defines its turns so; for every format, a template
    that demands alternating turns (``ModelProfile.alternating``) gets them this way, where
    Codex sends its environment context and its prompt as two user messages."""
    out: list[Message] = []
    last = -1  # where in out the last non-system message is
    for m in messages:
        prev = out[last] if last >= 0 else None
        if prev is not None and m.role == prev.role and m.role in ("user", "assistant"):
            reasoning = "\n".join(r for r in (prev.reasoning, m.reasoning) if r) or None
            out[last] = replace(prev, content=prev.content + m.content, tool_calls=prev.tool_calls + m.tool_calls,
                                reasoning=reasoning)
            continue
        out.append(m)
        if m.role != "system":
            last = len(out) - 1
    return out
