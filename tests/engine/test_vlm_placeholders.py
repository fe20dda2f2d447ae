"""An image's placeholder tokens, however the processor lays them out: one run (Qwen2-VL),
rows with breaks (Pixtral: ``[IMG]`` x w, ``[IMG_BREAK]``, ..., ``[IMG_END]``), tiles each
in its own markers (Idefics3, SmolVLM, LFM2-VL). Each image's span runs from its first
placeholder to its last; the prefix cache keys the whole span by the image's pixels."""

from __future__ import annotations

import pytest

from app.engine.prompt import MultimodalPrompt, PromptImage, cache_key_tokens, placeholder_spans

IMG, BREAK, END = 10, 11, 12


def pixtral(rows: int, width: int) -> list[int]:
    """Pixtral's layout of one image: rows of placeholders, each ended by a break, the last by the end."""
    out: list[int] = []
    for r in range(rows):
        out += [IMG] * width + [END if r == rows - 1 else BREAK]
    return out


def test_each_image_takes_its_count_of_placeholders_in_order():
    tokens = [1, 2, *pixtral(2, 3), 3, *pixtral(3, 2), 4]
    first, second = placeholder_spans(tokens, IMG, [6, 6])
    assert first == (2, 7) and tokens[2:9] == [IMG, IMG, IMG, BREAK, IMG, IMG, IMG]
    assert second == (11, 8) and tokens[11] == tokens[18] == IMG and tokens[19] == END


def test_counts_that_do_not_add_up_are_refused():
    tokens = [1, *pixtral(2, 3), 2]
    with pytest.raises(ValueError, match="6 placeholder token\\(s\\) for images of 4, 4"):
        placeholder_spans(tokens, IMG, [4, 4])
    with pytest.raises(ValueError):
        placeholder_spans(tokens, IMG, [6, 0])


def test_a_multi_run_image_is_keyed_by_its_pixels_across_its_whole_span():
    tokens = [1, 2, *pixtral(2, 3), 3, 4]
    span = placeholder_spans(tokens, IMG, [6])[0]

    def key(digest: str) -> list[int]:
        image = PromptImage(*span, digest=digest, image=None, placeholders=6)  # type: ignore[arg-type]
        return cache_key_tokens(MultimodalPrompt(tokens, (image,)))

    a, b = key("a" * 64), key("b" * 64)
    start, length = span
    assert a[:start] == tokens[:start] and a[start + length:] == tokens[start + length:]
    assert all(t < 0 for t in a[start:start + length]), "the breaks between its rows stand for the pixels too"
    assert all(x != y for x, y in zip(a[start:start + length], b[start:start + length], strict=True))
    assert key("a" * 64) == a


def test_an_image_of_one_run_counts_its_span():
    assert PromptImage(3, 5, "c" * 64, None).placeholders == 5  # type: ignore[arg-type]
