"""``tandem ps`` and ``tandem models``: what a running server has loaded, and what models.yaml offers.

Both read the server's ``GET /health``, which is open (no API key) and lists every model with its
state, memory and requests (the shape in the model registry's contract; a server from before the
registry names one chat model and its vision helper, and is read too). ``models`` works with no
server at all: whether a model is loaded is then unknown. Tables for people, ``--json`` for scripts.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any


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
        return body.get("default_model") or body.get("model")

    def describe(self) -> str:
        """One phrase: ``ok, serving X`` / ``unhealthy (503): why`` / ``not reachable (why)``."""
        if not self.reachable:
            return f"not reachable ({self.error})"
        if self.status == 200:
            return f"ok, serving {self.default_model}"
        engine = (self.body or {}).get("engine") or {}
        return f"unhealthy ({self.status}): {engine.get('error') or (self.body or {}).get('status')}"


def fetch_health(url: str, *, timeout: float = 5.0) -> Health:
    """``GET {url}/health``; a 503 is an answer too (its body says why)."""
    health = Health(url)
    try:
        with urllib.request.urlopen(f"{url.rstrip('/')}/health", timeout=timeout) as r:  # noqa: S310 - our URL
            health.status, raw = r.status, r.read()
    except urllib.error.HTTPError as exc:
        health.status, raw = exc.code, exc.read()
    except (urllib.error.URLError, OSError) as exc:
        health.error = str(getattr(exc, "reason", None) or exc)
        return health
    try:
        body = json.loads(raw)
    except ValueError:
        body = None
    health.body = body if isinstance(body, dict) else None
    if health.body is None:
        health.error = "not a Tandem server: /health did not answer JSON"
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
        for name, m in models.items():
            memory, requests = m.get("memory_mb") or {}, m.get("requests") or {}
            out.append(ModelStatus(
                name=name, role=m.get("role", "chat"), state=m.get("state", "unknown"),
                pinned=bool(m.get("pinned")), idle_s=m.get("idle_s"),
                memory_mb={k: memory.get(k) for k in ("weights", "kv_budget", "kv_used")},
                requests={k: requests.get(k) for k in ("running", "waiting")}, error=m.get("error")))
        return out
    return _statuses_before_the_registry(body)


def _statuses_before_the_registry(body: Mapping[str, Any]) -> list[ModelStatus]:
    """``{"status", "model", "engine", "vision"}``: one chat model and, in proxy mode, its VLM."""
    out: list[ModelStatus] = []
    engine = body.get("engine") or {}
    if body.get("model"):
        alive = bool(engine.get("alive"))
        out.append(ModelStatus(
            name=body["model"], role="chat", state="loaded" if alive else "failed",
            requests={"running": engine.get("active"), "waiting": engine.get("waiting")},
            error=engine.get("error")))
    vision = body.get("vision") or {}
    if vision.get("mode") == "proxy" and vision.get("model"):
        out.append(ModelStatus(name=vision["model"], role="vision",
                               state="loaded" if vision.get("available") else "unloaded",
                               error=vision.get("reason")))
    return out


# ---- tandem ps ---------------------------------------------------------------------------------

def ps_report(health: Health) -> dict[str, Any]:
    """``ps --json``: the models in memory (loaded, loading or failed), with the server's memory."""
    body = health.body or {}
    models = [asdict(m) for m in model_statuses(body) if m.state != "unloaded"]
    return {"url": health.url, "status": body.get("status"), "memory": body.get("memory"), "models": models}


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
    memory = report.get("memory")
    if memory:
        line = f"memory: {_mb(memory.get('used_mb'))} used of {_mb(memory.get('limit_mb'))}"
        mlx = memory.get("mlx") or {}
        if mlx:
            line += f" (MLX active {_mb(mlx.get('active_mb'))}, peak {_mb(mlx.get('peak_mb'))})"
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
