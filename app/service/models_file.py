"""Adding an entry to models.yaml as a person would: by editing its text.

Comments, blank lines, key order and quoting are the user's and stay as they are: the new entry
is inserted as lines after the last item of the ``models:`` list, indented like the first one.
The result is validated as a whole before it replaces the file (atomically), so a bad edit never
reaches the disk.
"""

from __future__ import annotations

import datetime
import json
import re
from pathlib import Path

import yaml

from app.errors import CommandError, ConfigError

_PLAIN = re.compile(r"[A-Za-z0-9_/~][A-Za-z0-9_./~+@-]*")


def _scalar(value: str) -> str:
    """A YAML scalar for ``value``: plain when YAML reads it back as the same string, else a JSON
    string (which YAML reads as a double-quoted scalar)."""
    if _PLAIN.fullmatch(value) and yaml.safe_load(value) == value:
        return value
    return json.dumps(value)


def _last_line(node: yaml.Node) -> int:
    """The last line (0-based) holding a scalar of ``node``: where its text ends."""
    if isinstance(node, yaml.ScalarNode):
        end = node.end_mark
        # A block scalar (`|`, `>`) ends at the start of the line after its text.
        return end.line - 1 if end.column == 0 and end.line > node.start_mark.line else end.line
    if isinstance(node, yaml.SequenceNode):
        return max(_last_line(n) for n in node.value)
    if isinstance(node, yaml.MappingNode):
        return max(max(_last_line(k), _last_line(v)) for k, v in node.value)
    return node.end_mark.line


def append_entry(path: Path, fields: dict[str, str], *, comment: str | None = None) -> str:
    """Append ``- name: ...`` with ``fields`` (in order) to the models list of ``path``; returns the
    text inserted. Raises ``CommandError`` when the file cannot be edited safely."""
    from app.config.loader import load_models_file

    text = path.read_text(encoding="utf-8")
    try:
        root = yaml.compose(text)
    except yaml.YAMLError as exc:
        raise CommandError(f"{path}: not valid YAML, left as it is: {exc}", exit_code=2) from exc
    models = next((v for k, v in getattr(root, "value", []) if getattr(k, "value", None) == "models"), None)
    if not isinstance(models, yaml.SequenceNode) or not models.value or models.flow_style:
        raise CommandError(f"{path}: `models:` is not a block list (`- name: ...` items); add the entry by hand",
                           exit_code=2)
    dash = " " * models.start_mark.column
    keys = " " * models.value[0].start_mark.column
    date = datetime.date.today().isoformat()
    lines = [f"{dash}# {comment or 'added by `tandem pull`'} ({date})"]
    first = dash + "-" + " " * max(len(keys) - len(dash) - 1, 1)  # `- ` or `-   `, as the file has it
    for i, (key, value) in enumerate(fields.items()):
        lines.append(f"{first if i == 0 else keys}{key}: {_scalar(value)}")
    inserted = "\n".join(lines) + "\n"

    source = text.splitlines(keepends=True)
    at = _last_line(models) + 1
    if at == len(source) and source and not source[-1].endswith("\n"):
        source[-1] += "\n"
    new_text = "".join(source[:at]) + inserted + "".join(source[at:])

    tmp = path.with_name(f".{path.name}.tandem-pull.tmp")
    tmp.write_text(new_text, encoding="utf-8")
    try:
        load_models_file(tmp)  # the whole file, as `tandem serve` will read it
    except ConfigError as exc:
        tmp.unlink()
        raise CommandError(f"the new entry would make {path} invalid, so it was not changed:\n{exc.message}",
                           exit_code=2) from exc
    tmp.chmod(path.stat().st_mode & 0o7777)
    tmp.replace(path)
    return inserted
