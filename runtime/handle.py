"""The trio side of one engine sequence: its chunks' channel, how it is cancelled, and what takes its chunks.

Free of MLX on purpose: the stages that read a sequence (``stages.rows``, the ``generate.echo`` stand-in) are
imported by graph checks that must not load the device's libraries.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Iterable

import trio

from protocols.ir import TokenChunk

# Takes a chunk as it is handed over, in trio, without awaiting: ``None`` when it took it (it stays offered),
# else the chunk to put in the channel after all (it is withdrawn; see stages.rows).
Taker = Callable[[TokenChunk], TokenChunk | None]


class SequenceHandle:
    """The trio side of one sequence: its chunks, and a way to cancel it.

    Its reader may offer a :data:`Taker` while it waits on an empty channel: the chunks of an ongoing sequence
    then go to it rather than through the channel, in the same pass that hands every sequence its chunk."""

    def __init__(self, seq_id: int, send: trio.MemorySendChannel[TokenChunk],
                 receive: trio.MemoryReceiveChannel[TokenChunk], on_cancel: Callable[[int], None]) -> None:
        self.id = seq_id
        self.chunks = receive
        self._send = send
        self._on_cancel = on_cancel
        self.error: BaseException | None = None
        self.finished = False
        self.cached_tokens = 0  # prompt tokens the prefix cache supplied
        self.cache_write_tokens = 0  # prompt tokens this sequence adds to the prefix cache's (full) blocks
        self.taker: Taker | None = None

    def cancel(self) -> None:
        """Ask the engine to drop this sequence at its next step (idempotent)."""
        if not self.finished:
            self.finished = True
            self._on_cancel(self.id)

    def end(self, error: BaseException | None = None) -> None:
        """Close the stream (trio side): finished, or failed with ``error``."""
        if error is not None:
            self.error = error
        self.finished = True
        self._send.close()

    def put(self, chunk: TokenChunk | None) -> None:
        """Trio side: one chunk of this sequence (None: it failed; its ``error`` says why)."""
        if chunk is None:
            self.end()
            return
        taker = self.taker
        if taker is not None and chunk.finish_reason is None:
            handed = taker(chunk)
            if handed is None:
                return
            chunk = handed
        self.taker = None
        try:
            self._send.send_nowait(chunk)
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            self.cancel()  # the reader went away: drop the sequence
            return
        if chunk.finish_reason is not None:
            self.end()

    async def __aenter__(self) -> SequenceHandle:
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.cancel()
        self.chunks.close()


# The most event-loop time one turn of a hand-out takes before the rest waits for the loop's next turn: a
# step's chunks for hundreds of rows (each running its lane's stages) would otherwise hold the loop for tens of
# milliseconds, and every other request, /health included, with it.
HANDOUT_SLICE_SECONDS = 0.004


class Handout:
    """Where a device's steps hand their sequences' chunks over, in trio: in order, a slice of the loop's time at
    a time.

    :meth:`give` takes one step's ``(handle, chunk)`` pairs (a chunk of None: the sequence failed) and puts them to
    their handles, oldest first; past :data:`HANDOUT_SLICE_SECONDS` in one turn, the rest is put in a later turn of
    the loop (other tasks and timers run between). A step handed over meanwhile waits behind what is left, so each
    sequence still gets its chunks in order."""

    def __init__(self) -> None:
        self._waiting: deque[tuple[SequenceHandle, TokenChunk | None]] = deque()
        self._resuming = False  # a later turn is booked for what waits
        self.deferred = 0  # turns that left chunks for a later one (stats and tests)

    def give(self, items: Iterable[tuple[SequenceHandle, TokenChunk | None]]) -> None:
        self._waiting.extend(items)
        if not self._resuming:
            self._put()

    def _resume(self) -> None:
        self._resuming = False
        self._put()

    def _put(self) -> None:
        waiting = self._waiting
        deadline = time.perf_counter() + HANDOUT_SLICE_SECONDS
        while waiting:
            handle, chunk = waiting.popleft()
            handle.put(chunk)
            if waiting and time.perf_counter() > deadline:
                self._resuming = True
                self.deferred += 1
                trio.lowlevel.current_trio_token().run_sync_soon(self._resume)
                return
