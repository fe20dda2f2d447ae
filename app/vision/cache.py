"""Caption cache: an LRU of captions keyed by image pixels, prompt, model and partition.

Chat UIs such as Open WebUI send the whole conversation on every turn, images
included, so without this cache every turn would caption every earlier image
again. The image's part of the key is the hash of its decoded pixels as the
captioner sees them (``app.engine.prompt.pixel_digest``), not of its bytes: one
picture sent as PNG, as lossless WebP or from another URL is captioned once, as
a native VLM's vision-feature cache encodes it once. Like the prefix cache, it is
partitioned by the request's cache namespace (its API key under ``prompt_cache_scope:
per_key``, and its ``cache_salt``): a hit answers in microseconds where a caption takes
tens of milliseconds or more, so a shared entry would tell one key that another sent
that picture. It lives on the event loop (no lock): the proxy is its only user.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import NamedTuple


class CaptionKey(NamedTuple):
    """What a caption depends on."""

    pixels: str  # sha256 of the decoded pixels the captioner takes (``pixel_digest``)
    prompt: str  # the text the VLM was asked with
    model: str  # the captioner's name
    scope: str  # the request's cache namespace (``Pipeline.cache_namespace``): "" when unpartitioned


class CaptionCache:
    """Least-recently-used captions, bounded by entry count, with hit/miss counters."""

    def __init__(self, max_entries: int = 512) -> None:
        # 512 captions of ~1 KB each: well under a megabyte.
        if max_entries < 0:
            raise ValueError("max_entries must be >= 0")
        self.max_entries = max_entries
        self.hits = 0
        self.misses = 0
        self.evictions = 0
        # UTF-8 bytes of the captions held.
        self.bytes = 0
        self._entries: OrderedDict[CaptionKey, str] = OrderedDict()

    def get(self, key: CaptionKey) -> str | None:
        """The cached caption for ``key`` (now most recently used), or None."""
        caption = self._entries.get(key)
        if caption is None:
            self.misses += 1
            return None
        self._entries.move_to_end(key)
        self.hits += 1
        return caption

    def put(self, key: CaptionKey, caption: str) -> None:
        """Store ``caption``, evicting the least recently used entry when full."""
        if self.max_entries == 0:
            return
        old = self._entries.pop(key, None)
        if old is not None:
            self.bytes -= len(old.encode())
        self._entries[key] = caption
        self.bytes += len(caption.encode())
        while len(self._entries) > self.max_entries:
            _, evicted = self._entries.popitem(last=False)
            self.bytes -= len(evicted.encode())
            self.evictions += 1

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: object) -> bool:
        return key in self._entries

    def clear(self) -> None:
        """Drop every entry; counters are kept."""
        self._entries.clear()
        self.bytes = 0

    def stats(self) -> dict[str, int]:
        """Counters for logs and a metrics endpoint."""
        return {
            "entries": len(self._entries),
            "max_entries": self.max_entries,
            "hits": self.hits,
            "misses": self.misses,
            "evictions": self.evictions,
            "bytes": self.bytes,
        }
