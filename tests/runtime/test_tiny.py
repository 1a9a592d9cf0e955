"""Tests for runtime.tiny: offline random-weight models of real mlx-lm architectures."""

from __future__ import annotations

import os

# Set before mlx_lm/huggingface_hub are imported: they read it at import time.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import json
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx_lm
import pytest

import runtime.tiny.build as tiny_build
from runtime.tiny import (
    PRESETS,
    SMOKE_TEST_LABEL,
    TinySpec,
    build_tiny_model,
    ensure_tiny_model,
    is_smoke_test_model,
)

TINY = ("tiny-qwen3", "tiny-llama", "tiny-gemma3")
ROUND_TRIP = "Hello, café 日本語 🎉"

EXPECTED_PROMPT = {
    "tiny-qwen3": "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n",
    "tiny-llama": (
        "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\n"
        "Cutting Knowledge Date: December 2023\nToday Date: 26 Jul 2024\n\n<|eot_id|>"
        "<|start_header_id|>user<|end_header_id|>\n\nhi<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\n"
    ),
    "tiny-gemma3": "<bos><start_of_turn>user\nhi<end_of_turn>\n<start_of_turn>model\n",
}
EXPECTED_STOPS = {
    "tiny-qwen3": {"<|im_end|>", "<|endoftext|>"},
    "tiny-llama": {"<|eot_id|>", "<|eom_id|>", "<|end_of_text|>"},
    "tiny-gemma3": {"<end_of_turn>", "<eos>"},
}
MODEL_TYPE = {"tiny-qwen3": "qwen3", "tiny-llama": "llama", "tiny-gemma3": "gemma3_text"}


@pytest.fixture(scope="module")
def builds(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, Path]]:
    """Each tiny preset built twice from scratch, in separate directories."""
    root = tmp_path_factory.mktemp("tiny")
    return {
        name: (build_tiny_model(root / "a" / name, PRESETS[name]), build_tiny_model(root / "b" / name, PRESETS[name]))
        for name in TINY
    }


@pytest.fixture(scope="module")
def loaded(builds: dict[str, tuple[Path, Path]]) -> dict[str, tuple[Any, Any]]:
    return {name: mlx_lm.load(str(paths[0])) for name, paths in builds.items()}


def _config(path: Path) -> dict[str, Any]:
    return json.loads((path / "config.json").read_text())


# --- spec and presets -------------------------------------------------------


def test_presets() -> None:
    assert set(TINY) | {"bench-80m"} <= set(PRESETS)
    assert PRESETS["tiny-qwen3"] == TinySpec()
    assert PRESETS["tiny-llama"].arch == "llama"
    assert PRESETS["tiny-gemma3"].arch == "gemma3"


def test_bench_80m_parameter_count() -> None:
    s = PRESETS["bench-80m"]
    assert (s.arch, s.dtype, s.vocab_size) == ("qwen3", "float32", 8192)
    head_dim = s.hidden_size // s.num_heads
    attention = s.hidden_size * head_dim * (2 * s.num_heads + 2 * s.num_kv_heads) + 2 * head_dim
    mlp = 3 * s.hidden_size * s.intermediate_size
    per_layer = attention + mlp + 2 * s.hidden_size
    # qwen3 is built with an untied lm_head, so embeddings count twice.
    total = s.num_layers * per_layer + 2 * s.vocab_size * s.hidden_size + s.hidden_size
    assert 75e6 < total < 95e6, total


@pytest.mark.skipif(not os.environ.get("FLOW_TEST_BENCH"), reason="set FLOW_TEST_BENCH=1 to build bench-80m")
def test_bench_80m_build(tmp_path: Path) -> None:
    path = build_tiny_model(tmp_path / "bench", PRESETS["bench-80m"])
    weights = mx.load(str(path / "model.safetensors"))
    assert 75e6 < sum(w.size for w in weights.values()) < 95e6
    assert {w.dtype for w in weights.values()} == {mx.float32}


def test_cache_key() -> None:
    key = TinySpec().cache_key()
    assert len(key) == 12 and int(key, 16) >= 0
    assert TinySpec(arch="qwen3", seed=0).cache_key() == key
    assert TinySpec(seed=1).cache_key() != key
    assert TinySpec(dtype="bfloat16").cache_key() != key
    assert len({spec.cache_key() for spec in PRESETS.values()}) == len(PRESETS)


@pytest.mark.parametrize(
    "bad",
    [
        {"arch": "gpt2"},
        {"dtype": "int8"},
        {"hidden_size": 65},
        {"num_kv_heads": 3},
        {"num_kv_heads": 0},
        {"vocab_size": 100},
    ],
)
def test_invalid_spec(bad: dict[str, Any]) -> None:
    with pytest.raises(ValueError):
        TinySpec(**bad)


# --- the built checkpoints ----------------------------------------------------


@pytest.mark.parametrize("name", TINY)
def test_files_and_marker(builds: dict[str, tuple[Path, Path]], name: str) -> None:
    path = builds[name][0]
    for f in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
              "special_tokens_map.json", "generation_config.json", "README.md"):
        assert (path / f).is_file(), f
    config = _config(path)
    assert config["model_type"] == MODEL_TYPE[name]
    assert isinstance(config["architectures"], list) and config["architectures"][0].endswith("ForCausalLM")
    assert config["flow_smoke_test"] is True
    assert SMOKE_TEST_LABEL in (path / "README.md").read_text()
    assert "chat_template" in json.loads((path / "tokenizer_config.json").read_text())
    assert is_smoke_test_model(path)
    # No staging directories are left next to the build.
    assert sorted(p.name for p in path.parent.iterdir()) == sorted(TINY)


def test_is_smoke_test_model_negative(tmp_path: Path) -> None:
    assert not is_smoke_test_model(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen3"}))
    assert not is_smoke_test_model(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    assert not is_smoke_test_model(tmp_path)


@pytest.mark.parametrize("name", TINY)
def test_deterministic_builds(builds: dict[str, tuple[Path, Path]], name: str) -> None:
    a, b = builds[name]
    for f in sorted(p.name for p in a.iterdir()):
        assert (a / f).read_bytes() == (b / f).read_bytes(), f


@pytest.mark.parametrize("name", TINY)
def test_chat_template(loaded: dict[str, tuple[Any, Any]], name: str) -> None:
    _, tokenizer = loaded[name]
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "hi"}], add_generation_prompt=True, tokenize=False
    )
    assert prompt == EXPECTED_PROMPT[name]


@pytest.mark.parametrize("name", TINY)
def test_tokenizer(loaded: dict[str, tuple[Any, Any]], builds: dict[str, tuple[Path, Path]], name: str) -> None:
    _, tokenizer = loaded[name]
    ids = tokenizer.encode(ROUND_TRIP, add_special_tokens=False)
    assert tokenizer.decode(ids) == ROUND_TRIP
    assert tokenizer.decode(tokenizer.encode(ROUND_TRIP), skip_special_tokens=True) == ROUND_TRIP
    assert len(tokenizer.get_vocab()) == PRESETS[name].vocab_size == _config(builds[name][0])["vocab_size"]
    stop_ids = {tokenizer.convert_tokens_to_ids(t) for t in EXPECTED_STOPS[name]}
    assert set(tokenizer.eos_token_ids) == stop_ids
    # Markup tokens are single tokens, never split by BPE.
    for token in EXPECTED_STOPS[name]:
        assert len(tokenizer.encode(token, add_special_tokens=False)) == 1


def test_qwen3_thinking_and_tools(loaded: dict[str, tuple[Any, Any]]) -> None:
    _, tokenizer = loaded["tiny-qwen3"]
    think = tokenizer.convert_tokens_to_ids("<think>")
    # Like real Qwen3, <think> and <tool_call> are added but not "special".
    assert tokenizer.decode([think], skip_special_tokens=True) == "<think>"
    assert tokenizer.has_thinking and tokenizer.tool_parser is not None
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
    messages = [
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}
        ]},
        {"role": "tool", "content": "22C"},
        {"role": "tool", "content": "sunny"},
    ]
    text = tokenizer.apply_chat_template(
        messages, tools=tools, add_generation_prompt=True, tokenize=False, enable_thinking=False
    )
    assert '<tools>\n{"type": "function", "function": {"name": "get_weather"' in text
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call><|im_end|>' in text
    assert "<|im_start|>user\n<tool_response>\n22C\n</tool_response>\n<tool_response>\nsunny\n</tool_response><|im_end|>" in text
    assert text.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")


def test_llama_tools(loaded: dict[str, tuple[Any, Any]]) -> None:
    _, tokenizer = loaded["tiny-llama"]
    tools = [{"type": "function", "function": {"name": "lookup", "parameters": {"type": "object"}}}]
    messages = [
        {"role": "user", "content": "Find it"},
        {"role": "assistant", "tool_calls": [{"type": "function", "function": {"name": "lookup", "arguments": {"id": 1}}}]},
        {"role": "tool", "content": "found"},
    ]
    text = tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=True, tokenize=False)
    assert "Environment: ipython\n" in text
    assert '"name": "lookup"' in text and "Find it<|eot_id|>" in text
    assert '{"name": "lookup", "parameters": {"id": 1}}<|eot_id|>' in text
    assert "<|start_header_id|>ipython<|end_header_id|>\n\n" in text


def test_gemma3_template_rules(loaded: dict[str, tuple[Any, Any]]) -> None:
    _, tokenizer = loaded["tiny-gemma3"]
    text = tokenizer.apply_chat_template(
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"},
         {"role": "assistant", "content": "yo"}, {"role": "user", "content": "bye"}],
        add_generation_prompt=True,
        tokenize=False,
    )
    assert text == (
        "<bos><start_of_turn>user\nBe brief.\n\nhi<end_of_turn>\n<start_of_turn>model\nyo<end_of_turn>\n"
        "<start_of_turn>user\nbye<end_of_turn>\n<start_of_turn>model\n"
    )
    for bad in ([{"role": "user", "content": "a"}, {"role": "user", "content": "b"}],
                [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}, {"role": "tool", "content": "c"}]):
        with pytest.raises(Exception, match="alternate"):
            tokenizer.apply_chat_template(bad, tokenize=False)


@pytest.mark.parametrize("name", TINY)
def test_generate_deterministic(builds: dict[str, tuple[Path, Path]], loaded: dict[str, tuple[Any, Any]], name: str) -> None:
    model, tokenizer = loaded[name]
    prompt = EXPECTED_PROMPT[name]
    text = mlx_lm.generate(model, tokenizer, prompt, max_tokens=20)
    model_b, tokenizer_b = mlx_lm.load(str(builds[name][1]))
    assert mlx_lm.generate(model_b, tokenizer_b, prompt, max_tokens=20) == text
    tokens = [r.token for r in mlx_lm.stream_generate(model, tokenizer, prompt, max_tokens=20)]
    assert len(set(tokens)) > 2, tokens  # greedy output is not one repeated token


# --- ensure_tiny_model: caching, races, crashes -------------------------------


def _count_builds(monkeypatch: pytest.MonkeyPatch) -> list[TinySpec]:
    calls: list[TinySpec] = []
    original = tiny_build._write_model_files

    def counting(out: Path, spec: TinySpec) -> None:
        calls.append(spec)
        original(out, spec)

    monkeypatch.setattr(tiny_build, "_write_model_files", counting)
    return calls


def test_ensure_caches(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    calls = _count_builds(monkeypatch)
    monkeypatch.setenv("FLOW_CACHE_DIR", str(tmp_path))
    first = ensure_tiny_model("tiny-qwen3")
    assert first == tmp_path / "tiny-models" / f"tiny-qwen3-{PRESETS['tiny-qwen3'].cache_key()}"
    mtime = (first / "model.safetensors").stat().st_mtime_ns
    second = ensure_tiny_model(PRESETS["tiny-qwen3"], cache_dir=tmp_path)
    assert second == first and len(calls) == 1
    assert (first / "model.safetensors").stat().st_mtime_ns == mtime
    assert is_smoke_test_model(first)


def test_ensure_custom_spec_dtype(tmp_path: Path) -> None:
    spec = TinySpec(arch="llama", dtype="bfloat16", seed=7)
    path = ensure_tiny_model(spec, cache_dir=tmp_path)
    assert path.name == f"custom-llama-{spec.cache_key()}"
    weights = mx.load(str(path / "model.safetensors"))
    assert {w.dtype for w in weights.values()} == {mx.bfloat16}
    model, tokenizer = mlx_lm.load(str(path))
    assert isinstance(mlx_lm.generate(model, tokenizer, "Hello", max_tokens=3), str)


def test_ensure_unknown_name(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="presets"):
        ensure_tiny_model("tiny-nope", cache_dir=tmp_path)


def test_ensure_race_uses_winner(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    original = tiny_build._stage

    def stage_then_lose(dest: Path, spec: TinySpec) -> Path:
        # Another process finishes and renames its build in while we build ours.
        os.rename(original(dest, spec), dest)
        (dest / "winner").touch()
        return original(dest, spec)

    monkeypatch.setattr(tiny_build, "_stage", stage_then_lose)
    path = ensure_tiny_model("tiny-gemma3", cache_dir=tmp_path)
    assert (path / "winner").exists()
    assert [p.name for p in path.parent.iterdir()] == [path.name]  # loser's copy removed


def test_crashed_build_leaves_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def boom(spec: TinySpec, config: dict[str, Any]) -> dict[str, mx.array]:
        raise RuntimeError("crash mid-build")

    monkeypatch.setattr(tiny_build, "_random_weights", boom)
    with pytest.raises(RuntimeError):
        build_tiny_model(tmp_path / "m")
    with pytest.raises(RuntimeError):
        ensure_tiny_model("tiny-qwen3", cache_dir=tmp_path)
    assert [p.name for p in tmp_path.iterdir()] == ["tiny-models"]
    assert list((tmp_path / "tiny-models").iterdir()) == []


def test_build_replaces_existing(tmp_path: Path) -> None:
    dest = tmp_path / "m"
    dest.mkdir()
    (dest / "stale.txt").write_text("old")
    assert build_tiny_model(dest, TinySpec(seed=1)) == dest
    assert not (dest / "stale.txt").exists() and is_smoke_test_model(dest)
    assert [p.name for p in tmp_path.iterdir()] == ["m"]
