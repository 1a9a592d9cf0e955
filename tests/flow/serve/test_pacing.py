"""Admission pacing (flow/serve/pacing.py): a wave of callers goes on a few per turn of trio's scheduler, in order."""

from __future__ import annotations

import trio

from flow.serve.pacing import TurnPacer


class TurnCounter(trio.abc.Instrument):
    """Numbers the turns of the scheduler (as the pacer counts them: one per wait for I/O)."""

    def __init__(self) -> None:
        self.turn = 0

    def before_io_wait(self, timeout: float) -> None:
        self.turn += 1


async def test_a_wave_goes_on_a_few_per_turn_in_arrival_order() -> None:
    pacer, turns = TurnPacer(per_turn=4), TurnCounter()
    trio.lowlevel.add_instrument(turns)
    arrived: list[int] = []
    went_in: dict[int, int] = {}  # caller -> the turn it went on in

    async def caller(i: int) -> None:
        arrived.append(i)
        await pacer.turn()
        went_in[i] = turns.turn

    async with trio.open_nursery() as nursery:
        for i in range(18):
            nursery.start_soon(caller, i)
    assert sorted(went_in) == list(range(18))
    per_turn: dict[int, int] = {}
    for turn in went_in.values():
        per_turn[turn] = per_turn.get(turn, 0) + 1
    assert max(per_turn.values()) <= 4 and len(per_turn) >= 5  # 18 callers, 4 a turn
    in_order = [went_in[i] for i in arrived]
    assert in_order == sorted(in_order)  # a later arrival never goes on in an earlier turn
    assert pacer.paced == 14


async def test_callers_spread_over_turns_go_on_at_once() -> None:
    pacer = TurnPacer(per_turn=2)
    for _ in range(10):  # one a turn: never over the count, never queued
        await pacer.turn()
        await trio.sleep(0.001)
    assert pacer.paced == 0


async def test_a_cancelled_waiter_holds_no_one_up() -> None:
    pacer = TurnPacer(per_turn=1)
    went: list[int] = []

    async def caller(i: int) -> None:
        await pacer.turn()
        went.append(i)

    async with trio.open_nursery() as nursery:
        await pacer.turn()  # this turn's one
        with trio.move_on_after(0) as gone:  # queued, then cancelled before its turn comes
            await pacer.turn()
        assert gone.cancelled_caught
        for i in range(3):
            nursery.start_soon(caller, i)
    assert sorted(went) == [0, 1, 2]  # (the order trio starts them in is its own)


async def test_a_new_trio_run_gets_its_own_releaser() -> None:
    pacer = TurnPacer(per_turn=1)

    async def wave() -> int:
        count = 0

        async def caller() -> None:
            nonlocal count
            await pacer.turn()
            count += 1

        async with trio.open_nursery() as nursery:
            for _ in range(5):
                nursery.start_soon(caller)
        return count

    assert await wave() == 5
    results: list[int] = []  # another run (in a thread: runs do not nest)
    await trio.to_thread.run_sync(lambda: results.append(trio.run(wave)))
    assert results == [5]
