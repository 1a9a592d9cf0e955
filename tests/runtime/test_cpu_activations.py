"""Flow's CPU GELU: as accurate as MLX's own functions, and a model's vectors unchanged by the swap."""

from __future__ import annotations

import math

import mlx.core as mx
from mlx.nn.layers.activations import GELU
import numpy as np
import pytest

from runtime.cpu_activations import FastGELU, erf, tanh, use_fast_gelu
from runtime.tiny import ensure_tiny_model


def test_erf_and_tanh_are_float32_accurate_everywhere() -> None:
    xs = np.linspace(-12, 12, 200_001, dtype=np.float32)
    exact_erf = np.array([math.erf(float(x)) for x in xs])
    exact_tanh = np.tanh(xs.astype(np.float64))
    assert np.abs(np.array(erf(mx.array(xs))) - exact_erf).max() < 5e-7
    assert np.abs(np.array(tanh(mx.array(xs))) - exact_tanh).max() < 5e-7
    # MLX's own functions, for scale: the swap must not be less accurate than what it replaces
    assert np.abs(np.array(mx.erf(mx.array(xs))) - exact_erf).max() > 1e-7


@pytest.mark.parametrize("approx", ["none", "precise", "tanh", "fast"])
def test_fast_gelu_computes_each_approximation_of_nn_gelu(approx: str) -> None:
    x = mx.random.normal((64, 512), key=mx.random.key(0)) * 4
    expected = np.array(GELU(approx)(x))  # type: ignore[no-untyped-call]
    got = np.array(FastGELU(approx)(x))
    assert np.abs(got - expected).max() < 2e-6


def test_a_bert_encoders_gelus_are_swapped_on_the_cpu_only() -> None:
    from mlx_embeddings.utils import load

    model, wrapper = load(str(ensure_tiny_model("tiny-bert")))
    ids = wrapper._tokenizer(["a short sentence", "and a second, longer one for the padding"], padding=True,
                             return_tensors="np")
    def vectors() -> np.ndarray:
        out = model(mx.array(ids["input_ids"]), attention_mask=mx.array(ids["attention_mask"]))
        return np.array(out.text_embeds)

    before = vectors()
    gelus = sum(type(m) is GELU for _, m in model.named_modules())
    assert gelus > 0
    assert use_fast_gelu(model, mx.Device(mx.gpu)) == 0  # on a GPU MLX's kernels stay
    assert sum(type(m) is GELU for _, m in model.named_modules()) == gelus
    assert use_fast_gelu(model, mx.Device(mx.cpu)) == gelus
    assert not any(type(m) is GELU for _, m in model.named_modules())
    assert sum(isinstance(m, FastGELU) for _, m in model.named_modules()) == gelus
    assert np.abs(vectors() - before).max() < 1e-6


def test_a_vision_towers_gelus_are_swapped_and_its_features_barely_move() -> None:
    """SigLIP-style towers (SmolVLM, Gemma 3) use nn.GELU modules: on the CPU flow's replace them."""
    from mlx_vlm.utils import load

    vlm, _ = load(str(ensure_tiny_model("bench-vlm")))
    tower = vlm.vision_tower
    size = vlm.config.vision_config.image_size
    pixels = mx.random.normal((1, size, size, 3), key=mx.random.key(0))

    def features() -> np.ndarray:
        out = tower(pixels)
        return np.array(out[0] if isinstance(out, tuple) else out)

    before = features()
    assert use_fast_gelu(vlm, mx.Device(mx.cpu)) > 0
    assert not any(type(m) is GELU for _, m in vlm.named_modules())
    after = features()
    assert np.abs(after - before).max() < 1e-4 * max(1.0, float(np.abs(before).max()))
