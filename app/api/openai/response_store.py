"""The Responses API's server-side state: stored responses, for ``previous_response_id`` and GET.

What is kept, per response created with ``store`` (OpenAI's default, true):
the response object as ``GET /v1/responses/{id}`` returns it, and the
conversation as input items (the chain it continued, its own input, its output),
which a request naming it as ``previous_response_id`` continues from. Every item
has an ``id`` (one is given to input items that came without); the items before
the output are what ``GET /v1/responses/{id}/input_items`` lists.
``instructions`` are not kept in the conversation: as at OpenAI, each request
gives its own.

How long: in memory only, least recently used first out, within two bounds
(``server.responses_store_entries`` and ``server.responses_store_mb``); a
response larger than the byte bound on its own is not kept. Each is kept as its
JSON text, so the byte bound counts the memory it holds (decoded on each read:
a GET or a ``previous_response_id``). A restart forgets
everything. ``store: false`` keeps nothing, so Codex (which sends it) leaves no
trace here. Each API key sees only the responses created with it (``CLIENT``).

Every call runs on the event loop without awaiting, so no lock is needed.
"""

from __future__ import annotations

import json
import sys
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

from app.api.wire import new_id
from app.errors import NotFoundError
from app.request_context import CLIENT

# OpenAI's id prefix of each input item type, for items a client sent without an id.
_ID_PREFIX = {"message": "msg", "function_call": "fc", "function_call_output": "fco", "reasoning": "rs"}


@dataclass(frozen=True)
class StoredResponse:
    """One kept response, as JSON text: what the byte bound counts is what it holds. Kept as
    Python objects, two responses with 24 MB of ``{}`` each held ~880 MB in a "64 MB" store."""

    # The response object, as GET returns it.
    response_json: bytes
    # The whole conversation as input items: the chain it continued, its input, its output.
    items_json: bytes
    # How many of the items came before its output: what the model was given.
    inputs: int

    @property
    def response(self) -> dict[str, Any]:
        return dict(json.loads(self.response_json))

    @property
    def items(self) -> list[dict[str, Any]]:
        return list(json.loads(self.items_json))

    @property
    def input_items(self) -> list[dict[str, Any]]:
        """The items the model was given for it: the chain it continued and its own input."""
        return self.items[:self.inputs]

    @property
    def nbytes(self) -> int:
        """The memory it holds: its two texts with their object headers."""
        return sys.getsizeof(self.response_json) + sys.getsizeof(self.items_json)


def _json(value: Any) -> bytes:
    return json.dumps(value, ensure_ascii=False, separators=(",", ":")).encode()


class ResponseStore:
    """A bounded LRU of stored responses, by API key and response id."""

    def __init__(self, max_entries: int, max_bytes: int) -> None:
        self.max_entries = max_entries
        self.max_bytes = max_bytes
        self.nbytes = 0
        self._entries: OrderedDict[tuple[str, str], StoredResponse] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def put(self, response: dict[str, Any], items: list[dict[str, Any]], inputs: int | None = None) -> bool:
        """Keep ``response`` with its conversation ``items``, the first ``inputs`` of them
        (all, when None) what it was given (evicting the least recently used to make room);
        False when it alone is larger than the byte bound, or the store holds nothing."""
        if self.max_entries == 0:
            return False
        items = [item if "id" in item else {"id": new_id(_ID_PREFIX.get(str(item.get("type")), "item"), "_"), **item}
                 for item in items]
        entry = StoredResponse(_json(response), _json(items), len(items) if inputs is None else inputs)
        nbytes = entry.nbytes
        if nbytes > self.max_bytes:
            return False
        key = (CLIENT.get(), response["id"])
        self._drop(key)
        while self._entries and (len(self._entries) >= self.max_entries or self.nbytes + nbytes > self.max_bytes):
            self._drop(next(iter(self._entries)))
        self._entries[key] = entry
        self.nbytes += nbytes
        return True

    def get(self, response_id: str, param: str | None = None) -> StoredResponse:
        """The stored response ``response_id`` (now the most recently used); 404 when it was
        never stored, was evicted, or belongs to another API key."""
        key = (CLIENT.get(), response_id)
        entry = self._entries.get(key)
        if entry is None:
            what = "Previous response" if param == "previous_response_id" else "Response"
            raise NotFoundError(f"{what} with id {response_id!r} not found (never stored, evicted, or from "
                                "before a restart)", param=param,
                                code="previous_response_not_found" if param else "response_not_found")
        self._entries.move_to_end(key)
        return entry

    def delete(self, response_id: str) -> None:
        """Forget ``response_id``; 404 when it is not stored."""
        self.get(response_id)
        self._drop((CLIENT.get(), response_id))

    def _drop(self, key: tuple[str, str]) -> None:
        old = self._entries.pop(key, None)
        if old is not None:
            self.nbytes -= old.nbytes
