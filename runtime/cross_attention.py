"""Cross-attention vision models (Llama 3.2 Vision, mlx-vlm's ``mllama``) in the batched engine.

Theory of operation
-------------------
Such a model reads its images through *cross-attention layers* between its self-attention layers: their keys and
values come from the row's images (the vision tower's output through the projector, every tile of every image),
not from the prompt. mlx-vlm runs one sequence: it keeps the vision states in its generation loop and recomputes
the keys and values from them in every pass. Here each row owns them instead — :class:`CrossStates`, made once
from its images when it is first prefilled (the vision tower as a job beside the steps, or the feature cache),
kept with the row for its life and dropped when it leaves — and every pass gives the model, per row, the window
of tokens it runs (:class:`CrossWindows`), so the model itself holds no per-sequence state.

What a pass computes per row, as mlx-vlm does for one sequence (``mlx_vlm/models/mllama``):

* **A prompt token** (prefill chunks and the pass of the last prompt token) attends to the tiles the processor's
  ``cross_attention_mask`` gives it (an image's tiles from its ``<|image|>`` token until the next image's; never
  a padding tile). A token that sees no image (the text before the first one) attends uniformly to every vision
  token, and its cross-attention MLP is zeroed (``full_text_row_masked_out_mask``).
* **A generated token** (decode and verify passes) attends to all the row's vision tokens without a mask, its
  MLP whole: mlx-vlm hands its decode steps the cross-attention states alone (its ``_step`` keeps only
  ``cross_attention_states`` after the first). Hugging Face's generation masks them with the last prompt row
  instead; flow follows mlx-vlm, whose output it is tested against.
* **A row without images** skips the cross-attention layers (Hugging Face's rule). mlx-vlm instead runs them with
  keys and values split from the layer's own queries, unmasked over the pass — which depends on how a prompt is
  cut into prefill chunks (``prefill_step_size``) and so cannot be batched, cached or chunked exactly.

Rows of a pass are grouped by their number of vision tokens (their images' count: every image has the same
number of tiles, padding included) and each group runs one attention — the shapes mlx-vlm runs for each of them
alone; a row without images is left out of the layer. The keys and values are computed once per row from its
states (``k_norm(k_proj(states))``, ``v_proj(states)`` for each cross-attention layer): the same arrays mlx-vlm
recomputes in every pass.

A row's KV blocks depend on all its images (a token that sees none attends to all of them), so the engine keys an
image row's prefix-cache blocks in a namespace of its images' digests in prompt order (``runtime/engine.py``).

Never imports the engine, the prefix cache or trio.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import mlx.core as mx


@dataclass(frozen=True, eq=False)
class CrossStates:
    """A row's cross-attention inputs, for its whole life: each cross-attention layer's keys and values
    (``[1, kv heads, vision tokens, head dim]``) and its prompt's mask (the processor's ``cross_attention_mask``:
    ``[prompt tokens, images, tiles]``, 1 where a token sees a tile)."""

    keys: tuple[mx.array, ...]
    values: tuple[mx.array, ...]
    mask: mx.array
    vision_tokens: int  # per tile (patches and the class token)

    @property
    def length(self) -> int:
        """The row's vision tokens (every tile of every image)."""
        return int(self.keys[0].shape[2]) if self.keys else 0

    @property
    def nbytes(self) -> int:
        return sum(int(a.nbytes) for a in (*self.keys, *self.values))

    def window(self, vlm: Any, start: int, length: int) -> tuple[mx.array | None, mx.array | None]:
        """The additive attention mask (``[1, 1, length, vision tokens]``) and the MLP's row mask
        (``[1, 1, length, 1]``) of ``length`` tokens from index ``start`` on, as mlx-vlm slices them from the whole
        prompt's; (None, None) past the prompt (generated tokens: no mask)."""
        prompt = int(self.mask.shape[0])
        if start >= prompt:
            return None, None
        end = min(start + length, prompt)
        mask, rows = vlm._prepare_cross_attention_mask(self.mask[None, start:end], num_vision_tokens=self.vision_tokens)
        tail = start + length - end
        if tail:  # a window past the prompt's end (never run: a prompt's last token has a pass of its own)
            mask = mx.concatenate([mask, mx.zeros((1, 1, tail, mask.shape[-1]), mask.dtype)], axis=2)
            rows = mx.concatenate([rows, mx.ones((1, 1, tail, 1), rows.dtype)], axis=2)
        return mask, rows


@dataclass(frozen=True)
class CrossWindows:
    """What one pass gives a cross-attention model of its rows: each row's states (None: a row without images)
    and the index of its window's first token; every window is ``length`` tokens."""

    rows: tuple[CrossStates | None, ...]
    starts: tuple[int, ...]
    length: int


def cross_states(vlm: Any, states: mx.array, mask: mx.array) -> CrossStates:
    """A row's :class:`CrossStates` from its images' projected vision states (``[1, vision tokens, hidden]``) and
    its prompt's cross-attention mask (``[1, prompt tokens, images, tiles]``)."""
    text = vlm.language_model.model
    keys: list[mx.array] = []
    values: list[mx.array] = []
    for idx in vlm.config.text_config.cross_attention_layers:
        attn = text.layers[idx].cross_attn
        heads, dim = attn.num_key_value_heads, attn.head_dim
        k = attn.k_proj(states).reshape(1, -1, heads, dim).transpose(0, 2, 1, 3)
        keys.append(attn.k_norm(k))
        values.append(attn.v_proj(states).reshape(1, -1, heads, dim).transpose(0, 2, 1, 3))
    vision = vlm.config.vision_config
    per_tile = (vision.image_size // vision.patch_size) ** 2 + 1
    return CrossStates(tuple(keys), tuple(values), mask[0], per_tile)


def forward(vlm: Any, inputs: mx.array, cache: Sequence[Any] | None, windows: CrossWindows | None) -> mx.array:
    """The language model's logits for ``inputs`` (``[rows, tokens]``) on ``cache`` (the self-attention layers'
    caches, in order), each row's cross-attention from ``windows`` (None: rows without images)."""
    from mlx_vlm.models.base import create_attention_mask

    lm = vlm.language_model
    text = lm.model
    crossing = set(vlm.config.text_config.cross_attention_layers)
    hidden = text.embed_tokens(inputs)
    caches = list(cache) if cache is not None else [None] * (len(text.layers) - len(crossing))
    mask = create_attention_mask(hidden, caches[0] if caches else None)
    at = 0
    nth = 0
    for idx, layer in enumerate(text.layers):
        if idx in crossing:
            if windows is not None:
                hidden = _cross_layer(vlm, layer, nth, hidden, windows)
            nth += 1
            continue
        hidden = _self_layer(layer, hidden, mask, caches[at])
        at += 1
    logits: mx.array = lm.lm_head(text.norm(hidden))
    return logits


def _cross_layer(vlm: Any, layer: Any, nth: int, hidden: mx.array, windows: CrossWindows) -> mx.array:
    """One cross-attention layer over the rows with images, grouped by their vision tokens' count; the others
    pass it unchanged."""
    groups: dict[int, list[int]] = {}
    for row, states in enumerate(windows.rows):
        if states is not None:
            groups.setdefault(states.length, []).append(row)
    out = hidden
    for rows in groups.values():
        members = [windows.rows[r] for r in rows]
        keys = _stack([s.keys[nth] for s in members if s is not None])
        values = _stack([s.values[nth] for s in members if s is not None])
        masks = [s.window(vlm, windows.starts[r], windows.length) for r, s in zip(rows, members) if s is not None]
        mask = rowmask = None
        if any(m is not None for m, _ in masks):
            length, tokens = windows.length, int(keys.shape[2])
            mask = _stack([m if m is not None else mx.zeros((1, 1, length, tokens)) for m, _ in masks])
            rowmask = _stack([r if r is not None else mx.ones((1, 1, length, 1), mx.bool_) for _, r in masks])
        whole = len(rows) == hidden.shape[0]
        index = mx.array(rows, dtype=mx.uint32)
        part = _apply(layer, hidden if whole else hidden[index], keys, values, mask, rowmask)
        if whole:
            return part
        out[index] = part
    return out


def _self_layer(layer: Any, hidden: mx.array, mask: Any, cache: Any) -> mx.array:
    """mlx-vlm's ``MllamaSelfAttentionDecoderLayer``, each row's rotary positions from its own cache offset:
    mlx-vlm rotates every row of a batch cache by their shared timeline (``cache_position_offset``), padding
    included, which is right for one sequence (the same int) and wrong for a left-padded row."""
    from mlx_lm.models.base import scaled_dot_product_attention

    attn = layer.self_attn
    x = layer.input_layernorm(hidden)
    rows, length, _ = x.shape
    queries = attn.q_proj(x).reshape(rows, length, attn.num_heads, -1).transpose(0, 2, 1, 3)
    keys = attn.k_proj(x).reshape(rows, length, attn.num_key_value_heads, -1).transpose(0, 2, 1, 3)
    values = attn.v_proj(x).reshape(rows, length, attn.num_key_value_heads, -1).transpose(0, 2, 1, 3)
    if cache is not None:
        queries = attn.rope(queries, offset=cache.offset)
        keys = attn.rope(keys, offset=cache.offset)
        keys, values = cache.update_and_fetch(keys, values)
    else:
        queries, keys = attn.rope(queries), attn.rope(keys)
    out = scaled_dot_product_attention(queries, keys, values, cache, scale=attn.scale, mask=mask)
    hidden = hidden + attn.o_proj(out.transpose(0, 2, 1, 3).reshape(rows, length, attn.hidden_size))
    result: mx.array = hidden + layer.mlp(layer.post_attention_layernorm(hidden))
    return result


def _stack(arrays: list[mx.array]) -> mx.array:
    return arrays[0] if len(arrays) == 1 else mx.concatenate(arrays, axis=0)


def _apply(layer: Any, hidden: mx.array, keys: mx.array, values: mx.array, mask: mx.array | None,
           rowmask: mx.array | None) -> mx.array:
    """mlx-vlm's ``MllamaCrossAttentionDecoderLayer`` with the keys and values given (not projected again)."""
    attn = layer.cross_attn
    residual = hidden
    x = layer.input_layernorm(hidden)
    rows, length, _ = x.shape
    query = attn.q_proj(x).reshape(rows, length, attn.num_heads, attn.head_dim).transpose(0, 2, 1, 3)
    out = mx.fast.scaled_dot_product_attention(attn.q_norm(query), keys, values, scale=attn.scale, mask=mask)
    out = attn.o_proj(out.transpose(0, 2, 1, 3).reshape(rows, length, attn.hidden_size))
    hidden = residual + mx.tanh(layer.cross_attn_attn_gate) * out
    residual = hidden
    mlp = layer.mlp(layer.post_attention_layernorm(hidden))
    if rowmask is not None:
        mlp = rowmask[:, 0] * mlp
    result: mx.array = residual + mx.tanh(layer.cross_attn_mlp_gate) * mlp
    return result
