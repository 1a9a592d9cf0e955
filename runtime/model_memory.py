"""A model's memory arithmetic from its config: one code path for serving and for ``flow fit``.

The engine reads the numbers from the loaded model's ``args`` (``runtime.engine``); ``flow fit`` and
``/library`` from ``config.json`` (``flow.catalog.fit``). Both call :func:`kv_bytes_per_token` and
:func:`context_length`, and the admission ceiling a model resource applies (``kv_budget_bytes``,
shown by ``/stats``) is :func:`default_kv_budget_bytes` unless the graph sets one.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from typing import Any

CONTEXT_KEYS = ("max_position_embeddings", "max_sequence_length", "n_positions", "seq_length")
DEFAULT_CONTEXT = 4096  # when the config names none


def context_length(config: Mapping[str, Any]) -> int:
    """The context a model was built for, from its config (or its ``text_config``)."""
    text = config.get("text_config") or {}
    for key in CONTEXT_KEYS:
        value = config.get(key) or text.get(key)
        if isinstance(value, int) and value > 0:
            return value
    return DEFAULT_CONTEXT


def default_kv_budget_bytes() -> int:
    """The KV memory one request may claim by default: half the machine's physical memory."""
    try:
        return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // 2)
    except (ValueError, OSError, AttributeError):
        return 8 << 30


def kv_bytes_per_token(get: Callable[[str], Any], layers_found: int = 0, itemsize: int = 2) -> int:
    """Layers × KV heads × head dim × 2 (keys and values) × bytes per element.

    ``get`` reads one config key (None when absent); ``layers_found``: the model's layer count when the
    config does not say; ``itemsize``: the activation dtype's bytes. An upper bound for models with
    sliding-window layers (their caches stop growing at the window)."""
    layers = get("num_hidden_layers") or layers_found
    heads = get("num_attention_heads") or 1
    kv_heads = get("num_key_value_heads") or heads
    head_dim = get("head_dim") or (get("hidden_size") or 0) // heads
    return int(layers * kv_heads * head_dim * 2 * itemsize)
