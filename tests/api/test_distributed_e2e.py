"""Tandem on two ranks of MLX distributed (the ring backend on loopback), as a user runs it:

    tandem launch --backend ring -n 2 --hosts 127.0.0.1 -- python -m app serve ...

(``tandem launch`` is mlx.launch with an exit status: tests/test_launch.py.)

over the seeded tiny llama (4 attention heads, 2 KV heads: tensor parallel over 2 ranks).
One launch serves most tests in this module; each test leaves it healthy, which proves the
ranks are still in step (a follower whose step differs from rank 0's stops, and rank 0
then answers 503). Answers are compared with the same model served by one process.
Most failure tests launch their ranks directly (MLX_RANK and MLX_HOSTFILE, as mlx.launch
sets them), because mlx.launch itself ends every rank as soon as one dies.
"""

from __future__ import annotations

import concurrent.futures as cf
import contextlib
import json
import os
import random
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml
from openai import OpenAI

from tests.api.serving import Served, serving
from tests.conftest import REPO, free_port

LAUNCH = [sys.executable, "-m", "app", "launch", "--backend", "ring", "-n", "2", "--hosts", "127.0.0.1"]
SERVE = [sys.executable, "-m", "app", "serve", "--log-level", "info"]
PROMPTS = [f"Tell me about the number {i}" + " and the sea" * i for i in range(8)]


def tiny_models(model_dir: Path, embeddings: Path | None = None, **server: Any) -> dict[str, Any]:
    params = {"mem": 16, "max_tokens": 16, "temperature": 0.0, "max_num_seqs": 8, "cache_min_tokens": 16}
    models: list[dict[str, Any]] = [{"name": "tiny", "local_path": str(model_dir), "params": params}]
    if embeddings is not None:
        models.append({"name": "minilm", "role": "embedding", "local_path": str(embeddings)})
    return {"server": {"shutdown_grace_s": 2, **server}, "models": models}


def ring_port() -> int:
    """A port whose next one is free too (the ring backend listens on one port per rank),
    below the kernel's ephemeral range (32768 up on Linux), so no outgoing connection of a
    test running beside this one takes either of them between this check and the bind."""
    rng = random.Random()
    for _ in range(200):
        port = rng.randrange(20000, 32000, 2)
        with contextlib.ExitStack() as held:
            try:
                for p in (port, port + 1):
                    s = held.enter_context(socket.socket())
                    s.bind(("127.0.0.1", p))
            except OSError:
                continue
        return port
    raise RuntimeError("no two free consecutive ports")


def wait_healthy(base: str, procs: list[subprocess.Popen], log: Path, timeout: float = 180) -> None:
    deadline = time.monotonic() + timeout
    while True:
        assert all(p.poll() is None for p in procs) and time.monotonic() < deadline, log.read_text()[-4000:]
        with contextlib.suppress(httpx.TransportError):
            if httpx.get(base + "/health", timeout=2).status_code == 200:
                return
        time.sleep(0.3)


def processes() -> dict[int, tuple[int, str]]:
    """Every process: pid -> (parent pid, state), from ps (Linux and macOS alike)."""
    out = subprocess.run(["ps", "-A", "-o", "pid=,ppid=,stat="], capture_output=True, text=True, check=True).stdout
    rows = (line.split() for line in out.splitlines() if line.strip())
    return {int(pid): (int(ppid), stat) for pid, ppid, stat, *_ in rows}


def children(pid: int) -> list[int]:
    return [child for child, (parent, _) in processes().items() if parent == pid]


def gone(pids: list[int]) -> bool:
    """Every one of ``pids`` has exited (a zombie not yet reaped counts as exited)."""
    running = processes()
    return all(pid not in running or running[pid][1].startswith("Z") for pid in pids)


@contextlib.contextmanager
def launched(tmp: Path, models: dict[str, Any], *, wait: bool = True) -> Iterator[tuple[subprocess.Popen, str, Path]]:
    """``tandem launch`` of two ranks of ``tandem serve``; yields the launcher, rank 0's base URL, the log."""
    (tmp / "models.yaml").write_text(yaml.safe_dump(models))
    port, log = free_port(), tmp / "launch.log"
    proc = subprocess.Popen([*LAUNCH, "-p", str(ring_port()), "--", *SERVE, "--models-file", str(tmp / "models.yaml"),
                             "--port", str(port)], cwd=REPO, stdout=log.open("wb"), stderr=subprocess.STDOUT,
                            stdin=subprocess.DEVNULL, start_new_session=True)
    base = f"http://127.0.0.1:{port}"
    try:
        if wait:
            wait_healthy(base, [proc], log)
        yield proc, base, log
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


@contextlib.contextmanager
def ranks(tmp: Path, models: dict[str, Any]) -> Iterator[tuple[list[subprocess.Popen], str, Path]]:
    """Two ranks started as mlx.launch starts them, without the launcher (which would end
    rank 0 as soon as rank 1 dies)."""
    (tmp / "models.yaml").write_text(yaml.safe_dump(models))
    ring = ring_port()
    (tmp / "hosts.json").write_text(json.dumps([[f"127.0.0.1:{ring}"], [f"127.0.0.1:{ring + 1}"]]))
    port, log = free_port(), tmp / "ranks.log"
    procs = [subprocess.Popen([*SERVE, "--models-file", str(tmp / "models.yaml"), "--port", str(port)], cwd=REPO,
                              env={**os.environ, "MLX_RANK": str(rank), "MLX_HOSTFILE": str(tmp / "hosts.json")},
                              stdout=log.open("ab"), stderr=subprocess.STDOUT, start_new_session=True)
             for rank in range(2)]
    base = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(base, procs, log)
        yield procs, base, log
    finally:
        for p in procs:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGCONT)
                os.killpg(p.pid, signal.SIGKILL)
            p.wait()


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path, minilm_dir: Path) -> Iterator[str]:
    with launched(tmp_path_factory.mktemp("two-ranks"), tiny_models(tiny_model_dir, minilm_dir)) as (_, base, _log):
        yield base


@pytest.fixture(scope="module")
def one_rank(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path, minilm_dir: Path) -> Iterator[Served]:
    """The same models and settings, served by one process."""
    models = tiny_models(tiny_model_dir, minilm_dir)
    with serving(tmp_path_factory.mktemp("one-rank"), yaml.safe_dump(models)) as served:
        yield served


def client(base: str) -> OpenAI:
    return OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0, timeout=120)


def chat_all(base: str, prompts: list[str], **kw: Any) -> list[str | None]:
    """Every prompt at once (the engine batches them), in order."""
    with client(base) as c, cf.ThreadPoolExecutor(len(prompts)) as pool:
        def one(p: str) -> str | None:
            return c.chat.completions.create(model="tiny", messages=[{"role": "user", "content": p}], **kw) \
                .choices[0].message.content
        return list(pool.map(one, prompts))


def health(base: str) -> dict[str, Any]:
    r = httpx.get(base + "/health", timeout=10)
    assert r.status_code == 200, r.text
    return dict(r.json())


def test_health_names_the_launch(two_ranks, one_rank):
    launch = health(two_ranks)["distributed"]
    ranks = launch.pop("ranks")
    assert launch == {"world_size": 2, "rank": 0, "backend": "ring", "mode": "tensor", "error": None}
    # Every rank with its host (a follower says its own in its hello) and health (rank 1 answers pings).
    assert [(r["rank"], r["host"], r["state"], r["error"]) for r in ranks] == [
        (0, socket.gethostname(), "ok", None), (1, socket.gethostname(), "ok", None)]
    assert ranks[1]["address"] == "127.0.0.1" and ranks[1]["last_heard_s"] < 3
    assert health(one_rank.base_url)["distributed"] is None


def test_answers_equal_one_process(two_ranks, one_rank):
    assert chat_all(two_ranks, PROMPTS[:4]) == chat_all(one_rank.base_url, PROMPTS[:4])
    seeded = {"temperature": 1.0, "seed": 11, "max_tokens": 12}
    assert chat_all(two_ranks, PROMPTS[4:], **seeded) == chat_all(one_rank.base_url, PROMPTS[4:], **seeded)


def test_logprobs_n_and_stop_strings_equal_one_process(two_ranks, one_rank):
    def ask(base: str) -> tuple[list[str], list[list[float]], str]:
        with client(base) as c:
            r = c.completions.create(model="tiny", prompt=PROMPTS[2], max_tokens=8, n=2, temperature=1.0, seed=5,
                                     logprobs=2)
            first = r.choices[0].text
            stop = first[len(first) // 2:][:3]  # ends the same generation half way
            stopped = c.completions.create(model="tiny", prompt=PROMPTS[2], max_tokens=8, temperature=1.0, seed=5,
                                           stop=[stop]).choices[0]
        assert stopped.finish_reason == "stop" and first.startswith(stopped.text) and stop not in stopped.text
        texts = [ch.text for ch in r.choices]
        logprobs = [ch.logprobs.token_logprobs for ch in r.choices]  # type: ignore[union-attr]
        return texts, logprobs, stopped.text

    texts, logprobs, stopped = ask(two_ranks)
    want_texts, want_logprobs, want_stopped = ask(one_rank.base_url)
    assert texts == want_texts and stopped == want_stopped
    for got, want in zip(logprobs, want_logprobs, strict=True):
        assert got == pytest.approx(want, abs=1e-3)  # tensor parallel sums in another order


def test_speculation_on_two_ranks_gives_the_plain_answers(two_ranks, one_rank):
    """Rank 0's drafters propose, every rank verifies the same tokens (a follower out of step
    would stop the launch: the health check at the end), and nothing changes in the answers."""
    repetitive = "one two three four five six seven eight " * 6
    prompts = [PROMPTS[3], repetitive, PROMPTS[6]]
    off = {"max_tokens": 24, "extra_body": {"speculative": {"prompt_lookup": False}}}
    plain = chat_all(one_rank.base_url, prompts, **off)
    assert chat_all(two_ranks, prompts, **off) == plain
    before = health(two_ranks)["models"]["tiny"].get("speculation", {})

    def ask(i: int) -> Any:
        with client(two_ranks) as c:
            kw: dict[str, Any] = {"prediction": {"type": "content", "content": plain[i]}} if i == 0 else {}
            return c.chat.completions.create(model="tiny", messages=[{"role": "user", "content": prompts[i]}],
                                             max_tokens=24, **kw)

    with cf.ThreadPoolExecutor(3) as pool:  # one batch: a predicted row, a prompt-lookup row, and one more
        answers = list(pool.map(ask, range(3)))
    assert [a.choices[0].message.content for a in answers] == plain
    assert answers[0].usage.completion_tokens_details.accepted_prediction_tokens > 0  # type: ignore[union-attr]
    after = health(two_ranks)["models"]["tiny"]["speculation"]
    assert after["prediction"]["accepted"] > before.get("prediction", {}).get("accepted", 0)
    # (Whether the prompt-lookup row proposes is the adaptive rule's call from this machine's
    # step timings, which a loaded CI box skews: its answer is what is checked, above.)
    # A seeded sampling row: rank 0 draws with the row's own key at every position, as one process does.
    # (A seed whose answer's text tokenizes back to the tokens drawn, so some of it is kept.)
    seeded = {"temperature": 0.3, "seed": 1, "max_tokens": 16}
    want = chat_all(one_rank.base_url, prompts[:1], **seeded)[0]
    predicted = {"model": "tiny", "messages": [{"role": "user", "content": prompts[0]}],
                 "prediction": {"type": "content", "content": want}, **seeded}
    with client(two_ranks) as c:
        got = c.chat.completions.create(**predicted)
    assert got.choices[0].message.content == want
    # (How many are kept depends on the proposal lengths, which each server's timings choose.)
    assert got.usage.completion_tokens_details.accepted_prediction_tokens > 0  # type: ignore[union-attr]
    assert health(two_ranks)["engine"]["error"] is None


def test_eight_concurrent_streams(two_ranks, one_rank):
    def stream(p: str) -> tuple[str, str | None]:
        with client(two_ranks) as c:
            text, finish = "", None
            for chunk in c.chat.completions.create(model="tiny", messages=[{"role": "user", "content": p}],
                                                   stream=True, max_tokens=24):
                if chunk.choices:
                    text += chunk.choices[0].delta.content or ""
                    finish = chunk.choices[0].finish_reason or finish
            return text, finish

    with cf.ThreadPoolExecutor(8) as pool:
        results = list(pool.map(stream, PROMPTS))
    assert [finish for _, finish in results] == ["length"] * 8
    assert [text for text, _ in results] == chat_all(one_rank.base_url, PROMPTS, max_tokens=24)


def test_a_repeated_prompt_is_served_from_the_prefix_cache(two_ranks, one_rank):
    prompt = "Remember this long preamble. " * 12
    with client(two_ranks) as c:
        answers = [c.chat.completions.create(model="tiny", messages=[{"role": "user", "content": prompt}])
                   for _ in range(2)]
    assert answers[1].usage.prompt_tokens_details.cached_tokens > 0  # type: ignore[union-attr]
    assert answers[0].choices[0].message.content == answers[1].choices[0].message.content
    assert answers[1].choices[0].message.content == chat_all(one_rank.base_url, [prompt])[0]


def test_a_disconnect_mid_stream_and_a_cancelled_request_leave_the_ranks_in_step(two_ranks, one_rank):
    body = {"model": "tiny", "messages": [{"role": "user", "content": PROMPTS[1]}], "max_tokens": 2000}
    with httpx.stream("POST", two_ranks + "/v1/chat/completions", json={**body, "stream": True}, timeout=60) as r:
        chunks = 0
        for line in r.iter_lines():
            chunks += line.startswith("data:")
            if chunks == 4:
                break  # the connection closes here, mid-stream
    with pytest.raises(httpx.ReadTimeout):  # a non-streaming client that gives up
        httpx.post(two_ranks + "/v1/chat/completions", json=body, timeout=1.5)
    deadline = time.monotonic() + 30
    while health(two_ranks)["engine"]["active"]:
        assert time.monotonic() < deadline, "cancelled sequences still run"
        time.sleep(0.2)
    assert chat_all(two_ranks, PROMPTS[5:7]) == chat_all(one_rank.base_url, PROMPTS[5:7])


def test_background_work_paused_for_interactive_resumes_in_step(two_ranks, one_rank):
    """Background sequences leave the batch with their KV and come back (on every rank)."""
    before = health(two_ranks)["engine"]["background_pauses"]
    kw = {"max_tokens": 40, "extra_body": {"priority": "background"}}
    with cf.ThreadPoolExecutor(2) as pool:
        background = pool.submit(chat_all, two_ranks, PROMPTS[:4], **kw)
        time.sleep(1.0)  # the background ones are decoding
        interactive = chat_all(two_ranks, PROMPTS[4:6], max_tokens=4)
        got = background.result()
    assert health(two_ranks)["engine"]["background_pauses"] > before
    assert got == chat_all(one_rank.base_url, PROMPTS[:4], max_tokens=40)
    assert interactive == chat_all(one_rank.base_url, PROMPTS[4:6], max_tokens=4)


@pytest.fixture(scope="module")
def tiny_ministral3_dir(tmp_path_factory: pytest.TempPathFactory, demo_model_dir: Path) -> Path:
    """A seeded random text-only Ministral 3 (3 layers, head_dim 64), which mlx-lm can split by
    layers, saved as mlx_lm.convert saves (with model.safetensors.index.json)."""
    import mlx.core as mx
    from mlx_lm.models import ministral3
    from mlx_lm.utils import save_model

    from tests.fixtures.tiny_ministral import _config

    out = tmp_path_factory.mktemp("tiny-ministral3")
    config = {**_config(49152, 256, 2)["text_config"], "num_hidden_layers": 3, "tie_word_embeddings": True}
    mx.random.seed(0)
    model = ministral3.Model(ministral3.ModelArgs.from_dict(config))
    mx.eval(model.parameters())
    save_model(out, model)
    (out / "config.json").write_text(json.dumps(config))
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        shutil.copy(demo_model_dir / name, out / name)
    return out


@pytest.mark.slow  # a sibling in the default suite covers the path
def test_pipeline_parallel_with_a_quantized_kv_cache_answers_as_one_process(tmp_path, tiny_ministral3_dir):
    models = tiny_models(tiny_ministral3_dir)
    models["models"][0]["params"] |= {"distributed": "pipeline", "kv_cache_bits": 8}
    prompts = [*PROMPTS[:3], PROMPTS[2]]  # the last one again: a prefix-cache hit of quantized KV
    (tmp_path / "one").mkdir()
    with serving(tmp_path / "one", yaml.safe_dump(models)) as one:
        want = chat_all(one.base_url, prompts[:3]) + chat_all(one.base_url, prompts[3:])
    with launched(tmp_path, models) as (_, base, _log):
        assert health(base)["distributed"]["mode"] == "pipeline"
        assert chat_all(base, prompts[:3]) + chat_all(base, prompts[3:]) == want
        assert health(base)["engine"]["prompt_cache_hits"] >= 1
        # Speculation over pipeline stages, the quantized KV rolled back on each: the same answer.
        with client(base) as c:
            predicted = c.chat.completions.create(model="tiny", messages=[{"role": "user", "content": prompts[0]}],
                                                  prediction={"type": "content", "content": want[0]})
        assert predicted.choices[0].message.content == want[0]
        assert predicted.usage.completion_tokens_details.accepted_prediction_tokens > 0  # type: ignore[union-attr]
        assert chat_all(base, prompts[1:3]) == want[1:3]  # still in step


def test_embeddings_are_served_by_rank_0_alone(two_ranks, one_rank):
    texts = ["the sea at night", "a market in the morning"]
    with client(two_ranks) as c, client(one_rank.base_url) as c1:
        got = c.embeddings.create(model="minilm", input=texts)
        want = c1.embeddings.create(model="minilm", input=texts)
    for g, w in zip(got.data, want.data, strict=True):
        assert g.embedding == pytest.approx(w.embedding, abs=1e-5)
    assert health(two_ranks)["models"]["minilm"]["state"] == "loaded"
    assert chat_all(two_ranks, PROMPTS[:2]) == chat_all(one_rank.base_url, PROMPTS[:2])  # the chat still in step


@pytest.mark.parametrize("case", ["heads", pytest.param("native vlm", marks=pytest.mark.slow)])
def test_a_model_that_cannot_be_split_is_refused_on_every_rank(tmp_path, demo_model_dir, tiny_model_dir, case):
    if case == "heads":
        models = {"models": [{"name": "demo", "local_path": str(demo_model_dir)}]}
        message = ("model 'demo' has 9 attention heads and 3 KV heads; tensor parallel over 2 ranks needs both "
                   "divisible by 2")
    else:  # refused before anything is read: the directory need not hold a VLM
        models = {"models": [{"name": "vlm", "local_path": str(tiny_model_dir),
                              "capabilities": {"vision_mode": "native"}}]}
        message = "model 'vlm' is a native VLM, which mlx-lm cannot split over ranks"
    with launched(tmp_path, models, wait=False) as (proc, _, log):
        status = proc.wait(timeout=120)
        out = log.read_text()
    assert status == 2, out[-3000:]  # a service manager sees the refusal (mlx.launch exited 0)
    for rank in (0, 1):
        assert f"rank {rank}: {message}" in out, out[-3000:]
        # Status 2; or, once its peer has exited 2, mlx.launch may end it first (SIGTERM).
        assert re.search(rf"Node with rank {rank} exited with code (2|-15)\b", out), out[-3000:]
    assert "exited with code 2" in out


@pytest.mark.parametrize("how", [signal.SIGKILL, pytest.param(signal.SIGSTOP, marks=pytest.mark.slow)],
                         ids=["killed", "hung"])
def test_a_lost_rank_is_reported_and_requests_get_503(tmp_path, tiny_model_dir, how):
    timeout = 3.0
    models = tiny_models(tiny_model_dir, distributed_timeout_s=timeout, on_engine_death="stay")
    with ranks(tmp_path, models) as (procs, base, log):
        assert chat_all(base, PROMPTS[:1])
        procs[1].send_signal(how)
        started = time.monotonic()
        while (r := httpx.get(base + "/health", timeout=10)).status_code == 200:
            assert time.monotonic() - started < timeout + 3, "rank 0 did not notice"
            time.sleep(0.1)
        assert r.status_code == 503
        assert "rank 1" in r.json()["distributed"]["error"], r.json()
        # The dashboard's ranks: a killed rank is lost (its connection ended), a hung one silent.
        follower = r.json()["distributed"]["ranks"][1]
        assert follower["state"] == ("lost" if how == signal.SIGKILL else "silent"), follower
        assert "rank 1" in r.json()["engine"]["error"]
        refused = httpx.post(base + "/v1/chat/completions", timeout=10,
                             json={"model": "tiny", "messages": [{"role": "user", "content": "hi"}]})
        assert refused.status_code == 503 and refused.json()["error"]["code"] == "engine_unavailable"
        procs[0].send_signal(signal.SIGTERM)
        assert procs[0].wait(timeout=30) == 0, log.read_text()[-3000:]


@pytest.mark.slow  # ~45 s; tests/test_launch.py and the refused model above cover the status in the default suite
def test_the_launch_exits_non_zero_when_a_rank_dies(tmp_path, tiny_model_dir):
    """A rank killed mid-service ends the launch with its status (128 + 9), where mlx.launch
    exited 0, so a service manager (Restart=on-failure, KeepAlive) starts the launch again."""
    with launched(tmp_path, tiny_models(tiny_model_dir)) as (proc, base, log):
        assert chat_all(base, PROMPTS[:1])
        rank_pids = children(proc.pid)
        assert len(rank_pids) == 2
        os.kill(rank_pids[1], signal.SIGKILL)
        assert proc.wait(timeout=60) == 137, log.read_text()[-3000:]
        assert "failed (status 137); exiting 137" in log.read_text()


def test_sigterm_to_the_launcher_ends_every_rank(tmp_path, tiny_model_dir):
    with launched(tmp_path, tiny_models(tiny_model_dir)) as (proc, base, log):
        rank_pids = children(proc.pid)
        assert len(rank_pids) == 2
        assert chat_all(base, PROMPTS[:1])
        proc.send_signal(signal.SIGTERM)  # the launcher alone: it dies without passing the signal on
        deadline = time.monotonic() + 30
        while not gone(rank_pids):
            assert time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(0.2)


@pytest.fixture(scope="module")
def hybrid_dir(tmp_path_factory: pytest.TempPathFactory, zoo_model) -> Path:
    """The zoo's tiny Qwen3.5 (3 gated delta-net layers, 1 attention layer), with the weight
    index pipeline parallel needs (mlx_lm.convert writes one)."""
    from safetensors import safe_open

    out = tmp_path_factory.mktemp("hybrid")
    src = zoo_model("qwen3_5")
    for f in src.iterdir():
        shutil.copy(f, out / f.name)
    with safe_open(str(out / "model.safetensors"), "numpy") as weights:
        names = list(weights.keys())
    (out / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {}, "weight_map": {n: "model.safetensors" for n in names}}))
    return out


def test_a_hybrid_model_on_two_pipeline_ranks_answers_reuses_and_speculates_as_one_process(tmp_path, hybrid_dir):
    """Qwen3.5's gated delta-net layers on two ranks (pipeline stages): the answers are one
    process's; turn 2 starts from turn 1's checkpoint (recurrent state restored, not trimmed);
    proposals are verified (each stage's state restored and the kept tokens replayed) and
    the answer with a prediction is the plain one."""
    models = tiny_models(hybrid_dir)
    models["models"][0]["params"] |= {"distributed": "pipeline"}
    first = PROMPTS[0]
    (tmp_path / "one").mkdir()
    with serving(tmp_path / "one", yaml.safe_dump(models)) as one:
        want = chat_all(one.base_url, PROMPTS[:3])
    with launched(tmp_path, models) as (_, base, _log):
        assert health(base)["distributed"]["mode"] == "pipeline"
        assert chat_all(base, PROMPTS[:3]) == want
        with client(base) as c:
            turn2 = c.chat.completions.create(model="tiny", max_tokens=4, messages=[
                {"role": "user", "content": first}, {"role": "assistant", "content": want[0]},
                {"role": "user", "content": "And then?"}])
            predicted = c.chat.completions.create(model="tiny", messages=[{"role": "user", "content": PROMPTS[1]}],
                                                  prediction={"type": "content", "content": want[1]})
        assert turn2.usage.prompt_tokens_details.cached_tokens >= len(first.split())  # type: ignore[union-attr]
        assert predicted.choices[0].message.content == want[1]
        # Verify steps ran on both stages (a follower checks every token it emits against rank 0's:
        # one out of step would stop the launch). How many a random model's answer keeps of its
        # own text, tokenized anew, is up to the model.
        spec = health(base)["models"]["tiny"]["speculation"]
        assert sum(d["proposed"] for d in spec.values()) > 0, spec
        assert chat_all(base, PROMPTS[3:5]) == chat_all(base, PROMPTS[3:5])  # still in step
        assert health(base)["engine"]["error"] is None
