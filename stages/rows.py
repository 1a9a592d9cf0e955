"""The trio side of a request's rows: how ``generate`` (and ``generate.echo``) pass an engine's chunks on.

A request's choices are rows of the engine's batch. Each row has its own channel of :class:`TokenChunk`; the
engine fills every row's channel in one crossing per step. Here each row's chunks are tagged with their
choice and sent downstream, those already waiting folded into one item (:func:`merge_pending`). However the
forwarding ends — every row finished, downstream stopped reading, the client gone — every row is cancelled,
so the engine drops it at its next step.

**A token without a task switch.** Waking a request's task for each token, and the awaits between its
stages, cost more than the stages' own work. So while a one-row request's task waits on an empty channel it
offers the row a :class:`Lane`: the engine's crossing then runs that row's stages for its token right there,
synchronously (``Outbox.send_now``, each inline step's ``feed_now``, the exit's socket write), for every row
in one pass. Anything that must await — a step that needs its task, a socket that is full, a failure, the
stages wanting no more — is kept in order on its edge, and the lane hands the row back: the task wakes
(:data:`WAKE`), finishes that work (``Outbox.drain``) and offers the lane again once the chain keeps up.
"""

from __future__ import annotations

import contextvars
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import replace
from typing import Protocol

import trio

from flow.graph.stage import Outbox, Step, paced
from protocols.errors import ApiError
from protocols.ir import Generation, GenerationStarted, PreparedPrompt, TokenChunk
from runtime.handle import Taker


class EachPrompt(Step[PreparedPrompt, Generation]):
    """The step of a stage that generates: each prompt run by ``generate(prompt, out)``, which returns whether
    downstream still reads."""

    def __init__(self, generate: Callable[[PreparedPrompt, Outbox[Generation]], Awaitable[bool]]) -> None:
        self._generate = generate

    async def feed(self, item: PreparedPrompt, out: Outbox[Generation]) -> bool:
        return await self._generate(item, out)


class Row(Protocol):
    """What an engine hands back for one submitted row (``runtime.handle.SequenceHandle`` is one)."""

    taker: Taker | None

    @property
    def chunks(self) -> trio.MemoryReceiveChannel[TokenChunk]: ...

    @property
    def error(self) -> BaseException | None: ...

    def cancel(self) -> None: ...


def merge_pending(chunk: TokenChunk, chunks: trio.MemoryReceiveChannel[TokenChunk]) -> TokenChunk:
    """Fold chunks that are already waiting into one item.

    When the stages downstream fall behind the engine (many streams, a slow
    client), tokens pile up here; passing them on as one item keeps the
    per-item work (detokenizing, encoding, writing) per step, not per token.
    """
    if chunk.finish_reason is not None:
        return chunk
    try:
        more = chunks.receive_nowait()
    except (trio.WouldBlock, trio.EndOfChannel):
        return chunk  # the usual case when downstream keeps up: nothing to fold, nothing built
    tokens = [*chunk.token_ids, *more.token_ids]
    logprobs = [*chunk.logprobs, *more.logprobs]
    finish = more.finish_reason
    while finish is None:
        try:
            more = chunks.receive_nowait()
        except (trio.WouldBlock, trio.EndOfChannel):
            break
        tokens.extend(more.token_ids)
        logprobs.extend(more.logprobs)
        finish = more.finish_reason
    return TokenChunk(tuple(tokens), finish, tuple(logprobs))


async def forward_rows(started: GenerationStarted, rows: Sequence[Row], outbox: Outbox[Generation]) -> bool:
    """Send ``started``, then every row's chunks until each row ends; ``False`` when downstream stopped reading
    first (it has all it wants: a stop string matched). The rows are cancelled and their channels closed on the
    way out, however it is left; a row the engine failed is an internal error."""
    try:
        try:
            await outbox.send(started)
        except trio.BrokenResourceError:
            return False
        if len(rows) == 1:  # one choice, the common case: no task of its own, and its tokens in the step's pass
            if not await _forward_one(rows[0], outbox):
                return False
        else:
            stopped: list[bool] = []

            async def forward(row: Row, choice: int) -> None:
                if not await _forward(row, choice, outbox):
                    stopped.append(True)
                    nursery.cancel_scope.cancel()  # downstream has all it wants: every choice stops

            async with trio.open_nursery() as nursery:
                for i, row in enumerate(rows):
                    nursery.start_soon(forward, row, i)
            if stopped:
                return False
    finally:
        for row in rows:
            row.cancel()
            row.chunks.close()
    failed = next((row.error for row in rows if row.error is not None), None)
    if failed is not None:
        raise ApiError("internal", f"generation failed: {failed}") from failed
    return True


async def _forward(row: Row, choice: int, outbox: Outbox[Generation]) -> bool:
    """One choice's chunks, tagged with the choice; ``False`` when downstream closed its inbox."""
    try:
        async for chunk in row.chunks:
            merged = merge_pending(chunk, row.chunks)
            await outbox.send(replace(merged, choice=choice) if choice else merged)
    except trio.BrokenResourceError:
        return False
    return True


# Put in a row's channel by its lane: the task has work to finish (see the module's text).
WAKE = TokenChunk(())


class Lane:
    """A one-row request's stages, run in the engine's crossing for each of its tokens (see the module's text).

    It runs in the request's context (the per-request notes and callbacks its stages use), outside its task."""

    def __init__(self, outbox: Outbox[Generation]) -> None:
        self.outbox = outbox
        self.context = contextvars.copy_context()
        self.failure: BaseException | None = None
        self.stopped = False  # downstream took no more

    def take(self, chunk: TokenChunk) -> TokenChunk | None:
        # No readiness check first: an edge that cannot take the chunk now keeps it for the task, in order.
        outbox = self.outbox
        try:
            self.context.run(outbox.send_now, chunk)
        except trio.BrokenResourceError:
            self.stopped = True
            return WAKE
        except BaseException as exc:  # raised in the request's task, as if its own send had
            self.failure = exc
            return WAKE
        return None if outbox.ready() else WAKE


async def _forward_one(row: Row, outbox: Outbox[Generation]) -> bool:
    """The one row's chunks; ``False`` when downstream stopped reading. While the task waits, the row's
    tokens go through its lane (when the stages take them synchronously); its last chunk waits for the
    request's turn (:func:`flow.graph.stage.paced`): the end of a stream, or the whole body's formatting."""
    lane = Lane(outbox) if outbox.sends_now() else None
    chunks = row.chunks
    try:
        while True:
            try:
                chunk = chunks.receive_nowait()
            except trio.WouldBlock:
                row.taker = lane.take if lane is not None else None
                try:
                    chunk = await chunks.receive()
                except trio.EndOfChannel:
                    break
                finally:
                    row.taker = None
            except trio.EndOfChannel:
                break
            if chunk is WAKE:
                assert lane is not None
                if lane.failure is not None:
                    raise lane.failure
                if lane.stopped:
                    return False
                await outbox.drain()
                continue
            if chunk.finish_reason is not None:
                await paced()  # requests whose rows end in one step end a few per turn of the loop
            await outbox.send(merge_pending(chunk, chunks))
    except trio.BrokenResourceError:
        return False
    return True
