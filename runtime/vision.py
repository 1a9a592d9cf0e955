"""Vision models (kind ``vision``) through mlx-vlm, served by the same engine as text models.

The engine runs a vision model's *language model* like any text model — batched decode, chunked prefill, the
prefix cache — through :class:`VisionLanguageModel`, and asks it for a prompt's input embeddings when the prompt
holds images: the text tokens embedded as the model embeds them, each image's token span filled with its
vision-tower features (mlx-vlm's ``get_input_embeddings``). Two caches make a repeated image cheap:

* the features of recent images, keyed by their pixel digest (:class:`FeatureCache`): an image seen again skips
  the vision tower;
* the prefix cache keys the positions of an image's tokens by the same digest (:func:`key_tokens`), so the next
  turn of a conversation that carries the same screenshot reads the whole span's KV from the cache and runs
  neither the tower nor the span's prefill. The digests go in prompt order, never sorted: swapping two images
  changes the keys.

Images are turned into pixel arrays by the model's own processor (transformers, numpy) on a worker thread
(:func:`prompt_inputs`); only the device thread touches MLX.
"""

from __future__ import annotations

import json
import logging
from collections import OrderedDict
from pathlib import Path
from collections.abc import Callable, Sequence
from typing import Any

import mlx.core as mx
import numpy as np
from mlx.nn.layers.base import Module

from protocols.ir import ImageSpan, PromptImages
from runtime.device import DeviceThread
from runtime.errors import ModelNotAvailable
from runtime.image_spans import image_spans
from runtime.sliced_jobs import SlicedWorker, with_checkpoint

log = logging.getLogger("flow.vision")

class FeatureCache:
    """Recent images' vision-tower features (the rows their tokens take in the input embeddings), by digest."""

    def __init__(self, slots: int) -> None:
        self.slots = slots
        self._rows: OrderedDict[bytes, mx.array] = OrderedDict()
        self.hits = 0
        self.misses = 0

    def get(self, digest: bytes) -> mx.array | None:
        rows = self._rows.get(digest)
        if rows is not None:
            self._rows.move_to_end(digest)
        return rows

    def put(self, digest: bytes, rows: mx.array) -> None:
        if self.slots <= 0:
            return
        self._rows[digest] = rows
        self._rows.move_to_end(digest)
        while len(self._rows) > self.slots:
            self._rows.popitem(last=False)

    def __len__(self) -> int:
        return len(self._rows)


class VisionLanguageModel(Module):
    """An mlx-vlm model as the engine sees a text model: tokens (or input embeddings) in, logits out, with
    mlx-lm's layer caches (the engine batches and cuts those)."""

    def __init__(self, vlm: Any, worker: SlicedWorker, feature_slots: int = 32) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.vlm = vlm
        self.worker = worker  # runs the vision tower beside the engine's steps, layer by layer
        config = vlm.config
        token = getattr(config, "image_token_id", None)
        if token is None:
            token = getattr(config, "image_token_index", None)
        if token is None:
            raise ValueError("the vision model's config names no image token (image_token_id / image_token_index)")
        self.image_token_id = int(token)
        self.features = FeatureCache(feature_slots)
        self.tower_passes = 0

    # ---------------------------------------------------------------- the engine's text-model interface
    @property
    def language_model(self) -> Any:
        return self.vlm.language_model

    @property
    def layers(self) -> list[Any]:
        lm = self.language_model
        layers = getattr(lm, "layers", None)
        return list(layers if layers is not None else lm.model.layers)

    @property
    def args(self) -> Any:
        """What :func:`runtime.engine._kv_bytes_per_token` reads: the text model's configuration."""
        return self.vlm.config

    def make_cache(self) -> list[Any]:
        """The language model's layer caches as mlx-lm's classes (windows kept), which the engine can batch,
        trim and cut into prefix blocks."""
        from mlx_lm.models.cache import KVCache, RotatingKVCache

        make = getattr(self.language_model, "make_cache", None)
        if make is None:
            return [KVCache() for _ in self.layers]  # type: ignore[no-untyped-call]
        out: list[Any] = []
        for cache in make():
            name = type(cache).__name__
            if name == "KVCache":
                out.append(KVCache())  # type: ignore[no-untyped-call]
            elif name == "RotatingKVCache":
                out.append(RotatingKVCache(max_size=int(cache.max_size),  # type: ignore[no-untyped-call]
                                           keep=int(getattr(cache, "keep", 0))))
            else:
                raise ValueError(f"the vision model's language model uses {name} layer caches, which flow's engine "
                                 "does not batch yet")
        return out

    def __call__(self, inputs: mx.array, cache: Any = None, input_embeddings: mx.array | None = None) -> mx.array:
        out = self.language_model(inputs, inputs_embeds=input_embeddings, cache=cache)
        logits: mx.array = out.logits if hasattr(out, "logits") else out
        return logits

    # ---------------------------------------------------------------- images
    def features_cached(self, images: PromptImages) -> bool:
        """Every image's features are in the feature cache (no tower pass needed)."""
        return all(self.features.get(d) is not None for d in _image_digests(images.spans))

    def embed_prompt(self, tokens: Sequence[int], images: PromptImages) -> mx.array:
        """The prompt's input embeddings (1 × tokens × hidden): images from the feature cache when all of them
        are there, else one vision-tower pass over the prompt's images (whose features are kept)."""
        ids = mx.array([list(tokens)], dtype=mx.int32)
        digests = _image_digests(images.spans)
        cached = [self.features.get(d) for d in digests]
        if cached and all(c is not None for c in cached):
            self.features.hits += len(cached)
            text = self.vlm.get_input_embeddings(ids, None)
            embeds: mx.array = getattr(text, "inputs_embeds", text)
            return _with_rows(embeds, images.spans, dict(zip(digests, cached)))  # type: ignore[arg-type]
        self.features.misses += len(digests)
        arrays = {k: mx.array(v) for k, v in images.arrays}
        pixels = arrays.pop("pixel_values", None)
        mask = arrays.pop("attention_mask", None)  # Gemma 3 needs it beside the pixels
        full = self.vlm.get_input_embeddings(ids, pixels, mask=mask, **arrays)
        self.tower_passes += 1
        embeds = getattr(full, "inputs_embeds", full)
        mx.eval(embeds)
        for digest in digests:
            self.features.put(digest, mx.concatenate([embeds[0, s.start:s.end] for s in images.spans
                                                      if s.digest == digest], axis=0))
        return embeds


def _image_digests(spans: Sequence[ImageSpan]) -> list[bytes]:
    """Each image's digest once, in prompt order."""
    seen: dict[bytes, None] = {}
    for span in spans:
        seen.setdefault(span.digest, None)
    return list(seen)


def _with_rows(embeds: mx.array, spans: Sequence[ImageSpan], rows: dict[bytes, mx.array]) -> mx.array:
    """``embeds`` with each span's rows taken from its image's cached features (in the image's span order)."""
    pieces: list[mx.array] = []
    at = 0
    used: dict[bytes, int] = {}
    for span in spans:
        pieces.append(embeds[:, at:span.start])
        offset = used.get(span.digest, 0)
        n = span.end - span.start
        pieces.append(rows[span.digest][None, offset:offset + n].astype(embeds.dtype))
        used[span.digest] = offset + n
        at = span.end
    pieces.append(embeds[:, at:])
    return mx.concatenate(pieces, axis=1)


def prompt_inputs(processor: Any, model_type: str, text: str, images: Sequence[Any], digests: Sequence[bytes],
                  image_token_id: int) -> tuple[tuple[int, ...], PromptImages]:
    """The prompt's token ids (image placeholders expanded by the processor) and its images' arrays and spans.

    Runs the model's processor (transformers: numpy, no MLX) — on a worker thread, never the event loop."""
    from mlx_vlm.utils import process_inputs_with_fallback, should_add_special_tokens

    special = should_add_special_tokens(model_type, processor)
    inputs = process_inputs_with_fallback(  # type: ignore[no-untyped-call]
        processor, prompts=[text], images=list(images), audio=None, add_special_tokens=special, return_tensors="np")
    ids = [int(t) for t in np.asarray(inputs["input_ids"])[0]]
    arrays = tuple((k, np.asarray(v)) for k, v in inputs.items()
                   if k != "input_ids" and v is not None)
    counts = None
    total = sum(t == image_token_id for t in ids)
    if total and _runs(ids, image_token_id) != len(images):
        counts = _tokens_per_image(processor, images, image_token_id, special)
    spans = image_spans(ids, image_token_id, digests, counts)
    return tuple(ids), PromptImages(arrays, spans)


def _runs(ids: Sequence[int], token: int) -> int:
    return sum(1 for i, t in enumerate(ids) if t == token and (i == 0 or ids[i - 1] != token))


def _tokens_per_image(processor: Any, images: Sequence[Any], image_token_id: int, special: bool) -> list[int] | None:
    """How many image tokens each image alone expands to (a tiling processor's count depends on its size)."""
    from mlx_vlm.utils import process_inputs_with_fallback

    placeholder = getattr(processor, "image_token", None)
    if not isinstance(placeholder, str):
        return None
    counts = []
    for image in images:
        try:
            alone = process_inputs_with_fallback(  # type: ignore[no-untyped-call]
                processor, prompts=[placeholder], images=[image], audio=None,
                                                 add_special_tokens=special, return_tensors="np")
        except ValueError:
            return None
        counts.append(int((np.asarray(alone["input_ids"]) == image_token_id).sum()))
    return counts


# Language models the engine cannot batch yet: 3-D (M-RoPE) positions that depend on the image grid, or
# cross-attention to the image instead of image tokens in the sequence.
_MROPE_TYPES = frozenset({"qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe", "qwen3_5", "qwen3_5_moe", "glm4v",
                          "glm4v_moe", "glm_ocr", "paddleocr_vl", "keye_vl", "dots_ocr"})
_CROSS_ATTENTION_TYPES = frozenset({"mllama"})


def unbatchable(config: dict[str, Any]) -> str | None:
    """Why flow's engine cannot serve this vision model yet (None: it can)."""
    model_type = str(config.get("model_type", ""))
    text = config.get("text_config") or {}
    rope = {**(config.get("rope_scaling") or {}), **(text.get("rope_scaling") or {}),
            **(text.get("rope_parameters") or {})}
    if model_type in _MROPE_TYPES or "mrope_section" in rope:
        return (f"a {model_type} model's language model takes 3-D (M-RoPE) positions, which flow's engine does not "
                "batch yet; vision models with ordinary positions (SmolVLM/Idefics3, Gemma 3, LLaVA, Pixtral, …) "
                "are served")
    if model_type in _CROSS_ATTENTION_TYPES:
        return (f"a {model_type} model reads images by cross-attention, which flow's engine does not batch yet; "
                "vision models with image tokens in the prompt (SmolVLM/Idefics3, Gemma 3, LLaVA, …) are served")
    return None


def load_vision_model(path: Path, device: DeviceThread, share: float = 0.15, feature_slots: int = 32,
                      lazy: bool = False) -> tuple[VisionLanguageModel, Any]:
    """The model and its processor (on the device thread; ``lazy``: the weights are read when first evaluated),
    with flow's GELU on the CPU (:mod:`runtime.cpu_activations`). The vision tower's layers become checkpoints
    of a sliced worker that gets ``share`` of the device while streams decode."""
    from mlx_vlm.utils import load

    unsupported = unbatchable(json.loads((path / "config.json").read_text()))
    if unsupported:
        raise ModelNotAvailable(f"{path}: {unsupported}. To serve its text side through mlx-lm (where mlx-lm has the "
                                "architecture), set kind = \"text\" on its [resources.*] table.")
    from runtime.cpu_activations import use_fast_gelu

    vlm, processor = load(str(path), lazy=lazy)
    use_fast_gelu(vlm)  # on the CPU, a SigLIP tower's GELU took a quarter of its time (MLX's tanh is scalar there)
    worker = SlicedWorker(device, share, "vision")
    for name in ("vision_tower", "vision_model", "vision_encoder"):
        tower = getattr(vlm, name, None)
        if tower is not None:
            _checkpoint_layers(tower, worker.checkpoint)
    return VisionLanguageModel(vlm, worker, feature_slots), processor


def _checkpoint_layers(module: Any, checkpoint: Callable[[], None]) -> None:
    """Every block of the tower's layer lists (``layers``, however deep) evaluates its output and passes a
    checkpoint: the tower gives the device back between its layers."""
    from mlx.nn.layers.base import Module

    for name, child in module.children().items():
        if name == "layers" and isinstance(child, list):
            for layer in child:
                with_checkpoint(layer, checkpoint, evaluate=True)
        elif isinstance(child, Module):
            _checkpoint_layers(child, checkpoint)
        elif isinstance(child, list):
            for item in child:
                if isinstance(item, Module):
                    _checkpoint_layers(item, checkpoint)
