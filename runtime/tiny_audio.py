"""Tiny random-weight audio models, built locally as mlx-audio loads real ones (see :mod:`runtime.tiny`).

A tiny Soprano is mlx-audio's ``soprano`` text-to-speech architecture — a Qwen3 language model whose hidden
states a Vocos decoder turns into 32 kHz audio, 2,048 samples per generated token — with a small language
model and a byte-level BPE vocabulary holding Soprano's ``[STOP]``, ``[TEXT]`` and ``[START]`` tokens. Its
random weights rarely pick ``[STOP]``: a sentence's speech is as long as the token cap allows.

A tiny Whisper is the real architecture (mlx-audio's ``whisper`` model type) at a small width, with a
multilingual Whisper vocabulary laid out as OpenAI's checkpoints lay it out: text tokens, ``<|endoftext|>``,
``<|startoftranscript|>``, the 99 language tokens, the task tokens, ``<|notimestamps|>``, then the 1,501
timestamp tokens ``<|0.00|>`` … ``<|30.00|>`` — 51,865 ids, so mlx-audio treats it as multilingual (language
detection, translation). The text part is a small byte-level BPE, padded with word-like filler tokens
(`` w123``) up to Whisper's 50,257 text ids: random weights pick those often, and they decode to words.
The encoder keeps Whisper's fixed input (80 mel bins, 1,500 positions for 30 seconds); the decoder reads 64
positions (a window decodes at most 32 tokens), so a random-weight transcript stays quick.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

import mlx.core as mx
from mlx.utils import tree_flatten
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers

if TYPE_CHECKING:
    from runtime.tiny import TinySpec

WHISPER_TEXT_TOKENS = 50257  # ids below <|endoftext|> in OpenAI's multilingual vocabulary
WHISPER_BPE_TOKENS = 600  # trained byte-level BPE part; the rest of the text ids are filler words
TIMESTAMPS = 1501  # <|0.00|> … <|30.00|>, every 20 ms


def _whisper_specials() -> list[str]:
    from mlx_audio.stt.models.whisper.tokenizer import LANGUAGES

    return ["<|endoftext|>", "<|startoftranscript|>", *(f"<|{code}|>" for code in LANGUAGES), "<|translate|>",
            "<|transcribe|>", "<|startoflm|>", "<|startofprev|>", "<|nospeech|>", "<|notimestamps|>"]


def whisper_tokenizer() -> Tokenizer:
    """A Whisper-layout vocabulary (see the module docstring). The filler words are plain vocabulary entries
    (``Ġw123``: no merge reaches them, byte-level decoding gives `` w123``), not added tokens, so the tokenizer
    loads as fast as a real one."""
    from runtime.tiny import _CORPUS, _pseudo_text

    trained = Tokenizer(models.BPE())
    trained.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(vocab_size=WHISPER_BPE_TOKENS, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    trained.train_from_iterator(_CORPUS.splitlines() + _pseudo_text(3000), trainer=trainer)
    model = json.loads(trained.to_str())["model"]
    vocab: dict[str, int] = dict(model["vocab"])
    vocab.update({f"\u0120w{i}": i for i in range(len(vocab), WHISPER_TEXT_TOKENS)})
    pairs = [m.split(" ", 1) if isinstance(m, str) else m for m in model["merges"]]
    merges: list[tuple[str, str]] = [(str(a), str(b)) for a, b in pairs]
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in _whisper_specials()])
    tok.add_tokens([AddedToken(f"<|{i * 0.02:.2f}|>", special=False, normalized=False) for i in range(TIMESTAMPS)])
    return tok


def write_whisper_files(out: Path, spec: TinySpec) -> None:
    """A Whisper checkpoint in mlx-audio's layout (config.json, model.safetensors, tokenizer and feature
    extractor files), random weights."""
    from mlx_audio.stt.models.whisper.whisper import Model, ModelDimensions

    tok = whisper_tokenizer()
    n_vocab = tok.get_vocab_size()
    dims = {"n_mels": 80, "n_audio_ctx": 1500, "n_audio_state": spec.hidden_size, "n_audio_head": spec.num_heads,
            "n_audio_layer": spec.num_layers, "n_vocab": n_vocab, "n_text_ctx": 64, "n_text_state": spec.hidden_size,
            "n_text_head": spec.num_heads, "n_text_layer": spec.num_layers}
    model = Model(ModelDimensions(**dims), dtype=mx.float32)
    params = dict(tree_flatten(model.parameters()))
    names = sorted(params)
    keys = mx.random.split(mx.random.key(spec.seed), len(names))
    weights = {name: (mx.random.normal(params[name].shape, key=keys[i]) * 0.02 if params[name].ndim >= 2
                      else params[name]).astype(getattr(mx, spec.dtype)) for i, name in enumerate(names)}
    weights.pop("encoder._positional_embedding", None)  # sinusoids, computed by the model
    mx.eval(weights)
    mx.save_safetensors(str(out / "model.safetensors"), weights, metadata={"format": "mlx"})
    tok.save(str(out / "tokenizer.json"))
    eot = "<|endoftext|>"

    def dump(name: str, obj: Any) -> None:
        (out / name).write_text(json.dumps(obj, indent=1) + "\n", encoding="utf-8")

    dump("config.json", {"model_type": "whisper", **dims, "flow_smoke_test": True})
    dump("generation_config.json", {"is_multilingual": True, "begin_suppress_tokens": [220, n_vocab - TIMESTAMPS - 1]})
    dump("tokenizer_config.json", {"tokenizer_class": "WhisperTokenizer", "bos_token": eot, "eos_token": eot,
                                   "unk_token": eot, "pad_token": eot, "model_max_length": 1024,
                                   "processor_class": "WhisperProcessor"})
    dump("preprocessor_config.json", {
        "feature_extractor_type": "WhisperFeatureExtractor", "feature_size": 80, "sampling_rate": 16000,
        "hop_length": 160, "chunk_length": 30, "n_fft": 400, "n_samples": 480000, "nb_max_frames": 3000,
        "padding_side": "right", "padding_value": 0.0, "return_attention_mask": False,
        "processor_class": "WhisperProcessor"})
    from runtime.tiny import SMOKE_TEST_LABEL

    (out / "README.md").write_text(f"# {SMOKE_TEST_LABEL}\n\nA `whisper` speech-to-text model with random weights "
                                   f"(cache key `{spec.cache_key()}`): its transcripts mean nothing.\n",
                                   encoding="utf-8")


SOPRANO_SPECIALS = ("[STOP]", "[TEXT]", "[START]")


def write_soprano_files(out: Path, spec: TinySpec) -> None:
    """A Soprano checkpoint in mlx-audio's layout (config.json, model.safetensors, tokenizer), random weights."""
    from mlx_audio.tts.models.soprano.soprano import Model, ModelConfig

    from runtime.tiny import _CORPUS, SMOKE_TEST_LABEL, _pseudo_text

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=spec.vocab_size, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  special_tokens=list(SOPRANO_SPECIALS), show_progress=False)
    tok.train_from_iterator(_CORPUS.splitlines() + _pseudo_text(3000), trainer=trainer)
    config: dict[str, Any] = {
        "model_type": "soprano", "architectures": ["Qwen3ForCausalLM"], "hidden_size": spec.hidden_size,
        "num_hidden_layers": spec.num_layers, "intermediate_size": spec.intermediate_size,
        "num_attention_heads": spec.num_heads, "num_key_value_heads": spec.num_kv_heads, "head_dim": spec.head_dim,
        "rms_norm_eps": 1e-6, "vocab_size": tok.get_vocab_size(), "max_position_embeddings": 2048,
        "rope_theta": 10000.0, "tie_word_embeddings": False, "sample_rate": 32000, "flow_smoke_test": True}
    model = Model(ModelConfig.from_dict({**config, "model_path": str(out)}))
    params = dict(tree_flatten(model.parameters()))
    names = sorted(params)
    keys = mx.random.split(mx.random.key(spec.seed), len(names))
    weights = {name: (mx.random.normal(params[name].shape, key=keys[i]) * 0.02 if params[name].ndim >= 2
                      else params[name]).astype(mx.float32) for i, name in enumerate(names)}
    mx.eval(weights)
    mx.save_safetensors(str(out / "model.safetensors"), weights, metadata={"format": "mlx"})
    tok.save(str(out / "tokenizer.json"))
    (out / "config.json").write_text(json.dumps(config, indent=1) + "\n", encoding="utf-8")
    (out / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "pad_token": "[STOP]", "eos_token": "[STOP]",
        "model_max_length": 2048, "clean_up_tokenization_spaces": False}, indent=1) + "\n", encoding="utf-8")
    (out / "README.md").write_text(f"# {SMOKE_TEST_LABEL}\n\nA `soprano` text-to-speech model with random weights "
                                   f"(cache key `{spec.cache_key()}`): its speech is noise.\n", encoding="utf-8")
