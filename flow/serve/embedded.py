"""A flow server running in a background thread of this process.

Used by the test-suite and by ``flow bench``: the server runs its own
``trio.run`` in a thread, so synchronous clients (the official SDKs, httpx) can
talk to it from the calling thread. It listens on loopback on a free port and
stops when the context manager exits.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import httpx
import trio

from flow.graph.compiled import CompiledGraph
from flow.serve.lifecycle import serve
from flow.serve.server import FlowServer, GraphLoader


class RunningServer:
    def __init__(self, server: FlowServer, base_url: str) -> None:
        self.server = server
        self.base_url = base_url
        self.url = base_url + "/v1"

    def health(self) -> dict[str, Any]:
        return httpx.get(self.base_url + "/health", timeout=10).json()  # type: ignore[no-any-return]

    def engine_stats(self, model: int = 0) -> dict[str, Any]:
        return self.health()["models"][model]["engine"]  # type: ignore[no-any-return]


@contextmanager
def running_server(graph: CompiledGraph, host: str = "127.0.0.1",
                   loader: GraphLoader | None = None) -> Iterator[RunningServer]:
    """Serve ``graph``; ``loader`` compiles the graph again for a reload (``POST /admin/reload``)."""
    server = FlowServer(graph, loader=loader)
    server.observer.owner = "embedded"  # /stats' server.owner
    ready = threading.Event()
    box: dict[str, Any] = {}

    async def main() -> None:
        stop = trio.Event()
        box["stop"], box["token"] = stop, trio.lowlevel.current_trio_token()

        async def _serve(task_status: trio.TaskStatus[list[str]] = trio.TASK_STATUS_IGNORED) -> None:
            await serve(server, host, 0, shutdown_trigger=stop.wait, task_status=task_status)

        async with trio.open_nursery() as nursery:
            box["bind"] = (await nursery.start(_serve))[0]
            ready.set()

    def thread_main() -> None:
        try:
            trio.run(main)
        except BaseException as exc:  # handed to the caller below
            box["error"] = exc
            ready.set()

    thread = threading.Thread(target=thread_main, name="flow-embedded-server", daemon=True)
    thread.start()
    ready.wait()
    if "error" in box:
        raise box["error"]
    try:
        yield RunningServer(server, box["bind"])
    finally:
        box["token"].run_sync_soon(box["stop"].set)
        thread.join(30)
