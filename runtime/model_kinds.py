"""A model's kind — text generation, vision, embeddings, audio — read from its files, once.

The kind decides the loader (mlx-lm, mlx-vlm, mlx-embeddings, mlx-audio) and which stages can use the
model. It is detected from what a model directory says about itself, most specific first:

* a sentence-transformers layout (``modules.json``, ``config_sentence_transformers.json``) or a
  sequence-classification head (a cross-encoder): **embeddings**;
* an audio model type or architecture (Whisper, speech-to-text, text-to-speech): **audio**;
* a vision tower (``vision_config``, image tokens) or a known vision-language type: **vision**;
* an encoder-only type (BERT and its kin) or a bare decoder without a language-model head
  (``Qwen3Model``): **embeddings**;
* anything else: **text** (what mlx-lm loads).

A graph may say otherwise (``kind = "embeddings"`` on the model resource); detection never loads weights.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any, Literal

ModelKind = Literal["text", "vision", "embeddings", "audio"]
KINDS: tuple[ModelKind, ...] = ("text", "vision", "embeddings", "audio")

SENTENCE_TRANSFORMERS_FILES = frozenset({"modules.json", "config_sentence_transformers.json"})
ENCODER_TYPES = frozenset({"bert", "roberta", "xlm-roberta", "xlm_roberta", "modernbert", "nomic_bert",
                           "distilbert", "electra", "mpnet", "deberta", "deberta-v2", "new", "jina_bert"})
AUDIO_TYPES = frozenset({"whisper", "qwen2_audio", "voxtral", "parakeet", "wav2vec2", "hubert", "kokoro", "csm",
                         "dia", "outetts", "spark", "sesame", "bark", "speecht5", "encodec", "mimi", "soprano",
                         "kitten_tts", "moonshine", "qwen3_tts", "qwen3_asr", "chatterbox", "vibevoice", "voxcpm",
                         "melotts", "pocket_tts"})
VISION_TYPES = frozenset({"llava", "llava_next", "llava-qwen2", "qwen2_vl", "qwen2_5_vl", "qwen3_vl", "idefics2",
                          "idefics3", "smolvlm", "paligemma", "pixtral", "mistral3", "mllama", "llama4",
                          "gemma3n", "florence2", "molmo", "multi_modality", "deepseek_vl_v2", "internvl_chat",
                          "phi3_v", "aya_vision", "kimi_vl"})
AUDIO_ARCHITECTURE_MARKERS = ("Whisper", "ForSpeechSeq2Seq", "ForCTC", "ForTextToSpeech", "ForAudio")


def detect_kind(config: dict[str, Any], files: Iterable[str] = ()) -> ModelKind:
    """The kind of the model whose ``config.json`` is ``config`` and whose directory holds ``files``."""
    names = set(files)
    model_type = str(config.get("model_type", "")).lower()
    architectures = [str(a) for a in config.get("architectures") or []]
    if names & SENTENCE_TRANSFORMERS_FILES or any(a.endswith("ForSequenceClassification") for a in architectures):
        return "embeddings"
    if model_type in AUDIO_TYPES or any(m in a for a in architectures for m in AUDIO_ARCHITECTURE_MARKERS):
        return "audio"
    if ("vision_config" in config or "image_token_index" in config or "image_token_id" in config
            or model_type in VISION_TYPES):
        return "vision"
    if model_type in ENCODER_TYPES:
        return "embeddings"
    if architectures and all(a.endswith("Model") and not a.endswith("ForCausalLM") for a in architectures):
        return "embeddings"  # a bare transformer without a language-model head: a decoder-style embedder
    return "text"


def detect_kind_of(path: Path) -> ModelKind:
    """The kind of the model in directory ``path`` (a missing or unreadable config.json: text, mlx-lm's
    loader then says what is wrong)."""
    try:
        config = json.loads((path / "config.json").read_text())
    except (OSError, ValueError):
        return "text"
    files = [p.name for p in path.iterdir()] if path.is_dir() else []
    return detect_kind(config if isinstance(config, dict) else {}, files)
