"""Request bodies: counted before they are decoded, and not kept once the route has its model.

Every route reads its JSON body through ``BoundedRequest.json`` (Litestar's
``request_class``). Three costs of a body are not its bytes:

- **Values.** ``"x": [{}, {}, ...]`` in a field the server ignores is 3 bytes a
  value on the wire and about 70 once decoded: 32 MB of it (``server.max_body_bytes``)
  decodes to a few GB. The body's values are counted first on its bytes, and past
  ``server.max_json_values`` it is a 413 before anything is decoded (as msgspec's
  own limit refuses a body nested too deeply).
- **Objects.** A top-level member the route's model does not read is never decoded
  (``decode_body``): padding in an ignored field costs its bytes, not a quarter of a
  million Python objects whose arenas outlive them.
- **Lifetime.** Litestar keeps the decoded JSON on the request and in the ASGI
  scope's state, so whatever holds the scope past the request holds the body: a
  reference cycle does, until a full collection, which bodies of many small
  objects rarely set off. The route gets its typed model and nothing else keeps
  the decoded JSON; the scope's state is emptied when the request ends
  (``app.httpserver``), and the cycles that held it are broken where they began
  (``app.httpserver``, ``app.api.streaming``, ``app.api.errors.release_frames``).
"""

from __future__ import annotations

import functools
from typing import Any

import anyio
import msgspec
import numpy as np
from litestar import Request
from litestar.serialization import decode_json
from litestar.types import TypeDecodersSequence
from pydantic import BaseModel

from app.errors import PayloadTooLargeError

# Bytes of JSON's structure; whitespace is at most a space (a control byte is no JSON outside strings).
_QUOTE, _COMMA, _OPEN_ARRAY, _CLOSE_ARRAY, _OPEN_OBJECT, _CLOSE_OBJECT, _SPACE = b'",[]{} '
# Bytes counted at a time: the work arrays stay a few times this, whatever the body's size.
_CHUNK = 1 << 22


def count_json_values(body: bytes) -> int:
    """The values in a JSON document: every array item and object member value, every
    container, the document itself (object keys are not counted). Exact for valid JSON.

    Each value after a container's first follows a comma, and each non-empty container
    has a first: values = 1 + commas + non-empty containers, all outside strings. Vectorized
    (numpy, a chunk at a time): about 20 ms a MB, however many strings the body holds.
    """
    # Escapes become two plain bytes (pairs from the left, as JSON reads them), so every quote left
    # opens or closes a string; the length is unchanged.
    plain = body.replace(b"\\\\", b"__").replace(b'\\"', b"__")
    separators = empty = 0
    inside = 0  # whether the chunk starts inside a string
    last = 0  # the previous chunk's last structural byte
    for start in range(0, len(plain), _CHUNK):
        raw = np.frombuffer(plain, dtype=np.uint8, count=min(_CHUNK, len(plain) - start), offset=start)
        # A string runs from its opening quote up to its closing one, which counts as outside.
        quotes = np.cumsum(raw == _QUOTE, dtype=np.uint8)  # wraps at 256: only its parity is read
        outside = ((quotes + inside) & 1) == 0
        inside = (inside + int(quotes[-1])) & 1
        structure = raw[outside & (raw > _SPACE)]
        if not structure.size:
            continue
        separators += int(np.count_nonzero((structure == _COMMA) | (structure == _OPEN_ARRAY)
                                           | (structure == _OPEN_OBJECT)))
        pairs = np.concatenate((np.array([last], dtype=np.uint8), structure))
        opens, closes = pairs[:-1], pairs[1:]
        empty += int(np.count_nonzero(((opens == _OPEN_ARRAY) & (closes == _CLOSE_ARRAY))
                                      | ((opens == _OPEN_OBJECT) & (closes == _CLOSE_OBJECT))))
        last = int(structure[-1])
    return 1 + separators - empty


def within_json_values(body: bytes, limit: int) -> bool:
    """Whether ``body`` surely holds at most ``limit`` values: an upper bound, three C passes
    over the bytes (separators inside strings counted too). False: count them."""
    return 1 + body.count(b",") + body.count(b"[") + body.count(b"{") <= limit


def check_json_values(body: bytes, limit: int) -> None:
    """413 when ``body`` holds more than ``limit`` JSON values, before decoding any of them."""
    if not within_json_values(body, limit):
        refuse_past(count_json_values(body), limit)


def refuse_past(values: int, limit: int) -> None:
    if values > limit:
        raise PayloadTooLargeError(
            f"request body has {values} JSON values; at most {limit} are accepted (server.max_json_values)")


@functools.cache
def top_level_fields(model: type[BaseModel]) -> frozenset[str] | None:
    """The top-level keys ``model`` reads (field names and aliases), or None when it refuses
    unknown keys (``extra="forbid"``: they must reach it, to be refused)."""
    if model.model_config.get("extra") == "forbid":
        return None
    keys: set[str] = set()
    for name, info in model.model_fields.items():
        keys.add(name)
        for alias in (info.alias, info.validation_alias):
            if isinstance(alias, str):
                keys.add(alias)
    return frozenset(keys)


def decode_body(body: bytes, model: Any, decoders: TypeDecodersSequence | None = None) -> Any:
    """``body``'s JSON as the route's ``model`` reads it. A model that ignores unknown keys gets
    only the top-level members it knows: the others are checked (JSON syntax, UTF-8) but never
    decoded, so `"x": [{}, {}, ...]` costs no Python objects. Those objects, a quarter of a
    million per 0.9 MB, left pymalloc arenas pinned by whatever else was allocated while they
    lived: RSS crept by ~25 MB per 200 such bodies sent four at a time, though no object survived."""
    known = top_level_fields(model) if isinstance(model, type) and issubclass(model, BaseModel) else None
    if known is not None:
        try:
            members = msgspec.json.decode(body, type=dict[str, msgspec.Raw])
        except msgspec.MsgspecError:
            members = None  # not a JSON object: the full decode below gives the error
        if members is not None:
            kept = {}
            for key, raw in members.items():
                if key in known:
                    kept[key] = decode_json(raw, type_decoders=decoders)
                else:
                    str(raw, "utf-8")  # JSON is UTF-8 throughout: a skipped member is checked too
            return kept
    return decode_json(body or b"null", type_decoders=decoders)


class BoundedRequest(Request[Any, Any, Any]):
    """Litestar's request, whose JSON body is counted before decoding and never cached."""

    async def json(self) -> Any:
        body = await self.body()
        limit = self.app.state.tandem.settings.max_json_values
        if not within_json_values(body, limit):  # near the limit: counted off the event loop
            refuse_past(await anyio.to_thread.run_sync(count_json_values, body), limit)
        # Not kept on the request or in the scope's state, as Litestar would: the route's model
        # holds what it needs, and a cached copy lives as long as whatever holds the scope.
        field = self.route_handler.parsed_data_field
        return decode_body(body, field.annotation if field is not None else None,
                           self.route_handler.resolve_type_decoders())
