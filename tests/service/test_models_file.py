"""`tandem pull --add` edits models.yaml's text: the user's comments, order and quoting stay; the
entry lands at the end of the `models:` list wherever that list is; a bad result is never written."""

from __future__ import annotations

import pytest
import yaml

from app.errors import CommandError
from app.service.models_file import append_entry

ENTRY = {"name": "added", "hf_id": "owner/added-4bit"}

CASES = {
    "list last, comments around": """\
# my models
models:
  # the demo
  - name: a          # inline comment
    builtin: smollm2-135m-instruct
# trailing comment
""",
    "list first, then other keys": """\
models:
- name: a
  builtin: smollm2-135m-instruct
  params: {mem: 64}

server:
  port: 8123   # keep me
""",
    "wide indents, nested keys": """\
models:
    -   name: a
        builtin: smollm2-135m-instruct
        capabilities:
          vision_mode: disabled
default_model: a
server:
  cors_origins:
    - http://x
""",
    "a block scalar ends the last item": """\
models:
  - name: a
    builtin: smollm2-135m-instruct
    capabilities:
      vision_proxy:
        model: a
        prompt_template: |
          Describe the image.

          {user_text}

server: {port: 8001}
""",
    "no newline at the end": "models:\n  - name: a\n    builtin: smollm2-135m-instruct",
}


@pytest.mark.parametrize("text", CASES.values(), ids=CASES.keys())
def test_the_entry_is_appended_and_every_other_line_kept(tmp_path, text):
    path = tmp_path / "models.yaml"
    path.write_text(text)
    inserted = append_entry(path, ENTRY)
    after = path.read_text()
    # Removing the inserted lines gives back the file as it was (up to a final newline).
    assert after.replace(inserted, "", 1).rstrip("\n") == text.rstrip("\n")
    data = yaml.safe_load(after)
    assert data["models"][-1] == ENTRY and data["models"][0]["name"] == "a"
    assert {k: v for k, v in data.items() if k != "models"} == {
        k: v for k, v in yaml.safe_load(text).items() if k != "models"}


def test_values_that_need_quotes_are_quoted(tmp_path):
    path = tmp_path / "models.yaml"
    path.write_text("models:\n  - name: a\n    builtin: smollm2-135m-instruct\n")
    append_entry(path, {"name": "yes", "local_path": "/models/my model: #1"})
    assert yaml.safe_load(path.read_text())["models"][-1] == {"name": "yes", "local_path": "/models/my model: #1"}


@pytest.mark.parametrize("text, why", [
    ("models: [{name: a, builtin: smollm2-135m-instruct}]\n", "not a block list"),
    ("models:\n  - name: added\n    builtin: smollm2-135m-instruct\n", "duplicate model names"),
])
def test_an_edit_that_cannot_be_made_safely_leaves_the_file_alone(tmp_path, text, why):
    path = tmp_path / "models.yaml"
    path.write_text(text)
    with pytest.raises(CommandError, match=why) as err:
        append_entry(path, ENTRY)
    assert err.value.exit_code == 2
    assert path.read_text() == text and [p.name for p in tmp_path.iterdir()] == ["models.yaml"]
