"""OpenAI's Predicted Outputs (``prediction``) and Tandem's ``speculative`` switches on chat
completions, with the openai SDK against the demo model: the answer is the answer without them,
usage carries accepted/rejected prediction tokens as OpenAI's does, bad shapes are 400s in
OpenAI's error shape."""

from __future__ import annotations

import httpx
import pytest

from app.engine.types import SpeculationRequest
from app.pipeline.pipeline import speculation_for
from app.pipeline.request import Options, Speculation
from tests.api.serving import assert_openai_error

Q = [{"role": "user", "content": "Write the numbers from one to ten in words, separated by commas."}]
KW = dict(model="demo", messages=Q, max_tokens=24, temperature=0)


@pytest.fixture(scope="module")
def plain(client_module):
    """The answer without a prediction (temperature 0)."""
    return client_module.chat.completions.create(**KW)


@pytest.fixture(scope="module")
def client_module(demo_server):
    from openai import OpenAI

    with OpenAI(base_url=demo_server.base_url + "/v1", api_key="unused", max_retries=0, timeout=120) as c:
        yield c


def test_a_prediction_leaves_the_answer_as_it_was_and_fills_usage(client_module, plain):
    text = plain.choices[0].message.content
    assert text
    details = plain.usage.completion_tokens_details
    # OpenAI sends both, 0 without a prediction.
    assert details.accepted_prediction_tokens == 0 and details.rejected_prediction_tokens == 0
    predicted = client_module.chat.completions.create(**KW, prediction={"type": "content", "content": text})
    assert predicted.choices[0].message.content == text
    details = predicted.usage.completion_tokens_details
    assert isinstance(details.accepted_prediction_tokens, int) and isinstance(details.rejected_prediction_tokens, int)
    assert details.accepted_prediction_tokens + details.rejected_prediction_tokens >= 0
    # The array form, and a wrong guess: still the same answer.
    parts = [{"type": "text", "text": "One, two, "}, {"type": "text", "text": "purple elephants."}]
    guessed = client_module.chat.completions.create(**KW, prediction={"type": "content", "content": parts})
    assert guessed.choices[0].message.content == text
    # Drafters switched off for this request: the same answer too.
    off = client_module.chat.completions.create(**KW, extra_body={"speculative": {"prompt_lookup": False,
                                                                                 "draft": False}})
    assert off.choices[0].message.content == text


def _prediction_ids(demo_state, text: str) -> list[int]:
    profile = demo_state.pipeline.profile("demo")
    assert profile is not None
    return list(profile.tokenizer.encode(text, add_special_tokens=False))


def test_a_prediction_equal_to_the_answer_is_accepted_whole(client_module, plain, demo_state):
    """OpenAI's definition: the prediction's tokens that appear in the completion, whatever
    the drafter proposed (on this CPU the adaptive rule proposes few: 2 of 60 accepted
    and 58 rejected used to be reported here)."""
    text = plain.choices[0].message.content
    predicted = client_module.chat.completions.create(**KW, prediction={"type": "content", "content": text})
    assert predicted.choices[0].message.content == text
    details = predicted.usage.completion_tokens_details
    assert details.accepted_prediction_tokens == len(_prediction_ids(demo_state, text))
    assert details.rejected_prediction_tokens == 0


def test_a_prediction_with_nothing_of_the_answer_is_rejected_whole(client_module, plain, demo_state):
    guess = "Purple elephants dance quietly"
    r = client_module.chat.completions.create(**KW, prediction={"type": "content", "content": guess})
    assert r.choices[0].message.content == plain.choices[0].message.content
    details = r.usage.completion_tokens_details
    assert (details.accepted_prediction_tokens, details.rejected_prediction_tokens) == (
        0, len(_prediction_ids(demo_state, guess)))


def test_streamed_usage_carries_the_prediction_fields(client_module, plain, demo_state):
    text = plain.choices[0].message.content
    chunks = list(client_module.chat.completions.create(**KW, stream=True, stream_options={"include_usage": True},
                                                        prediction={"type": "content", "content": text}))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == text
    usage = chunks[-1].usage
    assert usage is not None and usage.completion_tokens == plain.usage.completion_tokens
    assert usage.completion_tokens_details.accepted_prediction_tokens == len(_prediction_ids(demo_state, text))
    assert usage.completion_tokens_details.rejected_prediction_tokens == 0


def test_the_verify_steps_stay_in_metrics(demo_server, client_module, plain):
    """What the drafter proposed and the verify steps kept is /metrics' (per drafter)."""
    text = plain.choices[0].message.content
    client_module.chat.completions.create(**KW, prediction={"type": "content", "content": text})
    metrics = httpx.get(demo_server.base_url + "/metrics", timeout=30).text
    assert 'tandem_speculative_steps_total{drafter="prediction",model="demo"}' in metrics


@pytest.mark.parametrize("field, value", [
    ("prediction", "one, two, three"),
    ("prediction", {"type": "text", "content": "one"}),
    ("prediction", {"type": "content"}),
    ("prediction", {"type": "content", "content": 5}),
    ("prediction", {"type": "content", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}),
    ("prediction", {"type": "content", "content": [{"text": "no type"}]}),
    ("speculative", {"promt_lookup": False}),
    ("speculative", {"draft": [1]}),
    ("speculative", True),
])
def test_bad_prediction_and_switches_are_400_in_openai_shape(demo_server, field, value):
    r = httpx.post(demo_server.base_url + "/v1/chat/completions",
                   json={"model": "demo", "messages": Q, "max_tokens": 1, field: value}, timeout=60)
    err = assert_openai_error(r, 400)
    assert field in (err["param"] or "") + err["message"], err
    assert httpx.get(demo_server.base_url + "/health", timeout=30).status_code == 200  # still serving


def test_a_prediction_longer_than_the_context_is_refused(demo_server):
    r = httpx.post(demo_server.base_url + "/v1/chat/completions", timeout=120,
                   json={"model": "demo", "messages": Q, "max_tokens": 1,
                         "prediction": {"type": "content", "content": "word " * 5000}})
    err = assert_openai_error(r, 400)
    assert err["param"] == "prediction" and "context" in err["message"]


def test_the_prediction_is_the_models_tokens_without_special_ones(demo_state, plain):
    profile = demo_state.pipeline.profile("demo")
    assert profile is not None
    text = plain.choices[0].message.content
    spec = speculation_for(profile, Options("demo", speculation=Speculation(prediction=text, draft=False)))
    assert spec == SpeculationRequest(tuple(profile.tokenizer.encode(text, add_special_tokens=False)), None, False)
    assert profile.tokenizer.bos_token_id not in spec.prediction
    # Nothing asked: the model's defaults, no per-request speculation at all.
    assert speculation_for(profile, Options("demo")) is None


def test_completions_take_the_switches_too(demo_server):
    url = demo_server.base_url + "/v1/completions"
    body = {"model": "demo", "prompt": "One, two,", "max_tokens": 4, "temperature": 0}
    plain = httpx.post(url, json=body, timeout=60).json()["choices"][0]["text"]
    off = httpx.post(url, json={**body, "speculative": {"prompt_lookup": False}}, timeout=60)
    assert off.status_code == 200 and off.json()["choices"][0]["text"] == plain
    assert_openai_error(httpx.post(url, json={**body, "speculative": {"lookup": False}}, timeout=60), 400)
