"""Observability: /metrics in Prometheus' text format, x-request-id on every response, ids in logs."""

from __future__ import annotations

import logging
import re
import time
from contextlib import ExitStack

import httpx
import pytest

from app.request_context import RequestIdFilter
from tests.api.serving import serving, tiny_yaml

HI = [{"role": "user", "content": "Hi"}]
SAMPLE = re.compile(r'^([a-z_]+)(\{[^}]*\})? (\S+)$')


@pytest.fixture(scope="module")
def srv(tmp_path_factory, tiny_model_dir):
    with serving(tmp_path_factory.mktemp("metrics"), tiny_yaml(tiny_model_dir, vision={})) as served:
        yield served


def scrape(srv) -> dict[str, float]:
    """/metrics parsed, checking the format on the way: ``{'name{labels}': value}``."""
    r = srv.get("/metrics")
    assert r.status_code == 200
    assert r.headers["content-type"].startswith("text/plain; version=0.0.4")
    samples, typed = {}, {}
    for line in r.text.splitlines():
        if line.startswith("# TYPE "):
            _, _, name, kind = line.split(" ")
            typed[name] = kind
        elif not line.startswith("#"):
            m = SAMPLE.match(line)
            assert m, f"not a sample line: {line!r}"
            name = m.group(1)
            family = re.sub(r"_(bucket|sum|count)$", "", name) if name not in typed else name
            assert family in typed, f"{name} has no # TYPE"
            samples[name + (m.group(2) or "")] = float(m.group(3))
    for name, kind in typed.items():
        if kind == "histogram":  # cumulative buckets, ending in +Inf == count
            buckets = [v for k, v in samples.items() if k.startswith(name + "_bucket")]
            assert buckets == sorted(buckets) and buckets[-1] == samples[name + "_count"]
    return samples


def test_metrics_count_requests_tokens_and_latency(srv):
    before = scrape(srv)
    with httpx.stream("POST", srv.base_url + "/v1/chat/completions", timeout=60,
                      json={"model": "tiny", "messages": HI, "max_tokens": 3, "stream": True}) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        assert r.read().endswith(b"data: [DONE]\n\n")
    r = srv.post("/v1/completions", {"model": "tiny", "prompt": "Hi", "max_tokens": 2})
    assert r.status_code == 200
    assert srv.get("/v1/nowhere").status_code == 404
    after = scrape(srv)

    def delta(key):
        return after.get(key, 0) - before.get(key, 0)

    assert delta('tandem_http_responses_total{route="/v1/chat/completions",status="200"}') == 1
    assert delta('tandem_http_responses_total{route="/v1/completions",status="200"}') == 1
    assert delta('tandem_http_responses_total{route="unmatched",status="404"}') == 1
    assert delta('tandem_generations_total{outcome="length"}') == 2
    assert delta("tandem_completion_tokens_total") == 5
    assert delta("tandem_prompt_tokens_total") > 2
    assert delta("tandem_time_to_first_token_seconds_count") == 2
    assert delta("tandem_inter_token_latency_seconds_count") == 3  # tokens after the first
    assert after["tandem_engine_up"] == 1 and after["tandem_kv_budget_tokens"] > 0
    assert "tandem_caption_cache_hits_total" in after and "tandem_caption_cache_misses_total" in after
    assert after["tandem_memory_pauses_total"] == 0 and "tandem_background_pauses_total" in after


def test_gauges_show_a_running_request_and_a_cancelled_one(srv):
    with ExitStack() as stack:
        r = stack.enter_context(httpx.stream("POST", srv.base_url + "/v1/chat/completions", timeout=60, json={
            "model": "tiny", "messages": HI, "max_tokens": 1000, "stream": True}))
        lines = r.iter_lines()
        next(line for line in lines if '"content":"' in line and '"content":""' not in line)
        during = scrape(srv)
        # Reserved: what the row holds plus the next 256-token allocation step, not the 1,000 it may write.
        assert during["tandem_requests_running"] == 1 and 256 < during["tandem_kv_reserved_tokens"] < 1000
    for _ in range(200):
        after = scrape(srv)
        if after["tandem_requests_running"] == 0 and after.get('tandem_generations_total{outcome="cancelled"}'):
            break
    assert after["tandem_requests_running"] == 0 and after["tandem_kv_reserved_tokens"] == 0
    assert after['tandem_generations_total{outcome="cancelled"}'] >= 1


def test_every_response_carries_a_request_id(srv):
    responses = {
        "json": srv.post("/v1/chat/completions", {"model": "tiny", "messages": HI, "max_tokens": 1}),
        "sse": srv.post("/v1/chat/completions", {"model": "tiny", "messages": HI, "max_tokens": 1, "stream": True}),
        "400": srv.post("/v1/chat/completions", {"model": "tiny", "messages": []}),
        "404": srv.get("/v1/nowhere"),
        "405": srv.get("/v1/chat/completions"),
        "health": srv.get("/health"),
    }
    ids = {name: r.headers.get("x-request-id") for name, r in responses.items()}
    assert all(re.fullmatch(r"req-[0-9a-f]{24}", i or "") for i in ids.values()), ids
    assert len(set(ids.values())) == len(ids)


@pytest.mark.parametrize("header", ["x-request-id", "x-client-request-id"])
@pytest.mark.parametrize("sent, kept", [
    ("trace-1234.abc:def/ghi", True),
    ("x" * 129, False),  # too long
    ("two words", False),
    ("inject\u00e9d", False),
    ("", False),
])
def test_a_client_request_id_is_kept_beside_the_servers_own(srv, header, sent, kept):
    """The id is the server's, whatever the client sends: a client's own id used as the id
    let one request overwrite another's dashboard row and tag its log lines (issue 30). A
    short, plain one is echoed as x-client-request-id."""
    r = srv.get("/health", headers={header: sent.encode("latin-1")})
    assert re.fullmatch(r"req-[0-9a-f]{24}", r.headers["x-request-id"])
    assert r.headers.get("x-client-request-id") == (sent if kept else None)


def test_log_records_carry_the_request_id(srv, caplog):
    caplog.handler.addFilter(RequestIdFilter())
    try:
        with caplog.at_level(logging.INFO, logger="tandem"):
            r = srv.post("/v1/chat/completions", {"model": "tiny", "messages": HI, "max_tokens": 1},
                         headers={"x-request-id": "client-id-42"})
    finally:
        caplog.handler.filters.clear()
    assert r.headers["x-client-request-id"] == "client-id-42"
    (done,) = [rec for rec in caplog.records if rec.getMessage().startswith("generation length")]
    assert done.request_id == r.headers["x-request-id"]
    assert "completion_tokens=1" in done.getMessage()


def test_a_cancelled_generation_reports_the_tokens_it_used(srv, caplog):
    """It used to be logged (and counted) with prompt_tokens=0 completion_tokens=0."""
    caplog.handler.addFilter(RequestIdFilter())
    before = scrape(srv)
    try:
        with caplog.at_level(logging.INFO, logger="tandem"):
            with httpx.stream("POST", srv.base_url + "/v1/chat/completions", timeout=60, json={
                    "model": "tiny", "messages": HI, "max_tokens": 1000, "stream": True},
                    headers={"x-request-id": "leaves-early"}) as r:
                rid = r.headers["x-request-id"]
                seen = 0
                for line in r.iter_lines():
                    if '"content":"' in line and '"content":""' not in line:
                        seen += 1
                        if seen == 5:
                            break
            for _ in range(200):
                records = [rec for rec in caplog.records if rec.getMessage().startswith("generation cancelled")]
                if records:
                    break
                time.sleep(0.02)
    finally:
        caplog.handler.filters.clear()
    (record,) = records
    assert record.request_id == rid
    fields = dict(part.split("=") for part in record.getMessage().split(": ", 1)[1].split())
    assert int(fields["prompt_tokens"]) > 0 and int(fields["completion_tokens"]) >= 5
    after = scrape(srv)
    assert after["tandem_completion_tokens_total"] - before["tandem_completion_tokens_total"] >= 5


# ---- speculative decoding -------------------------------------------------------------------------


def test_speculative_counters_per_model_and_drafter():
    """The families /metrics renders from ``EngineStats.speculation``: one sample per (model, drafter)."""
    from prometheus_client import CollectorRegistry, generate_latest

    from app.api.metrics import _StateCollector
    from app.engine import DraftCounts
    from app.engine.types import EngineStats
    from app.pipeline.runtime import Figures

    stats = EngineStats(alive=True, active=0, waiting=0, kv_budget_tokens=1, kv_reserved_tokens=0,
                        prompt_cache_bytes=0, speculation={"prediction": DraftCounts(40, 31, 9),
                                                           "prompt_lookup": DraftCounts(12, 3, 5)})
    figures = Figures(True, [("big", stats)], [], {"models": {}, "limit_mb": 1, "used_mb": 0,
                                                   "mlx": {"active_mb": 0, "peak_mb": 0, "cache_mb": 0}}, None)
    registry = CollectorRegistry()
    registry.register(_StateCollector(lambda: figures))
    text = generate_latest(registry).decode()
    assert 'tandem_speculative_proposed_tokens_total{drafter="prediction",model="big"} 40.0' in text
    assert 'tandem_speculative_accepted_tokens_total{drafter="prediction",model="big"} 31.0' in text
    assert 'tandem_speculative_steps_total{drafter="prompt_lookup",model="big"} 5.0' in text
    assert 'tandem_speculative_accepted_tokens_total{drafter="prompt_lookup",model="big"} 3.0' in text


def test_health_and_metrics_carry_speculation_per_model(srv):
    r = srv.post("/v1/chat/completions", {"model": "tiny", "messages": HI, "max_tokens": 3,
                                          "prediction": {"type": "content", "content": "Hello there"}})
    assert r.status_code == 200
    assert {"accepted_prediction_tokens", "rejected_prediction_tokens"} <= set(
        r.json()["usage"]["completion_tokens_details"])
    text = srv.get("/metrics").text
    for family in ("proposed_tokens", "accepted_tokens", "steps"):
        assert f"# TYPE tandem_speculative_{family}_total counter" in text
    model = srv.get("/health").json()["models"]["tiny"]
    assert isinstance(model["speculation"], dict)
    for counts in model["speculation"].values():
        assert set(counts) == {"proposed", "accepted", "steps", "acceptance"}
        assert counts["accepted"] <= counts["proposed"]


def test_a_prediction_is_counted_in_health_and_metrics(srv):
    for _ in range(2):
        srv.post("/v1/chat/completions", {"model": "tiny", "messages": HI, "max_tokens": 8, "temperature": 0,
                                          "prediction": {"type": "content", "content": "Hello " * 8}})
    counts = srv.get("/health").json()["models"]["tiny"]["speculation"]["prediction"]
    assert counts["proposed"] > 0 and counts["steps"] > 0
    assert scrape(srv)['tandem_speculative_proposed_tokens_total{drafter="prediction",model="tiny"}'] > 0
