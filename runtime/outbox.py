"""Where a step's decisions leave the device thread: every sequence's chunk, handed to trio in one place.

The phases put each sequence's :class:`TokenChunk` (None: it failed, its handle's ``error`` says why) into the
engine's :class:`Outbox`; :meth:`Outbox.flush` hands them over in **one** ``run_sync_soon`` crossing per trio
run (to :func:`runtime.handle.hand_over`, which gives the loop's other work a turn every few milliseconds) — the
step's phase table says when (after the batch's tokens are read, as each prefilled group's first tokens are
sampled, at the step's end). A follower rank's replicas have no trio run: rank 0 hands out their tokens.

**The stream interval.** Where a step takes less than ``interval`` seconds (a small model, a fast device), the
tokens of steps in between wait in the outbox and go out together, each sequence's as one chunk: one crossing,
one wake of the event loop, one pass through a request's stages and one frame on its socket for several tokens,
so flow's own Python per token shrinks where it would otherwise cap the device. What a client waits for never
waits: a sequence's first :data:`UNHELD_TOKENS` tokens (what a client shows may begin a few tokens in, after a
reasoning tag, a channel header or leading whitespace a parser takes), its last (it finished) and a failure go out
at once, with everything held before them. ``interval = 0`` hands out every step's tokens.

Never imports the engine.
"""

from __future__ import annotations

import time

import trio

from protocols.ir import TokenChunk
from runtime.handle import SequenceHandle, hand_over
from runtime.sequence import Sequence

UNHELD_TOKENS = 8  # a sequence's first tokens, handed out as they come


class Outbox:
    def __init__(self, interval: float = 0.0) -> None:
        self.interval = interval
        self._items: list[tuple[Sequence, TokenChunk | None]] = []
        self._urgent = False  # something put since the last crossing must go out now
        self._held = False  # the items span more than one step: a sequence may have several chunks
        self._crossed = 0.0  # perf_counter of the last crossing

    def put(self, seq: Sequence, chunk: TokenChunk | None) -> None:
        """One sequence's chunk, to go out at the next flush: a first token, or a failure (None)."""
        self._items.append((seq, chunk))
        self._urgent = True

    def put_all(self, chunks: list[tuple[Sequence, TokenChunk]], urgent: bool) -> None:
        """A decode step's chunks; ``urgent`` when one of them starts or ends its sequence."""
        self._items.extend(chunks)
        self._urgent |= urgent

    def flush(self, force: bool = False) -> None:
        """Hand everything put so far to the trio runs its sequences belong to — unless all of it may wait for
        the stream interval (nothing urgent, the last crossing less than ``interval`` ago, not ``force``)."""
        if not self._items:
            return
        now = time.perf_counter()
        if not (force or self._urgent) and now - self._crossed < self.interval:
            self._held = True
            return
        items, self._items = self._items, []
        if self._held:
            items = _merged(items)
        self._urgent = self._held = False
        self._crossed = now
        by_token: dict[trio.lowlevel.TrioToken | None, list[tuple[SequenceHandle, TokenChunk | None]]] = {}
        for seq, chunk in items:
            by_token.setdefault(seq.token, []).append((seq.handle, chunk))
        for token, handed in by_token.items():
            if token is None:
                continue  # a follower rank's replicas: rank 0 hands out the tokens
            try:
                token.run_sync_soon(hand_over, handed)
            except trio.RunFinishedError:
                pass  # the server's trio run is gone; nobody is listening


def _merged(items: list[tuple[Sequence, TokenChunk | None]]) -> list[tuple[Sequence, TokenChunk | None]]:
    """Each sequence's chunks of several steps as one, in the place of its first (a failure, None, after it)."""
    chunks: dict[Sequence, TokenChunk] = {}
    failed: list[Sequence] = []
    for seq, chunk in items:
        if chunk is None:
            failed.append(seq)
            continue
        before = chunks.get(seq)
        chunks[seq] = chunk if before is None else TokenChunk(
            before.token_ids + chunk.token_ids, chunk.finish_reason, before.logprobs + chunk.logprobs, chunk.choice)
    merged: list[tuple[Sequence, TokenChunk | None]] = list(chunks.items())
    merged += [(seq, None) for seq in failed]
    return merged
