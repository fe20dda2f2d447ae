"""A Lark grammar (llguidance's dialect) under construction: named rules, markers as tokens.

Shared by the constraint writers (``constraints`` for the JSON shapes, ``call_shapes``
for the others). A marker that is one special token of the tokenizer (``[TOOL_CALLS]``,
``<|"|>``) is written as that token, never as its spelling in text.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

# JSON whitespace allowed at each place JSON allows it: a few spaces, or one line
# break and an indent. Bounded, so a small model cannot pad forever.
JSON_WHITESPACE = r"[ \t]{0,4}|\r?\n[ \t]{0,32}"

# Token id of a marker that is one special token, else None.
SpecialLookup = Callable[[str], int | None]


def literal(s: str) -> str:
    """A Lark string literal."""
    return json.dumps(s, ensure_ascii=False)


def json_item(schema: dict[str, Any], strict: bool) -> str:
    """An inline ``%json`` item with our whitespace bound (the user's own options are replaced)."""
    options = {"whitespace_pattern": JSON_WHITESPACE, "lenient": not strict}
    return "%json " + json.dumps({**schema, "x-guidance": options}, ensure_ascii=False)


@dataclass
class Lark:
    """A grammar under construction: named rules, in order."""

    special: SpecialLookup
    special_texts: Sequence[str]
    eos: Sequence[int]
    rules: list[str] = field(default_factory=list)
    _names: dict[str, int] = field(default_factory=dict)

    def rule(self, name: str, body: str) -> str:
        self.rules.append(f"{name}: {body}")
        return name

    def fresh(self, stem: str) -> str:
        """A rule name not used yet."""
        n = self._names[stem] = self._names.get(stem, -1) + 1
        return f"{stem}_{n}"

    def text(self, s: str) -> str:
        """Lark items spelling ``s``: special tokens as ``<[id]>``, the rest as literals."""
        items: list[str] = []
        rest = s
        while rest:
            at, tok = min(((rest.find(t), t) for t in self.special_texts if t in rest), default=(-1, ""))
            if at < 0:
                items.append(literal(rest))
                break
            if at:
                items.append(literal(rest[:at]))
            items.append(f"<[{self.special(tok)}]>")
            rest = rest[at + len(tok):]
        return " ".join(items)

    def text_until(self, closer: str, low: int = 0, high: int | None = None) -> str:
        """Free text, then ``closer`` (which the text cannot hold): a tool argument's text value,
        a reasoning block. A closer that begins with a special token is that token, after any
        tokens but it and EOS; a text closer ends the shortest text that reaches it. ``low`` and
        ``high`` bound the text's characters (a string parameter's minLength and maxLength)."""
        first = next((t for t in self.special_texts if closer.startswith(t)), None)
        if first is not None and not low and high is None:
            token = self.special(first)
            banned = ",".join(str(t) for t in (token, *self.eos))
            rest = closer[len(first):]
            return " ".join(p for p in (f"<[^{banned}]>*", f"<[{token}]>", self.text(rest) if rest else "") if p)
        at = min((closer.find(t) for t in self.special_texts if t in closer), default=-1)
        head, tail = (closer, "") if at < 0 else (closer[:at], closer[at:])
        count = "*" if not low and high is None else f"{{{low},{'' if high is None else high}}}"
        name = self.fresh("text")
        if head:
            self.rules.append(f"{name}[suffix={literal(head)}]: /(.|\\n){count}/")
        else:  # a special token closes it: the text is bounded by the count alone
            self.rules.append(f"{name}: /(.|\\n){count}/")
        return " ".join(p for p in (name, self.text(tail) if tail else "") if p)

    def bounded(self, item: str, sep: str, most: int) -> str:
        """``item`` one to ``most`` times, ``sep``-joined."""
        if most <= 1:
            return item
        more = f"({sep} {item})" if sep else item
        return f"{item} {more}{{0,{most - 1}}}"
