"""A server's life: open files raised, signals, ``--watch``, hypercorn until the drain ends.

:func:`serve` loads the graph's resources (:meth:`FlowServer.start`), builds the HTTP app over the server
(:mod:`flow.serve.http`) and runs hypercorn until a signal or the embedding's trigger starts the drain;
the running requests get ``server.shutdown_grace_seconds``, then end with an error event in their
protocol; resources close last (the disk tier flushes its writes).
"""

from __future__ import annotations

import importlib
import logging
import os
import resource
import signal
from collections.abc import Awaitable, Callable

import trio
from hypercorn.config import Config as HypercornConfig
from hypercorn.trio import serve as hypercorn_serve

from flow.graph.spec import SHUTDOWN_CLOSE_SECONDS
from flow.serve import hypercorn_fixes
from flow.serve.http import create_app
from flow.serve.server import FlowServer

log = logging.getLogger("flow.serve.lifecycle")


def raise_open_file_limit() -> int:
    """Raise the soft limit on open files to the hard limit; return the soft limit now in force.

    Every open connection holds a file descriptor, and the soft limit is small: 1024 on most
    Linux systems, 256 on macOS, and ``import mlx_lm`` sets (2048, 4096) — lowering the hard
    limit too, which an unprivileged process cannot undo (ml-explore/mlx-lm#1589). At the soft
    limit ``accept`` fails with EMFILE: new clients wait in the listen backlog, then time out,
    until connections close. Raising the soft limit is always allowed (Go's runtime does it at
    start-up); where the hard limit is unlimited, the kernel may refuse some values, so smaller
    ones are tried. ``mlx_lm.utils`` is imported first: were it imported later (a model the pool loads on
    demand), its import would set (2048, 4096) again under the running server.
    """
    importlib.import_module("mlx_lm.utils")
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return soft
    targets = [hard] if hard != resource.RLIM_INFINITY else [1 << 20, 65536, 10240]  # 10240: macOS OPEN_MAX
    for target in targets:
        if target <= soft:
            break
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
        except (ValueError, OSError):
            continue
        log.debug("open-file limit raised from %d to %d", soft, target)
        return target
    return soft


async def _signalled(server: FlowServer, grace: float) -> None:
    """SIGTERM (systemd, ``docker stop``) and SIGINT drain alike; a second one ends the requests now.
    SIGHUP reloads the graph. SIGUSR1 drains, then ``flow serve`` executes itself again (a distributed model whose
    group was lost asks for it: MLX forms one group per process)."""
    with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR1) as signals:
        async for signum in signals:
            if signum == signal.SIGHUP:
                log.info("received SIGHUP: reloading the graph")
                await server.reload()
                continue
            if signum == signal.SIGUSR1:
                log.info("received SIGUSR1: draining, then starting again")
                server.restart = True
                server.begin_drain(grace)
                continue
            if server.draining.is_set():
                server.end_requests()
                return
            log.info("received %s", signal.Signals(signum).name)
            server.begin_drain(grace)


async def watch(server: FlowServer, files: Callable[[], list[str]], interval: float = 1.0) -> None:
    """``flow serve --watch``: reload when a graph file (or one it extends) changes. Polls modification
    times: no dependency, and an editor's save-by-rename is seen like any write."""

    def stamps() -> dict[str, float | None]:
        out: dict[str, float | None] = {}
        for name in files():
            try:
                out[name] = os.stat(name).st_mtime_ns
            except OSError:
                out[name] = None
        return out

    seen = await trio.to_thread.run_sync(stamps)
    while True:
        await trio.sleep(interval)
        now = await trio.to_thread.run_sync(stamps)
        if now != seen:
            seen = now
            log.info("graph file changed: reloading")
            await server.reload()


async def serve(server: FlowServer, host: str, port: int, *,
                shutdown_trigger: Callable[[], Awaitable[None]] | None = None,
                watch_files: Callable[[], list[str]] | None = None,
                task_status: trio.TaskStatus[list[str]] = trio.TASK_STATUS_IGNORED) -> None:
    """Load the graph's resources, then serve HTTP until a signal (or ``shutdown_trigger``) stops it:
    no new requests, the running ones get ``server.shutdown_grace_seconds`` to finish, then end with an
    error event in their protocol; resources close last (the disk tier flushes its writes)."""
    raise_open_file_limit()  # one descriptor per open connection
    hypercorn_fixes.apply()
    server.bind_host = host
    spec = server.graph.spec.server
    grace = spec.shutdown_grace_seconds

    async def triggered() -> None:
        assert shutdown_trigger is not None
        await shutdown_trigger()
        server.begin_drain(grace)

    try:
        async with trio.open_nursery() as duties:  # resources' background duties, for the server's life
            await server.start(duties)
            app = create_app(server)
            config = HypercornConfig()
            config.bind = [f"{host}:{port}"]
            # hypercorn's default listen backlog is 100: a burst of connections beyond it has its SYNs
            # dropped and waits a 1 s retransmit (or more). 2048 is uvicorn's and gunicorn's default;
            # the kernel caps it at net.core.somaxconn (kern.ipc.somaxconn on macOS).
            config.backlog = 2048
            config.worker_class = "trio"
            # A connection with no request in progress — idle, or still sending its request's headers (a
            # slowloris) — is closed after this; bodies have their own deadline (body_timeout_seconds).
            config.keep_alive_timeout = spec.idle_timeout_seconds
            # Connections still open a second past the grace (a half-sent body, the last error events) are closed:
            # the process exits about a second after the grace, inside the supervisor's (flow.graph.spec).
            config.graceful_timeout = grace + SHUTDOWN_CLOSE_SECONDS
            config.accesslog = None
            config.errorlog = logging.getLogger("hypercorn.error")  # one handler: the root logger's
            async with trio.open_nursery() as nursery:
                if shutdown_trigger is None:
                    nursery.start_soon(_signalled, server, grace)
                else:
                    nursery.start_soon(triggered)
                if watch_files is not None:
                    nursery.start_soon(watch, server, watch_files)
                nursery.start_soon(server.drain, grace)
                await hypercorn_serve(app, config, shutdown_trigger=server.draining.wait,
                                      task_status=task_status)
                nursery.cancel_scope.cancel()
            duties.cancel_scope.cancel()
    finally:
        server.close()
