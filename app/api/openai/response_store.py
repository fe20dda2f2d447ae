"""The Responses API's server-side state: stored responses, for ``previous_response_id`` and GET.

What is kept, per response created with ``store`` (OpenAI's default, true):
the response object as ``GET /v1/responses/{id}`` returns it, and the
conversation as input items (the chain it continued, its own input, its output),
which a request naming it as ``previous_response_id`` continues from.
``instructions`` are not kept in the conversation: as at OpenAI, each request
gives its own.

How long: in memory only, least recently used first out, within two bounds
(``server.responses_store_entries`` and ``server.responses_store_mb``); a
response larger than the byte bound on its own is not kept. A restart forgets
everything. ``store: false`` keeps nothing, so Codex (which sends it) leaves no
trace here. Each API key sees only the responses created with it (``CLIENT``).

Every call runs on the event loop without awaiting, so no lock is needed.
"""

from __future__ import annotations

import json
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

from app.errors import NotFoundError
from app.request_context import CLIENT


@dataclass(frozen=True)
class StoredResponse:
    """One kept response."""

    # The response object, as GET returns it.
    response: dict[str, Any]
    # The whole conversation as input items: the chain it continued, its input, its output.
    items: list[dict[str, Any]]
    # The JSON size of the two, what the byte bound counts.
    nbytes: int


class ResponseStore:
    """A bounded LRU of stored responses, by API key and response id."""

    def __init__(self, max_entries: int, max_bytes: int) -> None:
        self.max_entries = max_entries
        self.max_bytes = max_bytes
        self.nbytes = 0
        self._entries: OrderedDict[tuple[str, str], StoredResponse] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def put(self, response: dict[str, Any], items: list[dict[str, Any]]) -> bool:
        """Keep ``response`` (evicting the least recently used to make room); False when it
        alone is larger than the byte bound, or the store holds nothing."""
        nbytes = len(json.dumps(response, ensure_ascii=False)) + len(json.dumps(items, ensure_ascii=False))
        if self.max_entries == 0 or nbytes > self.max_bytes:
            return False
        key = (CLIENT.get(), response["id"])
        self._drop(key)
        while self._entries and (len(self._entries) >= self.max_entries or self.nbytes + nbytes > self.max_bytes):
            self._drop(next(iter(self._entries)))
        self._entries[key] = StoredResponse(response, items, nbytes)
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
