"""Speculative decoding's two halves that are not the engine's: proposing drafts and accepting them exactly.

**Drafts by prompt lookup** (n-gram): agents rewrite what they just read — a file with a small edit, a diff, a
JSON echo — so the continuation of the latest earlier occurrence of a row's last few tokens, in its own prompt
and output, is often what the model writes next. No second model, no extra weights. Each row adapts its draft
length to how much of its drafts the model accepts, down to none (a cool-down after repeated misses), so text
without repetition costs nothing.

**Verification** keeps the output exactly the model's: a greedy row accepts the draft tokens the model's argmax
agrees with, then takes the model's own next token; a sampled row accepts draft token ``d`` with probability
``p(d)`` under its processed distribution (temperature, top-p, min-p, top-k) and, at the first rejection,
samples from ``p`` without ``d`` — standard speculative rejection sampling for a deterministic draft, whose
tokens follow the target distribution (tests/runtime/test_speculative.py measures it).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import mlx.core as mx
import numpy as np
from mlx_lm.sample_utils import apply_min_p, apply_top_k, apply_top_p

from runtime.engine_config import SpeculativeConfig
from runtime.sampling import SequenceSampler

COOL_DOWN_STEPS = 8  # steps without drafting after MISSES_BEFORE_COOL_DOWN drafts in a row found nothing accepted
MISSES_BEFORE_COOL_DOWN = 3


@dataclass
class DraftState:
    """One row's token history (prompt, then output) and how long its drafts are now."""

    config: SpeculativeConfig
    tokens: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    count: int = 0
    length: int = 0  # the draft length to propose next (adapted)
    misses: int = 0
    cool_down: int = 0
    proposed: int = 0
    accepted: int = 0

    def __post_init__(self) -> None:
        self.length = max(1, self.config.max_draft // 2)

    def extend(self, tokens: list[int]) -> None:
        need = self.count + len(tokens)
        if need > self.tokens.shape[0]:
            grown = np.zeros(max(need, 2 * self.tokens.shape[0], 256), dtype=np.int64)
            grown[: self.count] = self.tokens[: self.count]
            self.tokens = grown
        self.tokens[self.count : need] = tokens
        self.count = need

    def propose(self, limit: int) -> list[int]:
        """Up to ``min(limit, length)`` tokens continuing the latest earlier match of the history's last
        n-gram (longest n first); none while cooling down or without a match."""
        if self.cool_down > 0:
            self.cool_down -= 1
            return []
        want = min(limit, self.length)
        history = self.tokens[: self.count]
        for n in range(self.config.max_ngram, self.config.min_ngram - 1, -1):
            if self.count <= n or want <= 0:
                continue
            pattern = history[-n:]
            # Starts of earlier occurrences of the pattern (not the suffix itself), latest first.
            starts = np.flatnonzero(history[: self.count - n] == pattern[0])
            for j in range(1, n):
                starts = starts[history[starts + j] == pattern[j]]
            if starts.size:
                begin = int(starts[-1]) + n
                draft = history[begin : begin + want]
                if draft.size:
                    return [int(t) for t in draft]
        return []

    def record(self, proposed: int, accepted: int) -> None:
        """Adapt the draft length: longer after a draft fully accepted, shorter after a partial one."""
        if proposed == 0:
            return
        self.proposed += proposed
        self.accepted += accepted
        if accepted == proposed:
            self.length = min(self.config.max_draft, self.length * 2)
            self.misses = 0
        else:
            self.length = max(1, accepted + 1)
            self.misses = self.misses + 1 if accepted == 0 else 0
            if self.misses >= MISSES_BEFORE_COOL_DOWN:
                self.cool_down, self.misses = COOL_DOWN_STEPS, 0


def greedy_accepts(targets: list[int], draft: list[int]) -> int:
    """How many leading draft tokens equal the model's argmax at their positions."""
    accepted = 0
    for want, got in zip(targets, draft):
        if want != got:
            break
        accepted += 1
    return accepted


def _filtered(sampler: SequenceSampler, logprobs: mx.array) -> mx.array:
    """Log-probabilities after the sampler's filters, scaled by its temperature: what it samples from."""
    p = sampler.params
    out = logprobs
    if 0.0 < p.top_p < 1.0:
        out = apply_top_p(out, p.top_p)
    if p.min_p > 0.0:
        out = apply_min_p(out, p.min_p)
    if p.top_k > 0:
        out = apply_top_k(out, p.top_k)
    return out * (1.0 / p.temperature)


def sampled_verify(sampler: SequenceSampler, logprobs: mx.array, draft: list[int]) -> tuple[int, int]:
    """Rejection-sample a deterministic draft against a sampled row: ``logprobs`` is ``[len(draft) + 1, vocab]``
    (the row's window). Returns (tokens accepted, the next token: the correction at the first rejection, or
    the bonus after a fully accepted draft)."""
    scaled = _filtered(sampler, logprobs)
    normalized = scaled - mx.logsumexp(scaled, axis=-1, keepdims=True)
    k = len(draft)
    if k:
        chosen = mx.take_along_axis(normalized[:k], mx.array(draft, dtype=mx.int32)[:, None], axis=-1)[:, 0]
        uniforms = mx.random.uniform(shape=(k,), key=sampler.next_key())
        accept = np.asarray(mx.log(uniforms) < chosen)  # u < p(d), in log space
        rejected = np.flatnonzero(~accept)
        accepted = int(rejected[0]) if rejected.size else k
    else:
        accepted = 0
    row = normalized[accepted]
    if accepted < k:  # the residual max(0, p - q) with q the draft's point mass: p without the draft token
        row = mx.where(mx.arange(row.shape[-1]) == draft[accepted], mx.array(-mx.inf, dtype=row.dtype), row)
    token = int(np.asarray(mx.random.categorical(row, key=sampler.next_key())))
    return accepted, token
