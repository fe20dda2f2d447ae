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


@dataclass(frozen=True)
class CallSyntax:
    """How a model writes a tool call: the one description the parser reads and the grammar forces.

    ``args`` set: ``{begin}name{args}{arguments}{end}`` (Mistral, Llama's ``<function=``);
    with no ``end`` the arguments end where their JSON value does.
    Unset: ``{begin}`` a JSON object ``{"name": ..., "arguments": {...}}`` ``{end}`` (Qwen);
    with no ``begin`` either it is bare JSON, the whole answer (the tool note's form).
    Parallel calls are ``separator``-joined; bare JSON ones are a JSON list instead.

    Markers are spelled as the grammar writes them, whitespace included (Qwen's
    ``<tool_call>\\n``); the parser looks for them without the whitespace at their
    edges, which JSON allows anyway.
    """

    begin: str = ""
    args: str | None = None
    end: str = ""
    separator: str = ""
    # The arguments' key in a call object (Llama 3.1's template asks for "parameters");
    # the parser reads either key.
    arguments_key: str = "arguments"
    # Read, never written: a call id the model puts between the name and ``args``
    # (``[TOOL_CALLS]f[CALL_ID]a1b2c3d4e[ARGS]``); our ids replace it.
    id_marker: str = ""
    # The sentence that asks for this syntax in a tool note (a template that cannot show tools).
    note: str = ""

    @property
    def bare(self) -> bool:
        """A JSON call object (or a list of them) with no markers: the whole answer is the call."""
        return not self.begin and self.args is None


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
    templated: tuple[tuple[str, CallSyntax], ...] = ()
    noted: CallSyntax = BARE_JSON
    also_reads: tuple[CallSyntax, ...] = ()
    # The reasoning block the model writes, when neither its template nor its tokenizer says.
    reasoning: tuple[str, str] = THINK
    # Detection (app.parsers.detect): chat-template substrings that say this family, a
    # regular expression for model names when the template says nothing, and one for
    # the names of models that always reason.
    template_hints: tuple[str, ...] = ()
    name_hint: str = ""
    reasoning_names: str = ""
    # Makes tool call ids; a family whose chat template checks ids brings its own.
    call_id: Callable[[], str] = new_call_id
    # A conversation's call id (any client's) as the family's template accepts it.
    fit_call_id: Callable[[str], str] = str

    def call_syntax(self, template: str, template_takes_tools: bool) -> CallSyntax:
        """What the model is told to write, and forced to when a call is required."""
        if template_takes_tools:
            for hint, syntax in self.templated:
                if hint in template:
                    return syntax
        return self.noted

    @property
    def writes(self) -> tuple[CallSyntax, ...]:
        """Every syntax ``call_syntax`` may choose."""
        return _unique((*(syntax for _, syntax in self.templated), self.noted))

    @property
    def reads(self) -> tuple[CallSyntax, ...]:
        """Every syntax the family's parser reads: what it writes, and ``also_reads``."""
        return _unique((*self.writes, *self.also_reads))


def _unique(syntaxes: tuple[CallSyntax, ...]) -> tuple[CallSyntax, ...]:
    return tuple(dict.fromkeys(syntaxes))
