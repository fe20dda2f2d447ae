"""Recorded model outputs and the ways to chunk them, for the parser tests.

Each file in ``tests/fixtures/parsers`` holds one family's cases: the raw
output of a model in that family's format and the expected content,
reasoning, tool calls and number of errors (and, for the families that write
arguments as text, the offered tools whose schemas say what the text means). A case runs over many chunkings:
one character at a time, the whole text, token-like pieces (markers whole,
as special tokens arrive) and seeded random splits.
"""

from __future__ import annotations

import itertools
import json
import random
import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from app.parsers import Event, collect, make_parser

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "parsers"
_TOKEN = re.compile(r"\[/?[A-Z_]+\]|</?\w+>|<function=|\s+|\w+|.", re.S)
DEFAULT_OPTIONS = {"reasoning": True, "starts_in_reasoning": False, "tools_offered": True}


@dataclass(frozen=True)
class Case:
    """One recorded output and what a parser must make of it."""

    parser: str
    name: str
    output: str
    expected: dict[str, Any]
    options: dict[str, Any] = field(default_factory=dict)

    @property
    def id(self) -> str:
        return f"{self.parser}: {self.name}"


def load_cases() -> list[Case]:
    """Every case of every fixture file."""
    cases = []
    for path in sorted(FIXTURES.glob("*.json")):
        data = json.loads(path.read_text(encoding="utf-8"))
        for raw in data["cases"]:
            # A file's "tools" are the offered tools' schemas (what text values mean).
            options = {**DEFAULT_OPTIONS, "tools": data.get("tools"), **raw.get("options", {})}
            cases.append(Case(data["parser"], raw["name"], raw["output"], raw["expected"], options))
    return cases


def counting_ids() -> Any:
    """A deterministic id factory: call_000...0, call_000...1, ..."""
    counter = itertools.count()
    return lambda: f"call_{next(counter):024d}"


def run(parser: str, options: dict[str, Any], chunks: Iterable[str]) -> list[Event]:
    """Feed the chunks to a fresh parser, then finish it."""
    p = make_parser(parser, id_factory=counting_ids(), **options)
    events: list[Event] = []
    for chunk in chunks:
        events += p.feed(chunk)
    return events + p.finish()


def summary(events: list[Event]) -> dict[str, Any]:
    """What must not depend on chunking: the folded message, arguments decoded."""
    out = collect(events)
    return {
        "content": out.content,
        "reasoning": out.reasoning,
        "tool_calls": [(c.id, c.name, json.loads(c.arguments_json)) for c in out.tool_calls],
        "errors": out.errors,
    }


def tokens(text: str) -> list[str]:
    """Token-like pieces: markers whole, then words, spaces and single symbols."""
    return _TOKEN.findall(text)


def random_split(text: str, seed: int) -> list[str]:
    """Cut ``text`` at a seeded random set of positions."""
    rng = random.Random(seed)
    if len(text) < 2:
        return [text]
    cuts = sorted(rng.sample(range(1, len(text)), rng.randint(1, min(len(text) - 1, 12))))
    return [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]


def chunkings(text: str, seeds: int = 8) -> dict[str, list[str]]:
    """The named chunkings every case must survive."""
    ways = {"whole": [text], "chars": list(text), "tokens": tokens(text)}
    ways.update({f"random-{seed}": random_split(text, seed) for seed in range(seeds)})
    return ways
