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

import logging
import re
import resource
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import trio
from hypercorn.config import Config as HypercornConfig
from hypercorn.trio import serve as hypercorn_serve
from quart import Response, request
from quart_trio import QuartTrio
from werkzeug.exceptions import HTTPException

from flow.compiler import CompiledGraph, Route
from flow.resources import ModelResource
from flow.metrics import Metric, Registry
from flow.runner import RouteRunner
from flow.stage import EdgeStats, ExitStage, Outbox, Stage
from protocols.errors import ApiError
from protocols.ir import HttpRequest, WireFrame
from protocols.openai_chat import error_body as openai_error_body
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
        try:
            with scope:
                async with send:
                    try:
                        await runner.run(http, outbox)
                    except BaseException as raw:
                        exc = first_error(raw)
                        if isinstance(exc, trio.Cancelled) or not isinstance(exc, Exception):
                            raise
                        error = exc if isinstance(exc, ApiError) else None
                        if error is None:
                            log.exception("request %s failed", http.request_id, exc_info=exc)
                            error = ApiError("internal", f"Internal error while generating: {type(exc).__name__}: {exc}")
                        if error.status >= 500:
                            self.requests_failed += 1
                        frames = exit_cls.error_frames(error) if outbox.sent else [exit_cls.error_response(error)]
                        for frame in frames:
                            await send.send(frame)
        finally:
            self.requests_active -= 1
            self._duration.observe(time.perf_counter() - started, route=f"{runner.route.method} {runner.route.path}")

    async def respond(self, runner: RouteRunner, http: HttpRequest, nursery: trio.Nursery) -> Response:
        send, receive = trio.open_memory_channel[WireFrame](64)
        scope = trio.CancelScope()
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
            return Response(first.data, status=first.status, headers=list(first.headers))

        async def body() -> AsyncIterator[bytes]:
            try:
                yield first.data
                async for frame in receive:
                    yield frame.data
            finally:
                scope.cancel()  # the client left, or the stream is over
                receive.close()

        response = Response(body(), status=first.status, headers=list(first.headers))
        response.timeout = None
        return response

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
        if model.loaded is not None:
            out.update(path=str(model.loaded.path), smoke_test=model.loaded.smoke_test,
                       context_length=model.loaded.context_length, kv_budget_bytes=model.kv_budget_bytes,
                       engine=model.loaded.engine.stats_json())
        return out


def _json(obj: Any, status: int = 200) -> Response:
    return Response(dumps(obj), status=status, content_type="application/json")


def create_app(server: FlowServer) -> QuartTrio:
    app = QuartTrio("flow")
    app.config.update(RESPONSE_TIMEOUT=None, BODY_TIMEOUT=120, MAX_CONTENT_LENGTH=server.graph.spec.server.max_body_bytes)
    api_key = server.graph.spec.server.api_key

    def route_view(runner: RouteRunner) -> Callable[[], Awaitable[Response]]:
        exit_cls: type[ExitStage[Any, Any]] = server.graph.stages[runner.route.exit].cls  # type: ignore[assignment]

        async def view(**params: str) -> Response:
            if api_key is not None and not _key_ok(api_key):
                frame = exit_cls.error_response(ApiError("authentication", "Invalid or missing API key."))
                return Response(frame.data, status=frame.status, headers=list(frame.headers))
            http = HttpRequest(
                method=request.method, path=request.path, query=request.query_string.decode("latin-1"),
                headers=tuple(request.headers.items()), body=await request.get_data(cache=False),
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
        error = ApiError("not_found", f"The model {model_id!r} does not exist on this server.", param="model",
                         code="model_not_found")
        return Response(openai_error_body(error), status=404, content_type="application/json")

    @app.errorhandler(HTTPException)
    async def http_error(exc: HTTPException) -> Response:
        kinds = {404: "not_found", 405: "method_not_allowed", 413: "request_too_large"}
        kind = kinds.get(exc.code or 500, "invalid_request" if (exc.code or 500) < 500 else "internal")
        message = {
            404: f"No route {request.method} {request.path}. Routes: "
                 + ", ".join(f"{m} {p}" for m, p in sorted(server.runners)) + ", GET /v1/models, GET /health.",
            405: f"{request.method} is not allowed on {request.path}.",
            413: f"The request body is larger than {server.graph.spec.server.max_body_bytes} bytes.",
        }.get(exc.code or 500, exc.description or "error")
        error = ApiError(kind, message)  # type: ignore[arg-type]
        return Response(openai_error_body(error), status=exc.code or 500, content_type="application/json")

    @app.after_serving
    async def _close() -> None:
        server.close()

    return app


def quart_rule(path: str) -> str:
    """Graph routes write path parameters as ``{name}``; Quart wants ``<name>``."""
    return re.sub(r"\{(\w+)\}", r"<\1>", path)


def _key_ok(expected: str) -> bool:
    given = request.headers.get("x-api-key")
    auth = request.headers.get("authorization", "")
    if auth.lower().startswith("bearer "):
        given = given or auth[7:].strip()
    return given == expected


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


async def serve(server: FlowServer, host: str, port: int, *,
                shutdown_trigger: Callable[[], Awaitable[None]] | None = None,
                task_status: trio.TaskStatus[list[str]] = trio.TASK_STATUS_IGNORED) -> None:
    """Load the graph's resources, then serve HTTP until ``shutdown_trigger`` returns."""
    raise_open_file_limit()  # one descriptor per open connection
    await server.start()
    app = create_app(server)

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
    config.keep_alive_timeout = 75
    config.graceful_timeout = 5
    config.accesslog = None
    config.errorlog = logging.getLogger("hypercorn.error")  # one handler: the root logger's
    await hypercorn_serve(app, config, shutdown_trigger=shutdown_trigger, task_status=task_status)  # type: ignore[arg-type]
