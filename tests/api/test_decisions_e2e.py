"""POST /v1/decisions end to end, through the openai SDK's ``client.decisions.create``.

On the demo model: every question type, text and message input (tool calls and their
results), image input through the vision proxy's captions, decisions beside chat, and the
bad inputs' 400s. On a scripted tiny Ministral, whose next token after each token is
known: the answer is read at the assistant's first position, reasoning closed, from the
options' own tokens (whole sequences where they share a first token), and equals what the
model itself gives there.
"""

from __future__ import annotations

import asyncio
import math

import httpx
import mlx.core as mx
import pytest
import yaml
from openai import AsyncOpenAI, OpenAI

from tests.api.serving import assert_openai_error, serving
from tests.fixtures.tiny_vlm import build_tiny_qwen2_vl
from tests.vision.sample_images import data_url, image_bytes

# Short inputs and few questions: the demo model reads some 14 tokens a second on a small CPU.
TICKET = "Charged twice, refund please."
QUESTIONS = [
    {"type": "predicate", "name": "double_charge", "instructions": "The customer was charged twice."},
    {"type": "choice", "name": "team", "instructions": "Which team?",
     "choices": [{"value": "billing", "description": "Charges"}, {"value": "tech"}, {"value": True}]},
    {"type": "score", "instructions": [{"type": "input_text", "text": "How urgent?"}],
     "levels": [{"label": "Low"}, {"label": "High", "description": "Today"}]},
]


def check_shape(decision, questions) -> None:
    """Answers in question order, named, each distribution summing to 1, nothing generated."""
    assert [a.name for a in decision.answers] == [q.get("name") for q in questions]
    for a, q in zip(decision.answers, questions):
        if a.type == "refusal":
            continue
        assert a.type == q["type"]
        if a.type == "predicate":
            assert 0.0 <= a.probability <= 1.0
            continue
        total = sum(p.probability for p in a.probabilities)
        assert math.isclose(total, 1.0, abs_tol=1e-4)
        assert 0.0 <= a.confidence <= 1.0
        best = max(a.probabilities, key=lambda p: p.probability)
        if a.type == "choice":
            assert [p.value for p in a.probabilities] == [c["value"] for c in q["choices"]]
            assert a.choice == best.value and type(a.choice) is type(best.value)
        else:
            assert [(p.label, p.value) for p in a.probabilities] == [(lv["label"], i) for i, lv in
                                                                    enumerate(q["levels"])]
            assert math.isclose(a.score, sum(p.value * p.probability for p in a.probabilities), abs_tol=1e-9)
    u = decision.usage
    assert u.output_tokens == 0 and u.output_tokens_details.reasoning_tokens == 0
    assert u.total_tokens == u.input_tokens > 0


def test_every_question_type_about_a_text(client):
    decision = client.decisions.create(model="demo", input=TICKET, questions=QUESTIONS)
    assert decision.model == "demo"
    check_shape(decision, QUESTIONS)
    # A boolean choice comes back a boolean.
    assert decision.answers[1].type == "refusal" or decision.answers[1].probabilities[2].value is True
    # The input's KV is computed once: every question's prompt after the first reads it from the cache.
    u = decision.usage
    assert u.input_tokens_details.cached_tokens > 0
    again = client.decisions.create(model="demo", input=TICKET, questions=QUESTIONS[:1])
    assert again.answers[0].type == decision.answers[0].type
    if again.answers[0].type == "predicate":
        assert again.answers[0].probability == pytest.approx(decision.answers[0].probability, abs=1e-3)
    assert again.usage.input_tokens_details.cached_tokens > 0


def test_a_conversation_with_tool_calls(client):
    conversation = [
        {"role": "system", "content": "Weather bot."},
        {"role": "user", "content": [{"type": "input_text", "text": "Paris weather?"}]},
        {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": '{"city": "Paris"}'},
        {"type": "function_call_output", "call_id": "call_1", "output": "18C"},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "18C."}]},
        {"role": "developer", "content": "Be brief."},
        {"role": "user", "content": [{"type": "input_json", "data": {"rating": 5}}]},
    ]
    questions = [{"type": "choice", "name": "city", "instructions": "Which city?",
                  "choices": [{"value": "Paris"}, {"value": "Rome"}]}]
    decision = client.decisions.create(model="demo", input=conversation, questions=questions)
    check_shape(decision, questions)


def test_decisions_beside_chat_leave_each_chat_answer_its_lone_answer(demo_server):
    base = demo_server.base_url + "/v1"
    prompts = [f"Name a colour starting with {c}." for c in "BG"]

    async def chat(client: AsyncOpenAI, text: str) -> str:
        r = await client.chat.completions.create(model="demo", messages=[{"role": "user", "content": text}],
                                                 max_tokens=6, temperature=0)
        return r.choices[0].message.content

    async def run(with_decisions: bool) -> list[str]:
        async with AsyncOpenAI(base_url=base, api_key="unused", max_retries=0, timeout=300) as client:
            work = [chat(client, p) for p in prompts]
            if with_decisions:
                work += [client.decisions.create(model="demo", input=f"{TICKET} ({i})", questions=QUESTIONS[:2])
                         for i in range(2)]
            results = await asyncio.gather(*work)
        for d in results[len(prompts):]:
            check_shape(d, QUESTIONS[:2])
        return list(results[:len(prompts)])

    assert asyncio.run(run(True)) == asyncio.run(run(False))


BAD = [
    ({"questions": [{"type": "ranking", "instructions": "x"}]}, "questions"),
    ({"questions": [{"type": "choice", "instructions": "x", "choices": [{"value": "a"}]}]},
     "questions[0].choices"),
    ({"questions": [{"type": "choice", "instructions": "x", "choices": [{"value": "a"}, {"value": "a"}]}]},
     "questions[0].choices[1].value"),
    ({"questions": [{"type": "choice", "instructions": "x", "choices": [{"value": 1}, {"value": 2}]}]},
     "questions"),
    ({"questions": [{"type": "predicate", "instructions": "x"}] * 401}, "questions"),
    ({"questions": []}, "questions"),
    ({"questions": [{"type": "score", "instructions": "x", "levels": [{"label": "only"}]}]},
     "questions[0].levels"),
    ({"questions": [{"type": "score", "instructions": "x", "levels": [{"label": str(i)} for i in range(11)]}]},
     "questions[0].levels"),
    ({"questions": [{"type": "predicate", "instructions": "  "}]}, "questions[0].instructions"),
    ({"input": [{"type": "function_call_output", "call_id": "nope", "output": "x"}]}, "input[0].call_id"),
    ({"input": [{"role": "system", "content": [{"type": "input_image", "image_url": "data:,"}]}]},
     "input[0].content[0]"),
    ({"input": [{"role": "user", "content": [{"type": "input_audio", "data": "x"}]}]}, "input[0].content[0]"),
    ({"input": ""}, "input"),
    ({"model": "vlm"}, "model"),
    ({"model": "no-such-model"}, "model"),
]


@pytest.mark.parametrize(("change", "param"), BAD)
def test_bad_input_is_a_400_naming_the_field(demo_server, change, param):
    body = {"model": "demo", "input": TICKET, "questions": [{"type": "predicate", "instructions": "x"}], **change}
    r = httpx.post(demo_server.base_url + "/v1/decisions", json=body, timeout=60)
    assert r.status_code in (400, 404), r.text
    err = r.json()["error"]
    assert err["param"] is not None and err["param"].startswith(param), err
    assert err["message"]


def test_the_server_serves_on_after_bad_decisions(demo_server):
    for change, _ in BAD:
        body = {"model": "demo", "input": TICKET, "questions": [{"type": "predicate", "instructions": "x"}], **change}
        assert httpx.post(demo_server.base_url + "/v1/decisions", json=body, timeout=60).status_code in (400, 404)
    ok = httpx.post(demo_server.base_url + "/v1/decisions", timeout=120, json={
        "model": "demo", "input": "Hi", "questions": [{"type": "predicate", "instructions": "A greeting."}]})
    assert ok.status_code == 200, ok.text


# ---- images -----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def vision(tmp_path_factory, demo_model_dir, minilm_dir):
    """The demo model seeing through a tiny Qwen2-VL's captions; the VLM itself served native;
    an embedding model."""
    vlm = build_tiny_qwen2_vl(tmp_path_factory.mktemp("decisions-vlm") / "vlm")
    models = [
        {"name": "demo", "builtin": "smollm2-135m-instruct",
         "params": {"mem": 64, "max_model_len": 2048, "max_tokens": 4, "temperature": 0.0},
         "capabilities": {"vision_mode": "proxy", "vision_proxy": {"model": "qwen", "max_tokens": 4}}},
        {"name": "qwen", "local_path": str(vlm), "params": {"mem": 16, "max_pixels": 56 * 56},
         "capabilities": {"vision_mode": "native"}},
        {"name": "minilm", "role": "embedding", "builtin": "all-minilm-l6-v2"},
    ]
    text = yaml.safe_dump({"default_model": "demo", "server": {"shutdown_grace_s": 1}, "models": models})
    with serving(tmp_path_factory.mktemp("decisions-vision"), text) as srv:
        with OpenAI(base_url=srv.base_url + "/v1", api_key="unused", max_retries=0, timeout=120) as client:
            yield srv, client


def test_an_image_reaches_a_text_model_as_its_caption(vision):
    _, client = vision
    red = data_url(image_bytes((255, 0, 0)))
    questions = [{"type": "predicate", "name": "red", "instructions": "The picture is red."},
                 {"type": "choice", "name": "colour", "instructions": [
                     {"type": "input_text", "text": "Which colour is it, compared with this one?"},
                     {"type": "input_image", "image_url": data_url(image_bytes((0, 0, 255)))}],
                  "choices": [{"value": "red"}, {"value": "blue"}]}]
    inputs = [{"role": "user", "content": [{"type": "input_text", "text": "A photo:"},
                                           {"type": "input_image", "image_url": red, "detail": "low"}]}]
    decision = client.decisions.create(model="demo", input=inputs, questions=questions)
    check_shape(decision, questions)
    text_only = client.decisions.create(model="demo", input="A photo:", questions=questions[:1])
    # The caption is in the prompt: more tokens than the text alone.
    assert decision.usage.input_tokens > text_only.usage.input_tokens


def test_a_native_vision_model_reads_the_images_itself(vision):
    """The VLM served native sees the input's image, and a question's own, as its tokens (the
    step's score rows read them; tests/engine/test_vlm_step.py checks what is read)."""
    _, client = vision
    questions = [{"type": "predicate", "name": "red", "instructions": "The picture is red."},
                 {"type": "choice", "name": "same", "instructions": [
                     {"type": "input_text", "text": "Is it this colour?"},
                     {"type": "input_image", "image_url": data_url(image_bytes((0, 0, 255)))}],
                  "choices": [{"value": "yes"}, {"value": "no"}, {"value": "unsure"}]}]

    def about(colour: tuple[int, int, int]):
        inputs = [{"role": "user", "content": [{"type": "input_text", "text": "A photo:"},
                                               {"type": "input_image", "image_url": data_url(image_bytes(colour))}]}]
        return client.decisions.create(model="qwen", input=inputs, questions=questions)

    red, blue = about((255, 0, 0)), about((0, 0, 255))
    check_shape(red, questions)
    check_shape(blue, questions)
    text_only = client.decisions.create(model="qwen", input="A photo:", questions=questions[:1])
    assert red.usage.input_tokens > text_only.usage.input_tokens  # the image's own tokens
    assert blue.usage.input_tokens == red.usage.input_tokens


def test_a_model_that_cannot_decide_is_a_400(vision):
    srv, _ = vision
    r = httpx.post(srv.base_url + "/v1/decisions", timeout=60, json={
        "model": "minilm", "input": "x", "questions": [{"type": "predicate", "instructions": "x"}]})
    assert assert_openai_error(r, 400)["param"] == "model"


# ---- a scripted model: the right position, the right tokens -----------------------------

# After [/THINK] (the closed reasoning block a decision's prompt ends with) the model writes
# "blue" then " bird" (the tokens the tokenizer gives "blue bird"): nothing else is likely there.
SCRIPT = "[THINK]Birds.[/THINK]blue bird"


@pytest.fixture(scope="module")
def scripted(tmp_path_factory, tiny_ministral):
    path = tiny_ministral(SCRIPT)
    entry = {"name": "ministral", "local_path": str(path),
             "params": {"mem": 16, "max_tokens": 8, "temperature": 0.0, "max_model_len": 4096}}
    text = yaml.safe_dump({"server": {"shutdown_grace_s": 1}, "models": [entry]})
    with serving(tmp_path_factory.mktemp("decisions-ministral"), text) as srv:
        with OpenAI(base_url=srv.base_url + "/v1", api_key="unused", max_retries=0, timeout=60) as client:
            yield srv, client, path


def test_the_answer_is_read_after_the_closed_reasoning_block(scripted):
    _, client, _ = scripted
    first_token = {"type": "choice", "name": "first", "instructions": "Which bird?",
                   "choices": [{"value": "red"}, {"value": "blue"}]}
    whole = {"type": "choice", "name": "whole", "instructions": "Which bird?",
             "choices": [{"value": "blue whale"}, {"value": "blue bird"}, {"value": "blue"}]}
    predicate = {"type": "predicate", "name": "yes_no", "instructions": "It is a bird."}
    d = client.decisions.create(model="ministral", input="A small bird.", questions=[first_token, whole, predicate])
    assert d.answers[0].choice == "blue" and d.answers[0].probabilities[1].probability > 0.99
    # "blue whale", "blue bird" and "blue" share their first token: each is read as its whole
    # sequence ("blue" as "blue" and nothing after it, which the model does not write either).
    assert d.answers[1].choice == "blue bird" and d.answers[1].probabilities[1].probability > 0.99
    # Neither Yes nor No is what the model would write there: the question is refused.
    assert d.answers[2].type == "refusal" and d.answers[2].name == "yes_no"


def test_the_probabilities_are_the_model_own(scripted):
    """The answer equals the softmax, over the options' first tokens, of the model's own
    log-probabilities after the prompt: the rendered template, reasoning closed."""
    srv, client, path = scripted
    from mlx_lm import load

    question = {"type": "choice", "instructions": "Which bird?", "choices": [{"value": "red"}, {"value": "blue"},
                                                                          {"value": "green"}]}
    d = client.decisions.create(model="ministral", input="A small bird.", questions=[question])
    model, tokenizer = load(str(path))
    turn = ("A small bird.\n\nQuestion:\nWhich bird?\nOptions:\n- red\n- blue\n- green\n"
            "Answer with exactly one of the options, written as above, and nothing else.")
    text = tokenizer.apply_chat_template([{"role": "user", "content": turn}], add_generation_prompt=True,
                                         tokenize=False) + "[THINK][/THINK]"
    ids = tokenizer.encode(text, add_special_tokens=False)
    logits = model(mx.array([ids]))[0, -1].astype(mx.float32)
    lp = logits - mx.logsumexp(logits)
    firsts = [tokenizer.encode(text + c["value"], add_special_tokens=False)[len(ids)] for c in question["choices"]]
    scores = [lp[t].item() for t in firsts]
    expected = [math.exp(s) / sum(math.exp(x) for x in scores) for s in scores]
    assert [p.probability for p in d.answers[0].probabilities] == pytest.approx(expected, abs=1e-4)
