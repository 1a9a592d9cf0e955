"""The per-row LoRA arithmetic of runtime.adapters on a real mlx-lm model: a wrapped layer adds exactly
``scale · B(A x)`` of each row's adapters (padded ranks, stacks, rows without any), whichever path it takes."""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
import pytest
from mlx_lm.utils import load_model

from runtime.adapters import AdapterError, AdapterLinear, AdapterSet, load_adapter, read_adapter_files, same_base
from runtime.tiny.adapters import build_tiny_adapter

LAYER = "model.layers.0.self_attn.q_proj"


def test_each_row_gets_exactly_its_adapters_terms(tiny_llama: Path, tmp_path: Path) -> None:
    model, _ = load_model(tiny_llama)
    small = load_adapter("small", read_adapter_files(build_tiny_adapter(tiny_llama, tmp_path / "s", rank=2, seed=1)),
                         model)
    big = load_adapter("big", read_adapter_files(build_tiny_adapter(tiny_llama, tmp_path / "b", rank=8, seed=2,
                                                                     layout="peft")), model)
    adapters = AdapterSet(model)
    adapters.mount(small)
    adapters.mount(big)
    layer = dict(model.named_modules())[LAYER]
    assert isinstance(layer, AdapterLinear)
    x = mx.random.normal((4, 3, layer.base.weight.shape[1]), key=mx.random.key(0))

    def term(adapter: object, row: mx.array) -> mx.array:
        assert adapter in (small, big)
        a, b = small.factors[LAYER] if adapter is small else big.factors[LAYER]
        scale = small.scale if adapter is small else big.scale
        return scale * ((row @ a) @ b)

    rows = [(), (small,), (big,), (small, big)]
    adapters.route(rows)  # mixed: the gathered path
    mixed = layer(x)
    for i, used in enumerate(rows):
        expected = layer.base(x[i : i + 1])
        for adapter in used:
            expected = expected + term(adapter, x[i : i + 1])
        assert mx.allclose(mixed[i : i + 1], expected, atol=1e-5), used
    adapters.route([(small, big)] * 4)  # uniform: mlx-lm's dense path
    assert mx.allclose(layer(x)[3], mixed[3], atol=1e-5)
    adapters.route([()] * 4)  # no adapter: the base layer alone, exactly
    assert mx.array_equal(layer(x), layer.base(x))
    adapters.unmount(small)
    adapters.route([(big,), ()] * 2)
    assert mx.allclose(layer(x)[2], mixed[2], atol=1e-5)


def test_a_model_that_does_not_match_is_named(tiny_llama: Path, tmp_path: Path) -> None:
    model, _ = load_model(tiny_llama)
    files = read_adapter_files(build_tiny_adapter(tiny_llama, tmp_path / "a", seed=1))
    first = model.layers[0].self_attn
    first.q_proj = first.k_proj  # another shape where the adapter expects q_proj's
    with pytest.raises(AdapterError, match="q_proj: factors"):
        load_adapter("a", files, model)


@pytest.mark.parametrize(("trained_on", "served", "same"), [
    ("mlx-community/Qwen3-0.6B-4bit", ["/models/qwen3-0.6b"], True),
    ("Qwen/Qwen3-0.6B", ["mlx-community/Qwen3-0.6B-bf16"], True),
    ("Qwen/Qwen3-0.6B", ["mlx-community/Qwen3-1.7B-4bit"], False),
    ("meta-llama/Llama-3.2-1B-Instruct", ["llama-3.2-1b-instruct-q4_k_m"], True),
])
def test_base_model_names_compare_without_owner_case_or_quantization(trained_on: str, served: list[str],
                                                                    same: bool) -> None:
    assert same_base(trained_on, served) is same
