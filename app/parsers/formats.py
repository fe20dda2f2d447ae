"""Which reader reads which call shape: ``call_format(syntax)``.

Each shape of ``app.families.syntax`` has one reader module here; this is the
one place that maps the data to them, as the grammar's ``constraints`` module
maps it to grammars.
"""

from __future__ import annotations

from app.families.syntax import (
    CallSyntax,
    GemmaCalls,
    HarmonyCalls,
    NestedXmlCalls,
    PythonicCalls,
    RecipientCalls,
    Syntax,
    XmlCalls,
)
from app.parsers.calls import CallFormat
from app.parsers.shapes.gemma_calls import GemmaFormat
from app.parsers.shapes.named_calls import json_format
from app.parsers.shapes.nested_xml import NestedXmlFormat
from app.parsers.shapes.pythonic import PythonicFormat
from app.parsers.shapes.xml_calls import XmlFormat


def call_format(syntax: Syntax) -> CallFormat | None:
    """The format that reads ``syntax``; None for the shapes the parser finds without a
    marker (bare JSON, opened by the parser itself) or reads in its own way (Harmony)."""
    match syntax:
        case CallSyntax():
            return None if syntax.bare else json_format(syntax)
        case XmlCalls():
            return XmlFormat.of(syntax)
        case NestedXmlCalls():
            return NestedXmlFormat(syntax)
        case PythonicCalls():
            return PythonicFormat(syntax) if syntax.begin else None
        case GemmaCalls():
            return GemmaFormat(syntax)
        case HarmonyCalls() | RecipientCalls():
            return None
    raise TypeError(f"no reader for {syntax!r}")
