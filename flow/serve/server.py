"""Serving a live graph over HTTP: requests, graceful stop, live reload.

Theory of operation
-------------------
:class:`FlowServer` holds the :class:`~flow.serve.live.LiveGraph`. The HTTP app
(:mod:`flow.serve.http`) matches each request against the current generation's
routes and hands it to :meth:`FlowServer.respond`, which starts the request's
run in the app's nursery under its own cancel scope and waits for the first
:class:`WireFrame`: its status and headers become the response head; a
streaming frame makes the rest of the run the response body, which the run
writes to the connection itself (:mod:`flow.serve.exit`). The request holds
its generation until the run ends, so a reload never pulls a resource from
under it.

Whatever ends the response early — the client disconnecting or the body
finishing — cancels the run's scope, and with it every stage task and the
engine sequence.

Errors become the route's protocol shape: before the first frame, the exit
stage's ``error_response``; after it, its ``error_frames`` end the stream.
Nothing reaches a client as a traceback, and the server stays up.

Reload (``SIGHUP``, ``POST /admin/reload``, ``flow serve --watch``): the graph
is compiled whole by the server's loader; any error changes nothing and is
reported as ``flow check`` prints it; otherwise :meth:`LiveGraph.reload`
switches new requests to it.
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncGenerator, Callable
from dataclasses import dataclass, replace
from typing import Any

import trio

from flow.graph.compiled import CompiledGraph, CompileError
from flow.graph.runner import RouteRunner
from flow.graph.stage import EntryStage, ExitStage, request_notes
from flow.resources import heap
from flow.resources.model import ModelResource
from flow.serve.exit import BodyWriter, ResponseExit, RunExit
from flow.serve.guard import Guard
from flow.serve.live import Generation, LiveGraph, ReloadRefused, ReloadReport
from flow.serve.loop_watch import LoopWatch
from flow.serve.observe import Observer, RecentRequest
from flow.serve.pacing import TurnPacer
from protocols.errors import ApiError
from protocols.ir import HttpRequest, WireFrame
from protocols.limits import CHARS_PER_TOKEN
from protocols.openai_audio import AUDIO_UPLOAD_BYTES
from protocols.openai_embeddings import MAX_INPUTS
from runtime.arrivals import ARRIVING, CURRENT
from runtime.device import DeviceThread, shared_device

log = logging.getLogger("flow.serve.server")

GraphLoader = Callable[[], CompiledGraph]


def first_error(exc: BaseException) -> BaseException:
    """The most telling error inside (possibly nested) exception groups: an ApiError if any."""
    if isinstance(exc, BaseExceptionGroup):
        found = [first_error(e) for e in exc.exceptions]
        for candidate in found:
            if isinstance(candidate, ApiError):
                return candidate
        return found[0]
    return exc


def shutting_down() -> ApiError:
    """What requests refused or ended by a graceful stop get: retryable, a restarted server may answer."""
    return ApiError("overloaded", "The server is shutting down; retry shortly.", retry_after=5)


@dataclass(frozen=True)
class Answer:
    """What a request is answered with: its first frame (status, headers, the body or its first bytes) and,
    for a stream, the rest of the body. The HTTP app (flow.serve.graph_routes) sends it."""

    first: WireFrame
    body: AsyncGenerator[bytes, None] | None = None  # for a stream: yields the first frame, then the run writes the rest


@dataclass
class ReloadOutcome:
    """A reload's result: the report, or the errors (as ``flow check`` prints them) and nothing changed."""

    report: ReloadReport | None = None
    errors: str = ""

    def json(self) -> dict[str, Any]:
        if self.report is not None:
            return {"reloaded": True, **self.report.json()}
        return {"reloaded": False, "errors": self.errors}


class FlowServer:
    """A live graph served over HTTP: request runs, counters, graceful stop, reload."""

    def __init__(self, graph: CompiledGraph, device: DeviceThread | None = None,
                 loader: GraphLoader | None = None) -> None:
        self.device = device or shared_device()
        self.live = LiveGraph(graph, self.device)
        self.pacer = TurnPacer()  # a wave of requests starts a few per turn of the loop (flow.serve.pacing)
        self.loader = loader  # compiles the graph again for a reload (None: reload is off)
        self._first = graph
        self.bind_host = graph.spec.server.host  # the host actually bound (set by serve)
        self.started_at = time.time()
        self.started = False  # every eagerly loaded resource is ready
        self.requests_total = 0
        self.requests_failed = 0
        self.requests_active = 0
        # Graceful stop: a signal (or the embedding's trigger) starts draining; requests still running when
        # the grace period ends are cancelled and end with ``stop_error`` in their protocol's shape.
        self.draining = trio.Event()
        self.restart = False  # once drained, `flow serve` executes itself again (SIGUSR1)
        self.stop_error: ApiError | None = None
        self._runs: set[trio.CancelScope] = set()
        self.reload_failures = 0  # reloads refused (compile errors, a resource that did not start)
        self.on_reload: Callable[[], None] | None = None  # the HTTP app refreshes its limits
        self.observer = Observer(self)
        self.metrics = self.observer.metrics
        self.loop_watch = LoopWatch(self.metrics)  # the event loop's lag; stalls logged with their culprit

    # ------------------------------------------------------------------ the live graph
    @property
    def graph(self) -> CompiledGraph:
        return self.live.gen.graph if self.live.current is not None else self._first

    @property
    def resources(self) -> dict[str, Any]:
        return self.live.gen.resources if self.live.current is not None else {}

    @property
    def models(self) -> list[ModelResource]:
        return [r for r in self.resources.values() if isinstance(r, ModelResource)]

    @property
    def guard(self) -> Guard:
        spec = self.graph.spec.server
        return Guard(self.bind_host, spec.allowed_hosts, spec.api_key)

    async def start(self, nursery: trio.Nursery) -> None:
        """Start the device thread and the first graph's resources (concurrently); their background duties
        run in ``nursery``."""
        nursery.start_soon(self.loop_watch.run)
        nursery.start_soon(heap.collect_when_quiet, lambda: (self.requests_active, self.requests_total))
        self.device.start()
        await self.live.start(nursery)
        self.started = True

    def close(self) -> None:
        self.live.close()

    async def reload(self) -> ReloadOutcome:
        """Compile the graph again and switch to it; on any error nothing changes."""
        if self.loader is None:
            return ReloadOutcome(errors="this server was not started from a graph file; nothing to reload")
        try:
            graph = await trio.to_thread.run_sync(self.loader)
        except CompileError as exc:
            outcome = ReloadOutcome(errors=str(exc))
        except Exception as exc:  # an unreadable file: reported, never fatal
            outcome = ReloadOutcome(errors=f"{type(exc).__name__}: {exc}")
        else:
            outcome = await self._switch(graph)
        if outcome.errors:
            self.reload_failures += 1
            log.error("reload refused; the running graph is unchanged:\n%s", outcome.errors)
        return outcome

    async def _switch(self, graph: CompiledGraph) -> ReloadOutcome:
        old, new = self.graph.spec.server, graph.spec.server
        moved = [key for key in ("host", "port") if getattr(old, key) != getattr(new, key)]
        if moved:
            return ReloadOutcome(errors=f"server.{moved[0]} changed ({getattr(old, moved[0])!r} → "
                                 f"{getattr(new, moved[0])!r}): a restart applies it, a reload cannot")
        try:
            report = await self.live.reload(graph)
        except ReloadRefused as exc:
            return ReloadOutcome(errors=f"the new graph's resources failed to start: {exc}")
        if self.on_reload is not None:
            self.on_reload()
        return ReloadOutcome(report=report)

    # ------------------------------------------------------------------ one request
    async def run_request(self, gen: Generation, runner: RouteRunner, http: HttpRequest, exit: RunExit,
                          scope: trio.CancelScope, record: RecentRequest | None = None) -> None:
        """Run one request, its frames to ``exit``; errors end it in the route's protocol shape. ``exit`` is
        ended when the run is over, however it ends."""
        exit_stage = gen.exit_stage(runner.route.exit)
        self.requests_total += 1
        self.requests_active += 1
        started = time.perf_counter()
        self._runs.add(scope)
        try:
            with self.live.entered(gen):
                with scope, request_notes(record.notes if record is not None else {}, self.pacer.turn):
                    try:
                        await runner.run(http, exit)
                    except BaseException as raw:
                        exc = first_error(raw)
                        if isinstance(exc, trio.Cancelled) or not isinstance(exc, Exception):
                            raise
                        error = exc if isinstance(exc, ApiError) else None
                        if error is None:
                            # A server fault: the details go to the log under the request id, not the client.
                            log.error("request %s (%s %s) failed", http.request_id, http.method, http.path,
                                      exc_info=exc)
                            error = ApiError("internal", f"Internal server error (request id "
                                             f"{http.request_id}); the server log has the details.")
                        if error.status >= 500:
                            self.requests_failed += 1
                        await self._send_all(exit, self._error_frames(exit_stage, error, exit.sent > 0,
                                                                      http.request_id))
                if scope.cancelled_caught and self.stop_error is not None:
                    # Cancelled by the end of a graceful stop: the client learns why, in its protocol.
                    with trio.move_on_after(2):
                        await self._send_all(exit, self._error_frames(exit_stage, self.stop_error,
                                                                      exit.sent > 0, http.request_id))
        except Exception:  # a run task must never raise: it would close the app's nursery to every later request
            log.exception("request %s: failed while reporting its error", http.request_id)
        finally:
            exit.end()
            self._runs.discard(scope)
            self.requests_active -= 1
            self.observer.duration.observe(time.perf_counter() - started,
                                           route=f"{runner.route.method} {runner.route.path}")
            if record is not None:
                record.finished(round((time.perf_counter() - started) * 1000, 1))

    @staticmethod
    async def _send_all(exit: RunExit, frames: list[WireFrame]) -> None:
        """Send ``frames`` unless the client has gone (then nobody reads them)."""
        for frame in frames:
            try:
                await exit.send(frame)
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                return

    @staticmethod
    def _error_frames(exit_stage: ExitStage[Any, Any], error: ApiError, streaming: bool,
                      request_id: str) -> list[WireFrame]:
        """The exit stage's frames for ``error``; should encoding them fail, a plain internal error (a run
        task must never raise: it would take the app's nursery, and every later request, with it)."""
        try:
            return exit_stage.error_frames(error) if streaming else [exit_stage.error_response(error)]
        except Exception:
            log.exception("request %s: could not encode its error %r", request_id, error.message[:200])
            fallback = ApiError("internal", f"Internal server error (request id {request_id}).")
            return exit_stage.error_frames(fallback) if streaming else [exit_stage.error_response(fallback)]

    async def respond(self, gen: Generation, runner: RouteRunner, http: HttpRequest, nursery: trio.Nursery,
                      runs: list[trio.CancelScope] | None, writer: BodyWriter) -> Answer:
        """Start the request's run; answer with its first frame (and, streaming, the rest as the body, which the
        run writes through ``writer`` once the head is sent). ``runs``: the ASGI call's list of run scopes,
        cancelled when the call ends."""
        if self.draining.is_set():
            return Answer(self.error_response(http.path, shutting_down(), close=True,
                                              exit_stage=gen.exit_stage(runner.route.exit)))
        exit = ResponseExit()
        scope = trio.CancelScope()
        if runs is not None:
            runs.append(scope)  # cancelled when the request ends, even if its body never began
        route = f"{runner.route.method} {runner.route.path}"
        started = time.perf_counter()
        entry = gen.stages[runner.route.entry]
        listed = not (isinstance(entry, EntryStage) and http.method in entry.monitoring_methods)
        record = self.observer.request_started(http.request_id, route, listed=listed)
        # On its way to an engine until it submits or answers: an idle engine waits for a burst (runtime/arrivals.py).
        arrival = ARRIVING.started()
        place = CURRENT.set(arrival)
        nursery.start_soon(self.run_request, gen, runner, http, exit, scope, record)  # the task takes the context
        CURRENT.reset(place)
        try:
            await exit.started.wait()
        except BaseException:
            scope.cancel()
            raise
        finally:
            arrival.settle()
        first = exit.first
        if first is None:
            raise RuntimeError(f"request {http.request_id}: the run ended without a response")
        await self.pacer.turn()  # the response (a whole body, or a stream's head) goes out a few per turn
        self.observer.first_byte.observe(time.perf_counter() - started, route=route)
        self.observer.requests.inc(route=route, status=str(first.status))
        record.first_byte(first.status, round((time.perf_counter() - started) * 1000, 1))
        if not first.streaming:
            return Answer(first)

        async def body() -> AsyncGenerator[bytes, None]:
            try:
                yield first.data
                exit.attach(writer)  # the head and the first bytes are sent: the run writes the rest itself
                await exit.serve()
            finally:
                scope.cancel()  # the client left, or the stream is over

        return Answer(first, body())

    def error_response(self, path: str, error: ApiError, *, close: bool = False,
                       exit_stage: ExitStage[Any, Any] | None = None) -> WireFrame:
        """An error the shell answers itself, in the protocol of ``path`` (or of ``exit_stage``); ``close`` when
        the request body may still be on its way (the connection cannot be reused: its next bytes are that body)."""
        frame = (exit_stage or self.live.gen.exit_for_path(path)).error_response(error)
        return replace(frame, headers=(*frame.headers, ("connection", "close"))) if close else frame

    def body_limit(self) -> int:
        """The largest request body accepted: the graph's ``server.max_body_bytes``, or derived from the
        served models' context (what the largest one could accept as text, with room for JSON escapes and
        tool definitions), between 1 and 64 MiB. Unloaded models count as the maximum."""
        configured = self.graph.spec.server.max_body_bytes
        if configured is not None:
            return configured
        ceiling = 64 << 20
        if not self.models or any(not m.ready for m in self.models):
            return ceiling
        need = []
        for model in self.models:
            if model.loaded is not None:  # text: the context as text, with room for escapes and tools
                need.append(4 * model.loaded.context_length * CHARS_PER_TOKEN)
            elif model.audio is not None:  # an uploaded recording, as large as OpenAI's audio API takes
                need.append(AUDIO_UPLOAD_BYTES)
            elif model.embedding is not None:  # the most inputs a request may send, each as long as it may be
                need.append(MAX_INPUTS * model.embedding.max_length * 8)
        return max(1 << 20, min(ceiling, max(need) + (1 << 20)))

    # ------------------------------------------------------------------ graceful stop
    def begin_drain(self, grace: float) -> None:
        if not self.draining.is_set():
            log.info("stopping: no new requests; %d in flight get %g s to finish", self.requests_active, grace)
            self.draining.set()

    def end_requests(self) -> None:
        """Cancel every request still running; each ends with the stop error in its protocol's shape."""
        self.stop_error = shutting_down()
        if self._runs:
            log.info("stopping: ending %d requests still running", len(self._runs))
        for scope in list(self._runs):
            scope.cancel()

    async def drain(self, grace: float) -> None:
        """Once draining begins, give running requests ``grace`` seconds, then end them."""
        await self.draining.wait()
        with trio.move_on_after(grace):
            while self._runs:
                await trio.sleep(0.05)
        self.end_requests()
