"""The role table (``app/engine/roles.py``) and the typed handles it promises.

A role is one row on each side: ``ROLE_ENTRIES`` (config: its entry and params
model) and ``ROLES`` (engine: its handle, loader, memory rule, what it serves);
a test registers a new role with nothing else.
The source checks keep model handles, leases and prompts typed: no ``Any`` in
their annotations anywhere in ``app/``, and no ``hasattr`` asking a handle what
it is.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest
from pydantic import ValidationError

from app.config.schema import ROLE_ENTRIES, ChatParams, role_entry, role_params
from app.engine.batch.batching import BatchingEngine
from app.engine.batch.encoder_engine import EncoderEngine
from app.engine.params import ModelSource, ModelSpec
from app.engine.roles import ENCODER_ACTIVATION_FACTOR, ROLES, RoleSpec
from app.engine.worker import MLXWorker
from app.specs import model_spec

APP = Path(__file__).resolve().parents[2] / "app"
# Names whose annotation must say what the thing is.
TYPED_NAMES = re.compile(r"(^|_)(handle|lease|engine|prompt)s?$")


def test_every_config_role_has_a_row_and_back() -> None:
    assert set(ROLES) == set(ROLE_ENTRIES)
    for name in ROLES:
        assert role_params(name) is not None


def test_rows_say_what_they_serve() -> None:
    assert ROLES["chat"].serves == {"chat", "captions"}
    assert ROLES["vision"].serves == {"captions"} and not ROLES["vision"].public
    assert ROLES["embedding"].serves == {"embedding", "rerank"}
    assert ROLES["rerank"].serves == {"rerank"}
    for row in ROLES.values():
        assert row.handle in (BatchingEngine, EncoderEngine)
        assert row.what.startswith(("a ", "an "))


def test_memory_rule_comes_from_the_row() -> None:
    spec = ModelSpec(name="m", role="embedding", source=ModelSource(name="m", builtin="x"), aliases=(),
                     preload=False, pin=False, idle_unload_s=None, max_queue=1, queue_timeout_s=1.0)
    assert ROLES["embedding"].budget_bytes(100, spec) == int(100 * (1 + ENCODER_ACTIVATION_FACTOR))
    assert ROLES["chat"].budget_bytes(100, spec) == 100 + spec.kv_budget_bytes


def test_a_new_role_is_a_row_on_each_side(monkeypatch):
    """A draft model (it proposes tokens for a chat model) reuses the chat params and loader: one
    ``role_entry`` row in config, one ``RoleSpec`` row in the engine, and it validates, refuses
    another role's keys, maps to a spec and loads as a private slot, with no other edit."""
    from app.engine.registry import Registry

    draft_entry = role_entry("draft", ChatParams, "a small chat model that proposes tokens for a bigger one")
    monkeypatch.setitem(ROLES, "draft", RoleSpec(BatchingEngine, ROLES["chat"].load, frozenset(),
                                                 "a draft model (it proposes tokens for a chat model)"))
    with pytest.raises(ValidationError, match="capabilities"):
        draft_entry.model_validate({"name": "d", "role": "draft", "builtin": "smollm2-135m-instruct",
                                    "capabilities": {"tool_parser": "qwen"}})
    entry = draft_entry.model_validate({"name": "d", "role": "draft", "builtin": "smollm2-135m-instruct",
                                        "params": {"mem": 32, "max_num_seqs": 2}})
    spec = model_spec(entry, None)
    assert spec.role == "draft" and spec.engine is not None and spec.engine.kv_mem_mb == 32
    worker = MLXWorker()
    worker.start()
    try:
        registry = Registry(worker, [spec])
        registry.load_now("d")
        assert isinstance(registry.loaded("d"), BatchingEngine)
        assert registry.public_specs == [] and not registry.serves("d", "chat")
    finally:
        worker.stop()


def _annotations(tree: ast.AST) -> list[tuple[str, ast.expr, int]]:
    found: list[tuple[str, ast.expr, int]] = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            args = node.args
            for arg in [*args.posonlyargs, *args.args, *args.kwonlyargs]:
                if arg.annotation is not None:
                    found.append((arg.arg, arg.annotation, arg.lineno))
            # What hands out a handle or a lease (``acquire_chat``, ``loaded_encoder``).
            if node.returns is not None and node.name.startswith(("acquire", "loaded", "_lease")):
                found.append(("handle", node.returns, node.lineno))
        elif isinstance(node, ast.AnnAssign):
            target = node.target
            name = target.id if isinstance(target, ast.Name) else getattr(target, "attr", "")
            found.append((name, node.annotation, node.lineno))
    return found


def _uses_any(annotation: ast.expr) -> bool:
    text = ast.unparse(annotation)
    return re.search(r"\bAny\b|\bobject\b", text) is not None


def test_no_handle_lease_or_prompt_is_any() -> None:
    offenders = []
    for path in sorted(APP.rglob("*.py")):
        if path.name.endswith("protocol.py"):  # wire schemas: a client's raw JSON ``prompt``, not our Prompt
            continue
        tree = ast.parse(path.read_text(), str(path))
        for name, annotation, line in _annotations(tree):
            if TYPED_NAMES.search(name) and _uses_any(annotation):
                offenders.append(f"{path.relative_to(APP.parent)}:{line}: {name}: {ast.unparse(annotation)}")
    assert not offenders, "\n".join(offenders)


@pytest.mark.parametrize("module", ["engine/registry.py", "pipeline/pipeline.py", "engine/roles.py"])
def test_no_hasattr_on_handles(module: str) -> None:
    tree = ast.parse((APP / module).read_text())
    calls = [n for n in ast.walk(tree) if isinstance(n, ast.Call) and isinstance(n.func, ast.Name)
             and n.func.id == "hasattr"]
    assert not calls, f"{module} asks a handle what it is at line {calls[0].lineno}"


def test_registry_roles_come_from_the_table() -> None:
    """No ``role == "..."`` chains left in the registry: a new role is a row, not an edit there."""
    source = (APP / "engine/registry.py").read_text()
    assert not re.search(r"role\s*(==|in)\s*[(\"']", source)


def test_a_lease_of_the_wrong_handle_is_a_400_and_gives_its_count_back() -> None:
    """A text chat model asked to caption (the one mismatch the table lets through: chat rows
    serve captions, but only a VLM's engine can) is refused, and is not left held."""
    from app.engine.registry import Registry, _Slot
    from app.errors import InvalidRequestError

    spec = ModelSpec(name="m", role="chat", source=ModelSource(name="m", builtin="x"), aliases=(),
                     preload=False, pin=False, idle_unload_s=None, max_queue=1, queue_timeout_s=1.0)
    slot = _Slot(spec, ROLES["chat"], leases=1)
    with pytest.raises(InvalidRequestError) as info:
        Registry._lease(slot, None)
    assert info.value.code == "wrong_model_type" and slot.leases == 0
