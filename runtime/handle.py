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

# A step's hand-over runs in slices of about this long. Each sequence's chunk runs its request's stages (its
# lane: detokenizing, formatting, writing to its socket): at 256 rows one step's hand-over is 5–15 ms of the
# event loop, and the loop's other work (timers, new requests, the lag watch) would wait for all of it.
SLICE_SECONDS = 0.002


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


class _Handover:
    """The chunks of one trio run's sequences waiting to be handed to their handles, in the order they came."""

    def __init__(self) -> None:
        self.pending: deque[tuple[SequenceHandle, TokenChunk | None]] = deque()
        self.scheduled = False

    def add(self, items: Iterable[tuple[SequenceHandle, TokenChunk | None]]) -> None:
        self.pending.extend(items)
        if not self.scheduled:
            self.drain()

    def drain(self) -> None:
        """Hand chunks over for one slice; what is left goes on at the loop's next turn (the chunks of a later
        step queue behind it, so a sequence's chunks keep their order)."""
        self.scheduled = False
        pending = self.pending
        deadline = time.perf_counter() + SLICE_SECONDS
        while pending:
            handle, chunk = pending.popleft()
            handle.put(chunk)
            if pending and time.perf_counter() >= deadline:
                self.scheduled = True
                trio.lowlevel.current_trio_token().run_sync_soon(self.drain)
                return


_HANDOVER: trio.lowlevel.RunVar[_Handover] = trio.lowlevel.RunVar("flow_handover")


def hand_over(items: Iterable[tuple[SequenceHandle, TokenChunk | None]]) -> None:
    """In trio: give each sequence its chunk (None: it failed), a slice of the loop's time at a time.

    The engine's crossing (``runtime.outbox``) calls this once per step for every row; so does the echo device."""
    try:
        handover = _HANDOVER.get()
    except LookupError:
        handover = _Handover()
        _HANDOVER.set(handover)
    handover.add(items)
