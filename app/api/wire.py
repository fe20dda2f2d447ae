"""What every wire format's models and renderers share: the lenient request base and response ids.

Each format (OpenAI chat and completions, Responses, Anthropic Messages, AG-UI) keeps its
own package and never imports another's module (tests/test_layering.py); the few pieces
they all need live here, below them, written once.
"""

from __future__ import annotations

import uuid

from pydantic import BaseModel, ConfigDict


class Lenient(BaseModel):
    """A request model that accepts and ignores unknown fields: clients send many
    (``user``, ``store``, ``metadata``, ...), and rejecting them would break the SDKs."""

    model_config = ConfigDict(extra="allow")


def new_id(prefix: str, sep: str = "-", hex_chars: int = 24) -> str:
    """A response or item id: ``chatcmpl-…`` and ``cmpl-…`` in OpenAI's chat and completions,
    ``resp_…`` / ``msg_…`` in the Responses API and Anthropic's Messages."""
    return f"{prefix}{sep}{uuid.uuid4().hex[:hex_chars]}"
