"""What a model family is: a reasoning block, a tool-call syntax, and the hints that find it.

A ``Family`` is data. Three parts of the server read it, so that what the model
is told, what it is forced to write and what is parsed back are one description:

    Family.call_syntax(template, takes_tools) -> CallSyntax
        the prompt (app.pipeline.prompting)   which syntax the model is told; the tool note's sentence
        the grammar (app.engine.constrain.constraints)  forces that syntax for tool_choice required / named
        the parser (app.parsers)              reads every syntax in ``Family.reads``

A syntax the grammar may force is always one the family's parser reads
(``writes`` is part of ``reads``), and tests/families checks that what the
grammar lets through parses back to the same calls.
"""

from __future__ import annotations

import secrets
import string
from collections.abc import Callable
from dataclasses import dataclass

from app.families.syntax import CallSyntax, HarmonyCalls, NestedXmlCalls, RecipientCalls, Syntax, XmlCalls

# Every reasoning block a model is known to write; every family's parser reads them all
# (templates that open one block sometimes get another from the model).
REASONING_MARKERS: tuple[tuple[str, str], ...] = (
    ("<think>", "</think>"),
    ("[THINK]", "[/THINK]"),
    ("<reasoning>", "</reasoning>"),
    ("<thought>", "</thought>"),
)
THINK = REASONING_MARKERS[0]

_ID_ALPHABET = string.ascii_letters + string.digits


def new_call_id() -> str:
    """A fresh OpenAI-style tool call id: ``call_`` and 24 letters or digits."""
    return "call_" + "".join(secrets.choice(_ID_ALPHABET) for _ in range(24))


# What the tool note asks for; every family reads it, and generic models write nothing else.
BARE_JSON = CallSyntax(
    note='To call one, answer with only a JSON object {"name": <function name>, "arguments": <arguments object>}.'
)


@dataclass(frozen=True)
class Family:
    """A model family's output format and how to recognise its models.

    ``templated`` pairs a chat-template substring with the syntax the model
    writes when that template renders the tools ("" matches any template;
    the first match wins). ``noted`` is what the tool note asks for when the
    template cannot render tools. The parser also reads ``also_reads``.
    """

    name: str
    templated: tuple[tuple[str, Syntax], ...] = ()
    noted: CallSyntax = BARE_JSON
    also_reads: tuple[Syntax, ...] = ()
    # The reasoning blocks the family's models write, its own first (the one a budget closes
    # and the grammar lets through); the parser reads these and every shared one.
    reasoning: tuple[tuple[str, str], ...] = (THINK,)
    # Markers that are structure, not text: dropped wherever they stand (Cohere's
    # <|START_RESPONSE|>, Kimi K3's response tags). Call sections are dropped too.
    dropped: tuple[str, ...] = ()
    # A call the model writes inside its reasoning block: a call (the block ends there, as
    # DeepSeek, Kimi and Ling write them), or part of the reasoning (Hermes-style templates,
    # whose models think about calls in <think>). See docs/guides/tool-calls.md.
    calls_in_reasoning: bool = True
    # Detection's fallback, when the template writes no call a family reads (app.parsers.detect):
    # chat-template substrings that say this family (a tuple: all of them), a regular expression
    # for model names when the template says nothing, one for the names of models that always reason.
    template_hints: tuple[str | tuple[str, ...], ...] = ()
    name_hint: str = ""
    reasoning_names: str = ""
    # Makes tool call ids; a family whose chat template checks ids brings its own.
    call_id: Callable[[], str] = new_call_id
    # A conversation's call id (any client's) as the family's template accepts it.
    fit_call_id: Callable[[str], str] = str
    # How the family's template writes a call's id, when it writes its own: earlier calls
    # and their results get ids in this form ({name}, {index}: its place in its turn).
    call_id_format: str = ""

    def call_syntax(self, template: str, template_takes_tools: bool) -> Syntax:
        """What the model is told to write, and forced to when a call is required."""
        if template_takes_tools:
            for hint, syntax in self.templated:
                if hint in template:
                    return syntax
        return self.noted

    @property
    def writes(self) -> tuple[Syntax, ...]:
        """Every syntax ``call_syntax`` may choose (a Harmony template always renders the
        tools, so a channels family is never told the tool note's form)."""
        noted = () if self.channels else (self.noted,)
        return _unique((*(syntax for _, syntax in self.templated), *noted))

    @property
    def reads(self) -> tuple[Syntax, ...]:
        """Every syntax the family's parser reads: what it writes, and ``also_reads``."""
        return _unique((*self.writes, *self.also_reads))

    @property
    def reasoning_pairs(self) -> tuple[tuple[str, str], ...]:
        """Every reasoning block the parser reads: the family's, then the shared ones
        (templates that open one block sometimes get another from the model)."""
        return tuple(dict.fromkeys((*self.reasoning, *REASONING_MARKERS)))

    @property
    def sections(self) -> tuple[str, ...]:
        """The markers around runs of calls, which the parser drops when tools are offered."""
        sectioned = (s for s in self.reads if isinstance(s, (CallSyntax, XmlCalls, NestedXmlCalls)))
        return tuple(dict.fromkeys(m.strip() for s in sectioned for m in s.section if m.strip()))

    @property
    def channels(self) -> bool:
        """Whether the family writes messages with headers rather than markers (gpt-oss's
        Harmony channels, muse-glimmer's recipients)."""
        return any(isinstance(s, (HarmonyCalls, RecipientCalls)) for _, s in self.templated)


def _unique(syntaxes: tuple[Syntax, ...]) -> tuple[Syntax, ...]:
    return tuple(dict.fromkeys(syntaxes))
