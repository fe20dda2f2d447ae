"""Chat templates that transformers' renderer refuses, rendered the way llama.cpp's does.

transformers renders templates in an immutable sandbox whose ``tojson`` takes no
generators, so real templates fail there: Kimi K2's appends to a list to pair tool
results with their calls (``ids.append(...)``), DeepSeek R1's as llama.cpp ships it
writes ``tools | map(attribute='function') | tojson``. llama.cpp's renderer (minja)
takes both. ``render_template`` is the fallback ``TextPrompts`` uses when
transformers refuses: still a sandbox (no attribute of Python's internals, no
import, no I/O), in which lists may grow and ``tojson`` reads any iterable.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from datetime import datetime
from functools import lru_cache
from typing import Any

import jinja2
from jinja2.ext import loopcontrols
from jinja2.sandbox import SandboxedEnvironment


def _plain(value: Any) -> Any:
    """``value`` with every iterable (a ``map`` filter's generator) turned into a list."""
    if isinstance(value, Mapping):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, (str, bytes, int, float, bool)) or value is None:
        return value
    if isinstance(value, Iterable):
        return [_plain(v) for v in value]
    return value


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None,
            sort_keys: bool = False) -> str:
    return json.dumps(_plain(value), ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


def _raise(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


@lru_cache(maxsize=16)
def _compiled(template: str) -> jinja2.Template:
    env = SandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals.update(raise_exception=_raise, strftime_now=lambda fmt: datetime.now().strftime(fmt))
    return env.from_string(template)


def render_template(template: str, messages: list[dict[str, Any]], **variables: Any) -> str:
    """``template`` rendered with ``messages`` and ``variables`` (tools, add_generation_prompt,
    the special tokens, the reasoning switches); jinja's errors propagate. An earlier turn's
    reasoning is there as ``reasoning_content`` and ``thinking`` (gpt-oss reads the latter),
    as transformers passes it."""
    messages = [{"thinking": m["reasoning_content"], **m} if isinstance(m, dict) and m.get("reasoning_content")
                else m for m in messages]
    return _compiled(template).render(messages=messages, **variables)
