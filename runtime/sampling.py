"""Per-sequence sampling, built from a :class:`SamplingParams`.

Each sequence owns its random key, so a seeded request samples the same tokens
whatever else runs beside it. Greedy decoding uses exactly the operations of
``mlx_lm.generate`` (log-softmax, then argmax) so that outputs match it
token for token. Filters and penalties are mlx-lm's own functions.
"""

from __future__ import annotations

import random
from collections.abc import Callable

import mlx.core as mx
from mlx_lm.sample_utils import apply_min_p, apply_top_k, apply_top_p, make_logits_processors

from protocols.ir import SamplingParams, TokenLogprob

LogitsProcessor = Callable[[mx.array, mx.array], mx.array]


class SequenceSampler:
    """Turns one sequence's logits into its next token (lazily: returns an mx.array)."""

    def __init__(self, params: SamplingParams) -> None:
        self.params = params
        self.processors: list[LogitsProcessor] = make_logits_processors(
            logit_bias=dict(params.logit_bias) or None,
            repetition_penalty=params.repetition_penalty,
            repetition_context_size=params.repetition_context_size,
            presence_penalty=params.presence_penalty,
            frequency_penalty=params.frequency_penalty,
        )
        # How much history the penalties look at (they slice it themselves).
        self.history_window = max(params.repetition_context_size, 20) if self.processors else 0
        seed = params.seed if params.seed is not None else random.getrandbits(63)
        self._key = mx.random.key(seed) if not params.greedy else None

    def __call__(self, logits: mx.array, history: list[int]) -> tuple[mx.array, mx.array]:
        """``logits`` is ``[1, vocab]`` for the last position; returns the ``[1]`` token array
        and the ``[1, vocab]`` log-probabilities it was drawn from (after penalties)."""
        if self.processors:
            tokens = mx.array(history[-self.history_window :])
            for processor in self.processors:
                logits = processor(tokens, logits)
        logprobs = logits - mx.logsumexp(logits, keepdims=True)
        if self._key is None:
            return mx.argmax(logprobs, axis=-1), logprobs
        p = self.params
        filtered = logprobs
        if 0.0 < p.top_p < 1.0:
            filtered = apply_top_p(filtered, p.top_p)
        if p.min_p > 0.0:
            filtered = apply_min_p(filtered, p.min_p)
        if p.top_k > 0:
            filtered = apply_top_k(filtered, p.top_k)
        keys = mx.random.split(self._key)
        self._key = keys[0]
        return mx.random.categorical(filtered * (1.0 / p.temperature), key=keys[1]), logprobs

    def report(self, token: int, logprobs: mx.array) -> TokenLogprob:
        """The sampled token's log-probability and the top alternatives, as asked for."""
        row = logprobs.reshape(-1)
        k = self.params.logprobs or 0
        top: tuple[tuple[int | str, float], ...] = ()
        if k > 0:
            ids = mx.argsort(-row)[:k]
            top = tuple((int(i), float(v)) for i, v in zip(ids.tolist(), row[ids].tolist()))  # type: ignore[arg-type]
        return TokenLogprob(token, float(row[token].item()), top)  # type: ignore[arg-type]
