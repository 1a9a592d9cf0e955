"""The live quantized KV cache through the real server: ``kv_bits`` on the model resource, mlx-lm's tokens,
the prefix cache reused, a model that cannot take it refused at startup with a message naming the setting."""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from flow.builtins import compile_tables
from flow.serve.embedded import RunningServer, running_server
from flow.serve.server import first_error
from runtime.tiny import TinySpec, ensure_tiny_model
from tests.harness import tables_with_model, tables_with_prefix_cache

PROMPT = "The keeper climbed the stairs of the lighthouse, lit the lamp and watched the ships. " * 3
START = 16  # tokens of context from which the batch's KV is quantized: every prompt here passes it


@pytest.fixture(scope="module")
def wide_qwen3() -> Path:
    return ensure_tiny_model(TinySpec(num_heads=2, num_kv_heads=1))  # head dimension 32: a group fits


@pytest.fixture(scope="module")
def server(wide_qwen3: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    tables = tables_with_prefix_cache(wide_qwen3, tmp_path_factory.mktemp("kv"), 16)
    tables["resources"]["model"].update(kv_bits=8, quantized_kv_start=START)
    with running_server(compile_tables(tables, "default.toml (kv quantization test)")) as running:
        yield running


def mlx_lm_quantized(server: RunningServer, ids: list[int], max_tokens: int) -> str:
    from mlx_lm import generate

    loaded = server.server.models[0].require()
    return str(server.server.device.call(
        lambda: generate(loaded.model, loaded.tokenizer, prompt=ids, max_tokens=max_tokens, kv_bits=8,
                         kv_group_size=32, quantized_kv_start=START)))


def test_greedy_output_is_mlx_lm_quantized_output_and_a_repeat_is_cached(server: RunningServer) -> None:
    client = openai.OpenAI(base_url=server.url, api_key="unused", max_retries=0)
    ids = server.server.models[0].require().tokenizer.encode(PROMPT)
    expected = mlx_lm_quantized(server, ids, 20)
    for repeat in range(2):
        out = client.completions.create(model="tiny", prompt=ids, max_tokens=20, temperature=0)
        assert out.choices[0].text == expected
        assert out.usage is not None and out.usage.prompt_tokens == len(ids)
        cached = out.usage.prompt_tokens_details.cached_tokens if out.usage.prompt_tokens_details else 0
        assert (cached == len(ids) - 1) if repeat else (cached == 0)
    stats = httpx.get(server.base_url + "/stats", timeout=10).json()
    engine = stats["models"]["tiny"]["engine"]
    assert engine["kv_quantization"] == {"bits": 8, "group_size": 32, "start": START}


def test_a_model_that_cannot_keep_quantized_kv_stops_the_startup() -> None:
    from runtime.errors import ModelNotAvailable

    tables = tables_with_model(ensure_tiny_model("tiny-gemma3"), kv_bits=8)
    with pytest.raises(BaseException) as raised:
        with running_server(compile_tables(tables, "default.toml (kv quantization refused)")):
            pass
    error = first_error(raised.value)  # what `flow serve` prints before it exits
    assert isinstance(error, ModelNotAvailable)
    assert re.search(r"model tiny .*kv_bits = 8: this model cannot .*RotatingKVCache.*remove kv_bits", str(error))
