"""A request's lifecycle around a batch step, as the engine runs it.

``TextEngine`` (``app.engine.batch.engine``) serves text and image rows alike over Tandem's
decode step (``app.engine.step``); this base holds what is not about the step: the inbox,
admission, the running rows, the token path and the end of a request. A request's way
through:

    stream(req)      the engine opens a ``Seq`` (``_open``: its KV width, its channel);
                     ``_submit`` checks the queue and puts it in the inbox; the handler
                     then reads deltas from the sequence's channel
    each loop turn   on the MLX thread (``_step``): the inbox into admission's queue,
                     cancellations, queue expiry, then the engine's own scheduling
                     (``_schedule``: admission, pausing, the vision tower), then one
                     batch step (``_batch_step``)
    each token       detokenized, cut at stop strings, timed, sent (``_on_token``)
    the end          however it comes (finished, cancelled, failed, expired, aborted,
                     the thread's death): the KV reservation given back once
                     (``_release``), and one ``GenerationRecord`` to the listeners (``_end``)

One bad request fails alone; a failed batch step fails the requests in it and starts
a fresh batch (``_fail_batch``), and the thread goes on.

A base class rather than a helper object the engine holds: this part owns most of the
engine's state (inbox, admission queue, running rows), and its loop and token path call
back into the engine at some ten points (start, drop a row, logprobs, prompt caching). As
a helper, each of those would be a callback crossing the seam both ways; as hooks on one
object they read in order, and the engine's module holds only what is about the step.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import AsyncGenerator, Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, Generic, Protocol, TypeVar

from app.engine.batch.admission import Admission, Waiting, busy_error
from app.engine.batch.channel import OpenStreams, TokenChannel, deferred_wakes
from app.engine.batch.stops import StopMatcher
from app.engine.kv.geometry import KVGeometry
from app.engine.params import EngineParams
from app.engine.prompt import PromptBuilder
from app.engine.step import ScoreResponse
from app.engine.step.reasoning import BudgetProcessor, ReasoningTracker, piece_reader
from app.engine.step.sampling import reset_random_state, token_logprob
from app.engine.types import (
    SCORED,
    ConstraintProcessor,
    EngineStats,
    GenerationRecord,
    GenerationRequest,
    ScoreResult,
    TokenDelta,
    TokenLogprob,
)
from app.engine.worker import MLXWorker
from app.errors import AppError, EngineDeadError, EngineError

log = logging.getLogger("tandem.engine")

Listener = Callable[[GenerationRecord], None]


@dataclass(eq=False)
class Seq:
    """One request in an engine, from submission to its end."""

    req: GenerationRequest
    channel: TokenChannel
    # Its whole width in a batch cache (the most admission may reserve for it), and its prompt's real length.
    width: int
    prompt_len: int
    uid: int | None = None
    detok: Any = None
    stops: StopMatcher | None = None
    cached_tokens: int = 0
    generated: int = 0
    done: bool = False
    # Admitted and not yet released: it holds a KV reservation (``BatchingEngine._release``).
    holds: bool = False
    enqueued: float = field(default_factory=time.monotonic)
    first_token: float | None = None
    last_token: float | None = None
    gaps: list[float] = field(default_factory=list)
    # Its output constraint's processor (``GenerationRequest.constraint``), if any.
    constraint: ConstraintProcessor | None = None
    # Its reasoning block, as emitted (``GenerationRequest.reasoning``): what it spent there.
    reasoning: ReasoningTracker | None = None
    # Its prediction's tokens kept and refused so far (speculative decoding's Predicted Outputs).
    accepted_prediction_tokens: int = 0
    rejected_prediction_tokens: int = 0
    # Prompt tokens it wrote to the prefix cache at a cache breakpoint (``cache_write_tokens``).
    cache_write_tokens: int = 0

    @property
    def background(self) -> bool:
        return self.req.priority == "background"

    @property
    def suspended(self) -> bool:
        """Holding its reservation without a batch slot (a paused sequence)."""
        return False


class LoadedInfo(Protocol):
    """What the shared part reads of a loaded model (``LoadedModel``, ``LoadedVlm``)."""

    @property
    def name(self) -> str: ...

    @property
    def max_model_len(self) -> int: ...

    @property
    def config(self) -> dict[str, Any]: ...

    @property
    def tokenizer(self) -> Any: ...

    @property
    def kv(self) -> KVGeometry: ...


S = TypeVar("S", bound=Seq)
L = TypeVar("L", bound=LoadedInfo)


class BatchingEngine(Generic[S, L]):
    """Continuous batching for one loaded model: the request lifecycle (see the module
    docstring). An engine supplies ``_open``, ``_schedule``, ``_parked``, ``_new_batch``
    and ``_drop_row``, and may hook the rest; it registers ``_step`` with the worker
    once it is built."""

    # Renders this model's requests into prompts; each engine sets its own.
    prompts: PromptBuilder

    def __init__(self, worker: MLXWorker, loaded: L, params: EngineParams) -> None:
        self.worker = worker
        self.loaded = loaded
        self.params = params
        self.tokenizer = loaded.tokenizer
        # What one row holds, layer by layer (``app.engine.kv.geometry``).
        self.geometry = loaded.kv
        self.admission: Admission[S] = Admission(
            params.kv_mem_mb * 2**20, params.max_num_seqs, params.max_queue,
            params.queue_timeout_s, starvation_s=params.starvation_s, cost=self.geometry.row_bytes,
        )
        self._listeners: list[Listener] = []
        self._streams = OpenStreams(params.channel_max_pending)
        # Guards the inbox (the event loop adds, the MLX thread takes) and admission.
        self._lock = threading.Lock()
        self._inbox: deque[S] = deque()
        self._cancelled: deque[S] = deque()
        self._running: dict[int, S] = {}
        self._accepting = True
        self._bg: Any = None
        # Token id -> text, for reasoning markers (``app.engine.step.reasoning``).
        self._piece = piece_reader(self.tokenizer)

    # ---- called from the event loop -------------------------------------------------

    @property
    def name(self) -> str:
        return self.loaded.name

    @property
    def max_model_len(self) -> int:
        return self.loaded.max_model_len

    @property
    def vocab_size(self) -> int | None:
        config = self.loaded.config
        size = config.get("vocab_size") or config.get("text_config", {}).get("vocab_size")
        return int(size) if size else None

    @property
    def kv_bytes_per_token(self) -> int:
        return int(self.loaded.kv.bytes_per_token)

    @property
    def in_flight(self) -> int:
        return len(self._inbox) + len(self.admission.waiting) + len(self._running) + len(self._parked)

    def add_listener(self, listener: Listener) -> None:
        """Call ``listener`` (on the MLX thread; it must be quick) for every generation that ends."""
        self._listeners.append(listener)

    async def stream(self, req: GenerationRequest) -> AsyncGenerator[TokenDelta, None]:
        """Deltas for one request, ending with the one that carries finish_reason."""
        seq = await self._open(req)
        if req.reasoning is not None:
            seq.reasoning = ReasoningTracker(req.reasoning, self._piece)
        self._submit(seq)
        try:
            if req.announce_queued:
                yield TokenDelta()
            while True:
                for delta in await seq.channel.get():
                    if delta.error is not None:
                        raise delta.error
                    yield delta
                    if delta.finish_reason is not None:
                        return
        finally:
            if not seq.done:
                self._cancelled.append(seq)
                self.worker.wake()

    async def _open(self, req: GenerationRequest) -> S:
        """A new sequence for ``req`` (its channel from ``self._streams``), or the request's error."""
        raise NotImplementedError

    def _check_open(self) -> None:
        if not self.worker.alive:
            raise EngineDeadError("the engine is not running; see /health")
        if not self._accepting:
            raise EngineDeadError("the server is shutting down", retry_after=10)

    def _submit(self, seq: S) -> None:
        self._check_open()
        with self._lock:
            self.admission.check(seq.width, arriving=len(self._inbox))
            self._inbox.append(seq)
        self.worker.wake()

    def stop_accepting(self) -> None:
        self._accepting = False

    def close(self) -> None:
        """Leave the MLX loop (an unload). MLX thread only, with nothing queued or running."""
        self._accepting = False
        self.worker.remove_stepper(self._step)

    def finish_writes(self, timeout: float) -> bool:
        """Finish queued background writes at shutdown; whether in time. None here."""
        return True

    def stats(self) -> EngineStats:
        return EngineStats(
            alive=self.worker.alive,
            active=len(self._running),
            waiting=len(self.admission.waiting) + len(self._inbox),
            kv_budget_tokens=self.admission.budget_tokens,
            kv_reserved_tokens=self.admission.reserved_tokens,
            prompt_cache_bytes=0,
            kv_budget_bytes=self.admission.budget_bytes,
            kv_reserved_bytes=self.admission.reserved,
            kv_layers=self.geometry.summary(),
            kv_max_sequence_tokens=self.admission.max_sequence_tokens,
        )

    def abort_all(self, exc: BaseException) -> Future[None]:
        """End every queued and running request with ``exc`` (a shutdown past its grace
        period); returns the worker's Future for it."""
        return self.worker.submit(lambda: self._abort_all(exc))

    def end_streams(self, exc: BaseException) -> None:
        """Event loop: end every open stream with ``exc`` now, without the MLX thread (when
        ``abort_all`` waits behind a long step at shutdown)."""
        self._streams.end_all(exc)

    # ---- the MLX thread: what an engine supplies -------------------------------------

    @property
    def _parked(self) -> deque[S]:
        """Admitted sequences outside the batch, holding their reservation."""
        raise NotImplementedError

    def _schedule(self) -> None:
        """Admit waiting requests and start them (or set them aside) before the batch step."""
        raise NotImplementedError

    def _reservation(self, seq: S) -> int:
        """What ``seq`` reserves now (``admission.reservation``); here its whole width, up front."""
        return seq.width

    def _new_batch(self) -> Any:
        """A fresh batch generator."""
        raise NotImplementedError

    def _renew_batch(self) -> None:
        """Replace the batch generator after a failed step. The old one is closed first: on
        Metal its close restores the wired limit, which a late garbage collection of it
        would otherwise do under the new one."""
        if self._bg is not None:
            self._bg.close()
        self._bg = self._new_batch()

    def _drop_row(self, uid: int) -> None:
        """Take row ``uid`` out of the batch, its KV freed."""
        raise NotImplementedError

    def _cancel_row(self, seq: S) -> None:
        """``seq``'s client left (or its request was cancelled) while it had a batch row: the row leaves."""
        assert seq.uid is not None
        self._drop_row(seq.uid)

    def _on_batch_next(self, prompt_responses: list[Any]) -> None:
        """The batch step just returned; its responses are handled next."""

    def _on_prompt_progress(self, responses: list[Any]) -> None:
        """The batch step's prompt responses (prefill progress)."""

    def _stop_early(self, seq: S) -> None:
        """``seq`` hit a stop string while the batch would go on: its row leaves."""
        assert seq.uid is not None
        self._drop_row(seq.uid)

    def _on_finished(self, seq: S, r: Any) -> None:
        """The batch ended ``seq`` (EOS or max_tokens); ``r`` is its last response."""

    def _budget(self, seq: S, prompt_len: int) -> list[Any]:
        """The row's budget processor (none without a budget): it goes after the sampling
        processors, so penalties cannot unforce the closer, and before the constraint."""
        block = seq.req.reasoning
        if block is None or block.budget is None or not block.close_ids:
            return []
        return [BudgetProcessor(block, self._piece, prompt_len)]

    def _held(self, seq: S) -> bool:
        """Whether the engine holds a waiting ``seq`` back (it neither runs nor times out)."""
        return False

    def _distribution(self, seq: S, r: Any) -> Any:
        """The log-probabilities ``r``'s token was drawn from (requests with logprobs only)."""
        raise NotImplementedError

    # ---- the MLX thread: the lifecycle -----------------------------------------------

    def _step(self) -> bool:
        """One loop turn; whether work remains."""
        self._take_inbox()
        self._take_cancellations()
        self._expire_waiting()
        self._schedule()
        if not self._running:
            return bool(self.admission.waiting or self._parked)
        return self._batch_step()

    def _batch_step(self) -> bool:
        try:
            prompt_responses, gen_responses = self._bg.next()
        except Exception as exc:  # noqa: BLE001 - fail this batch, keep the thread
            log.exception("model %s: batch step failed; failing %d requests", self.name, len(self._running))
            self._fail_batch(exc)
            return True
        self._on_batch_next(prompt_responses)
        self._on_prompt_progress(prompt_responses)
        with deferred_wakes():  # the event loop is woken once for the step's tokens, not once a stream
            for r in gen_responses:
                seq = self._running.get(r.uid)
                if seq is None:
                    continue
                if isinstance(r, ScoreResponse):
                    self._on_scored(seq, r)
                else:
                    self._on_token(seq, r)
        return True

    def _take_inbox(self) -> None:
        while self._inbox:
            with self._lock:
                seq = self._inbox.popleft()
                self.admission.waiting.append(Waiting(seq, self._reservation(seq), seq.enqueued,
                                                      rank=int(seq.background)))

    def _take_cancellations(self) -> None:
        while self._cancelled:
            seq = self._cancelled.popleft()
            if seq.done:
                continue
            if seq.uid is not None and seq.uid in self._running:
                self._cancel_row(seq)
                self._release(seq)
            elif seq in self._parked:
                self._parked.remove(seq)
                self._release(seq)
            else:
                with self._lock:
                    self.admission.waiting = deque(w for w in self.admission.waiting if w.item is not seq)
                    if seq in self._inbox:
                        self._inbox.remove(seq)
            self._end(seq, "cancelled")

    def _expire_waiting(self) -> None:
        with self._lock:
            expired = self.admission.expire(held=self._held)
            for_slot = self.admission.running >= self.admission.max_seqs
        for seq in expired:
            self._finish_with_error(seq, busy_error(time.monotonic() - seq.enqueued, for_slot))

    def _admit(self, cache_bytes: int = 0, evict: Callable[[int, S], int] = lambda n, _: 0, *,
               background: bool = True, limit: int | None = None) -> list[S]:
        """Waiting requests that fit now (``Admission.admit``), each now holding its reservation."""
        with self._lock:
            admitted = self.admission.admit(cache_bytes, evict, background=background, limit=limit, held=self._held)
        for seq in admitted:
            seq.holds = True
        return admitted

    def _on_token(self, seq: S, r: Any) -> None:
        assert seq.stops is not None
        try:
            finish = r.finish_reason
            failed = seq.constraint.failure() if finish is not None and seq.constraint is not None else None
            if failed is not None:  # the grammar forced that EOS: the text so far is not the promised shape
                self._release(seq)
                self._finish_with_error(seq, failed)
                return
            if finish != "stop":  # an EOS token is not text
                seq.detok.add_token(r.token)
                if seq.reasoning is not None:
                    seq.reasoning.feed(r.token)
            if finish is not None:
                seq.detok.finalize()
            seq.generated += 1
            self._time_token(seq)
            text = seq.stops.feed(seq.detok.last_segment)
            top = seq.req.logprobs
            logprobs = [token_logprob(r.token, self._distribution(seq, r), top)] if top is not None else []
            if seq.stops.stopped:
                if finish is None:
                    self._stop_early(seq)
                finish = "stop"
            elif finish is not None:
                text += seq.stops.flush()
                self._on_finished(seq, r)
            self._emit(seq, text, finish, logprobs)
        except Exception as exc:  # noqa: BLE001 - this request fails, the batch goes on
            log.exception("request %s failed while decoding", seq.req.request_id)
            if seq.uid is not None and seq.uid in self._running and r.finish_reason is None:
                self._drop_row(seq.uid)
            self._release(seq)
            self._finish_with_error(seq, EngineError(f"generation failed: {exc}"))

    def _on_scored(self, seq: S, r: ScoreResponse) -> None:
        """A score row's pass (``GenerationRequest.score``): its answer on its final delta,
        nothing generated; the step has let the row go."""
        delta = TokenDelta(finish_reason=SCORED, scores=ScoreResult(r.tail, r.next),
                           prompt_tokens=seq.prompt_len, cached_tokens=seq.cached_tokens,
                           cache_write_tokens=seq.cache_write_tokens)
        self._release(seq)
        self._end(seq, SCORED)
        seq.channel.put(delta)

    @staticmethod
    def _time_token(seq: Seq) -> None:
        now = time.monotonic()
        if seq.first_token is None:
            seq.first_token = now
        else:
            seq.gaps.append(now - (seq.last_token or now))
        seq.last_token = now

    def _emit(self, seq: S, text: str, finish: str | None, logprobs: list[TokenLogprob]) -> None:
        delta = TokenDelta(text=text, tokens=1, finish_reason=finish, logprobs=logprobs)
        if finish is not None:
            delta.stop_sequence = seq.stops.matched if seq.stops is not None else None
            delta.prompt_tokens = seq.prompt_len
            delta.cached_tokens = seq.cached_tokens
            delta.completion_tokens = seq.generated
            delta.reasoning_tokens = seq.reasoning.spent if seq.reasoning is not None else 0
            delta.accepted_prediction_tokens = seq.accepted_prediction_tokens
            delta.rejected_prediction_tokens = seq.rejected_prediction_tokens
            delta.cache_write_tokens = seq.cache_write_tokens
            self._release(seq)
            self._end(seq, finish)
        seq.channel.put(delta)

    def _release(self, seq: S) -> None:
        """Give back what an admitted ``seq`` holds: its batch row and KV reservation, once."""
        if seq.uid is not None:
            self._running.pop(seq.uid, None)
        if seq.holds:
            seq.holds = False
            with self._lock:
                self.admission.release(seq, running=not seq.suspended)

    def _finish_with_error(self, seq: S, exc: BaseException) -> None:
        self._end(seq, "error", exc)
        seq.channel.put(TokenDelta(error=exc))

    def _end(self, seq: S, outcome: str, exc: BaseException | None = None) -> None:
        """Mark ``seq`` done and tell the listeners, once."""
        if seq.done:
            return
        seq.done = True
        code = None
        if exc is not None:
            code = exc.code if isinstance(exc, AppError) else type(exc).__name__
        record = GenerationRecord(
            request_id=seq.req.request_id, model=self.name, outcome=outcome,
            prompt_tokens=seq.prompt_len, cached_tokens=seq.cached_tokens, completion_tokens=seq.generated,
            ttft_s=None if seq.first_token is None else seq.first_token - seq.enqueued,
            total_s=time.monotonic() - seq.enqueued, token_gaps_s=tuple(seq.gaps), error=code,
        )
        for listener in self._listeners:
            try:
                listener(record)
            except Exception:  # noqa: BLE001 - a listener's bug must not fail the request
                log.exception("generation listener failed")

    def _fail_batch(self, exc: Exception) -> None:
        for seq in list(self._running.values()):
            self._release(seq)
            self._finish_with_error(seq, EngineError(f"generation failed: {exc}"))
        self._renew_batch()
        reset_random_state()

    def _on_worker_death(self, exc: BaseException) -> None:
        err = EngineDeadError(f"the engine thread died: {exc}")
        with self._lock:
            waiting = self.admission.fail_all() + list(self._inbox)
            self._inbox.clear()
        for seq in waiting + list(self._running.values()) + list(self._parked):
            self._finish_with_error(seq, err)
        self._running.clear()
        self._parked.clear()
        # And any stream the thread held in no list when it died (admitted, being inserted).
        self._streams.end_all(err)

    def _abort_all(self, exc: BaseException) -> None:
        self._take_inbox()
        with self._lock:
            waiting = self.admission.fail_all()
        for seq in waiting:
            self._finish_with_error(seq, exc)
        for seq in list(self._running.values()):
            assert seq.uid is not None
            self._drop_row(seq.uid)
            self._release(seq)
            self._finish_with_error(seq, exc)
        while self._parked:
            seq = self._parked.popleft()
            self._release(seq)
            self._finish_with_error(seq, exc)

