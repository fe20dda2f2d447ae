"""Mistral, Ministral, Magistral, Devstral: ``[THINK]`` and ``[TOOL_CALLS]``.

Raw output of newer models (Ministral 3, Magistral, Mistral Small 3.2; one
``[TOOL_CALLS]`` per call; Ministral reasoning opens ``[THINK]`` in its template
when thinking is on)::

    [THINK]The user wants the weather in Paris.[/THINK]
    [TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}[TOOL_CALLS]get_time[ARGS]{"tz": "CET"}

Some templates write a call id: ``[TOOL_CALLS]get_weather[CALL_ID]a1b2c3d4e[ARGS]{...}``
(our ids replace it). Older models (v3 tokenizer, Mistral 7B v0.3, Mixtral)::

    [TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris"}}]

There is no end marker: the arguments end with their JSON value. These are
the two shapes mlx-lm's ``tool_parsers/mistral.py`` reads whole; forced calls
are the first. ``[TOOL_CALLS]``, ``[ARGS]`` and ``[THINK]`` are special tokens
in Mistral tokenizers, and the grammar forces the token, not its spelling.
"""

from __future__ import annotations

import hashlib
import secrets
import string

from app.families.family import CallSyntax, Family

_ALNUM = string.ascii_letters + string.digits

CALLS = CallSyntax(begin="[TOOL_CALLS]", args="[ARGS]", id_marker="[CALL_ID]")


def mistral_call_id() -> str:
    """Mistral chat templates refuse tool call ids that are not 9 letters or digits."""
    return "".join(secrets.choice(_ALNUM) for _ in range(9))


def fit_mistral_call_id(call_id: str) -> str:
    """A conversation's call id as a Mistral template accepts it: as it is when it is 9
    letters or digits, else 9 derived from it (the same for the call and its result), so
    ids another server or model made (``call_...``, ``toolu_...``) do not fail the request."""
    if len(call_id) == 9 and all(ch in _ALNUM for ch in call_id):
        return call_id
    n = int.from_bytes(hashlib.sha256(call_id.encode()).digest()[:8], "big")
    out = []
    for _ in range(9):
        n, r = divmod(n, len(_ALNUM))
        out.append(_ALNUM[r])
    return "".join(out)


FAMILY = Family(
    "mistral",
    templated=(("", CALLS),),
    reasoning=(("[THINK]", "[/THINK]"),),
    # Magistral thinks about calls in [THINK] before it makes one (llama.cpp reads them so too).
    calls_in_reasoning=False,
    template_hints=("[TOOL_CALLS]", "[THINK]"),
    name_hint=r"mistral|ministral|magistral|devstral|mixtral|codestral|pixtral",
    reasoning_names=r"magistral",  # always reasons
    call_id=mistral_call_id,
    fit_call_id=fit_mistral_call_id,
)
