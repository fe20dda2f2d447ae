"""The dashboard over plain HTTP: the page and its CSP, server.dashboard: false, the event
stream, the request log, and the admin endpoints (load, unload, pin) on a real server with
the tiny chat model and the embedded embedding model."""

from __future__ import annotations

import contextlib
import json
import logging
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import yaml

from tests.api.serving import Served, assert_openai_error, serving

KEY = "dash-key"


def models_yaml(tiny: Path, minilm: Path, server: dict | None = None) -> str:
    return yaml.safe_dump({"server": {"shutdown_grace_s": 1, **(server or {})}, "models": [
        {"name": "tiny", "local_path": str(tiny), "params": {"mem": 16, "max_tokens": 2, "temperature": 0.0}},
        {"name": "minilm", "role": "embedding", "local_path": str(minilm)},
    ]})


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path, minilm_dir: Path) -> Iterator[Served]:
    tmp = tmp_path_factory.mktemp("dashboard")
    with serving(tmp, models_yaml(tiny_model_dir, minilm_dir)) as s:
        yield s


@pytest.fixture(scope="module")
def keyed(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path, minilm_dir: Path) -> Iterator[Served]:
    tmp = tmp_path_factory.mktemp("dashboard-key")
    with serving(tmp, models_yaml(tiny_model_dir, minilm_dir, {"api_key": KEY})) as s:
        yield s


def events(s: Served, count: int, headers: dict | None = None) -> list[tuple[str, dict]]:
    """The first ``count`` events of /ui/events."""
    out: list[tuple[str, dict]] = []
    with httpx.stream("GET", s.base_url + "/ui/events", headers=headers, timeout=30) as r:
        assert r.status_code == 200, r.read()
        assert r.headers["content-type"].startswith("text/event-stream")
        name = None
        for line in r.iter_lines():
            if line.startswith("event:"):
                name = line[6:].strip()
            elif line.startswith("data:"):
                out.append((name, json.loads(line[5:])))
                if len(out) == count:
                    break
    return out


@pytest.mark.parametrize("path", ["/", "/ui"])
def test_page_is_served_with_a_strict_csp(served: Served, path: str) -> None:
    r = served.get(path)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/html")
    csp = r.headers["content-security-policy"]
    assert "default-src 'none'" in csp and "script-src 'self'" in csp and "style-src 'self'" in csp
    assert "unsafe-inline" not in csp and "unsafe-eval" not in csp and "frame-ancestors 'none'" in csp
    assert r.headers["x-content-type-options"] == "nosniff"
    # Nothing inline for the CSP to refuse, nothing fetched from elsewhere.
    html = r.text
    assert "<script>" not in html and "<style" not in html and " style=" not in html and "http" not in html
    for asset, kind in (("/ui/static/app.js", "text/javascript"), ("/ui/static/app.css", "text/css")):
        assert asset in html
        a = served.get(asset)
        assert a.status_code == 200 and a.headers["content-type"].startswith(kind)
        assert a.headers["content-security-policy"] == csp
        assert "http://" not in a.text and "https://" not in a.text


def test_unknown_assets_are_404s_in_openai_shape(served: Served, caplog: pytest.LogCaptureFixture) -> None:
    # A 5,000-character name was a 500 with a traceback: the file system refused the name (issue 30).
    with caplog.at_level(logging.INFO):
        for name in ("nope.js", "..%2Fdashboard.py", "index.py", "a" * 4997 + ".js", "static", ".", "%00.js"):
            assert_openai_error(served.get("/ui/static/" + name), 404)
    assert not [rec for rec in caplog.records if rec.exc_info or rec.levelno >= logging.ERROR]


def test_dashboard_off_is_404(tmp_path: Path, tiny_model_dir: Path, minilm_dir: Path) -> None:
    with serving(tmp_path, models_yaml(tiny_model_dir, minilm_dir, {"dashboard": False})) as s:
        for path in ("/", "/ui", "/ui/static/app.js", "/ui/events"):
            assert_openai_error(s.get(path), 404)
        assert s.get("/health").status_code == 200


def test_an_open_dashboard_does_not_hold_shutdown(tmp_path: Path, tiny_model_dir: Path, minilm_dir: Path) -> None:
    got: list[str] = []
    with serving(tmp_path, models_yaml(tiny_model_dir, minilm_dir)) as s:
        def read() -> None:
            with httpx.stream("GET", s.base_url + "/ui/events", timeout=30) as r:
                got.extend(r.iter_lines())

        reader = threading.Thread(target=read, daemon=True)
        reader.start()
        while not got:
            time.sleep(0.05)
        stopping = time.monotonic()
    # The stream ends with the drain (within a sample), not at uvicorn's graceful timeout (grace + 5 s).
    assert time.monotonic() - stopping < 4
    reader.join(timeout=5)
    assert not reader.is_alive()


def test_events_stream_history_then_ticks_with_models_and_requests(served: Served) -> None:
    r = served.post("/v1/chat/completions", {"model": "tiny", "messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 200, r.text
    rid = r.headers["x-request-id"]
    (first, history), (second, tick) = events(served, 2)
    assert first == "history" and second == "tick"
    models = {m["name"]: m for m in history["overview"]["models"]}
    assert models["tiny"]["state"] == "loaded" and models["tiny"]["default"] and models["tiny"]["weights_mb"] > 0
    assert models["tiny"]["kv_budget_mb"] == 16 and "memory" in models["tiny"]["cache_tiers"]
    assert models["minilm"]["role"] == "embedding" and models["minilm"]["on_disk"] is True
    # The request log joined the HTTP side and the generation's record.
    row = next(x for x in history["requests"] + tick.get("requests", []) if x["id"] == rid)
    assert row["route"] == "/v1/chat/completions" and row["method"] == "POST" and row["status"] == 200
    assert row["model"] == "tiny" and row["prompt_tokens"] > 0 and row["completion_tokens"] == 2
    assert row["ttft_s"] is not None and row["duration_s"] is not None and row["client"] == "127.0.0.1"
    # The generation shows in a sample: its decode speed and time to first token.
    samples = history["samples"] + [tick["sample"]]
    assert all(s["limit_mb"] > 0 for s in samples)
    assert any("tiny" in s["models"] and s["models"]["tiny"].get("ttft_s") for s in samples)


def test_admin_load_pin_unload_the_embedding_model(served: Served) -> None:
    r = served.post("/v1/admin/models/load", {"model": "minilm"})
    assert r.status_code == 200, r.text
    assert r.json()["state"] == "loaded" and r.json()["weights_mb"] > 0
    assert served.post("/v1/embeddings", {"model": "minilm", "input": "x"}).status_code == 200
    pinned = served.post("/v1/admin/models/pin", {"model": "minilm", "pinned": True})
    assert pinned.status_code == 200 and pinned.json()["pinned"] is True
    assert_openai_error(served.post("/v1/admin/models/unload", {"model": "minilm"}), 409, "model_pinned")
    assert served.post("/v1/admin/models/pin", {"model": "minilm", "pinned": False}).json()["pinned"] is False
    r = served.post("/v1/admin/models/unload", {"model": "minilm"})
    assert r.status_code == 200 and r.json()["state"] == "unloaded" and r.json()["weights_mb"] == 0
    assert served.state.registry.loaded("minilm") is None
    # Unloading again is no error; the default model still serves.
    assert served.post("/v1/admin/models/unload", {"model": "minilm"}).json()["state"] == "unloaded"
    assert served.post("/v1/chat/completions", {"model": "tiny", "messages": [{"role": "user", "content": "x"}]}
                       ).status_code == 200


def test_every_request_that_names_a_model_lists_it(served: Served) -> None:
    # Embeddings, rerank and the admin buttons generate nothing, so no GenerationRecord
    # names their model: the pipeline notes it for the request log instead.
    ids = {}
    for what, path, body in (
        ("load", "/v1/admin/models/load", {"model": "minilm"}),
        ("embed", "/v1/embeddings", {"model": "minilm", "input": ["one two", "three"]}),
        ("rerank", "/v1/rerank", {"model": "minilm", "query": "q", "documents": ["a", "b c"]}),
        ("pin", "/v1/admin/models/pin", {"model": "tiny", "pinned": False}),
        ("unload", "/v1/admin/models/unload", {"model": "minilm"}),
    ):
        r = served.post(path, body)
        assert r.status_code == 200, (what, r.text)
        ids[what] = r.headers["x-request-id"]
    (_, history), = events(served, 1)
    rows = {x["id"]: x for x in history["requests"]}
    assert {what: rows[rid]["model"] for what, rid in ids.items()} == {
        "load": "minilm", "embed": "minilm", "rerank": "minilm", "pin": "tiny", "unload": "minilm"}
    assert rows[ids["embed"]]["prompt_tokens"] > 0 and rows[ids["rerank"]]["prompt_tokens"] > 0
    assert rows[ids["embed"]]["route"] == "/v1/embeddings" and rows[ids["embed"]]["completion_tokens"] == 0


def test_a_load_in_progress_shows_its_phase_and_bytes(tmp_path: Path, tiny_model_dir: Path,
                                                      demo_model_dir: Path) -> None:
    # The demo model's ~100 MB of weights are read in 64 MB slices: the load stops (its
    # listener holds the MLX thread) after the first, and the dashboard must say so.
    models = {"server": {"shutdown_grace_s": 1}, "models": [
        {"name": "tiny", "local_path": str(tiny_model_dir), "params": {"mem": 16, "max_tokens": 2}},
        {"name": "demo", "local_path": str(demo_model_dir), "params": {"mem": 16}},
    ]}
    with serving(tmp_path, yaml.safe_dump(models)) as s:
        steps: list = []
        midway, release = threading.Event(), threading.Event()

        def hold(name: str, step) -> None:  # type: ignore[no-untyped-def]
            steps.append((name, step))
            if name == "demo" and step.phase == "loading weights" and 0 < step.done < step.total:
                midway.set()
                release.wait(30)

        s.state.registry.add_load_listener(hold)
        loaded: list[httpx.Response] = []
        loader = threading.Thread(target=lambda: loaded.append(s.post("/v1/admin/models/load", {"model": "demo"})))
        loader.start()
        try:
            assert midway.wait(60), steps
            (_, history), = events(s, 1)
            row = next(m for m in history["overview"]["models"] if m["name"] == "demo")
            assert row["state"] == "loading", row
            p = row["progress"]
            assert p["phase"] == "loading weights" and p["unit"] == "bytes" and 0 < p["done"] < p["total"], p
            assert p["total"] > 90 * 2**20  # the demo model's weights
            assert s.get("/health").json()["models"]["demo"]["progress"]["done"] == p["done"]
        finally:
            release.set()
            loader.join(60)
        assert loaded[0].status_code == 200 and loaded[0].json()["state"] == "loaded"
        assert loaded[0].json()["progress"] is None
        # Every phase in order, the bytes only ever growing, to the whole.
        mine = [st for name, st in steps if name == "demo"]
        phases = [st.phase for st in mine]
        assert phases[0] == "waiting for the engine thread" and phases[-1] == "starting engine", phases
        weights = [st for st in mine if st.phase == "loading weights"]
        assert [st.done for st in weights] == sorted(st.done for st in weights) and weights[-1].done == p["total"]


@pytest.mark.parametrize(("body", "status"), [
    ({"model": "no-such-model"}, 404),
    ({}, 400),
    ({"model": ""}, 400),
    ({"model": 3}, 400),
    ({"model": "minilm", "extra": 1}, 400),
])
def test_admin_bad_bodies_are_4xx(served: Served, body: dict, status: int) -> None:
    assert_openai_error(served.post("/v1/admin/models/load", body), status)
    assert served.get("/health").status_code == 200


def test_admin_endpoints_take_json_only(served: Served) -> None:
    # A cross-site form or text/plain POST needs no preflight: it must not press a button.
    for kind in ("application/x-www-form-urlencoded", "text/plain", "multipart/form-data; boundary=x"):
        r = httpx.post(served.base_url + "/v1/admin/models/load", content=b'{"model": "minilm"}',
                       headers={"Content-Type": kind}, timeout=30)
        assert_openai_error(r, 415)
    assert served.state.registry.loaded("minilm") is None
    assert_openai_error(served.get("/v1/admin/models/load"), 405)


def test_with_a_key_the_page_loads_but_its_data_and_buttons_need_it(keyed: Served) -> None:
    assert keyed.get("/").status_code == 200  # static, no data
    assert keyed.get("/ui/static/app.js").status_code == 200
    assert_openai_error(keyed.get("/ui/events"), 401)
    assert_openai_error(keyed.get("/ui/events", headers={"Authorization": "Bearer wrong"}), 401)
    assert_openai_error(keyed.post("/v1/admin/models/load", {"model": "minilm"}), 401)
    assert_openai_error(keyed.post("/v1/admin/models/pin", {"model": "tiny"}), 401)
    assert keyed.state.registry.loaded("minilm") is None
    auth = {"Authorization": f"Bearer {KEY}"}
    (name, history), = events(keyed, 1, auth)
    assert name == "history" and history["overview"]["models"]
    r = keyed.post("/v1/admin/models/load", {"model": "minilm"}, headers=auth)
    assert r.status_code == 200 and r.json()["state"] == "loaded"
    assert keyed.post("/v1/admin/models/unload", {"model": "minilm"}, headers=auth).json()["state"] == "unloaded"
    # The request log names the key a request used as its client; refused requests by their address.
    (_, history), = events(keyed, 1, auth)
    rows = {x["id"]: x for x in history["requests"]}
    assert rows[r.headers["x-request-id"]]["client"] == "default"
    assert any(x["status"] == 401 and x["client"] == "127.0.0.1" for x in rows.values())


@contextlib.contextmanager
def open_streams(s: Served, count: int, headers: dict | None = None) -> Iterator[list[httpx.Response]]:
    """``count`` /ui/events requests, each on a connection of its own; the open ones are held
    until the block ends. Yields the responses (200: a stream held open; else the refusal)."""
    with contextlib.ExitStack() as stack:
        out = []
        for _ in range(count):
            client = stack.enter_context(httpx.Client(timeout=10))
            r = client.send(client.build_request("GET", s.base_url + "/ui/events", headers=headers), stream=True)
            if r.status_code == 200:
                stack.callback(r.close)
            else:
                r.read()
            out.append(r)
        yield out


def wait_for_streams(s: Served, count: int) -> None:
    """Until the server counts ``count`` open streams (a closed one is seen at its next tick)."""
    deadline = time.monotonic() + 10
    while s.server.config.app.state.event_streams.open.total() != count:
        assert time.monotonic() < deadline, s.server.config.app.state.event_streams.open
        time.sleep(0.1)


def test_event_streams_leave_connections_for_the_api(tmp_path: Path, tiny_model_dir: Path, minilm_dir: Path) -> None:
    """24 streams against max_connections: 24 took every connection, and chat and /v1/models were
    503s for as long as they stayed open (issue 30). Streams are capped below the limit."""
    with serving(tmp_path, models_yaml(tiny_model_dir, minilm_dir, {"max_connections": 24})) as s:
        with open_streams(s, 24) as streams:
            statuses = [r.status_code for r in streams]
            chat = s.post("/v1/chat/completions", {"model": "tiny", "messages": [{"role": "user", "content": "hi"}]})
            assert chat.status_code == 200, chat.text
            assert s.get("/v1/models").status_code == 200
        # One client (this address, with no keys) holds at most its share; the others are 429s.
        assert statuses.count(200) == 4 and statuses.count(429) == 20, statuses
        refused = next(r for r in streams if r.status_code == 429)
        assert "max_event_streams_per_client" in refused.text and refused.headers["retry-after"]
        wait_for_streams(s, 0)  # closed pages give their slots back
        with open_streams(s, 1) as (again,):
            assert again.status_code == 200


def test_event_streams_are_capped_per_key_and_in_all(tmp_path: Path, tiny_model_dir: Path,
                                                     minilm_dir: Path) -> None:
    keys = {"alice": "sk-alice-1", "bob": "sk-bob-1"}
    server = {"max_connections": 8, "max_event_streams_per_client": 3, "api_keys": keys}  # 4 in all: half of 8
    alice, bob = ({"authorization": f"Bearer {keys[k]}"} for k in ("alice", "bob"))
    with serving(tmp_path, models_yaml(tiny_model_dir, minilm_dir, server)) as s:
        with open_streams(s, 4, alice) as hers:
            assert [r.status_code for r in hers] == [200, 200, 200, 429]
            with open_streams(s, 2, bob) as his:
                assert [r.status_code for r in his] == [200, 429]
                assert "server.max_event_streams," in his[1].text
            wait_for_streams(s, 3)
            with open_streams(s, 1, bob) as (his_again,):
                assert his_again.status_code == 200


def test_foreign_host_gets_no_page(served: Served) -> None:
    # DNS rebinding: a page served as evil.example pointing at 127.0.0.1 reads nothing.
    assert_openai_error(served.get("/", headers={"Host": "evil.example"}), 403)
    assert_openai_error(served.get("/ui/events", headers={"Host": "evil.example"}), 403)



def test_unload_never_cuts_off_a_running_request(served: Served) -> None:
    body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1500, "stream": True}
    with httpx.stream("POST", served.base_url + "/v1/chat/completions", json=body, timeout=60) as stream:
        lines = stream.iter_lines()
        assert next(line for line in lines if line.startswith("data:"))  # it is generating
        assert_openai_error(served.post("/v1/admin/models/unload", {"model": "tiny"}), 409, "model_busy")
        assert next(line for line in lines if line.startswith("data:"))  # and still is
    assert served.state.registry.loaded("tiny") is not None


def test_samples_carry_each_models_speculative_acceptance_since_the_last() -> None:
    """The live chart's "speculative acceptance": accepted / proposed tokens between two samples."""
    from app.api.ui.activity import Activity
    from app.engine import DraftCounts
    from app.pipeline.runtime import ModelState, Overview

    counts = {"prompt_lookup": DraftCounts(0, 0, 0)}

    def overview() -> Overview:
        model = ModelState("big", "chat", "loaded", True, False, True, True, 0.0, 1.0, 16.0, 0.0, 0, 0, None,
                           speculation=dict(counts))
        return Overview(True, "big", 100.0, 10.0, {}, [model], None)

    activity = Activity(overview)
    assert activity.sample()["models"]["big"]["acceptance"] is None  # nothing proposed yet
    counts["prompt_lookup"] = DraftCounts(10, 4, 3)
    counts["draft"] = DraftCounts(10, 8, 3)
    assert activity.sample()["models"]["big"]["acceptance"] == 0.6
    assert activity.sample()["models"]["big"]["acceptance"] is None  # nothing new this second
    counts["draft"] = DraftCounts(20, 18, 6)
    assert activity.sample()["models"]["big"]["acceptance"] == 1.0
