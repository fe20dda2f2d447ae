"""GET /metrics: counters, gauges and latency histograms in Prometheus' text format.

The exposition (text format 0.0.4: ``# HELP``, ``# TYPE``, ``name{label="v"} value``)
is written by hand: it is a few dozen lines and needs no dependency. Counters
and histograms change only on the event loop (the ``before_send`` hook and the
stream wrapper), so they need no lock; gauges are read from the engine and the
caption cache at scrape time.

    tandem_http_responses_total{route,status}     every response, by route template
    tandem_generations_total{outcome}             stop, length, error, cancelled
    tandem_prompt_tokens_total, tandem_cached_prompt_tokens_total, tandem_completion_tokens_total
    tandem_time_to_first_token_seconds            histogram, from submission to the first token
    tandem_inter_token_latency_seconds            histogram, per generated token
    tandem_engine_up, tandem_requests_running, tandem_requests_waiting
    tandem_kv_budget_tokens, tandem_kv_reserved_tokens, tandem_prompt_cache_bytes
    tandem_prompt_cache_hits_total, tandem_prompt_cache_tokens_saved_total
    tandem_caption_cache_hits_total, tandem_caption_cache_misses_total, tandem_caption_cache_entries
"""

from __future__ import annotations

import logging
import time
from bisect import bisect_left
from collections import Counter
from typing import Any, AsyncIterator

from litestar import Request, get

from app.engine.types import TokenDelta
from app.errors import AppError

log = logging.getLogger("tandem.api")

CONTENT_TYPE = "text/plain; version=0.0.4"  # Litestar adds "; charset=utf-8"
TTFT_BUCKETS = (0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
ITL_BUCKETS = (0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0)


class Histogram:
    """Cumulative buckets as Prometheus wants them; ``observe`` is a bisect and three adds."""

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)  # the last one is +Inf
        self.sum = 0.0
        self.count = 0

    def observe(self, value: float, n: int = 1) -> None:
        """Record ``n`` observations of ``value``."""
        self.counts[bisect_left(self.bounds, value)] += n
        self.sum += value * n
        self.count += n

    def lines(self, name: str) -> list[str]:
        out, running = [], 0
        for bound, n in zip((*map(_num, self.bounds), "+Inf"), self.counts):
            running += n
            out.append(f'{name}_bucket{{le="{bound}"}} {running}')
        return out + [f"{name}_sum {_num(self.sum)}", f"{name}_count {self.count}"]


class Metrics:
    """What the server counts; one instance per app."""

    def __init__(self) -> None:
        self.responses: Counter[tuple[str, int]] = Counter()
        self.generations: Counter[str] = Counter()
        self.prompt_tokens = 0
        self.cached_tokens = 0
        self.completion_tokens = 0
        self.ttft = Histogram(TTFT_BUCKETS)
        self.itl = Histogram(ITL_BUCKETS)

    async def before_send(self, message: Any, scope: Any) -> None:
        """Litestar ``before_send`` hook: count each response once, at its start."""
        if message["type"] == "http.response.start":
            # The route's template, never the raw path: unknown paths must not grow the label set.
            self.responses[(scope.get("path_template") or "unmatched", message["status"])] += 1

    async def observe(self, deltas: AsyncIterator[TokenDelta]) -> AsyncIterator[TokenDelta]:
        """Pass one generation's deltas through, timing them; logs one line when it ends."""
        start = time.perf_counter()
        ttft = last = None
        outcome, error, final = "cancelled", "", None  # cancelled unless it finishes or fails
        try:
            async for delta in deltas:
                if delta.tokens:
                    now = time.perf_counter()
                    if last is None:
                        ttft = now - start
                        self.ttft.observe(ttft)
                    else:  # a coalesced delta spreads its gap over its tokens
                        self.itl.observe((now - last) / delta.tokens, delta.tokens)
                    last = now
                if delta.finish_reason is not None:
                    outcome, final = delta.finish_reason, delta
                yield delta
        except Exception as exc:
            outcome, error = "error", f" ({exc.code})" if isinstance(exc, AppError) else f" ({type(exc).__name__})"
            raise
        finally:
            self.generations[outcome] += 1
            if final is not None:
                self.prompt_tokens += final.prompt_tokens
                self.cached_tokens += final.cached_tokens
                self.completion_tokens += final.completion_tokens
            log.info(
                "generation %s%s: prompt_tokens=%d cached_tokens=%d completion_tokens=%d ttft_s=%s total_s=%.3f",
                outcome, error, final.prompt_tokens if final else 0, final.cached_tokens if final else 0,
                final.completion_tokens if final else 0, "-" if ttft is None else f"{ttft:.3f}",
                time.perf_counter() - start,
            )

    def render(self, state: Any) -> str:
        """The whole exposition, with the engine and caption-cache gauges read now."""
        stats = state.engine.stats()
        out: list[str] = []

        def metric(name: str, kind: str, help_: str, samples: list[str]) -> None:
            out.extend([f"# HELP {name} {help_}", f"# TYPE {name} {kind}", *samples])

        metric("tandem_http_responses_total", "counter", "HTTP responses by route template and status.",
               [f'tandem_http_responses_total{{route="{_label(r)}",status="{s}"}} {n}'
                for (r, s), n in sorted(self.responses.items())])
        metric("tandem_generations_total", "counter", "Generations by outcome (stop, length, error, cancelled).",
               [f'tandem_generations_total{{outcome="{o}"}} {n}' for o, n in sorted(self.generations.items())])
        for name, value, help_ in (
            ("tandem_prompt_tokens_total", self.prompt_tokens, "Prompt tokens of finished generations."),
            ("tandem_cached_prompt_tokens_total", self.cached_tokens, "Prompt tokens served from the prefix cache."),
            ("tandem_completion_tokens_total", self.completion_tokens, "Generated tokens of finished generations."),
            ("tandem_prompt_cache_hits_total", stats.prompt_cache_hits, "Requests that reused a cached prefix."),
            ("tandem_prompt_cache_tokens_saved_total", stats.prompt_cache_tokens_saved, "Prefill tokens saved by the prefix cache."),
        ):
            metric(name, "counter", help_, [f"{name} {value}"])
        metric("tandem_time_to_first_token_seconds", "histogram",
               "Seconds from submission to the engine (queue wait and prefill) to the first token.",
               self.ttft.lines("tandem_time_to_first_token_seconds"))
        metric("tandem_inter_token_latency_seconds", "histogram", "Seconds between generated tokens.",
               self.itl.lines("tandem_inter_token_latency_seconds"))
        for name, value, help_ in (
            ("tandem_engine_up", int(stats.alive and state.worker.alive), "1 while the MLX engine thread runs."),
            ("tandem_requests_running", stats.active, "Sequences being generated."),
            ("tandem_requests_waiting", stats.waiting, "Requests queued for KV memory."),
            ("tandem_kv_budget_tokens", stats.kv_budget_tokens, "KV-cache budget in tokens (mem)."),
            ("tandem_kv_reserved_tokens", stats.kv_reserved_tokens, "KV tokens reserved by running sequences."),
            ("tandem_prompt_cache_bytes", stats.prompt_cache_bytes, "Bytes held by the prefix cache."),
        ):
            metric(name, "gauge", help_, [f"{name} {value}"])
        proxy = state.vision.proxy
        if proxy is not None:
            cache = proxy.cache.stats()
            metric("tandem_caption_cache_hits_total", "counter", "Images whose caption came from the cache.",
                   [f"tandem_caption_cache_hits_total {cache['hits']}"])
            metric("tandem_caption_cache_misses_total", "counter", "Images that had to be captioned.",
                   [f"tandem_caption_cache_misses_total {cache['misses']}"])
            metric("tandem_caption_cache_entries", "gauge", "Captions held by the cache.",
                   [f"tandem_caption_cache_entries {cache['entries']}"])
        return "\n".join(out) + "\n"


def _num(x: float) -> str:
    return repr(float(x)) if isinstance(x, float) else str(x)


def _label(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


@get("/metrics", media_type=CONTENT_TYPE, summary="Prometheus metrics")
async def metrics(request: Request) -> str:
    state = request.app.state.tandem
    return state.metrics.render(state)
