"""The reference output of a Llama 3.2 Vision (``mllama``) row: ``mlx_vlm.stream_generate``, with one rule of
Hugging Face's that mlx-vlm 0.7.10 lacks — a sequence without images skips the cross-attention layers.

mlx-vlm runs those layers on a text-only prompt with keys and values split from the layer's own queries, unmasked
over the pass, so a token attends to the tokens after it in the same prefill chunk and the output depends on
``prefill_step_size`` (``test_mlx_vlm_text_rows_depend_on_its_prefill_chunks``): no batched, chunked or
prefix-cached engine could match it, and the model was not trained for it. flow skips the layers
(runtime/cross_attention.py); image rows are mlx-vlm's own, untouched.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any


@contextmanager
def text_rows_skip_cross_attention() -> Iterator[None]:
    """mlx-vlm's mllama cross-attention decoder layers pass a sequence without images through unchanged."""
    from mlx_vlm.models.mllama import language

    layer = language.MllamaCrossAttentionDecoderLayer
    original = layer.__call__

    def call(self: Any, hidden_states: Any, cross_attention_states: Any = None, *args: Any, **kwargs: Any) -> Any:
        if cross_attention_states is None:
            return hidden_states
        return original(self, hidden_states, cross_attention_states, *args, **kwargs)

    layer.__call__ = call  # type: ignore[method-assign]
    try:
        yield
    finally:
        layer.__call__ = original  # type: ignore[method-assign]
