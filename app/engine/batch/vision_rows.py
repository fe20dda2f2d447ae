"""What a native VLM's rows need beyond a text model's, for the one chat engine.

A native VLM (mlx-vlm) is served by the same engine as a text model
(``app.engine.batch.engine``): admission, the prefix cache and its disk tier, pauses,
speculation, quantized KV, logprobs and constraints are one code path. What is the VLM's
own is here:

    prompts        ``VlmPrompts``: the processor expands each image's placeholders, its
                   spans known to the prompt (``app.engine.models.vlm_prompts``)
    the step       ``new_vlm_decode_batch``: the language model fed by ``VlmForward``
                   (embeddings and positions per row; ``app.engine.models.vlm_forward``),
                   stopping where mlx-vlm stops
    a row's inputs ``prompt_row_inputs``: the prompt's embeddings from the first token the
                   prefix cache did not give, the images after it through the vision tower
                   (or the vision-feature cache), images wholly inside the prefix skipped
    the cache key  ``cache_key_tokens``: each image's span stands for its pixel digest, so a
                   cached prefix runs across an image only when its pixels are the same;
                   the partition names the processor's pixel settings
    tokens out     the processor's own streaming detokenizer

MLX thread only, except ``stats``.
"""

from __future__ import annotations

from importlib.metadata import version
from typing import TYPE_CHECKING, Any

from app.engine.batch.vision_features import FeatureCache, prompt_row_inputs
from app.engine.kv.kv_layout import KVLayout, model_layout
from app.engine.kv.kv_snapshot import kv_identity
from app.engine.mlx_internals import new_vlm_detokenizer, vlm_language_model
from app.engine.models.vlm_forward import VlmForward, new_vlm_decode_batch, rebase
from app.engine.prompt import MultimodalPrompt, Prompt, cache_key_tokens
from app.engine.step import DecodeBatch, RowInputs
from app.engine.types import GenerationRequest
from app.errors import ImageError

if TYPE_CHECKING:
    from app.engine.models.vlm import LoadedVlm
    from app.engine.worker import MLXWorker


class VisionRows:
    """A native VLM's part of the chat engine (see the module docstring)."""

    def __init__(self, loaded: LoadedVlm, worker: MLXWorker, feature_cache_bytes: int = 0) -> None:
        from app.engine.models.vlm import VlmPrompts

        self.loaded = loaded
        # The vision tower's output per image (``vision_features``); 0 bytes: none.
        self.features = FeatureCache(feature_cache_bytes) if feature_cache_bytes > 0 else None
        # The processor's one job per prompt runs on the MLX thread.
        self.prompts = VlmPrompts(loaded, lambda fn: worker.submit(fn).result())
        self.forward = VlmForward(loaded.model, loaded.name)

    # ---- what differs from a text model --------------------------------------------------

    def new_batch(self, *, completion_batch_size: int, prefill_batch_size: int, prefill_step_size: int,
                  checkpoints: bool) -> DecodeBatch:
        return new_vlm_decode_batch(self.loaded.model, self.loaded.processor,
                                    completion_batch_size=completion_batch_size,
                                    prefill_batch_size=prefill_batch_size, prefill_step_size=prefill_step_size,
                                    checkpoints=checkpoints, name=self.loaded.name)

    def quantized_cache(self, bits: int, group_size: int) -> list[Any]:
        """An empty cache for a row, its plain KV layers quantized (``kv_cache_bits``)."""
        return self.forward.quantized_cache(bits, group_size, self.loaded.kv_plain_attention)

    def detokenizer(self) -> Any:
        return new_vlm_detokenizer(self.loaded.processor)

    def partition(self) -> str:
        """What shaped each image's tokens: a prefix cache partition of its own."""
        return f"{self.loaded.max_pixels}/{self.loaded.min_pixels}"

    @staticmethod
    def key_tokens(prompt: Prompt) -> list[int]:
        """The prompt as the prefix cache keys it: each image's span its pixel digest."""
        return cache_key_tokens(prompt)

    def inputs(self, prompt: Prompt, scope: str, cached: int) -> RowInputs | None:
        """A row's inputs from its ``cached`` tokens on (None for a prompt without images).
        The vision tower runs here for every image after ``cached`` not in the feature cache."""
        loaded = self.loaded
        return prompt_row_inputs(loaded.model, prompt, self.features, scope, loaded.max_pixels, loaded.min_pixels,
                                 cached_tokens=cached)

    @staticmethod
    def rebased(inputs: RowInputs | None, n: int) -> RowInputs | None:
        """A row's inputs for ``n`` more of its prompt tokens already in its KV (a paused row put back)."""
        return rebase(inputs, n)

    def check(self, req: GenerationRequest) -> None:
        """The engine's own guard on a request's images (the pipeline checks the count first,
        naming the client's part)."""
        images = req.prompt.images if isinstance(req.prompt, MultimodalPrompt) else ()
        if len(images) > self.loaded.max_images:
            raise ImageError(f"this request has {len(images)} images; at most {self.loaded.max_images} are accepted",
                             param=None, code="too_many_images")

    def encodes(self, prompt: Prompt, cached: int) -> bool:
        """Whether starting this row runs the vision tower (an image after its cached prefix)."""
        return isinstance(prompt, MultimodalPrompt) and any(i.start + i.length > cached for i in prompt.images)

    # ---- the disk tier ---------------------------------------------------------------------

    def identity(self) -> str:
        """What the KV depends on: the weights, and what shaped each image's tokens."""
        loaded = self.loaded
        return kv_identity(loaded.model, loaded.path, {
            "kind": "vlm", "max_pixels": loaded.max_pixels, "min_pixels": loaded.min_pixels,
            "mlx_vlm": version("mlx-vlm")})

    def layout(self, bits: int | None, group_size: int) -> KVLayout:
        """The tensors a row's caches are made of, as the step keeps them (mlx-lm's classes)."""
        language_model = vlm_language_model(self.loaded.model)
        return model_layout(language_model, bits, group_size, plain=self.loaded.kv_plain_attention,
                            make_cache=self.forward.make_cache,
                            forward=lambda tokens, cache: language_model(tokens, cache=cache))

    def close(self) -> None:
        if self.features is not None:
            self.features.clear()
