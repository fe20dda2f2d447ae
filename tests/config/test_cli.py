"""The command line: a bad models.yaml stops start-up with a clear message and exit code 2."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "app", *args], cwd=REPO, capture_output=True, text=True, timeout=120)


def test_typo_in_models_yaml_stops_startup(tmp_path):
    bad = tmp_path / "models.yaml"
    bad.write_text("models:\n  - name: a\n    builtin: smollm2-135m-instruct\n    params: {max_num_seq: 4}\n")
    r = run("serve", "--models-file", str(bad))
    assert r.returncode == 2
    assert str(bad) in r.stderr and "models[0].params.max_num_seq" in r.stderr and "unknown key" in r.stderr


def test_bad_flag_value_names_the_flag(tmp_path):
    ok = tmp_path / "models.yaml"
    ok.write_text("models:\n  - name: a\n    builtin: smollm2-135m-instruct\n")
    r = run("serve", "--models-file", str(ok), "--max-num-seqs", "0")
    assert r.returncode == 2 and "command-line flags" in r.stderr and "max_num_seqs" in r.stderr


def test_models_list(tmp_path):
    r = run("models", "list")
    assert r.returncode == 0 and "smollm2-135m-instruct\tchat\tsmollm2-135m-instruct" in r.stdout


def test_a_key_of_another_role_stops_startup(tmp_path):
    """The acceptance test, end to end: an embedding entry with `temperature` fails at start-up."""
    bad = tmp_path / "models.yaml"
    bad.write_text("models:\n  - name: a\n    builtin: smollm2-135m-instruct\n"
                   "  - name: minilm\n    role: embedding\n    builtin: all-minilm-l6-v2\n"
                   "    params: {temperature: 0.5}\n")
    r = run("serve", "--models-file", str(bad))
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert str(bad) in r.stderr and "models[1].params.temperature" in r.stderr
    assert "model 'minilm' has role embedding, which takes no 'temperature'" in r.stderr
