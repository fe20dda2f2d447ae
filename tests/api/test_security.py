"""Security rules over HTTP: loopback by default, the API key, CORS, and logs that keep no secrets."""

from __future__ import annotations

import base64
import logging

import httpx
import pytest

from app.config.schema import ServerSettings
from tests.api.serving import assert_openai_error, serving, tiny_yaml
from tests.conftest import resolved_config
from tests.vision.sample_images import data_url, striped_bytes

KEY = "sk-tandem-test-4f1d9a7c2b"
AUTH = {"authorization": f"Bearer {KEY}"}
ORIGIN = "http://allowed.example"
HI = [{"role": "user", "content": "Hi"}]


@pytest.fixture(scope="module")
def srv(tmp_path_factory, tiny_model_dir):
    yaml = tiny_yaml(tiny_model_dir, {"api_key": KEY, "cors_origins": [ORIGIN]}, vision={})
    with serving(tmp_path_factory.mktemp("security"), yaml, log_level="info") as served:
        yield served


def test_binds_loopback_by_default(srv):
    from app.cli import build_parser, uvicorn_config

    assert ServerSettings().host == "127.0.0.1"
    assert uvicorn_config(None, ServerSettings()).host == "127.0.0.1"
    assert build_parser().parse_args(["serve"]).host is None  # no flag: models.yaml or the default decides
    # The server above sets no host: it listens on loopback only.
    (listener,) = srv.server.servers
    assert {s.getsockname()[0] for s in listener.sockets} == {"127.0.0.1"}


GUARDED = [
    ("GET", "/v1/models", None),
    ("GET", "/v1/models/tiny", None),
    ("POST", "/v1/chat/completions", {"model": "tiny", "messages": HI, "max_tokens": 1}),
    ("POST", "/v1/completions", {"model": "tiny", "prompt": "Hi", "max_tokens": 1}),
    ("POST", "/v1/agui", {"threadId": "t", "runId": "r", "state": {}, "tools": [], "context": [],
                          "messages": [{"id": "1", "role": "user", "content": "Hi"}],
                          "forwardedProps": {"max_tokens": 1}}),
    ("POST", "/v1/responses", {"model": "tiny", "input": "Hi", "max_output_tokens": 1}),
    ("GET", "/metrics", None),
]
BAD_AUTH = {
    "missing": {},
    "wrong key": {"authorization": "Bearer sk-wrong"},
    "key as a prefix": {"authorization": f"Bearer {KEY}x"},
    "wrong scheme": {"authorization": f"Basic {KEY}"},
    "bare key": {"authorization": KEY},
}


@pytest.mark.parametrize("method, path, body", GUARDED, ids=[g[1] for g in GUARDED])
def test_api_key_guards_v1_and_metrics(srv, method, path, body):
    for name, headers in BAD_AUTH.items():
        r = httpx.request(method, srv.base_url + path, json=body, headers=headers, timeout=60)
        err = assert_openai_error(r, 401, "invalid_api_key")
        assert err["type"] == "authentication_error" and r.headers["www-authenticate"] == "Bearer", name
        assert KEY not in r.text
    ok = httpx.request(method, srv.base_url + path, json=body, timeout=60,
                       headers={"authorization": f"bearer {KEY}"})  # the scheme is case-insensitive
    assert ok.status_code == 200, ok.text


def test_probes_stay_open(srv):
    assert srv.get("/health").status_code == 200


VIEWERS = ["/docs", "/docs/swagger", "/docs/redoc", "/docs/scalar", "/docs/elements", "/docs/rapidoc", "/schema"]


@pytest.mark.parametrize("path", [*VIEWERS, "/docs/openapi.json"])
def test_the_openapi_pages_are_off_by_default(srv, path):
    """/docs needed no key and loaded unpinned CDN scripts, with no CSP, in the API's origin (issue 30)."""
    for headers in ({}, AUTH):
        assert_openai_error(srv.get(path, headers=headers), 404)


def test_the_openapi_schema_when_asked_for_is_json_behind_the_key(tmp_path, tiny_model_dir):
    with serving(tmp_path, tiny_yaml(tiny_model_dir, {"api_key": KEY, "openapi_schema": True})) as s:
        assert_openai_error(s.get("/docs/openapi.json"), 401)
        r = s.get("/docs/openapi.json", headers=AUTH)
        assert r.status_code == 200 and "json" in r.headers["content-type"]
        assert "/v1/chat/completions" in r.json()["paths"]
        for path in VIEWERS[1:]:  # no viewer page, so no third-party script, ever
            page = s.get(path, headers=AUTH)
            assert page.status_code == 404 and "<script" not in page.text, path


def test_api_key_never_printed_with_the_settings(tmp_path, tiny_model_dir, srv):
    assert KEY not in repr(srv.state.config) and KEY not in str(srv.state.config.server)
    config = resolved_config(tiny_yaml(tiny_model_dir), tmp_path, api_key="from-the-flag")
    assert config.server.api_key.get_secret_value() == "from-the-flag"


def preflight(base, origin):
    return httpx.options(base + "/v1/chat/completions", headers={
        "origin": origin, "access-control-request-method": "POST",
        "access-control-request-headers": "authorization, content-type"})


def test_cors_allows_only_the_listed_origins(srv):
    ok = preflight(srv.base_url, ORIGIN)  # a preflight carries no key, and needs none
    assert ok.status_code in (200, 204)
    assert ok.headers["access-control-allow-origin"] == ORIGIN
    assert "authorization" in ok.headers["access-control-allow-headers"].lower()
    evil = preflight(srv.base_url, "http://evil.example")
    assert evil.status_code >= 400 and "access-control-allow-origin" not in evil.headers
    r = srv.post("/v1/chat/completions", {"model": "tiny", "messages": HI, "max_tokens": 1},
                 headers={**AUTH, "origin": ORIGIN})
    assert r.headers["access-control-allow-origin"] == ORIGIN
    r = srv.get("/v1/models", headers={**AUTH, "origin": "http://evil.example"})
    assert "access-control-allow-origin" not in r.headers


def test_cors_is_off_by_default(demo_server):
    r = preflight(demo_server.base_url, ORIGIN)
    assert not any(h.startswith("access-control-") for h in r.headers)
    r = httpx.get(demo_server.base_url + "/v1/models", headers={"origin": ORIGIN})
    assert r.status_code == 200 and "access-control-allow-origin" not in r.headers


def test_logs_hold_neither_the_key_nor_image_bytes(srv, caplog):
    image = data_url(striped_bytes(11, size=(64, 48)))
    payload = image.split(",", 1)[1]
    content = [{"type": "text", "text": "What is this?"}, {"type": "image_url", "image_url": {"url": image}}]
    broken = data_url(base64.b64decode(payload)[:100])  # a truncated PNG: a 400 naming the part
    # Other servers in this test process may have turned uvicorn's access log down or off.
    access = logging.getLogger("uvicorn.access")
    level = access.level
    access.setLevel(logging.INFO)
    access.addHandler(caplog.handler)
    try:
        with caplog.at_level(logging.DEBUG):
            r = srv.post("/v1/chat/completions", {"model": "tiny", "messages": [{"role": "user", "content": content}],
                                                  "max_tokens": 1}, headers=AUTH)
            assert r.status_code == 200, r.text
            bad = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": broken}}]}]
            assert_openai_error(srv.post("/v1/chat/completions", {"model": "tiny", "messages": bad}, headers=AUTH), 400)
            assert_openai_error(srv.post("/v1/chat/completions", {"model": "tiny", "messages": HI},
                                         headers={"authorization": f"Bearer {KEY}-typo"}), 401)
    finally:
        access.removeHandler(caplog.handler)
        access.setLevel(level)
    server_side = [r for r in caplog.records if not r.name.startswith(("httpx", "httpcore"))]
    assert sum("/v1/chat/completions" in r.getMessage() for r in server_side if r.name == "uvicorn.access") >= 3
    text = "\n".join(caplog.handler.format(r) for r in server_side)
    assert "placeholder" in text or "vision" in text  # the image was handled, and logged about
    assert KEY not in text
    for piece in (payload[:48], payload[len(payload) // 2:][:48], payload[-48:]):
        assert piece not in text
