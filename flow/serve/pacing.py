"""Admission pacing: a wave of requests is read, started, answered and ended a few per turn of the event loop.

trio runs every task that is ready in one turn of its scheduler and looks at its timers and sockets only between
turns. When many requests become ready together — a wave of clients that all got their answers in the same engine
step and all send the next request at once — each one's work (reading and decoding its body, starting its run,
sending its answer, ending its stream) runs in that one turn, back to back: with 256 of them the loop was held for
50–100 ms, and every stream in flight waited that long for its next token. (A request's end — a stream's last
frames, a whole body's formatting — waits here through ``flow.graph.stage.paced``: the server hands each request
:meth:`TurnPacer.turn` with its notes.)

:class:`TurnPacer` spreads such a wave: the first ``per_turn`` callers of a turn go on at once (no await), the rest
queue in arrival order, and a releaser task lets ``per_turn`` of them go each later turn, so the streams' frames and
the timers run in between. The work is the same; a wave's last request is served about as late as it would have
been, and no stream in flight stalls for the whole wave. Turns are counted exactly: a trio instrument's
``before_io_wait`` hook, called once per turn of the scheduler, starts each turn's count afresh.
"""

from __future__ import annotations

from collections import deque

import trio

PER_TURN = 8  # a request's paced work is ~0.1–0.6 ms: 8 keep a turn of them to a few ms


class TurnPacer(trio.abc.Instrument):
    """Lets at most ``per_turn`` callers of :meth:`turn` go on in one turn of trio's scheduler, the rest in arrival
    order in later turns. The instrument and the releaser task join the trio run of the first caller (a server's
    tests run several, one after another)."""

    def __init__(self, per_turn: int = PER_TURN) -> None:
        if per_turn < 1:
            raise ValueError("per_turn must be at least 1")
        self.per_turn = per_turn
        self.paced = 0  # callers that waited for a later turn (/stats)
        self._passed = 0  # callers gone on in this turn
        self._waiting: deque[trio.Event] = deque()
        self._wake = trio.Event()
        self._run: trio.lowlevel.TrioToken | None = None  # the run the instrument and the releaser belong to

    async def turn(self) -> None:
        """Go on now, or in a later turn once this one has let ``per_turn`` callers go."""
        if self._run is not trio.lowlevel.current_trio_token():
            self._join_run()
        if self._passed < self.per_turn and not self._waiting:
            self._passed += 1
            return
        released = trio.Event()
        self._waiting.append(released)
        self.paced += 1
        self._wake.set()
        await released.wait()

    def before_io_wait(self, timeout: float) -> None:
        self._passed = 0  # a turn of the scheduler ends here

    def _join_run(self) -> None:
        self._run = trio.lowlevel.current_trio_token()
        self._passed = 0
        self._waiting.clear()  # (a former run's waiters are gone with it)
        self._wake = trio.Event()
        trio.lowlevel.add_instrument(self)
        trio.lowlevel.spawn_system_task(self._release, name="flow-turn-pacer")

    async def _release(self) -> None:
        while True:
            await self._wake.wait()
            self._wake = trio.Event()
            while self._waiting:
                await trio.lowlevel.checkpoint()  # a turn later: the last ones released have run
                for _ in range(min(self.per_turn, len(self._waiting))):
                    self._waiting.popleft().set()
