"""Batch sampling against mlx-lm's own operations: greedy rows take the argmax of the log-softmax, as
``mlx_lm.generate`` does — and skip computing the log-softmax only where that cannot change a token."""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import pytest

from protocols.ir import SamplingParams
from runtime.sampling import SequenceSampler, sample_batch

GREEDY = SequenceSampler(SamplingParams())


def mlx_lm_greedy(logits: mx.array) -> list[int]:
    """mlx-lm's greedy token per row: the argmax of the log-probabilities, in the logits' dtype."""
    return mx.argmax(logits - mx.logsumexp(logits, axis=-1, keepdims=True), axis=-1).tolist()  # type: ignore[return-value]


def test_float32_greedy_rows_skip_the_log_softmax_and_keep_mlx_lms_tokens(monkeypatch: pytest.MonkeyPatch) -> None:
    rows = [(mx.random.normal((8, vocab), key=mx.random.key(vocab)) * scale)
            for vocab, scale in ((1024, 0.3), (8192, 4.0), (151936, 12.0))]
    want = [mlx_lm_greedy(logits) for logits in rows]

    def refuse(*args: Any, **kwargs: Any) -> mx.array:
        raise AssertionError("the log-softmax was computed for greedy float32 rows")

    monkeypatch.setattr(mx, "logsumexp", refuse)  # the module sampling uses
    for logits, tokens in zip(rows, want):
        sample = sample_batch(logits, [GREEDY] * logits.shape[0], [None] * logits.shape[0])
        assert sample.report is None and sample.tokens.dtype == mx.uint32
        assert sample.tokens.tolist() == tokens


def test_bfloat16_ties_are_broken_as_mlx_lm_breaks_them() -> None:
    # 0.99609375 and 1.0 are two bfloat16 values apart by one step; less the row's log-sum-exp (~6.93) both round
    # to -5.9375, and mlx-lm's argmax takes the first of the tie: index 0, not the larger logit at index 1.
    logits = mx.zeros((1, 1024), dtype=mx.bfloat16)
    logits[0, 0] = 0.99609375
    logits[0, 1] = 1.0
    assert mx.argmax(logits, axis=-1).tolist() == [1]
    assert mlx_lm_greedy(logits) == [0]
    assert sample_batch(logits, [GREEDY], [None]).tokens.tolist() == [0]


def test_a_row_that_asks_for_logprobs_keeps_them() -> None:
    logits = mx.random.normal((2, 512), key=mx.random.key(3))
    asking = SequenceSampler(SamplingParams(logprobs=2))
    sample = sample_batch(logits, [GREEDY, asking], [None, None])
    assert sample.report is not None and sample.report.rows == (1,)
    assert sample.tokens.tolist() == mlx_lm_greedy(logits)
    want = (logits - mx.logsumexp(logits, axis=-1, keepdims=True))[1, sample.tokens[1].item()]
    assert abs(sample.report.chosen[0].item() - want.item()) < 1e-6
