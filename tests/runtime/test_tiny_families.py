"""The families' tiny architectures (``runtime/tiny/archs.py``): byte-for-byte deterministic builds (their
mixtures of experts, biases, sinks and gated-delta decay rates included), the real architecture's
config and the vocabulary's own special tokens."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from mlx_lm.utils import load_tokenizer

from runtime.tiny import PRESETS, arch_info, build_tiny_model, ensure_tiny_model
from runtime.tiny.archs import FAMILY_ARCHS

FAMILY_PRESETS = {name: spec.arch for name, spec in PRESETS.items() if spec.arch in FAMILY_ARCHS or
                  spec.arch == "qwen3_next"}
ARCHS = {**FAMILY_ARCHS, "qwen3_next": arch_info("qwen3_next")}  # Qwen3's vocabulary on Qwen3-Next's architecture


def test_every_family_architecture_has_a_preset() -> None:
    assert set(FAMILY_PRESETS.values()) == set(ARCHS)


# biases and sinks; gated-delta parameters; MTP layers; Mamba-2 state parameters
@pytest.mark.parametrize("name", ["tiny-gpt-oss", "tiny-qwen3.5", "tiny-qwen3.5-mtp", "tiny-granite4"])
def test_deterministic_builds(tmp_path: Path, name: str) -> None:
    a, b = (build_tiny_model(tmp_path / side, PRESETS[name]) for side in ("a", "b"))
    for f in sorted(p.name for p in a.iterdir()):
        assert (a / f).read_bytes() == (b / f).read_bytes(), f


@pytest.mark.parametrize("name", sorted(FAMILY_PRESETS))
def test_config_and_special_tokens(name: str) -> None:
    info = ARCHS[FAMILY_PRESETS[name]]
    path = ensure_tiny_model(name)
    config = json.loads((path / "config.json").read_text())
    assert config["model_type"] == info.model_type and config["architectures"] == [info.architecture]
    tokenizer = load_tokenizer(path)
    for token in info.special:  # each a single token of the vocabulary, decoded back to itself
        ids = tokenizer.encode(token, add_special_tokens=False)
        assert len(ids) == 1 and tokenizer.decode(ids) == token, token
    # Hermes 3 ships named templates, which transformers reads as a mapping.
    assert tokenizer.chat_template == (dict(info.named_templates) if info.named_templates else info.chat_template)
