"""A one-row request's lane (stages/rows.py): an engine step's tokens run through the row's stages in the step's
own pass while the request's task waits; whatever must await goes back to the task, in order.

A fake outbox stands in for the row's chain of stages: it records what it got and how (``now``: in the step's
pass, ``task``: from the request's task), can be told to keep items for the task (as a full socket does), to
refuse more (as a stop string does) or to fail.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any, cast

import trio
import trio.testing

from flow.graph.stage import Outbox, request_notes
from protocols.ir import GenerationStarted, PreparedPrompt, TokenChunk
from runtime.handle import SequenceHandle
from stages.rows import forward_rows


class Chain(Outbox[Any]):
    def __init__(self) -> None:
        super().__init__(())
        self.got: list[tuple[str, Any]] = []
        self.kept: list[Any] = []  # taken without waiting, waiting for the task's drain
        self.keep_next = False
        self.refuse = False
        self.fail_on: int | None = None
        self.drains = 0

    async def send(self, item: Any) -> None:
        if self.refuse:
            raise trio.BrokenResourceError
        await self.drain()
        self.got.append(("task", item))

    def sends_now(self) -> bool:
        return True

    def ready(self) -> bool:
        return not self.kept and not self.refuse

    def send_now(self, item: Any) -> None:
        if self.refuse:
            raise trio.BrokenResourceError
        if item.token_ids and item.token_ids[0] == self.fail_on:
            raise ValueError("the parser broke")
        if self.kept or self.keep_next:
            self.keep_next = False
            self.kept.append(item)
            return
        self.got.append(("now", item))

    async def drain(self) -> None:
        self.drains += 1
        while self.kept:
            self.got.append(("drained", self.kept.pop(0)))


def started(stream: bool = True) -> GenerationStarted:
    prompt = cast(PreparedPrompt, SimpleNamespace(request=SimpleNamespace(stream=stream)))  # all rows.py reads
    return GenerationStarted(prompt, 3)


def run(chain: Chain, steps: list[TokenChunk], before: Any = None,
        stream: bool = True) -> tuple[bool | BaseException, SequenceHandle]:
    """The row's task forwards while a device puts one chunk per step (each step after the task waits again)."""
    send, receive = trio.open_memory_channel[TokenChunk](100)
    row = SequenceHandle(1, send, receive, on_cancel=lambda _id: None)
    outcome: list[bool | BaseException] = []

    async def main() -> None:
        async def task() -> None:
            try:
                outcome.append(await forward_rows(started(stream), [row], chain))
            except Exception as exc:
                outcome.append(exc)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(task)
            for i, chunk in enumerate(steps):
                await trio.testing.wait_all_tasks_blocked()
                if before is not None:
                    before(i)
                if row.finished:
                    break
                row.put(chunk)

    trio.run(main)
    return outcome[0], row


def tokens(*ids: int, finish: str | None = None) -> list[TokenChunk]:
    return [TokenChunk((i,)) for i in ids] + ([TokenChunk((), finish)] if finish else [])  # type: ignore[arg-type]


def test_tokens_go_through_the_chain_in_the_steps_pass_and_the_finish_through_the_task() -> None:
    chain = Chain()
    result, row = run(chain, tokens(1, 2, 3, finish="stop"))
    assert result is True and row.finished
    assert [(how, getattr(item, "token_ids", None)) for how, item in chain.got] == [
        ("task", None), ("now", (1,)), ("now", (2,)), ("now", (3,)), ("task", ())]


def test_a_rows_finish_waits_its_turn_before_the_chain_gets_it() -> None:
    """The server's pacer (request_notes' ``pace``): requests whose rows all finish in one step end a few per
    turn, streamed or whole (a whole body is formatted at its end)."""
    chain = Chain()
    waited: list[int] = []

    async def pace() -> None:
        waited.append(len(chain.got))  # what the chain had when the finish waited its turn
        await trio.sleep(0)

    with request_notes({}, pace):
        result, _ = run(chain, tokens(1, 2, finish="stop"))
        assert result is True and waited == [3]  # after the header and both tokens, before the finish
        assert [how for how, _ in chain.got] == ["task", "now", "now", "task"]
        waited.clear()
        run(Chain(), tokens(1, finish="stop"), stream=False)
        assert len(waited) == 1
        waited.clear()
    run(Chain(), tokens(1, finish="stop"))  # outside a request's notes: no pace
    assert waited == []


def test_what_the_chain_keeps_is_drained_by_the_task_before_anything_after_it() -> None:
    chain = Chain()

    def socket_full(step: int) -> None:
        chain.keep_next = step == 1

    result, _ = run(chain, tokens(1, 2, 3, 4, finish="length"), before=socket_full)
    assert result is True
    assert [(how, item.token_ids) for how, item in chain.got[1:]] == [
        ("now", (1,)), ("drained", (2,)), ("now", (3,)), ("now", (4,)), ("task", ())]
    assert chain.drains >= 1


def test_a_failure_in_the_steps_pass_is_raised_in_the_requests_task() -> None:
    chain = Chain()
    chain.fail_on = 2
    result, row = run(chain, tokens(1, 2, 3, finish="stop"))
    assert isinstance(result, ValueError) and "parser broke" in str(result)
    assert row.finished  # cancelled on the way out: the engine drops it at its next step


def test_a_chain_that_wants_no_more_ends_the_forwarding() -> None:
    chain = Chain()

    def stop_string(step: int) -> None:
        chain.refuse = step == 2

    result, row = run(chain, tokens(1, 2, 3, 4, finish="stop"), before=stop_string)
    assert result is False and row.finished
    assert [item.token_ids for how, item in chain.got[1:]] == [(1,), (2,)]


def test_several_choices_keep_their_tasks() -> None:
    """More than one row: each row's task forwards its chunks (no lane), tagged with its choice."""
    chain = Chain()
    rows = []
    for i in range(2):
        send, receive = trio.open_memory_channel[TokenChunk](100)
        rows.append(SequenceHandle(i, send, receive, on_cancel=lambda _id: None))

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(forward_rows, started(), rows, chain)
            await trio.testing.wait_all_tasks_blocked()
            assert all(row.taker is None for row in rows)
            for row in rows:
                row.put(TokenChunk((7,), "length"))

    trio.run(main)
    assert sorted(item.choice for how, item in chain.got[1:]) == [0, 1] and all(h == "task" for h, _ in chain.got)
