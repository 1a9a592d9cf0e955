"""Flow's CPU GELU: as accurate as MLX's own functions, and a model's vectors unchanged by the swap."""

from __future__ import annotations

import io
import math
import re

import mlx.core as mx
from mlx.nn.layers.activations import GELU
import numpy as np
import pytest

from runtime.cpu_activations import FastGELU, CompiledPerShape, erf, tanh, use_fast_gelu
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


@pytest.mark.parametrize("approx", ["none", "precise", "fast"])
def test_fast_gelu_saturates_exactly_and_passes_nan(approx: str) -> None:
    """Past the clamp Φ is exactly 0 or 1, as MLX's own GELU gives: −0 for a large negative input, not x·3e-8."""
    x = mx.array([-1e30, -1e6, -100.0, 100.0, 1e6, 1e30, 0.0, math.inf, math.nan])
    got = np.array(FastGELU(approx)(x))
    assert list(got[:7]) == [0.0, 0.0, 0.0, 100.0, 1e6, np.float32(1e30), 0.0]
    assert got[7] == math.inf and math.isnan(got[8])


@pytest.mark.parametrize("approx", ["none", "precise", "fast"])
def test_fast_gelu_is_two_fused_kernels(approx: str) -> None:
    """The clamp and the rest: MLX fuses each into one kernel (it fuses at most 11 operations deep, and the
    factored polynomials fit). Split further, a GELU costs 3-4x as much on the CPU."""
    x = mx.random.normal((4, 8), key=mx.random.key(1))
    mx.eval(x)
    dot = io.StringIO()
    mx.export_to_dot(dot, FastGELU(approx)(x))
    kernels = re.findall(r'label ="(Compiled\w*)"', dot.getvalue())
    assert len(kernels) == 2, kernels
    assert not re.findall(r'label ="Broadcast"', dot.getvalue())  # no constant read through a strided input


def test_traces_per_shape_are_bounded_and_stay_correct() -> None:
    gelu = CompiledPerShape(lambda x: x * 2.0, limit=3)
    for rows in range(1, 8):
        x = mx.ones((rows, 5))
        assert np.array(gelu(x)).tolist() == [[2.0] * 5] * rows
        assert len(gelu._shapes) <= 3


@pytest.mark.parametrize("dtype", [mx.float16, mx.bfloat16])
@pytest.mark.parametrize("approx", ["none", "precise", "fast"])
def test_fast_gelu_of_a_half_precision_model_is_computed_in_float32(approx: str, dtype: mx.Dtype) -> None:
    """A float16 or bfloat16 model keeps its dtype, and its GELU is as close to the exact one as the dtype allows:
    at least as close as MLX's own GELU in that dtype (in float16, the factors' products would overflow)."""
    x = mx.array(np.linspace(-8, 8, 20_001, dtype=np.float32)).astype(dtype)
    exact = np.array(GELU(approx)(x.astype(mx.float32)))  # type: ignore[no-untyped-call]
    own = np.array(GELU(approx)(x).astype(mx.float32))  # type: ignore[no-untyped-call]
    out = FastGELU(approx)(x)
    assert out.dtype == dtype
    got = np.array(out.astype(mx.float32))
    assert np.isfinite(got).all()
    assert np.abs(got - exact).max() <= np.abs(own - exact).max()
