"""The HTTP app: the graph's routes served straight from ASGI, the shell's own on quart-trio, on hypercorn.

The graph's routes are not Quart rules: they change with a reload, and they are the hot path. The ASGI app
in front (``flow.serve.graph_routes``) matches each request against the current generation's routing table
and hands it to :meth:`FlowServer.respond`. The shell owns only ``/health``, ``/stats`` (and its feed
``/stats/events``), ``/metrics``, ``POST /admin/reload`` and the WebSocket routes: those are Quart's (and
``GET /`` is answered with a short JSON when the graph has no console page there). Every error the shell
writes itself (unknown route, wrong method, body too large or too slow, refused host or key) takes the
protocol shape of the path's route, or the graph's ``server.default_exit``.

Checks before routing (host, origin, API key, content type) run for every HTTP path the same way, in the
ASGI app in front, before the body is read.
"""

from __future__ import annotations

import logging
from typing import Any

from quart import Response, has_request_context, request, websocket
from quart_trio import QuartTrio
from werkzeug.datastructures import Headers
from werkzeug.exceptions import HTTPException

from flow.serve.graph_routes import GraphRoutes, http_refusal
from flow.serve.live import NoRoute
from flow.serve.server import FlowServer
from flow.serve.stats_feed import FeedLimit, parse_interval
from flow.serve.stats_feed import stats_events as stats_feed
from flow.serve.websocket import WS_METHOD, ResponsesSocket
from protocols.errors import ApiError
from protocols.ir import WireFrame, new_request_id
from protocols.sse import dumps

log = logging.getLogger("flow.serve.http")

def _json(obj: Any, status: int = 200) -> Response:
    return Response(dumps(obj), status=status, content_type="application/json")


def _frame_response(frame: WireFrame) -> Response:
    return Response(frame.data, status=frame.status, headers=Headers(list(frame.headers)))


def create_app(server: FlowServer) -> QuartTrio:
    app = QuartTrio("flow")

    def shell_error(path: str, error: ApiError, *, close: bool = False) -> Response:
        """An error the shell answers itself, in the protocol of ``path``."""
        return _frame_response(server.error_response(path, error, close=close))

    app.asgi_app = GraphRoutes(server, app.asgi_app, lambda: app.nursery)  # type: ignore[method-assign]
    app.config.update(RESPONSE_TIMEOUT=None)

    def refresh_limits() -> None:
        """The graph's body limit and timeout; again after each reload (later requests read the app's config)."""
        app.config.update(BODY_TIMEOUT=server.graph.spec.server.body_timeout_seconds,
                          MAX_CONTENT_LENGTH=server.body_limit())

    refresh_limits()

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
        return _frame_response(http_refusal(server, code, request.method, request.path,
                                            exc.description or "error"))

    @app.errorhandler(Exception)
    async def unexpected(exc: Exception) -> Response:
        request_id = new_request_id()
        log.error("unexpected error %s", request_id, exc_info=exc)
        error = ApiError("internal", f"Internal server error (request id {request_id}); the server log has "
                         "the details.")
        if not has_request_context():
            return Response(b"", status=500)
        return shell_error(request.path, error, close=True)

    server.on_reload = refresh_limits
    return app
