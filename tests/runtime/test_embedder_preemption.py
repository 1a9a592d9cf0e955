"""Preemption between blocks: a one-sentence request that arrives during a large job's pass is served between two
of that pass's blocks (real tiny models, real MLX; the test thread plays the device thread)."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from runtime.embeddings import PREEMPTION_SHARE, Embedder
from runtime.sliced_jobs import repeated_blocks, with_checkpoint
from runtime.tiny import ensure_tiny_model
from tests.runtime.test_embedder_passes import _Device


def _load(name: str) -> tuple[Any, Any]:
    from mlx_embeddings.utils import load

    model, wrapper = load(str(ensure_tiny_model(name)))
    return model, getattr(wrapper, "_tokenizer", wrapper)


def _alone(model: Any, ids: list[int]) -> np.ndarray:
    import mlx.core as mx

    return np.array(model(mx.array([ids]), attention_mask=mx.array([[1] * len(ids)])).text_embeds[0])


def _parameter_names(model: Any) -> set[str]:
    from mlx.utils import tree_flatten

    flat: Any = tree_flatten(model.parameters())
    return {name for name, _ in flat}


@pytest.mark.parametrize("name, blocks", [("tiny-bert", "BertLayer"), ("tiny-qwen3-embedding", "Qwen3DecoderLayer"),
                                          ("tiny-reranker", "ModernBertEncoderLayer")])
def test_the_blocks_are_found_and_checkpointing_them_changes_no_output(name: str, blocks: str) -> None:
    import mlx.core as mx

    model, _ = _load(name)
    found = repeated_blocks(model)
    assert len(found) >= 2 and {type(b).__name__ for b in found} == {blocks}
    ids, mask = mx.array([[5, 6, 7, 8]]), mx.array([[1, 1, 1, 0]])
    before = np.array(model(ids, attention_mask=mask).pooler_output)
    names_before = _parameter_names(model)
    passed: list[int] = []
    for block in found:
        with_checkpoint(block, lambda: passed.append(1), evaluate=lambda: True)
    after = np.array(model(ids, attention_mask=mask).pooler_output)
    assert len(passed) == len(found) and np.array_equal(before, after)
    assert _parameter_names(model) == names_before
    assert all(type(b).__name__ == f"Checkpointed{blocks}" for b in found)


class _ArrivingMidPass(Embedder):
    """An embedder to whom a one-input request arrives before each block, while ``arriving`` lasts (``late``: the
    last one's future)."""

    arriving: list[list[int]] = []
    late: Any = None

    def _between_blocks(self) -> None:
        if self.arriving:
            self.late = self.submit([self.arriving.pop()])
        super()._between_blocks()


def _embedder(model: Any, tokenizer: Any, pass_tokens: int) -> _ArrivingMidPass:
    return _ArrivingMidPass(model, _Device(), int(tokenizer.pad_token_id or 0), 32,  # type: ignore[arg-type]
                            pass_tokens=pass_tokens, pass_seconds=0.1)


def test_a_request_arriving_during_a_large_jobs_pass_is_served_between_its_blocks() -> None:
    model, tokenizer = _load("tiny-bert")
    texts = [f"document number {i} about rivers and seas" for i in range(40)]
    big_ids = [list(tokenizer(t)["input_ids"]) for t in texts]
    short_ids = list(tokenizer("a short query")["input_ids"])
    e = _embedder(model, tokenizer, pass_tokens=8 * max(map(len, big_ids)))  # the large job takes 5 passes
    big = e.submit(big_ids)
    e.arriving = [short_ids]
    e.step()
    assert e.late.done() and not big.done()  # served inside the large job's first pass
    assert e.preemptions == 1 and e.passes == 2
    assert np.abs(e.late.result()[0] - _alone(model, short_ids)).max() < 1e-5
    while not big.done():
        e.step()
    expected = np.stack([_alone(model, ids) for ids in big_ids])
    assert np.abs(big.result() - expected).max() < 1e-5  # the pass computed block by block: the same vectors


def test_small_requests_wait_for_the_pass_under_way() -> None:
    """Only a large job's passes are preempted: a pass of small requests (64 clients' sentences) is efficient
    as a whole, and one arriving during it joins the next pass."""
    model, tokenizer = _load("tiny-bert")
    ids = [list(tokenizer(f"sentence {i}")["input_ids"]) for i in range(4)]
    e = _embedder(model, tokenizer, pass_tokens=1000)
    first = [e.submit([row]) for row in ids[:3]]
    e.arriving = [ids[3]]
    e.step()
    assert all(f.done() for f in first) and not e.late.done() and e.preemptions == 0
    e.step()
    assert np.abs(e.late.result()[0] - _alone(model, ids[3])).max() < 1e-5


def test_preemption_is_bounded_by_the_large_passs_own_time() -> None:
    """A stream of small requests cannot take more of the device than the large pass they preempt: here that
    pass is estimated at next to nothing, so one request is served between its blocks and the next waits."""
    model, tokenizer = _load("tiny-bert")
    big_ids = [list(tokenizer(f"document {i} about mountains")["input_ids"]) for i in range(40)]
    e = _embedder(model, tokenizer, pass_tokens=8 * max(map(len, big_ids)))
    e.pass_seconds = 1e-6  # the allowance: the larger of pass_seconds and the pass's estimate (none yet)
    e.submit(big_ids)
    e.arriving = [list(tokenizer(q)["input_ids"]) for q in ("second query", "first query")]
    e.step()
    assert e.preemptions == 1 and not e.late.done()  # the first served, the second waits for the pass's end
    e.step()  # a short pass for it before the large job goes on
    assert e.late.done() and e.preemptions == 1


class _ArrivingInsideALayer(Embedder):
    """An embedder that counts the checkpoints a large pass passes, and to whom a one-input request arrives at
    the ``arrive_at``-th: in the first layer, after its attention, before its feed-forward."""

    arrive_at = 3  # the layer's own checkpoint, then its attention's, then its feed-forward's
    seen = 0
    arriving: list[int] = []
    late: Any = None

    def _between_blocks(self) -> None:
        if self._preempting:
            self.seen += 1
            if self.seen == self.arrive_at:
                self.late = self.submit([self.arriving])
        super()._between_blocks()


def test_a_large_pass_is_preempted_inside_a_layer_too() -> None:
    """A layer's parts are checkpointed as well as the layer: a request waits for the attention or the
    feed-forward under way, not for a whole layer of the large pass."""
    model, tokenizer = _load("tiny-bert")
    big_ids = [list(tokenizer(f"document {i} about the harbour")["input_ids"]) for i in range(40)]
    short_ids = list(tokenizer("a query in the middle")["input_ids"])
    e = _ArrivingInsideALayer(model, _Device(), int(tokenizer.pad_token_id or 0), 32,  # type: ignore[arg-type]
                              pass_tokens=8 * max(map(len, big_ids)), pass_seconds=0.1)
    e.arriving = short_ids
    big = e.submit(big_ids)
    e.step()
    layers = repeated_blocks(model)
    parts = len(layers[0].children())  # BERT: attention, intermediate, output
    assert parts == 3 and e.seen == len(layers) * (1 + parts)
    assert e.late.done() and e.preemptions == 1 and not big.done()
    assert np.abs(e.late.result()[0] - _alone(model, short_ids)).max() < 1e-5
    while not big.done():
        e.step()
    expected = np.stack([_alone(model, ids) for ids in big_ids])
    assert np.abs(big.result() - expected).max() < 1e-5


class _BackToBack(Embedder):
    """A client that asks again as soon as it is answered, on a clock the test drives: each piece of the large
    pass takes ``PIECE`` seconds, each short pass ``SHORT``; ``served_at`` records (own seconds of the large pass,
    seconds preempted before) at each short pass."""

    PIECE, SHORT = 0.002, 0.006
    now = 0.0
    query: list[int] = []
    pending: Any = None
    pieces = 0
    served_at: list[tuple[float, float]] = []

    short_running = False
    in_checkpoint = False

    def _between_blocks(self) -> None:
        if self._preempting:
            self.pieces += 1
            type(self).now += self.PIECE  # the piece before this checkpoint was computed
            if self.pending is None or self.pending.done():
                self.pending = self.submit([self.query])
        elif self.short_running:
            type(self).now += self.SHORT / 8  # a short pass passes the same checkpoints (tiny-bert: 2 layers)
        was, self.in_checkpoint = self.in_checkpoint, True
        try:
            super()._between_blocks()
        finally:
            self.in_checkpoint = was

    def _run(self, chosen: list[Any]) -> None:
        if self.in_checkpoint:  # a short pass between two pieces of the large one
            own = type(self).now - self._pass_started - self._pass_preempted
            self.served_at.append((own, self._pass_preempted))
            self.short_running = True
        try:
            super()._run(chosen)
        finally:
            self.short_running = False


def test_a_client_asking_back_to_back_is_paced_through_the_large_pass(monkeypatch: pytest.MonkeyPatch) -> None:
    """Passes between pieces never take more than PREEMPTION_SHARE times what the large pass has computed, plus
    one short pass's fixed cost: the large job keeps a third of the device, and a client asking back to back is
    served all along the pass rather than at every piece until an allowance runs out and then not until the
    pass ends."""
    import time

    monkeypatch.setattr(time, "perf_counter", lambda: _BackToBack.now)  # the embedder's clock
    model, tokenizer = _load("tiny-bert")
    big_ids = [list(tokenizer(f"document {i} about the station")["input_ids"]) for i in range(40)]
    fixed = _BackToBack.SHORT
    e = _BackToBack(model, _Device(), int(tokenizer.pad_token_id or 0), 32,  # type: ignore[arg-type]
                    pass_tokens=8 * max(map(len, big_ids)), pass_seconds=0.1, idle_cost=(fixed, 1e-9))
    e.query = list(tokenizer("are you there")["input_ids"])
    e.served_at = []
    big = e.submit(big_ids)
    e.step()  # the large job's first pass: each layer and its 3 parts checkpointed
    assert e.pieces == 4 * len(repeated_blocks(model)) and not big.done()
    assert 3 <= len(e.served_at) < e.pieces  # served along the way, not at every piece
    for own, preempted in e.served_at:
        assert preempted <= PREEMPTION_SHARE * own + fixed + 1e-9
    assert e.served_at[-1][0] >= 0.6 * e.pieces * e.PIECE  # still served near the pass's end


def test_a_short_request_is_not_packed_into_a_large_pass_but_served_between_its_pieces() -> None:
    """A request a short pass can finish, waiting when a large job's pass is formed, stays out of it: it would
    wait for that whole pass; between the pass's pieces it is served at the first checkpoint."""
    model, tokenizer = _load("tiny-bert")
    big_ids = [list(tokenizer(f"document {i} about the bridge")["input_ids"]) for i in range(40)]
    e = _embedder(model, tokenizer, pass_tokens=8 * max(map(len, big_ids)))
    big = e.submit(big_ids)
    first = e.submit([list(tokenizer("first query")["input_ids"])])
    e.step()  # a short pass for the newcomer before the large job goes on
    assert first.done() and e.preemptions == 0 and e.passes == 1
    second_ids = list(tokenizer("second query")["input_ids"])
    second = e.submit([second_ids])
    e.step()  # the large job's pass; the second query waits outside it
    assert second.done() and e.preemptions == 1 and not big.done()
    assert np.abs(second.result()[0] - _alone(model, second_ids)).max() < 1e-5
    while not big.done():
        e.step()
    expected = np.stack([_alone(model, ids) for ids in big_ids])
    assert np.abs(big.result() - expected).max() < 1e-5
