"""Importing GGUF files (llama.cpp, Ollama, LM Studio) as MLX model directories.

Theory of operation
-------------------

flow serves MLX model directories; a GGUF becomes one once, in the model cache, and is served from there:

1. **Parts.** ``model.gguf``, or every part of a split ``model-00001-of-00003.gguf`` (naming any part
   names them all). The first part holds the metadata; each part holds some of the tensors.
2. **Identity.** Each part's name, size and modification time, the dtype asked for and this importer's
   version name the cache directory, ``$FLOW_CACHE_DIR/gguf/<name>-<dtype>-<digest>`` (``~/.cache/flow``
   by default). A directory whose stamp carries that identity is reused without reading the file.
3. **Layout.** ``general.architecture`` picks one of the layouts flow knows (:data:`LAYOUTS`): the
   ``config.json`` it becomes and the names its tensors take in mlx-lm. Anything else is an error that
   names the supported architectures.
4. **Tensors.** Each is dequantized to float32 by the ``gguf`` package, llama.cpp's conversion is undone
   (llama's q/k rows are interleaved for llama.cpp's rope; Gemma's norms are stored as ``1 + w``), then it
   is cast, or its matrices quantized with MLX's affine scheme as ``mlx_lm.convert`` does (``config.json``
   gets the ``quantization`` block; ``auto`` keeps the file's precision class), and written in shards of
   at most 2 GiB, so memory holds one shard at a time.
5. **Tokenizer.** Rebuilt from the vocabulary by :mod:`runtime.gguf_tokenizer`.
6. **Atomic.** Everything is written into a partial directory beside the target, renamed into place at
   the end: an interrupted import leaves nothing that would later be served, and the next import removes
   partial directories whose process is gone.

Reading the file is :mod:`runtime.gguf_file`'s part, rebuilding the tokenizer :mod:`runtime.gguf_tokenizer`'s.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import shutil
import tempfile
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, get_args

import numpy as np
from gguf.constants import LlamaFileType

from runtime.gguf_file import (
    GGUFImportError,
    GGUFSource,
    Metadata,
    TensorInfo,
    gguf_model_name,
    gguf_parts,
    read_source,
    tensor_array,
)
from runtime.gguf_tokenizer import GGUFVocab, VocabularyError, end_of_generation_ids, write_tokenizer_files

if TYPE_CHECKING:  # MLX is imported when tensors are converted
    import mlx.core as mx

__all__ = ["IMPORT_DTYPES", "LAYOUTS", "GGUFImportError", "ImportDType", "ImportResult", "gguf_cache_dir",
           "gguf_model_name", "import_gguf"]

log = logging.getLogger("flow.gguf")

ImportDType = Literal["auto", "float32", "float16", "bfloat16", "q4", "q8"]
IMPORT_DTYPES: tuple[ImportDType, ...] = get_args(ImportDType)
FloatDType = Literal["float32", "float16", "bfloat16"]
ConcreteDType = Literal["float32", "float16", "bfloat16", "q4", "q8"]

IMPORTER_VERSION = 1  # bump when the files an import writes change, so older imports are not reused
STAMP = ".flow-gguf-import.json"
SHARD_BYTES = 2 << 30
# GGUF quantizes in blocks of 32 values (K-quants in sub-blocks of 32), each with its own scale and
# offset: MLX groups of the same width re-quantize them almost exactly. With groups of 64 a Q4_1
# SmolLM2-135M re-quantized to q4 no longer knew the capital of France.
QUANT_GROUP_SIZE = 32
QUANT_BITS: dict[str, int] = {"q4": 4, "q8": 8}


def gguf_cache_dir() -> Path:
    """Where imports live: ``$FLOW_CACHE_DIR/gguf``, default ``~/.cache/flow/gguf``."""
    root = os.environ.get("FLOW_CACHE_DIR")
    return (Path(root) if root else Path.home() / ".cache" / "flow") / "gguf"


# ------------------------------------------------------------------ architectures

@dataclass(frozen=True)
class ModelFacts:
    """What the tensors say that the metadata may not."""

    vocab_size: int
    has_output: bool  # a separate lm_head (else tied to the embeddings)
    attention_bias: bool
    mlp_bias: bool
    rope_factors: np.ndarray[Any, np.dtype[np.float32]] | None  # llama 3's rope_freqs


@dataclass(frozen=True)
class Layout:
    """How one GGUF architecture becomes an mlx-lm model directory."""

    model_type: str
    architecture: str
    block: Mapping[str, str]  # GGUF block tensor → mlx-lm module path in model.layers.N
    config: Callable[[str, Metadata, ModelFacts], dict[str, Any]]
    interleaved_qk: bool = False  # llama.cpp permuted q/k rows for its rope (convert_hf_to_gguf LlamaModel.permute)
    norm_shift: float = 0.0  # stored norm weight = weight + shift

    def tensor_name(self, gguf_name: str) -> str | None:
        """The mlx-lm name of a GGUF tensor, None when the layout has no place for it."""
        if gguf_name in GLOBAL_TENSORS:
            return GLOBAL_TENSORS[gguf_name]
        match = BLOCK_TENSOR.match(gguf_name)
        if match is None or match["stem"] not in self.block:
            return None
        return f"model.layers.{match['layer']}.{self.block[match['stem']]}.{match['kind']}"


GLOBAL_TENSORS = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
                  "output.weight": "lm_head.weight"}
BLOCK_TENSOR = re.compile(r"^blk\.(?P<layer>\d+)\.(?P<stem>\w+)\.(?P<kind>weight|bias)$")
ROPE_FREQS = "rope_freqs.weight"

_ATTENTION_AND_MLP = {"attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
                      "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
                      "ffn_down": "mlp.down_proj", "attn_norm": "input_layernorm"}
_LLAMA_BLOCK = {**_ATTENTION_AND_MLP, "ffn_norm": "post_attention_layernorm"}
_QK_NORMS = {"attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm"}
_GEMMA3_BLOCK = {**_ATTENTION_AND_MLP, **_QK_NORMS, "post_attention_norm": "post_attention_layernorm",
                 "ffn_norm": "pre_feedforward_layernorm", "post_ffw_norm": "post_feedforward_layernorm"}


def _common_config(arch: str, md: Metadata, facts: ModelFacts) -> dict[str, Any]:
    heads = md.integer(f"{arch}.attention.head_count")
    return {
        "hidden_size": md.integer(f"{arch}.embedding_length"),
        "num_hidden_layers": md.integer(f"{arch}.block_count"),
        "intermediate_size": md.integer(f"{arch}.feed_forward_length"),
        "num_attention_heads": heads,
        "num_key_value_heads": md.integer(f"{arch}.attention.head_count_kv", heads),
        "rms_norm_eps": md.number(f"{arch}.attention.layer_norm_rms_epsilon"),
        "vocab_size": facts.vocab_size,
        "max_position_embeddings": md.integer(f"{arch}.context_length"),
        "rope_theta": md.number(f"{arch}.rope.freq_base", 10000.0),
        "tie_word_embeddings": not facts.has_output,
    }


def _llama_config(arch: str, md: Metadata, facts: ModelFacts) -> dict[str, Any]:
    if md.optional_integer(f"{arch}.expert_count"):
        raise GGUFImportError(f"{md.source}: a mixture-of-experts llama (Mixtral-style) GGUF; flow imports "
                              "dense llama models only")
    config = _common_config(arch, md, facts)
    head_dim = (md.optional_integer(f"{arch}.attention.key_length")
                or md.optional_integer(f"{arch}.rope.dimension_count")
                or config["hidden_size"] // config["num_attention_heads"])
    config.update(head_dim=head_dim, attention_bias=facts.attention_bias, mlp_bias=facts.mlp_bias,
                  hidden_act="silu")
    scaling = _rope_scaling(arch, md, facts, head_dim, config["rope_theta"])
    if scaling is not None:
        config["rope_scaling"] = scaling
    return config


def _qwen2_config(arch: str, md: Metadata, facts: ModelFacts) -> dict[str, Any]:
    config = _common_config(arch, md, facts)
    config["hidden_act"] = "silu"
    scaling = _rope_scaling(arch, md, facts, config["hidden_size"] // config["num_attention_heads"],
                            config["rope_theta"])
    if scaling is not None:
        config["rope_scaling"] = scaling
    return config


def _qwen3_config(arch: str, md: Metadata, facts: ModelFacts) -> dict[str, Any]:
    config = _qwen2_config(arch, md, facts)
    config["head_dim"] = md.integer(f"{arch}.attention.key_length",
                                    config["hidden_size"] // config["num_attention_heads"])
    return config


def _gemma3_config(arch: str, md: Metadata, facts: ModelFacts) -> dict[str, Any]:
    config = _common_config(arch, md, facts)
    head_dim = md.integer(f"{arch}.attention.key_length", 256)
    # llama.cpp scales Gemma 3 27B's queries by hidden/heads, every other size by the head size.
    query_scalar = (config["hidden_size"] // config["num_attention_heads"] if config["num_hidden_layers"] == 62
                    else head_dim)
    config.update(head_dim=head_dim, query_pre_attn_scalar=query_scalar,
                  sliding_window=md.integer(f"{arch}.attention.sliding_window", 512),
                  sliding_window_pattern=_sliding_window_pattern(arch, md, config["num_hidden_layers"]),
                  rope_local_base_freq=md.number(f"{arch}.rope.freq_base_swa", 10000.0),
                  hidden_activation="gelu_pytorch_tanh")
    scaling = _rope_scaling(arch, md, facts, head_dim, config["rope_theta"])
    if scaling is not None:
        config["rope_scaling"] = scaling
    return config


def _sliding_window_pattern(arch: str, md: Metadata, layers: int) -> int:
    """Every how manyth layer attends globally (the others in a sliding window). llama.cpp reads Gemma 3's
    as 6 unless the file says otherwise, as a period or as a per-layer list (true: sliding)."""
    key = f"{arch}.attention.sliding_window_pattern"
    value = md.values.get(key, 6)
    if isinstance(value, int) and not isinstance(value, bool) and value > 0:
        return value
    if isinstance(value, list) and value and all(isinstance(v, bool) for v in value):
        period = value.index(False) + 1 if False in value else layers + 1
        if value == [(i + 1) % period != 0 for i in range(len(value))]:
            return period
    raise GGUFImportError(f"{md.source}: {key} is {value!r:.80}; mlx-lm's gemma3 needs a global layer at a "
                          "fixed period")


def _rope_scaling(arch: str, md: Metadata, facts: ModelFacts, head_dim: int,
                  theta: float) -> dict[str, Any] | None:
    """mlx-lm's rope_scaling from the metadata, or from llama 3's rope_freqs tensor."""
    if facts.rope_factors is not None:
        return _llama3_rope_scaling(md.source, facts.rope_factors, head_dim, theta)
    kind = md.text(f"{arch}.rope.scaling.type")
    if kind in (None, "none"):
        return None
    factor = md.number(f"{arch}.rope.scaling.factor")
    if kind == "linear":
        return {"type": "linear", "factor": factor}
    if kind == "yarn":
        original = md.integer(f"{arch}.rope.scaling.original_context_length")
        return {"type": "yarn", "factor": factor, "original_max_position_embeddings": original}
    raise GGUFImportError(f"{md.source}: rope scaling {kind!r} is not one flow imports (none, linear, yarn, "
                          "llama 3's rope_freqs)")


def llama3_rope_factors(factor: float, head_dim: int, theta: float, low_freq_factor: float = 1.0,
                        high_freq_factor: float = 4.0, original_context: int = 8192) -> np.ndarray[Any, np.dtype[np.float32]]:
    """The rope_freqs tensor convert_hf_to_gguf writes for a llama 3 rope_scaling."""
    freqs = 1.0 / theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    wavelen = 2 * np.pi / freqs
    smooth = (original_context / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    factors = np.where(wavelen < original_context / high_freq_factor, 1.0,
                       np.where(wavelen > original_context / low_freq_factor, factor,
                                1.0 / ((1 - smooth) / factor + smooth)))
    return factors.astype(np.float32)


def _llama3_rope_scaling(source: str, factors: np.ndarray[Any, np.dtype[np.float32]], head_dim: int,
                         theta: float) -> dict[str, Any]:
    """Llama 3.1+ GGUFs keep their rope scaling only as per-frequency factors; every release used the same
    low/high frequency factors and original context, so the factors give back the scaling — checked."""
    factor = float(factors.max())
    if not np.allclose(llama3_rope_factors(factor, head_dim, theta), factors, rtol=1e-4):
        raise GGUFImportError(f"{source}: its rope_freqs tensor is not llama 3's rope scaling; flow cannot "
                              "express it in config.json")
    return {"rope_type": "llama3", "factor": factor, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192}


LAYOUTS: dict[str, Layout] = {
    "llama": Layout("llama", "LlamaForCausalLM", _LLAMA_BLOCK, _llama_config, interleaved_qk=True),
    "qwen2": Layout("qwen2", "Qwen2ForCausalLM", _LLAMA_BLOCK, _qwen2_config),
    "qwen3": Layout("qwen3", "Qwen3ForCausalLM", {**_LLAMA_BLOCK, **_QK_NORMS}, _qwen3_config),
    "gemma3": Layout("gemma3_text", "Gemma3ForCausalLM", _GEMMA3_BLOCK, _gemma3_config, norm_shift=1.0),
}


def layout_for(source: GGUFSource) -> Layout:
    """The layout of the file's architecture, or an error naming the supported ones."""
    arch = source.architecture
    if arch not in LAYOUTS:
        raise GGUFImportError(f"{source.metadata.source}: GGUF architecture {arch!r} is not one flow can import; "
                              f"supported: {', '.join(sorted(LAYOUTS))}")
    return LAYOUTS[arch]


def model_facts(source: GGUFSource) -> ModelFacts:
    by_name = {t.name: t for t in source.tensors}
    embeddings = by_name.get("token_embd.weight")
    if embeddings is None or len(embeddings.shape) != 2:
        raise GGUFImportError(f"{source.metadata.source}: no 2-D token_embd.weight tensor; not a language model")
    rope = by_name.get(ROPE_FREQS)
    return ModelFacts(
        vocab_size=embeddings.shape[0],
        has_output="output.weight" in by_name,
        attention_bias="blk.0.attn_q.bias" in by_name,
        mlp_bias="blk.0.ffn_up.bias" in by_name,
        rope_factors=None if rope is None else tensor_array(source, rope).reshape(-1),
    )


def model_config(source: GGUFSource, layout: Layout, facts: ModelFacts, vocab: GGUFVocab) -> dict[str, Any]:
    """config.json as mlx-lm (and transformers) read it."""
    config = {"model_type": layout.model_type, "architectures": [layout.architecture],
              **layout.config(source.architecture, source.metadata, facts)}
    if vocab.bos_id is not None:
        config["bos_token_id"] = vocab.bos_id
    stops = end_of_generation_ids(vocab)
    if stops:
        config["eos_token_id"] = stops[0] if len(stops) == 1 else stops
    return config


def vocabulary(source: GGUFSource) -> GGUFVocab:
    """The ``tokenizer.*`` metadata, or an error when the file carries no tokenizer."""
    md = source.metadata
    tokens = md.strings("tokenizer.ggml.tokens")
    model = md.text("tokenizer.ggml.model")
    if not tokens or model is None:
        raise GGUFImportError(f"{md.source}: the GGUF carries no tokenizer (tokenizer.ggml.model/tokens are "
                              "missing), so flow cannot build tokenizer.json; use a GGUF that embeds its "
                              "vocabulary, as llama.cpp's convert_hf_to_gguf.py writes them")
    named = sorted(key.removeprefix("tokenizer.chat_template.") for key in md.values
                   if key.startswith("tokenizer.chat_template."))
    if named:
        log.info("%s: its named chat templates (%s) are left out: flow renders a model's default template",
                 md.source, ", ".join(named))
    return GGUFVocab(
        model=model, tokens=tokens,
        types=md.integers("tokenizer.ggml.token_type") or [1] * len(tokens),
        scores=md.numbers("tokenizer.ggml.scores"),
        merges=md.strings("tokenizer.ggml.merges"),
        pre=md.text("tokenizer.ggml.pre") or "default",
        bos_id=md.optional_integer("tokenizer.ggml.bos_token_id"),
        eos_id=md.optional_integer("tokenizer.ggml.eos_token_id"),
        unk_id=md.optional_integer("tokenizer.ggml.unknown_token_id"),
        pad_id=md.optional_integer("tokenizer.ggml.padding_token_id"),
        eot_id=md.optional_integer("tokenizer.ggml.eot_token_id"),
        eom_id=md.optional_integer("tokenizer.ggml.eom_token_id"),
        # llama.cpp adds bos to a SentencePiece vocabulary that does not say otherwise
        add_bos=md.flag("tokenizer.ggml.add_bos_token", model == "llama"),
        add_eos=md.flag("tokenizer.ggml.add_eos_token", False),
        add_space_prefix=md.flag("tokenizer.ggml.add_space_prefix", model == "llama"),
        chat_template=md.text("tokenizer.chat_template"),
    )


# ------------------------------------------------------------------ tensors

def undo_interleaved_rope(weight: np.ndarray[Any, np.dtype[np.float32]], heads: int) -> np.ndarray[Any, np.dtype[np.float32]]:
    """Inverse of convert_hf_to_gguf's LlamaModel.permute: each head's rows go from pairs (llama.cpp's
    rope) back to halves (Hugging Face's and MLX's)."""
    rows = weight.shape[0]
    return weight.reshape(heads, rows // heads // 2, 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


@dataclass(frozen=True)
class DTypePlan:
    """What the weights become: a float dtype, and MLX quantization bits for the matrices (0: none)."""

    name: ConcreteDType
    float_dtype: FloatDType
    bits: int

    @classmethod
    def of(cls, dtype: ConcreteDType, beside_quantized: FloatDType) -> DTypePlan:
        if dtype == "q4" or dtype == "q8":
            return cls(dtype, beside_quantized, QUANT_BITS[dtype])
        return cls(dtype, dtype, 0)

    def quantizes(self, name: str, shape: tuple[int, ...]) -> bool:
        """Matrices of linear and embedding layers whose rows split into whole groups, as mlx_lm.convert picks."""
        return bool(self.bits) and name.endswith(".weight") and len(shape) == 2 and shape[-1] % QUANT_GROUP_SIZE == 0


def float_beside_quantized() -> FloatDType:
    """The dtype of norms, biases and scales in a q4/q8 import: float16 on a GPU, as mlx-community ships
    them; float32 on a CPU, where MLX's float16 arithmetic is far slower (SmolLM2 q8 decoded 0.1 tok/s
    with float16 scales, 4.7 with float32, on a 2-core x86)."""
    import mlx.core as mx

    return "float16" if mx.default_device() == mx.gpu else "float32"


def resolve_dtype(dtype: ImportDType, source: GGUFSource) -> ConcreteDType:
    """``auto`` keeps the file's precision class: float stays float, 5–8 bit becomes q8, 4 bit and less q4."""
    if dtype != "auto":
        return dtype
    file_type = source.metadata.optional_integer("general.file_type")
    known = {t.value for t in LlamaFileType} - {LlamaFileType.GUESSED.value}
    name = LlamaFileType(file_type).name if file_type in known else _dominant_tensor_type(source)
    core = name.removeprefix("ALL_").removeprefix("MOSTLY_")
    if core in FLOAT_TYPES:
        return FLOAT_TYPES[core]
    bits = re.search(r"\d", core)  # Q4_K_M, IQ3_S, Q8_0 …
    return "q4" if bits is not None and int(bits[0]) <= 4 else "q8"


FLOAT_TYPES: dict[str, FloatDType] = {"F32": "float32", "F16": "float16", "BF16": "bfloat16"}


def _dominant_tensor_type(source: GGUFSource) -> str:
    counts: dict[str, int] = {}
    for t in source.tensors:
        if len(t.dims) == 2:
            counts[t.qtype.name] = counts.get(t.qtype.name, 0) + t.elements
    return max(counts, key=lambda k: counts[k]) if counts else "F32"


class ShardWriter:
    """Collects converted arrays and writes them as safetensors shards of at most ``limit`` bytes."""

    def __init__(self, folder: Path, limit: int = SHARD_BYTES) -> None:
        self.folder = folder
        self.limit = limit
        self.pending: dict[str, mx.array] = {}
        self.pending_bytes = 0
        self.written: list[tuple[Path, list[str]]] = []
        self.total_bytes = 0

    def add(self, arrays: Mapping[str, mx.array]) -> None:
        import mlx.core as mx

        mx.eval(*arrays.values())
        nbytes = sum(a.nbytes for a in arrays.values())
        if self.pending and self.pending_bytes + nbytes > self.limit:
            self.flush()
        self.pending.update(arrays)
        self.pending_bytes += nbytes
        self.total_bytes += nbytes

    def flush(self) -> None:
        import mlx.core as mx

        if not self.pending:
            return
        path = self.folder / f"shard-{len(self.written) + 1:05d}.safetensors"
        mx.save_safetensors(str(path), self.pending, metadata={"format": "mlx"})
        self.written.append((path, sorted(self.pending)))
        self.pending, self.pending_bytes = {}, 0

    def finish(self) -> None:
        """Name the shards as mlx-lm writes them (and an index when there are several)."""
        self.flush()
        if len(self.written) == 1:
            self.written[0][0].rename(self.folder / "model.safetensors")
            return
        weight_map: dict[str, str] = {}
        for number, (path, names) in enumerate(self.written, start=1):
            final = f"model-{number:05d}-of-{len(self.written):05d}.safetensors"
            path.rename(self.folder / final)
            weight_map.update(dict.fromkeys(names, final))
        index = {"metadata": {"total_size": self.total_bytes}, "weight_map": dict(sorted(weight_map.items()))}
        (self.folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=1))


def convert_tensors(source: GGUFSource, layout: Layout, config: Mapping[str, Any], plan: DTypePlan,
                    out: Path, *, progress: bool) -> None:
    """Every tensor, dequantized, put back in Hugging Face layout, cast or quantized, into shards in ``out``."""
    from tqdm import tqdm

    named = _mapped_tensors(source, layout)
    writer = ShardWriter(out)
    with tqdm(total=sum(t.n_bytes for t, _ in named), unit="B", unit_scale=True, disable=not progress,
              desc=f"importing {source.parts[0].name}") as bar:
        for tensor, name in named:
            weight = _in_hf_layout(tensor, name, tensor_array(source, tensor), layout, config)
            writer.add(_converted(name, weight, plan))
            bar.update(tensor.n_bytes)
    writer.finish()


def _mapped_tensors(source: GGUFSource, layout: Layout) -> list[tuple[TensorInfo, str]]:
    """(tensor, mlx-lm name) for every tensor; an error for one the layout has no place for."""
    named: list[tuple[TensorInfo, str]] = []
    for tensor in source.tensors:
        if tensor.name == ROPE_FREQS:
            continue  # became config.json's rope_scaling
        name = layout.tensor_name(tensor.name)
        if name is None:
            raise GGUFImportError(f"{source.metadata.source}: tensor {tensor.name!r} has no place in flow's "
                                  f"{source.architecture} layout; this GGUF is a variant flow does not import")
        named.append((tensor, name))
    return named


def _in_hf_layout(tensor: TensorInfo, name: str, weight: np.ndarray[Any, np.dtype[np.float32]], layout: Layout,
                  config: Mapping[str, Any]) -> np.ndarray[Any, np.dtype[np.float32]]:
    """Undo what llama.cpp's converter did to this tensor."""
    stem = BLOCK_TENSOR.match(tensor.name)
    if layout.interleaved_qk and stem is not None and stem["stem"] in ("attn_q", "attn_k"):
        heads = config["num_attention_heads"] if stem["stem"] == "attn_q" else config["num_key_value_heads"]
        weight = undo_interleaved_rope(weight, heads)
    if layout.norm_shift and name.endswith("norm.weight"):
        weight = weight - np.float32(layout.norm_shift)
    return weight


def _converted(name: str, weight: np.ndarray[Any, np.dtype[np.float32]], plan: DTypePlan) -> dict[str, mx.array]:
    import mlx.core as mx

    array = mx.array(weight).astype(getattr(mx, plan.float_dtype))
    if not plan.quantizes(name, weight.shape):
        return {name: array}
    quantized, scales, biases = mx.quantize(array, group_size=QUANT_GROUP_SIZE, bits=plan.bits)
    stem = name.removesuffix(".weight")
    return {name: quantized, f"{stem}.scales": scales, f"{stem}.biases": biases}


# ------------------------------------------------------------------ the import, cached and atomic

@dataclass(frozen=True)
class ImportResult:
    path: Path  # the MLX model directory
    dtype: str  # what the weights became
    reused: bool  # True when an earlier import was found
    seconds: float


@dataclass(frozen=True)
class Identity:
    """What makes two imports the same: the parts as found on disk, the dtype asked for, this importer."""

    parts: tuple[tuple[str, int, int], ...]  # (name, size, mtime_ns)
    dtype: ImportDType
    beside_quantized: FloatDType
    version: int = IMPORTER_VERSION

    @classmethod
    def of(cls, parts: tuple[Path, ...], dtype: ImportDType) -> Identity:
        stats = [(p.name, p.stat()) for p in parts]
        return cls(tuple((name, s.st_size, s.st_mtime_ns) for name, s in stats), dtype, float_beside_quantized())

    def as_json(self) -> dict[str, Any]:
        return {"parts": [list(p) for p in self.parts], "dtype": self.dtype,
                "beside_quantized": self.beside_quantized, "importer_version": self.version}

    @property
    def digest(self) -> str:
        return hashlib.sha256(json.dumps(self.as_json(), sort_keys=True).encode()).hexdigest()[:12]


def default_import_dir(parts: tuple[Path, ...], identity: Identity) -> Path:
    name = re.sub(r"[^\w.+-]+", "_", gguf_model_name(parts[0].name)) or "model"
    return gguf_cache_dir() / f"{name}-{identity.dtype}-{identity.digest}"


def import_gguf(path: Path | str, *, dtype: ImportDType = "auto", out: Path | None = None,
                progress: bool = True) -> ImportResult:
    """Import the GGUF at ``path`` (any part of a split one) as an MLX model directory, once.

    The directory is ``out``, else one in :func:`gguf_cache_dir` named by the file's identity and
    ``dtype``; when it already holds this import it is returned as it is (``reused``)."""
    started = time.perf_counter()
    if dtype not in IMPORT_DTYPES:
        raise GGUFImportError(f"dtype {dtype!r} is not one of {', '.join(IMPORT_DTYPES)}")
    parts = gguf_parts(Path(path).expanduser())
    identity = Identity.of(parts, dtype)
    dest = (out.expanduser() if out is not None else default_import_dir(parts, identity)).absolute()
    stamp = _read_stamp(dest)
    if stamp is not None and stamp.get("digest") == identity.digest:
        return ImportResult(dest, str(stamp.get("dtype", dtype)), True, time.perf_counter() - started)
    if stamp is None and dest.exists() and (not dest.is_dir() or any(dest.iterdir())):
        raise GGUFImportError(f"{dest} exists and is not a GGUF import of flow's; choose another --out directory")
    source = read_source(parts)
    concrete = resolve_dtype(dtype, source)
    log.info("importing %s as %s into %s (once; later starts reuse it) …", parts[0], concrete, dest)
    dest.parent.mkdir(parents=True, exist_ok=True)
    _remove_abandoned_partials(dest)
    partial = Path(tempfile.mkdtemp(prefix=f".{dest.name}.{os.getpid()}.", suffix=".partial", dir=dest.parent))
    try:
        plan = DTypePlan.of(concrete, identity.beside_quantized)
        details = write_model_dir(source, plan, partial, progress=progress)
        _write_stamp(partial, {"digest": identity.digest, "identity": identity.as_json(),
                               "source": [str(p.resolve()) for p in parts], "dtype": concrete,
                               "seconds": round(time.perf_counter() - started, 1), **details})
        _move_into_place(partial, dest, identity.digest)
    finally:
        shutil.rmtree(partial, ignore_errors=True)
    seconds = time.perf_counter() - started
    log.info("imported %s in %.1f s", parts[0].name, seconds)
    return ImportResult(dest, concrete, False, seconds)


def write_model_dir(source: GGUFSource, plan: DTypePlan, out: Path, *, progress: bool) -> dict[str, Any]:
    """config.json, weights and tokenizer files of ``source`` into the (empty) directory ``out``."""
    layout = layout_for(source)
    vocab = vocabulary(source)
    facts = model_facts(source)
    config = model_config(source, layout, facts, vocab)
    try:
        write_tokenizer_files(vocab, out, config["max_position_embeddings"])
    except VocabularyError as exc:
        raise GGUFImportError(f"{source.metadata.source}: {exc}") from None
    convert_tensors(source, layout, config, plan, out, progress=progress)
    if plan.bits:
        quantization = {"group_size": QUANT_GROUP_SIZE, "bits": plan.bits, "mode": "affine"}
        config.update(quantization=quantization, quantization_config=quantization)
    (out / "config.json").write_text(json.dumps(config, indent=1))
    return {"architecture": source.architecture, "name": source.metadata.text("general.name")}


def _read_stamp(folder: Path) -> dict[str, Any] | None:
    try:
        stamp = json.loads((folder / STAMP).read_text())
    except (OSError, ValueError):
        return None
    return stamp if isinstance(stamp, dict) else None


def _write_stamp(folder: Path, stamp: Mapping[str, Any]) -> None:
    (folder / STAMP).write_text(json.dumps(stamp, indent=1))


def _move_into_place(partial: Path, dest: Path, digest: str) -> None:
    """Rename the finished import to ``dest``: onto nothing or an empty directory directly, else replacing an
    older import of flow's there; if another process finished the same import first, keep theirs."""
    try:
        os.rename(partial, dest)
        return
    except OSError:
        stamp = _read_stamp(dest)
        if stamp is None:
            raise
        if stamp.get("digest") == digest:
            return
    old = Path(tempfile.mkdtemp(prefix=f".{dest.name}.{os.getpid()}.", suffix=".old", dir=dest.parent))
    os.rename(dest, old / "import")
    os.rename(partial, dest)
    shutil.rmtree(old, ignore_errors=True)


def _remove_abandoned_partials(dest: Path) -> None:
    """Partial directories beside ``dest`` whose importing process is gone (killed mid-import)."""
    prefix = f".{dest.name}."
    for candidate in _siblings(dest.parent, prefix):
        pid = candidate.name[len(prefix):].split(".", 1)[0]
        if pid.isdigit() and not _process_alive(int(pid)):
            shutil.rmtree(candidate, ignore_errors=True)


def _siblings(folder: Path, prefix: str) -> Iterator[Path]:
    return (p for p in folder.iterdir() if p.name.startswith(prefix) and p.name.endswith((".partial", ".old")))


def _process_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # someone else's process
    return True
