"""Request bodies: counted before they are decoded, and not kept once the route has its model.

Every route reads its JSON body through ``BoundedRequest.json`` (Litestar's
``request_class``). Two costs of a body are not its bytes:

- **Values.** ``"x": [{}, {}, ...]`` in a field the server ignores is 3 bytes a
  value on the wire and about 70 once decoded: 32 MB of it (``server.max_body_bytes``)
  decodes to a few GB. The body's values are counted first on its bytes, and past
  ``server.max_json_values`` it is a 413 before anything is decoded (as msgspec's
  own limit refuses a body nested too deeply).
- **Lifetime.** Litestar keeps the decoded JSON on the request and in the ASGI
  scope's state, so whatever holds the scope past the request holds the body: a
  reference cycle does, until a full collection, which bodies of many small
  objects rarely set off. The route gets its typed model and nothing else keeps
  the decoded JSON; the scope's state is emptied when the request ends
  (``app.httpserver``), and the cycles that held it are broken where they began
  (``app.httpserver``, ``app.api.streaming``, ``app.api.errors.release_frames``).
"""

from __future__ import annotations

from typing import Any

import anyio
import numpy as np
from litestar import Request
from litestar.serialization import decode_json

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


class BoundedRequest(Request[Any, Any, Any]):
    """Litestar's request, whose JSON body is counted before decoding and never cached."""

    async def json(self) -> Any:
        body = await self.body()
        limit = self.app.state.tandem.settings.max_json_values
        if not within_json_values(body, limit):  # near the limit: counted off the event loop
            refuse_past(await anyio.to_thread.run_sync(count_json_values, body), limit)
        # Not kept on the request or in the scope's state, as Litestar would: the route's model
        # holds what it needs, and a cached copy lives as long as whatever holds the scope.
        return decode_json(body or b"null", type_decoders=self.route_handler.resolve_type_decoders())
