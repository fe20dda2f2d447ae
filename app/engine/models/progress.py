"""How far a model's load has got, told by the steps that do the work.

A load is a few phases, each reported where the work happens, with a measure where
there is a real one:

    downloading        bytes fetched of the files' total (``hub.fetch``), a hub model not cached
    converting GGUF    the converter's own fraction (``gguf.convert_gguf``), a GGUF not converted
    loading weights    bytes of weights read into memory of their total (the sliced text
                       load); the one-shot loaders (mlx-vlm, mlx-embeddings, a rank's shard)
                       report the phase alone
    starting engine    the handle being built (a VLM's worst-case image profile runs here)

The registry makes one ``LoadProgress`` per load, the loaders write to it (on the MLX
thread), and the dashboard reads its last ``LoadStep`` from the event loop: a step is
a frozen value swapped in whole, so a reader never sees half of one. Listeners
(``Registry.add_load_listener``) are told of each step on the thread that made it.
No mlx import: the hub's fetcher reports here too, and the CLI stays light.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class LoadStep:
    """One moment of a load: its phase and, when measured, ``done`` of ``total`` in ``unit``
    ("bytes", or "" for a plain fraction of 1.0). ``total`` 0: no measure, the phase alone."""

    phase: str
    done: float = 0.0
    total: float = 0.0
    unit: str = ""

    @property
    def fraction(self) -> float | None:
        return min(1.0, self.done / self.total) if self.total > 0 else None


class LoadProgress:
    """The steps of one model's load; ``step`` is the latest."""

    def __init__(self, notify: Callable[[LoadStep], None] | None = None) -> None:
        self._notify = notify
        self.step = LoadStep("waiting for the engine thread")

    def report(self, phase: str, done: float = 0.0, total: float = 0.0, unit: str = "") -> None:
        self.step = LoadStep(phase, done, total, unit)
        if self._notify is not None:
            self._notify(self.step)

    def bytes(self, phase: str, total: int) -> Callable[[int], None]:
        """Start a phase measured in bytes; returns ``advance(n)``, to call as each ``n`` bytes are done."""
        done = 0
        self.report(phase, 0, total, "bytes")

        def advance(n: int) -> None:
            nonlocal done
            done += n
            self.report(phase, done, total, "bytes")

        return advance
