"""What Tandem serves today, architecture by architecture: issue 29's acceptance list as a matrix.

Every tiny random model of the zoo (tests/fixtures/zoo.py: plain KV, sliding windows,
Mamba, gated delta-net, short convolutions, MoE, KV-shared layers) is served by the real
server (``tests.api.serving``: ``tandem serve``'s uvicorn set-up, the openai SDK as the
client), one server per model at a time, and each item of the acceptance list is its own
test. What fails on today's engine is marked ``xfail(strict=True)`` in ``GAPS`` with what
fails and why, so the matrix turns green as the engine work lands, and a gap closed by
the way shows as an unexpected pass.

Answers are greedy and at most 8 tokens; the chat template's default system prompt makes
every prompt longer than the zoo's 16-token sliding windows, so the sliding layers rotate.
"""

from __future__ import annotations

import contextlib
import functools
import json
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import yaml
from openai import OpenAI

from tests.api.serving import Served, serving
from tests.fixtures.zoo import ZOO, cache_kinds

TEXT = tuple(ZOO)
MAX_TOKENS = 8
# Tokens a turn may lose at its end where the answer, sent back as text, tokenizes anew.
SLACK = 4
QUESTION = [{"role": "user", "content": "Tell me about the sea and the sky in a few words, please."}]

# ---- what fails today, and why (issue 29) ------------------------------------------------

# Gaps of every test on one model.
MODEL_GAPS: dict[str, str] = {}


# Gaps of one test, by model.
GAPS: dict[str, dict[str, str]] = {}


def cases(test: str) -> list[Any]:
    """The zoo's model names for ``test``, each gap marked strict xfail with its reason."""
    marked = []
    for name in TEXT:
        reason = MODEL_GAPS.get(name) or GAPS.get(test, {}).get(name)
        marks = [pytest.mark.xfail(strict=True, reason=f"issue 29: {reason}")] if reason else []
        marked.append(pytest.param(name, marks=marks, id=name))
    return marked


def matrix(test: str, fixture: str = "served"):
    """Parametrize ``fixture`` (module-scoped, by model) over the zoo for ``test``."""
    return pytest.mark.parametrize(fixture, cases(test), indirect=True, scope="module")


# ---- one server per model ------------------------------------------------------------------


@dataclass
class ZooServer:
    """A zoo model served by the real server; ``restart`` stops it (its disk writes finished)
    and serves the same models.yaml again."""

    name: str
    path: Path
    yaml_text: str
    tmp: Path
    served: Served = field(init=False)
    _stack: contextlib.ExitStack = field(default_factory=contextlib.ExitStack)

    def start(self) -> ZooServer:
        self.served = self._stack.enter_context(serving(self.tmp, self.yaml_text))
        return self

    def stop(self) -> None:
        self._stack.close()

    def restart(self) -> None:
        self.stop()
        self._stack = contextlib.ExitStack()
        self.start()

    @contextlib.contextmanager
    def client(self) -> Iterator[OpenAI]:
        with OpenAI(base_url=self.served.base_url + "/v1", api_key="unused", max_retries=0, timeout=60) as c:
            yield c

    model = "zoo"

    def chat(self, messages: list[dict[str, Any]] = QUESTION, **kw: Any) -> Any:
        with self.client() as c:
            return c.chat.completions.create(model="zoo", messages=messages,
                                             **{"max_tokens": MAX_TOKENS, "temperature": 0, **kw})

    def health(self) -> dict[str, Any]:
        return self.served.get("/health").json()


def zoo_yaml(path: Path, cache_dir: Path, **params: Any) -> str:
    entry = {"name": "zoo", "local_path": str(path), "params": {
        "mem": 16, "max_tokens": MAX_TOKENS, "temperature": 0.0, "max_num_seqs": 4, "cache_min_tokens": 8,
        "prompt_cache_disk_mb": 64, "prompt_cache_disk_dir": str(cache_dir), **params}}
    return yaml.safe_dump({"server": {"shutdown_grace_s": 1}, "models": [entry]})


def _serve(request, tmp_path_factory, zoo_model, **params: Any) -> Iterator[ZooServer]:
    name = request.param
    tmp = tmp_path_factory.mktemp(f"served-{name}")
    path = zoo_model(name)
    server = ZooServer(name, path, zoo_yaml(path, tmp / "prompt-cache", **params), tmp)
    try:
        yield server.start()
    finally:
        server.stop()


@pytest.fixture(scope="module")
def served(request, tmp_path_factory, zoo_model) -> Iterator[ZooServer]:
    yield from _serve(request, tmp_path_factory, zoo_model)


@pytest.fixture(scope="module")
def served_kv8(request, tmp_path_factory, zoo_model) -> Iterator[ZooServer]:
    yield from _serve(request, tmp_path_factory, zoo_model, kv_cache_bits=8)


def answer(r: Any) -> str:
    return r.choices[0].message.content or ""


def written(r: Any) -> list[str]:
    """The tokens the model wrote (``r`` asked for logprobs), each as text."""
    return [bytes(e.bytes).decode("utf-8", errors="replace") for e in r.choices[0].logprobs.content]


def cached(r: Any) -> int:
    return r.usage.prompt_tokens_details.cached_tokens


@functools.cache
def _tokenizer(path: Path) -> Any:
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(path / "tokenizer.json"))


@functools.cache
def _template(path: Path) -> Any:
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    # As transformers renders chat templates.
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    return env.from_string(json.loads((path / "tokenizer_config.json").read_text())["chat_template"])


def prompt_ids(path: Path, messages: list[dict[str, Any]]) -> list[int]:
    """The prompt's tokens as the server makes them: the chat template, then the tokenizer."""
    text = _template(path).render(messages=messages, add_generation_prompt=True)
    return list(_tokenizer(path).encode(text, add_special_tokens=False).ids)


def shared_tokens(path: Path, question: list[dict[str, Any]], one: Any, messages: list[dict[str, Any]]) -> int:
    """How many tokens turn 2's prompt (``messages``) shares with turn 1 as the model saw it:
    turn 1's prompt (``question``), then the tokens it wrote (``one``, with logprobs)."""
    first, second = prompt_ids(path, question), prompt_ids(path, messages)
    assert len(first) == one.usage.prompt_tokens, "the test renders the prompt as the server does"
    tokenizer = _tokenizer(path)
    seen = [tokenizer.decode([i], skip_special_tokens=False) for i in first] + written(one)
    shown = [tokenizer.decode([i], skip_special_tokens=False) for i in second]
    n = 0
    while n < min(len(seen), len(shown)) and seen[n] == shown[n]:
        n += 1
    return n


def turn_two(question: list[dict[str, Any]], reply: str) -> list[dict[str, Any]]:
    return [*question, {"role": "assistant", "content": reply}, {"role": "user", "content": "And beyond them?"}]


# Turn 1 of a conversation whose turn 2 sends the answer back as the model wrote it (the
# text of its tokens: a chat answer loses its first token's leading space, and a random
# model's answer starts with one more often than a real model's does), so turn 2's prompt
# starts with the whole of turn 1; and turn 1 of one whose turn 2 sends another answer
# (an edited reply, or a template that drops the reasoning from history, as Qwen3.5's does),
# so turn 2 shares turn 1's prompt only.
WHOLE = [{"role": "user", "content": "What do the fishermen say about the weather tomorrow?"}]
EDITED = [{"role": "user", "content": "Which birds follow the boats back to the port in winter?"}]
EDITED_REPLY = "Gulls, mostly."


def second_turn(server: ZooServer, question: list[dict[str, Any]], one: Any) -> tuple[int, int]:
    """Turn 2 after ``one`` (turn 1 on ``question``, with logprobs): the tokens it reused,
    and the tokens it shares with turn 1. Its answer is also checked against the same
    prompt computed cold (another ``cache_salt``): reuse must not change it."""
    reply = "".join(written(one)) if question is WHOLE else EDITED_REPLY
    messages = turn_two(question, reply)
    two = server.chat(messages)
    assert answer(two) == answer(server.chat(messages, extra_body={"cache_salt": "cold"}))
    shared = shared_tokens(server.path, question, one, messages)
    if question is WHOLE:  # the precondition of the case, not of the engine
        assert shared == one.usage.prompt_tokens + one.usage.completion_tokens, "the answer came back whole"
    return cached(two), shared


# ---- the zoo itself ------------------------------------------------------------------------


@pytest.mark.parametrize("name", TEXT)
def test_make_cache_gives_the_architectures_cache_kinds(zoo_model, name):
    """The built directory loads in mlx-lm, and its caches are the mix the zoo promises."""
    from mlx_lm.utils import load_model

    model, _ = load_model(zoo_model(name))
    assert cache_kinds(model) == list(ZOO[name].caches)
    assert len(model.layers) == ZOO[name].layers


def test_the_bench_model_is_qwen3_5_shaped_with_a_512_token_vocabulary(tmp_path):
    from mlx_lm import load

    from tests.fixtures.zoo import build_bench_qwen3_5

    model, tokenizer = load(str(build_bench_qwen3_5(tmp_path / "bench")))
    assert cache_kinds(model) == list(ZOO["qwen3_5"].caches)
    assert len(tokenizer.vocab) == model.args.text_config["vocab_size"] == 512
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "Hello"}], add_generation_prompt=True)
    assert tokenizer.decode(prompt).endswith("<|im_start|>assistant\n")


# ---- the matrix ------------------------------------------------------------------------------


@matrix("loads")
def test_loads(served):
    listed = [m.id for m in OpenAI(base_url=served.served.base_url + "/v1", api_key="x").models.list().data]
    assert "zoo" in listed
    r = served.chat()
    assert r.usage.completion_tokens > 0 and r.choices[0].finish_reason in ("stop", "length")


@matrix("stream")
def test_streamed_equals_non_streamed(served):
    whole = served.chat()
    with served.client() as c:
        chunks = list(c.chat.completions.create(model="zoo", messages=QUESTION, max_tokens=MAX_TOKENS, temperature=0,
                                                stream=True, stream_options={"include_usage": True}))
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    assert text == answer(whole)
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens


MIXED = [
    [{"role": "user", "content": "Hi."}],
    [{"role": "user", "content": "Write a long poem about the rain falling on the roofs of an old city at night."}],
    [{"role": "system", "content": "You answer in French."}, {"role": "user", "content": "What is a cat?"}],
]


@matrix("mixed_batch")
def test_a_mixed_batch_keeps_each_rows_lone_answer(served):
    """Rows of different lengths sent at once (prefilled together, or one prefilling while
    another decodes) answer as they do alone."""
    alone = [answer(served.chat(m, extra_body={"cache_salt": "alone"})) for m in MIXED]
    start = threading.Barrier(len(MIXED))

    def together(messages: list[dict[str, Any]]) -> str:
        start.wait()
        return answer(served.chat(messages, extra_body={"cache_salt": "together"}))

    with ThreadPoolExecutor(len(MIXED)) as pool:
        assert list(pool.map(together, MIXED)) == alone


@matrix("turn_2")
def test_turn_2_reuses_turn_1(served):
    """Turn 2 starts from turn 1's end, its prompt and answer."""
    got, shared = second_turn(served, WHOLE, served.chat(WHOLE, logprobs=True))
    assert got >= shared - SLACK, f"turn 2 reused {got} of the {shared} tokens of turn 1 it starts with"


@matrix("turn_2_edited")
def test_turn_2_after_another_answer_reuses_turn_1s_prompt(served):
    """Turn 2 whose history holds another answer than the model wrote still starts from the
    end of turn 1's prompt: what is stored (prompt and answer) is cut back to what is shared."""
    got, shared = second_turn(served, EDITED, served.chat(EDITED, logprobs=True))
    assert got >= shared - SLACK, f"turn 2 reused {got} of the {shared} tokens it shares with turn 1"


@matrix("same_prompt")
def test_the_same_prompt_again_reuses_it(served):
    """A request sent again (a retry, a regenerate) reuses all of its prompt but the last token,
    though what is stored is the prompt with its answer after it."""
    question = [{"role": "user", "content": "Why is the sea salty?"}]
    first = served.chat(question)
    again = served.chat(question)
    assert cached(again) >= first.usage.prompt_tokens - 1
    assert answer(again) == answer(first)


@pytest.fixture(scope="module")
def restarted(served) -> dict[str, Any]:
    """Turn 1 of both conversations, then a restart (its disk writes finished first)."""
    turns = {"whole": served.chat(WHOLE, logprobs=True), "edited": served.chat(EDITED, logprobs=True)}
    served.restart()
    return turns


@matrix("restart")
def test_turn_2_reuses_turn_1_after_a_restart(served, restarted):
    """The disk tier keeps turn 1 across a restart: turn 2 on the new server starts from it."""
    got, shared = second_turn(served, WHOLE, restarted["whole"])
    assert got >= shared - SLACK, f"turn 2 reused {got} of the {shared} tokens of turn 1 it starts with"
    assert served.health()["engine"]["prompt_cache_tiers"]["disk"]["hits"] >= 1


@matrix("restart_edited")
def test_turn_2_after_another_answer_reuses_turn_1s_prompt_after_a_restart(served, restarted):
    got, shared = second_turn(served, EDITED, restarted["edited"])
    assert got >= shared - SLACK, f"turn 2 reused {got} of the {shared} tokens it shares with turn 1"


def verified(server: ZooServer) -> int:
    """Prediction tokens the engine's verify steps have accepted so far (/health)."""
    return server.health()["engine"]["speculation"].get("prediction", {}).get("accepted", 0)


@matrix("prediction")
def test_an_exact_prediction_keeps_the_greedy_answer_and_is_accepted(served):
    """The prediction is the answer as the model writes it (the text of its tokens, which
    tokenizes to them again: see ``WHOLE``). Usage counts the prediction's tokens that
    appear in the answer, speculation or not; the verify steps' own count is on /health."""
    plain = served.chat(WHOLE, logprobs=True, extra_body={"cache_salt": "plain"})
    before = verified(served)
    predicted = served.chat(WHOLE, prediction={"type": "content", "content": "".join(written(plain))},
                            extra_body={"cache_salt": "predicted"})
    assert answer(predicted) == answer(plain)
    assert predicted.usage.completion_tokens_details.accepted_prediction_tokens > 0
    assert verified(served) > before, "the engine verified none of the prediction"


@matrix("kv_bits", "served_kv8")
def test_kv_cache_bits_8(served_kv8):
    """Quantized KV serves, and turn 2 reuses turn 1."""
    got, shared = second_turn(served_kv8, WHOLE, served_kv8.chat(WHOLE, logprobs=True))
    assert got >= shared - SLACK, f"turn 2 reused {got} of the {shared} tokens of turn 1 it starts with"


@matrix("n")
def test_n_choices_share_the_prompt(served):
    question = [{"role": "user", "content": "Count the waves until the lighthouse turns."}]
    one = served.chat(question, extra_body={"cache_salt": "one"})
    three = served.chat(question, n=3, extra_body={"cache_salt": "three"})
    assert [c.index for c in three.choices] == [0, 1, 2]
    assert {c.message.content for c in three.choices} == {answer(one)}  # greedy: one answer thrice
    assert three.usage.completion_tokens == 3 * one.usage.completion_tokens


# Short, so that a random model's answer under it ends within a few tokens.
SCHEMA = {"enum": ["high", "low"]}


@matrix("json_schema")
def test_json_schema(served):
    r = served.chat(response_format={"type": "json_schema", "json_schema": {
        "name": "tide", "schema": SCHEMA, "strict": True}})
    assert json.loads(answer(r)) in ("high", "low")


@matrix("logprobs")
def test_logprobs(served):
    r = served.chat(logprobs=True, top_logprobs=2)
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens > 0
    for entry in content:  # greedy: the chosen token is the most likely one
        assert entry.logprob <= 0 and len(entry.top_logprobs) == 2
        assert entry.top_logprobs[0].token == entry.token
        assert entry.top_logprobs[0].logprob == pytest.approx(entry.logprob)


# A row this long crosses every window and fills whole 256-token KV allocation steps.
ROW_TOKENS = 512


@matrix("kv_accounting")
def test_kv_accounting_by_layer_kind(served):
    """What admission counts for a row of ``ROW_TOKENS`` tokens is what the model's caches hold
    for it: attention layers by tokens, sliding layers capped at their window, recurrent layers
    a constant. Admission's figure is read from /health (``kv_layers``: per layer kind, bytes
    per token, per row, the window), the caches' bytes from mlx-lm's own caches for the model
    after such a row."""
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache
    from mlx_lm.utils import load_model

    engine = served.health()["engine"]
    admitted = 0  # one row of ROW_TOKENS tokens, as /health's per-kind figures count it
    for kind, layers in engine["kv_layers"].items():
        tokens = min(ROW_TOKENS, layers["window"]) if kind == "rotating" else ROW_TOKENS
        admitted += layers["bytes_per_token"] * tokens + layers["bytes_per_row"]
    model, _ = load_model(served.path)
    caches = make_prompt_cache(model)
    tokens = mx.arange(1000, 1000 + ROW_TOKENS)[None]
    for start in range(0, ROW_TOKENS - 1, 128):  # prefilled in chunks, then a decode step
        model(tokens[:, start:min(start + 128, ROW_TOKENS - 1)], cache=caches)
    model(tokens[:, -1:], cache=caches)
    mx.eval([c.state for c in caches])
    held = sum(c.nbytes for c in caches)
    assert held <= admitted <= held * 1.1, f"admission counts {admitted / held:.2f}x the bytes the caches hold"


def background_pauses(server: Any) -> int:
    return server.health()["engine"]["background_pauses"]


def paused_answers(server: Any, *, extra: dict[str, Any] | None = None, **kw: Any) -> tuple[list[str], list[str]]:
    """Three background requests, decoding, then an interactive one: all but background_share
    of them leave the batch with their KV (and the token each had drawn) and come back once it
    has its first token. Their answers, and each one's answer alone."""
    questions = [[{"role": "user", "content": f"Tell me a long story about the harbour, part {i}."}]
                 for i in range(3)]
    body = {"max_tokens": 400, **kw}
    alone = [answer(server.chat(q, **body, extra_body={"priority": "background", "cache_salt": "alone",
                                                       **(extra or {})})) for q in questions]

    def background(q: list[dict[str, Any]], started: threading.Event) -> str:
        with server.client() as c:
            stream = c.chat.completions.create(model=server.model, messages=q, stream=True, temperature=0,
                                               **body, extra_body={"priority": "background", **(extra or {})})
            text = []
            for chunk in stream:
                started.set()
                text.append(chunk.choices[0].delta.content or "" if chunk.choices else "")
            return "".join(text)

    with ThreadPoolExecutor(3) as pool:
        events = [threading.Event() for _ in questions]
        running = [pool.submit(background, q, e) for q, e in zip(questions, events)]
        for e in events:
            e.wait(60)  # decoding: an interactive request now pauses them
        server.chat([{"role": "user", "content": "Quick: is the tide high?"}], max_tokens=2,
                    extra_body=extra or {})
        got = [f.result() for f in running]
    return got, alone


@pytest.mark.slow  # ~40 s a model here; tests/engine/test_step.py resumes paused rows of every cache kind
@matrix("pauses")
def test_background_rows_paused_for_interactive_work_keep_their_answers(served):
    before = background_pauses(served)
    got, alone = paused_answers(served)
    assert got == alone
    assert background_pauses(served) > before, "no background row was paused"
