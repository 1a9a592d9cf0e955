"""Tiny random-weight audio models, built locally as mlx-audio loads real ones (see :mod:`runtime.tiny`).

A tiny Qwen3-TTS is mlx-audio's ``qwen3_tts`` architecture (a CustomVoice checkpoint with three speakers), the
text-to-speech model that batches requests (continuous batching): see :func:`write_qwen3_tts_files`.

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
from typing import Any

import mlx.core as mx
from mlx.nn.layers.convolution_transpose import ConvTranspose1d
from mlx.utils import tree_flatten
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers

from runtime.tiny.spec import SMOKE_TEST_LABEL, TinySpec
from runtime.tiny.tokenizer import CORPUS, pseudo_text

# mlx-audio is imported inside the functions that build its models: it takes seconds to import (it brings
# transformers), and only an audio model's build needs it.

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
    trained = Tokenizer(models.BPE())
    trained.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(vocab_size=WHISPER_BPE_TOKENS, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    trained.train_from_iterator(CORPUS.splitlines() + pseudo_text(3000), trainer=trainer)
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
    (out / "README.md").write_text(f"# {SMOKE_TEST_LABEL}\n\nA `whisper` speech-to-text model with random weights "
                                   f"(cache key `{spec.cache_key()}`): its transcripts mean nothing.\n",
                                   encoding="utf-8")


SOPRANO_SPECIALS = ("[STOP]", "[TEXT]", "[START]")


def write_soprano_files(out: Path, spec: TinySpec) -> None:
    """A Soprano checkpoint in mlx-audio's layout (config.json, model.safetensors, tokenizer), random weights."""
    from mlx_audio.tts.models.soprano.soprano import Model, ModelConfig

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=spec.vocab_size, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  special_tokens=list(SOPRANO_SPECIALS), show_progress=False)
    tok.train_from_iterator(CORPUS.splitlines() + pseudo_text(3000), trainer=trainer)
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


# Qwen3-TTS: the text tokens its prompt template names (Qwen's chat markers and the TTS text markers), and the
# codec ids of the real 12 Hz checkpoints (codes 0…2047, then the codec's own specials, languages, speakers).
QWEN3_TTS_SPECIALS = ("<|im_start|>", "<|im_end|>", "<|tts_pad|>", "<|tts_text_bos|>", "<|tts_text_eod|>")
QWEN3_TTS_SPEAKERS = {"vivian": 3065, "ryan": 3061, "aiden": 2861}
QWEN3_TTS_LANGUAGES = {"chinese": 2055, "english": 2050, "german": 2053, "french": 2061}
QWEN3_TTS_CODE_GROUPS = 4  # the real checkpoints have 16 codebooks per 12.5 Hz frame; fewer keeps it quick
QWEN3_TTS_FRAME_SAMPLES = 1  # samples a codec frame decodes to (the real codec: 1,920 at 24 kHz)


def write_qwen3_tts_files(out: Path, spec: TinySpec) -> None:
    """A Qwen3-TTS CustomVoice checkpoint in mlx-audio's layout, random weights: config.json (``talker_config``
    with its code predictor), model.safetensors, a byte-level BPE text tokenizer, generation_config.json, and
    ``speech_tokenizer/`` (the 12 Hz codec's decoder: config.json, model.safetensors). Its talker and code
    predictor are ``spec``-sized Qwen3 transformers; the codec decoder is small (see below). Sampling is greedy
    (``generation_config.json``), so a text's speech is one function of the text, alone or in a batch; random
    weights rarely pick the codec's end token, so a sentence's speech is as long as the token cap allows."""
    from mlx_audio.tts.models.qwen3_tts.config import ModelConfig
    from mlx_audio.tts.models.qwen3_tts.qwen3_tts import Model
    from mlx_audio.tts.models.qwen3_tts.speech_tokenizer import Qwen3TTSSpeechTokenizer

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=spec.vocab_size, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  special_tokens=list(QWEN3_TTS_SPECIALS), show_progress=False)
    tok.train_from_iterator(CORPUS.splitlines() + pseudo_text(3000), trainer=trainer)
    tok.add_tokens(["assistant", "user"])  # one token each, as in Qwen's vocabulary: the prompt is sliced by count
    ids = tok.get_vocab()
    head_dim = spec.hidden_size // spec.num_heads
    transformer = {"hidden_size": spec.hidden_size, "intermediate_size": spec.intermediate_size,
                   "num_hidden_layers": spec.num_layers, "num_attention_heads": spec.num_heads,
                   "num_key_value_heads": spec.num_kv_heads, "head_dim": head_dim, "hidden_act": "silu",
                   "rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "attention_bias": False,
                   "max_position_embeddings": spec.max_position_embeddings}
    quarter = head_dim // 8  # the real [24, 20, 20] of 64 rotary pairs, scaled
    talker = {**transformer, "vocab_size": 3072, "num_code_groups": QWEN3_TTS_CODE_GROUPS,
              "text_hidden_size": spec.hidden_size, "text_vocab_size": tok.get_vocab_size(),
              "rope_scaling": {"interleaved": True, "mrope_section": [head_dim // 2 - 2 * quarter, quarter, quarter],
                               "rope_type": "default"},
              "codec_eos_token_id": 2150, "codec_think_id": 2154, "codec_nothink_id": 2155,
              "codec_think_bos_id": 2156, "codec_think_eos_id": 2157, "codec_pad_id": 2148, "codec_bos_id": 2149,
              "codec_language_id": QWEN3_TTS_LANGUAGES, "spk_id": QWEN3_TTS_SPEAKERS,
              "spk_is_dialect": {name: False for name in QWEN3_TTS_SPEAKERS},
              "code_predictor_config": {**transformer, "num_hidden_layers": 1, "vocab_size": 2048,
                                        "num_code_groups": QWEN3_TTS_CODE_GROUPS}}
    config: dict[str, Any] = {
        "model_type": "qwen3_tts", "architectures": ["Qwen3TTSForConditionalGeneration"],
        "tts_model_type": "custom_voice", "tts_model_size": "tiny", "tokenizer_type": "qwen3_tts_tokenizer_12hz",
        "talker_config": talker, "im_start_token_id": ids["<|im_start|>"], "im_end_token_id": ids["<|im_end|>"],
        "tts_pad_token_id": ids["<|tts_pad|>"], "tts_bos_token_id": ids["<|tts_text_bos|>"],
        "tts_eos_token_id": ids["<|tts_text_eod|>"], "sample_rate": 24000, "flow_smoke_test": True}
    # The codec's loader guesses each convolution's layout from its shape (PyTorch's or MLX's): widths above 64
    # channels keep its guesses right. MLX computes dilated and transposed convolutions on a CPU in a slow direct
    # loop, and a decoder block's residual units (dilations 1, 3, 9) run at the output rate: one block (the real
    # codec has four) and one sample a frame (instead of 1,920) keep the codec's share of a tiny model's time
    # near a real one's on a GPU, where the talker's passes dominate.
    decoder = {"codebook_size": 2048, "codebook_dim": 136, "latent_dim": 64, "decoder_dim": 130,
               "hidden_size": spec.hidden_size, "intermediate_size": spec.intermediate_size,
               "num_hidden_layers": 1, "num_attention_heads": spec.num_heads, "num_key_value_heads": spec.num_heads,
               "head_dim": head_dim, "num_quantizers": QWEN3_TTS_CODE_GROUPS, "num_semantic_quantizers": 1,
               "upsample_rates": [1], "upsampling_ratios": [], "sliding_window": 72,
               "vector_quantization_hidden_dimension": 136}
    codec_config = {"model_type": "qwen3_tts_tokenizer_12hz", "decoder_config": decoder,
                    "input_sample_rate": 24000, "output_sample_rate": 24000,
                    "decode_upsample_rate": QWEN3_TTS_FRAME_SAMPLES, "encode_downsample_rate": QWEN3_TTS_FRAME_SAMPLES}
    model = Model(ModelConfig.from_dict({**config, "model_path": str(out)}))
    codec = Qwen3TTSSpeechTokenizer(_qwen3_codec_config(codec_config))
    (out / "speech_tokenizer").mkdir()
    # Wider random weights than other tiny models (std 0.3, not 0.02): at 0.02 the talker's greedy choices do not
    # depend on the text or the voice, and every request would speak the same noise.
    mx.save_safetensors(str(out / "model.safetensors"), _random_like(model, spec.seed, std=0.3),
                        metadata={"format": "mlx"})
    mx.save_safetensors(str(out / "speech_tokenizer" / "model.safetensors"),
                        _as_pytorch_codec(codec, _random_like(codec, spec.seed + 1)), metadata={"format": "pt"})
    tok.save(str(out / "tokenizer.json"))

    def dump(name: str, obj: Any) -> None:
        (out / name).write_text(json.dumps(obj, indent=1) + "\n", encoding="utf-8")

    dump("config.json", config)
    dump("speech_tokenizer/config.json", codec_config)
    dump("generation_config.json", {"do_sample": False, "temperature": 0.0, "top_k": 50, "top_p": 1.0,
                                    "repetition_penalty": 1.05, "max_new_tokens": 2048})
    dump("tokenizer_config.json", {"tokenizer_class": "PreTrainedTokenizerFast", "pad_token": "<|im_end|>",
                                   "eos_token": "<|im_end|>", "model_max_length": 32768,
                                   "clean_up_tokenization_spaces": False})
    (out / "README.md").write_text(f"# {SMOKE_TEST_LABEL}\n\nA `qwen3_tts` (CustomVoice) text-to-speech model with "
                                   f"random weights (cache key `{spec.cache_key()}`): its speech is noise.\n",
                                   encoding="utf-8")


def _qwen3_codec_config(raw: dict[str, Any]) -> Any:
    from mlx_audio.tts.models.qwen3_tts.config import Qwen3TTSTokenizerConfig

    return Qwen3TTSTokenizerConfig(**{k: v for k, v in raw.items() if k != "model_type"})


def _random_like(module: Any, seed: int, std: float = 0.02) -> dict[str, mx.array]:
    """Random normal weights (``std``) for every matrix of ``module``, its vectors (norm scales, biases) as
    initialized."""
    params = dict(tree_flatten(module.parameters()))
    names = sorted(params)
    keys = mx.random.split(mx.random.key(seed), len(names))
    weights = {name: (mx.random.normal(params[name].shape, key=keys[i]) * std if params[name].ndim >= 2
                      else params[name]).astype(mx.float32) for i, name in enumerate(names)}
    mx.eval(weights)
    return weights


def _as_pytorch_codec(codec: Any, weights: dict[str, mx.array]) -> dict[str, mx.array]:
    """The codec's weights as the real checkpoints store them: convolutions in PyTorch's layout (``out, in,
    kernel``; transposed ones ``in, out, kernel``), each codebook as ``embedding_sum`` and ``cluster_usage``."""
    transposed = {f"{name}.weight" for name, module in codec.named_modules() if isinstance(module, ConvTranspose1d)}
    stored: dict[str, mx.array] = {}
    for name, value in weights.items():
        if name.endswith(".codebook.embed.weight"):
            base = name.removesuffix(".codebook.embed.weight")
            stored[f"{base}._codebook.embedding_sum"] = value
            stored[f"{base}._codebook.cluster_usage"] = mx.ones((value.shape[0],), dtype=value.dtype)
        elif value.ndim == 3:
            stored[name] = value.transpose(2, 0, 1) if name in transposed else value.transpose(0, 2, 1)
        else:
            stored[name] = value
    return stored
