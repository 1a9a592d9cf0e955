"""The hand-over of a device's steps in trio (runtime/handle.py's Handout): in order, a slice of the loop at a time."""

from __future__ import annotations

import math
import time

import pytest
import trio

from protocols.ir import TokenChunk
from runtime import handle as handle_module
from runtime.handle import Handout, SequenceHandle


class SlowRow(SequenceHandle):
    """A row whose chunks take ``cost`` seconds each to put (a lane running its stages), recorded in order."""

    def __init__(self, name: str, cost: float, log: list[tuple[str, int]]) -> None:
        send, receive = trio.open_memory_channel[TokenChunk](math.inf)
        super().__init__(0, send, receive, on_cancel=lambda _id: None)
        self.name, self.cost, self.log = name, cost, log

    def put(self, chunk: TokenChunk | None) -> None:
        time.sleep(self.cost)
        assert chunk is not None
        self.log.append((self.name, chunk.token_ids[0]))


async def test_a_long_hand_out_yields_the_loop_between_slices_and_keeps_every_rows_order(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(handle_module, "HANDOUT_SLICE_SECONDS", 0.002)
    log: list[tuple[str, int]] = []
    rows = [SlowRow(f"row{i}", 0.0005, log) for i in range(24)]
    handout = Handout()
    seen_between: list[int] = []
    done = trio.Event()

    async def neighbour() -> None:  # another task of the loop: it runs while the hand-out is under way
        while not done.is_set():
            seen_between.append(len(log))
            await trio.sleep(0)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(neighbour)
        await trio.sleep(0)
        handout.give([(row, TokenChunk((1,), None)) for row in rows])  # step 1: one chunk per row
        handout.give([(row, TokenChunk((2,), None)) for row in rows])  # step 2, handed over while step 1 waits
        with trio.fail_after(10):
            while len(log) < 2 * len(rows):
                await trio.sleep(0)
        done.set()

    assert handout.deferred >= 2  # 48 puts of 0.5 ms in slices of 2 ms
    assert any(0 < n < len(log) for n in seen_between)  # the loop ran other tasks in between
    # Every row gets step 1's chunk before step 2's, and the rows keep the steps' order.
    assert log == [(row.name, 1) for row in rows] + [(row.name, 2) for row in rows]


async def test_a_short_hand_out_is_put_at_once() -> None:
    log: list[tuple[str, int]] = []
    rows = [SlowRow(f"row{i}", 0.0, log) for i in range(8)]
    handout = Handout()
    handout.give([(row, TokenChunk((7,), None)) for row in rows])
    assert log == [(row.name, 7) for row in rows] and handout.deferred == 0
