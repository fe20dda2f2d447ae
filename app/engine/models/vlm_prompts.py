"""A native VLM's prompts: its chat template places the images, its processor expands them.

``VlmPrompts`` is the model's prompt builder (``app.engine.prompt.PromptBuilder``):
``render`` runs mlx-vlm's chat template (plain CPU work, fit for a worker thread), which
writes the model's own marker for each image part (``image_marker``, read from the
template at load); ``build`` runs the model's processor once per prompt on the MLX thread
(mlx-vlm's processors make MLX arrays), which expands each marker to the image's
placeholder tokens, and finds each image's span among them (``image_spans``). Nothing
here assumes one run of placeholders per image: Pixtral breaks an image into rows
(``[IMG_BREAK]``), Idefics3, SmolVLM and LFM2-VL into tiles, each wrapped in its own
markers, and Gemma 3's template writes ``<start_of_image>``, which its processor expands
to the image's soft tokens between two markers of its own. How many placeholders an image
has is the processor's to say (seed 002: vLLM counts each item's placeholders so).
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from app.engine.mlx_internals import vlm_prompt_inputs, vlm_text_tokens
from app.engine.prompt import (
    MultimodalPrompt,
    Prompt,
    PromptImage,
    TokenPrompt,
    pixel_digest,
    placeholder_runs,
    placeholder_spans,
)
from app.errors import InvalidRequestError

if TYPE_CHECKING:
    from PIL.Image import Image

    from app.engine.models.vlm import LoadedVlm


def count_images(messages: list[dict[str, Any]]) -> int:
    """Image parts in user messages of the mlx-vlm message format."""
    return sum(
        1
        for m in messages
        if m.get("role") == "user" and isinstance(m.get("content"), list)
        for part in m["content"]
        if isinstance(part, dict) and part.get("type") == "image"
    )


class VlmPrompts:
    """A native VLM's prompt builder (``app.engine.prompt.PromptBuilder``): mlx-vlm's chat
    template places the image placeholders, the model's processor expands them.

    ``render`` is plain CPU work. ``build`` hashes the images where it is called, then
    runs the processor once on the MLX thread (``run``; mlx-vlm's processors make MLX
    arrays), since the real length of each image's run of tokens is the processor's to
    say. ``run`` None: the caller is on the MLX thread already (the load-time profile).
    """

    takes_images = True

    def __init__(self, loaded: LoadedVlm, run: Callable[[Callable[[], Any]], Any] | None = None) -> None:
        self.loaded = loaded
        self._run = run or (lambda fn: fn())

    def render(self, messages: list[dict[str, Any]], *, tools: list[dict[str, Any]] | None = None,
               switches: Mapping[str, Any] | None = None, generation_prompt: bool = True) -> str:
        """The prompt text for ``messages``, through mlx-vlm's chat template for this model.

        ``messages`` are dicts ``{"role": "system" | "user" | "assistant" | "tool", "content": ...}``:
        ``content`` is a string, or (user messages) a list of ``{"type": "image"}`` and
        ``{"type": "text", "text": str}`` parts in the order the client sent them; each image
        part becomes the model's own placeholder at that place, and the request's images
        must follow in that order. ``tool_calls``, ``tool_call_id`` and ``name`` pass
        through to the template. Images in other roles are refused: mlx-vlm's templates drop them.

        ``InvalidRequestError`` when the template rejects the messages, or renders a
        different number of placeholders than there are images.
        """
        loaded = self.loaded
        for m in messages:
            content = m.get("content")
            if m.get("role") != "user" and isinstance(content, list) and any(
                isinstance(p, dict) and p.get("type") == "image" for p in content
            ):
                raise InvalidRequestError(
                    f"this model takes images in user messages only, not in a {m.get('role')} message",
                    param="messages",
                )
        n = count_images(messages)
        kwargs: dict[str, Any] = {**(switches or {}), **({"tools": tools} if tools is not None else {})}
        try:
            text = _apply_template(loaded.processor, loaded.model, messages, n, generation_prompt, kwargs)
        except Exception as exc:  # noqa: BLE001 - jinja and mlx-vlm errors are the request's shape
            raise InvalidRequestError(
                f"the model's chat template rejected these messages: {exc}", param="messages"
            ) from exc
        marker = loaded.marker
        if marker and text.count(marker) != n:
            raise InvalidRequestError(
                f"the chat template of {loaded.name} wrote {text.count(marker)} image placeholder(s) for {n} image(s)",
                param="messages",
            )
        return text

    def build(self, text: str, images: Sequence[Image] = ()) -> Prompt:
        """``text`` (rendered by ``render``) and its images as exact tokens: a ``TokenPrompt``
        without images, else a ``MultimodalPrompt`` with each image's span, hash and inputs.

        Each image's placeholder tokens are the processor's to say (``image_spans``): one
        image may come as several runs (rows, tiles), and the template's marker may be
        expanded to more than placeholders (Gemma 3's soft tokens between its markers)."""
        loaded = self.loaded
        marker = loaded.marker
        if marker and text.count(marker) != len(images):
            # mlx-vlm's processors drop surplus placeholders, or images, in silence.
            raise InvalidRequestError(
                f"the prompt has {text.count(marker)} image placeholder(s) for {len(images)} image(s)",
                param="messages",
            )
        if not images:
            return TokenPrompt(vlm_text_tokens(loaded.model, loaded.processor, text))
        fitted = [fit_image(img, loaded.max_pixels) for img in images]
        digests = [pixel_digest(img) for img in fitted]

        def process() -> tuple[list[int], dict[str, Any], list[tuple[int, int, int]]]:
            try:
                inputs = vlm_prompt_inputs(loaded.model, loaded.processor, text, fitted)
                tokens = inputs.pop("input_ids")[0].tolist()
                return tokens, inputs, image_spans(loaded, tokens, fitted, digests)
            except InvalidRequestError:
                raise
            except Exception as exc:  # noqa: BLE001 - the processor refusing this prompt is the request's fault
                raise InvalidRequestError(f"the model's processor cannot take this prompt: {exc}",
                                          param="messages") from exc

        tokens, inputs, spans = self._run(process)
        images_ = tuple(PromptImage(start, length, digest, img, count)
                        for (start, length, count), digest, img in zip(spans, digests, fitted, strict=True))
        return MultimodalPrompt(tokens, images_, inputs)


def image_spans(loaded: LoadedVlm, tokens: list[int], images: Sequence[Any],
                digests: Sequence[str]) -> list[tuple[int, int, int]]:
    """Each image's (start, length, placeholders) in ``tokens``, the processor's output for
    a prompt with ``images``. One run of placeholders per image needs nothing more; where
    the processor made more runs than images (an image's rows or tiles), it says how many
    placeholders each image has: the processor runs once more per distinct image, on the
    template's marker alone (seed 002: vLLM counts each item's placeholders so). MLX thread."""
    token_id = loaded.image_token_id
    if token_id is None:
        raise InvalidRequestError(f"{loaded.name} has no image token to find the images by", param="messages")
    runs = placeholder_runs(tokens, token_id)
    if len(runs) == len(images):
        counts = [length for _, length in runs]
    elif len(images) == 1:
        counts = [sum(length for _, length in runs)]
    else:
        alone: dict[str, int] = {}
        for img, digest in zip(images, digests, strict=True):
            if digest not in alone:
                ids = vlm_prompt_inputs(loaded.model, loaded.processor, loaded.marker, [img])["input_ids"]
                alone[digest] = ids[0].tolist().count(token_id)
        counts = [alone[d] for d in digests]
    try:
        spans = placeholder_spans(tokens, token_id, counts)
    except ValueError as exc:
        raise InvalidRequestError(f"the processor of {loaded.name} made {exc}", param="messages") from exc
    return [(start, length, count) for (start, length), count in zip(spans, counts, strict=True)]


def fit_image(image: Any, max_pixels: int) -> Any:
    """``image`` shrunk, keeping its aspect ratio, to at most ``max_pixels`` (the
    worst case the load-time profile measured). Usually a no-op: the pipeline
    decodes images to that size already."""
    w, h = image.size
    if w * h <= max_pixels:
        return image
    scale = math.sqrt(max_pixels / (w * h))
    return image.resize((max(1, math.floor(w * scale)), max(1, math.floor(h * scale))))


def image_marker(processor: Any, model: Any) -> str:
    """What the chat template writes for one image part: a user message rendered with one
    image and without it, the difference (as llama.cpp's autoparser finds a template's
    markers). The processor expands it: Qwen2-VL's template writes
    ``<|vision_start|><|image_pad|><|vision_end|>`` and its processor repeats the pad;
    Gemma 3's writes ``<start_of_image>`` and its processor adds the image's 256 soft tokens."""
    with_image = _apply_template(processor, model, [_user_with_image("probe")], 1, True, {})
    text_only = [{"role": "user", "content": [{"type": "text", "text": "probe"}]}]
    without = _apply_template(processor, model, text_only, 0, True, {})
    head = len(os.path.commonprefix([with_image, without]))
    tail = len(os.path.commonprefix([with_image[head:][::-1], without[head:][::-1]]))
    return with_image[head:len(with_image) - tail].strip()


def _user_with_image(text: str) -> dict[str, Any]:
    # Image before text, the order Qwen2-VL's own examples use.
    return {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": text}]}


def _apply_template(
    processor: Any, model: Any, messages: list[dict[str, Any]], num_images: int, add_generation_prompt: bool,
    template_kwargs: dict[str, Any],
) -> str:
    from mlx_vlm import apply_chat_template

    return str(
        apply_chat_template(
            processor, model.config, messages, add_generation_prompt=add_generation_prompt, num_images=num_images,
            **template_kwargs,
        )
    )
