"""Random LoRA adapters for a local model, written in mlx-lm's or PEFT's layout: smoke tests and benchmarks of
adapter serving without a training run (a trained adapter has the same files; only its numbers differ)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Literal

import mlx.core as mx
from mlx.utils import tree_flatten

DEFAULT_KEYS = ("self_attn.q_proj", "self_attn.v_proj")


def build_tiny_adapter(model_dir: Path, dest: Path, *, rank: int = 4, scale: float = 2.0, num_layers: int = -1,
                       keys: tuple[str, ...] = DEFAULT_KEYS, seed: int = 0,
                       layout: Literal["mlx-lm", "peft"] = "mlx-lm") -> Path:
    """Write an adapter for the model in ``model_dir`` to ``dest``: ``mlx_lm.tuner``'s LoRA layers on the last
    ``num_layers`` blocks (-1: all) at ``keys``, with random factors (``lora_b`` too, so it changes the output)."""
    # mlx-lm takes seconds to import (it brings transformers): only a build of an adapter pays for it.
    from mlx_lm.tuner.utils import linear_to_lora_layers
    from mlx_lm.utils import load_model

    model, _ = load_model(Path(model_dir))
    blocks = len(model.layers)
    count = blocks if num_layers < 0 else num_layers
    mx.random.seed(seed)  # lora_a is drawn by linear_to_lora_layers: the same seed, the same adapter
    linear_to_lora_layers(model, count, {"rank": rank, "scale": scale, "dropout": 0.0, "keys": list(keys)})
    factors: dict[str, mx.array] = {}
    leaves: list[tuple[str, mx.array]] = tree_flatten(model.parameters())  # type: ignore[assignment]
    for name, value in leaves:
        if name.endswith(".lora_a"):
            factors[name] = value
        elif name.endswith(".lora_b"):
            factors[name] = 0.2 * mx.random.normal(value.shape) / rank  # zeros (mlx-lm's init) would change nothing
    dest = Path(dest)
    dest.mkdir(parents=True, exist_ok=True)
    config: dict[str, Any]
    if layout == "mlx-lm":
        config = {"fine_tune_type": "lora", "num_layers": count, "model": str(model_dir),
                  "lora_parameters": {"rank": rank, "scale": scale, "dropout": 0.0, "keys": list(keys)}}
        mx.save_safetensors(str(dest / "adapters.safetensors"), factors)
    else:
        peft: dict[str, mx.array] = {}
        for name, value in factors.items():
            module, end = name.rsplit(".", 1)
            peft[f"base_model.model.{module}.lora_{end[-1].upper()}.weight"] = value.T
        config = {"peft_type": "LORA", "r": rank, "lora_alpha": scale * rank, "base_model_name_or_path": str(model_dir),
                  "target_modules": sorted({k.rsplit(".", 1)[-1] for k in keys})}
        mx.save_safetensors(str(dest / "adapter_model.safetensors"), peft)
    (dest / "adapter_config.json").write_text(json.dumps(config, indent=2))
    return dest
