"""What an embedding model's files say about it: task, pooling, length limit, Matryoshka sizes."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from runtime.embedding_profile import Matryoshka, ProfileError, read_profile


def model_dir(tmp_path: Path, config: dict[str, Any], files: dict[str, Any] | None = None) -> Path:
    tmp_path.mkdir(parents=True, exist_ok=True)
    (tmp_path / "config.json").write_text(json.dumps(config))
    for name, content in (files or {}).items():
        target = tmp_path / name
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(content if isinstance(content, str) else json.dumps(content))
    return tmp_path


BERT = {"model_type": "bert", "architectures": ["BertModel"], "hidden_size": 384, "max_position_embeddings": 512}


def test_a_plain_encoder_pools_the_mean_and_cannot_be_shortened(tmp_path: Path) -> None:
    profile = read_profile(model_dir(tmp_path, BERT))
    assert (profile.task, profile.pooling, profile.normalized, profile.max_length, profile.dims) == (
        "embed", "mean", True, 512, 384)
    assert not profile.matryoshka.declared and not profile.matryoshka.accepts(128, 384)
    assert profile.matryoshka.accepts(384, 384)


def test_sentence_transformers_files_decide_pooling_and_length(tmp_path: Path) -> None:
    profile = read_profile(model_dir(
        tmp_path, BERT, {"sentence_bert_config.json": {"max_seq_length": 256},
                         "modules.json": [{"path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}],
                         "1_Pooling/config.json": {"pooling_mode_cls_token": True, "pooling_mode_mean_tokens": False}}))
    assert (profile.pooling, profile.builtin_pooling, profile.max_length) == ("cls", "mean", 256)


def test_an_unknown_pooling_is_refused_by_name(tmp_path: Path) -> None:
    path = model_dir(tmp_path, BERT, {"1_Pooling/config.json": {"pooling_mode_weightedmean_tokens": True}})
    with pytest.raises(ProfileError, match="pooling_mode_weightedmean_tokens"):
        read_profile(path)


def test_matryoshka_sizes_from_config_card_series_and_graph(tmp_path: Path) -> None:
    assert read_profile(model_dir(tmp_path / "a", {**BERT, "matryoshka_dimensions": [64, 128, 256]})
                        ).matryoshka == Matryoshka((64, 128, 256))
    card = "## Training\n\n```json\n{\n    \"loss\": \"MultipleNegativesRankingLoss\",\n" \
           "    \"matryoshka_dims\": [\n        384,\n        256,\n        128\n    ]\n}\n```\n"
    assert read_profile(model_dir(tmp_path / "b", BERT, {"README.md": card})).matryoshka == Matryoshka((128, 256, 384))
    qwen = read_profile(model_dir(tmp_path / "c", {"model_type": "qwen3", "architectures": ["Qwen3Model"],
                                                   "hidden_size": 1024}))
    assert qwen.pooling == "last_token" and qwen.matryoshka.accepts(32, 1024) and not qwen.matryoshka.accepts(31, 1024)
    assert qwen.matryoshka.describe(1024) == "any value from 32 to 1024"
    assert read_profile(tmp_path / "a", configured_dims=(16, 8)).matryoshka == Matryoshka((8, 16))


def test_a_sequence_classification_head_is_a_cross_encoder(tmp_path: Path) -> None:
    profile = read_profile(model_dir(tmp_path, {"model_type": "modernbert", "hidden_size": 768,
                                                "architectures": ["ModernBertForSequenceClassification"]}))
    assert (profile.task, profile.normalized, profile.dims) == ("score", False, None)
    assert not profile.matryoshka.declared
