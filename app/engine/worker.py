"""The one thread that makes every MLX call.

MLX is not thread-safe (ml-explore/mlx#2809), so model loading, prefill,
decoding and vision captioning all run here. Other threads hand work over with
``submit(fn)`` (a one-off job, run ahead of the next batch step) or
``submit_steps(make_gen)`` (a long job as a generator, e.g. a caption token by
token: one step of it runs before each batch step, so captioning goes ahead
of primary generation without freezing the text streams while it runs), and
the text engine registers a ``step`` callback that advances its batch. A job that raises fails its own future only;
if the loop itself dies, ``dead`` says why and every waiter is told.
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from collections.abc import Callable, Generator
from concurrent.futures import Future
from typing import TypeVar

from app.errors import EngineDeadError

log = logging.getLogger("tandem.engine")
T = TypeVar("T")


class MLXWorker:
    """A thread running submitted jobs first, then one step of the batch."""

    def __init__(self, name: str = "tandem-mlx") -> None:
        self._jobs: deque[tuple[Callable[[], object], Future]] = deque()
        self._step_jobs: deque[tuple[Callable[[], Generator], Future]] = deque()
        self._current: tuple[Generator, Future] | None = None
        self._wake = threading.Event()
        self._stop = threading.Event()
        # (step, its on-death hook): an engine's batch and how it fails its requests.
        self._steppers: list[tuple[Callable[[], bool], Callable[[BaseException], None]]] = []
        # Told after every stepper's own hook (the process's exit on engine death).
        self._death_hooks: list[Callable[[BaseException], None]] = []
        self.dead: BaseException | None = None
        # Set by kill() from another thread; the loop dies of it.
        self._killed: BaseException | None = None
        self._death_lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)

    def start(self) -> None:
        self._thread.start()

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and self.dead is None

    def add_stepper(self, step: Callable[[], bool], on_death: Callable[[BaseException], None]) -> None:
        """``step()`` advances some work by one slice and returns whether work remains."""
        self._steppers.append((step, on_death))

    def remove_stepper(self, step: Callable[[], bool]) -> None:
        """Stop calling ``step`` (an unloaded model's engine). MLX thread only."""
        self._steppers = [(s, hook) for s, hook in self._steppers if s != step]

    def add_death_hook(self, notify: Callable[[BaseException], None]) -> None:
        """Call ``notify(exc)`` on the MLX thread if its loop dies, after the steppers' own hooks
        (so their requests have been failed first); at once if it is already dead."""
        if self.dead is not None:
            notify(self.dead)
            return
        self._death_hooks.append(notify)

    def submit(self, fn: Callable[[], T]) -> Future[T]:
        """Run ``fn`` on the MLX thread, ahead of the next batch step."""
        return self._enqueue(self._jobs, fn)

    def submit_steps(self, make: Callable[[], Generator[object, None, T]]) -> Future[T]:
        """Run the generator ``make()`` on the MLX thread, one step per loop turn,
        interleaved with the batch; the future gets its return value. Step jobs
        run one at a time, in order."""
        return self._enqueue(self._step_jobs, make)

    def _enqueue(self, queue: deque, job: Callable) -> Future:
        fut: Future = Future()
        if self.dead is not None or self._stop.is_set():
            fut.set_exception(EngineDeadError("the MLX engine thread is not running"))
            return fut
        queue.append((job, fut))
        self._wake.set()
        return fut

    def wake(self) -> None:
        self._wake.set()

    def stop(self, timeout: float = 10.0) -> None:
        self._stop.set()
        self._wake.set()
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            # A killed thread may be stuck for good (a collective whose peer hung): no long wait.
            self._thread.join(timeout if self.dead is None else 0.5)

    def kill(self, exc: BaseException, grace_s: float = 1.0) -> None:
        """Declare the engine dead from another thread (the distributed watchdog). The loop
        dies of ``exc`` at its next turn; if it does not get there within ``grace_s`` (stuck
        in an MLX call that will not return), the death hooks run here instead, so waiting
        requests fail and /health says so either way."""
        if self.dead is not None:
            return
        self._killed = exc
        self._stop.set()
        self._wake.set()
        if threading.current_thread() is not self._thread:
            self._thread.join(grace_s)
            if self._thread.is_alive():
                log.error("the MLX thread is stuck; failing its work from %s", threading.current_thread().name)
                self._die(exc)
                self._fail_pending()

    def _die(self, exc: BaseException) -> None:
        """Record the death and tell every hook, once (the loop or kill(), whichever is first)."""
        with self._death_lock:
            if self.dead is not None:
                return
            self.dead = exc
        for notify in [hook for _, hook in self._steppers] + self._death_hooks:
            notify(exc)

    def _run_jobs(self) -> None:
        while self._jobs:
            fn, fut = self._jobs.popleft()
            if not fut.set_running_or_notify_cancel():
                continue
            try:
                fut.set_result(fn())
            except BaseException as exc:  # noqa: BLE001 - the job's failure is its caller's
                fut.set_exception(exc)

    def _advance(self) -> bool:
        """One step of the current step job; returns whether one is running."""
        if self._current is None:
            while self._step_jobs:
                make, fut = self._step_jobs.popleft()
                if fut.set_running_or_notify_cancel():
                    try:
                        self._current = (make(), fut)
                    except BaseException as exc:  # noqa: BLE001 - the job's failure is its caller's
                        fut.set_exception(exc)
                        continue
                    break
        if self._current is None:
            return False
        gen, fut = self._current
        try:
            next(gen)
        except StopIteration as done:
            self._current = None
            fut.set_result(done.value)
        except BaseException as exc:  # noqa: BLE001
            self._current = None
            fut.set_exception(exc)
        return True

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                self._run_jobs()
                busy = self._advance()
                for step, _ in self._steppers:  # rebound, never mutated: safe to iterate
                    busy = step() or busy
                if not busy and not self._jobs and not self._step_jobs:
                    self._wake.wait(timeout=0.05)
                    self._wake.clear()
            if self._killed is not None:
                raise self._killed
        except BaseException as exc:  # noqa: BLE001 - recorded, reported, never silent
            if exc is not self._killed:
                log.exception("MLX engine thread died")
            self._die(exc)
        finally:
            # Streams belong to the thread that made them; left behind, they abort the
            # process at exit (mlx-vlm's atexit cleanup only clears the main thread's).
            import mlx.core as mx

            mx.clear_streams()
            self._fail_pending()

    def _fail_pending(self) -> None:
        err = EngineDeadError("the MLX engine thread stopped")
        while self._jobs:
            _, fut = self._jobs.popleft()
            if fut.set_running_or_notify_cancel():
                fut.set_exception(err)
        pending = [f for _, f in self._step_jobs] + ([self._current[1]] if self._current else [])
        for fut in pending:
            if not fut.done():
                fut.set_exception(err)
