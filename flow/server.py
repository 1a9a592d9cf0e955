"""The thin HTTP shell: quart-trio on hypercorn, routes built from a compiled graph.

Theory of operation
-------------------
:class:`FlowServer` instantiates a compiled graph: resources (models load on
the device thread), one instance per stage, one :class:`RouteRunner` per route.
Each route becomes a Quart view that turns the HTTP request into an
:class:`HttpRequest` item and starts the request's run in the app's nursery
under its own cancel scope. The view waits for the first :class:`WireFrame`:
its status and headers become the response head; a streaming frame makes the
rest of the run the response body.

Whatever ends the response early — the client disconnecting (quart-trio then
cancels the view or the body iterator) or the body finishing — cancels the
run's scope, and with it every stage task and the engine sequence.

Errors become the route's protocol shape: before the first frame, the exit
stage's ``error_response``; after it, the exit stage's ``error_frames`` end
the stream. Nothing reaches a client as a traceback, and the server stays up.
"""

from __future__ import annotations

import contextvars
import logging
import re
import resource
import signal
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import trio
from hypercorn.config import Config as HypercornConfig
from hypercorn.trio import serve as hypercorn_serve
from quart import Response, has_request_context, request
from quart_trio import QuartTrio
from werkzeug.datastructures import Headers
from werkzeug.exceptions import HTTPException

from flow import hypercorn_fixes
from flow.compiler import CompiledGraph
from flow.guard import Guard
from flow.resources import ModelResource
from flow.metrics import Metric, Registry
from flow.runner import RouteRunner
from flow.stage import EdgeStats, ExitStage, Outbox, Stage
from protocols.errors import ApiError
from protocols.ir import HttpRequest, WireFrame
from protocols.limits import CHARS_PER_TOKEN
from protocols.sse import dumps
from runtime.device import DeviceThread, shared_device

log = logging.getLogger("flow.server")


def first_error(exc: BaseException) -> BaseException:
    """The most telling error inside (possibly nested) exception groups: an ApiError if any."""
    if isinstance(exc, BaseExceptionGroup):
        found = [first_error(e) for e in exc.exceptions]
        for candidate in found:
            if isinstance(candidate, ApiError):
                return candidate
        return found[0]
    return exc


# The run scopes a request's view started; cancelled when the request's ASGI call ends (see _EndRunsWithRequest).
_request_runs: contextvars.ContextVar[list[trio.CancelScope] | None] = contextvars.ContextVar(
    "flow_request_runs", default=None)


class _EndRunsWithRequest:
    """ASGI middleware: the runs a request started are cancelled when its ASGI call ends, however it ends.

    A streaming response's run is normally cancelled by its body iterator's ``finally``. But a client that
    leaves after the view has returned and before Quart has begun the body (the disconnect cancels Quart's
    send of the response head) leaves that iterator never started, hence never closed: without this, the
    run, its engine sequence (prefill, then up to ``max_tokens``) and its task would go on, nobody reading.
    """

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        runs: list[trio.CancelScope] = []
        token = _request_runs.set(runs)
        try:
            await self.app(scope, receive, send)
        finally:
            _request_runs.reset(token)
            for run in runs:
                run.cancel()


def shutting_down() -> ApiError:
    """What requests refused or ended by a graceful stop get: retryable, a restarted server may answer."""
    return ApiError("overloaded", "The server is shutting down; retry shortly.", retry_after=5)


class FlowServer:
    """A compiled graph made live: resources, stage instances and routes."""

    def __init__(self, graph: CompiledGraph, device: DeviceThread | None = None) -> None:
        self.graph = graph
        self.device = device or shared_device()
        self.resources: dict[str, Any] = {
            rid: res.cls(rid, res.config) for rid, res in graph.resources.items()
        }
        self.stages: dict[str, Stage[Any, Any]] = {
            sid: st.cls(sid, st.config, {name: self.resources[name] for name in st.resources})
            for sid, st in graph.stages.items()
        }
        self.runners = {(r.method, r.path): RouteRunner(graph, r, self.stages) for r in graph.routes}
        self.started_at = time.time()
        self.started = False  # every eagerly loaded resource is ready
        self.requests_total = 0
        self.requests_failed = 0
        self.requests_active = 0
        # Graceful stop: a signal (or the embedding's trigger) starts draining; requests still running when
        # the grace period ends are cancelled and end with ``stop_error`` in their protocol's shape.
        self.draining = trio.Event()
        self.stop_error: ApiError | None = None
        self._runs: set[trio.CancelScope] = set()
        self.metrics = Registry()
        self._requests = self.metrics.counter("flow_requests_total", "Requests by route and response status.")
        self._duration = self.metrics.histogram("flow_request_duration_seconds", "Whole request time by route.")
        self._first_byte = self.metrics.histogram(
            "flow_time_to_first_byte_seconds", "Time until the response head (streams: the first event) by route.")
        self.metrics.collector(self._collect)

    @property
    def models(self) -> list[ModelResource]:
        return [r for r in self.resources.values() if isinstance(r, ModelResource)]

    async def start(self) -> None:
        """Bind resources that manage others (a model pool), then start every resource concurrently."""
        self.device.start()
        for resource in self.resources.values():
            if hasattr(resource, "bind"):
                resource.bind(self.resources)
        async with trio.open_nursery() as nursery:
            for resource in self.resources.values():
                nursery.start_soon(resource.start, self.device)
        self.started = True

    async def run_duties(self) -> None:
        """Resources' background duties while serving (a pool's idle unloading), until cancelled."""
        async with trio.open_nursery() as nursery:
            for resource in self.resources.values():
                if hasattr(resource, "run"):
                    nursery.start_soon(resource.run)

    def close(self) -> None:
        for resource in self.resources.values():
            resource.close()

    # ------------------------------------------------------------------ one request
    async def run_request(self, runner: RouteRunner, http: HttpRequest,
                          send: trio.MemorySendChannel[WireFrame], scope: trio.CancelScope) -> None:
        exit_cls: type[ExitStage[Any, Any]] = self.graph.stages[runner.route.exit].cls  # type: ignore[assignment]
        self.requests_total += 1
        self.requests_active += 1
        started = time.perf_counter()
        outbox: Outbox[WireFrame] = Outbox([send.clone()])
        self._runs.add(scope)
        try:
            async with send:
                with scope:
                    try:
                        await runner.run(http, outbox)
                    except BaseException as raw:
                        exc = first_error(raw)
                        if isinstance(exc, trio.Cancelled) or not isinstance(exc, Exception):
                            raise
                        error = exc if isinstance(exc, ApiError) else None
                        if error is None:
                            # A server fault: the details go to the log under the request id, not to the client.
                            log.error("request %s (%s %s) failed", http.request_id, http.method, http.path,
                                      exc_info=exc)
                            error = ApiError("internal", f"Internal server error (request id {http.request_id}); "
                                             "the server log has the details.")
                        if error.status >= 500:
                            self.requests_failed += 1
                        await self._send_all(send, self._error_frames(exit_cls, error, outbox.sent > 0, http.request_id))
                if scope.cancelled_caught and self.stop_error is not None:
                    # Cancelled by the end of a graceful stop: the client learns why, in its protocol.
                    with trio.move_on_after(2):
                        await self._send_all(send, self._error_frames(exit_cls, self.stop_error, outbox.sent > 0,
                                                                      http.request_id))
        except Exception:  # a run task must never raise: it would close the app's nursery to every later request
            log.exception("request %s: failed while reporting its error", http.request_id)
        finally:
            self._runs.discard(scope)
            self.requests_active -= 1
            self._duration.observe(time.perf_counter() - started, route=f"{runner.route.method} {runner.route.path}")

    @staticmethod
    async def _send_all(send: trio.MemorySendChannel[WireFrame], frames: list[WireFrame]) -> None:
        """Send ``frames`` unless the client has gone (then nobody reads them)."""
        for frame in frames:
            try:
                await send.send(frame)
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                return

    @staticmethod
    def _error_frames(exit_cls: type[ExitStage[Any, Any]], error: ApiError, streaming: bool,
                      request_id: str) -> list[WireFrame]:
        """The exit stage's frames for ``error``; should encoding them fail, a plain internal error (a run
        task must never raise: it would take the app's nursery, and every later request, with it)."""
        try:
            return exit_cls.error_frames(error) if streaming else [exit_cls.error_response(error)]
        except Exception:
            log.exception("request %s: could not encode its error %r", request_id, error.message[:200])
            fallback = ApiError("internal", f"Internal server error (request id {request_id}).")
            return exit_cls.error_frames(fallback) if streaming else [exit_cls.error_response(fallback)]

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

    def body_limit(self) -> int:
        """The largest request body accepted: the graph's ``server.max_body_bytes``, or derived from the
        served models' context (what the largest one could accept as text, with room for JSON escapes and
        tool definitions), between 1 and 64 MiB. Unloaded models count as the maximum."""
        configured = self.graph.spec.server.max_body_bytes
        if configured is not None:
            return configured
        ceiling = 64 << 20
        if not self.models or any(m.loaded is None for m in self.models):
            return ceiling
        largest = max(m.loaded.context_length for m in self.models if m.loaded is not None)
        return max(1 << 20, min(ceiling, 4 * largest * CHARS_PER_TOKEN + (1 << 20)))

    async def respond(self, runner: RouteRunner, http: HttpRequest, nursery: trio.Nursery) -> Response:
        if self.draining.is_set():
            return self.error_response(http.path, shutting_down(), close=True,
                                       exit_cls=self.exit_class(runner.route.exit))
        send, receive = trio.open_memory_channel[WireFrame](64)
        scope = trio.CancelScope()
        runs = _request_runs.get()
        if runs is not None:
            runs.append(scope)  # cancelled when the request ends, even if its body never began
        route = f"{runner.route.method} {runner.route.path}"
        started = time.perf_counter()
        nursery.start_soon(self.run_request, runner, http, send, scope)
        try:
            first = await receive.receive()
        except BaseException:
            scope.cancel()
            raise
        self._first_byte.observe(time.perf_counter() - started, route=route)
        self._requests.inc(route=route, status=str(first.status))
        if not first.streaming:
            receive.close()
            return Response(first.data, status=first.status, headers=Headers(list(first.headers)))

        async def body() -> AsyncIterator[bytes]:
            try:
                yield first.data
                async for frame in receive:
                    yield frame.data
            finally:
                scope.cancel()  # the client left, or the stream is over
                receive.close()

        response = Response(body(), status=first.status, headers=Headers(list(first.headers)))
        response.timeout = None
        return response

    # ------------------------------------------------------------------ error shapes
    def exit_class(self, stage_id: str) -> type[ExitStage[Any, Any]]:
        return self.graph.stages[stage_id].cls  # type: ignore[return-value]

    def exit_for_path(self, path: str) -> type[ExitStage[Any, Any]]:
        """The exit stage whose protocol an error on ``path`` is written in: the route whose fixed part is
        the longest prefix of the path (``/v1/messages/batches`` → Anthropic), else OpenAI chat's."""
        best: tuple[int, str] | None = None
        for route in self.graph.routes:
            fixed = route.path.split("{", 1)[0].rstrip("/")
            if path == fixed or path.startswith(fixed + "/"):
                if best is None or len(fixed) > best[0]:
                    best = (len(fixed), route.exit)
        if best is not None:
            return self.exit_class(best[1])
        from stages.openai_chat import OpenAIChatFormat  # the shape most clients expect

        return OpenAIChatFormat

    def error_response(self, path: str, error: ApiError, *, close: bool = False,
                       exit_cls: type[ExitStage[Any, Any]] | None = None) -> Response:
        """An error the shell answers itself, in the protocol of ``path`` (or of ``exit_cls``); ``close`` when
        the request body may still be on its way (the connection cannot be reused: its next bytes are that body)."""
        frame = (exit_cls or self.exit_for_path(path)).error_response(error)
        headers = [*frame.headers, *([("connection", "close")] if close else [])]
        return Response(frame.data, status=frame.status, headers=Headers(headers))

    # ------------------------------------------------------------------ info endpoints
    def models_json(self) -> dict[str, Any]:
        """The model list in a shape both SDKs accept: OpenAI's ``{object, data:[{id, object,
        created, owned_by}]}`` and Anthropic's ``{data:[{type, id, display_name, created_at}],
        has_more, first_id, last_id}`` (each ignores the other's fields)."""
        created = int(self.started_at)
        created_at = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(created))
        data = []
        for model in self.models:
            for model_id in model.ids:
                entry: dict[str, Any] = {"id": model_id, "object": "model", "created": created, "owned_by": "flow",
                                         "type": "model", "display_name": model_id, "created_at": created_at,
                                         "lifecycle": "active"}
                if model_id != model.name:
                    entry["alias_of"] = model.name
                if model.loaded is not None:
                    entry["max_input_tokens"] = model.loaded.context_length
                    if model.loaded.smoke_test:
                        entry["description"] = "SMOKE-TEST MODEL: random weights, output is gibberish"
                        entry["display_name"] = f"{model_id} (smoke-test model)"
                data.append(entry)
        return {"object": "list", "data": data, "has_more": False,
                "first_id": data[0]["id"] if data else None, "last_id": data[-1]["id"] if data else None}

    def health_json(self) -> dict[str, Any]:
        return {
            "status": "ok" if self.started else "loading",
            "graph": self.graph.name,
            "uptime_seconds": round(time.time() - self.started_at, 1),
            "requests": {"total": self.requests_total, "active": self.requests_active,
                         "failed": self.requests_failed},
            "models": [self._model_health(m) for m in self.models],
        }

    def stats_json(self) -> dict[str, Any]:
        """Everything observable: requests, models with their engines, and resources that keep stats."""
        health = self.health_json()
        return {
            "graph": self.graph.name,
            "uptime_seconds": health["uptime_seconds"],
            "requests": health["requests"],
            "models": {m["id"]: m for m in health["models"]},
            "resources": {rid: res.stats() for rid, res in self.resources.items() if hasattr(res, "stats")},
            "edges": {f"{src} -> {dst}": {"items": e.items, "full": e.full, "streams": e.streams}
                      for (src, dst), e in self.edge_stats().items()},
        }

    def edge_stats(self) -> dict[tuple[str, str], EdgeStats]:
        """Per graph edge, summed over the routes that share it."""
        total: dict[tuple[str, str], EdgeStats] = {}
        for runner in self.runners.values():
            for edge, stats in runner.edge_stats.items():
                acc = total.setdefault(edge, EdgeStats())
                acc.items += stats.items
                acc.full += stats.full
                acc.streams += stats.streams
        return total

    def _collect(self) -> list[Metric]:
        """Metrics read at scrape time from the engines, stores and edges."""
        active = Metric("flow_requests_active", "Requests in flight.", "gauge")
        active.set(self.requests_active)
        prompt = Metric("flow_prompt_tokens_total", "Prompt tokens prefilled, by model.", "counter")
        generated = Metric("flow_generated_tokens_total", "Tokens generated, by model.", "counter")
        running = Metric("flow_engine_sequences", "Sequences in the engine, by model and state.", "gauge")
        steps = Metric("flow_engine_steps_total", "Engine steps, by model.", "counter")
        finished = Metric("flow_engine_sequences_total", "Sequences that left the engine, by model and outcome.",
                          "counter")
        for model in self.models:
            if model.loaded is None:
                continue
            engine = model.loaded.engine
            stats = engine.stats
            prompt.set(stats.prompt_tokens, model=model.name)
            generated.set(stats.generated_tokens, model=model.name)
            running.set(engine.active, model=model.name, state="active")
            running.set(engine.waiting, model=model.name, state="waiting")
            steps.set(stats.steps, model=model.name)
            for outcome in ("finished", "cancelled", "failed"):
                finished.set(getattr(stats, outcome), model=model.name, outcome=outcome)
        store_entries = Metric("flow_store_entries", "Entries in stores, by resource.", "gauge")
        store_bytes = Metric("flow_store_bytes", "Bytes held by stores, by resource.", "gauge")
        for rid, res in self.resources.items():
            if hasattr(res, "stats"):
                numbers = res.stats()
                if "entries" in numbers:
                    store_entries.set(numbers["entries"], resource=rid)
                    store_bytes.set(numbers.get("bytes", 0), resource=rid)
        items = Metric("flow_edge_items_total", "Items sent along each graph edge.", "counter")
        full = Metric("flow_edge_full_total", "Sends that found the consumer's inbox full (backpressure).", "counter")
        for (src, dst), e in self.edge_stats().items():
            items.set(e.items, edge=f"{src}->{dst}")
            full.set(e.full, edge=f"{src}->{dst}")
        resource_metrics = [m for res in self.resources.values() if hasattr(res, "metrics") for m in res.metrics()]
        return [active, prompt, generated, running, steps, finished, store_entries, store_bytes, items, full,
                *resource_metrics]

    @staticmethod
    def _model_health(model: ModelResource) -> dict[str, Any]:
        out: dict[str, Any] = {"id": model.name, "aliases": model.config.aliases, "ready": model.loaded is not None,
                               "state": model.state, "family": model.family.name}
        if model.loaded is not None:  # no paths: /health needs no key
            out.update(smoke_test=model.loaded.smoke_test,
                       context_length=model.loaded.context_length, kv_budget_bytes=model.kv_budget_bytes,
                       engine=model.loaded.engine.stats_json())
        return out


def _json(obj: Any, status: int = 200) -> Response:
    return Response(dumps(obj), status=status, content_type="application/json")


def create_app(server: FlowServer, guard: Guard) -> QuartTrio:
    spec = server.graph.spec.server
    app = QuartTrio("flow")
    app.asgi_app = _EndRunsWithRequest(app.asgi_app)  # type: ignore[method-assign]
    app.config.update(RESPONSE_TIMEOUT=None, BODY_TIMEOUT=spec.body_timeout_seconds,
                      MAX_CONTENT_LENGTH=server.body_limit())

    @app.before_request
    async def _guard() -> Response | None:
        """Host, origin, key and content type: checked before routing, so an unknown route or method tells
        an unauthenticated client nothing, and before the body is read (the connection is then closed)."""
        headers = {name.lower(): value for name, value in request.headers.items()}
        if "transfer-encoding" in headers and "content-length" in headers:
            # RFC 9112 §6.1: a request with both may be smuggling one inside the other; never reuse it.
            return server.error_response(request.path, ApiError(
                "invalid_request", "The request has both Content-Length and Transfer-Encoding."), close=True)
        try:
            guard.check(request.method, request.path, headers)
        except ApiError as error:
            return server.error_response(request.path, error, close=True)
        return None

    def route_view(runner: RouteRunner) -> Callable[[], Awaitable[Response]]:
        async def view(**params: str) -> Response:
            body = await request.get_data(cache=False, as_text=False)
            assert isinstance(body, bytes)
            http = HttpRequest(
                method=request.method, path=request.path, query=request.query_string.decode("latin-1"),
                headers=tuple(request.headers.items()), body=body,
                request_id=uuid.uuid4().hex[:24], params=tuple(params.items()),
            )
            return await server.respond(runner, http, app.nursery)

        view.__name__ = f"route_{runner.route.entry}_{runner.route.method}"
        return view

    for (method, path), runner in server.runners.items():
        app.add_url_rule(quart_rule(path), endpoint=f"{runner.route.entry}:{method}:{path}", view_func=route_view(runner),
                         methods=[method])

    @app.route("/", methods=["GET", "HEAD"])
    async def root() -> Response:
        return _json({"name": "flow", "graph": server.graph.name, "status": "ok"})

    @app.route("/health", methods=["GET", "HEAD"])
    async def health() -> Response:
        body = server.health_json()
        return _json(body, 200 if body["status"] == "ok" else 503)

    @app.route("/metrics", methods=["GET"])
    async def metrics() -> Response:
        return Response(server.metrics.render(), content_type="text/plain; version=0.0.4; charset=utf-8")

    @app.route("/stats", methods=["GET"])
    async def stats() -> Response:
        return _json(server.stats_json())

    @app.route("/v1/models", methods=["GET"])
    async def models() -> Response:
        return _json(server.models_json())

    @app.route("/v1/models/<path:model_id>", methods=["GET"])
    async def model(model_id: str) -> Response:
        for entry in server.models_json()["data"]:
            if entry["id"] == model_id:
                return _json(entry)
        return server.error_response(request.path, ApiError(
            "not_found", f"The model {model_id!r} does not exist on this server.", param="model",
            code="model_not_found"))

    @app.errorhandler(HTTPException)
    async def http_error(exc: HTTPException) -> Response:
        code = exc.code or 500
        if not has_request_context():  # a WebSocket: it has no HTTP request to answer
            return Response(b"", status=code)
        kinds = {404: "not_found", 405: "method_not_allowed", 413: "request_too_large", 408: "invalid_request"}
        kind = kinds.get(code, "invalid_request" if code < 500 else "internal")
        message = {
            404: f"No route {request.method} {request.path}. Routes: "
                 + ", ".join(f"{m} {p}" for m, p in sorted(server.runners)) + ", GET /v1/models, GET /health.",
            405: f"{request.method} is not allowed on {request.path}.",
            413: f"The request body is larger than {server.body_limit()} bytes, more than the served models' "
                 "context can take.",
            408: f"The request body did not arrive within {spec.body_timeout_seconds:g} seconds.",
        }.get(code, exc.description or "error")
        # Routing and size errors come before the body is read: the connection cannot carry another request.
        return server.error_response(request.path, ApiError(kind, message), close=True)  # type: ignore[arg-type]

    @app.errorhandler(Exception)
    async def unexpected(exc: Exception) -> Response:
        request_id = uuid.uuid4().hex[:24]
        log.error("unexpected error %s", request_id, exc_info=exc)
        error = ApiError("internal", f"Internal server error (request id {request_id}); the server log has "
                         "the details.")
        if not has_request_context():
            return Response(b"", status=500)
        return server.error_response(request.path, error, close=True)

    @app.after_serving
    async def _close() -> None:
        server.close()

    return app


def quart_rule(path: str) -> str:
    """Graph routes write path parameters as ``{name}``; Quart wants ``<name>``."""
    return re.sub(r"\{(\w+)\}", r"<\1>", path)


def raise_open_file_limit() -> int:
    """Raise the soft limit on open files to the hard limit; return the soft limit now in force.

    Every open connection holds a file descriptor, and the soft limit is small: 1024 on most
    Linux systems, 256 on macOS, and ``import mlx_lm`` sets (2048, 4096) — lowering the hard
    limit too, which an unprivileged process cannot undo (ml-explore/mlx-lm#1589). At the soft
    limit ``accept`` fails with EMFILE: new clients wait in the listen backlog, then time out,
    until connections close. Raising the soft limit is always allowed (Go's runtime does it at
    start-up); where the hard limit is unlimited, the kernel may refuse some values, so smaller
    ones are tried.
    """
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
    """SIGTERM (systemd, ``docker stop``) and SIGINT drain alike; a second signal ends the requests now."""
    with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
        async for signum in signals:
            if server.draining.is_set():
                server.end_requests()
                return
            log.info("received %s", signal.Signals(signum).name)
            server.begin_drain(grace)


async def serve(server: FlowServer, host: str, port: int, *,
                shutdown_trigger: Callable[[], Awaitable[None]] | None = None,
                task_status: trio.TaskStatus[list[str]] = trio.TASK_STATUS_IGNORED) -> None:
    """Load the graph's resources, then serve HTTP until a signal (or ``shutdown_trigger``) stops it:
    no new requests, the running ones get ``server.shutdown_grace_seconds`` to finish, then end with an
    error event in their protocol; resources close last (the disk tier flushes its writes)."""
    raise_open_file_limit()  # one descriptor per open connection
    hypercorn_fixes.apply()
    await server.start()
    spec = server.graph.spec.server
    app = create_app(server, Guard(host, spec.allowed_hosts, spec.api_key))

    @app.before_serving
    async def _duties() -> None:
        app.nursery.start_soon(server.run_duties)

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
    config.graceful_timeout = spec.shutdown_grace_seconds + 5  # room for the last requests' error events
    config.accesslog = None
    config.errorlog = logging.getLogger("hypercorn.error")  # one handler: the root logger's
    grace = spec.shutdown_grace_seconds

    async def triggered() -> None:
        assert shutdown_trigger is not None
        await shutdown_trigger()
        server.begin_drain(grace)

    async with trio.open_nursery() as nursery:
        if shutdown_trigger is None:
            nursery.start_soon(_signalled, server, grace)
        else:
            nursery.start_soon(triggered)
        nursery.start_soon(server.drain, grace)
        await hypercorn_serve(app, config, shutdown_trigger=server.draining.wait,
                              task_status=task_status)
        nursery.cancel_scope.cancel()
