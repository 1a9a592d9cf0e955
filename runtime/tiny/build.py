"""Building a tiny model: its config.json, deterministic random weights and files, staged beside the destination
and renamed into place; the cache of builds (:func:`ensure_tiny_model`).

Text models are written here (weights drawn from the real mlx-lm model class for the config), and so are the
encoders (mlx-embeddings' BERT and ModernBERT); the audio and vision-language ones by runtime/tiny/audio.py and
runtime/tiny/vlm.py. A build is staged in a temporary directory next to its destination and renamed into place,
so a crash never leaves half a model; when two processes race to the same cache entry, the first rename wins and
the loser discards its copy.
"""

from __future__ import annotations

import importlib
import json
import os
import shutil
import tempfile
import uuid
from dataclasses import asdict
from pathlib import Path
from typing import Any

import mlx.core as mx
from mlx.utils import tree_flatten

from runtime.tiny.archs import ARCHS, ArchInfo
from runtime.tiny.audio import write_qwen3_tts_files, write_soprano_files, write_whisper_files
from runtime.tiny.spec import (
    BUILDER_VERSION,
    INIT_STD,
    PRESETS,
    SMOKE_TEST_LABEL,
    VLM_ARCHS,
    Arch,
    TinySpec,
    size_fields,
)
from runtime.tiny.tokenizer import special_tokens_map, tokenizer_config, train_tokenizer, wordpiece_tokenizer
from runtime.tiny.vlm import write_vlm_files


def _model_config(info: ArchInfo, spec: TinySpec, token_id: dict[str, int]) -> dict[str, Any]:
    """config.json as the real checkpoints write it, plus the smoke-test marker."""
    eos_ids = [token_id[t] for t in info.config_eos]
    common: dict[str, Any] = {
        "architectures": [info.architecture],
        "model_type": info.model_type,
        **size_fields(spec),
        "bos_token_id": token_id[info.config_bos],
        "eos_token_id": eos_ids[0] if len(eos_ids) == 1 else eos_ids,
        "pad_token_id": token_id[info.pad],
        "initializer_range": INIT_STD,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "tie_word_embeddings": info.tie_embeddings,
        "torch_dtype": spec.dtype,
        "use_cache": True,
    }
    if info.fields is not None:
        arch_fields: dict[str, Any] = info.fields(spec.num_layers)
        if spec.mtp_layers:
            arch_fields["mtp_num_hidden_layers"] = spec.mtp_layers
        if spec.arch == "lfm2":  # LFM2's config repeats the sizes under names of its own
            arch_fields.update(block_dim=spec.hidden_size, block_ff_dim=spec.intermediate_size,
                               conv_dim=spec.hidden_size, conv_dim_out=spec.hidden_size)
    elif spec.arch == "qwen3":
        arch_fields = {
            "hidden_act": "silu",
            "rms_norm_eps": 1e-6,
            "rope_theta": 1_000_000.0,
            "rope_scaling": None,
            "sliding_window": None,
            "use_sliding_window": False,
            "max_window_layers": spec.num_layers,
        }
    elif spec.arch == "llama":
        arch_fields = {
            "hidden_act": "silu",
            "mlp_bias": False,
            "pretraining_tp": 1,
            "rms_norm_eps": 1e-5,
            "rope_theta": 500_000.0,
            "rope_scaling": {
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                # Real 3.1: 8192 of 131072. Kept below max_position_embeddings,
                # which transformers checks when it reads the config.
                "original_max_position_embeddings": max(1, spec.max_position_embeddings // 16),
                "rope_type": "llama3",
            },
        }
    else:
        arch_fields = {
            "hidden_activation": "gelu_pytorch_tanh",
            "rms_norm_eps": 1e-6,
            "rope_theta": 1_000_000.0,
            "rope_local_base_freq": 10_000.0,
            "rope_scaling": None,
            "query_pre_attn_scalar": spec.head_dim,
            "sliding_window": spec.sliding_window,
            # mlx-lm indexes cache[pattern - 1], so the pattern can't exceed the
            # layer count; with 2 layers this gives one sliding + one global layer.
            "sliding_window_pattern": min(6, spec.num_layers),
            "attn_logit_softcapping": None,
            "final_logit_softcapping": None,
        }
    marker = {
        "flow_smoke_test": True,
        "flow_smoke_test_label": SMOKE_TEST_LABEL,
        "flow_tiny_spec": asdict(spec),
        "flow_builder_version": BUILDER_VERSION,
    }
    return {**common, **arch_fields, **marker}


_MODULES: dict[str, str] = {"qwen3": "qwen3", "llama": "llama", "gemma3": "gemma3_text"}


def _model_module(arch: Arch) -> Any:
    return importlib.import_module(f"mlx_lm.models.{ARCHS[arch].module or _MODULES[arch]}")


def _random_weights(spec: TinySpec, config: dict[str, Any]) -> dict[str, mx.array]:
    """Weights named exactly as the real mlx-lm model class names its parameters."""
    module = _model_module(spec.arch)
    mx.random.seed(spec.seed)  # what module init draws and the loop below keeps (gated-delta decay rates) is fixed
    model = module.Model(module.ModelArgs.from_dict(config))
    params = dict(tree_flatten(model.parameters()))
    if spec.arch == "gemma3":
        # Absent lm_head is how mlx-lm (and HF) know gemma3's head is tied.
        params.pop("lm_head.weight", None)
    names = sorted(params)
    keys = mx.random.split(mx.random.key(spec.seed), len(names))
    dtype = getattr(mx, spec.dtype)
    layer_std = ARCHS[spec.arch].layer_std or INIT_STD
    weights: dict[str, mx.array] = {}
    for i, name in enumerate(names):
        value = params[name]
        if value.ndim >= 2:  # embeddings, projections, experts' stacks: HF-style N(0, 0.02)
            std = INIT_STD if "embed" in name else layer_std
            value = mx.random.normal(value.shape, key=keys[i]) * std
        elif name.endswith(("bias", "sinks")):  # module init draws these at random: zero them, deterministic
            value = mx.zeros_like(value)
        elif spec.arch == "gemma3":  # gemma norms scale by (1 + w); identity is w = 0
            value = mx.zeros_like(value)
        weights[name] = value.astype(dtype)
    mx.eval(weights)
    return weights


def _random_mtp_weights(spec: TinySpec, config: dict[str, Any]) -> dict[str, mx.array]:
    """The MTP layers' weights as the real checkpoints store them: ``mtp.``-prefixed, norms as ``w`` of ``1 + w``."""
    # runtime.mtp imports mlx-lm, which takes seconds to import (it brings transformers): only a build with MTP
    # layers pays for it.
    from runtime.mtp import MTPHead

    params = dict(tree_flatten(MTPHead(config).parameters()))  # type: ignore[no-untyped-call]
    names = sorted(params)
    keys = mx.random.split(mx.random.key(spec.seed + 1), len(names))
    weights: dict[str, mx.array] = {}
    for i, name in enumerate(names):
        value = params[name]
        value = mx.random.normal(value.shape, key=keys[i]) * INIT_STD if value.ndim >= 2 else value - 1.0
        weights[f"mtp.{name}"] = value.astype(getattr(mx, spec.dtype))
    mx.eval(weights)
    return weights


# ---------------------------------------------------------------------------
# Files


def _readme(spec: TinySpec, info: ArchInfo, n_params: int) -> str:
    # The README is one of the build's files: it still names runtime/tiny.py (where the builder lived), because
    # changing its text changes the bytes of every cached build; it changes with the next BUILDER_VERSION.
    fields = "\n".join(f"| {k} | {v} |" for k, v in asdict(spec).items())
    return f"""# {SMOKE_TEST_LABEL}

This is **not a real model**. It is a `{info.model_type}` checkpoint with
**random weights** and a tiny byte-level BPE tokenizer, built locally by
`runtime/tiny.py` (flow) for tests, demos and benchmarks. Whatever it
generates is gibberish.

- parameters: {n_params:,}
- cache key: `{spec.cache_key()}` (builder version {BUILDER_VERSION})
- `config.json` carries `"flow_smoke_test": true`

| field | value |
| --- | --- |
{fields}
"""


def _write_model_files(out: Path, spec: TinySpec) -> None:
    """Write every file of the checkpoint into the (empty) directory ``out``."""
    if spec.arch in ("bert", "modernbert"):
        _write_encoder_files(out, spec)
        return
    if spec.arch in ("whisper", "soprano", "qwen3_tts"):
        writers = {"whisper": write_whisper_files, "soprano": write_soprano_files, "qwen3_tts": write_qwen3_tts_files}
        writers[spec.arch](out, spec)
        return
    if spec.arch in VLM_ARCHS:
        write_vlm_files(out, spec)
        return
    info = ARCHS[spec.arch]
    tok = train_tokenizer(info, spec.vocab_size)
    token_id = tok.get_vocab()
    config = _model_config(info, spec, token_id)
    if spec.embedding:
        config["architectures"] = [info.architecture.replace("ForCausalLM", "Model")]
    weights = _random_weights(spec, config)
    if spec.mtp_layers:
        weights.update(_random_mtp_weights(spec, config))

    def dump(name: str, obj: Any) -> None:
        (out / name).write_text(json.dumps(obj, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")

    mx.save_safetensors(str(out / "model.safetensors"), weights, metadata={"format": "mlx"})
    dump("config.json", config)
    dump(
        "generation_config.json",
        {
            "bos_token_id": token_id[info.config_bos],
            "eos_token_id": [token_id[t] for t in info.stop_tokens],
            "pad_token_id": token_id[info.pad],
            **info.generation_defaults,
        },
    )
    tok.save(str(out / "tokenizer.json"))
    dump("tokenizer_config.json", tokenizer_config(info, tok, spec))
    dump("special_tokens_map.json", special_tokens_map(info))
    n_params = sum(v.size for v in weights.values())
    (out / "README.md").write_text(_readme(spec, info, n_params), encoding="utf-8")


def _encoder_config(spec: TinySpec, vocab: dict[str, int]) -> dict[str, Any]:
    """The config of an encoder-only model: a ``BertModel`` sentence encoder, or (``modernbert``) a ModernBERT
    cross-encoder with one relevance output, as rerankers ship (gte-reranker-modernbert)."""
    common = {"vocab_size": len(vocab), "hidden_size": spec.hidden_size, "num_hidden_layers": spec.num_layers,
              "num_attention_heads": spec.num_heads, "intermediate_size": spec.intermediate_size,
              "max_position_embeddings": spec.max_position_embeddings, "pad_token_id": vocab["[PAD]"],
              "flow_smoke_test": True}
    if spec.arch == "modernbert":
        return {"architectures": ["ModernBertForSequenceClassification"], "model_type": "modernbert", **common,
                "id2label": {"0": "LABEL_0"}, "label2id": {"LABEL_0": 0}, "classifier_pooling": "mean",
                "cls_token_id": vocab["[CLS]"], "sep_token_id": vocab["[SEP]"], "local_attention": 16,
                "global_attn_every_n_layers": 2, "hidden_activation": "gelu"}
    return {"architectures": ["BertModel"], "model_type": "bert", **common, "type_vocab_size": 2,
            "hidden_act": "gelu", "layer_norm_eps": 1e-12}


def _write_encoder_files(out: Path, spec: TinySpec) -> None:
    """An encoder as embedding and reranking checkpoints ship it: WordPiece tokenizer, weights named as
    mlx-embeddings' module for the architecture names them."""
    # mlx-embeddings takes seconds to import (it brings transformers): only an encoder's build pays for it.
    from mlx_embeddings.models import bert, modernbert

    tok = wordpiece_tokenizer(spec)
    vocab = tok.get_vocab()
    config = _encoder_config(spec, vocab)
    module: Any = modernbert if spec.arch == "modernbert" else bert
    model = module.Model(module.ModelArgs.from_dict(config))
    params = dict(tree_flatten(model.parameters()))
    names = sorted(params)
    keys = mx.random.split(mx.random.key(spec.seed), len(names))
    weights = {name: (mx.random.normal(params[name].shape, key=keys[i]) * INIT_STD if params[name].ndim == 2
                      else params[name]).astype(getattr(mx, spec.dtype)) for i, name in enumerate(names)}
    mx.eval(weights)
    mx.save_safetensors(str(out / "model.safetensors"), weights, metadata={"format": "mlx"})
    tok.save(str(out / "tokenizer.json"))
    (out / "vocab.txt").write_text("".join(t + "\n" for t, _ in sorted(vocab.items(), key=lambda kv: kv[1])))
    for name, obj in (("config.json", config), ("tokenizer_config.json", {
            "tokenizer_class": "BertTokenizer", "do_lower_case": True, "model_max_length": spec.max_position_embeddings,
            "unk_token": "[UNK]", "sep_token": "[SEP]", "pad_token": "[PAD]", "cls_token": "[CLS]",
            "mask_token": "[MASK]", "padding_side": "right", "clean_up_tokenization_spaces": True})):
        (out / name).write_text(json.dumps(obj, indent=2) + "\n", encoding="utf-8")
    role = "cross-encoder (reranker)" if spec.arch == "modernbert" else "encoder"
    (out / "README.md").write_text(f"# {SMOKE_TEST_LABEL}\n\nA `{spec.arch}` {role} with random weights (cache "
                                   f"key `{spec.cache_key()}`): its outputs mean nothing.\n", encoding="utf-8")


_REQUIRED_FILES = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json")


def _is_complete(path: Path) -> bool:
    return all((path / name).is_file() for name in _REQUIRED_FILES)


def _stage(dest: Path, spec: TinySpec) -> Path:
    """Build into a fresh temp dir beside ``dest`` (same filesystem, so rename is atomic)."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    staged = Path(tempfile.mkdtemp(dir=dest.parent, prefix=f".{dest.name}.tmp-"))
    try:
        _write_model_files(staged, spec)
    except BaseException:
        shutil.rmtree(staged, ignore_errors=True)
        raise
    return staged


def _swap_in(staged: Path, dest: Path) -> None:
    """Replace an existing ``dest`` with ``staged``; dest is never half-written."""
    old = dest.with_name(f".{dest.name}.old-{uuid.uuid4().hex[:8]}")
    os.rename(dest, old)
    os.rename(staged, dest)
    shutil.rmtree(old, ignore_errors=True)


def build_tiny_model(dest: Path, spec: TinySpec = TinySpec()) -> Path:
    """Build a random-weight checkpoint for ``spec`` at ``dest`` (replacing what is there)."""
    dest = Path(dest)
    staged = _stage(dest, spec)
    if dest.exists():
        _swap_in(staged, dest)
    else:
        os.rename(staged, dest)
    return dest


def _default_cache_dir() -> Path:
    env = os.environ.get("FLOW_CACHE_DIR")
    return Path(env) if env else Path.home() / ".cache" / "flow"


def tiny_models_dir(cache_dir: Path | None = None) -> Path:
    """Where tiny models are built (``$FLOW_CACHE_DIR/tiny-models``, default ``~/.cache/flow``)."""
    return (Path(cache_dir) if cache_dir is not None else _default_cache_dir()) / "tiny-models"


def _resolve(name_or_spec: str | TinySpec) -> tuple[str, TinySpec]:
    if isinstance(name_or_spec, TinySpec):
        for name, spec in PRESETS.items():
            if spec == name_or_spec:
                return name, spec
        return f"custom-{name_or_spec.arch}", name_or_spec
    try:
        return name_or_spec, PRESETS[name_or_spec]
    except KeyError:
        raise ValueError(f"unknown tiny model {name_or_spec!r}; presets: {sorted(PRESETS)}") from None


def ensure_tiny_model(name_or_spec: str | TinySpec, cache_dir: Path | None = None) -> Path:
    """Return the cached build for a preset name or spec, building it on first use."""
    name, spec = _resolve(name_or_spec)
    dest = tiny_models_dir(cache_dir) / f"{name}-{spec.cache_key()}"
    if _is_complete(dest):
        return dest
    staged = _stage(dest, spec)
    try:
        os.rename(staged, dest)
    except OSError:
        # Another process renamed its build in first (dest is a non-empty dir):
        # use the winner's, it is the same spec.
        if _is_complete(dest):
            shutil.rmtree(staged, ignore_errors=True)
            return dest
        if not dest.exists():
            raise
        _swap_in(staged, dest)  # dest was junk (not one of our builds): replace it
    return dest


def is_smoke_test_model(path: Path) -> bool:
    """True when ``path`` holds a checkpoint built by this module."""
    try:
        config = json.loads((Path(path) / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return isinstance(config, dict) and config.get("flow_smoke_test") is True
