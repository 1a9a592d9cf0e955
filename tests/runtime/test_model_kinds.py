"""A model's kind from its files: the loader and the stages that can serve it follow it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from runtime.model_kinds import detect_kind, detect_kind_of


@pytest.mark.parametrize(("config", "files", "kind"), [
    ({"model_type": "qwen3", "architectures": ["Qwen3ForCausalLM"]}, [], "text"),
    ({"model_type": "llama"}, [], "text"),
    ({"model_type": "bert", "architectures": ["BertModel"]}, [], "embeddings"),
    ({"model_type": "xlm-roberta", "architectures": ["XLMRobertaForSequenceClassification"]}, [], "embeddings"),
    ({"model_type": "qwen3", "architectures": ["Qwen3Model"]}, [], "embeddings"),  # Qwen3-Embedding
    ({"model_type": "qwen3", "architectures": ["Qwen3ForCausalLM"]}, ["modules.json"], "embeddings"),
    ({"model_type": "whisper", "architectures": ["WhisperForConditionalGeneration"]}, [], "audio"),
    ({"model_type": "gemma3", "architectures": ["Gemma3ForConditionalGeneration"], "vision_config": {}}, [],
     "vision"),
    ({"model_type": "qwen2_5_vl"}, [], "vision"),
    ({"model_type": "kokoro"}, [], "audio"),
])
def test_detect_kind(config: dict[str, object], files: list[str], kind: str) -> None:
    assert detect_kind(config, files) == kind


def test_detect_kind_of_a_directory(tmp_path: Path) -> None:
    assert detect_kind_of(tmp_path) == "text"  # no config: mlx-lm's loader says what is missing
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "bert"}))
    assert detect_kind_of(tmp_path) == "embeddings"


def test_the_tiny_chat_models_are_text(tiny_qwen3: Path, tiny_llama: Path) -> None:
    assert detect_kind_of(tiny_qwen3) == detect_kind_of(tiny_llama) == "text"
