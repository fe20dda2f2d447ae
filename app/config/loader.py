"""Read models.yaml, apply command-line overrides, resolve what will be served.

A bad file stops start-up with a ``ConfigError`` whose message names the file,
the key (``models[0].params.dtype``) and what is allowed there.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from types import UnionType
from typing import Any, Literal, Union, get_args, get_origin

import yaml
from pydantic import SecretStr, ValidationError
from pydantic.fields import FieldInfo

from app.config.schema import ROLE_ENTRIES, ChatEntry, ChatParams, ModelEntry, ModelsFile, ServerSettings, role_params
from app.errors import ConfigError


def _loc(loc: tuple) -> str:
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out or "(top level)"


def _entry_loc(loc: tuple) -> tuple[tuple, str | None]:
    """An entry's location without the role tag pydantic puts after ``models[i]``, and that role."""
    if len(loc) > 2 and loc[0] == "models" and isinstance(loc[1], int) and loc[2] in ROLE_ENTRIES:
        return loc[:2] + loc[3:], loc[2]
    return loc, None


def _wrong_role(loc: tuple, role: str, data: Any) -> str | None:
    """Why a key is refused when another role's entries take it (``temperature`` on an embedding
    model), naming the entry and what its role allows; None when no role takes it (a typo)."""
    key, where = loc[-1], loc[3:-1]
    if where == ("params",):
        allowed = list(role_params(role).model_fields)
        owners = [r for r in ROLE_ENTRIES if key in role_params(r).model_fields]
        what = "params"
    elif where == ():
        allowed = list(ROLE_ENTRIES[role].model_fields)
        owners = [r for r, cls in ROLE_ENTRIES.items() if key in cls.model_fields]
        what = "keys"
    else:
        return None
    if not owners:
        return None
    try:
        name = repr(data["models"][loc[1]]["name"])
    except (KeyError, IndexError, TypeError):
        name = f"models[{loc[1]}]"
    return (f"model {name} has role {role}, which takes no {key!r} (a key of {' and '.join(owners)} entries); "
            f"{role} {what}: {', '.join(allowed)}")


def format_validation_error(source: str, exc: ValidationError, data: Any = None) -> str:
    """One line per problem: file, key, what was wrong and what is allowed. ``data``, the
    validated input, lets a key of the wrong role name its entry."""
    lines = [f"{source}: invalid configuration"]
    for err in exc.errors():
        full = tuple(p for p in err["loc"] if not str(p).startswith("function-"))
        loc, role = _entry_loc(full)
        where, msg = _loc(loc), err["msg"]
        if err["type"] == "extra_forbidden":
            wrong = _wrong_role(full, role, data) if role else None
            msg = wrong or "unknown key (check the spelling; see the models.yaml reference in README.md)"
        elif err["type"] == "literal_error":
            msg = f"got {err.get('input')!r}; allowed: {err['ctx']['expected']}"
        elif err["type"] == "union_tag_invalid":  # the role, which picks the entry's type
            where = f"{where}.role"
            msg = f"got {err['ctx']['tag']!r}; allowed: {err['ctx']['expected_tags']}"
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
        raise ConfigError(format_validation_error(str(path), exc, raw)) from exc


# Command-line flag -> the served chat model's params field (ChatParams).
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
    "draft_model": "speculative.draft",
    "speculative_tokens": "speculative.tokens",
}
# Command-line flags that override the file's ServerSettings field of the same name.
SERVER_FLAGS = ("host", "port", "api_key")


def _flag_kwargs(info: FieldInfo, key: str) -> dict[str, Any]:
    """argparse keywords for one field: type and choices from its annotation, help from its
    description and default. The flag itself defaults to None: not given, the file decides."""
    kinds = [a for a in get_args(info.annotation) if a is not type(None)] or [info.annotation]
    kind = kinds[0] if get_origin(info.annotation) in (Union, UnionType) else info.annotation
    default = "" if info.default is None else f"; default {info.default}"
    kwargs: dict[str, Any] = {"help": f"{info.description} (models.yaml {key}{default})".replace("%", "%%")}
    if get_origin(kind) is Literal:
        kwargs["choices"] = list(get_args(kind))
        kwargs["type"] = type(kwargs["choices"][0])
    else:
        kwargs["type"] = str if kind is SecretStr else kind
    return kwargs


def flag_arguments() -> list[tuple[str, dict[str, Any]]]:
    """The override flags as (name, argparse keywords), generated from the schema's fields
    (as vLLM's ``get_kwargs`` builds its CLI from ``ModelConfig``): server flags first."""
    server = [(f, _flag_kwargs(ServerSettings.model_fields[f], f"server.{f}")) for f in SERVER_FLAGS]
    params = [(f, _flag_kwargs(param_field(k), f"params.{k}")) for f, k in PARAM_FLAGS.items()]
    return server + params


def param_field(key: str) -> FieldInfo:
    """The ChatParams field a dotted key names (``speculative.draft``: a nested model's field)."""
    model: Any = ChatParams
    *outer, last = key.split(".")
    for part in outer:
        model = model.model_fields[part].annotation
    return model.model_fields[last]


def _nested(updates: dict[str, Any]) -> dict[str, Any]:
    """Dotted keys as nested mappings: {"speculative.draft": "x"} -> {"speculative": {"draft": "x"}}."""
    out: dict[str, Any] = {}
    for key, value in updates.items():
        *outer, last = key.split(".")
        here = out
        for part in outer:
            here = here.setdefault(part, {})
        here[last] = value
    return out


@dataclass(frozen=True)
class ResolvedConfig:
    """What this process serves: the chat model, its vision helper, the server settings."""

    source: str
    primary: ChatEntry
    vision: ModelEntry | None
    server: ServerSettings
    models_file: ModelsFile


def _override(model: Any, updates: dict[str, Any], source: str, where: str) -> Any:
    if not updates:
        return model
    data = model.model_dump(exclude_unset=True)
    for key, value in updates.items():  # a nested model's keys are merged into what the file set
        data[key] = {**data.get(key, {}), **value} if isinstance(value, dict) else value
    try:
        return type(model).model_validate(data)
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
    if not isinstance(entry, ChatEntry):
        chat = [m.name for m in models_file.models if m.role == "chat"]
        raise ConfigError(f"{source}: no chat model {name!r}; chat models: {', '.join(chat)}")

    param_updates = _nested({PARAM_FLAGS[k]: v for k, v in overrides.items() if k in PARAM_FLAGS})
    params = _override(entry.params, param_updates, source, "command-line flags")
    primary = entry.model_copy(update={"params": params})
    if problem := models_file.draft_problem(primary):
        raise ConfigError(f"{source} (command-line flags): params.speculative.draft: {problem}")

    server_updates = {k: overrides[k] for k in SERVER_FLAGS if k in overrides}
    server = _override(models_file.server, server_updates, source, "command-line flags")

    vision = None
    proxy = primary.capabilities.vision_proxy
    if primary.capabilities.vision_mode == "proxy" and proxy is not None:
        vision = models_file.find(proxy.model)
    return ResolvedConfig(source, primary, vision, server, models_file)

