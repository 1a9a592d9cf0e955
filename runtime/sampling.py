"""Sampling for a batch of sequences, each with its own :class:`SamplingParams`.

Theory of operation
-------------------
The engine runs one forward pass for the whole decode batch and hands the
``[B, vocab]`` logits of the last position to :func:`sample_batch`, together
with one :class:`SequenceSampler` per row. Everything stays lazy (``mx.array``
graphs); the engine evaluates the result with ``mx.async_eval`` so the device
computes while Python delivers the previous step.

Per-row independence is the rule: a row's token depends only on that row's
logits, its own penalties context and its own random key, never on its
neighbours. So

* greedy rows use exactly the operations of ``mlx_lm.generate``
  (log-softmax, then argmax), batched over the rows: a row-wise reduction
  gives each row the same value it would get alone. A batch of float32 logits
  whose rows are all greedy and report no logprobs skips the log-softmax: its
  argmax is the logits' (a constant shift per row; float32 rounding would make a
  tie of two logits only within a few units of its last place — none in 160k
  random rows of small logits, where bfloat16 made 7 %, float16 1 %: in those
  dtypes mlx-lm's operations and ties are kept), and its exponentials over the
  vocabulary were most of a small model's sampling (~1.9 ms a row a step for a
  152k vocabulary on the CPU);
* logits processors (logit bias, repetition/presence/frequency penalties —
  mlx-lm's own functions) run on the rows that have them, one row at a time;
* sampled rows draw with the sequence's own key, split once per token, so a
  seeded request gives the same text alone or inside any batch.

Rows with a grammar constraint (structured output) get their disallowed tokens
set to -inf before sampling, from the mask their matcher computed for this step;
unconstrained rows are left as they are.

Rows that asked for logprobs get the sampled token's log-probability and the
top alternatives as three small arrays (:class:`LogprobReport`), read with one
``tolist()`` per array per step rather than per token.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import mlx.core as mx
import numpy as np
from mlx_lm.sample_utils import apply_min_p, apply_top_k, apply_top_p, make_logits_processors

from protocols.ir import SamplingParams, TokenLogprob
from runtime.constrained import Constraint

LogitsProcessor = Callable[[mx.array, mx.array], mx.array]


class SequenceSampler:
    """One sequence's sampling state: its processors, its grammar constraint if any, and, when it samples, its
    seed.

    The token at each position of the output is drawn with the Gumbel-max trick from noise keyed by the seed
    and the position alone: the same seed gives the same tokens however they were computed — one per step,
    or several per step by speculative decoding (:mod:`runtime.speculative`)."""

    def __init__(self, params: SamplingParams, constraint: Constraint | None = None) -> None:
        self.params = params
        self.constraint = constraint
        self.processors: list[LogitsProcessor] = make_logits_processors(
            logit_bias=dict(params.logit_bias) or None,
            repetition_penalty=params.repetition_penalty,
            repetition_context_size=params.repetition_context_size,
            presence_penalty=params.presence_penalty,
            frequency_penalty=params.frequency_penalty,
        )
        # How much history the penalties look at (they slice it themselves).
        self.history_window = max(params.repetition_context_size, 20) if self.processors else 0
        self.greedy = params.greedy
        self.top_logprobs = params.logprobs  # None: the request did not ask for logprobs
        self.seed = params.seed if params.seed is not None else random.getrandbits(63)
        self.drawn = 0  # tokens sampled so far: the position of the next draw

    def process(self, logits: mx.array, context: mx.array) -> mx.array:
        """Apply this sequence's logits processors to its ``[1, vocab]`` row."""
        for processor in self.processors:
            logits = processor(context, logits)
        return logits

    def scaled(self, logprobs: mx.array) -> mx.array:
        """Rows of log-probabilities after the sampler's filters (top-p, min-p, top-k), divided by its
        temperature: the logits it samples from."""
        p = self.params
        filtered = logprobs
        if 0.0 < p.top_p < 1.0:
            filtered = apply_top_p(filtered, p.top_p)
        if p.min_p > 0.0:
            filtered = apply_min_p(filtered, p.min_p)
        if p.top_k > 0:
            filtered = apply_top_k(filtered, p.top_k)
        return filtered * (1.0 / p.temperature)

    def draws(self, scaled: mx.array) -> mx.array:
        """The tokens drawn at the next ``len(scaled)`` positions, one per row of ``scaled`` (``[n, vocab]``),
        without advancing: each is the argmax of the row plus Gumbel noise keyed by its position."""
        assert not self.greedy, "greedy sequences are sampled in the batch, not here"
        noise = mx.stack([mx.random.gumbel(shape=scaled.shape[-1:], key=self._key_at(self.drawn + j))
                          for j in range(scaled.shape[0])])
        return mx.argmax(scaled + noise.astype(scaled.dtype), axis=-1)

    def sample(self, logprobs: mx.array) -> mx.array:
        """Draw one token (``[1]``) from a ``[1, vocab]`` row of log-probabilities."""
        token = self.draws(self.scaled(logprobs))
        self.drawn += 1
        return token

    def _key_at(self, position: int) -> mx.array:
        return mx.random.key((self.seed * 0x9E3779B97F4A7C15 + position) % (1 << 63))

    @property
    def plain(self) -> bool:
        """Sampled from the model's distribution alone: no penalties or bias, no grammar, no logprobs asked
        (what speculative decoding verifies exactly)."""
        return not self.processors and self.constraint is None and self.top_logprobs is None


@dataclass(frozen=True)
class LogprobReport:
    """Lazy logprob figures for the rows that asked for them, in ``rows`` order."""

    rows: tuple[int, ...]  # row indices in the batch the report was computed for
    chosen: mx.array  # [R] log-probability of each row's sampled token
    top_ids: mx.array  # [R, k] best alternatives, most likely first
    top_values: mx.array  # [R, k]

    def arrays(self) -> list[mx.array]:
        return [self.chosen, self.top_ids, self.top_values]

    def read(self, tokens: Sequence[int], wanted: Sequence[int]) -> list[TokenLogprob]:
        """The reports as IR values; ``tokens`` and ``wanted`` (top-k asked) are in ``rows`` order."""
        chosen: list[float] = self.chosen.tolist()  # type: ignore[assignment]
        ids: list[list[int]] = self.top_ids.tolist()  # type: ignore[assignment]
        values: list[list[float]] = self.top_values.tolist()  # type: ignore[assignment]
        out: list[TokenLogprob] = []
        for i, token in enumerate(tokens):
            k = wanted[i]
            top: tuple[tuple[int | str, float], ...] = tuple(zip(ids[i][:k], values[i][:k])) if k > 0 else ()
            out.append(TokenLogprob(token, float(chosen[i]), top))
        return out


@dataclass(frozen=True)
class BatchSample:
    tokens: mx.array  # [B] uint32
    report: LogprobReport | None


def _runs(flags: Sequence[bool]) -> list[tuple[int, int, bool]]:
    """Split row indices into maximal runs of equal flags: (start, stop, flag)."""
    runs: list[tuple[int, int, bool]] = []
    start = 0
    for i in range(1, len(flags) + 1):
        if i == len(flags) or flags[i] != flags[start]:
            runs.append((start, i, flags[start]))
            start = i
    return runs


def _masked(logits: mx.array, masks: Sequence[np.ndarray | None]) -> mx.array:
    """``logits`` with the disallowed tokens of constrained rows at -inf, in one operation over the batch (the
    rows without a mask keep every token)."""
    rows, width = logits.shape
    allowed = np.ones((rows, width), dtype=bool)
    for i, mask in enumerate(masks):
        if mask is not None:
            n = min(width, mask.shape[0])  # the grammar's vocabulary and the logits' may differ in padding
            allowed[i, :n] = mask[:n]
            allowed[i, n:] = False
    return mx.where(mx.array(allowed), logits, mx.array(-mx.inf, dtype=logits.dtype))


def sample_batch(logits: mx.array, samplers: Sequence[SequenceSampler],
                 contexts: Sequence[mx.array | None]) -> BatchSample:
    """Next token for every row of ``logits`` (``[B, vocab]``), lazily.

    ``contexts[i]`` is row *i*'s penalties context (recent tokens, the current
    input last) when its sampler has processors, else None.
    """
    if any(c is not None for c in contexts):
        parts = []
        for start, stop, processed in _runs([c is not None for c in contexts]):
            if not processed:
                parts.append(logits[start:stop])
                continue
            for i in range(start, stop):
                context = contexts[i]
                assert context is not None
                parts.append(samplers[i].process(logits[i : i + 1], context))
        logits = mx.concatenate(parts, axis=0) if len(parts) > 1 else parts[0]
    masks = [s.constraint.allowed() if s.constraint is not None else None for s in samplers]
    if any(m is not None for m in masks):
        logits = _masked(logits, masks)
    if logits.dtype == mx.float32 and all(s.greedy and s.top_logprobs is None for s in samplers):
        return BatchSample(mx.argmax(logits, axis=-1).astype(mx.uint32), None)  # the log-softmax's argmax
    logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    tokens = mx.argmax(logprobs, axis=-1)
    if not all(s.greedy for s in samplers):
        parts = []
        for start, stop, greedy in _runs([s.greedy for s in samplers]):
            if greedy:
                parts.append(tokens[start:stop])
            else:
                parts.extend(samplers[i].sample(logprobs[i : i + 1]) for i in range(start, stop))
        tokens = mx.concatenate([p.astype(mx.uint32) for p in parts]) if len(parts) > 1 else parts[0]
    report = None
    wanted = [i for i, s in enumerate(samplers) if s.top_logprobs is not None]
    if wanted:
        k = max(1, max(samplers[i].top_logprobs or 0 for i in wanted))
        rows = mx.array(wanted) if len(wanted) < len(samplers) else None
        lp = logprobs[rows] if rows is not None else logprobs
        chosen_tokens = tokens[rows] if rows is not None else tokens
        chosen = mx.take_along_axis(lp, chosen_tokens[:, None].astype(mx.int32), axis=-1)[:, 0]
        top_ids = mx.argsort(-lp, axis=-1)[:, :k]
        top_values = mx.take_along_axis(lp, top_ids, axis=-1)
        report = LogprobReport(tuple(wanted), chosen, top_ids, top_values)
    return BatchSample(tokens.astype(mx.uint32), report)
