"""What configures an engine, importable without MLX (graphs are compiled and checked without it)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

Strategy = Literal["decode_first", "prefill_first", "balanced"]
STRATEGIES: tuple[Strategy, ...] = ("decode_first", "prefill_first", "balanced")


SpeculativeKind = Literal["off", "ngram", "draft", "mtp"]


@dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding: each step a row may propose up to ``max_draft`` tokens that the model verifies in
    the same forward pass. ``ngram``: prompt lookup, the continuation of the latest earlier occurrence of the
    row's last ``min_ngram``..``max_ngram`` tokens in its own prompt and output; ``draft``: a draft model's greedy
continuation (the engine is given the model); ``mtp``: the model's own multi-token-prediction layers, fed the
    model's last hidden states (runtime/mtp.py; the engine is given the drafter). Steps whose batch has more than
    ``max_batch`` rows decode as usual (verifying drafts costs compute a full batch no longer has to spare)."""

    kind: SpeculativeKind = "off"
    max_draft: int = 8
    min_ngram: int = 2
    max_ngram: int = 4
    max_batch: int = 4

    def __post_init__(self) -> None:
        if self.kind not in ("off", "ngram", "draft", "mtp"):
            raise ValueError(f"unknown speculative kind {self.kind!r}; expected off, ngram, draft or mtp")
        if self.max_draft < 1 or self.max_batch < 1 or not 1 <= self.min_ngram <= self.max_ngram:
            raise ValueError("max_draft and max_batch must be positive, 1 <= min_ngram <= max_ngram")


@dataclass(frozen=True)
class KVQuantization:
    """The live batch's quantized KV (runtime.quantized_kv): off without ``bits``. A batch's keys and values are
    stored ``bits``-quantized, in groups of ``group_size`` along the head dimension (None: the largest of 64
    and 32 that divides it), once one of its rows holds ``start`` tokens of context."""

    bits: int | None = None
    group_size: int | None = None
    start: int = 2048

    def __post_init__(self) -> None:
        if self.bits not in (None, 4, 8):
            raise ValueError(f"kv_bits must be 4 or 8 (or absent: full precision), not {self.bits!r}")
        if self.group_size not in (None, 32, 64, 128):
            raise ValueError(f"kv_group_size must be 32, 64 or 128, not {self.group_size!r}")
        if self.start < 0:
            raise ValueError("quantized_kv_start must be 0 or more tokens")

    @property
    def on(self) -> bool:
        return self.bits is not None


@dataclass(frozen=True)
class EngineConfig:
    max_batch: int = 32  # sequences decoding at once (rows of the batch)
    prefill_chunk: int = 512  # prompt tokens a prefill pass holds, and a step's prefill budget
    strategy: Strategy = "decode_first"
    max_queue: int = 256  # sequences waiting for a row beyond which submit refuses
    # While more prompts wait than rows decode, a step's budget is up to this many chunks (1: always one).
    prefill_burst: int = 4
    # Steps quicker than this hand their tokens out together (runtime/outbox.py; 0: every step's at once).
    stream_interval: float = 0.010
    speculative: SpeculativeConfig = SpeculativeConfig()
    kv_quantization: KVQuantization = KVQuantization()

    def __post_init__(self) -> None:
        if self.strategy not in STRATEGIES:
            raise ValueError(f"unknown strategy {self.strategy!r}; expected one of {', '.join(STRATEGIES)}")
        if self.max_batch < 1 or self.prefill_chunk < 1 or self.max_queue < 1 or self.prefill_burst < 1:
            raise ValueError("max_batch, prefill_chunk, max_queue and prefill_burst must be positive")
        if not 0 <= self.stream_interval <= 1:
            raise ValueError("stream_interval must be between 0 and 1 second")


class EngineOverloaded(Exception):
    """Too many sequences are waiting; the caller should retry after ``retry_after`` seconds."""

    def __init__(self, message: str, retry_after: float) -> None:
        super().__init__(message)
        self.retry_after = retry_after
