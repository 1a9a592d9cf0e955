"""The HTTP app: quart-trio on hypercorn, one dispatcher over the live graph's routes.

The graph's routes are not Quart rules: they change with a reload. One
catch-all view matches each request against the current generation's routing
table (``{param}`` segments; 404, or 405 with the methods the path has) and
hands it to :meth:`FlowServer.respond`. The shell owns only ``/health``,
``/stats`` (and its feed ``/stats/events``), ``/metrics`` and ``POST /admin/reload`` (and answers ``GET /`` with a
short JSON when the graph has no console page there); every error it writes
itself (unknown route, wrong method, body too large or too slow, refused host
or key) takes the protocol shape of the path's route, or the graph's
``server.default_exit``.

Checks before routing (host, origin, API key, content type) run for every path
the same way, before the body is read.
"""

from __future__ import annotations

import contextvars
import functools
import logging
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import trio
from quart import Response, has_request_context, request, websocket
from quart_trio import QuartTrio
from werkzeug.datastructures import Headers
from werkzeug.exceptions import HTTPException

from flow.serve.hypercorn_fixes import DirectWriter, direct_writer
from flow.serve.live import NoRoute
from flow.serve.server import Answer, FlowServer
from flow.serve.stats_feed import FeedLimit, parse_interval
from flow.serve.stats_feed import stats_events as stats_feed
from flow.serve.websocket import WS_METHOD, ResponsesSocket
from protocols.errors import ApiError
from protocols.ir import HttpRequest, WireFrame
from protocols.sse import dumps

log = logging.getLogger("flow.serve.http")

METHODS = ["GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS"]


def _no_direct_write(data: bytes) -> None:
    """Where the connection has no direct writer: a piece always takes the awaited path."""
    return None


@dataclass
class _RequestIO:
    """What a request's view needs from its ASGI call: the run scopes it started (cancelled when the call
    ends, see _EndRunsWithRequest) and the connection's ``send``, which a streaming run writes its frames to."""

    runs: list[trio.CancelScope]
    send: Any

    @functools.cached_property
    def direct(self) -> DirectWriter | None:
        """The connection's direct writer (flow.serve.hypercorn_fixes), looked up at the first piece."""
        return direct_writer(self.send)

    async def write(self, data: bytes) -> None:
        """One piece of a streaming response's body, straight to the connection (flow.serve.exit)."""
        await self.send({"type": "http.response.body", "body": data, "more_body": True})

    @property
    def write_now(self) -> Callable[[bytes], bytes | None]:
        """Writes a piece without awaiting, where hypercorn's connection allows it (flow.serve.hypercorn_fixes):
        the direct writer's own method, which the exit binds once per response (no layer per token)."""
        direct = self.direct
        return _no_direct_write if direct is None else direct.write_now

    async def write_raw(self, data: bytes) -> None:
        assert self.direct is not None  # only what write_now began comes here
        await self.direct.write_raw(data)


_request_io: contextvars.ContextVar[_RequestIO | None] = contextvars.ContextVar("flow_request_io", default=None)


class _EndRunsWithRequest:
    """ASGI middleware: the runs a request started are cancelled when its ASGI call ends, however it ends.

    A streaming response's run is normally cancelled by its body iterator's ``finally``. But a client that
    leaves after the view has returned and before Quart has begun the body (the disconnect cancels Quart's
    send of the response head) leaves that iterator never started, hence never closed: without this, the
    run, its engine sequence (prefill, then up to ``max_tokens``) and its task would go on, nobody reading.
    It also hands the view the call's ``send``, for the run to write a stream's body with.
    """

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        io = _RequestIO([], send)
        token = _request_io.set(io)
        try:
            await self.app(scope, receive, send)
        finally:
            _request_io.reset(token)
            for run in io.runs:
                run.cancel()


def _json(obj: Any, status: int = 200) -> Response:
    return Response(dumps(obj), status=status, content_type="application/json")


def _frame_response(frame: WireFrame) -> Response:
    return Response(frame.data, status=frame.status, headers=Headers(list(frame.headers)))


def _answer_response(answer: Answer) -> Response:
    """The response to a graph route: its first frame, and for a stream the rest of the body."""
    if answer.body is None:
        return _frame_response(answer.first)
    response = Response(answer.body, status=answer.first.status, headers=Headers(list(answer.first.headers)))
    response.timeout = None
    return response


def create_app(server: FlowServer) -> QuartTrio:
    app = QuartTrio("flow")

    def shell_error(path: str, error: ApiError, *, close: bool = False) -> Response:
        """An error the shell answers itself, in the protocol of ``path``."""
        return _frame_response(server.error_response(path, error, close=close))

    app.asgi_app = _EndRunsWithRequest(app.asgi_app)  # type: ignore[method-assign]
    app.config.update(RESPONSE_TIMEOUT=None)

    def refresh_limits() -> None:
        """The graph's body limit and timeout; again after each reload (later requests read the app's config)."""
        app.config.update(BODY_TIMEOUT=server.graph.spec.server.body_timeout_seconds,
                          MAX_CONTENT_LENGTH=server.body_limit())

    refresh_limits()

    @app.before_request
    async def _guard() -> Response | None:
        """Host, origin, key and content type: checked before routing, so an unknown route or method tells
        an unauthenticated client nothing, and before the body is read (the connection is then closed)."""
        headers = {name.lower(): value for name, value in request.headers.items()}
        if "transfer-encoding" in headers and "content-length" in headers:
            # RFC 9112 §6.1: a request with both may be smuggling one inside the other; never reuse it.
            return shell_error(request.path, ApiError(
                "invalid_request", "The request has both Content-Length and Transfer-Encoding."), close=True)
        public = request.method in ("GET", "HEAD") and server.live.gen.is_public(request.method, request.path)
        try:
            server.guard.check(request.method, request.path, headers, public=public,
                               body_types=server.live.gen.body_types(request.method, request.path))
        except ApiError as error:
            return shell_error(request.path, error, close=True)
        return None

    def about() -> dict[str, Any]:
        return {"name": "flow", "graph": server.live.gen.info(), "status": "ok"}

    async def dispatch(path: str = "") -> Response:
        """Every graph route: matched against the generation serving new requests now."""
        gen = server.live.gen
        try:
            match = gen.match(request.method, request.path)
        except NoRoute as missing:
            if request.path == "/" and request.method in ("GET", "HEAD"):
                return _json(about())  # a graph without a console page: connectivity checks still get an answer
            if not missing.allowed:
                return shell_error(request.path, ApiError(
                    "not_found", f"No route {request.method} {request.path}. Routes: {gen.routes_text()}, "
                    "GET /health."), close=True)
            if request.method == "OPTIONS":
                return Response(b"", status=200, headers={"allow": ", ".join([*missing.allowed, "OPTIONS"])})
            error = ApiError("method_not_allowed", f"{request.method} is not allowed on {request.path}; "
                             f"allowed: {', '.join(missing.allowed)}.")
            response = shell_error(request.path, error, close=True)
            response.headers["allow"] = ", ".join(missing.allowed)
            return response
        await server.pacer.turn()  # a wave of requests is read and started a few per turn (flow.serve.pacing)
        body = await request.get_data(cache=False, as_text=False)
        assert isinstance(body, bytes)
        http = HttpRequest(
            method=request.method, path=request.path, query=request.query_string.decode("latin-1"),
            headers=tuple(request.headers.items()), body=body,
            request_id=uuid.uuid4().hex[:24], params=tuple(match.params.items()),
        )
        io = _request_io.get()
        if io is None:
            raise RuntimeError("a graph route's request outside the app's ASGI middleware")
        return _answer_response(await server.respond(gen, match.runner, http, app.nursery, io.runs, io))

    app.add_url_rule("/", endpoint="graph_root", view_func=dispatch, methods=METHODS,
                     provide_automatic_options=False)  # "/" is a graph route too: the console page
    app.add_url_rule("/<path:path>", endpoint="graph", view_func=dispatch, methods=METHODS,
                     provide_automatic_options=False)

    @app.websocket("/<path:path>")
    async def socket(path: str = "") -> Response | None:
        """A graph route ``WEBSOCKET /path`` (the Responses API's WebSocket mode). Anything else is refused
        before the upgrade, in the path's protocol shape: clients fall back to HTTP at once."""
        headers = {name.lower(): value for name, value in websocket.headers.items()}
        try:
            server.guard.check("GET", websocket.path, headers)
            server.live.gen.match(WS_METHOD, websocket.path)
        except ApiError as error:
            return shell_error(websocket.path, error)
        except NoRoute:
            paths = sorted(r.path for r in server.live.gen.graph.routes if r.method == WS_METHOD)
            return shell_error(websocket.path, ApiError(
                "not_found", f"No WebSocket route at {websocket.path}; use HTTP there. WebSocket routes: "
                f"{', '.join(paths) or '(none)'}."))
        await websocket.accept()
        session = ResponsesSocket(server, websocket.path, websocket.query_string.decode("latin-1"),
                                  list(websocket.headers.items()), websocket.send)
        await session.serve(websocket.receive)
        return None

    @app.route("/health", methods=["GET", "HEAD"])
    async def health() -> Response:
        body = server.observer.health_json()
        return _json(body, 200 if body["status"] == "ok" else 503)

    @app.route("/metrics", methods=["GET"])
    async def metrics() -> Response:
        return Response(server.metrics.render(), content_type="text/plain; version=0.0.4; charset=utf-8")

    @app.route("/stats", methods=["GET"])
    async def stats() -> Response:
        return _json(server.observer.stats_json())

    feeds = FeedLimit()

    @app.route("/stats/events", methods=["GET"])
    async def stats_events() -> Response:
        """The /stats figures as server-sent events: a whole reading, then what changed (flow.serve.stats_feed)."""
        try:
            interval = parse_interval(request.args.to_dict())
            feeds.check()
        except ApiError as error:
            return shell_error(request.path, error)
        feed = stats_feed(server.observer.stats_json, interval, server.draining, feeds)
        response = Response(feed, content_type="text/event-stream",
                            headers={"cache-control": "no-store", "x-accel-buffering": "no"})
        response.timeout = None
        return response

    @app.route("/admin/reload", methods=["POST"])
    async def reload() -> Response:
        """Compile the graph file again and switch to it (the API key guards it like every route)."""
        outcome = await server.reload()
        return _json(outcome.json(), 200 if outcome.report is not None else 422)

    @app.errorhandler(HTTPException)
    async def http_error(exc: HTTPException) -> Response:
        code = exc.code or 500
        if not has_request_context():  # a WebSocket: it has no HTTP request to answer
            return Response(b"", status=code)
        kinds = {404: "not_found", 405: "method_not_allowed", 413: "request_too_large", 408: "invalid_request"}
        kind = kinds.get(code, "invalid_request" if code < 500 else "internal")
        message = {
            404: f"No route {request.method} {request.path}. Routes: {server.live.gen.routes_text()}, GET /health.",
            405: f"{request.method} is not allowed on {request.path}.",
            413: f"The request body is larger than {server.body_limit()} bytes, "
                 + ("the server's max_body_bytes." if server.graph.spec.server.max_body_bytes is not None else
                    "the most its models take (a text model's context as text, an audio file up to 25 MB, an "
                    "embedding request's inputs)."),
            408: f"The request body did not arrive within {server.graph.spec.server.body_timeout_seconds:g} "
                 "seconds.",
        }.get(code, exc.description or "error")
        # Routing and size errors come before the body is read: the connection cannot carry another request.
        return shell_error(request.path, ApiError(kind, message), close=True)  # type: ignore[arg-type]

    @app.errorhandler(Exception)
    async def unexpected(exc: Exception) -> Response:
        request_id = uuid.uuid4().hex[:24]
        log.error("unexpected error %s", request_id, exc_info=exc)
        error = ApiError("internal", f"Internal server error (request id {request_id}); the server log has "
                         "the details.")
        if not has_request_context():
            return Response(b"", status=500)
        return shell_error(request.path, error, close=True)

    server.on_reload = refresh_limits
    return app
