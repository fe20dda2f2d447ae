"""The engine's benchmarks (issue 29), as ratios from one run (``scripts/bench.py --only engine``).

  a. the step: Tandem's decode step (``DecodeBatch``) against mlx-lm's ``BatchGenerator``
     (what drove the text engine before it), driven the same way in this process on the
     demo model: the same prompts, greedy, no stop tokens, so both make the same tokens.
     Single-stream decode tokens/s and the 8-stream aggregate, rounds alternated, medians.
  b. host overhead: a tiny model whose decode step takes about a millisecond on a fast
     device (a 512-token vocabulary: ``tests.fixtures.zoo.build_bench_qwen3_5``, and a
     llama of the same size with plain KV), so what Tandem's host code spends per token
     (scheduling, detokenizing, stop strings, the parser, SSE, the hand-off between
     threads) is what the figure shows. Aggregate tokens/s at 1, 8 and 32 streams of a
     real ``tandem serve`` streaming over HTTP (speculation and prompt lookup off; the
     prefix cache off, so both sides prefill every prompt) against ``BatchGenerator``
     driven in a loop in this process with no server (the same prompt tokens, greedy),
     and ``mlx_lm.server`` for reference. The loop and the servers' rounds alternate
     (the servers idle between their rounds), and each figure is a median. Beside the
     wall-clock figures: the server's CPU time per token against the loop's, which a
     busy machine moves less.
  c. turn 2 on a hybrid model: a tiny Qwen3.5-shaped model (3 gated delta-net layers, 1
     attention layer) served by ``tandem serve``; a conversation whose first turn is
     about 2,000 tokens, then its second turn (turn 1's prompt and answer, and a new
     question). Time to first token of turn 2 over turn 1's, from the prefix cache's
     memory tier (a new conversation each round, so nothing else is reused).
  d. rows per MB: how many rows of a given width admission takes into a KV budget on a
     Qwen3.5-shaped model (Qwen3.5-4B's layer plan: 8 attention layers in 32, the rest
     gated delta-net), by the per-layer accounting (``app.engine.kv.geometry``, read off
     the model) against the old one, which counted every layer of the config as full
     attention (layers x KV heads x head dim x 2 x bytes per element, per token). A
     llama of the same attention shape is the control (both accountings agree there).

``bench_engine(prof)`` returns the lines of ratios; its helpers return the numbers.
"""

from __future__ import annotations

import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "scripts"))

from bench import free_port, stop, wait_ready  # noqa: E402

# The host-overhead benchmark's stream counts (the issue's).
HOST_STREAMS = (1, 8, 32)
# Server params for the host-overhead and turn-2 servers: speculation off, prompt lookup off.
NO_SPECULATION = {"speculative": {"tokens": 0, "prompt_lookup": False}}


# ---- a. the step against mlx-lm's BatchGenerator ------------------------------------------


def drive(batch: Any, prompts: Sequence[list[int]], max_tokens: int) -> dict[str, Any]:
    """Run ``prompts`` through a batch generator (``DecodeBatch`` or mlx-lm's
    ``BatchGenerator``: the same ``insert_segments`` / ``next`` surface) to ``max_tokens``
    each. Returns the decode rate (tokens emitted once every row decodes, over that time),
    the whole run's rate (every token over the time from insert to the last), each row's
    tokens, and the process's CPU seconds."""
    n = len(prompts)
    cpu0, t0 = time.process_time(), time.perf_counter()
    uids = batch.insert_segments([[list(p)] for p in prompts], max_tokens=[max_tokens] * n)
    out: dict[int, list[int]] = {u: [] for u in uids}
    done = 0
    all_decoding: float | None = None
    after = 0
    while done < n:
        _, responses = batch.next()
        for r in responses:
            out[r.uid].append(r.token)
            if all_decoding is not None:
                after += 1
            if r.finish_reason is not None:
                done += 1
        if all_decoding is None and all(out.values()):
            all_decoding = time.perf_counter()
    end = time.perf_counter()
    batch.close()
    total = sum(len(v) for v in out.values())
    decode_span = end - (all_decoding or end)
    return {"decode_tok_s": after / decode_span if decode_span > 0 else float("nan"),
            "tok_s": total / (end - t0), "tokens": [out[u] for u in uids], "total": total,
            "cpu_s": time.process_time() - cpu0}


def new_step(model: Any, n: int) -> Any:
    """Tandem's decode step, greedy, no stop tokens."""
    from app.engine.step import DecodeBatch

    return DecodeBatch(model, stop_tokens=[], prefill_step_size=512, prefill_batch_size=min(n, 8),
                       completion_batch_size=n)


def mlx_lm_step(model: Any, n: int) -> Any:
    """mlx-lm's BatchGenerator, greedy (its default sampler), no stop tokens."""
    from mlx_lm.generate import BatchGenerator

    return BatchGenerator(model, stop_tokens=[], prefill_step_size=512, prefill_batch_size=min(n, 8),
                          completion_batch_size=n)


def chat_prompts(tokenizer: Any, n: int, topic: str = "the sea") -> list[list[int]]:
    """``n`` different short chat prompts, as token ids through the model's chat template."""
    return [list(tokenizer.apply_chat_template([{"role": "user", "content": f"Write story number {i} about {topic}."}],
                                               add_generation_prompt=True)) for i in range(n)]


def compare_steps(model: Any, prompts: list[list[int]], tokens: int, rounds: int) -> dict[str, Any]:
    """The two steps on the same prompts, alternated ``rounds`` times: the median of each
    round's decode rate ratio, the median rates and CPU seconds per token of each, and
    whether they made the same tokens."""
    drive(new_step(model, len(prompts)), prompts, 2)  # warm up this batch shape
    drive(mlx_lm_step(model, len(prompts)), prompts, 2)
    ours, theirs = [], []
    for _ in range(rounds):
        theirs.append(drive(mlx_lm_step(model, len(prompts)), prompts, tokens))
        ours.append(drive(new_step(model, len(prompts)), prompts, tokens))
    med = lambda runs, key: statistics.median(r[key] for r in runs)  # noqa: E731
    cpu = lambda runs: statistics.median(r["cpu_s"] / r["total"] for r in runs)  # noqa: E731
    return {"ratio": statistics.median(a["decode_tok_s"] / b["decode_tok_s"] for a, b in zip(ours, theirs)),
            "ours": med(ours, "decode_tok_s"), "theirs": med(theirs, "decode_tok_s"),
            "ours_cpu": cpu(ours), "theirs_cpu": cpu(theirs),
            "same": all(a["tokens"] == b["tokens"] for a, b in zip(ours, theirs))}


def bench_step(model_path: str, prof: dict[str, Any]) -> list[str]:
    """Section a on the demo model: single-stream decode and the 8-stream aggregate."""
    from mlx_lm import load

    model, tokenizer = load(model_path)
    lines = []
    for n, tokens in zip((1, 8), prof["step_tokens"], strict=True):
        # Short prompts, not the chat template's: the demo model prefills slowly on a CPU.
        prompts = [tokenizer.encode(f"Once upon a time, story {i}") for i in range(n)]
        r = compare_steps(model, prompts, tokens, rounds=prof["step_rounds"])
        what = "single-stream decode" if n == 1 else f"{n}-stream aggregate decode"
        print(f"step, {what}: DecodeBatch {r['ours']:.2f} tok/s, BatchGenerator {r['theirs']:.2f} tok/s; CPU a "
              f"token {r['ours_cpu'] * 1e3:.1f} / {r['theirs_cpu'] * 1e3:.1f} ms; same tokens: {r['same']}")
        lines.append(f"{what} tok/s, Tandem's step / mlx-lm's BatchGenerator (demo model, in process, median of "
                     f"paired rounds): {r['ratio']:.3f}   (target >= 0.97; medians {r['ours']:.2f} / "
                     f"{r['theirs']:.2f}); tokens per CPU-second {r['theirs_cpu'] / r['ours_cpu']:.3f}; "
                     f"same tokens: {'yes' if r['same'] else 'NO'}")
    return lines


# ---- b. host overhead --------------------------------------------------------------------


def build_bench_llama(out: Path, qwen_dir: Path) -> Path:
    """A llama the size of ``build_bench_qwen3_5``'s model (hidden 64, 4 layers, every one
    plain KV), with its 512-token tokenizer, seeded: the host-overhead figures' control."""
    import shutil

    import mlx.core as mx
    from mlx.utils import tree_flatten
    from mlx_lm.models import llama

    out.mkdir(parents=True, exist_ok=True)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(qwen_dir / f, out / f)
    text = json.loads((qwen_dir / "config.json").read_text())["text_config"]
    config = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": 64,
              "num_hidden_layers": 4, "intermediate_size": 128, "num_attention_heads": 2, "num_key_value_heads": 1,
              "head_dim": 64, "rms_norm_eps": 1e-5, "vocab_size": text["vocab_size"], "rope_theta": 10000.0,
              "max_position_embeddings": 32768, "tie_word_embeddings": True, "eos_token_id": text["eos_token_id"]}
    mx.random.seed(0)
    model = llama.Model(llama.ModelArgs.from_dict(config))
    mx.eval(model.parameters())
    mx.save_safetensors(str(out / "model.safetensors"), dict(tree_flatten(model.parameters())),
                        metadata={"format": "mlx"})
    (out / "config.json").write_text(json.dumps(config, indent=2))
    return out


def serve_tandem(model_dir: Path, name: str, params: dict[str, Any]) -> tuple[subprocess.Popen, int]:
    """``tandem serve`` of one model (its log to a file beside its models.yaml); the process and its port."""
    cfg = Path(tempfile.mkdtemp(prefix="tandem-bench-engine-")) / "models.yaml"
    cfg.write_text(json.dumps({"default_model": name, "models": [
        {"name": name, "local_path": str(model_dir), "params": {"prompt_cache_disk_mb": 0, **params}}]}))
    port = free_port()
    log = open(cfg.with_name("server.log"), "wb")  # noqa: SIM115 - the server's, closed with it
    proc = subprocess.Popen([sys.executable, "-m", "app", "serve", "--models-file", str(cfg), "--port", str(port),
                             "--no-vision", "--log-level", "warning"], cwd=REPO, stdout=log, stderr=log,
                            start_new_session=True)
    wait_ready(f"http://127.0.0.1:{port}/health", proc)
    return proc, port


def serve_mlx_lm(model_dir: Path, streams: int) -> tuple[subprocess.Popen, int]:
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "mlx_lm.server", "--model", str(model_dir), "--port", str(port),
                             "--decode-concurrency", str(streams), "--log-level", "WARNING"], cwd=REPO,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    wait_ready(f"http://127.0.0.1:{port}/v1/models", proc)
    return proc, port


async def sse(port: int, body: dict[str, Any]) -> dict[str, Any]:
    """One streamed chat completion over a plain socket (HTTP/1.1, ``Connection: close``),
    read as bytes and never parsed but for its usage: a client that costs the shared
    machine as little as it can. Returns its completion tokens (from usage, else the
    events that carry content) and when its first and last bytes came."""
    data = json.dumps({**body, "stream": True, "stream_options": {"include_usage": True}}).encode()
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    t0 = time.perf_counter()
    writer.write(b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1:%d\r\nContent-Type: application/json\r\n"
                 b"Connection: close\r\nContent-Length: %d\r\n\r\n%s" % (port, len(data), data))
    parts: list[bytes] = []
    first = None
    while chunk := await reader.read(1 << 16):
        first = first or time.perf_counter()
        parts.append(chunk)
    end = time.perf_counter()
    writer.close()
    raw = b"".join(parts)
    if not raw.startswith(b"HTTP/1.1 200") and not raw.startswith(b"HTTP/1.0 200"):
        raise RuntimeError(f"the server answered {raw[:300]!r}")
    tokens = 0
    for line in raw.split(b"\n"):
        if line.startswith(b"data: {") and b'"usage"' in line:
            tokens = (json.loads(line[6:]).get("usage") or {}).get("completion_tokens", tokens)
    return {"tokens": tokens, "start": t0, "first": first or end, "end": end}


async def _streams(port: int, bodies: list[dict[str, Any]]) -> dict[str, Any]:
    runs = await asyncio.gather(*(sse(port, b) for b in bodies))
    start, end = min(r["start"] for r in runs), max(r["end"] for r in runs)
    tokens = sum(r["tokens"] for r in runs)
    return {"tok_s": tokens / (end - start), "tokens": tokens}


def cpu_s(pid: int) -> float:
    """A process's CPU seconds so far (user + system), from /proc or ps."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except OSError:
        out = subprocess.run(["ps", "-o", "cputime=", "-p", str(pid)], capture_output=True, text=True).stdout
        h, m, s = (["0"] * 3 + out.strip().replace("-", ":").split(":"))[-3:]
        return int(h) * 3600 + int(m) * 60 + float(s)


def http_round(port: int, pid: int | None, model: str, prompts: list[str], tokens: int) -> dict[str, Any]:
    """``len(prompts)`` streams at once, greedy, ``tokens`` each: aggregate tokens/s and the
    server's CPU seconds per token."""
    bodies = [{"model": model, "messages": [{"role": "user", "content": p}], "max_tokens": tokens,
               "temperature": 0} for p in prompts]
    before = cpu_s(pid) if pid else 0.0
    r = asyncio.run(_streams(port, bodies))
    r["cpu_per_token"] = (cpu_s(pid) - before) / max(1, r["tokens"]) if pid else float("nan")
    return r


def host_overhead(model_dir: Path, name: str, prof: dict[str, Any], *, with_mlx_server: bool = True,
                  streams: Sequence[int] = HOST_STREAMS) -> dict[int, dict[str, float]]:
    """Section b on one model: at each stream count, Tandem over HTTP, mlx-lm's loop in
    process and (``with_mlx_server``) mlx_lm.server, rounds alternated; medians."""
    from mlx_lm import load

    model, tokenizer = load(str(model_dir))
    texts = [f"Write story number {i} about the sea." for i in range(max(streams))]
    prompts = [list(tokenizer.apply_chat_template([{"role": "user", "content": t}], add_generation_prompt=True))
               for t in texts]
    tokens, rounds = prof["host_tokens"], prof["host_rounds"]
    tandem, tport = serve_tandem(model_dir, name, {
        "max_num_seqs": max(streams), "prefill_batch_size": 8, "mem": 512, "max_queue": 256,
        "prompt_cache": "off", "temperature": 0.0, **NO_SPECULATION})
    theirs = serve_mlx_lm(model_dir, max(streams)) if with_mlx_server else None
    out: dict[int, dict[str, float]] = {}
    try:
        for n in streams:
            http_round(tport, tandem.pid, name, texts[:n], 4)  # warm up this batch shape
            if theirs is not None:
                http_round(theirs[1], None, str(model_dir), texts[:n], 4)
            drive(mlx_lm_step(model, n), prompts[:n], 4)
            runs: dict[str, list[dict[str, Any]]] = {"loop": [], "tandem": [], "mlx_lm.server": []}
            for _ in range(rounds):  # alternated: a busy machine drifts between runs
                loop = drive(mlx_lm_step(model, n), prompts[:n], tokens)
                loop["cpu_per_token"] = loop["cpu_s"] / loop["total"]
                runs["loop"].append(loop)
                runs["tandem"].append(http_round(tport, tandem.pid, name, texts[:n], tokens))
                if theirs is not None:
                    runs["mlx_lm.server"].append(http_round(theirs[1], theirs[0].pid, str(model_dir), texts[:n],
                                                            tokens))
            loops = runs["loop"]
            out[n] = {"loop_tok_s": statistics.median(r["tok_s"] for r in loops),
                      "loop_cpu_per_token": statistics.median(r["cpu_per_token"] for r in loops),
                      "loop_tokens": loops[0]["total"]}
            for k in ("tandem", "mlx_lm.server"):
                if runs[k]:
                    # The median of each round's ratio to the loop run beside it.
                    out[n][f"{k}_ratio"] = statistics.median(r["tok_s"] / x["tok_s"] for r, x in zip(runs[k], loops))
                    out[n][f"{k}_tok_s"] = statistics.median(r["tok_s"] for r in runs[k])
                    out[n][f"{k}_cpu_per_token"] = statistics.median(r["cpu_per_token"] for r in runs[k])
                    out[n][f"{k}_tokens"] = runs[k][0]["tokens"]
            print(f"host overhead, {name}, {n} stream(s): {out[n]}")
    finally:
        stop(tandem)
        if theirs is not None:
            stop(theirs[0])
    return out


def bench_host(prof: dict[str, Any], root: Path) -> list[str]:
    """Section b on the Qwen3.5-shaped and the llama-shaped 512-vocabulary models."""
    from tests.fixtures.zoo import build_bench_qwen3_5

    qwen = build_bench_qwen3_5(root / "bench-qwen3_5")
    models = {"qwen3_5-512": qwen, "llama-512": build_bench_llama(root / "bench-llama", qwen)}
    lines = []
    for name, path in models.items():
        figures = host_overhead(path, name, prof, with_mlx_server=name == "qwen3_5-512")
        for n, f in figures.items():
            line = (f"host overhead, {name}, {n:>2} stream(s): aggregate tok/s Tandem over HTTP / mlx-lm's loop "
                    f"(median of paired rounds): {f['tandem_ratio']:.3f}   (target >= 0.9; medians "
                    f"{f['tandem_tok_s']:.0f} / {f['loop_tok_s']:.0f}); tokens per CPU-second, the server's / the "
                    f"loop's: {f['loop_cpu_per_token'] / f['tandem_cpu_per_token']:.3f} "
                    f"({f['tandem_cpu_per_token'] * 1e6:.0f} / {f['loop_cpu_per_token'] * 1e6:.0f} us a token)")
            if "mlx_lm.server_ratio" in f:
                line += (f"; mlx_lm.server / loop {f['mlx_lm.server_ratio']:.3f}, per CPU-second "
                         f"{f['loop_cpu_per_token'] / f['mlx_lm.server_cpu_per_token']:.3f}")
            if f["tandem_tokens"] != f["loop_tokens"]:
                line += f" (tokens: Tandem {f['tandem_tokens']:.0f}, loop {f['loop_tokens']:.0f})"
            lines.append(line)
    return lines


# ---- c. turn 2 on a hybrid model ---------------------------------------------------------


def _words(n: int, salt: int) -> str:
    base = ("The keeper of the lighthouse logged the weather, the ships that passed, the state of the lamp and "
            "the tides.").split()
    return f"Log {salt}. " + " ".join(base[i % len(base)] for i in range(n))


async def _ttft(port: int, body: dict[str, Any]) -> tuple[float, str, dict[str, Any]]:
    """One streamed request: the time to its first token (the first event after the role
    chunk, which goes out as soon as the request is queued), its text and usage."""
    data = json.dumps({**body, "stream": True, "stream_options": {"include_usage": True}}).encode()
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    t0 = time.perf_counter()
    writer.write(b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1:%d\r\nContent-Type: application/json\r\n"
                 b"Connection: close\r\nContent-Length: %d\r\n\r\n%s" % (port, len(data), data))
    events, first, text, usage = 0, None, [], {}
    buf = b""
    while chunk := await reader.read(1 << 16):
        buf += chunk
        *lines, buf = buf.split(b"\n")
        for line in lines:
            if not line.startswith(b"data: {"):
                continue
            events += 1
            if events == 2:
                first = time.perf_counter()
            obj = json.loads(line[6:])
            usage = obj.get("usage") or usage
            for c in obj.get("choices", []):
                text.append((c.get("delta") or {}).get("content") or "")
    writer.close()
    assert first is not None, "no token came"
    return first - t0, "".join(text), usage


def turn_two(port: int, model: str, words: int, salt: int, answer_tokens: int) -> dict[str, float]:
    """One conversation: turn 1 (a long system prompt and a question), then turn 2 (turn 1,
    its answer, a new question); both TTFTs and turn 2's cached tokens."""
    log = _words(words, salt)
    turn1 = [{"role": "system", "content": "You are a careful assistant. Answer briefly."},
             {"role": "user", "content": f"Here is my log:\n\n{log}\n\nWhat did I log today?"}]
    body = {"model": model, "temperature": 0, "max_tokens": answer_tokens}
    t1, answer, u1 = asyncio.run(_ttft(port, {**body, "messages": turn1}))
    turn2 = [*turn1, {"role": "assistant", "content": answer}, {"role": "user", "content": "And the tides?"}]
    t2, _, u2 = asyncio.run(_ttft(port, {**body, "messages": turn2}))
    return {"ttft1": t1, "ttft2": t2, "prompt1": u1.get("prompt_tokens", 0), "prompt2": u2.get("prompt_tokens", 0),
            "cached2": (u2.get("prompt_tokens_details") or {}).get("cached_tokens", 0)}


def bench_turn_two(prof: dict[str, Any], root: Path) -> list[str]:
    """Section c: turn 2 / turn 1 TTFT on the tiny Qwen3.5-shaped model, prefix cache on."""
    from app.engine.models.demo_model import ensure_demo_model
    from tests.fixtures.zoo import build_zoo_model

    path = build_zoo_model("qwen3_5", root / "zoo-qwen3_5", ensure_demo_model(progress=False))
    proc, port = serve_tandem(path, "qwen3_5", {"max_num_seqs": 4, "mem": 512, "prompt_cache": "prefix",
                                                "cache_min_tokens": 32, **NO_SPECULATION})
    try:
        turn_two(port, "qwen3_5", 64, -1, 4)  # warm up
        runs = [turn_two(port, "qwen3_5", prof["turn_words"], salt, 8) for salt in range(prof["turn_rounds"])]
    finally:
        stop(proc)
    med = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
    print(f"turn 2 on qwen3_5: {med}")
    return [f"turn-2 TTFT / turn-1 TTFT, tiny Qwen3.5-shaped, a {med['prompt1']:.0f}-token turn 1: "
            f"{med['ttft2']:.3f}s / {med['ttft1']:.3f}s = {med['ttft2'] / med['ttft1']:.3f}   (target <= 0.2; "
            f"turn 2 {med['cached2']:.0f} of {med['prompt2']:.0f} prompt tokens cached)"]


# ---- d. rows per MB of KV budget ---------------------------------------------------------

# Qwen3.5-4B's shape as mlx-lm reads it (text config): 32 layers, full attention every 4th.
QWEN3_5_4B = {
    "model_type": "qwen3_5", "text_config": {
        "model_type": "qwen3_5_text", "hidden_size": 2560, "num_hidden_layers": 32, "intermediate_size": 9216,
        "num_attention_heads": 16, "num_key_value_heads": 4, "head_dim": 256, "full_attention_interval": 4,
        "linear_num_value_heads": 32, "linear_num_key_heads": 16, "linear_key_head_dim": 128,
        "linear_value_head_dim": 128, "linear_conv_kernel_dim": 4, "vocab_size": 248320, "rms_norm_eps": 1e-6,
        "max_position_embeddings": 262144, "tie_word_embeddings": True,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000000.0, "partial_rotary_factor": 0.25,
                            "mrope_section": [11, 11, 10], "mrope_interleaved": True}}}
# A llama with the same attention shape in every one of its 32 layers: the control.
LLAMA_4B = {"model_type": "llama", "hidden_size": 2560, "num_hidden_layers": 32, "intermediate_size": 9216,
            "num_attention_heads": 16, "num_key_value_heads": 4, "head_dim": 256, "vocab_size": 248320,
            "rms_norm_eps": 1e-6, "rope_theta": 10000000.0, "tie_word_embeddings": True}


def old_bytes_per_token(config: dict[str, Any], bytes_per_element: int = 2) -> int:
    """The old accounting: every layer of the config full attention."""
    c = config.get("text_config", config)
    head_dim = c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"]
    return c["num_hidden_layers"] * c.get("num_key_value_heads", c["num_attention_heads"]) * head_dim * 2 \
        * bytes_per_element


def rows_admitted(cost: Callable[[int], int], budget_mb: int, width: int) -> int:
    """Rows of ``width`` tokens (prompt + max_tokens) admission takes into ``budget_mb``."""
    from app.engine.batch.admission import Admission, Waiting

    adm: Admission[int] = Admission(budget_mb * 2**20, max_seqs=100_000, max_queue=100_000, queue_timeout_s=60,
                                    cost=cost)
    adm.waiting.extend(Waiting(i, width) for i in range(4096))
    return len(adm.admit(0, lambda n, _: 0))


def accounting(config: dict[str, Any], budget_mb: int, widths: Sequence[int]
               ) -> dict[int, tuple[int, int, int, int]]:
    """For each width: rows admitted by the per-layer accounting and by the old one, and the
    bytes one such row costs by each."""
    import importlib

    import mlx.core as mx

    from app.engine.models.loader import model_geometry

    module = importlib.import_module(f"mlx_lm.models.{config['model_type']}")
    model = module.Model(module.ModelArgs.from_dict(config))  # never evaluated: shapes only
    model.set_dtype(mx.bfloat16)
    geometry = model_geometry(model, None)
    per_token = old_bytes_per_token(config)
    return {w: (rows_admitted(geometry.row_bytes, budget_mb, w), rows_admitted(lambda x: x * per_token, budget_mb, w),
                geometry.row_bytes(w), w * per_token) for w in widths}


def bench_rows(budget_mb: int = 16384, widths: Sequence[int] = (2048, 8192, 32768)) -> list[str]:
    """Section d: rows of each width admitted into ``budget_mb``, by both accountings."""
    lines = []
    for label, config in (("Qwen3.5-4B-shaped", QWEN3_5_4B), ("llama of its attention shape (control)", LLAMA_4B)):
        for width, (new, old, new_b, old_b) in accounting(config, budget_mb, widths).items():
            target = "   (target >= 3)" if config is QWEN3_5_4B else ""
            lines.append(f"rows admitted per MB of KV budget, per-layer accounting / every layer full attention, "
                         f"{label}, {width}-token rows in {budget_mb} MB: {new} / {old} rows = "
                         f"{new / max(old, 1):.2f}{target}; a row costs {new_b / 2**20:.0f} / {old_b / 2**20:.0f} MB "
                         f"({old_b / new_b:.2f}x)")
    return lines


def bench_engine(model_path: str, prof: dict[str, Any], only: Sequence[str] = ("step", "host", "turn", "rows")
                 ) -> list[str]:
    """Every part of the section (``only``: some of step, host, turn, rows); the lines of ratios."""
    root = Path(tempfile.mkdtemp(prefix="tandem-bench-engine-"))
    lines: list[str] = []
    if "rows" in only:
        lines += bench_rows()
    if "turn" in only:
        lines += bench_turn_two(prof, root)
    if "host" in only:
        lines += bench_host(prof, root)
    if "step" in only:
        lines += bench_step(model_path, prof)
    return lines


if __name__ == "__main__":
    import argparse

    from bench import PROFILES

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model-path", help="the step's model (default: the embedded demo model)")
    ap.add_argument("--profile", choices=sorted(PROFILES), default="cpu")
    ap.add_argument("--only", nargs="+", choices=("step", "host", "turn", "rows"), default=None)
    args = ap.parse_args()
    if args.model_path is None:
        from app.engine.models.demo_model import ensure_demo_model

        args.model_path = str(ensure_demo_model(progress=False))
    result = bench_engine(args.model_path, PROFILES[args.profile], args.only or ("step", "host", "turn", "rows"))
    print("\n== ratios ==")
    for line in result:
        print(line)
