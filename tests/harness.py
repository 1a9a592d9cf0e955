"""A real flow server on loopback, in a background thread, for tests.

The server runs its own ``trio.run`` in a thread so that tests can use the
official *synchronous* SDK clients against it. It listens on 127.0.0.1 on a
free port and stops by itself when the context manager exits.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import trio

from flow.compiler import CompiledGraph, compile_tables
from flow.server import FlowServer, serve
from flow.spec import load_tables

GRAPHS = Path(__file__).resolve().parent.parent / "graphs"


def graph_with_model(model_path: Path | str, *, graph: str = "default.toml", name: str = "tiny",
                     **overrides: Any) -> CompiledGraph:
    """The named graph file with its model resource pointed at ``model_path``."""
    tables = load_tables(GRAPHS / graph)
    table = tables["resources"]["model"]
    table.update(path=str(model_path), name=name, aliases=["default"], **overrides)
    return compile_tables(tables, f"{graph} (test)")


class RunningServer:
    def __init__(self, server: FlowServer, base_url: str) -> None:
        self.server = server
        self.base_url = base_url
        self.url = base_url + "/v1"

    def health(self) -> dict[str, Any]:
        return httpx.get(self.base_url + "/health", timeout=10).json()  # type: ignore[no-any-return]

    def engine_stats(self) -> dict[str, Any]:
        return self.health()["models"][0]["engine"]  # type: ignore[no-any-return]


@contextmanager
def running_server(graph: CompiledGraph) -> Iterator[RunningServer]:
    server = FlowServer(graph)
    ready = threading.Event()
    box: dict[str, Any] = {}

    async def main() -> None:
        stop = trio.Event()
        box["stop"] = stop
        box["token"] = trio.lowlevel.current_trio_token()
        async with trio.open_nursery() as nursery:
            binds = await nursery.start(lambda task_status: serve(server, "127.0.0.1", 0, shutdown_trigger=stop.wait,
                                                                   task_status=task_status))
            box["bind"] = binds[0]
            ready.set()

    def thread_main() -> None:
        try:
            trio.run(main)
        except BaseException as exc:  # surfaced to the test below
            box["error"] = exc
            ready.set()

    thread = threading.Thread(target=thread_main, name="flow-test-server", daemon=True)
    thread.start()
    ready.wait(120)
    if "error" in box:
        raise box["error"]
    try:
        yield RunningServer(server, box["bind"])
    finally:
        box["token"].run_sync_soon(box["stop"].set)
        thread.join(30)
