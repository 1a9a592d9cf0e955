"""Run one request through its route: stages inline in one task where they can be, tasks and channels elsewhere.

Each stage on the route either runs inline — called for each item by its producer, in the producer's task
(:mod:`flow.graph.inline` says which) — or heads a task of its own, fed through an inbox channel (capacity:
the stage's ``buffer``). A producer sends into its consumers' inboxes, or straight into its inline consumer's
step (:class:`InlineOutbox`). When a stage's ``run`` returns, its output is finished: its inline consumers'
``end`` runs, in order down the chain, and its consumers' inboxes close, so end-of-stream flows down the graph
by itself. An exception in any stage cancels the whole request and propagates to the caller, which renders
it in the route's protocol (see :mod:`flow.serve.server`).

A route whose stages all run in one task — the entry works as a step and every other stage is inline, as on
the chat routes — runs in the caller's own task: no nursery, no channel, no task per stage. Every stage and
edge still counts its figures (``/stats``, ``/metrics``): runs, errors (charged to the stage that raised,
once), items per edge.

Such a chain can also be fed with no task at all: :meth:`InlineOutbox.send_now` runs each step's
``feed_now`` synchronously (an engine step handing a row its token, see :mod:`stages.rows`), and keeps what
must await for the request's task, in order.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping
from typing import Any

import trio

from flow.graph.compiled import CompiledGraph, Route
from flow.graph.stage import (
    EdgeStats,
    NotNow,
    Outbox,
    Stage,
    StageStats,
    Step,
    request_lifetime,
    takes_now,
)
from protocols.ir import HttpRequest, WireFrame


class _Failures:
    """A request's exceptions already charged to a stage: one raised inline passes up through its producers,
    which must not count it again."""

    def __init__(self) -> None:
        self._seen: set[int] = set()

    def charge(self, exc: BaseException, stats: StageStats) -> None:
        if isinstance(exc, Exception) and id(exc) not in self._seen:
            self._seen.add(id(exc))
            stats.errors += 1


class InlineOutbox(Outbox[Any]):
    """The edge to an inline stage: each item is fed to the stage's step at once, in the sender's task.

    Or without a task at all (:meth:`send_now`: an engine step handing a row its token): the step's
    ``feed_now`` takes the item synchronously. An item it can only take by awaiting — and every item after it,
    so that none overtakes another — waits in the edge's backlog until the request's task drains it
    (:meth:`drain`, or the next :meth:`send`, which drains first)."""

    def __init__(self, step: Step[Any, Any], downstream: Outbox[Any], edge: EdgeStats, stats: StageStats,
                 failures: _Failures) -> None:
        super().__init__((), (edge,))
        self._step = step
        self._downstream = downstream
        self._edge = edge
        self._stage = stats
        self._failures = failures
        self._takes_now = takes_now(step)
        self._backlog: deque[Any] = deque()
        self._done = False  # the step takes no more items
        self._ended = False  # its end has run (or the request failed)

    def _count(self) -> None:
        if self._done:  # the stage has all it wants: as sending into a closed inbox
            raise trio.BrokenResourceError("the consumer takes no more items")
        self.sent += 1
        self._edge.items += 1

    async def send(self, item: Any) -> None:
        self._count()
        if self._backlog:
            await self._drain_backlog()
        await self._feed(item)

    async def _feed(self, item: Any) -> None:
        try:
            more = await self._step.feed(item, self._downstream)
        except BaseException as exc:
            self._failures.charge(exc, self._stage)
            raise
        if not more:  # it has all it wants: what waits behind it is dropped, as items left in a closed inbox
            self._done = True
            self._backlog.clear()
            await self._end()

    def sends_now(self) -> bool:
        return self._takes_now and self._downstream.sends_now()

    def ready(self) -> bool:
        return self._takes_now and not self._done and not self._backlog and self._downstream.ready()

    def send_now(self, item: Any) -> None:
        self._count()
        if self._backlog:  # behind an item that waits for the task (downstream keeps its own order)
            self._backlog.append(item)
            return
        try:
            more = self._step.feed_now(item, self._downstream)
        except NotNow:
            self._backlog.append(item)
            return
        except BaseException as exc:
            self._failures.charge(exc, self._stage)
            raise
        if not more:
            self._done = True  # later sends fail at once; the step's end waits for the task
            self._backlog.append(_END)

    async def _drain_backlog(self) -> None:
        while self._backlog:
            item = self._backlog.popleft()
            if item is _END:
                await self._end()
            else:
                await self._feed(item)

    async def drain(self) -> None:
        await self._drain_backlog()
        await self._downstream.drain()

    async def finish(self) -> None:
        self._done = True
        await self._drain_backlog()
        await self._end()

    async def _end(self) -> None:
        if self._ended:
            return
        self._ended = True
        try:
            await self._step.end(self._downstream)
        except BaseException as exc:
            self._failures.charge(exc, self._stage)
            raise
        await self._downstream.finish()

    def close(self) -> None:
        self._done = self._ended = True
        self._backlog.clear()  # the request failed or was cancelled: nothing more is fed
        self._downstream.close()


# In a backlog: the step wanted no more items; its end runs in turn.
_END = object()


class RouteRunner:
    """Runs requests on one route of a compiled graph with live stage instances."""

    def __init__(self, graph: CompiledGraph, route: Route, instances: Mapping[str, Stage[Any, Any]]) -> None:
        self.graph = graph
        self.route = route
        self.instances = instances
        self._consumers: dict[str, list[str]] = {sid: [] for sid in route.stages}
        for src, dst in route.edges:
            self._consumers[src].append(dst)
        self.edge_stats = {edge: EdgeStats() for edge in route.edges}
        self.stage_stats = {sid: StageStats() for sid in route.stages}
        self._heads = [sid for sid in route.stages if sid not in route.inline]
        # The whole route in the caller's task: the entry is a step and every other stage inline.
        self._one_task = self._heads == [route.entry] and instances[route.entry].inline
        # The inboxes of the runs in flight, by stage: their fill is the queue depth /stats shows.
        self._inboxes: dict[str, set[trio.MemoryReceiveChannel[Any]]] = {sid: set() for sid in route.stages}

    def queued(self, sid: str) -> int:
        """Items waiting now in ``sid``'s inboxes, over this route's requests in flight (an inline stage has
        none: its items are handled as they are sent)."""
        return sum(inbox.statistics().current_buffer_used for inbox in self._inboxes[sid])

    async def run(self, request: HttpRequest, exit_outbox: Outbox[WireFrame]) -> None:
        """Run the request; the exit stage's frames go to ``exit_outbox`` (finished or closed at the end)."""
        route = self.route
        failures = _Failures()
        inboxes: dict[str, tuple[trio.MemorySendChannel[Any], trio.MemoryReceiveChannel[Any]]] = {}
        if not self._one_task:
            for sid in self._heads:
                buffer = self.graph.stages[sid].buffer
                inboxes[sid] = trio.open_memory_channel(max(buffer, 1) if sid == route.entry else buffer)
        outboxes: dict[str, Outbox[Any]] = {}
        for sid in reversed(route.stages):  # consumers before their producers
            consumers = self._consumers[sid]
            if sid == route.exit:
                outboxes[sid] = exit_outbox
            elif len(consumers) == 1 and consumers[0] in route.inline:
                consumer = consumers[0]
                outboxes[sid] = InlineOutbox(self.instances[consumer].open_step(), outboxes[consumer],
                                             self.edge_stats[(sid, consumer)], self.stage_stats[consumer], failures)
            else:
                outboxes[sid] = Outbox([inboxes[c][0].clone() for c in consumers],
                                       [self.edge_stats[(sid, c)] for c in consumers])
        inline = [self.stage_stats[sid] for sid in route.inline]
        for stats in inline:
            stats.active += 1
            stats.runs += 1
        try:
            with request_lifetime():
                if self._one_task:
                    await self._run_entry_step(request, outboxes[route.entry], failures)
                    return
                entry_send = inboxes[route.entry][0]
                entry_send.send_nowait(request)
                for send, _ in inboxes.values():
                    send.close()  # only the clones held by producers stay open
                async with trio.open_nursery() as nursery:
                    for sid in self._heads:
                        nursery.start_soon(self._run_stage, sid, inboxes[sid][1], outboxes[sid], failures,
                                           name=f"stage:{sid}")
        finally:
            for stats in inline:
                stats.active -= 1

    async def _run_entry_step(self, request: HttpRequest, outbox: Outbox[Any], failures: _Failures) -> None:
        """The entry's step, fed the request in this task (and, through the inline outboxes, every stage)."""
        sid = self.route.entry
        stats = self.stage_stats[sid]
        stats.active += 1
        stats.runs += 1
        try:
            step = self.instances[sid].open_step()
            await step.feed(request, outbox)
            await step.end(outbox)
            await outbox.finish()
        except BaseException as exc:
            failures.charge(exc, stats)
            raise
        finally:
            stats.active -= 1
            outbox.close()

    async def _run_stage(self, sid: str, inbox: trio.MemoryReceiveChannel[Any], outbox: Outbox[Any],
                         failures: _Failures) -> None:
        stats = self.stage_stats[sid]
        stats.active += 1
        stats.runs += 1
        self._inboxes[sid].add(inbox)
        async with inbox:
            try:
                await self.instances[sid].run(inbox, outbox)
                await outbox.finish()
            except BaseException as exc:
                failures.charge(exc, stats)
                raise
            finally:
                stats.active -= 1
                self._inboxes[sid].discard(inbox)
                outbox.close()
