"""Embedding and rerank jobs scheduled on the MLX thread the way chat requests are.

A loaded encoder is served by an ``EncoderEngine`` (the registry's handle for
the embedding and rerank roles). A request's way through:

    encode(prepare)    on the event loop: the queue checked (429 with Retry-After
                       past ``max_queue``), then ``prepare`` (checks and tokenizing,
                       ``Encoder.prepare_*``) in a worker thread, never the MLX one
    the inbox          the job waits, FIFO; past ``queue_timeout_s`` it gets a 503
    each loop turn     on the MLX thread (``_step``, a worker stepper next to the chat
                       engines'): one batch of one job, the running jobs taking turns
                       (at most ``max_jobs`` of them), so a small request is not
                       stuck behind a large one and a chat stream gets a step between
                       any two encoder batches
    the end            the result back to the handler; a handler that goes away (its
                       client hung up) marks its job cancelled, and no batch of it runs
                       after that

A batch is cut to take about ``max_step_ms``: the engine keeps a running
estimate of its model's seconds per padded token and takes inputs (shortest
first) while the estimate fits, up to ``max_batch`` inputs and
``max_batch_tokens`` padded tokens. On a fast GPU the token limit binds; on a
slow CPU the time does, and chat's inter-token gap stays near ``max_step_ms``.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import Counter, deque
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field

import numpy as np

from app.engine.batch.admission import busy_error
from app.engine.models.encoder import Encoder, Tokenized
from app.engine.worker import MLXWorker
from app.errors import AppError, EngineDeadError, EngineError, RateLimitError

log = logging.getLogger("tandem.engine")

# The weight of the newest batch in the seconds-per-token estimate.
ESTIMATE_WEIGHT = 0.5


@dataclass(frozen=True)
class EncoderStats:
    """One encoder's jobs and work so far, for /health and /metrics."""

    running: int
    waiting: int
    jobs: dict[str, int]  # ended jobs by outcome: done, cancelled, error
    batches: int
    tokens: int  # real (unpadded) tokens encoded
    # Of the jobs done: inputs truncation cut to the model's length, and the tokens it cut.
    truncated_inputs: int = 0
    truncated_tokens: int = 0


@dataclass(eq=False)
class _Job:
    tokens: list[list[int]]
    loop: asyncio.AbstractEventLoop
    future: asyncio.Future[np.ndarray]
    # Input indices, shortest first; ``cursor`` is the next to encode.
    order: list[int]
    out: np.ndarray
    cursor: int = 0
    enqueued: float = field(default_factory=time.monotonic)
    # Set by the event loop when the handler goes away; the MLX thread drops the job.
    cancelled: bool = False
    done: bool = False

    def settle(self, result: np.ndarray | None = None, exc: BaseException | None = None) -> None:
        """Hand the result (or the error) to the waiting handler. Any thread; once."""
        self.done = True

        def deliver() -> None:
            if self.future.done():
                return
            if exc is not None or result is None:
                self.future.set_exception(exc or EngineError("an encoder job ended without a result"))
            else:
                self.future.set_result(result)

        try:
            self.loop.call_soon_threadsafe(deliver)
        except RuntimeError:  # the loop is gone: nobody is listening any more
            pass


class EncoderEngine:
    """An encoder's job queue and its stepper on the MLX thread."""

    def __init__(self, worker: MLXWorker, encoder: Encoder, *, max_queue: int, queue_timeout_s: float) -> None:
        self.worker = worker
        self.encoder = encoder
        self.max_queue = max_queue
        self.queue_timeout_s = queue_timeout_s
        self._lock = threading.Lock()  # the inbox: the event loop adds, the MLX thread takes
        self._inbox: deque[_Job] = deque()
        self._waiting: deque[_Job] = deque()
        self._running: deque[_Job] = deque()
        self._preparing = 0
        self._accepting = True
        # Seconds per padded token, measured; None until the first batch.
        self._s_per_token: float | None = None
        self._outcomes: Counter[str] = Counter()
        self._batches = 0
        self._tokens = 0
        self._truncated_inputs = 0
        self._truncated_tokens = 0
        worker.add_stepper(self._step, self._on_worker_death)

    # ---- the event loop ---------------------------------------------------------------

    @property
    def name(self) -> str:
        return self.encoder.name

    @property
    def in_flight(self) -> int:
        """Jobs preparing, queued or running (the registry keeps a busy model loaded)."""
        return self._preparing + len(self._inbox) + len(self._waiting) + len(self._running)

    async def encode(self, prepare: Callable[[], Tokenized]) -> tuple[Tokenized, np.ndarray]:
        """Tokens from ``prepare()`` (run in a worker thread) and what ``Encoder.forward``
        gives for each, in order. Cancelling the caller cancels the job."""
        self._check_open()
        self._check_queue()
        self._preparing += 1  # counted as waiting from the start: tokenizing is part of the wait
        try:
            tokenized = await asyncio.to_thread(prepare)
        finally:
            self._preparing -= 1
        self._check_open()
        loop = asyncio.get_running_loop()
        tokens = tokenized.ids
        order = sorted(range(len(tokens)), key=lambda i: len(tokens[i]))
        job = _Job(tokens, loop, loop.create_future(), order,
                   np.empty((len(tokens), *self.encoder.out_shape), dtype=np.float32))
        with self._lock:
            self._inbox.append(job)
        self.worker.wake()
        try:
            result = await job.future
            self._truncated_inputs += tokenized.truncated_inputs
            self._truncated_tokens += tokenized.truncated_tokens
            return tokenized, result
        finally:
            if not job.done:
                job.cancelled = True
                self.worker.wake()

    def _check_open(self) -> None:
        if not self.worker.alive:
            raise EngineDeadError("the engine is not running; see /health")
        if not self._accepting:
            raise EngineDeadError("the server is shutting down", retry_after=10)

    def _check_queue(self) -> None:
        free = max(0, self.encoder.limits.max_jobs - len(self._running))
        waiting = self._preparing + len(self._inbox) + len(self._waiting) - free
        if waiting >= self.max_queue:
            raise RateLimitError(
                f"model {self.name!r} is at capacity ({len(self._running)} running, {max(0, waiting)} waiting); "
                "retry shortly", retry_after=2)

    def stats(self) -> EncoderStats:
        return EncoderStats(running=len(self._running), waiting=self._preparing + len(self._inbox) + len(self._waiting),
                            jobs=dict(self._outcomes), batches=self._batches, tokens=self._tokens,
                            truncated_inputs=self._truncated_inputs, truncated_tokens=self._truncated_tokens)

    def stop_accepting(self) -> None:
        self._accepting = False

    def abort_all(self, exc: BaseException) -> Future[None]:
        """End every queued and running job with ``exc`` (a shutdown past its grace period)."""
        return self.worker.submit(lambda: self._end_all(exc))

    def end_streams(self, exc: BaseException) -> None:
        """Event loop: end every job with ``exc`` now, without the MLX thread (busy in a long
        step at shutdown); what it computes later is dropped."""
        for job in [*self._inbox, *self._waiting, *self._running]:
            job.cancelled = True
            job.settle(exc=exc)

    def finish_writes(self, timeout: float) -> bool:
        """Nothing is written in the background."""
        return True

    def close(self) -> None:
        """Leave the MLX loop (an unload). MLX thread only, with nothing queued or running."""
        self._accepting = False
        self.worker.remove_stepper(self._step)

    # ---- the MLX thread ---------------------------------------------------------------

    def _step(self) -> bool:
        """One batch of the job whose turn it is; whether work remains."""
        with self._lock:
            self._waiting.extend(self._inbox)
            self._inbox.clear()
        self._drop_cancelled()
        self._expire_waiting()
        while self._waiting and len(self._running) < self.encoder.limits.max_jobs:
            self._running.append(self._waiting.popleft())
        if not self._running:
            return False
        job = self._running[0]  # left in place while it runs: /health counts it
        try:
            self._run_batch(job)
        except Exception as exc:  # noqa: BLE001 - this job fails alone, the thread goes on
            if not isinstance(exc, AppError):
                log.exception("model %s: an encoder batch failed", self.name)
                exc = EngineError(f"model {self.name!r} failed on a batch: {exc}")
            self._running.popleft()
            self._end(job, "error", exc=exc)
            return True
        if job.cursor == len(job.order):
            self._running.popleft()
            self._end(job, "done", result=job.out)
        else:
            self._running.rotate(-1)  # its next batch after the other jobs' turns
        return True

    def _run_batch(self, job: _Job) -> None:
        batch = self._next_batch(job)
        started = time.perf_counter()
        job.out[batch] = self.encoder.forward([job.tokens[i] for i in batch])
        elapsed = time.perf_counter() - started
        padded = len(batch) * len(job.tokens[batch[-1]])
        measured = elapsed / max(1, padded)
        old = self._s_per_token
        self._s_per_token = measured if old is None else old + ESTIMATE_WEIGHT * (measured - old)
        self._batches += 1
        self._tokens += sum(len(job.tokens[i]) for i in batch)

    def _next_batch(self, job: _Job) -> list[int]:
        """The next inputs of ``job`` (shortest first) that fit one step: ``max_batch``,
        ``max_batch_tokens`` padded, and ``max_step_ms`` by the estimate (one input at least)."""
        limits = self.encoder.limits
        budget = limits.max_batch_tokens
        if self._s_per_token is None:
            budget = 0  # one input first, to measure
        else:
            budget = min(budget, int(limits.max_step_ms / 1000 / self._s_per_token))
        batch = [job.order[job.cursor]]
        for i in job.order[job.cursor + 1:]:
            # Shortest first: input i is the longest of the batch it joins.
            if len(batch) >= limits.max_batch or (len(batch) + 1) * len(job.tokens[i]) > budget:
                break
            batch.append(i)
        job.cursor += len(batch)
        return batch

    def _drop_cancelled(self) -> None:
        for queue in (self._waiting, self._running):
            for job in [j for j in queue if j.cancelled]:
                queue.remove(job)
                self._end(job, "cancelled")

    def _expire_waiting(self) -> None:
        now = time.monotonic()
        for job in [j for j in self._waiting if now - j.enqueued > self.queue_timeout_s]:
            self._waiting.remove(job)
            self._end(job, "error", exc=busy_error(now - job.enqueued, for_slot=True, slot_setting="max_jobs"))

    def _end(self, job: _Job, outcome: str, result: np.ndarray | None = None, exc: BaseException | None = None) -> None:
        self._outcomes[outcome] += 1
        if outcome != "cancelled":
            job.settle(result, exc)

    def _end_all(self, exc: BaseException) -> None:
        with self._lock:
            self._waiting.extend(self._inbox)
            self._inbox.clear()
        for queue in (self._waiting, self._running):
            while queue:
                self._end(queue.popleft(), "error", exc=exc)

    def _on_worker_death(self, exc: BaseException) -> None:
        self._end_all(EngineDeadError(f"the engine thread died: {exc}"))

