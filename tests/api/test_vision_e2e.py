"""Proxy vision end to end: the demo chat model, a tiny real Qwen2-VL, the openai SDK."""

from __future__ import annotations

import httpx
import pytest
from openai import OpenAI

from tests.conftest import DEMO_YAML, LiveServer, resolved_config
from tests.fixtures.tiny_vlm import build_tiny_qwen2_vl
from tests.vision.sample_images import data_url, image_bytes, png_claiming_size, striped_bytes


@pytest.fixture(scope="module")
def vision_server(tmp_path_factory, demo_model_dir):
    from app.main import build_state, create_app

    tmp = tmp_path_factory.mktemp("vision-e2e")
    vlm = build_tiny_qwen2_vl(tmp / "vlm")
    state = build_state(resolved_config(DEMO_YAML.replace("{vlm_path}", str(vlm)), tmp))
    assert state.vision.available, state.vision.reason
    with LiveServer(create_app(state)) as server:
        yield server, state
    state.worker.stop()


def user(text, *urls):
    return {"role": "user", "content": [{"type": "text", "text": text}]
            + [{"type": "image_url", "image_url": {"url": u}} for u in urls]}


def post(base, messages, **kw):
    return httpx.post(base + "/v1/chat/completions", timeout=120,
                      json={"model": "demo", "messages": messages, "max_tokens": 2, "temperature": 0, **kw})


def test_caption_replaces_image_in_the_prompt(vision_server):
    server, _ = vision_server
    client = OpenAI(base_url=server.base_url + "/v1", api_key="x", max_retries=0)
    r = client.chat.completions.create(
        model="demo", max_tokens=2, temperature=0, extra_body={"extensions": True},
        messages=[user("What colour is this?", data_url(striped_bytes(1)))])
    ext = r.model_extra["extensions"]
    (caption,) = ext["captions"]
    assert caption["cached"] is False and caption["caption"]
    prompt = ext["prompt"]
    assert "What colour is this?" in prompt
    assert f"Image 1: {caption['caption']}" in prompt
    assert "data:image" not in prompt and "image_url" not in prompt


def test_earlier_image_hits_the_caption_cache(vision_server):
    server, _ = vision_server
    img = data_url(striped_bytes(2))
    first = post(server.base_url, [user("Describe it.", img)], extensions=True).json()["extensions"]["captions"]
    history = [user("Describe it.", img), {"role": "assistant", "content": "A picture."},
               {"role": "user", "content": "And what else?"}]
    again = post(server.base_url, history, extensions=True).json()["extensions"]["captions"]
    assert first[0]["cached"] is False and again[0]["cached"] is True
    assert again[0]["caption"] == first[0]["caption"]


def test_streaming_reports_captions_in_the_first_chunk(vision_server):
    server, _ = vision_server
    client = OpenAI(base_url=server.base_url + "/v1", api_key="x", max_retries=0)
    chunks = list(client.chat.completions.create(
        model="demo", max_tokens=2, temperature=0, stream=True, extra_body={"extensions": True},
        messages=[user("Hi", data_url(striped_bytes(3)))]))
    assert chunks[0].model_extra["extensions"]["captions"][0]["caption"]
    assert all("extensions" not in c.model_extra for c in chunks[1:])


BAD_IMAGES = [
    ("garbage base64", "data:image/png;base64,@@not-base64@@", "invalid_image"),
    ("not an image", data_url(b"hello, I am text"), "invalid_image"),
    ("truncated", data_url(image_bytes(size=(64, 64))[:60]), "invalid_image"),
    ("too many pixels", data_url(png_claiming_size(50_000, 50_000)), "image_too_large"),
    ("unsupported scheme", "ftp://example.com/cat.png", "invalid_image"),
    ("file outside allowed dir", "file:///etc/passwd", "invalid_image"),
    ("remote off by default", "http://127.0.0.1:9/x.png", "invalid_image"),
]


@pytest.mark.parametrize("name, url, code", BAD_IMAGES, ids=[b[0] for b in BAD_IMAGES])
def test_bad_images_get_400_naming_the_part(vision_server, name, url, code):
    server, _ = vision_server
    messages = [{"role": "system", "content": "Be brief."}, user("Look:", url)]
    r = post(server.base_url, messages)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["code"] == code
    assert err["param"].startswith("messages[1].content[1]")
    assert httpx.get(server.base_url + "/health").json()["status"] == "ok"


def test_too_many_images(vision_server):
    server, state = vision_server
    cap = state.config.vision.params.max_images_per_request
    r = post(server.base_url, [user("All of them", *[data_url(image_bytes((i, 0, 0))) for i in range(cap + 1)])])
    assert r.status_code == 400 and r.json()["error"]["code"] == "too_many_images"


def test_unavailable_vision_gives_placeholder_and_warning(client, demo_server):
    r = post(demo_server.base_url, [user("What is this?", data_url(image_bytes()))], extensions=True)
    assert r.status_code == 200, r.text
    ext = r.json()["extensions"]
    assert "[Image 1: not available, no vision model loaded]" in ext["prompt"]
    assert ext["warnings"] and "missing-vlm" in ext["warnings"][0]


def test_disabled_vision_refuses_images(tmp_path, tiny_model_dir):
    from app.main import build_state, create_app

    yaml = f"models:\n  - name: tiny\n    local_path: {tiny_model_dir}\n    params: {{mem: 16, max_tokens: 2}}\n"
    state = build_state(resolved_config(yaml, tmp_path))
    try:
        with LiveServer(create_app(state)) as server:
            r = httpx.post(server.base_url + "/v1/chat/completions",
                           json={"model": "tiny", "messages": [user("hi", data_url(image_bytes()))]})
            assert r.status_code == 400
            assert r.json()["error"]["code"] == "vision_not_supported"
            assert "does not accept images" in r.json()["error"]["message"]
    finally:
        state.worker.stop()


def test_no_vision_flag_gives_placeholders_not_a_500(tmp_path, demo_model_dir):
    """``tandem serve --no-vision`` with a proxy-mode model: images become placeholders with
    a warning, the documented path (it used to be a 500: the proxy was never built)."""
    from app.main import build_state, create_app

    state = build_state(resolved_config(DEMO_YAML.replace("{vlm_path}", str(tmp_path / "unused")), tmp_path),
                        load_vision=False)
    try:
        assert state.vision.mode == "proxy" and not state.vision.available
        assert "--no-vision" in (state.vision.reason or "")
        with LiveServer(create_app(state)) as server:
            r = post(server.base_url, [user("What is this?", data_url(image_bytes()))], extensions=True)
            assert r.status_code == 200, r.text
            ext = r.json()["extensions"]
            assert "[Image 1: not available, no vision model loaded]" in ext["prompt"]
            assert "--no-vision" in ext["warnings"][0]
            # A broken image is still the client's mistake.
            bad = post(server.base_url, [user("And this?", "data:image/png;base64,AAAA")])
            assert bad.status_code == 400 and bad.json()["error"]["code"] == "invalid_image"
    finally:
        state.worker.stop()


# ---- no vision model: one rule on every format ----------------------------------------------

PLACEHOLDER = "[Image 1: not available, no vision model loaded]"


def image_bodies(url: str) -> dict[str, dict]:
    """The same question with an image, in each format."""
    ask, data = "What is this?", url.split(",", 1)[1]
    return {
        "/v1/chat/completions": {"messages": [user(ask, url)], "max_tokens": 1},
        "/v1/responses": {"input": [{"role": "user", "content": [{"type": "input_text", "text": ask},
                                                                  {"type": "input_image", "image_url": url}]}],
                          "max_output_tokens": 1, "store": False},
        "/v1/messages": {"max_tokens": 1, "messages": [{"role": "user", "content": [
            {"type": "text", "text": ask},
            {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": data}}]}]},
    }


def vision_yaml(model_dir, policy: str | None) -> str:
    import yaml

    from tests.api.serving import tiny_yaml

    config = yaml.safe_load(tiny_yaml(model_dir, vision={}))  # a proxy to a VLM that is not there
    if policy is not None:
        config["models"][0]["capabilities"]["vision_unavailable"] = policy
    return yaml.safe_dump(config)


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_placeholders_are_announced_on_every_format(tmp_path, tiny_model_dir, stream):
    """With no vision model, images become placeholders (the default) and every format says so:
    the x-tandem-warning header (streams too), and the body where it has room when the request
    asks for ``extensions`` (chat's and the Responses API's; Anthropic's Message has no field
    for it: the header alone). /v1/messages and /v1/responses used to answer as if the model
    had seen the image."""
    from tests.api.serving import serving

    with serving(tmp_path, vision_yaml(tiny_model_dir, None)) as served:
        for path, body in image_bodies(data_url(image_bytes())).items():
            for extensions in (False, True) if path != "/v1/messages" else (False,):
                with httpx.stream("POST", served.base_url + path, timeout=60,
                                  json={"model": "tiny", "stream": stream, "extensions": extensions, **body}) as r:
                    text = r.read().decode()
                assert r.status_code == 200, (path, text)
                warning = r.headers.get("x-tandem-warning", "")
                assert "1 image(s) were not described: no vision model is loaded" in warning, (path, r.headers)
                # The non-standard extensions object only when asked for (clients compare shapes).
                assert ('"warnings":["1 image(s) were not described' in text) is extensions, (path, text)
        # Without images nothing is announced.
        r = served.post("/v1/chat/completions", {"model": "tiny", "messages": [user("Hi")], "max_tokens": 1})
        assert r.status_code == 200 and "x-tandem-warning" not in r.headers


def test_refuse_answers_400_on_every_format(tmp_path, tiny_model_dir):
    """``vision_unavailable: refuse``: a 400 in each format's error shape, naming the image."""
    from tests.api.serving import serving

    with serving(tmp_path, vision_yaml(tiny_model_dir, "refuse")) as served:
        for path, body in image_bodies(data_url(image_bytes())).items():
            r = served.post(path, {"model": "tiny", **body})
            assert r.status_code == 400, (path, r.text)
            if path == "/v1/messages":
                assert r.json()["type"] == "error" and r.json()["error"]["type"] == "invalid_request_error"
                message = r.json()["error"]["message"]
            else:
                err = r.json()["error"]
                where = "messages[0].content[1]" if "chat" in path else "input[0].content[1]"
                assert err["code"] == "vision_not_supported" and err["param"].startswith(where), err
                message = err["message"]
            assert "cannot see images now" in message and "'vlm'" in message, message
        r = served.post("/v1/chat/completions", {"model": "tiny", "messages": [user("Hi")], "max_tokens": 1})
        assert r.status_code == 200  # text is still served
