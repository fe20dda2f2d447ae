"""The llama.cpp corpus and a tokenizer to serve its templates with, once per session."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.families import llama_cpp


@pytest.fixture(scope="session")
def corpus_root() -> Path:
    """llama.cpp's templates and test-chat.cpp, fetched and checked (``llama_cpp.fetch``)."""
    try:
        return llama_cpp.fetch()
    except RuntimeError as exc:  # no PyPI: nothing to compare with
        pytest.skip(f"llama.cpp's templates cannot be fetched: {exc}")


@pytest.fixture(scope="session")
def corpus_tokenizer(demo_model_dir: Path) -> Any:
    """The demo tokenizer, which ``corpus.profile_for`` gives each template in turn."""
    from mlx_lm.utils import load_tokenizer

    return load_tokenizer(demo_model_dir)
