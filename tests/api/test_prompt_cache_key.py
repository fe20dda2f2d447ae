"""OpenAI's ``prompt_cache_key`` scopes the prefix cache as ``cache_salt`` does, on chat
completions, Responses and decisions: a keyed prompt's cached tokens are invisible under
another key or none, and visible under its own."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from tests.api.serving import Served, assert_openai_error, serving, tiny_yaml


def system(team: str) -> str:
    """A prompt long enough to cache, its own per format: the disk tier outlives each server."""
    return f"You are a careful assistant for the {team} team and answer in short sentences. " * 6


@pytest.fixture
def srv(tmp_path, tiny_model_dir):
    with serving(tmp_path, tiny_yaml(tiny_model_dir, None, {"cache_min_tokens": 16})) as s:
        yield s


def _chat(srv: Served, **extra) -> int:
    messages = [{"role": "system", "content": system("chat")}, {"role": "user", "content": "What is 2 + 2?"}]
    r = srv.post("/v1/chat/completions", {"model": "tiny", "messages": messages, "max_tokens": 1, **extra})
    assert r.status_code == 200, r.text
    return r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]


def _responses(srv: Served, **extra) -> int:
    body = {"model": "tiny", "instructions": system("responses"), "input": "What is 2 + 2?", "max_output_tokens": 1,
            "store": False, **extra}
    r = srv.post("/v1/responses", body)
    assert r.status_code == 200, r.text
    return r.json()["usage"]["input_tokens_details"]["cached_tokens"]


def _decisions(srv: Served, **extra) -> int:
    body = {"model": "tiny", "input": system("decisions"),
            "questions": [{"type": "predicate", "instructions": "About billing."}], **extra}
    r = srv.post("/v1/decisions", body)
    assert r.status_code == 200, r.text
    return r.json()["usage"]["input_tokens_details"]["cached_tokens"]


FORMATS: dict[str, Callable[..., int]] = {"chat": _chat, "responses": _responses, "decisions": _decisions}


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_a_keyed_prefix_is_hidden_without_its_key(srv, fmt):
    ask = FORMATS[fmt]
    ask(srv, prompt_cache_key="tenant-a")
    assert ask(srv) == 0
    assert ask(srv, prompt_cache_key="tenant-b") == 0
    assert ask(srv, cache_salt="tenant-a") == 0  # a key is not a salt of the same text
    assert ask(srv, prompt_cache_key="tenant-a") > 0


def test_an_oversized_key_is_a_400(srv):
    r = srv.post("/v1/chat/completions", {"model": "tiny", "max_tokens": 1, "prompt_cache_key": "k" * 257,
                                          "messages": [{"role": "user", "content": "Hi"}]})
    assert assert_openai_error(r, 400)["param"] == "prompt_cache_key"
