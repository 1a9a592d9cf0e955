"""Run one request through its route: one nursery, one task per stage, channels as edges.

Each stage on the route gets one inbox channel (capacity: the stage's
``buffer``); each producer sends into the inboxes of its on-route consumers.
Closing a send side ends the stream; a stage's task closes its outbox when it
returns, so end-of-stream flows down the graph by itself. An exception in any
stage cancels the whole nursery and propagates to the caller, which renders it
in the route's protocol (see :mod:`flow.serve.server`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import trio

from flow.graph.compiled import CompiledGraph, Route
from flow.graph.stage import EdgeStats, Outbox, Stage, StageStats, request_lifetime
from protocols.ir import HttpRequest, WireFrame


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
        # The inboxes of the runs in flight, by stage: their fill is the queue depth /stats shows.
        self._inboxes: dict[str, set[trio.MemoryReceiveChannel[Any]]] = {sid: set() for sid in route.stages}

    def queued(self, sid: str) -> int:
        """Items waiting now in ``sid``'s inboxes, over this route's requests in flight."""
        return sum(inbox.statistics().current_buffer_used for inbox in self._inboxes[sid])

    async def run(self, request: HttpRequest, exit_outbox: Outbox[WireFrame]) -> None:
        """Run the request; the exit stage's frames go to ``exit_outbox`` (closed at the end)."""
        route = self.route
        inboxes: dict[str, tuple[trio.MemorySendChannel[Any], trio.MemoryReceiveChannel[Any]]] = {}
        for sid in route.stages:
            buffer = self.graph.stages[sid].buffer
            inboxes[sid] = trio.open_memory_channel(max(buffer, 1) if sid == route.entry else buffer)
        outboxes: dict[str, Outbox[Any]] = {}
        for sid in route.stages:
            if sid == route.exit:
                outboxes[sid] = exit_outbox
            else:
                outboxes[sid] = Outbox([inboxes[c][0].clone() for c in self._consumers[sid]],
                                       [self.edge_stats[(sid, c)] for c in self._consumers[sid]])
        entry_send = inboxes[route.entry][0]
        entry_send.send_nowait(request)
        for send, _ in inboxes.values():
            send.close()  # only the clones held by producers stay open
        with request_lifetime():
            async with trio.open_nursery() as nursery:
                for sid in route.stages:
                    nursery.start_soon(self._run_stage, sid, inboxes[sid][1], outboxes[sid], name=f"stage:{sid}")

    async def _run_stage(self, sid: str, inbox: trio.MemoryReceiveChannel[Any], outbox: Outbox[Any]) -> None:
        stats = self.stage_stats[sid]
        stats.active += 1
        stats.runs += 1
        self._inboxes[sid].add(inbox)
        async with inbox:
            try:
                await self.instances[sid].run(inbox, outbox)
            except Exception:
                stats.errors += 1
                raise
            finally:
                stats.active -= 1
                self._inboxes[sid].discard(inbox)
                outbox.close()
