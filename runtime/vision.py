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

Models whose language model takes **3-D positions** (M-RoPE: Qwen2-VL, Qwen2.5-VL, Qwen3-VL and the others whose
mlx-vlm language model has ``get_rope_index``) are served too. mlx-vlm keeps their position state (``rope_deltas``,
the prompt's position ids) on the model, for the one sequence it runs; here every pass gets its rows' positions
from the engine instead (:meth:`VisionLanguageModel.rope_index` makes a row's from its prompt and image grids,
with mlx-vlm's own ``get_rope_index``; ``runtime/passes.py`` lays them out per pass), so the model holds no
per-sequence state at all. Qwen3-VL's *deepstack* features (tower layers added to the first decoder layers' hidden
states at the image's positions) travel with the input embeddings: rows below the first, zero where no image
sits, gathered at the image positions of each chunk.

Models that read images by **cross-attention** (Llama 3.2 Vision, mlx-vlm's ``mllama``) are served too: the prompt
holds one ``<|image|>`` token per image, and the images reach the language model through its cross-attention
layers, whose keys and values each row owns (:mod:`runtime.cross_attention`): :meth:`VisionLanguageModel.embed_prompt`
makes them from the vision tower's output (or the feature cache's, by digest), and every pass gets its rows' windows.

Models whose language model is a **hybrid** (Qwen3.5's vision variants, mlx-vlm's ``qwen3_5`` / ``qwen3_5_moe``:
gated-delta layers with recurrent states between attention layers) are served as the text Qwen3.5 is: their layer
caches are mlx-lm's (``ArraysCache`` for the gated-delta layers), which the engine batches, snapshots in the prefix
cache and rolls back after a verify pass (:mod:`runtime.recurrent_rollback`). mlx-vlm's model keeps its own cache
class there (with speculation records) and, around its layers, paths of its own for batches (rows split and run
one by one when left-padded, a ragged decode kernel); so :func:`_hybrid_forward` runs the layers as mlx-lm's text
model does — masks from mlx-lm's batch caches (``create_attention_mask``, ``create_ssm_mask``), each row's 3-D
positions from the engine — and each gated-delta mixer reads and writes an mlx-lm ``ArraysCache`` through
:class:`_RecurrentView` (the same arithmetic, one sequence's result equal to mlx-vlm's own).
"""

from __future__ import annotations

import json
import logging
from collections import OrderedDict
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
from mlx.nn.layers.base import Module

from protocols.errors import ApiError
from protocols.ir import ImageSpan, PromptImages
from runtime import cross_attention
from runtime.cross_attention import CrossStates, CrossWindows
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
        # 3-D (M-RoPE) positions: the engine hands every pass its rows' positions (runtime/passes.py).
        self.mrope = callable(getattr(vlm.language_model, "get_rope_index", None))
        # Images by cross-attention: the engine hands every pass its rows' cross-attention windows.
        self.cross = str(getattr(config, "model_type", "")) in _CROSS_ATTENTION_TYPES
        self._crossing = frozenset(config.text_config.cross_attention_layers) if self.cross else frozenset()
        # A hybrid language model (gated-delta layers beside attention): its layers run on mlx-lm's caches.
        self.hybrid = _adopt_gated_delta(vlm.language_model)

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

        if self.cross:  # the self-attention layers only: a cross-attention layer's keys and values are the row's own
            own = [i for i in range(len(self.layers)) if i not in self._crossing]
            return [KVCache() for _ in own]  # type: ignore[no-untyped-call]
        from mlx_lm.models.cache import ArraysCache

        make = getattr(self.language_model, "make_cache", None)
        if make is None:
            return [KVCache() for _ in self.layers]  # type: ignore[no-untyped-call]
        out: list[Any] = []
        for cache in make():
            name = type(cache).__name__
            if name == "KVCache":
                out.append(KVCache())  # type: ignore[no-untyped-call]
            elif name == "ArraysCache" and self.hybrid:  # a gated-delta layer's: mlx-lm's, as the text Qwen3.5's
                out.append(ArraysCache(size=len(cache.cache)))
            elif name == "RotatingKVCache":
                out.append(RotatingKVCache(max_size=int(cache.max_size),  # type: ignore[no-untyped-call]
                                           keep=int(getattr(cache, "keep", 0))))
            else:
                raise ValueError(f"the vision model's language model uses {name} layer caches, which flow's engine "
                                 "does not batch yet")
        return out

    def __call__(self, inputs: mx.array, cache: Any = None, input_embeddings: mx.array | None = None,
                 positions: mx.array | CrossWindows | None = None) -> mx.array:
        """Logits for ``inputs`` (``[rows, tokens]``), from ``input_embeddings`` where given (a vision prompt's
        chunk: ``[1 + deepstack layers, tokens, hidden]`` for one row); ``positions`` (``[3, rows, tokens]``) an
        M-RoPE model takes with every pass, for it keeps no position state of its own here. Without them the rows
        are text from their caches' ends (each token at its index in all three dimensions): what a caller that knows
        nothing of rows gives, as mlx-lm's ``generate`` in ``flow probe`` or the prefix audit's cold run of a text
        prompt; the engine's passes always give them. A cross-attention model takes its rows' windows
        (:class:`runtime.cross_attention.CrossWindows`) there instead; without them every row is text."""
        if self.cross:
            return cross_attention.forward(self.vlm, inputs, cache,
                                           positions if isinstance(positions, CrossWindows) else None)
        assert not isinstance(positions, CrossWindows)
        extra: dict[str, Any] = {}
        if self.mrope:
            extra["position_ids"] = positions if positions is not None else _text_positions(cache, inputs)
        if input_embeddings is not None and input_embeddings.shape[0] > inputs.shape[0]:
            input_embeddings, extra = self._deepstack(inputs, input_embeddings, extra)
        if self.hybrid:
            return _hybrid_forward(self.language_model, inputs, input_embeddings, cache, extra.get("position_ids"))
        out = self.language_model(inputs, inputs_embeds=input_embeddings, cache=cache, **extra)
        logits: mx.array = out.logits if hasattr(out, "logits") else out
        return logits

    def _deepstack(self, inputs: mx.array, embeds: mx.array,
                   extra: dict[str, Any]) -> tuple[mx.array, dict[str, Any]]:
        """Split a one-row chunk's embeddings into its input embeddings and its deepstack features, each layer's
        gathered at the chunk's image positions as mlx-vlm hands them (compact, in token order)."""
        mask = inputs == self.image_token_id
        at = np.flatnonzero(np.asarray(mask[0]))
        if at.size:
            index = mx.array(at, dtype=mx.uint32)
            deep = embeds[1:]
            extra = {**extra, "visual_pos_masks": mask,
                     "deepstack_visual_embeds": [deep[layer][index] for layer in range(deep.shape[0])]}
        return embeds[:1], extra

    # ---------------------------------------------------------------- 3-D positions
    def rope_index(self, tokens: Sequence[int], images: PromptImages | None) -> tuple[mx.array | None, int]:
        """A prompt's 3-D positions (``[3, tokens]``, None for a prompt without images: each token at its index)
        and its rope delta (what decoding adds to a token's index), by mlx-vlm's ``get_rope_index``."""
        grid = None if images is None else dict(images.arrays).get("image_grid_thw")
        if grid is None:
            return None, 0
        ids = mx.array([list(tokens)], dtype=mx.int32)
        positions, deltas = self.language_model.get_rope_index(ids, mx.array(grid), None, None)
        return positions[:, 0].astype(mx.int32), int(np.asarray(deltas).reshape(-1)[0])

    # ---------------------------------------------------------------- images
    def features_cached(self, images: PromptImages) -> bool:
        """Every image's features are in the feature cache (no tower pass needed)."""
        return all(self.features.get(d) is not None for d in _image_digests(images.spans))

    def embed_prompt(self, tokens: Sequence[int], images: PromptImages) -> mx.array | CrossStates:
        """The prompt's input embeddings (1 × tokens × hidden): images from the feature cache when all of them
        are there, else one vision-tower pass over the prompt's images (whose features are kept). A cross-attention
        model's prompt keeps its tokens' embeddings: it gets its row's cross-attention states instead."""
        if self.cross:
            return self._cross_states(tokens, images)
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
        deep = getattr(full, "deepstack_visual_embeds", None)
        if deep is not None:  # Qwen3-VL: the deepstack layers' features, as rows below, where the image sits
            at = mx.array(np.flatnonzero(np.asarray(tokens) == self.image_token_id), dtype=mx.uint32)
            layers = mx.stack(list(deep)).astype(embeds.dtype)
            rows = mx.zeros((layers.shape[0], *embeds.shape[1:]), dtype=embeds.dtype).at[:, at].add(layers)
            embeds = mx.concatenate([embeds, rows], axis=0)
        mx.eval(embeds)
        for digest in digests:
            self.features.put(digest, mx.concatenate([embeds[:, s.start:s.end] for s in images.spans
                                                      if s.digest == digest], axis=1))
        return embeds


    def _cross_states(self, tokens: Sequence[int], images: PromptImages) -> CrossStates:
        """A cross-attention prompt's row states: its images' projected vision states (the tower's, or the feature
        cache's when every image is there), in prompt order, with its cross-attention mask."""
        arrays = {k: mx.array(v) for k, v in images.arrays}
        mask = arrays.pop("cross_attention_mask")
        pixels = arrays.pop("pixel_values")
        arrays.pop("attention_mask", None)
        order = [span.digest for span in images.spans]
        count = int(pixels.shape[1])  # the processor's images, in prompt order: one <|image|> token (span) each
        cached = [self.features.get(d) for d in order] if len(order) == count else []
        if cached and all(c is not None for c in cached):
            self.features.hits += len(cached)
            states = mx.concatenate(cached, axis=1)  # type: ignore[arg-type]
        else:
            self.features.misses += len(set(order))
            ids = mx.array([list(tokens)], dtype=mx.int32)
            states = self.vlm.get_input_embeddings(ids, pixels, **arrays).cross_attention_states
            self.tower_passes += 1
            mx.eval(states)
            if len(order) == count:
                per = states.shape[1] // count
                for i, digest in enumerate(order):
                    self.features.put(digest, states[:, i * per:(i + 1) * per])
        row = cross_attention.cross_states(self.vlm, states, mask)
        mx.eval(row.keys, row.values, row.mask)
        return row


def _text_positions(cache: Any, inputs: mx.array) -> mx.array:
    """3-D positions of text rows that go on from their caches' ends: ``[3, rows, tokens]`` (the ends of the first
    layer that keeps positions: a hybrid's recurrent layers keep none)."""
    offset = next((c.offset for c in cache if hasattr(c, "offset")), 0) if cache else 0
    first = offset if isinstance(offset, mx.array) else mx.array([offset] * inputs.shape[0])
    grid = first.astype(mx.int32)[:, None] + mx.arange(inputs.shape[1], dtype=mx.int32)[None]
    return mx.broadcast_to(grid[None], (3, *grid.shape))


class _RecurrentView:
    """An mlx-lm ``ArraysCache`` (conv window, recurrent state) as mlx-vlm's Qwen3.5 gated-delta mixer writes its own
    cache class: the window and state updates of mlx-vlm's ``ArraysCache`` without its speculation records (flow
    rolls the state back itself), ``lengths`` and ``advance`` mlx-lm's (each row's kept length, its padding)."""

    def __init__(self, cache: Any) -> None:
        self.cache = cache

    def __getitem__(self, index: int) -> Any:
        return self.cache[index]

    @property
    def lengths(self) -> Any:
        return self.cache.lengths

    def update_window(self, index: int, source: mx.array, width: int, *, lengths: Any = None) -> mx.array:
        length = source.shape[1] - width
        if lengths is None:
            state = mx.contiguous(source[:, length:length + width])
        else:  # each row's window ends at its length (mlx-lm's right padding: a verify pass cut back)
            positions = mx.clip(lengths, 0, length)[:, None] + mx.arange(width)
            state = mx.take_along_axis(source, positions[..., None], axis=1)
        self.cache[index] = state
        return state

    def update_recurrent(self, index: int, length: int, update: Callable[[Any, Any], Any]) -> tuple[Any, Any]:
        output, state = update(self.cache[index], None)[:2]
        self.cache[index] = state
        return output, state

    def advance(self, n: int) -> None:
        self.cache.advance(n)


def _adopt_gated_delta(language_model: Any) -> bool:
    """Let the language model's gated-delta mixers (mlx-vlm's Qwen3.5 ``linear_attn``) run on mlx-lm's
    ``ArraysCache``: each mixer's class becomes a subclass whose call hands the base class a
    :class:`_RecurrentView` of it (what :mod:`runtime.recurrent_rollback` then records and replays). True when
    the model has such layers."""
    layers = getattr(getattr(language_model, "model", None), "layers", None) or []
    mixers = [layer.linear_attn for layer in layers
              if getattr(layer, "is_linear", False) and hasattr(layer, "linear_attn")]
    if not mixers or not hasattr(getattr(language_model, "model", None), "fa_idx"):
        return False
    for mixer in mixers:
        base = type(mixer)
        if getattr(base, "_flow_mlx_lm_cache", False):
            continue

        def __call__(self: Any, inputs: mx.array, mask: Any = None, cache: Any = None, *,
                     _base: Any = base) -> Any:
            view = cache if cache is None or hasattr(cache, "update_window") else _RecurrentView(cache)
            return _base.__call__(self, inputs, mask, view)

        mixer.__class__ = type(f"MlxLmCache{base.__name__}", (base,), {"__call__": __call__,
                                                                       "_flow_mlx_lm_cache": True})
    return True


def _hybrid_forward(lm: Any, inputs: mx.array, embeds: mx.array | None, cache: Any,
                    positions: mx.array | None) -> mx.array:
    """Logits of mlx-vlm's hybrid (Qwen3.5) language model ``lm`` with mlx-lm's batch caches, run as mlx-lm's
    text Qwen3.5 runs its layers: one attention mask from the first attention layer's cache (left padding, the
    causal window), one state mask from the first gated-delta layer's (padding and kept lengths), each row's 3-D
    positions as given."""
    from mlx_lm.models.base import create_attention_mask, create_ssm_mask

    model = lm.model
    h = embeds if embeds is not None else model.embed_tokens(inputs)
    caches = cache if cache is not None else [None] * len(model.layers)
    fa_mask = create_attention_mask(h, caches[model.fa_idx])
    ssm_mask = create_ssm_mask(h, caches[model.ssm_idx])  # type: ignore[no-untyped-call]
    rotated = None
    if positions is not None:
        first = next(layer for layer in model.layers if not layer.is_linear)
        if not first.self_attn.rotary_emb.fused_apply:  # mlx-vlm computes the rotation once for every layer
            rotated = first.self_attn.rotary_emb(h, positions)
    for layer, c in zip(model.layers, caches):
        h = layer(h, mask=ssm_mask if layer.is_linear else fa_mask, cache=c, position_ids=positions,
                  position_embeddings=rotated)
    h = model.norm(h)
    logits: mx.array = model.embed_tokens.as_linear(h) if lm.args.tie_word_embeddings else lm.lm_head(h)
    return logits


def _image_digests(spans: Sequence[ImageSpan]) -> list[bytes]:
    """Each image's digest once, in prompt order."""
    seen: dict[bytes, None] = {}
    for span in spans:
        seen.setdefault(span.digest, None)
    return list(seen)


def _with_rows(embeds: mx.array, spans: Sequence[ImageSpan], rows: dict[bytes, mx.array]) -> mx.array:
    """``embeds`` (the prompt's text embeddings) with each span's rows taken from its image's cached features (in
    the image's span order); features with deepstack layers (``[1 + layers, tokens, hidden]``) add those layers as
    rows below, zero under the text."""
    depth = max(r.shape[0] for r in rows.values())
    if depth > embeds.shape[0]:
        embeds = mx.concatenate([embeds, mx.zeros((depth - embeds.shape[0], *embeds.shape[1:]), embeds.dtype)])
    pieces: list[mx.array] = []
    at = 0
    used: dict[bytes, int] = {}
    for span in spans:
        pieces.append(embeds[:, at:span.start])
        offset = used.get(span.digest, 0)
        n = span.end - span.start
        pieces.append(rows[span.digest][:, offset:offset + n].astype(embeds.dtype))
        used[span.digest] = offset + n
        at = span.end
    pieces.append(embeds[:, at:])
    return mx.concatenate(pieces, axis=1)


def prompt_inputs(processor: Any, model_type: str, text: str, images: Sequence[Any], digests: Sequence[bytes],
                  image_token_id: int) -> tuple[tuple[int, ...], PromptImages]:
    """The prompt's token ids (image placeholders expanded by the processor) and its images' arrays and spans.

    Runs the model's processor (transformers: numpy, no MLX) — on a worker thread, never the event loop. An image
    the processor refuses (Qwen-VL's: a side more than 200 times the other) is the request's error, a 400."""
    from mlx_vlm.utils import process_inputs_with_fallback, should_add_special_tokens

    special = should_add_special_tokens(model_type, processor)
    try:
        inputs = process_inputs_with_fallback(  # type: ignore[no-untyped-call]
            processor, prompts=[text], images=list(images), audio=None, add_special_tokens=special,
            return_tensors="np")
    except ValueError as exc:
        reason = str(exc).removeprefix("Failed to process inputs with error: ")
        raise ApiError("invalid_request", f"The model's image processor refused an image: {reason}.",
                       param="messages") from None
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


# Vision models whose language model reads the image by cross-attention (not image tokens in the prompt): each
# row's cross-attention states are its own (runtime/cross_attention.py).
_CROSS_ATTENTION_TYPES = frozenset({"mllama"})
# Model types whose language model takes 3-D (M-RoPE) positions, whatever their config's rope section says.
_MROPE_TYPES = frozenset({"qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe", "qwen3_5", "qwen3_5_moe", "glm4v",
                          "glm4v_moe", "glm_ocr", "paddleocr_vl", "keye_vl", "dots_ocr"})


def declares_mrope(config: dict[str, Any]) -> bool:
    """Whether a vision model's config says its language model takes 3-D (M-RoPE) positions."""
    text = config.get("text_config") or {}
    rope = {**(config.get("rope_scaling") or {}), **(text.get("rope_scaling") or {}),
            **(text.get("rope_parameters") or {})}
    return str(config.get("model_type", "")) in _MROPE_TYPES or "mrope_section" in rope


def load_vision_model(path: Path, device: DeviceThread, share: float = 0.15, feature_slots: int = 32,
                      lazy: bool = False) -> tuple[VisionLanguageModel, Any]:
    """The model and its processor (on the device thread; ``lazy``: the weights are read when first evaluated),
    with flow's GELU on the CPU (:mod:`runtime.cpu_activations`). The vision tower's layers become checkpoints
    of a sliced worker that gets ``share`` of the device while streams decode."""
    from mlx_vlm.utils import load

    config = json.loads((path / "config.json").read_text())
    from runtime.cpu_activations import use_fast_gelu

    vlm, processor = load(str(path), lazy=lazy)
    use_fast_gelu(vlm)  # on the CPU, a SigLIP tower's GELU took a quarter of its time (MLX's tanh is scalar there)
    worker = SlicedWorker(device, share, "vision")
    for name in ("vision_tower", "vision_model", "vision_encoder"):
        tower = getattr(vlm, name, None)
        if tower is not None:
            _checkpoint_layers(tower, worker.checkpoint)
    model = VisionLanguageModel(vlm, worker, feature_slots)
    if declares_mrope(config) and not model.mrope:
        raise ModelNotAvailable(f"{path}: its language model takes 3-D (M-RoPE) positions, but mlx-vlm's "
                                f"{config.get('model_type')} language model has no get_rope_index to compute a "
                                "row's positions from its prompt and image grids, which flow's engine needs")
    return model, processor


def _checkpoint_layers(module: Any, checkpoint: Callable[[], None]) -> None:
    """Every block of the tower's layer lists (``layers``, or ``blocks`` as the Qwen-VL towers name them, however
    deep) evaluates its output and passes a checkpoint: the tower gives the device back between its layers."""
    from mlx.nn.layers.base import Module

    for name, child in module.children().items():
        if name in ("layers", "blocks") and isinstance(child, list):
            for layer in child:
                with_checkpoint(layer, checkpoint, evaluate=True)
        elif isinstance(child, Module):
            _checkpoint_layers(child, checkpoint)
        elif isinstance(child, list):
            for item in child:
                if isinstance(item, Module):
                    _checkpoint_layers(item, checkpoint)
