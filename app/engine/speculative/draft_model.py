"""A draft model: another chat entry of models.yaml runs ahead of its target, k tokens a step.

    registry    loads the draft entry first (a lease held while the target is loaded: it is
                never unloaded under it), then the target, whose loader builds a
                ``DraftModelSource`` from the draft's loaded model and the target's tokenizer
    load        the tokenizers are compared: the same token -> id for the whole vocabulary,
                the same special tokens and EOS ids, or the target does not load (a draft's
                token ids mean nothing to a target with another vocabulary)
    each row    ``open`` gives a ``DraftModelDrafter`` with a KV cache of its own (mlx-lm's
                ``make_prompt_cache`` on the draft model); ``propose`` feeds the row's tokens
                the draft has not seen (a long prompt a chunk per call, proposing nothing until
                it is in), then decodes k tokens greedily; ``verified`` trims the draft's KV back
                to the accepted length; ``close`` drops the KV

Proposals are greedy (``Proposal.logprobs`` None): the verify step accepts a drafted token
with the target's probability of it (its argmax at temperature 0), which is exact for any
sampling; a sampled draft would only pay where its temperature matches the row's, which the
``DraftSource`` seam does not carry.

Memory: the draft's weights count as its own entry's (its slot in the registry); its KV for
the target's rows is at most the target's admitted tokens times the draft's bytes per token,
so the registry counts ``kv_allowance_bytes`` (the target's KV budget in tokens times the
draft's bytes per token) with the target, beside the target's own KV budget.

Everything here runs on the MLX thread, inside the target's batch step.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import mlx.core as mx

from app.engine.mlx_internals import KVCache, QuantizedKVCache, make_prompt_cache, trim_prompt_cache
from app.engine.models.loader import LoadedModel, model_geometry
from app.engine.speculative import Proposal
from app.errors import ConfigError

log = logging.getLogger("tandem.engine")

# Prompt tokens a drafter feeds its model in one ``propose`` call while it catches up with a
# long prompt (proposing nothing meanwhile), so one batch step never waits for a whole prefill.
PREFILL_CHUNK = 256


def tokenizer_mismatch(target: Any, draft: Any) -> str | None:
    """Why ``draft``'s token ids would mean something else to ``target`` (mlx-lm
    ``TokenizerWrapper``s or Hugging Face tokenizers), or None when they agree: the same
    token -> id for the whole vocabulary, the same special tokens, the same EOS ids."""
    t_vocab, d_vocab = target.get_vocab(), draft.get_vocab()
    if t_vocab != d_vocab:
        differ = sorted(set(t_vocab.items()) ^ set(d_vocab.items()), key=lambda item: item[1])
        shown = ", ".join(f"{tok!r}->{i}" for tok, i in differ[:3])
        return (f"the vocabularies differ ({len(t_vocab)} and {len(d_vocab)} tokens; {len(differ)} token->id "
                f"pairs are in one only, e.g. {shown})")
    t_special = dict(zip(target.all_special_tokens, target.all_special_ids, strict=False))
    d_special = dict(zip(draft.all_special_tokens, draft.all_special_ids, strict=False))
    if t_special != d_special:
        return f"the special tokens differ ({t_special} and {d_special})"
    t_eos, d_eos = set(getattr(target, "eos_token_ids", ()) or ()), set(getattr(draft, "eos_token_ids", ()) or ())
    if t_eos != d_eos:
        return f"the EOS token ids differ ({sorted(t_eos)} and {sorted(d_eos)})"
    return None


class DraftModelSource:
    """A draft model shared by every row of the target it drafts for (``DraftSource``)."""

    name = "draft"

    def __init__(self, draft: LoadedModel, target: LoadedModel) -> None:
        problem = tokenizer_mismatch(target.tokenizer, draft.tokenizer)
        if problem:
            raise ConfigError(f"model {target.name!r}: draft model {draft.name!r} cannot draft for it: {problem}; "
                              "a draft model needs the target's tokenizer")
        caches = make_prompt_cache(draft.model)
        if not all(isinstance(c, KVCache | QuantizedKVCache) for c in caches):
            kinds = sorted({type(c).__name__ for c in caches})
            raise ConfigError(f"model {target.name!r}: draft model {draft.name!r} keeps a {', '.join(kinds)}, which "
                              "cannot be rolled back to the accepted tokens; a draft model needs plain KV layers")
        self.model = draft.model
        self.draft_name = draft.name
        self.target_name = target.name
        # Its own KV, unquantized whatever its entry's kv_cache_bits (a row's draft cache is mlx-lm's plain one).
        self.kv_bytes_per_token = model_geometry(draft.model, None).bytes_per_token
        self.kv_allowance_bytes = 0  # set by ``budget``
        # Token ids the target knows: a draft's embedding may be padded past the tokenizer.
        self.vocab_size = len(target.tokenizer.get_vocab())

    def budget(self, target_budget_tokens: int) -> int:
        """The bytes the draft's KV may take for the target's rows: at most every token the
        target admits, at the draft's bytes per token."""
        self.kv_allowance_bytes = target_budget_tokens * self.kv_bytes_per_token
        return self.kv_allowance_bytes

    def open(self, prompt_tokens: Sequence[int], k: int) -> DraftModelDrafter:
        return DraftModelDrafter(self, k)


class DraftModelDrafter:
    """One row's draft: its own KV on the draft model, and the tokens in it (``Drafter``)."""

    name = "draft"

    def __init__(self, source: DraftModelSource, k: int) -> None:
        self._source = source
        self._k = k
        self._cache: list[Any] | None = make_prompt_cache(source.model)
        # The tokens whose KV is in the cache, in order.
        self._fed: list[int] = []
        # The row's length when the last proposal was made (what ``verified`` trims back to, plus the accepted).
        self._base = 0

    @property
    def cached_tokens(self) -> int:
        """Tokens in this row's draft KV."""
        return len(self._fed)

    def propose(self, tokens: Sequence[int], k: int) -> Proposal | None:
        if self._cache is None or not tokens:
            return None
        k = min(k, self._k)
        # Keep the KV of the longest prefix the row still has; at least its last token is fed again,
        # for the logits that give the first drafted token.
        common = 0
        limit = min(len(self._fed), len(tokens) - 1)
        while common < limit and self._fed[common] == tokens[common]:
            common += 1
        self._trim_to(common)
        pending = [int(t) for t in tokens[common:]]
        if len(pending) > PREFILL_CHUNK:  # catching up with a long prompt: one chunk per step
            self._feed(pending[:PREFILL_CHUNK])
            return None
        if k <= 0:
            return None
        self._base = len(tokens)
        logits = self._feed(pending)
        drafted: list[int] = []
        for i in range(k):
            best: Any = mx.argmax(logits).item()
            token = int(best)
            if token >= self._source.vocab_size:  # a padded id no tokenizer knows: stop here
                break
            drafted.append(token)
            if i + 1 < k:
                logits = self._feed([token])
        return Proposal(self.name, tuple(drafted)) if drafted else None

    def verified(self, proposal: Proposal, accepted: int) -> None:
        # The accepted drafted tokens' KV stays; the rest (and the rejected) goes.
        self._trim_to(min(len(self._fed), self._base + max(0, accepted)))

    def close(self) -> None:
        self._cache = None
        self._fed = []

    def _feed(self, tokens: list[int]) -> Any:
        """Run the draft model over ``tokens`` into this row's KV; the last position's logits."""
        assert self._cache is not None
        logits = self._source.model(mx.array([tokens]), cache=self._cache)[0, -1]
        mx.eval(logits)
        self._fed.extend(tokens)
        return logits

    def _trim_to(self, n: int) -> None:
        if self._cache is not None and len(self._fed) > n:
            trim_prompt_cache(self._cache, len(self._fed) - n)
            del self._fed[n:]
