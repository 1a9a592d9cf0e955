"""What configures an engine, importable without MLX (graphs are compiled and checked without it)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

Strategy = Literal["decode_first", "prefill_first", "balanced"]
STRATEGIES: tuple[Strategy, ...] = ("decode_first", "prefill_first", "balanced")


@dataclass(frozen=True)
class EngineConfig:
    max_batch: int = 32  # sequences decoding at once (rows of the batch)
    prefill_chunk: int = 512  # prompt tokens prefilled per step, across sequences
    strategy: Strategy = "decode_first"
    max_queue: int = 256  # sequences waiting for a row beyond which submit refuses

    def __post_init__(self) -> None:
        if self.strategy not in STRATEGIES:
            raise ValueError(f"unknown strategy {self.strategy!r}; expected one of {', '.join(STRATEGIES)}")
        if self.max_batch < 1 or self.prefill_chunk < 1 or self.max_queue < 1:
            raise ValueError("max_batch, prefill_chunk and max_queue must be positive")


class EngineOverloaded(Exception):
    """Too many sequences are waiting; the caller should retry after ``retry_after`` seconds."""

    def __init__(self, message: str, retry_after: float) -> None:
        super().__init__(message)
        self.retry_after = retry_after
