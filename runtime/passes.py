"""The model's forward passes, as every phase of a step runs them.

One pass runs one window of tokens per row on a cache (a sequence's own, a group's or the decode batch's): each
row with its sequence's LoRA adapters (routed just before the pass), a vision prompt's chunk with its input
embeddings (its images' features where they sit), and — when the model's own MTP layers draft — the final
hidden states those layers draft from, out of the same pass. After a pass the live KV is quantized once long
enough (when the model serves it quantized), as mlx-lm does.

A vision model whose language model takes 3-D positions (M-RoPE: Qwen2-VL, Qwen2.5-VL, Qwen3-VL) gets every
row's positions with every pass (:meth:`ModelPasses.positions`): each row's own, from the
:class:`runtime.sequence.RopePositions` made from its prompt and images at its first pass — never a position
state kept on the model, which serves one sequence in mlx-vlm and every row of the batch here. A vision model that
reads images by cross-attention (Llama 3.2 Vision) gets its rows' cross-attention windows the same way
(:class:`runtime.cross_attention.CrossWindows`: each row's own keys, values and prompt mask, and its window's start).

Never imports the engine, the prefix cache or trio.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import mlx.core as mx

from runtime.adapters import Adapter, AdapterSet
from runtime.cross_attention import CrossWindows
from runtime.mtp import MTPDrafter
from runtime.quantized_kv import KVQuantizer
from runtime.sequence import RopePositions
from runtime.sequence import Sequence as Row


class ModelPasses:
    def __init__(self, model: Any, adapters: AdapterSet, drafter: Any, quantizer: KVQuantizer | None) -> None:
        self.model = model  # sets mrope and cross (read on every pass)
        self.adapters = adapters
        self.mtp = drafter if isinstance(drafter, MTPDrafter) else None
        self.quantizer = quantizer

    def run(self, window: mx.array, cache: list[Any], adapters: Iterable[tuple[Adapter, ...]],
            embeddings: mx.array | None = None,
            positions: mx.array | CrossWindows | None = None) -> tuple[mx.array, mx.array | None]:
        """The model on ``window`` (``[rows, tokens]``): its logits and, when the MTP layers draft (and the window
        is tokens, not a vision chunk's embeddings), the final hidden states they draft from. ``positions``: what
        the rows bring to every pass (:meth:`positions`): an M-RoPE model's 3-D positions, a cross-attention
        model's windows."""
        if self.adapters:
            self.adapters.route(list(adapters))
        if positions is not None:
            with_positions: mx.array = self.model(window, cache=cache, input_embeddings=embeddings,
                                                  positions=positions)
            return with_positions, None
        if embeddings is not None:
            with_images: mx.array = self.model(window, cache=cache, input_embeddings=embeddings)
            return with_images, None
        if self.mtp is not None:
            return self.mtp.forward(window, cache)
        logits: mx.array = self.model(window, cache=cache)
        return logits, None

    @property
    def model(self) -> Any:
        return self._model

    @model.setter
    def model(self, model: Any) -> None:
        self._model = model
        # Read once, not per pass: an attribute an mlx Module lacks costs a failed lookup through its dict.
        self.mrope = bool(getattr(model, "mrope", False))  # it takes 3-D (M-RoPE) positions with every pass
        self.cross = bool(getattr(model, "cross", False))  # it reads images by cross-attention (rows bring states)

    def positions(self, rows: Sequence[Row], starts: Sequence[int], length: int) -> mx.array | CrossWindows | None:
        """What the rows of a pass over ``length`` tokens per row (row ``i`` from its index ``starts[i]`` on) bring
        to it: an M-RoPE model's 3-D positions (``[3, rows, length]``); a cross-attention model's windows (None when
        no row has images); None for a model with ordinary positions (they come from its caches' offsets)."""
        if self.cross:
            if all(row.cross is None for row in rows):
                return None
            return CrossWindows(tuple(row.cross for row in rows), tuple(starts), length)
        if not self.mrope:
            return None
        ropes = [self.rope(row) for row in rows]
        if all(r.prompt is None or start >= r.prompt.shape[1] for r, start in zip(ropes, starts)):
            # Decoding (and text prompts): every row at its index plus its delta, one small array for the batch.
            first = mx.array([start + r.delta for r, start in zip(ropes, starts)], dtype=mx.int32)
            grid = first[:, None] + mx.arange(length, dtype=mx.int32)[None]
            return mx.broadcast_to(grid[None], (3, len(ropes), length))
        return mx.stack([r.window(start, length) for r, start in zip(ropes, starts)], axis=1)

    def decode_positions(self, rows: Sequence[Row], length: int) -> mx.array | CrossWindows | None:
        """:meth:`positions` for a decode pass: each row's window from its next index on (its prompt and the tokens
        fed back so far). Nothing is computed for a model with ordinary positions (every step, every row)."""
        if not (self.mrope or self.cross):
            return None
        return self.positions(rows, [len(r.prompt) + len(r.fed) for r in rows], length)

    def rope(self, row: Row) -> RopePositions:
        """The row's 3-D positions, made from its prompt and images on first use (an M-RoPE model only)."""
        if row.rope is None:
            prompt, delta = self.model.rope_index(row.prompt, row.images)
            row.rope = RopePositions(prompt, delta)
        return row.rope

    def quantize(self, cache: list[Any]) -> None:
        """After a forward pass (as mlx-lm does): quantize the cache once it is long enough (when set)."""
        if self.quantizer is not None:
            self.quantizer.apply(cache)
