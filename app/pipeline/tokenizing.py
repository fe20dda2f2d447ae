"""A prompt's tokens, at a cost bounded by the model's context rather than by the prompt's size.

``check_prompt_chars`` (app/pipeline/pipeline.py) refuses, before any tokenizing, what
cannot fit whatever its tokens. A dense script passes it: 1.3 M CJK characters are
under the 1,327,104-character cut of an 8,192-token model, and took 3.5 M tokens,
seconds (4.9 s in the red-team's run, 13.7 s on a busy 2-core box) and GBs of
tokenizer memory to be refused.

So a prompt with more characters than the context has tokens (one that might not
fit) is first counted a slice at a time, and refused once the count is past the
context: about a context's worth of tokenizing, whatever its length. One that may
fit is then tokenized whole, in one call, so its tokens are exactly what they always
were. Slices end before a space between two words, where pre-tokenizers split anyway
(byte-level BPE: not one token of difference); in text without spaces a cut may
change a token or two, which ``CUT_SLACK`` allows for, so no prompt that fits is
ever refused here.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from app.errors import ContextLengthError

# Characters counted at a time: at most ~4 tokens each (a UTF-8 character's bytes).
SLICE_CHARS = 8192
# Tokens a cut may add to the count (measured: 0 for byte-level BPE, at most 2 for SentencePiece).
CUT_SLACK = 16


def check_within(tokenizer: Any, text: str, context: int, param: str | None = None) -> None:
    """``ContextLengthError`` (on ``param``) when the slices of ``text`` alone are more than
    ``context`` tokens; nothing for a prompt that may fit (its builder then tokenizes it whole)."""
    if len(text) <= context:  # fewer characters than the context are at most ~4x its tokens
        return
    counted = read = 0
    for cuts, piece in enumerate(slices(text, SLICE_CHARS)):
        counted += len(tokenizer.encode(piece, add_special_tokens=False))
        read += len(piece)
        if counted > context + CUT_SLACK * cuts:
            raise ContextLengthError(
                f"this model's maximum context length is {context} tokens, but the prompt has more "
                f"(its first {read} characters alone are {counted} tokens)", param=param)


def encode_within(tokenizer: Any, text: str, context: int, param: str | None = None, *,
                  special_tokens: bool = False) -> list[int]:
    """Token ids of ``text`` (``special_tokens``: with the tokenizer's BOS and the like; a
    rendered chat prompt has its own), refused past ``context`` as ``check_within`` does."""
    check_within(tokenizer, text, context, param)
    return list(tokenizer.encode(text, add_special_tokens=special_tokens))


def slices(text: str, size: int) -> Iterator[str]:
    """``text`` in pieces of at most ``size`` characters, each ending, where the last half of
    its window has one, before a space that stands between two non-spaces."""
    start = 0
    while start < len(text):
        end = min(start + size, len(text))
        if end < len(text):
            floor = start + size // 2
            cut = text.rfind(" ", floor, end)
            while cut > floor and (text[cut - 1].isspace() or text[cut + 1].isspace()):
                cut = text.rfind(" ", floor, cut)
            if cut > floor:
                end = cut
        yield text[start:end]
        start = end

