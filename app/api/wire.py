"""What every wire format's models and renderers share: the lenient request base and response ids.

Each format (OpenAI chat and completions, Responses, Anthropic Messages, AG-UI) keeps its
own package and never imports another's module (tests/test_layering.py); the few pieces
they all need live here, below them, written once.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable
from typing import Annotated, Any

from pydantic import BaseModel, BeforeValidator, ConfigDict
from pydantic_core import PydanticCustomError

from app.errors import InvalidRequestError


class Lenient(BaseModel):
    """A request model that accepts and ignores unknown fields: clients send many
    (``user``, ``store``, ``metadata``, ...), and rejecting them would break the SDKs."""

    model_config = ConfigDict(extra="allow")


def _json_bool(value: Any) -> Any:
    if not isinstance(value, bool):
        raise PydanticCustomError("bool_type", "Input should be a valid boolean: true or false")
    return value


# A request's boolean: JSON's true or false, nothing else. pydantic's lax mode reads "yes", "no",
# "on", 0 and 1 as booleans (Litestar validates with strict=False, which overrides a field's
# own StrictBool), so `"pinned": "yes"` pinned a model; this check runs whatever the mode.
JsonBool = Annotated[bool, BeforeValidator(_json_bool)]


def new_id(prefix: str, sep: str = "-", hex_chars: int = 24) -> str:
    """A response or item id: ``chatcmpl-…`` and ``cmpl-…`` in OpenAI's chat and completions,
    ``resp_…`` / ``msg_…`` in the Responses API and Anthropic's Messages."""
    return f"{prefix}{sep}{uuid.uuid4().hex[:hex_chars]}"


# The tag of a content part whose type none of a format's part models has (``part_tag``).
UNSUPPORTED = "unsupported"


class UnsupportedPart(Lenient):
    """A content part of a type this server does not take (vLLM's ``video_url``, OpenAI's
    ``input_audio``, Anthropic's ``document``). Parsed rather than refused by validation, so
    the 400 names the part and its type instead of what every other part model expected."""

    type: str

    def refused(self, where: str, takes: str) -> InvalidRequestError:
        """The error to raise for this part at ``where``; ``takes`` lists the types served."""
        return InvalidRequestError(f"{where}: content of type {self.type!r} is not supported; this server takes "
                                   f"{takes}", param=where)


def part_tag(tags: dict[str, str]) -> Callable[[Any], str | None]:
    """A pydantic discriminator for content parts told apart by ``type``: the member's tag for
    each type in ``tags``, ``UNSUPPORTED`` for any other string (None, a validation error, when
    the part has no type at all)."""

    def tag(v: Any) -> str | None:
        kind = v.get("type") if isinstance(v, dict) else getattr(v, "type", None)
        return tags.get(kind, UNSUPPORTED) if isinstance(kind, str) else None

    return tag
