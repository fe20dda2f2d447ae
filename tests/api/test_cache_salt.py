"""``cache_salt`` scopes the prefix cache on every wire format, by one rule.

The red team, on a server without keys, read 259 cached tokens of another client's
salted prompt through /v1/messages: only chat completions passed the salt on. Each
format now puts it on the typed request's ``Options`` and the pipeline turns it into
the cache's scope in one place, so a salted prompt's cached tokens are invisible
without its salt, on any format, and visible with it.
"""

from __future__ import annotations

import json
from collections.abc import Callable

import pytest

from tests.api.serving import Served, assert_openai_error, serving, tiny_yaml


def system(team: str) -> str:
    """A system prompt long enough to cache, opening with its own team."""
    return f"You are a careful assistant for the {team} team and answer in short sentences. " * 8


@pytest.fixture
def srv(tmp_path, tiny_model_dir):
    """No keys: the salt is the only thing that scopes the cache. A server per test, so no test
    sees the chat template's opening tokens cached by another."""
    with serving(tmp_path, tiny_yaml(tiny_model_dir, None, {"cache_min_tokens": 16})) as s:
        yield s


def _chat(srv: Served, team: str, question: str = "What is 2 + 2?", **extra) -> int:
    messages = [{"role": "system", "content": system(team)}, {"role": "user", "content": question}]
    r = srv.post("/v1/chat/completions", {"model": "tiny", "messages": messages, "max_tokens": 1, **extra})
    assert r.status_code == 200, r.text
    return r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]


def _completions(srv: Served, team: str, question: str = "What is 2 + 2?", **extra) -> int:
    r = srv.post("/v1/completions", {"model": "tiny", "prompt": system(team) + question, "max_tokens": 1, **extra})
    assert r.status_code == 200, r.text
    return r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]


def _messages(srv: Served, team: str, question: str = "What is 2 + 2?", **extra) -> int:
    body = {"model": "tiny", "system": system(team), "messages": [{"role": "user", "content": question}],
            "max_tokens": 1, **extra}
    r = srv.post("/v1/messages", body)
    assert r.status_code == 200, r.text
    return r.json()["usage"]["cache_read_input_tokens"]


def _responses(srv: Served, team: str, question: str = "What is 2 + 2?", **extra) -> int:
    body = {"model": "tiny", "instructions": system(team), "input": question, "max_output_tokens": 1, "store": False,
            **extra}
    r = srv.post("/v1/responses", body)
    assert r.status_code == 200, r.text
    return r.json()["usage"]["input_tokens_details"]["cached_tokens"]


FORMATS: dict[str, Callable[..., int]] = {"chat": _chat, "completions": _completions, "messages": _messages,
                                          "responses": _responses}


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_a_salted_prefix_is_hidden_without_its_salt(srv, fmt):
    ask = FORMATS[fmt]
    ask(srv, fmt, cache_salt="tenant-a")  # tenant a's prompt, now cached under its salt
    assert ask(srv, fmt) == 0  # no salt: nothing of a's shows
    assert ask(srv, fmt, cache_salt="tenant-b") == 0  # another salt: nothing either
    assert ask(srv, fmt, cache_salt="tenant-a") > 0  # a's own repeat is a hit


def test_an_agui_run_takes_its_salt_from_forwarded_props(srv):
    """AG-UI's events carry no usage; the run's cached prefix shows on a chat request of the
    same conversation, the same salt and nothing else (one scope for every format)."""
    run = {"threadId": "t", "runId": "r", "state": {}, "context": [], "tools": [],
           "forwardedProps": {"max_tokens": 1, "cache_salt": "tenant-a"},
           "messages": [{"id": "m0", "role": "system", "content": system("agui")},
                        {"id": "m1", "role": "user", "content": "What is 2 + 2?"}]}
    r = srv.post("/v1/agui", run)
    assert r.status_code == 200 and "RUN_FINISHED" in r.text, r.text
    assert _chat(srv, "agui") == 0
    assert _chat(srv, "agui", cache_salt="tenant-a") > 0


def test_an_oversized_salt_is_a_400_in_each_formats_shape(srv):
    for path, body in (("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}]}),
                       ("/v1/completions", {"prompt": "Hi"}), ("/v1/responses", {"input": "Hi"})):
        err = assert_openai_error(srv.post(path, {"model": "tiny", "max_tokens": 1, "cache_salt": "s" * 257, **body}),
                                  400)
        assert err["param"] == "cache_salt" and "256" in err["message"], path
    r = srv.post("/v1/messages", {"model": "tiny", "max_tokens": 1, "cache_salt": "s" * 257,
                                  "messages": [{"role": "user", "content": "Hi"}]})
    assert r.status_code == 400, r.text
    body = r.json()
    assert body["type"] == "error" and body["error"]["type"] == "invalid_request_error", body
    assert "cache_salt" in json.dumps(body)
