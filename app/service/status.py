"""``tandem ps`` and ``tandem models``: what a running server has loaded, and what models.yaml offers.

Both read the server's ``GET /health``, which is open (no API key) and lists every model with its
state, memory and requests (the shape in the model registry's contract; a server from before the
registry names one chat model and its vision helper, and is read too). ``models`` works with no
server at all: whether a model is loaded is then unknown. Tables for people, ``--json`` for scripts.

What a server answers is not trusted: ``/health`` may be anyone's on that port. Its answer is read
within one overall timeout and up to ``MAX_HEALTH_BYTES``, a body of the wrong shape reads as
unknown values rather than a traceback, and every text from it is stripped of control characters
(ANSI escapes included) before it reaches the terminal.
"""

from __future__ import annotations

import json
import re
import threading
import urllib.error
import urllib.request
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

# A Tandem /health is a few KB; an answer past this is not one.
MAX_HEALTH_BYTES = 1 << 20
# ANSI CSI and OSC sequences, then any other C0/C1 control character.
_CONTROL = re.compile(r"\x1b\[[0-?]*[ -/]*[@-~]?|\x1b\][^\x07\x1b]*(?:\x07|\x1b\\)?|[\x00-\x1f\x7f-\x9f]")
# A text from the server longer than this is cut (a name or an error message).
_MAX_TEXT = 200


def printable(value: Any) -> str:
    """``value`` as one line of plain text, safe to print: no escapes, no control characters."""
    text = _CONTROL.sub("", str(value))
    return text if len(text) <= _MAX_TEXT else text[: _MAX_TEXT - 3] + "..."


def _text(value: Any, default: str | None = None) -> str | None:
    return default if value is None else printable(value)


def _number(value: Any) -> Any:
    """An int or float from the server, else None (a bool or a string is not a figure)."""
    return value if isinstance(value, int | float) and not isinstance(value, bool) else None


def _mapping(value: Any) -> Mapping[str, Any]:
    return value if isinstance(value, Mapping) else {}


@dataclass
class Health:
    """One ``GET /health``: its status and body, or why the server could not be reached."""

    url: str
    status: int | None = None
    body: dict[str, Any] | None = None
    error: str | None = None

    @property
    def reachable(self) -> bool:
        return self.status is not None

    @property
    def default_model(self) -> str | None:
        body = self.body or {}
        return _text(body.get("default_model") or body.get("model"))

    def describe(self) -> str:
        """One phrase: ``ok, serving X`` / ``unhealthy (503): why`` / ``not reachable (why)``."""
        if not self.reachable:
            return f"not reachable ({self.error})"
        if self.status == 200:
            return f"ok, serving {self.default_model}"
        engine = _mapping((self.body or {}).get("engine"))
        return f"unhealthy ({self.status}): {_text(engine.get('error') or (self.body or {}).get('status'))}"


def fetch_health(url: str, *, timeout: float = 5.0) -> Health:
    """``GET {url}/health``; a 503 is an answer too (its body says why). ``timeout`` bounds the
    whole exchange, not each read: a server that trickles its answer is given up on."""
    done: list[Health] = []
    reader = threading.Thread(target=lambda: done.append(_fetch(url, timeout)), daemon=True)
    reader.start()
    reader.join(timeout)
    return done[0] if done else Health(url, error=f"no whole answer from /health within {timeout:g} s")


def _fetch(url: str, timeout: float) -> Health:
    health = Health(url)
    try:
        with urllib.request.urlopen(f"{url.rstrip('/')}/health", timeout=timeout) as r:  # noqa: S310 - our URL
            health.status, raw = r.status, r.read(MAX_HEALTH_BYTES + 1)
    except urllib.error.HTTPError as exc:
        health.status, raw = exc.code, exc.read(MAX_HEALTH_BYTES + 1)
    except (urllib.error.URLError, OSError) as exc:
        health.error = printable(getattr(exc, "reason", None) or exc)
        return health
    if len(raw) > MAX_HEALTH_BYTES:
        health.error = f"not a Tandem server: /health answered more than {MAX_HEALTH_BYTES >> 20} MB"
        return health
    try:
        body = json.loads(raw)
    except (ValueError, RecursionError):
        body = None
    health.body = body if isinstance(body, dict) else None
    if health.body is None:
        health.error = "not a Tandem server: /health did not answer a JSON object"
    return health


@dataclass
class ModelStatus:
    """One model as ``ps`` shows it (the contract's per-model shape, with its name)."""

    name: str
    role: str
    state: str  # loaded | loading | unloaded | failed
    pinned: bool = False
    idle_s: float | None = None
    memory_mb: dict[str, float | None] = field(
        default_factory=lambda: {"weights": None, "kv_budget": None, "kv_used": None})
    requests: dict[str, int | None] = field(default_factory=lambda: {"running": None, "waiting": None})
    error: str | None = None


def model_statuses(body: Mapping[str, Any]) -> list[ModelStatus]:
    """Every model a ``/health`` body knows, whichever shape it has."""
    models = body.get("models")
    if isinstance(models, Mapping):
        out = []
        for name, entry in models.items():
            m = _mapping(entry)
            memory, requests = _mapping(m.get("memory_mb")), _mapping(m.get("requests"))
            out.append(ModelStatus(
                name=printable(name), role=_text(m.get("role")) or "chat", state=_text(m.get("state")) or "unknown",
                pinned=m.get("pinned") is True, idle_s=_number(m.get("idle_s")),
                memory_mb={k: _number(memory.get(k)) for k in ("weights", "kv_budget", "kv_used")},
                requests={k: _number(requests.get(k)) for k in ("running", "waiting")}, error=_text(m.get("error"))))
        return out
    return _statuses_before_the_registry(body)


def _statuses_before_the_registry(body: Mapping[str, Any]) -> list[ModelStatus]:
    """``{"status", "model", "engine", "vision"}``: one chat model and, in proxy mode, its VLM."""
    out: list[ModelStatus] = []
    engine = _mapping(body.get("engine"))
    if body.get("model"):
        alive = bool(engine.get("alive"))
        out.append(ModelStatus(
            name=printable(body["model"]), role="chat", state="loaded" if alive else "failed",
            requests={"running": _number(engine.get("active")), "waiting": _number(engine.get("waiting"))},
            error=_text(engine.get("error"))))
    vision = _mapping(body.get("vision"))
    if vision.get("mode") == "proxy" and vision.get("model"):
        out.append(ModelStatus(name=printable(vision["model"]), role="vision",
                               state="loaded" if vision.get("available") else "unloaded",
                               error=_text(vision.get("reason"))))
    return out


# ---- tandem ps ---------------------------------------------------------------------------------

def ps_report(health: Health) -> dict[str, Any]:
    """``ps --json``: the models in memory (loaded, loading or failed), with the server's memory."""
    body = health.body or {}
    models = [asdict(m) for m in model_statuses(body) if m.state != "unloaded"]
    memory = body.get("memory")
    return {"url": health.url, "status": _text(body.get("status")),
            "memory": memory if isinstance(memory, Mapping) else None, "models": models}


def ps_table(report: Mapping[str, Any]) -> str:
    """``ps`` for people."""
    rows = [["NAME", "ROLE", "STATE", "WEIGHTS", "KV USED / BUDGET", "RUNNING", "WAITING", "IDLE"]]
    for m in report["models"]:
        mem, req = m["memory_mb"], m["requests"]
        kv = "-" if mem["kv_budget"] is None else f"{_mb(mem['kv_used'])} / {_mb(mem['kv_budget'])}"
        rows.append([m["name"] + (" (pinned)" if m["pinned"] else ""), m["role"], m["state"], _mb(mem["weights"]),
                     kv, _count(req["running"]), _count(req["waiting"]), _idle(m["idle_s"])])
    lines = [table(rows)] if report["models"] else ["no model loaded"]
    lines += [f"  {m['name']}: {m['error']}" for m in report["models"] if m["error"]]
    memory = _mapping(report.get("memory"))
    if memory:
        line = f"memory: {_mb(_number(memory.get('used_mb')))} used of {_mb(_number(memory.get('limit_mb')))}"
        mlx = _mapping(memory.get("mlx"))
        if mlx:
            line += f" (MLX active {_mb(_number(mlx.get('active_mb')))}, peak {_mb(_number(mlx.get('peak_mb')))})"
        lines.append(line)
    return "\n".join(lines)


# ---- tandem models -----------------------------------------------------------------------------

@dataclass
class Entry:
    """A models.yaml entry as ``models`` needs it (no pydantic here: the CLI hands these over)."""

    name: str
    role: str
    source: dict[str, str]  # the entry's source key and value: {"hf_id": "org/name"}


def models_report(entries: Sequence[Entry], default_model: str | None, health: Health,
                  downloaded: Callable[[Entry], bool | None]) -> dict[str, Any]:
    """``models --json``: each entry with its role, whether it is on disk, and whether it is
    loaded (``None``: unknown, no server answered)."""
    states = {m.name: m.state for m in model_statuses(health.body)} if health.body else None
    rows = []
    for e in entries:
        state = states.get(e.name, "unloaded") if states is not None else None
        rows.append({"name": e.name, "role": e.role, "source": e.source, "default": e.name == default_model,
                     "downloaded": downloaded(e), "loaded": None if state is None else state == "loaded",
                     "state": state})
    server = "unreachable" if not health.reachable else "ok" if health.status == 200 else "unhealthy"
    return {"url": health.url, "server": server, "error": health.error, "models": rows}


def models_table(report: Mapping[str, Any]) -> str:
    """``models`` for people."""
    rows = [["NAME", "ROLE", "DOWNLOADED", "LOADED", "SOURCE"]]
    for m in report["models"]:
        (kind, value), = m["source"].items()
        rows.append([m["name"] + (" *" if m["default"] else ""), m["role"], _yes_no(m["downloaded"]),
                     _yes_no(m["loaded"]) if m["state"] in (None, "loaded", "unloaded") else m["state"],
                     value if kind == "hf_id" else f"{kind}: {value}"])
    lines = [table(rows), "* default model"]
    if report["server"] == "unreachable":
        lines.append(f"loaded: unknown, no server at {report['url']} ({report['error']})")
    return "\n".join(lines)


# ---- formatting --------------------------------------------------------------------------------

def table(rows: Sequence[Sequence[str]]) -> str:
    """Left-aligned columns, two spaces apart."""
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows)


def _mb(value: float | None) -> str:
    if value is None:
        return "-"
    return f"{value / 1024:.1f} GB" if value >= 1024 else f"{value:.0f} MB" if value >= 10 else f"{value:.1f} MB"


def _count(value: int | None) -> str:
    return "-" if value is None else str(value)


def _idle(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    if seconds < 120:
        return f"{seconds:.0f}s"
    return f"{seconds / 60:.0f}m" if seconds < 7200 else f"{seconds / 3600:.1f}h"


def _yes_no(value: bool | None) -> str:
    return "?" if value is None else "yes" if value else "no"
