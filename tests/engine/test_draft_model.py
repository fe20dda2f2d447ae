"""The draft model drafter (``app.engine.speculative.draft_model``) on tiny real llamas: its
tokenizer check, its greedy proposals, its own KV rolled back to what was accepted."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import mlx.core as mx
import pytest

from app.config.schema import ChatParams
from app.engine.mlx_internals import make_prompt_cache
from app.engine.models.loader import LoadedModel, load_text_model
from app.engine.params import ModelSource
from app.engine.speculative import Proposal
from app.engine.speculative.draft_model import PREFILL_CHUNK, DraftModelSource, tokenizer_mismatch
from app.errors import ConfigError
from app.specs import load_params
from tests.fixtures.tiny_llama import TINY_LLAMA, build_tiny_llama


def load(name: str, path: Path) -> LoadedModel:
    return load_text_model(ModelSource(name, local_path=str(path)), load_params(ChatParams()))


@pytest.fixture(scope="module")
def target(tiny_model_dir: Path) -> LoadedModel:
    return load("target", tiny_model_dir)


@pytest.fixture(scope="module")
def small(tmp_path_factory: pytest.TempPathFactory, demo_model_dir: Path) -> LoadedModel:
    """Another tiny llama (one layer, another seed) with the same tokenizer."""
    config = {**TINY_LLAMA, "num_hidden_layers": 1}
    return load("small", build_tiny_llama(tmp_path_factory.mktemp("small-llama"), demo_model_dir, config, seed=7))


def greedy(loaded: LoadedModel, tokens: list[int], n: int) -> list[int]:
    """``n`` tokens decoded greedily after ``tokens``, one plain forward pass each."""
    cache = make_prompt_cache(loaded.model)
    logits = loaded.model(mx.array([tokens]), cache=cache)[0, -1]
    out: list[int] = []
    for _ in range(n):
        out.append(int(mx.argmax(logits).item()))
        logits = loaded.model(mx.array([out[-1:]]), cache=cache)[0, -1]
    return out


PROMPT = [1, 504, 2536, 314, 253, 1345, 28, 2240, 30, 198, 504, 2536]


def test_a_draft_proposes_its_own_greedy_continuation(target, small):
    drafter = DraftModelSource(small, target).open(PROMPT, 4)
    proposal = drafter.propose(PROMPT, 4)
    assert proposal == Proposal("draft", tuple(greedy(small, PROMPT, 4)))
    assert drafter.cached_tokens == len(PROMPT) + 3  # the last drafted token is not fed yet
    drafter.close()


def test_verified_rolls_the_draft_kv_back_and_the_next_proposal_is_exact(target, small):
    """After each verify, the next proposal is what a fresh draft would propose from the row's
    tokens: the rejected tokens' KV is gone, the accepted ones' kept."""
    source = DraftModelSource(small, target)
    drafter = source.open(PROMPT, 4)
    row = list(PROMPT)
    for accepted, own in ((2, 77), (0, 1234), (4, 9)):
        proposal = drafter.propose(row, 4)
        assert proposal is not None
        drafter.verified(proposal, accepted)
        assert drafter.cached_tokens == len(row) + min(accepted, 3)
        row += [*proposal.tokens[:accepted], own]  # the target's own next token follows the accepted run
        assert drafter.propose(row, 3) == Proposal("draft", tuple(greedy(small, row, 3)))
        drafter.verified(Proposal("draft", ()), 0)
    # A row that does not extend what the draft fed (a resumed row, a cut) rolls back to the common prefix.
    cut = row[:len(PROMPT) + 2] + [42]
    assert drafter.propose(cut, 2) == Proposal("draft", tuple(greedy(small, cut, 2)))
    drafter.close()
    assert drafter.propose(cut, 2) is None  # closed: its KV is gone


def test_a_long_prompt_is_fed_a_chunk_per_call(target, small):
    prompt = (PROMPT * 60)[:PREFILL_CHUNK * 2 + 5]
    drafter = DraftModelSource(small, target).open(prompt, 2)
    assert drafter.propose(prompt, 2) is None and drafter.cached_tokens == PREFILL_CHUNK
    assert drafter.propose(prompt, 2) is None and drafter.cached_tokens == 2 * PREFILL_CHUNK
    assert drafter.propose(prompt, 2) == Proposal("draft", tuple(greedy(small, prompt, 2)))


def test_the_draft_kv_is_budgeted_per_target_token(target, small):
    source = DraftModelSource(small, target)
    # One layer, 2 KV heads of 16 dims, K and V, float32 (the tiny llama's weights).
    assert source.kv_bytes_per_token == 1 * 2 * 16 * 2 * 4
    assert source.budget(1000) == 1000 * source.kv_bytes_per_token == source.kv_allowance_bytes


def test_a_draft_with_another_vocabulary_is_refused(tmp_path, target, demo_model_dir):
    """Two token ids swapped: same size, same strings, different meaning."""
    tok_dir = tmp_path / "tok"
    tok_dir.mkdir()
    for name in ("tokenizer_config.json", "special_tokens_map.json"):
        if (demo_model_dir / name).exists():
            shutil.copy(demo_model_dir / name, tok_dir / name)
    data = json.loads((demo_model_dir / "tokenizer.json").read_text())
    vocab = data["model"]["vocab"]
    a, b = (tok for tok, i in vocab.items() if i in (1000, 1001))
    vocab[a], vocab[b] = vocab[b], vocab[a]
    (tok_dir / "tokenizer.json").write_text(json.dumps(data))
    other = load("other", build_tiny_llama(tmp_path / "other", tok_dir, {**TINY_LLAMA, "num_hidden_layers": 1}))
    assert "the vocabularies differ" in (tokenizer_mismatch(target.tokenizer, other.tokenizer) or "")
    with pytest.raises(ConfigError, match="draft model 'other' cannot draft for it: the vocabularies differ"):
        DraftModelSource(other, target)


def test_the_same_tokenizer_passes_the_check(target, small):
    assert tokenizer_mismatch(target.tokenizer, small.tokenizer) is None
