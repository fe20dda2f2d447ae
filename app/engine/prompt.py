"""One prompt type, whether it holds only tokens or tokens and images.

    Prompt = TokenPrompt | MultimodalPrompt

Every request reaches an engine as a ``Prompt`` made by its model's
``PromptBuilder`` (chosen with the model's profile): the builder renders the
chat template (``render``) and turns the text, and the images in the order
their placeholders appear, into exact token ids (``build``). A native VLM's
processor expands each image placeholder to the image's real run of tokens,
so ``len(prompt.tokens)`` is what the KV cache holds for either kind, and the
completion budget, admission and logs count the same thing for both (as
llama.cpp's ``server_tokens`` keeps text tokens and media chunks in one type).

A ``MultimodalPrompt`` carries, for each image, its span in the tokens, the
decoded image the processor took, and a content hash of its pixels (sha256
of the array's bytes and shape), so the prefix cache keys a prompt by its tokens
with each image run standing for its hash (``cache_key_tokens``). The processor's model
inputs (``pixel_values``, ``image_grid_thw``, ...) are kept as it made them,
for the engine's vision tower: they are MLX arrays, made and used on the
MLX-owner thread only.

``TextPrompts`` is the builder of a text model (its tokenizer's chat template);
``app.engine.models.vlm.VlmPrompts`` is a native VLM's. Both are plain CPU work but
for a VLM's processor, which mlx-vlm runs on MLX arrays: ``VlmPrompts.build``
hands that one job to the MLX thread.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

from app.engine.chat_templates import render_template
from app.errors import ContextLengthError, InvalidRequestError

if TYPE_CHECKING:
    import mlx.core as mx
    from PIL.Image import Image


@dataclass(frozen=True)
class TokenPrompt:
    """A prompt of text tokens only."""

    tokens: list[int]

    @property
    def images(self) -> tuple[PromptImage, ...]:
        return ()


@dataclass(frozen=True)
class PromptImage:
    """One image of a ``MultimodalPrompt``: where its tokens are, what it was, its hash."""

    # Its span in ``MultimodalPrompt.tokens``, tokens[start:start + length]: from its first
    # placeholder token to its last. A processor may break an image's placeholders into
    # several runs (Pixtral's rows end in [IMG_BREAK], Idefics3's and LFM2-VL's tiles are
    # each wrapped in their own markers): the span holds those separators too.
    start: int
    length: int
    # sha256 of the decoded, resized pixels (``pixel_digest``): the image's identity in caches.
    digest: str
    # The decoded image (PIL, within the model's max_pixels) the processor took.
    image: Image = field(repr=False, compare=False)
    # Its placeholder tokens, one per row of vision features (0: the whole span, one run).
    placeholders: int = 0

    def __post_init__(self) -> None:
        if not self.placeholders:
            object.__setattr__(self, "placeholders", self.length)


@dataclass(frozen=True)
class MultimodalPrompt:
    """Text tokens with images: every placeholder run expanded to its real length."""

    tokens: list[int]
    images: tuple[PromptImage, ...]
    # The processor's model inputs besides the token ids (pixel_values, attention_mask,
    # image_grid_thw, ...): MLX arrays, read on the MLX thread only.
    inputs: Mapping[str, mx.array] = field(repr=False, compare=False, default_factory=dict)


Prompt = TokenPrompt | MultimodalPrompt


class PromptBuilder(Protocol):
    """Renders a model's requests: its chat template, then exact tokens."""

    # Whether messages may carry image parts (``{"type": "image"}``) to ``render``.
    takes_images: bool

    def render(self, messages: list[dict[str, Any]], *, tools: list[dict[str, Any]] | None = None,
               switches: Mapping[str, Any] | None = None, generation_prompt: bool = True) -> str:
        """The chat template applied, with ``switches`` as template variables (``enable_thinking``,
        ``reasoning_effort``, ...). ``InvalidRequestError`` when the template rejects the messages."""
        ...

    def build(self, text: str, images: Sequence[Image] = ()) -> Prompt:
        """``text`` (a rendered prompt) and its images, in placeholder order, as a ``Prompt``."""
        ...


class TextPrompts:
    """A text model's builder: the tokenizer's chat template and tokens."""

    takes_images = False

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer

    def render(self, messages: list[dict[str, Any]], *, tools: list[dict[str, Any]] | None = None,
               switches: Mapping[str, Any] | None = None, generation_prompt: bool = True) -> str:
        kwargs: dict[str, Any] = {**(switches or {}), "add_generation_prompt": generation_prompt, "tokenize": False}
        if tools is not None:
            kwargs["tools"] = tools
        try:
            return str(self.tokenizer.apply_chat_template(messages, **kwargs))
        except Exception as exc:  # noqa: BLE001 - jinja errors are the request's shape
            try:  # what transformers' renderer refuses and llama.cpp's takes (Kimi K2's list appends)
                return self._render_permissive(messages, kwargs)
            except Exception:  # noqa: BLE001 - the first error says it best
                pass
            raise InvalidRequestError(f"the model's chat template rejected these messages: {exc}",
                                      param="messages") from exc

    def _render_permissive(self, messages: list[dict[str, Any]], kwargs: dict[str, Any]) -> str:
        template = getattr(self.tokenizer, "chat_template", None)
        if not isinstance(template, str):
            raise TypeError("no single chat template")
        variables = {k: v for k, v in kwargs.items() if k != "tokenize"}
        special = getattr(self.tokenizer, "special_tokens_map", None) or {}
        variables = {**{k: v for k, v in special.items() if isinstance(v, str)}, **variables}
        return render_template(template, messages, **variables)

    def build(self, text: str, images: Sequence[Image] = ()) -> Prompt:
        if images:
            raise InvalidRequestError("this model does not take images", param="messages")
        # The rendered prompt already holds its special tokens.
        return TokenPrompt(list(self.tokenizer.encode(text, add_special_tokens=False)))


def completion_room(prompt_len: int, max_model_len: int, kv_budget_tokens: int | None,
                    prompt_param: str = "messages") -> int:
    """The most tokens a completion may have after a prompt of ``prompt_len`` exact tokens:
    what the context and the KV budget leave. ``ContextLengthError`` when nothing is left.
    The one completion-budget rule: the pipeline's ``completion_budget`` and the captioner
    clamp what they ask for to it."""
    if prompt_len >= max_model_len:
        raise ContextLengthError(
            f"this model's maximum context length is {max_model_len} tokens, but the prompt has {prompt_len} tokens",
            param=prompt_param,
        )
    budget = kv_budget_tokens or max_model_len
    room = min(max_model_len, budget) - prompt_len
    if room <= 0:
        raise ContextLengthError(
            f"a prompt of {prompt_len} tokens does not fit this model's KV budget of {budget} tokens "
            "(raise `mem` in models.yaml)", param=prompt_param,
        )
    return room


def pixel_digest(image: Image) -> str:
    """sha256 of an image's pixels as decoded and resized (array bytes and shape)."""
    array = np.ascontiguousarray(np.asarray(image))
    h = hashlib.sha256(repr((array.shape, str(array.dtype))).encode())
    h.update(array.tobytes())
    return h.hexdigest()


def cache_key_tokens(prompt: Prompt) -> list[int]:
    """The prompt's tokens as a prefix cache keys them: each image's run of placeholder
    tokens replaced by ids drawn from its pixel digest, so two prompts share a cached
    prefix across an image only when the pixels are the same, whatever the URL or the
    encoding. The ids are negative (real token ids never are) and fit in int32, as the
    disk tier stores tokens; each position of a run has its own 31 bits, so a run of
    n tokens matches another image's by chance with odds 2**-31n."""
    tokens = list(prompt.tokens)
    for image in prompt.images:
        seed = bytes.fromhex(image.digest)
        for i in range(image.length):
            h = hashlib.blake2b(seed + i.to_bytes(4, "little"), digest_size=4).digest()
            tokens[image.start + i] = -1 - (int.from_bytes(h, "little") & 0x7FFFFFFF)
    return tokens


def placeholder_spans(tokens: Sequence[int], token_id: int, counts: Sequence[int]) -> list[tuple[int, int]]:
    """Each image's span (start, length) in ``tokens``: the first ``counts[0]`` placeholders
    (``token_id``) are the first image's, the next ``counts[1]`` the second's, and so on,
    in order; a span runs from an image's first placeholder to its last, whatever separators
    its runs have between them. ``ValueError`` when the counts do not add up to the tokens'."""
    at = [i for i, t in enumerate(tokens) if t == token_id]
    if sum(counts) != len(at) or any(c <= 0 for c in counts):
        raise ValueError(f"{len(at)} placeholder token(s) for images of {', '.join(map(str, counts))}")
    spans, first = [], 0
    for count in counts:
        start, last = at[first], at[first + count - 1]
        spans.append((start, last - start + 1))
        first += count
    return spans


def placeholder_runs(tokens: Sequence[int], token_id: int) -> list[tuple[int, int]]:
    """Each maximal run of ``token_id`` in ``tokens``, as (start, length)."""
    runs: list[tuple[int, int]] = []
    start = None
    for i, t in enumerate([*tokens, None]):
        if t == token_id and start is None:
            start = i
        elif t != token_id and start is not None:
            runs.append((start, i - start))
            start = None
    return runs
