"""What the red team found, each on a real server (the tiny model, `tandem serve`'s set-up).

Web pages (CSRF, DNS rebinding), other local users (prefix-cache probing, /health
details, keys in `ps`), and requests built to cost the server: each now gets a
clear 4xx, or is served as what it means, and the server keeps serving.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import time

import httpx
import psutil
import pytest
import yaml

from tests.api.serving import assert_openai_error, server_process, serving, tiny_yaml

HI = [{"role": "user", "content": "Hi"}]
ALICE, BOB, CAROL = "sk-alice-0123456789", "sk-bob-9876543210", "sk-carol-5555555555"
LONG_SYSTEM = "You are a careful assistant for the accounts team and answer in short sentences. " * 8


@pytest.fixture(scope="module")
def srv(tmp_path_factory, tiny_model_dir):
    server = {"api_keys": {"alice": ALICE, "bob": BOB, "carol": CAROL}}
    params = {"cache_min_tokens": 16, "max_tokens": 2}
    with serving(tmp_path_factory.mktemp("hardening"), tiny_yaml(tiny_model_dir, server, params)) as served:
        yield served


def auth(key: str = ALICE) -> dict[str, str]:
    return {"authorization": f"Bearer {key}"}


def chat(srv, body: dict, key: str = ALICE, **kw) -> httpx.Response:
    return srv.post("/v1/chat/completions", {"model": "tiny", "messages": HI, "max_tokens": 2, **body},
                    headers=auth(key), **kw)


# ---- web pages: CSRF and DNS rebinding ---------------------------------------------------

@pytest.mark.parametrize("content_type", ["text/plain", "application/x-www-form-urlencoded", "multipart/form-data",
                                          None])
@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/agui"])
def test_non_json_bodies_get_415(srv, path, content_type):
    headers = auth()
    if content_type:
        headers["content-type"] = content_type
    body = json.dumps({"model": "tiny", "messages": HI, "prompt": "Hi", "max_tokens": 1}).encode()
    r = httpx.post(srv.base_url + path, content=body, headers=headers, timeout=30)
    err = assert_openai_error(r, 415, "unsupported_media_type")
    assert "application/json" in err["message"]


def test_json_with_a_charset_is_json(srv):
    body = json.dumps({"model": "tiny", "messages": HI, "max_tokens": 1}).encode()
    r = httpx.post(srv.base_url + "/v1/chat/completions", content=body, timeout=30,
                   headers={**auth(), "content-type": "application/json; charset=utf-8"})
    assert r.status_code == 200, r.text


@pytest.mark.parametrize("host", ["evil.example.com", "evil.example.com:8000", "127.0.0.1.nip.io", "192.168.1.5"])
def test_foreign_host_names_are_refused_on_loopback(srv, host):
    """DNS rebinding: a page whose own name now points at 127.0.0.1 reads nothing."""
    for method, path in (("GET", "/health"), ("GET", "/v1/models"), ("POST", "/v1/chat/completions")):
        r = httpx.request(method, srv.base_url + path, headers={**auth(), "host": host}, timeout=30,
                          json={"model": "tiny", "messages": HI, "max_tokens": 1} if method == "POST" else None)
        err = assert_openai_error(r, 403, "host_not_allowed")
        assert err["type"] == "permission_error"


@pytest.mark.parametrize("host", ["localhost", "127.0.0.1", "[::1]"])
def test_loopback_host_names_are_served(srv, host):
    port = srv.base_url.rsplit(":", 1)[1]
    for value in (host, f"{host}:{port}"):
        assert httpx.get(srv.base_url + "/v1/models", headers={**auth(), "host": value}, timeout=30).status_code == 200


def test_allowed_hosts_adds_names(tmp_path, tiny_model_dir):
    with serving(tmp_path, tiny_yaml(tiny_model_dir, {"allowed_hosts": ["tandem.lan"]})) as srv:
        assert srv.get("/health", headers={"host": "tandem.lan:8000"}).status_code == 200
        assert srv.get("/health", headers={"host": "other.lan"}).status_code == 403


# ---- other local users: keys, the prefix cache, /health ----------------------------------

def test_named_keys_bearer_or_x_api_key(srv):
    assert chat(srv, {}, ALICE).status_code == 200
    r = srv.post("/v1/chat/completions", {"model": "tiny", "messages": HI, "max_tokens": 1},
                 headers={"x-api-key": BOB})
    assert r.status_code == 200, r.text
    assert_openai_error(chat(srv, {}, "sk-mallory"), 401, "invalid_api_key")


def cached(srv, key: str, **extra) -> int:
    messages = [{"role": "system", "content": LONG_SYSTEM}, {"role": "user", "content": "What is 2 + 2?"}]
    r = chat(srv, {"messages": messages, "temperature": 0, **extra}, key)
    assert r.status_code == 200, r.text
    return r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]


def test_one_key_cannot_probe_another_keys_prompts(srv):
    """cached_tokens (and time to first token) used to tell a probe how much of its prompt
    matched someone else's cached conversation."""
    cached(srv, ALICE)
    assert cached(srv, ALICE) > 0  # alice's own repeat is a hit
    assert cached(srv, CAROL) == 0  # carol, sending alice's exact prompt, learns nothing
    assert cached(srv, CAROL) > 0  # ... and then has her own copy


def test_cache_salt_separates_prefixes_of_one_key(srv):
    cached(srv, ALICE, cache_salt="tenant-a")
    assert cached(srv, ALICE, cache_salt="tenant-a") > 0
    assert cached(srv, ALICE, cache_salt="tenant-b") == 0


def test_shared_scope_shares_across_keys(tmp_path, tiny_model_dir):
    server = {"api_keys": {"alice": ALICE, "bob": BOB}, "prompt_cache_scope": "shared"}
    with serving(tmp_path, tiny_yaml(tiny_model_dir, server, {"cache_min_tokens": 16})) as shared:
        cached(shared, ALICE)
        assert cached(shared, BOB) > 0


def test_health_details_only_with_a_key(srv):
    public = srv.get("/health")
    assert public.status_code == 200 and public.json() == {"status": "ok", "model": "tiny"}
    detailed = srv.get("/health", headers=auth()).json()
    assert detailed["status"] == "ok" and "engine" in detailed and "vision" in detailed


def test_head_health(srv):
    r = httpx.head(srv.base_url + "/health", timeout=30)
    assert r.status_code == 200 and r.content == b""


def test_api_key_from_the_environment_or_a_file(tmp_path, monkeypatch):
    """--api-key shows in `ps`; TANDEM_API_KEY and --api-key-file do not."""
    from app.cli import _api_key
    from app.errors import ConfigError

    args = argparse.Namespace(api_key=None, api_key_file=None)
    monkeypatch.setenv("TANDEM_API_KEY", "sk-from-env")
    assert _api_key(args) == "sk-from-env"
    keyfile = tmp_path / "key"
    keyfile.write_text("sk-from-file\n")
    assert _api_key(argparse.Namespace(api_key=None, api_key_file=str(keyfile))) == "sk-from-file"
    assert _api_key(argparse.Namespace(api_key="sk-flag", api_key_file=None)) == "sk-flag"
    (tmp_path / "empty").write_text("")
    with pytest.raises(ConfigError, match="empty"):
        _api_key(argparse.Namespace(api_key=None, api_key_file=str(tmp_path / "empty")))


# ---- requests built to cost the server ---------------------------------------------------

NESTED = b"[" * 10_000 + b"]" * 10_000


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/agui"])
def test_deeply_nested_json_is_a_400_without_a_traceback(srv, path, caplog):
    with caplog.at_level(logging.INFO):
        r = httpx.post(srv.base_url + path, content=NESTED, timeout=30,
                       headers={**auth(), "content-type": "application/json"})
    assert_openai_error(r, 400)
    assert not [rec for rec in caplog.records if rec.exc_info or "Traceback" in rec.getMessage()]


def test_request_bodies_do_not_outlive_their_requests(tmp_path, tiny_model_dir):
    """Every request's scope (its body, its decoded JSON) stayed in a reference cycle until a full
    collection, which a body of many small objects rarely sets off: 106 requests with 0.9 MB of
    `{}` in an ignored field added 2.4 GB. Now RSS levels off after the first few."""
    models = yaml.safe_load(tiny_yaml(tiny_model_dir))
    body = json.dumps({"model": "tiny", "messages": HI, "max_tokens": 1, "x": [{}] * 225_000}).encode()
    with server_process(tmp_path, models) as (proc, base):
        rss = psutil.Process(proc.pid).memory_info

        def send(n: int) -> int:
            for _ in range(n):  # each on a connection of its own, as the red team sent them
                r = httpx.post(base + "/v1/chat/completions", content=body, timeout=60,
                               headers={"content-type": "application/json"})
                assert r.status_code == 200, r.text
            time.sleep(0.3)  # the last connection's close is handled
            return rss().rss

        early = send(8)
        late = send(16)  # before the fix: +16 MB a request, 336 MB after 10 and 827 MB after 40
    assert late / early <= 1.1, f"{early / 2**20:.0f} MB after 8 requests, {late / 2**20:.0f} MB after 24"


@pytest.mark.slow
def test_rss_stays_flat_over_200_bodies_sent_four_at_a_time(tmp_path, tiny_model_dir):
    """196 bodies of 0.9 MB of `{}` took RSS from 877 to 1,006 MB though no object outlived its
    request (issue 30): the quarter of a million objects each decoded left pymalloc arenas pinned
    by whatever else was allocated while they lived (211 -> 243 MB here, 118 arenas against 63).
    A member the model ignores is no longer decoded."""
    from concurrent.futures import ThreadPoolExecutor

    models = yaml.safe_load(tiny_yaml(tiny_model_dir))
    body = json.dumps({"model": "tiny", "messages": HI, "max_tokens": 1, "x": [{}] * 225_000}).encode()
    with server_process(tmp_path, models) as (proc, base), ThreadPoolExecutor(4) as pool:
        rss = psutil.Process(proc.pid).memory_info

        def one(_: int) -> None:
            r = httpx.post(base + "/v1/chat/completions", content=body, timeout=60,
                           headers={"content-type": "application/json"})
            assert r.status_code == 200, r.text

        def send(n: int) -> int:
            list(pool.map(one, range(n)))
            time.sleep(0.3)  # the last connections' close is handled
            return rss().rss

        early = send(20)
        late = send(180)
    assert late / early <= 1.1, f"{early / 2**20:.0f} MB after 20 bodies, {late / 2**20:.0f} MB after 200"


@pytest.mark.parametrize("member, code", [(b"[1,, 2]", 400), (b'"\xff"', 400), (b"[" * 2000 + b"]" * 2000, 400),
                                          (b'[{"a": "b"}]', 200)], ids=["bad JSON", "bad UTF-8", "too deep", "fine"])
def test_an_ignored_member_is_still_checked(srv, member, code):
    """An unknown top-level member is skipped, not decoded; it must still be JSON."""
    body = b'{"model": "tiny", "max_tokens": 1, "messages": [{"role": "user", "content": "Hi"}], "x": ' + member + b"}"
    r = httpx.post(srv.base_url + "/v1/chat/completions", content=body, timeout=30,
                   headers={**auth(), "content-type": "application/json"})
    assert r.status_code == code, r.text


@pytest.mark.parametrize("where", ["tool description", "tool-call arguments", "tool name in history"])
def test_huge_tool_texts_are_refused_before_tokenizing(srv, where):
    """A 20 MB tool description took 17 s of CPU and 2.6 GB before its 400."""
    huge = "x " * 10_000_000
    body: dict = {"messages": HI}
    if where == "tool description":
        body["tools"] = [{"type": "function", "function": {"name": "f", "description": huge}}]
    elif where == "tool-call arguments":
        body["messages"] = [*HI, {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "f", "arguments": json.dumps({"a": huge})}}]},
            {"role": "tool", "tool_call_id": "c1", "content": "ok"}]
    else:
        body["messages"] = [*HI, {"role": "assistant", "content": huge[:4_000_000]}]
    started = time.monotonic()
    r = chat(srv, body, timeout=120)
    took = time.monotonic() - started
    assert_openai_error(r, 400, "context_length_exceeded")
    assert took < 5, took
    assert chat(srv, {}).status_code == 200


def test_responses_metadata_is_bounded_and_kept(srv):
    """Metadata is echoed and stored with the response: OpenAI's bounds keep it small."""
    def create(metadata: dict) -> httpx.Response:
        return srv.post("/v1/responses", {"model": "tiny", "input": "Hi", "max_output_tokens": 1, "metadata": metadata},
                        headers=auth())

    for metadata in ({f"k{i}": "v" for i in range(17)}, {"k" * 65: "v"}, {"k": "v" * 513}, {"k": [{}] * 100_000}):
        assert assert_openai_error(create(metadata), 400)["param"].startswith("metadata")
    fits = {f"{i:064d}": "v" * 512 for i in range(16)}
    r = create(fits)
    assert r.status_code == 200 and r.json()["metadata"] == fits, r.text
    assert srv.get(f"/v1/responses/{r.json()['id']}", headers=auth()).json()["metadata"] == fits


def test_a_huge_model_name_is_not_echoed_whole(srv):
    r = chat(srv, {"model": "m" * 1_000_000})
    err = assert_openai_error(r, 404, "model_not_found")
    assert len(err["message"]) < 300


def test_max_queue_holds_in_a_burst(tmp_path, tiny_model_dir):
    """The check used to count the admission queue but not the engine's undrained inbox:
    12 simultaneous streams against max_queue 2 all got in."""
    params = {"max_queue": 2, "max_num_seqs": 1, "max_tokens": 40}
    with serving(tmp_path, tiny_yaml(tiny_model_dir, params=params)) as srv:
        async def one(client: httpx.AsyncClient) -> int:
            body = {"model": "tiny", "messages": HI, "stream": True, "max_tokens": 40}
            async with client.stream("POST", srv.base_url + "/v1/chat/completions", json=body) as r:
                await r.aread()
                return r.status_code

        async def burst() -> list[int]:
            async with httpx.AsyncClient(timeout=120) as client:
                return await asyncio.gather(*(one(client) for _ in range(12)))

        statuses = asyncio.run(burst())
        assert statuses.count(200) <= 3 and statuses.count(429) >= 9, statuses
        assert srv.state.engine.stats().waiting == 0


def test_a_queue_timeout_names_what_it_waited_for(tmp_path, demo_model_dir):
    """It said "waited for KV memory" when the limit was max_num_seqs. The demo model
    (slow here) keeps the one batch slot busy while a second request waits."""
    params = {"max_num_seqs": 1, "queue_timeout_s": 0.5, "max_tokens": 200, "mem": 64, "max_model_len": 2048}
    with serving(tmp_path, tiny_yaml(demo_model_dir, params=params)) as srv:
        eos = srv.state.engine.tokenizer.eos_token_ids
        with httpx.stream("POST", srv.base_url + "/v1/chat/completions", timeout=60, json={
                "model": "tiny", "messages": HI, "stream": True, "max_tokens": 200,
                "logit_bias": {str(t): -100 for t in eos}}) as busy:  # it cannot end early
            lines = busy.iter_lines()  # kept: a dropped iterator would let the response go
            next(line for line in lines if '"content":"' in line and '"content":""' not in line)
            r = srv.post("/v1/chat/completions", {"model": "tiny", "messages": HI, "max_tokens": 1})
        err = assert_openai_error(r, 503, "engine_busy")
        assert "batch slot" in err["message"] and "KV memory" not in err["message"]


# ---- sampling values at their limits -----------------------------------------------------

def greedy(srv, **sampling) -> str:
    r = chat(srv, {"messages": [{"role": "user", "content": "Count: one, two"}], "max_tokens": 6, **sampling})
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["message"]["content"]


def test_sampling_values_next_to_zero_are_greedy(srv):
    reference = greedy(srv, temperature=0)
    assert greedy(srv, temperature=1e-39) == reference
    assert greedy(srv, temperature=1.0, top_p=1e-46, seed=3) == reference


def test_a_vanishing_repetition_penalty_is_refused(srv):
    err = assert_openai_error(chat(srv, {"repetition_penalty": 1e-300}), 400)
    assert err["param"] == "repetition_penalty"


def test_logit_bias_is_honoured(srv):
    tokenizer = srv.state.engine.tokenizer
    token = tokenizer.encode(" banana")[-1]
    text = greedy(srv, temperature=0, logit_bias={str(token): 100})
    assert text.replace(" ", "") == "banana" * 6 or text.count("banana") >= 5, text
    assert_openai_error(chat(srv, {"logit_bias": {"99999999": 5}}), 400)
    assert_openai_error(chat(srv, {"logit_bias": {str(token): 101}}), 400)


# ---- AG-UI: client mistakes are 4xx before the run starts ---------------------------------

def run_input(**overrides) -> dict:
    body = {"threadId": "t", "runId": "r", "state": {}, "tools": [], "context": [],
            "messages": [{"id": "1", "role": "user", "content": "Hi"}], "forwardedProps": {"max_tokens": 1}}
    return {**body, **overrides}


AGUI_MISTAKES = [
    ("temperature 5", run_input(forwardedProps={"temperature": 5}), "forwardedProps.temperature"),
    ("max_tokens not a number", run_input(forwardedProps={"max_tokens": "x"}), "forwardedProps.max_tokens"),
    ("seed over 64 bits", run_input(forwardedProps={"seed": 2**70}), "forwardedProps.seed"),
    ("no messages", run_input(messages=[]), "messages"),
    ("assistant with nothing", run_input(messages=[{"id": "1", "role": "user", "content": "Hi"},
                                                   {"id": "2", "role": "assistant"}]), "messages[1]"),
    ("tool name too long", run_input(tools=[{"name": "t" * 65, "description": "d", "parameters": {}}]),
     "tools[0].name"),
    ("parameters not an object", run_input(tools=[{"name": "t", "description": "d", "parameters": [1, 2]}]),
     "tools[0].parameters"),
]


@pytest.mark.parametrize("name, body, param", AGUI_MISTAKES, ids=[m[0] for m in AGUI_MISTAKES])
def test_agui_client_mistakes_are_4xx_before_the_run(srv, name, body, param):
    r = srv.post("/v1/agui", body, headers=auth())
    err = assert_openai_error(r, 400)
    assert err["param"] == param and err["type"] == "invalid_request_error"


VIDEO = {"type": "video_url", "video_url": {"url": "https://example.com/clip.mp4"}}
AUDIO = {"type": "input_audio", "input_audio": {"data": "", "format": "wav"}}
UNSUPPORTED_PARTS = [
    ("chat video_url (vLLM's)", "/v1/chat/completions",
     {"messages": [{"role": "user", "content": [{"type": "text", "text": "What happens?"}, VIDEO]}]},
     "video_url", "messages[0].content[1]"),
    ("chat input_audio", "/v1/chat/completions",
     {"messages": [{"role": "user", "content": [AUDIO]}]},
     "input_audio", "messages[0].content[0]"),
    ("responses input_video", "/v1/responses",
     {"input": [{"role": "user", "content": [{"type": "input_video", "video_url": "https://example.com/a.mp4"}]}]},
     "input_video", "input[0].content[0]"),
    ("responses video_url", "/v1/responses", {"input": [{"role": "user", "content": [VIDEO]}]},
     "video_url", "input[0].content[0]"),
    ("messages video", "/v1/messages",
     {"max_tokens": 1, "messages": [{"role": "user", "content": [
         {"type": "text", "text": "What happens?"}, {"type": "video", "source": {"type": "url", "url": "https://x"}}]}]},
     "video", "messages[0].content[1]"),
]


@pytest.mark.parametrize("name, path, body, kind, param", UNSUPPORTED_PARTS, ids=[u[0] for u in UNSUPPORTED_PARTS])
def test_an_unsupported_content_part_is_named(srv, name, path, body, kind, param):
    """A video (or audio) part was a raw validation dump on chat (``param: messages[0].content.str``,
    each member of the part union's complaint); every format now names the part and its type."""
    r = srv.post(path, {"model": "tiny", **body}, headers=auth())
    assert r.status_code == 400, r.text
    if path == "/v1/messages":
        err = r.json()["error"]
        assert err["type"] == "invalid_request_error"
    else:
        err = assert_openai_error(r, 400)
        assert err["param"] == param
    assert err["message"].startswith(f"{param}: content of type {kind!r} is not supported"), err
