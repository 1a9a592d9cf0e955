"""Where a step's decisions leave the device thread: every sequence's chunk, handed to trio in one place.

The phases put each sequence's :class:`TokenChunk` (None: it failed, its handle's ``error`` says why) into the
engine's :class:`Outbox`; :meth:`Outbox.flush` hands them over in **one** ``run_sync_soon`` crossing per trio
run (to :func:`runtime.handle.hand_over`, which gives the loop's other work a turn every few milliseconds) — the
step's phase table says when (after the batch's tokens are read, as each prefilled group's first tokens are
sampled, at the step's end). A follower rank's replicas have no trio run: rank 0 hands out their tokens.

Never imports the engine.
"""

from __future__ import annotations

import trio

from protocols.ir import TokenChunk
from runtime.handle import SequenceHandle, hand_over
from runtime.sequence import Sequence


class Outbox:
    def __init__(self) -> None:
        self._items: list[tuple[Sequence, TokenChunk | None]] = []

    def put(self, seq: Sequence, chunk: TokenChunk | None) -> None:
        self._items.append((seq, chunk))

    def put_all(self, chunks: list[tuple[Sequence, TokenChunk]]) -> None:
        self._items.extend(chunks)

    def flush(self) -> None:
        """Hand everything put so far to the trio runs its sequences belong to."""
        if not self._items:
            return
        items, self._items = self._items, []
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

