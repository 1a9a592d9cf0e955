"""The model's forward passes, as every phase of a step runs them.

One pass runs one window of tokens per row on a cache (a sequence's own, a group's or the decode batch's): each
row with its sequence's LoRA adapters (routed just before the pass), a vision prompt's chunk with its input
embeddings (its images' features where they sit), and — when the model's own MTP layers draft — the final
hidden states those layers draft from, out of the same pass. After a pass the live KV is quantized once long
enough (when the model serves it quantized), as mlx-lm does.

Never imports the engine, the prefix cache or trio.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import mlx.core as mx

from runtime.adapters import Adapter, AdapterSet
from runtime.mtp import MTPDrafter
from runtime.quantized_kv import KVQuantizer


class ModelPasses:
    def __init__(self, model: Any, adapters: AdapterSet, drafter: Any, quantizer: KVQuantizer | None) -> None:
        self.model = model
        self.adapters = adapters
        self.mtp = drafter if isinstance(drafter, MTPDrafter) else None
        self.quantizer = quantizer

    def run(self, window: mx.array, cache: list[Any], adapters: Iterable[tuple[Adapter, ...]],
            embeddings: mx.array | None = None) -> tuple[mx.array, mx.array | None]:
        """The model on ``window`` (``[rows, tokens]``): its logits and, when the MTP layers draft (and the window
        is tokens, not a vision chunk's embeddings), the final hidden states they draft from."""
        if self.adapters:
            self.adapters.route(list(adapters))
        if embeddings is not None:
            with_images: mx.array = self.model(window, cache=cache, input_embeddings=embeddings)
            return with_images, None
        if self.mtp is not None:
            return self.mtp.forward(window, cache)
        logits: mx.array = self.model(window, cache=cache)
        return logits, None

    def quantize(self, cache: list[Any]) -> None:
        """After a forward pass (as mlx-lm does): quantize the cache once it is long enough (when set)."""
        if self.quantizer is not None:
            self.quantizer.apply(cache)
