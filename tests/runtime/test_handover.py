"""A step's hand-over (``runtime.handle.hand_over``): every sequence gets its chunks in order, and the event loop's
other work gets a turn between slices of a large step."""

from __future__ import annotations

import math

import pytest
import trio
import trio.testing

from protocols.ir import TokenChunk
from runtime import handle
from runtime.handle import SequenceHandle, hand_over


def _handles(n: int) -> list[SequenceHandle]:
    out = []
    for i in range(n):
        send, receive = trio.open_memory_channel[TokenChunk](math.inf)
        out.append(SequenceHandle(i, send, receive, on_cancel=lambda _id: None))
    return out


def _received(row: SequenceHandle) -> list[TokenChunk]:
    got = []
    while True:
        try:
            got.append(row.chunks.receive_nowait())
        except (trio.WouldBlock, trio.EndOfChannel):
            return got


def test_a_slice_at_a_time_with_the_loop_turning_between(monkeypatch: pytest.MonkeyPatch) -> None:
    """With slices of no time at all, each chunk is its own slice: another task runs between them, and the
    next step's chunks (handed over before the first step's are all out) still come after them."""
    monkeypatch.setattr(handle, "SLICE_SECONDS", 0.0)
    rows = _handles(4)
    order: list[str] = []

    async def main() -> None:
        async def other_work() -> None:
            while not all(row.finished for row in rows):
                order.append("other")
                await trio.lowlevel.checkpoint()

        async with trio.open_nursery() as nursery:
            hand_over([(row, TokenChunk((10 + row.id,))) for row in rows])
            hand_over([(row, TokenChunk((20 + row.id,), "length")) for row in rows])  # queued behind the first
            order.append("handed")
            nursery.start_soon(other_work)

    original = handle._Handover.drain

    def drain(self: handle._Handover) -> None:
        order.append("slice")
        original(self)

    monkeypatch.setattr(handle._Handover, "drain", drain)
    trio.run(main)
    for row in rows:
        assert [c.token_ids for c in _received(row)] == [(10 + row.id,), (20 + row.id,)]
        assert row.finished
    assert order.count("slice") == 8  # one per chunk
    assert order[:2] == ["slice", "handed"]  # the first slice at once, in the caller
    last_slice = len(order) - 1 - order[::-1].index("slice")
    assert "other" in order[2:last_slice], "no other task ran between the slices"


def test_a_small_step_is_handed_over_at_once() -> None:
    rows = _handles(3)

    async def main() -> None:
        hand_over([(row, TokenChunk((row.id,))) for row in rows])
        for row in rows:  # no turn of the loop yet
            assert [c.token_ids for c in _received(row)] == [(row.id,)]

    trio.run(main)


def test_a_failed_sequence_and_a_gone_reader() -> None:
    """None ends the sequence (it failed); a reader that went away cancels its sequence, and the others still
    get theirs."""
    failed, gone, fine = _handles(3)
    cancelled: list[int] = []
    gone._on_cancel = cancelled.append
    gone.chunks.close()

    async def main() -> None:
        hand_over([(failed, None), (gone, TokenChunk((1,))), (fine, TokenChunk((2,)))])

    trio.run(main)
    assert failed.finished and _received(failed) == []
    assert gone.finished and cancelled == [gone.id]
    assert [c.token_ids for c in _received(fine)] == [(2,)]
