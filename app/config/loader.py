"""Read models.yaml, apply command-line overrides, resolve what will be served.

A bad file stops start-up with a ``ConfigError`` whose message names the file,
the key (``models[0].params.dtype``) and what is allowed there.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from app.config.schema import ModelEntry, ModelsFile, ServerSettings
from app.errors import ConfigError


def _loc(loc: tuple) -> str:
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out or "(top level)"


def format_validation_error(source: str, exc: ValidationError) -> str:
    """One line per problem: file, key, what was wrong and what is allowed."""
    lines = [f"{source}: invalid configuration"]
    for err in exc.errors():
        where = _loc(tuple(p for p in err["loc"] if not str(p).startswith("function-")))
        msg = err["msg"]
        if err["type"] == "extra_forbidden":
            msg = "unknown key (check the spelling; see the models.yaml reference in README.md)"
        elif err["type"] == "literal_error":
            msg = f"got {err.get('input')!r}; allowed: {err['ctx']['expected']}"
        elif "input" in err and not isinstance(err["input"], (dict, list)):
            msg = f"{msg} (got {err['input']!r})"
        lines.append(f"  {where}: {msg}")
    return "\n".join(lines)


def load_models_file(path: str | Path) -> ModelsFile:
    """Parse and validate a models.yaml file."""
    path = Path(path)
    try:
        raw = yaml.safe_load(path.read_text(encoding="utf-8"))
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read models file: {exc.strerror}") from exc
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path}: not valid YAML: {exc}") from exc
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: expected a mapping with a 'models' list at the top")
    try:
        return ModelsFile.model_validate(raw)
    except ValidationError as exc:
        raise ConfigError(format_validation_error(str(path), exc)) from exc


# Command-line flag -> EngineParams field.
PARAM_FLAGS = {
    "dtype": "dtype",
    "isq": "quantization",
    "mem": "mem",
    "kv_cache_bits": "kv_cache_bits",
    "max_num_seqs": "max_num_seqs",
    "prefill_chunk_size": "prefill_chunk_size",
    "max_model_len": "max_model_len",
    "max_queue": "max_queue",
    "temperature": "temperature",
    "max_tokens": "max_tokens",
    "distributed": "distributed",
}
SERVER_FLAGS = ("host", "port", "api_key")


@dataclass(frozen=True)
class ResolvedConfig:
    """What this process serves: the chat model, its vision helper, the server settings."""

    source: str
    primary: ModelEntry
    vision: ModelEntry | None
    server: ServerSettings
    models_file: ModelsFile


def _override(model: Any, updates: dict[str, Any], source: str, where: str) -> Any:
    if not updates:
        return model
    try:
        return type(model).model_validate({**model.model_dump(exclude_unset=True), **updates})
    except ValidationError as exc:
        raise ConfigError(format_validation_error(f"{source} ({where})", exc)) from exc


def resolve(
    models_file: ModelsFile,
    *,
    source: str = "models.yaml",
    model: str | None = None,
    overrides: dict[str, Any] | None = None,
) -> ResolvedConfig:
    """Pick the served model and fold command-line overrides into its params."""
    overrides = {k: v for k, v in (overrides or {}).items() if v is not None}
    name = model or models_file.default_model
    if name is None:
        name = next((m.name for m in models_file.models if m.role == "chat"), None)
    entry = models_file.find(name) if name else None
    if entry is None or entry.role != "chat":
        chat = [m.name for m in models_file.models if m.role == "chat"]
        raise ConfigError(f"{source}: no chat model {name!r}; chat models: {', '.join(chat)}")

    param_updates = {PARAM_FLAGS[k]: v for k, v in overrides.items() if k in PARAM_FLAGS}
    params = _override(entry.params, param_updates, source, "command-line flags")
    primary = entry.model_copy(update={"params": params})

    server_updates = {k: overrides[k] for k in SERVER_FLAGS if k in overrides}
    server = _override(models_file.server, server_updates, source, "command-line flags")

    vision = None
    proxy = primary.capabilities.vision_proxy
    if primary.capabilities.vision_mode == "proxy" and proxy is not None:
        vision = models_file.find(proxy.model)
    return ResolvedConfig(source, primary, vision, server, models_file)

