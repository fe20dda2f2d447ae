"""Native VLM chat end to end: a tiny random Qwen2-VL served by mlx-vlm, through the openai SDK.

Image parts go straight to the model (its processor places them); a proxy-mode
text model may caption with the same loaded copy.
"""

from __future__ import annotations

import logging
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import yaml
from openai import OpenAI

from tests.api.serving import assert_openai_error, serving
from tests.fixtures.tiny_vlm import build_tiny_qwen2_vl
from tests.vision.sample_images import data_url, image_bytes, striped_bytes


@pytest.fixture(scope="module")
def vlm_dir(tmp_path_factory, demo_model_dir):
    return build_tiny_qwen2_vl(tmp_path_factory.mktemp("native") / "vlm")


@pytest.fixture(scope="module")
def native(tmp_path_factory, vlm_dir, demo_model_dir):
    models = [
        {"name": "demo", "builtin": "smollm2-135m-instruct",
         "params": {"mem": 64, "max_model_len": 2048, "max_tokens": 4, "temperature": 0.0},
         "capabilities": {"vision_mode": "proxy", "vision_proxy": {"model": "qwen", "max_tokens": 4}}},
        {"name": "qwen", "local_path": str(vlm_dir),
         "params": {"mem": 16, "max_tokens": 6, "temperature": 0.0, "max_images_per_request": 2,
                    "max_pixels": 56 * 56},
         "capabilities": {"vision_mode": "native"}},
    ]
    text = yaml.safe_dump({"default_model": "demo", "server": {"shutdown_grace_s": 1}, "models": models})
    with serving(tmp_path_factory.mktemp("native-server"), text) as srv:
        yield srv


def ask(srv, *images: str, text: str = "What is in the picture?", model: str = "qwen", **kw):
    content = [{"type": "text", "text": text}] + [{"type": "image_url", "image_url": {"url": u}} for u in images]
    with OpenAI(base_url=srv.base_url + "/v1", api_key="unused", max_retries=0, timeout=120) as client:
        return client.chat.completions.create(model=model, messages=[{"role": "user", "content": content}],
                                              max_tokens=6, temperature=0, **kw)


def test_images_reach_the_model(native, caplog):
    with caplog.at_level(logging.INFO, logger="tandem"):
        a = ask(native, data_url(striped_bytes(1)))
    assert any("worst case" in r.getMessage() and "peak" in r.getMessage() for r in caplog.records)
    a_again = ask(native, data_url(striped_bytes(1)))
    b = ask(native, data_url(striped_bytes(2)))
    assert a.choices[0].message.content == a_again.choices[0].message.content
    assert a.choices[0].message.content != b.choices[0].message.content
    # Image tokens count in the prompt.
    assert a.usage.prompt_tokens > ask(native).usage.prompt_tokens


def test_text_only_requests_work(native):
    r = ask(native, text="Hello there")
    assert r.choices[0].finish_reason in ("stop", "length") and r.usage.completion_tokens > 0


def test_too_many_images_is_a_400_naming_the_limit(native):
    r = native.post("/v1/chat/completions", {"model": "qwen", "max_tokens": 2, "messages": [
        {"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": data_url(image_bytes((i * 40, 0, 0)))}} for i in range(3)]}]})
    err = assert_openai_error(r, 400, "too_many_images")
    assert "at most 2" in err["message"] and err["param"] == "messages[0].content[2].image_url"


def test_a_proxy_model_captions_with_the_same_loaded_copy(native):
    r = native.post("/v1/chat/completions", {"model": "demo", "max_tokens": 2, "extensions": True, "messages": [
        {"role": "user", "content": [{"type": "text", "text": "Describe it"},
                                     {"type": "image_url", "image_url": {"url": data_url(striped_bytes(3))}}]}]})
    assert r.status_code == 200, r.text
    (caption,) = r.json()["extensions"]["captions"]
    assert caption["caption"] and "Image 1: " in r.json()["extensions"]["prompt"]
    models = native.get("/health").json()["models"]
    assert set(models) == {"demo", "qwen"} and models["qwen"]["state"] == "loaded"  # one copy, not two
    listed = {m["id"]: m for m in native.get("/v1/models").json()["data"]}
    assert listed["qwen"]["capabilities"]["vision"]["mode"] == "native"


def test_logprobs_with_an_image(native):
    r = ask(native, data_url(striped_bytes(1)), logprobs=True, top_logprobs=2)
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens > 0
    for entry in content:  # temperature 0: the chosen token is the most likely one
        assert entry.logprob < 0 and len(entry.top_logprobs) == 2
        assert entry.top_logprobs[0].token == entry.token
        assert entry.top_logprobs[0].logprob == pytest.approx(entry.logprob)
    assert ask(native, data_url(striped_bytes(1))).choices[0].logprobs is None


def test_counted_tokens_are_the_prompts_exact_tokens(native):
    """A native VLM's prompt is exact at prepare time, image runs expanded: what
    count_tokens says is what the generation's usage says (it once left the images out)."""
    url = data_url(striped_bytes(1))
    b64 = url.split(",", 1)[1]
    counted = native.post("/v1/messages/count_tokens", {"model": "qwen", "messages": [{"role": "user", "content": [
        {"type": "text", "text": "What is in the picture?"},
        {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": b64}}]}]})
    assert counted.status_code == 200, counted.text
    used = ask(native, url).usage.prompt_tokens
    text_only = ask(native).usage.prompt_tokens
    assert counted.json()["input_tokens"] == used > text_only


def test_a_repeated_image_skips_the_tower_and_shows_in_metrics_and_health(native):
    """Another question about the same picture: its features come from the cache (counted
    in /metrics), the answer is what a cold encode gave; another cache_salt encodes anew."""
    from tests.api.test_metrics import scrape

    url = data_url(striped_bytes(11))
    before = scrape(native)
    first = ask(native, url, text="What is in the picture?")
    again = ask(native, url, text="Describe the colours, please.")
    salted = ask(native, url, text="Describe the colours, please.", extra_body={"cache_salt": "someone else"})
    after = scrape(native)

    def delta(key):
        return after.get(key, 0) - before.get(key, 0)

    assert delta('tandem_vision_feature_cache_hits_total{model="qwen"}') == 1
    assert delta('tandem_vision_feature_cache_misses_total{model="qwen"}') == 2
    assert delta('tandem_vision_encoded_images_total{model="qwen"}') == 2  # not three: one skipped the tower
    assert after['tandem_vision_feature_cache_bytes{model="qwen"}'] > 0
    assert 'tandem_vision_feature_cache_evictions_total{model="qwen"}' in after
    assert again.choices[0].message.content == salted.choices[0].message.content, "cached = encoded anew"
    assert first.usage.prompt_tokens > 0
    health = native.get("/health").json()
    # The cache's cap (vision_feature_cache_mb, 64 by default) counts in the model's memory.
    assert health["models"]["qwen"]["memory_mb"]["weights"] >= 64
    # The default (proxy) model's caption cache in /health, with its new counters.
    cache = health["vision"]["caption_cache"]
    assert {"hits", "misses", "evictions", "bytes", "entries"} <= set(cache)


class _OnePicture(BaseHTTPRequestHandler):
    """One URL whose picture the test swaps: what a reused upload path or a CDN key does."""

    body = b""

    def do_GET(self):
        self.send_response(200)
        self.send_header("Content-Type", "image/png")
        self.send_header("Content-Length", str(len(self.body)))
        self.end_headers()
        self.wfile.write(self.body)

    def log_message(self, *args):
        pass


@pytest.fixture(scope="module")
def picture_url():
    server = ThreadingHTTPServer(("127.0.0.1", 0), _OnePicture)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}/photo.png"
    server.shutdown()
    server.server_close()


@pytest.fixture(scope="module")
def remote(tmp_path_factory, vlm_dir):
    models = [{"name": "qwen", "local_path": str(vlm_dir),
               "params": {"mem": 16, "max_tokens": 6, "temperature": 0.0, "max_pixels": 56 * 56,
                          "cache_min_tokens": 8, "prompt_cache_disk_mb": 0},
               "capabilities": {"vision_mode": "native"}}]
    server = {"shutdown_grace_s": 1, "allow_remote_images": True, "allow_private_remote_images": True,
              "remote_image_hosts": ["127.0.0.1"]}
    with serving(tmp_path_factory.mktemp("remote-server"), yaml.safe_dump({"server": server, "models": models})) as srv:
        yield srv


def chat(srv, messages, **kw):
    with OpenAI(base_url=srv.base_url + "/v1", api_key="unused", max_retries=0, timeout=120) as client:
        return client.chat.completions.create(model="qwen", messages=messages, max_tokens=6, temperature=0, **kw)


def picture_first(url: str, text: str = "What is in the picture?") -> dict:
    return {"role": "user",
            "content": [{"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": text}]}


def test_turn_two_reuses_the_pictures_kv_and_counts_it(remote):
    """The prefix cache of a native VLM through the API: turn two repeats turn one, its
    picture's tokens come from the cache and are counted in cached_tokens."""
    url = data_url(striped_bytes(21))
    first = chat(remote, [picture_first(url)])
    turn2 = [picture_first(url), {"role": "assistant", "content": first.choices[0].message.content},
             {"role": "user", "content": "And the colours?"}]
    second = chat(remote, turn2)
    cold = chat(remote, turn2, extra_body={"cache_salt": "another client"})
    assert second.choices[0].message.content == cold.choices[0].message.content
    assert cold.usage.prompt_tokens_details.cached_tokens == 0, "another cache_salt shares nothing"
    image_tokens = second.usage.prompt_tokens - chat(remote, turn2[1:]).usage.prompt_tokens
    assert second.usage.prompt_tokens_details.cached_tokens > image_tokens > 0
    from tests.api.test_metrics import scrape

    metrics = scrape(remote)
    assert metrics['tandem_prompt_cache_tier_hits_total{model="qwen",tier="memory"}'] >= 1
    assert metrics['tandem_prompt_cache_tier_bytes{model="qwen",tier="memory"}'] > 0


def test_two_pictures_behind_one_url_are_never_confused(remote, picture_url):
    """The key is the pixels: the same URL now serving another picture gets no cached KV of
    the first one (only the text before it), and the answer a fresh request gives."""
    _OnePicture.body = striped_bytes(22)
    a = chat(remote, [picture_first(picture_url)])
    a_again = chat(remote, [picture_first(picture_url)])
    assert a_again.usage.prompt_tokens_details.cached_tokens == a_again.usage.prompt_tokens - 1
    _OnePicture.body = striped_bytes(23)
    b = chat(remote, [picture_first(picture_url)])
    text_before = chat(remote, [{"role": "user", "content": ""}]).usage.prompt_tokens
    assert b.usage.prompt_tokens_details.cached_tokens < text_before
    fresh_b = chat(remote, [picture_first(data_url(striped_bytes(23)))], extra_body={"cache_salt": "b"})
    fresh_a = chat(remote, [picture_first(data_url(striped_bytes(22)))], extra_body={"cache_salt": "a"})
    assert b.choices[0].message.content == fresh_b.choices[0].message.content
    assert a.choices[0].message.content == fresh_a.choices[0].message.content
