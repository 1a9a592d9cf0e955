"""What a tiny model is: :class:`TinySpec` (every field that decides its files), the named presets, and what the
real checkpoints of each text architecture have (:func:`arch_info`).

A spec decides its build byte for byte: :meth:`TinySpec.cache_key` hashes its fields with :data:`BUILDER_VERSION`,
and builds are cached under that key (runtime/tiny/build.py). Change what a spec builds and bump the version.
"""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import asdict, dataclass
from typing import Any, Literal, get_args

from runtime.tiny.archs import ARCHS, ArchInfo

Arch = Literal["qwen3", "llama", "gemma3", "bert", "modernbert", "gpt_oss", "deepseek_v3", "kimi_k2", "minimax",
               "seed_oss", "qwen3_5", "gemma4", "phi3", "granite", "granitemoehybrid", "llama4_text", "hermes3",
               "minicpm5", "deepseek_r1", "qwen3_next", "whisper", "soprano", "idefics3", "gemma3_vision", "qwen2",
               "qwen3_tts", "nemotron_h", "falcon_h1", "lfm2", "mamba2", "qwen2_vl", "qwen2_5_vl", "qwen3_vl",
               "mllama", "qwen3_5_vision"]
DType = Literal["float32", "bfloat16", "float16"]

# Bump when the bytes a spec builds change, so cached builds are not reused.
BUILDER_VERSION = 1

SMOKE_TEST_LABEL = "flow-smoke-test (random weights; output is gibberish)"

INIT_STD = 0.02  # HF's initializer_range: weight matrices are drawn from N(0, INIT_STD)
_MIN_VOCAB = 512  # 256 byte tokens + specials + some merges
ROWS_COLS = 6  # SmolVLM's vocabulary holds <row_1_col_1> … <row_6_col_6>

# The vision-language architectures (runtime/tiny/vlm.py): a TinySpec of one of them has a VisionSpec.
VLM_ARCHS = ("idefics3", "gemma3_vision", "qwen2_vl", "qwen2_5_vl", "qwen3_vl", "mllama", "qwen3_5_vision")


@dataclass(frozen=True)
class VisionSpec:
    """The vision side of a tiny vision-language model (the text side is the rest of its TinySpec)."""

    hidden_size: int = 32
    num_layers: int = 2
    num_heads: int = 2
    intermediate_size: int = 64
    image_size: int = 64  # the tower's input, square (idefics3: one tile)
    patch_size: int = 8
    tokens_per_image: int = 16  # image tokens per tile (idefics3), per image (gemma3), at most per image (Qwen-VL)
    max_tiles_per_side: int = 2  # idefics3: an image is split into at most this many tiles per side

    def __post_init__(self) -> None:
        if min(self.hidden_size, self.num_layers, self.num_heads, self.intermediate_size, self.image_size,
               self.patch_size, self.tokens_per_image, self.max_tiles_per_side) < 1:
            raise ValueError("vision sizes must be positive")
        if self.hidden_size % self.num_heads:
            raise ValueError("vision hidden_size must be a multiple of num_heads")
        if self.image_size % self.patch_size:
            raise ValueError("image_size must be a multiple of patch_size")
        if self.max_tiles_per_side > ROWS_COLS:
            raise ValueError(f"at most {ROWS_COLS} tiles per side (the vocabulary's <row_R_col_C> tokens)")
        # mlx-vlm's patch-embedding sanitize keeps a conv weight as MLX layout only when out >= kernel size.
        if self.hidden_size < self.patch_size:
            raise ValueError("vision hidden_size must be at least patch_size")
        side = self.image_size // self.patch_size
        per_side = math.isqrt(self.tokens_per_image)
        if per_side * per_side != self.tokens_per_image or side % per_side:
            raise ValueError("tokens_per_image must be a square whose side divides image_size // patch_size")

    @property
    def patches_per_side(self) -> int:
        return self.image_size // self.patch_size

    @property
    def pool(self) -> int:
        """Patches per image token along a side: idefics3's pixel-shuffle scale, gemma3's pooling kernel."""
        return self.patches_per_side // math.isqrt(self.tokens_per_image)


@dataclass(frozen=True)
class TinySpec:
    """Everything that determines a tiny model's files."""

    arch: Arch = "qwen3"
    hidden_size: int = 64
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int = 2
    intermediate_size: int = 128
    vocab_size: int = 1024  # BPE vocab size target (special tokens included)
    max_position_embeddings: int = 4096
    seed: int = 0
    dtype: DType = "float32"
    sliding_window: int = 512  # gemma3: the window of its sliding-window layers
    embedding: bool = False  # qwen3: a bare Qwen3Model (no language-model head), as embedding models ship
    vision: VisionSpec | None = None  # the vision archs (VLM_ARCHS): the vision tower (runtime/tiny/vlm.py)
    mtp_layers: int = 0  # qwen3_5: multi-token-prediction layers in the safetensors (``mtp.*``, as Qwen ships them)

    def __post_init__(self) -> None:
        if self.arch not in get_args(Arch):
            raise ValueError(f"unknown arch {self.arch!r}; expected one of {get_args(Arch)}")
        if self.dtype not in get_args(DType):
            raise ValueError(f"unsupported dtype {self.dtype!r}")
        sizes = (self.hidden_size, self.num_layers, self.num_heads, self.num_kv_heads, self.intermediate_size)
        if min(*sizes, self.max_position_embeddings) < 1:
            raise ValueError("model sizes must be positive")
        if self.hidden_size % self.num_heads:
            raise ValueError("hidden_size must be a multiple of num_heads")
        if self.num_heads % self.num_kv_heads:
            raise ValueError("num_heads must be a multiple of num_kv_heads")
        if self.vocab_size < _MIN_VOCAB:
            raise ValueError(f"vocab_size must be at least {_MIN_VOCAB}")
        if (self.arch in VLM_ARCHS) != (self.vision is not None):
            raise ValueError("a vision spec goes with a vision arch, and only with one")
        if self.mtp_layers and self.arch != "qwen3_5":
            raise ValueError("mtp_layers is a qwen3_5 setting")

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    def cache_key(self) -> str:
        """A short hash of every field and the builder version."""
        fields = asdict(self)
        if fields["sliding_window"] == 512:
            del fields["sliding_window"]  # added later: builds from before keep their keys
        if not fields["embedding"]:
            del fields["embedding"]
        if fields["vision"] is None:
            del fields["vision"]
        if not fields["mtp_layers"]:
            del fields["mtp_layers"]  # added later: builds without it keep their keys
        payload = json.dumps({"builder": BUILDER_VERSION, **fields}, sort_keys=True)
        return hashlib.sha256(payload.encode()).hexdigest()[:12]


PRESETS: dict[str, TinySpec] = {
    "tiny-qwen3": TinySpec(),
    "tiny-llama": TinySpec(arch="llama"),
    "tiny-gemma3": TinySpec(arch="gemma3"),
    # The model families' architectures (runtime/tiny/archs.py), with their real chat templates.
    "tiny-gpt-oss": TinySpec(arch="gpt_oss", intermediate_size=64),
    "tiny-deepseek-v3": TinySpec(arch="deepseek_v3", intermediate_size=64),
    "tiny-deepseek-r1": TinySpec(arch="deepseek_r1", intermediate_size=64),
    "tiny-kimi-k2": TinySpec(arch="kimi_k2", intermediate_size=64),
    "tiny-minimax-m2": TinySpec(arch="minimax", intermediate_size=64),
    "tiny-seed-oss": TinySpec(arch="seed_oss", intermediate_size=64),
    "tiny-qwen3.5": TinySpec(arch="qwen3_5", intermediate_size=64),
    # Qwen3.5 with its MTP layer in the safetensors, as Qwen ships it (speculative kind "mtp").
    "tiny-qwen3.5-mtp": TinySpec(arch="qwen3_5", intermediate_size=64, mtp_layers=1),
    "tiny-qwen3-next": TinySpec(arch="qwen3_next", intermediate_size=64),
    # The other hybrids of mlx-lm, each a layout of layer caches of its own (the prefix cache's state snapshots):
    # Nemotron-H's Mamba-2 and attention blocks between MLP ones (caches for the first two only), LFM2's
    # short-convolution windows (one array per layer, no recurrent matrix), Falcon-H1's attention and Mamba-2 side
    # by side in every layer (a CacheList per layer), Mamba-2 alone (no attention layer: blocks without KV).
    "tiny-nemotron-h": TinySpec(arch="nemotron_h", num_layers=5, intermediate_size=64),
    "tiny-lfm2": TinySpec(arch="lfm2", intermediate_size=64),
    "tiny-falcon-h1": TinySpec(arch="falcon_h1", intermediate_size=64),
    "tiny-mamba2": TinySpec(arch="mamba2", intermediate_size=128),
    # Qwen2 / Qwen2.5: in mlx-lm both tensor and pipeline parallel (runtime.distributed).
    "tiny-qwen2": TinySpec(arch="qwen2"),
    "tiny-gemma4": TinySpec(arch="gemma4", intermediate_size=64),
    "tiny-phi4-mini": TinySpec(arch="phi3", intermediate_size=64),
    "tiny-granite3": TinySpec(arch="granite", intermediate_size=64),
    "tiny-granite4": TinySpec(arch="granitemoehybrid", intermediate_size=64),
    "tiny-llama4": TinySpec(arch="llama4_text", intermediate_size=64),
    "tiny-hermes3": TinySpec(arch="hermes3", intermediate_size=64),
    "tiny-minicpm5": TinySpec(arch="minicpm5", intermediate_size=64),
    # Embedding models (mlx-embeddings): an encoder with a WordPiece tokenizer, and a decoder-style one.
    "tiny-bert": TinySpec(arch="bert", hidden_size=32, num_heads=2, num_kv_heads=2, intermediate_size=128,
                          vocab_size=1000, max_position_embeddings=512),
    "tiny-qwen3-embedding": TinySpec(embedding=True),
    # Speech to text (mlx-audio): a multilingual Whisper layout (runtime/tiny/audio.py).
    "tiny-whisper": TinySpec(arch="whisper", hidden_size=64, num_heads=2, num_kv_heads=2, intermediate_size=256),
    # Text to speech (mlx-audio): a Soprano (Qwen3 language model + Vocos decoder) (runtime/tiny/audio.py).
    "tiny-soprano": TinySpec(arch="soprano", vocab_size=600),
    # Text to speech that batches requests: a Qwen3-TTS CustomVoice (talker, code predictor, 12 Hz codec decoder).
    "tiny-qwen3-tts": TinySpec(arch="qwen3_tts", vocab_size=600),
    "tiny-reranker": TinySpec(arch="modernbert", hidden_size=32, num_heads=2, num_kv_heads=2, intermediate_size=64,
                              vocab_size=1000, max_position_embeddings=512),
    # Vision-language models (mlx-vlm), runtime/tiny/vlm.py. SmolVLM: 16 image tokens per 64 px tile, an image
    # split into at most 2x2 tiles plus a global view (80 tokens; 48 for a wide strip).
    "tiny-smolvlm": TinySpec(arch="idefics3", vision=VisionSpec()),
    # Gemma 3: every image is 16 soft tokens; a 32-token window on the sliding layer, so a prompt with an image
    # already wraps the rotating cache.
    "tiny-gemma3-vision": TinySpec(arch="gemma3_vision", sliding_window=32, vision=VisionSpec()),
    # The Qwen vision-language models (3-D M-RoPE positions; runtime/tiny/qwen_vl.py): 8-pixel patches merged 2x2,
    # so an image costs one token per 16 x 16 pixels after its resize (80 x 48: 15 tokens), at most 16.
    "tiny-qwen2-vl": TinySpec(arch="qwen2_vl", vision=VisionSpec()),
    "tiny-qwen2.5-vl": TinySpec(arch="qwen2_5_vl", vision=VisionSpec()),
    "tiny-qwen3-vl": TinySpec(arch="qwen3_vl", vision=VisionSpec()),
    # Qwen3.5's vision variant: Qwen3-VL's tower (no deepstack) beside the hybrid language model of tiny-qwen3.5
    # (gated-delta and attention layers alternating), whose attention takes 3-D positions.
    "tiny-qwen3.5-vl": TinySpec(arch="qwen3_5_vision", intermediate_size=64, vision=VisionSpec()),
    # Llama 3.2 Vision (images by cross-attention; runtime/tiny/mllama.py): 3 layers, the middle one cross-attention;
    # 32-pixel tiles of 8-pixel patches, at most 4 tiles an image (4 x 17 vision tokens, one <|image|> token).
    "tiny-mllama": TinySpec(arch="mllama", num_layers=3, vision=VisionSpec(image_size=32, tokens_per_image=4)),
    # A vision tower that costs real time on a CPU: SigLIP-B/14-224's width at half its depth (256 patches, 6
    # layers of 768, ~43M parameters; real VLMs' towers are larger still), 64 tokens per image.
    "bench-vlm": TinySpec(arch="gemma3_vision", hidden_size=384, num_layers=4, num_heads=6, num_kv_heads=2,
                          intermediate_size=1024, vocab_size=4096, vision=VisionSpec(
                              hidden_size=768, num_layers=6, num_heads=12, intermediate_size=3072, image_size=224,
                              patch_size=14, tokens_per_image=64)),
    # bench-vlm's sizes as a Qwen2.5-VL: its tower at SigLIP-B's width and half its depth over 14-pixel patches
    # merged 2x2, a picture at most 336 x 336 pixels' worth (640 x 480: 280 x 364, 520 patches, 130 tokens).
    "bench-qwen2.5-vl": TinySpec(arch="qwen2_5_vl", hidden_size=384, num_layers=4, num_heads=6, num_kv_heads=2,
                                 intermediate_size=1024, vocab_size=4096, vision=VisionSpec(
                                     hidden_size=768, num_layers=6, num_heads=12, intermediate_size=3072,
                                     image_size=336, patch_size=14, tokens_per_image=144)),
    # A hybrid of ~35M parameters (gated-delta and attention layers alternating, float32): the prefix cache's
    # state snapshots measured where a prefill costs real time (scripts/bench_prefix.py).
    "bench-qwen3.5": TinySpec(arch="qwen3_5", hidden_size=512, num_layers=8, num_heads=8, num_kv_heads=2,
                              intermediate_size=1536, vocab_size=8192, max_position_embeddings=32768),
    # ~88M parameters (untied lm_head): big enough that decode speed means something.
    "bench-80m": TinySpec(
        arch="qwen3",
        hidden_size=768,
        num_layers=12,
        num_heads=12,
        num_kv_heads=4,
        intermediate_size=2048,
        vocab_size=8192,
        max_position_embeddings=32768,
        dtype="float32",
    ),
}


def arch_info(arch: Arch) -> ArchInfo:
    """What the real checkpoints of ``arch`` have: special tokens, stop tokens, chat template."""
    return ARCHS[arch]


def size_fields(spec: TinySpec) -> dict[str, Any]:
    """A config's size fields, as every transformer config writes them."""
    return {"hidden_size": spec.hidden_size, "intermediate_size": spec.intermediate_size,
            "num_hidden_layers": spec.num_layers, "num_attention_heads": spec.num_heads,
            "num_key_value_heads": spec.num_kv_heads, "head_dim": spec.head_dim, "vocab_size": spec.vocab_size,
            "max_position_embeddings": spec.max_position_embeddings}
