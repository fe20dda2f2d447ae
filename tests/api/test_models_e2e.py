"""Several models, one server: routing by `model`, lazy loads, LRU and idle unloads, one budget.

The demo model (SmolLM2-135M, the default, loaded at start) and a seeded random
tiny llama with the demo's tokenizer, served together through the openai SDK.
Each model's temperature-0 answer must equal its answer when served alone, also
after switching between them and with requests to both at once.
"""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest
import yaml
from openai import AsyncOpenAI, OpenAI

from tests.api.serving import assert_openai_error, serving

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
MB = 2**20


def models_yaml(tiny_dir, *, server: dict | None = None, extra: tuple[str, ...] = (), **overrides: dict) -> str:
    """The demo model (default) and the tiny llama, plus ``extra`` tiny copies under other
    names; ``overrides[name]`` is merged into that entry."""
    tiny_params = {"mem": 16, "max_tokens": 8, "temperature": 0.0}
    models = [{"name": "demo", "builtin": "smollm2-135m-instruct",
               "params": {"mem": 64, "max_model_len": 2048, "max_tokens": 8, "temperature": 0.0}}]
    models += [{"name": name, "local_path": str(tiny_dir), "params": dict(tiny_params)} for name in ("tiny", *extra)]
    for m in models:
        m.update(overrides.get(m["name"], {}))
    return yaml.safe_dump({"default_model": "demo", "server": {"shutdown_grace_s": 1, **(server or {})},
                           "models": models})


def answer(base: str, model: str) -> str:
    with OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0, timeout=120) as client:
        r = client.chat.completions.create(model=model, messages=QUESTION, max_tokens=8, temperature=0)
    return r.choices[0].message.content or ""


def states(srv) -> dict[str, str]:
    return {name: m["state"] for name, m in srv.get("/health").json()["models"].items()}


@pytest.fixture(scope="module")
def alone(tmp_path_factory, tiny_model_dir) -> dict[str, str]:
    """Each model's answer when it is the only one served."""
    out = {}
    for name in ("demo", "tiny"):
        text = models_yaml(tiny_model_dir)
        data = yaml.safe_load(text)
        data["models"] = [m for m in data["models"] if m["name"] == name]
        data["default_model"] = name
        with serving(tmp_path_factory.mktemp(f"alone-{name}"), yaml.safe_dump(data)) as srv:
            out[name] = answer(srv.base_url, name)
    return out


@pytest.fixture(scope="module")
def both(tmp_path_factory, tiny_model_dir):
    with serving(tmp_path_factory.mktemp("both"), models_yaml(tiny_model_dir)) as srv:
        yield srv


def test_every_entry_is_listed_and_only_the_default_is_loaded_at_start(both):
    listed = {m["id"]: m for m in both.get("/v1/models").json()["data"]}
    assert set(listed) == {"demo", "tiny"}
    assert listed["demo"]["loaded"] is True and listed["demo"]["role"] == "chat"
    assert states(both)["tiny"] == "unloaded"


def test_answers_equal_served_alone_also_after_switching(both, alone):
    assert alone["demo"] != alone["tiny"]  # the two models really differ
    for name in ("tiny", "demo", "tiny", "demo"):
        assert answer(both.base_url, name) == alone[name], name
    assert states(both) == {"demo": "loaded", "tiny": "loaded"}
    health = both.get("/health").json()
    assert health["models"]["tiny"]["memory_mb"]["weights"] > 0
    assert health["memory"]["used_mb"] <= health["memory"]["limit_mb"]
    assert health["memory"]["mlx"]["active_mb"] > 0


def test_concurrent_requests_to_both(both, alone):
    async def main() -> list[tuple[str, str]]:
        async with AsyncOpenAI(base_url=both.base_url + "/v1", api_key="unused", max_retries=0, timeout=120) as c:
            async def one(model: str) -> tuple[str, str]:
                r = await c.chat.completions.create(model=model, messages=QUESTION, max_tokens=8, temperature=0)
                return model, r.choices[0].message.content or ""

            return await asyncio.gather(*(one(m) for m in ("demo", "tiny") * 3))

    for model, text in asyncio.run(main()):
        assert text == alone[model], model


def test_unknown_model_is_a_404_and_the_hf_id_is_an_alias(both):
    r = both.post("/v1/chat/completions", {"model": "nope", "messages": QUESTION})
    assert "demo" in assert_openai_error(r, 404, "model_not_found")["message"]
    assert_openai_error(both.get("/v1/models/nope"), 404, "model_not_found")


def test_a_model_loads_on_its_first_request(tmp_path, tiny_model_dir, alone):
    with serving(tmp_path, models_yaml(tiny_model_dir)) as srv:
        assert states(srv)["tiny"] == "unloaded"
        assert srv.get("/v1/models/tiny").json()["loaded"] is False
        assert answer(srv.base_url, "tiny") == alone["tiny"]
        assert srv.get("/v1/models/tiny").json()["loaded"] is True


def test_idle_models_unload_and_load_again(tmp_path, tiny_model_dir, alone):
    with serving(tmp_path, models_yaml(tiny_model_dir, tiny={"idle_unload_secs": 1})) as srv:
        assert answer(srv.base_url, "tiny") == alone["tiny"]
        assert states(srv)["tiny"] == "loaded"
        deadline = time.monotonic() + 15
        while states(srv)["tiny"] != "unloaded":
            assert time.monotonic() < deadline, states(srv)
            time.sleep(0.2)
        assert states(srv)["demo"] == "loaded"  # no idle_unload_secs: it stays
        assert answer(srv.base_url, "tiny") == alone["tiny"]


def subdir(tmp_path, name: str):
    (tmp_path / name).mkdir()
    return tmp_path / name


def budget_of(srv, name: str) -> float:
    m = srv.get("/health").json()["models"][name]["memory_mb"]
    return m["weights"] + m["kv_budget"]


def test_least_recently_used_idle_models_make_room(tmp_path, tiny_model_dir):
    """Room for the demo model and one tiny one: each new tiny one unloads the LRU model."""
    with serving(subdir(tmp_path, "measure"), models_yaml(tiny_model_dir)) as srv:
        answer(srv.base_url, "tiny")
        demo, tiny = budget_of(srv, "demo"), budget_of(srv, "tiny")
    limit = int(demo + tiny + tiny / 2) + 1
    with serving(subdir(tmp_path, "lru"), models_yaml(tiny_model_dir, server={"memory_limit_mb": limit},
                                              extra=("tiny2",))) as srv:
        answer(srv.base_url, "tiny")
        assert states(srv) == {"demo": "loaded", "tiny": "loaded", "tiny2": "unloaded"}
        answer(srv.base_url, "tiny2")  # tiny was used last; the demo model before it
        assert states(srv) == {"demo": "unloaded", "tiny": "loaded", "tiny2": "loaded"}
        answer(srv.base_url, "demo")
        assert states(srv) == {"demo": "loaded", "tiny": "unloaded", "tiny2": "loaded"}
        health = srv.get("/health").json()["memory"]
        assert health["used_mb"] <= health["limit_mb"] == limit


def test_a_pinned_model_is_never_unloaded_for_room(tmp_path, tiny_model_dir):
    demo = {"pin": True, "params": {"mem": 16, "max_model_len": 2048, "max_tokens": 8, "temperature": 0.0}}
    with serving(tmp_path, models_yaml(tiny_model_dir, server={"memory_limit_mb": 64}, demo=demo)) as srv:
        r = srv.post("/v1/chat/completions", {"model": "tiny", "messages": QUESTION, "max_tokens": 2})
        err = assert_openai_error(r, 503, "insufficient_memory")
        assert "pinned" in err["message"] and "MB" in err["message"]
        assert states(srv)["demo"] == "loaded"


def test_a_model_that_cannot_fit_gets_a_503_saying_why(tmp_path, tiny_model_dir):
    tiny = {"params": {"mem": 1000, "max_tokens": 8}}  # its KV budget alone is over the limit
    with serving(tmp_path, models_yaml(tiny_model_dir, server={"memory_limit_mb": 400}, tiny=tiny)) as srv:
        r = srv.post("/v1/chat/completions", {"model": "tiny", "messages": QUESTION, "max_tokens": 2})
        err = assert_openai_error(r, 503, "insufficient_memory")
        assert "needs" in err["message"] and "free" in err["message"] and "400 MB" in err["message"]
        assert int(r.headers["retry-after"]) > 0
        assert states(srv)["demo"] == "loaded"  # the fit is checked first: the idle default stays loaded
        assert answer(srv.base_url, "demo")  # the server keeps serving


def test_a_busy_model_is_not_unloaded_for_room(tmp_path, tiny_model_dir):
    """Only an idle model makes room: one with a running request stays, the newcomer waits its turn (503)."""
    with serving(subdir(tmp_path, "measure"), models_yaml(tiny_model_dir)) as srv:
        answer(srv.base_url, "tiny")
        demo, tiny = budget_of(srv, "demo"), budget_of(srv, "tiny")
    limit = int(demo + tiny + tiny / 2) + 1
    pinned = {"pin": True, "params": {"mem": 64, "max_model_len": 2048, "max_tokens": 8, "temperature": 0.0}}
    with serving(subdir(tmp_path, "busy"), models_yaml(tiny_model_dir, server={"memory_limit_mb": limit},
                                               extra=("tiny2",), demo=pinned)) as srv:
        with httpx.stream("POST", srv.base_url + "/v1/chat/completions", timeout=60, json={
                "model": "tiny", "messages": QUESTION, "stream": True, "max_tokens": 2000}) as running:
            lines = running.iter_lines()
            next(line for line in lines if '"content":"' in line and '"content":""' not in line)
            r = srv.post("/v1/chat/completions", {"model": "tiny2", "messages": QUESTION, "max_tokens": 2})
            assert "busy" in assert_openai_error(r, 503, "insufficient_memory")["message"]
            assert states(srv)["tiny"] == "loaded"
