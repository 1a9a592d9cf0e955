"""The engine's counters and recent history: what ``/stats`` reports of a model and what its admission reads.

:class:`EngineStats` holds the running totals the device thread updates; :class:`Tally` adds the recent history
(token rates, times to first token, finish times) with the verbs the phases call — a first token, finished rows,
a step done — and turns both into ``/stats``' JSON. Safe to read from any thread (the device thread writes).

Never imports the engine, MLX or trio.
"""

from __future__ import annotations

import statistics
import time
from collections import deque
from dataclasses import asdict, dataclass
from typing import Any


@dataclass
class EngineStats:
    submitted: int = 0
    finished: int = 0
    cancelled: int = 0
    failed: int = 0
    rejected: int = 0  # refused by submit: the queue was full
    prompt_tokens: int = 0  # prompt tokens computed (cached ones excluded)
    cached_tokens: int = 0  # prompt tokens handed in already in a cache
    generated_tokens: int = 0
    steps: int = 0
    decode_steps: int = 0
    prefill_chunks: int = 0  # prefill forward passes
    grouped_prefills: int = 0  # of those, the ones that prefilled several prompts together
    batch_size: int = 0  # rows in the decode batch after the last step
    peak_batch: int = 0
    kv_bytes: int = 0  # KV cache bytes held by all sequences after the last step
    decode_seconds: float = 0.0
    prefill_seconds: float = 0.0
    speculative_steps: int = 0  # decode steps that verified drafts
    draft_tokens: int = 0  # tokens proposed by speculative decoding
    accepted_tokens: int = 0  # of those, the ones the model accepted


class Tally:
    """The totals and the recent history (64 entries each) the rates, TTFT and retry-after estimates read."""

    def __init__(self) -> None:
        self.stats = EngineStats()
        self._rates: deque[tuple[float, int, int]] = deque(maxlen=64)  # (time, generated, prompt tokens)
        self._ttfts: deque[float] = deque(maxlen=64)
        self._finish_times: deque[float] = deque(maxlen=64)

    def first_token(self, submitted_at: float, now: float) -> None:
        self._ttfts.append(now - submitted_at)

    def finished(self, rows: int, now: float) -> None:
        self.stats.finished += rows
        self._finish_times.extend([now] * rows)

    def step_done(self) -> None:
        s = self.stats
        s.steps += 1
        now = time.perf_counter()
        if not self._rates or now - self._rates[-1][0] > 0.1:
            self._rates.append((now, s.generated_tokens, s.prompt_tokens))

    def retry_after(self, excess: int) -> float:
        """Seconds until about ``excess`` queue places free up, from the recent finish rate."""
        times = list(self._finish_times)
        if len(times) >= 2 and times[-1] > times[0]:
            rate = (len(times) - 1) / (times[-1] - times[0])
            return float(min(60, max(1, round(excess / rate))))
        return 1.0

    def json(self) -> dict[str, Any]:
        """The totals, the overall and recent token rates and the recent median TTFT, ready for ``/stats``."""
        s = self.stats
        out: dict[str, Any] = asdict(s)
        rates = list(self._rates)
        recent_decode = recent_prefill = 0.0
        if len(rates) >= 2 and rates[-1][0] > rates[0][0]:
            span = rates[-1][0] - rates[0][0]
            recent_decode = (rates[-1][1] - rates[0][1]) / span
            recent_prefill = (rates[-1][2] - rates[0][2]) / span
        ttfts = list(self._ttfts)
        out.update(
            decode_tokens_per_second=round(s.generated_tokens / s.decode_seconds, 1) if s.decode_seconds else 0.0,
            prefill_tokens_per_second=round(s.prompt_tokens / s.prefill_seconds, 1) if s.prefill_seconds else 0.0,
            recent_decode_tokens_per_second=round(recent_decode, 1),
            recent_prefill_tokens_per_second=round(recent_prefill, 1),
            ttft_ms_median_recent=round(statistics.median(ttfts) * 1000, 1) if ttfts else None,
        )
        for key in ("decode_seconds", "prefill_seconds"):
            out[key] = round(out[key], 3)
        return out
