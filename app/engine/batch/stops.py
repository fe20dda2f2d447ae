"""Stop strings matched on text, so they work across token boundaries.

Token-level stop sequences miss a stop string that the model spells with
different tokens; matching the detokenized text does not. Text that could be
the start of a stop string is held back until it is clear either way.
"""

from __future__ import annotations

from app.streamtext import split_marker


class StopMatcher:
    """Feed text pieces; get back what is safe to emit and whether to stop."""

    def __init__(self, stops: tuple[str, ...] | list[str]) -> None:
        self._stops = tuple(s for s in stops if s)
        self._held = ""
        # The stop string that ended the text (Anthropic's ``stop_sequence`` names it).
        self.matched: str | None = None

    @property
    def stopped(self) -> bool:
        return self.matched is not None

    def feed(self, text: str) -> str:
        """Returns text that can be emitted now. Sets ``matched`` on a match."""
        if not self._stops:
            return text
        if self.stopped:
            return ""
        before, marker, self._held = split_marker(self._held + text, self._stops)
        if marker is not None:
            self.matched, self._held = marker, ""
        return before

    def flush(self) -> str:
        """The held-back text, once generation ended without a match."""
        out, self._held = self._held, ""
        return "" if self.stopped else out
