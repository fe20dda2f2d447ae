"""How a model writes its tool calls: one small data type per call shape.

Each shape is data that three readers share: the parser reads it
(``app.parsers.call_format``), the grammar forces it
(``app.engine.constrain.constraints``) and detection matches it against what
a model's chat template writes (``app.pipeline.detection``). Markers are
spelled as the grammar writes them, whitespace included; the parsers look for
them without the whitespace at their edges.

    CallSyntax     JSON in markers      <tool_call>{"name": "f", "arguments": {...}}</tool_call>
                   name, then JSON      [TOOL_CALLS]f[ARGS]{...}   <｜tool▁call▁begin｜>f<｜tool▁sep｜>{...}
                   bare JSON            {"name": "f", "arguments": {...}}
    XmlCalls       text values          <function=f><parameter=city>Paris</parameter></function>
                                        <tool_call>f<arg_key>city</arg_key><arg_value>Paris</arg_value></tool_call>
    NestedXmlCalls values as elements   <invoke name="f"><city>Paris</city></invoke>   (MiniMax M3)
    PythonicCalls  Python calls         [f(city="Paris"), g()]
    GemmaCalls     Gemma 4's objects    <|tool_call>call:f{city:<|"|>Paris<|"|>}<tool_call|>
    HarmonyCalls   Harmony messages     <|start|>assistant to=functions.f<|channel|>commentary json<|message|>{...}
    RecipientCalls messages to a tool   <|start|>assistant to=f<|message|><atem:function_calls>...   (muse-glimmer)
"""

from __future__ import annotations

import re
from dataclasses import dataclass

# The placeholders of a format string: {name}, {key}, {value}, and attributes ({index}, {string}, {type}).
PLACEHOLDER = re.compile(r"\{(\w+)\}")


@dataclass(frozen=True)
class CallSyntax:
    """A call whose arguments are one JSON object.

    ``args`` set: ``{begin}{header}{args}{arguments}{end}``, the name in the header
    (Mistral, Llama's ``<function=``, DeepSeek, Kimi); with no ``end`` the arguments
    end where their JSON value does. Unset: ``{begin}`` a JSON object ``{"name":
    ..., "arguments": {...}}`` (or a list of them) ``{end}`` (Qwen, Hermes, Cohere);
    with no ``begin`` either it is bare JSON, the whole answer (the tool note's form).
    Parallel calls are ``separator``-joined, all inside ``section`` when it is set.
    """

    begin: str = ""
    args: str | None = None
    end: str = ""
    separator: str = ""
    # Markers around the whole run of calls (DeepSeek's <｜tool▁calls▁begin｜>, Kimi's section).
    section: tuple[str, str] = ("", "")
    # The header between ``begin`` and ``args``: the name, and what the model writes
    # around it ("functions.{name}:{index}" for Kimi). Read, and written by the grammar.
    header: str = "{name}"
    # The arguments' key in a call object (Llama 3.1's template asks for "parameters");
    # the parser reads either key, and Cohere's "tool_name" for the name.
    arguments_key: str = "arguments"
    # Call objects written as {NAME: arguments} (Apertus).
    keyed: bool = False
    # A JSON list of call objects even for one call (Cohere, Nemotron's <TOOLCALL>).
    listed: bool = False
    # One call object a line, all between ``begin`` and ``end`` (MiniMax M1).
    lines: bool = False
    # Read, never written: a call id the model puts between the name and ``args``
    # (``[TOOL_CALLS]f[CALL_ID]a1b2c3d4e[ARGS]``); our ids replace it.
    id_marker: str = ""
    # A header that is no call: what follows ``args`` is the answer (Functionary's ``>>>all``).
    content_header: str = ""
    # The sentence that asks for this syntax in a tool note (a template that cannot show tools).
    note: str = ""

    @property
    def bare(self) -> bool:
        """A JSON call object (or a list of them) with no markers: the whole answer is the call."""
        return not self.begin and self.args is None


@dataclass(frozen=True)
class XmlCalls:
    """A call whose arguments are elements holding text, one per key.

    ``call``, ``param`` and ``end`` are format strings: ``{name}``, ``{key}`` and
    ``{value}`` are what they say; other placeholders are attributes the model
    writes beside them (DeepSeek's ``string="true"``, Kimi K3's ``type`` and
    ``index``). A value is text; the offered tool's schema says what it means
    (``"5"`` for an integer parameter is ``5``). One newline at each edge of a
    value is the template's layout, not the value.
    """

    call: str
    param: str
    end: str
    section: tuple[str, str] = ("", "")
    separator: str = ""


@dataclass(frozen=True)
class NestedXmlCalls:
    """Arguments as nested elements named by their keys, each preceded by ``tag``:
    ``{tag}<key>value{tag}</key>``; an object's members and an array's ``<item>``s
    nest the same way (MiniMax M3)."""

    tag: str
    call: str
    end: str
    section: tuple[str, str] = ("", "")
    separator: str = ""


@dataclass(frozen=True)
class PythonicCalls:
    """A Python list of calls with keyword arguments: ``[f(city="Paris"), g()]``,
    between ``begin`` and ``end`` (LFM2), or the whole answer when they are empty (Llama 4)."""

    begin: str = ""
    end: str = ""


@dataclass(frozen=True)
class GemmaCalls:
    """Gemma 4: ``{begin}call:NAME{key:value,...}{end}``, strings between ``quote``s,
    keys bare, other values as in JSON."""

    begin: str = "<|tool_call>"
    end: str = "<tool_call|>"
    quote: str = '<|"|>'


@dataclass(frozen=True)
class HarmonyCalls:
    """gpt-oss: a call is a message to ``functions.NAME`` on the commentary channel,
    its arguments a JSON object (read by the Harmony parser, which reads channels)."""

    start: str = "<|start|>assistant"
    recipient: str = " to=functions.{name}"
    channel: str = "<|channel|>commentary"
    constrain: str = " <|constrain|>json"
    message: str = "<|message|>"
    end: str = "<|call|>"


@dataclass(frozen=True)
class RecipientCalls:
    """Messages to recipients (muse-glimmer): `` to=user<|message|>...<|eot|>`` is the answer,
    `` to=self`` reasoning, `` to=NAME`` a call of NAME whose body holds ``body``'s calls
    (read by the Harmony parser, as gpt-oss's channels are)."""

    body: XmlCalls
    message: str = "<|message|>"
    ends: tuple[str, ...] = ("<|eom|>", "<|eot|>")
    start: str = "<|start|>assistant"
    answer: str = "user"
    thought: str = "self"


Syntax = CallSyntax | XmlCalls | NestedXmlCalls | PythonicCalls | GemmaCalls | HarmonyCalls | RecipientCalls


def format_parts(fmt: str) -> list[tuple[str, str]]:
    """A format string as ``(literal, placeholder)`` pairs; the last placeholder is "".

    ``"<parameter={key}>\\n{value}\\n</parameter>"`` ->
    ``[("<parameter=", "key"), (">\\n", "value"), ("\\n</parameter>", "")]``
    """
    parts: list[tuple[str, str]] = []
    at = 0
    for m in PLACEHOLDER.finditer(fmt):
        parts.append((fmt[at : m.start()], m.group(1)))
        at = m.end()
    parts.append((fmt[at:], ""))
    return parts
