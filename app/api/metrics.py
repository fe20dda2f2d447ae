"""GET /metrics: Prometheus metrics, with the field's own ``prometheus_client``.

Counters and histograms are fed by two listeners: Litestar's ``before_send``
hook (every HTTP response, by route template) and the engine's finished
generations (``GenerationRecord``: outcome, tokens, time to first token and
the gaps between tokens, cancelled and failed ones included). Gauges and the
engine's own counters are read from the engine and the caption cache at
scrape time by a collector. Each app has its own registry.

    tandem_http_responses_total{route,status}     every response, by route template
    tandem_generations_total{outcome}             stop, length, scored (a decision's prompt read), cancelled, error
    tandem_decision_questions_total{type,answer}  decision questions by type, answered or refused
    tandem_prompt_tokens_total, tandem_cached_prompt_tokens_total, tandem_completion_tokens_total
    tandem_time_to_first_token_seconds            histogram, from submission to the first token (generations)
    tandem_inter_token_latency_seconds            histogram, per generated token after the first
    tandem_engine_up, tandem_requests_running, tandem_requests_waiting, tandem_requests_paused
    tandem_background_pauses_total                 background sequences paused for interactive work
    tandem_kv_budget_tokens, tandem_kv_reserved_tokens, tandem_prompt_cache_bytes
    tandem_prompt_cache_hits_total, tandem_prompt_cache_tokens_saved_total
    tandem_kv_cache_bytes                         bytes MLX's KV caches hold (rows, paused, memory tier)
    tandem_prompt_cache_tier_{hits,tokens,evictions}_total{model,tier}, ..._tier_{bytes,entries}{model,tier}
    tandem_prompt_cache_disk_writes_total{model,outcome}, tandem_prompt_cache_disk_damaged_total{model}
    tandem_vision_feature_cache_{hits,misses,evictions,tokens}_total{model}, ..._{bytes,entries}{model}
    tandem_vision_encoded_images_total{model}, tandem_vision_encode_seconds_total{model}   the tower's own runs
    tandem_caption_cache_{hits,misses,evictions}_total, tandem_caption_cache_{entries,bytes}
    tandem_encoder_jobs_running{model}, tandem_encoder_jobs_waiting{model}   embedding / rerank jobs now
    tandem_encoder_jobs_total{model,outcome}      ended jobs: done, cancelled (client gone), error
    tandem_encoder_batches_total{model}, tandem_encoder_tokens_total{model}   batches run, tokens encoded
    tandem_encoder_truncated_{inputs,tokens}_total{model}   inputs cut to the model's length, tokens cut
    tandem_model_loaded{model,role}, tandem_model_memory_bytes{model,part}
    tandem_memory_limit_bytes, tandem_memory_used_bytes
    tandem_mlx_active_memory_bytes, tandem_mlx_peak_memory_bytes, tandem_mlx_cache_memory_bytes
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from litestar import Request, Response, get
from prometheus_client import CollectorRegistry, Counter, Histogram, disable_created_metrics, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.exposition import CONTENT_TYPE_PLAIN_0_0_4
from prometheus_client.registry import Collector

from app.pipeline.decisions.request import Decision
from app.pipeline.runtime import SCORED, EncoderStats, EngineStats, Figures, GenerationRecord

# No "_created" timestamp series next to every counter: nothing here reads them.
disable_created_metrics()

TTFT_BUCKETS = (0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
ITL_BUCKETS = (0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0)


class Metrics:
    """What the server counts; one instance (and registry) per app."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.responses = Counter("tandem_http_responses", "HTTP responses by route template and status.",
                                 ["route", "status"], registry=r)
        self.generations = Counter("tandem_generations",
                                   "Generations by outcome (stop, length, scored, cancelled, error).", ["outcome"],
                                   registry=r)
        self.decision_questions = Counter("tandem_decision_questions", "Decision questions by type, answered or "
                                          "refused.", ["type", "answer"], registry=r)
        self.prompt_tokens = Counter("tandem_prompt_tokens", "Prompt tokens of generations that ended.", registry=r)
        self.cached_tokens = Counter("tandem_cached_prompt_tokens", "Prompt tokens served from the prefix cache.",
                                     registry=r)
        self.completion_tokens = Counter("tandem_completion_tokens",
                                         "Generated tokens, cancelled and failed generations included.", registry=r)
        self.ttft = Histogram("tandem_time_to_first_token_seconds",
                              "Seconds from submission to the engine (queue wait and prefill) to the first token.",
                              buckets=TTFT_BUCKETS, registry=r)
        self.itl = Histogram("tandem_inter_token_latency_seconds", "Seconds between generated tokens.",
                             buckets=ITL_BUCKETS, registry=r)

    def watch(self, read: Callable[[], Figures]) -> None:
        """Read gauges from the runtime's figures at scrape time."""
        self.registry.register(_StateCollector(read))

    async def before_send(self, message: Any, scope: Any) -> None:
        """Litestar ``before_send`` hook: count each response once, at its start."""
        if message["type"] == "http.response.start":
            # The route's template, never the raw path: unknown paths must not grow the label set.
            self.responses.labels(scope.get("path_template") or "unmatched", str(message["status"])).inc()

    def on_generation(self, record: GenerationRecord) -> None:
        """The engine's listener: one generation ended (called on the MLX thread)."""
        self.generations.labels(record.outcome).inc()
        self.prompt_tokens.inc(record.prompt_tokens)
        self.cached_tokens.inc(record.cached_tokens)
        self.completion_tokens.inc(record.completion_tokens)
        if record.ttft_s is not None and record.outcome != SCORED:  # a scored row has no first token
            self.ttft.observe(record.ttft_s)
        for gap in record.token_gaps_s:
            self.itl.observe(gap)

    def on_decision(self, decision: Decision) -> None:
        """A decision answered (its rows counted as generations already)."""
        for a in decision.answers:
            self.decision_questions.labels(a.question.kind, "refused" if a.refused else "answered").inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _StateCollector(Collector):
    """Engine and caption-cache figures, read when scraped."""

    def __init__(self, read: Callable[[], Figures]) -> None:
        self._read = read

    def collect(self) -> Iterator[Metric]:
        figures = self._read()
        stats = [s for _, s in figures.chat]
        total = lambda field: sum(getattr(s, field) for s in stats)  # noqa: E731
        for name, value, help_ in (
            ("tandem_engine_up", int(figures.alive and all(s.alive for s in stats)),
             "1 while the MLX engine thread runs."),
            ("tandem_requests_running", total("active"), "Sequences being generated."),
            ("tandem_requests_waiting", total("waiting"), "Requests waiting for the engine."),
            ("tandem_requests_paused", total("paused"), "Background sequences paused for interactive work."),
            ("tandem_kv_budget_tokens", total("kv_budget_tokens"), "KV-cache budget in tokens (mem), loaded models."),
            ("tandem_kv_reserved_tokens", total("kv_reserved_tokens"),
             "KV tokens reserved: running and paused rows x (the widest reservation, what a row holds + its next "
             "allocation step, grown as it decodes + a step unused)."),
            ("tandem_prompt_cache_bytes", total("prompt_cache_bytes"), "Bytes held by the prefix caches."),
            ("tandem_kv_cache_bytes", total("kv_cache_bytes"),
             "Bytes MLX's KV caches hold: batch rows, paused sequences, the prefix caches' memory tiers."),
        ):
            yield GaugeMetricFamily(name, help_, value=value)
        yield CounterMetricFamily("tandem_background_pauses", "Background sequences paused for interactive work.",
                                  value=total("background_pauses"))
        yield CounterMetricFamily("tandem_memory_pauses", "Sequences paused because the KV budget could not take "
                                  "their growth (their KV to the prefix cache, resumed when room returns).",
                                  value=total("memory_pauses"))
        yield CounterMetricFamily("tandem_prompt_cache_hits", "Requests that reused a cached prefix.",
                                  value=total("prompt_cache_hits"))
        yield CounterMetricFamily("tandem_prompt_cache_tokens_saved", "Prefill tokens saved by the prefix cache.",
                                  value=total("prompt_cache_tokens_saved"))
        yield from _tier_metrics(figures.chat)
        yield from _speculative_metrics(figures.chat)
        yield from _feature_metrics(figures.chat)
        yield from _encoder_metrics(figures.encoders)
        yield from _model_metrics(figures.memory)
        cache = figures.captions
        if cache is not None:
            yield CounterMetricFamily("tandem_caption_cache_hits", "Images whose caption came from the cache.",
                                      value=cache["hits"])
            yield CounterMetricFamily("tandem_caption_cache_misses", "Images that had to be captioned.",
                                      value=cache["misses"])
            yield CounterMetricFamily("tandem_caption_cache_evictions", "Captions evicted to stay within the "
                                      "cache's entries.", value=cache["evictions"])
            yield GaugeMetricFamily("tandem_caption_cache_entries", "Captions held by the cache.",
                                    value=cache["entries"])
            yield GaugeMetricFamily("tandem_caption_cache_bytes", "UTF-8 bytes of the captions held.",
                                    value=cache["bytes"])


def _feature_metrics(engines: list[tuple[str, EngineStats]]) -> Iterator[Metric]:
    """Each loaded native VLM's vision-feature cache, and its vision tower's own runs."""
    caches = [(name, s.vision_feature_cache) for name, s in engines if s.vision_feature_cache is not None]
    for name, help_, kind in (
        ("hits", "Images whose features came from the cache.", CounterMetricFamily),
        ("misses", "Images the cache did not hold (encoded by the vision tower).", CounterMetricFamily),
        ("evictions", "Images' features evicted to stay within vision_feature_cache_mb.", CounterMetricFamily),
        ("tokens", "Image tokens whose features came from the cache.", CounterMetricFamily),
        ("bytes", "Bytes of image features the cache holds.", GaugeMetricFamily),
        ("entries", "Images whose features the cache holds.", GaugeMetricFamily),
    ):
        family = kind(f"tandem_vision_feature_cache_{name}", help_, labels=["model"])
        for model, c in caches:
            family.add_metric([model], getattr(c, name))
        yield family
    images = CounterMetricFamily("tandem_vision_encoded_images", "Images run through the vision tower.",
                                 labels=["model"])
    seconds = CounterMetricFamily("tandem_vision_encode_seconds", "Seconds the vision tower ran.", labels=["model"])
    for model, s in engines:
        if s.vision_feature_cache is not None:
            images.add_metric([model], s.vision_encoded_images)
            seconds.add_metric([model], s.vision_encode_s)
    yield images
    yield seconds


def _encoder_metrics(stats: list[tuple[str, EncoderStats]]) -> Iterator[Metric]:
    """Each loaded encoder's jobs (``EncoderEngine.stats``)."""
    running = GaugeMetricFamily("tandem_encoder_jobs_running", "Embedding and rerank jobs running.", labels=["model"])
    waiting = GaugeMetricFamily("tandem_encoder_jobs_waiting", "Embedding and rerank jobs waiting (tokenizing "
                                "or queued).", labels=["model"])
    jobs = CounterMetricFamily("tandem_encoder_jobs", "Embedding and rerank jobs ended, by outcome (done, "
                               "cancelled, error).", labels=["model", "outcome"])
    batches = CounterMetricFamily("tandem_encoder_batches", "Encoder batches run.", labels=["model"])
    tokens = CounterMetricFamily("tandem_encoder_tokens", "Tokens encoded (without padding).", labels=["model"])
    cut_inputs = CounterMetricFamily("tandem_encoder_truncated_inputs", "Inputs longer than the model takes, cut "
                                     "to its length (models.yaml truncate, or the request's).", labels=["model"])
    cut_tokens = CounterMetricFamily("tandem_encoder_truncated_tokens", "Tokens truncation cut from those inputs.",
                                     labels=["model"])
    for name, s in stats:
        running.add_metric([name], s.running)
        waiting.add_metric([name], s.waiting)
        for outcome in ("done", "cancelled", "error"):
            jobs.add_metric([name, outcome], s.jobs.get(outcome, 0))
        batches.add_metric([name], s.batches)
        tokens.add_metric([name], s.tokens)
        cut_inputs.add_metric([name], s.truncated_inputs)
        cut_tokens.add_metric([name], s.truncated_tokens)
    yield from (running, waiting, jobs, batches, tokens, cut_inputs, cut_tokens)


def _model_metrics(snapshot: dict[str, Any]) -> Iterator[Metric]:
    """Each model's state and memory, the budget, and MLX's own memory figures."""
    mb = 2**20
    loaded = GaugeMetricFamily("tandem_model_loaded", "1 while the model is loaded.", labels=["model", "role"])
    memory = GaugeMetricFamily("tandem_model_memory_bytes", "A model's weights, KV budget and KV in use.",
                               labels=["model", "part"])
    for name, m in snapshot["models"].items():
        loaded.add_metric([name, m["role"]], int(m["state"] == "loaded"))
        for part, value in m["memory_mb"].items():
            memory.add_metric([name, part], value * mb)
    yield loaded
    yield memory
    yield GaugeMetricFamily("tandem_memory_limit_bytes", "The process's memory budget (server.memory_limit_mb).",
                            value=snapshot["limit_mb"] * mb)
    yield GaugeMetricFamily("tandem_memory_used_bytes", "What the loaded models count against the budget.",
                            value=snapshot["used_mb"] * mb)
    for key, help_ in (("active", "MLX's active memory."), ("peak", "MLX's peak memory."),
                       ("cache", "MLX's buffer cache.")):
        yield GaugeMetricFamily(f"tandem_mlx_{key}_memory_bytes", help_, value=snapshot["mlx"][f"{key}_mb"] * mb)


def _speculative_metrics(engines: list[tuple[str, EngineStats]]) -> Iterator[Metric]:
    """Each loaded chat model's speculative decoding, per drafter (prediction, prompt_lookup, draft)."""
    for name, help_ in (
        ("proposed_tokens", "Tokens a drafter proposed for the verify step."),
        ("accepted_tokens", "Proposed tokens the model kept (each one a token it did not decode on its own)."),
        ("steps", "Verify steps that carried a drafter's proposals."),
    ):
        family = CounterMetricFamily(f"tandem_speculative_{name}", help_, labels=["model", "drafter"])
        for model, stats in engines:
            for drafter, counts in stats.speculation.items():
                family.add_metric([model, drafter], getattr(counts, name.removesuffix("_tokens")))
        yield family


def _tier_metrics(engines: list[tuple[str, EngineStats]]) -> Iterator[Metric]:
    """Each loaded model's prefix cache per tier (memory, disk), and the disk tiers' writes."""
    tiers = [(name, tier, t) for name, stats in engines for tier, t in stats.prompt_cache_tiers.items()]
    for name, help_, kind in (
        ("hits", "Requests whose cached prefix came from this tier.", CounterMetricFamily),
        ("tokens", "Prompt tokens served from this tier.", CounterMetricFamily),
        ("evictions", "Entries evicted from this tier to stay within its budget.", CounterMetricFamily),
        ("bytes", "Bytes this tier holds.", GaugeMetricFamily),
        ("entries", "Prefixes this tier holds.", GaugeMetricFamily),
    ):
        family = kind(f"tandem_prompt_cache_tier_{name}", help_, labels=["model", "tier"])
        for model, tier, t in tiers:
            family.add_metric([model, tier], getattr(t, name))
        yield family
    writes = CounterMetricFamily("tandem_prompt_cache_disk_writes",
                                 "Prefixes offered to the disk tier, by outcome.", labels=["model", "outcome"])
    damaged = CounterMetricFamily("tandem_prompt_cache_disk_damaged", "Damaged files found and ignored.",
                                  labels=["model"])
    for model, tier, t in tiers:
        if tier == "disk":
            for outcome, value in (("written", t.writes), ("dropped", t.write_drops), ("failed", t.write_errors)):
                writes.add_metric([model, outcome], value)
            damaged.add_metric([model], t.damaged)
    yield writes
    yield damaged


@get("/metrics", summary="Prometheus metrics")
async def metrics(request: Request) -> Response[bytes]:
    return Response(request.app.state.tandem.metrics.render(), media_type=CONTENT_TYPE_PLAIN_0_0_4)
