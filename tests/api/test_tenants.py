"""Boundaries between API keys (issue 30): captions, key roles, the dashboard's request list,
request ids. A real server on the tiny chat model, whose proxy captions with a tiny real
Qwen2-VL, under three keys: ``ops`` (admin), ``alice`` and ``bob`` (users)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import yaml

from app.config.loader import format_validation_error
from app.config.schema import ServerSettings
from tests.api.serving import Served, assert_openai_error, serving
from tests.fixtures.tiny_vlm import build_tiny_qwen2_vl
from tests.vision.sample_images import data_url, striped_bytes

KEYS = {"ops": "sk-ops-5b1f0c9e", "alice": "sk-alice-7d2a4e61", "bob": "sk-bob-0c93f8a2"}
HI = [{"role": "user", "content": "Hi"}]


def auth(who: str) -> dict[str, str]:
    return {"authorization": f"Bearer {KEYS[who]}"}


@pytest.fixture(scope="module")
def srv(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path) -> Iterator[Served]:
    tmp = tmp_path_factory.mktemp("tenants")
    vlm = build_tiny_qwen2_vl(tmp / "vlm")
    models = {"server": {"shutdown_grace_s": 1, "api_keys": {
        "ops": {"key": KEYS["ops"], "role": "admin"}, "alice": KEYS["alice"], "bob": {"key": KEYS["bob"]}}},
        "models": [
            {"name": "tiny", "local_path": str(tiny_model_dir),
             "params": {"mem": 16, "max_tokens": 2, "temperature": 0.0},
             "capabilities": {"vision_mode": "proxy", "vision_proxy": {"model": "vlm", "max_tokens": 4}}},
            {"name": "vlm", "role": "vision", "local_path": str(vlm)}]}
    with serving(tmp, yaml.safe_dump(models)) as s:
        assert s.state.vision.available, s.state.vision.reason
        yield s


def chat(srv: Served, who: str, messages: list, headers: dict | None = None, **body) -> httpx.Response:
    r = srv.post("/v1/chat/completions", {"model": "tiny", "messages": messages, **body},
                 headers={**auth(who), **(headers or {})})
    assert r.status_code == 200, r.text
    return r


def caption(srv: Served, who: str, image: str, **kw) -> dict:
    asked = [{"role": "user", "content": [{"type": "text", "text": "What is it?"},
                                          {"type": "image_url", "image_url": {"url": image}}]}]
    (info,) = chat(srv, who, asked, extensions=True, **kw).json()["extensions"]["captions"]
    return info


def test_a_caption_is_not_shared_across_keys_or_salts(srv: Served) -> None:
    """Another key sending the same picture got `cached: true` in 0.006 ms against 29: it learnt
    that someone had sent it. Captions are partitioned as the prefix cache is."""
    image = data_url(striped_bytes(6))
    first = caption(srv, "alice", image)
    assert first["cached"] is False
    assert caption(srv, "bob", image)["cached"] is False
    assert caption(srv, "alice", image, cache_salt="project-x")["cached"] is False
    again = caption(srv, "alice", image)
    assert again["cached"] is True and again["caption"] == first["caption"]
    assert caption(srv, "bob", image)["cached"] is True


ADMIN = [("/v1/admin/models/pin", {"model": "tiny", "pinned": True}),
         ("/v1/admin/models/unload", {"model": "tiny"}),
         ("/v1/admin/models/load", {"model": "vlm"})]


@pytest.mark.parametrize("path, body", ADMIN, ids=[p for p, _ in ADMIN])
def test_admin_routes_need_an_admin_key(srv: Served, path: str, body: dict) -> None:
    """Any key could unload or pin any model (one unloaded the default model: 200)."""
    for who in ("alice", "bob"):
        err = assert_openai_error(srv.post(path, body, headers=auth(who)), 403, "admin_key_required")
        assert err["type"] == "permission_error" and KEYS[who] not in err["message"]
    assert srv.state.registry.loaded("tiny") is not None
    assert not srv.state.registry.spec("tiny").pin
    assert_openai_error(srv.post(path, body), 401)


def test_an_admin_key_uses_them(srv: Served) -> None:
    for pinned in (True, False):
        r = srv.post("/v1/admin/models/pin", {"model": "tiny", "pinned": pinned}, headers=auth("ops"))
        assert r.status_code == 200 and r.json()["pinned"] is pinned


def listed(srv: Served, who: str) -> dict[str, dict]:
    """The request list of ``who``'s dashboard (its first event), by request id."""
    with httpx.stream("GET", srv.base_url + "/ui/events", headers=auth(who), timeout=30) as r:
        assert r.status_code == 200, r.read()
        line = next(line for line in r.iter_lines() if line.startswith("data:"))
    return {row["id"]: row for row in json.loads(line[5:])["requests"]}


def test_each_key_sees_its_own_requests_and_an_admin_all(srv: Served) -> None:
    """Any key's /ui/events listed every tenant's requests (key name, model, tokens, TTFT)."""
    alice = chat(srv, "alice", HI).headers["x-request-id"]
    bob = chat(srv, "bob", HI).headers["x-request-id"]
    seen = {who: listed(srv, who) for who in KEYS}
    assert alice in seen["alice"] and bob not in seen["alice"]
    assert bob in seen["bob"] and alice not in seen["bob"]
    assert {row["client"] for row in seen["alice"].values()} == {"alice"}
    assert {row["client"] for row in seen["bob"].values()} == {"bob"}
    assert alice in seen["ops"] and bob in seen["ops"]
    assert seen["ops"][alice]["client"] == "alice" and seen["ops"][alice]["prompt_tokens"] > 0
    assert all("key" not in row for row in seen["ops"].values())


def test_a_client_request_id_is_recorded_never_used_as_the_key(srv: Served) -> None:
    """bob sending alice's x-request-id overwrote her row and tagged his log lines with her id."""
    first = chat(srv, "alice", HI, headers={"x-request-id": "trace-7"})
    second = chat(srv, "bob", HI, headers={"x-request-id": first.headers["x-request-id"]})
    ids = first.headers["x-request-id"], second.headers["x-request-id"]
    assert ids[0] != ids[1] and all(i.startswith("req-") for i in ids)
    assert first.headers["x-client-request-id"] == "trace-7"
    rows = listed(srv, "ops")
    assert rows[ids[0]]["client"] == "alice" and rows[ids[0]]["client_request_id"] == "trace-7"
    assert rows[ids[1]]["client"] == "bob" and rows[ids[1]]["client_request_id"] == ids[0]


def test_key_roles_in_models_yaml() -> None:
    """A key alone is a user; {key, role} names the role; server.api_key is the admin "default"."""
    server = ServerSettings(api_key="sk-0", api_keys={"a": "sk-a", "b": {"key": "sk-b", "role": "admin"},
                                                      "c": {"key": "sk-c"}})
    assert {name: k.role for name, k in server.api_keys.items()} == {"a": "user", "b": "admin", "c": "user"}
    from app.api.guards import admin_keys, api_keys

    assert admin_keys(server) == {"default", "b"} and set(api_keys(server)) == {"default", "a", "b", "c"}
    assert "sk-a" not in repr(server)


@pytest.mark.parametrize("keys, says", [
    ({"api_keys": {"a": {"key": "sk-a", "role": "root"}}}, "server.api_keys.a.role: got 'root'"),
    ({"api_keys": {"a": "sk-same", "b": "sk-same"}}, "api keys 'a' and 'b' are the same key"),
    ({"api_key": "sk-same", "api_keys": {"a": "sk-same"}}, "api keys 'a' and 'default' are the same key"),
    ({"api_key": "sk-0", "api_keys": {"default": "sk-1"}}, 'a key named "default"'),
])
def test_key_mistakes_stop_start_up_without_showing_the_key(keys: dict, says: str) -> None:
    from pydantic import ValidationError

    from app.config.schema import ModelsFile

    with pytest.raises(ValidationError) as caught:
        ModelsFile.model_validate({"server": keys, "models": [{"name": "m", "builtin": "smollm2-135m-instruct"}]})
    text = format_validation_error("models.yaml", caught.value, {})
    assert says in text and "sk-" not in text
