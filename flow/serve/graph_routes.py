"""The graph's HTTP routes, served straight from the ASGI call: no web framework between a connection and a run.

Every HTTP request is guarded here; one whose path is not one of the shell's own (:data:`SHELL_PATHS`, which
the Quart app in ``flow.serve.http`` serves, with every WebSocket and the lifespan) is then handled here, in the
task hypercorn started for it:

1. the guard (host, origin, API key, content type: ``flow.serve.guard``) before routing and before the body
   is read, so an unknown route or method tells an unauthenticated client nothing;
2. the route matched against the generation serving new requests now (``{param}`` segments): 404, 405 with
   the methods the path has, ``OPTIONS``, and ``GET /`` where the graph has no page there;
3. admission pacing (``flow.serve.pacing``), then the body, within the server's limit (413, refused from its
   declared length before a byte is read) and deadline (408);
4. :meth:`FlowServer.respond` starts the run; its first frame is sent (a whole body, or a stream's head
   and first bytes), and a stream's run writes the rest of the body itself (``flow.serve.exit``);
5. while the answer is under way one watcher waits on the connection: a client that leaves cancels the
   request, and with it its run.

Every run a request started is cancelled when its ASGI call ends, however it ends (a client that leaves
between the head and the body included). Every error written here takes the protocol shape of the path's
route (``FlowServer.error_response``); one before the body is read closes the connection, whose next bytes
would be that body.

Why not a Quart view: per request Quart builds a request and a response object, a request context and two
tasks; here a request costs its one task, one watcher, and what flow itself does.
"""

from __future__ import annotations

import functools
import logging
import math
from collections.abc import Callable, Sequence
from contextlib import aclosing
from dataclasses import replace
from typing import Any

import trio

from flow.serve.hypercorn_fixes import DirectWriter, direct_writer
from flow.serve.live import NoRoute
from flow.serve.server import Answer, FlowServer
from protocols.errors import ApiError
from protocols.ir import HttpRequest, WireFrame, new_request_id
from protocols.sse import dumps

log = logging.getLogger("flow.serve.graph_routes")

# The shell's own paths (flow.serve.http): served by its Quart app, never by a graph route.
SHELL_PATHS = frozenset({"/health", "/metrics", "/stats", "/stats/events", "/admin/reload"})


def guard_refusal(server: FlowServer, method: str, path: str, headers: dict[str, str]) -> WireFrame | None:
    """The answer a request gets before routing and before its body is read, or ``None`` when it may go on.
    ``headers``: lower-case names."""
    if "transfer-encoding" in headers and "content-length" in headers:
        # RFC 9112 §6.1: a request with both may be smuggling one inside the other; never reuse it.
        return server.error_response(path, ApiError(
            "invalid_request", "The request has both Content-Length and Transfer-Encoding."), close=True)
    gen = server.live.gen
    public = method in ("GET", "HEAD") and gen.is_public(method, path)
    try:
        server.guard.check(method, path, headers, public=public, body_types=gen.body_types(method, path))
    except ApiError as error:
        return server.error_response(path, error, close=True)
    return None


def http_refusal(server: FlowServer, code: int, method: str, path: str, default: str = "error",
                 allowed: Sequence[str] = ()) -> WireFrame:
    """The answer to an HTTP-level refusal (``code``: 404, 405, 408, 413, ...), in the protocol of ``path``;
    ``allowed``: a 405's methods, named in its message and its ``allow`` header. Routing and size refusals come
    before the body is read: the connection closes."""
    kinds = {404: "not_found", 405: "method_not_allowed", 413: "request_too_large", 408: "invalid_request"}
    kind = kinds.get(code, "invalid_request" if code < 500 else "internal")
    message = {
        404: f"No route {method} {path}. Routes: {server.live.gen.routes_text()}, GET /health.",
        405: f"{method} is not allowed on {path}" + (f"; allowed: {', '.join(allowed)}." if allowed else "."),
        413: f"The request body is larger than {server.body_limit()} bytes, "
             + ("the server's max_body_bytes." if server.graph.spec.server.max_body_bytes is not None else
                "the most its models take (a text model's context as text, an audio file up to 25 MB, an "
                "embedding request's inputs)."),
        408: f"The request body did not arrive within {server.graph.spec.server.body_timeout_seconds:g} seconds.",
    }.get(code, default)
    frame = server.error_response(path, ApiError(kind, message), close=True)  # type: ignore[arg-type]
    if code == 405 and allowed:
        return replace(frame, headers=(*frame.headers, ("allow", ", ".join(allowed))))
    return frame


class ConnectionWriter:
    """A streamed response's body, written by its run (``flow.serve.exit.BodyWriter``): through the ASGI
    ``send``, or without awaiting through hypercorn's connection where it allows (flow.serve.hypercorn_fixes)."""

    def __init__(self, send: Any) -> None:
        self.send = send

    @functools.cached_property
    def direct(self) -> DirectWriter | None:
        """The connection's direct writer, looked up at the first piece."""
        return direct_writer(self.send)

    async def write(self, data: bytes) -> None:
        await self.send({"type": "http.response.body", "body": data, "more_body": True})

    @property
    def write_now(self) -> Callable[[bytes], bytes | None]:
        """The direct writer's own method, which the exit binds once per response (no layer per token)."""
        direct = self.direct
        return _no_direct_write if direct is None else direct.write_now

    async def write_raw(self, data: bytes) -> None:
        assert self.direct is not None  # only what write_now began comes here
        await self.direct.write_raw(data)


def _no_direct_write(data: bytes) -> None:
    """Where the connection has no direct writer: a piece always takes the awaited path."""


class _ClientGone(Exception):
    """The client closed the connection before its request's body was read."""


class _Refused(Exception):
    def __init__(self, code: int) -> None:
        self.code = code


class GraphRoutes:
    """The ASGI app in front of the shell's: graph routes here, the rest to ``shell`` (see the module's text).
    ``nursery``: where runs are started (the app's, open for the server's life)."""

    def __init__(self, server: FlowServer, shell: Any, nursery: Callable[[], trio.Nursery]) -> None:
        self.server = server
        self.shell = shell
        self.nursery = nursery

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":  # a WebSocket (its view guards it) or the lifespan
            await self.shell(scope, receive, send)
            return
        reply = _Reply(send)
        runs: list[trio.CancelScope] = []
        try:
            await self._serve(scope, receive, reply, runs)
        except _ClientGone:
            pass
        except Exception as exc:
            request_id = new_request_id()
            log.error("request %s (%s %s) failed", request_id, scope["method"], scope["path"], exc_info=exc)
            if not reply.started:
                await reply.frame(self.server.error_response(scope["path"], ApiError(
                    "internal", f"Internal server error (request id {request_id}); the server log has the "
                    "details."), close=True))
        finally:
            for run in runs:
                run.cancel()

    async def _serve(self, scope: Any, receive: Any, reply: _Reply, runs: list[trio.CancelScope]) -> None:
        server = self.server
        method, path = scope["method"], scope["path"]
        raw_headers = [(name.decode("latin-1"), value.decode("latin-1")) for name, value in scope["headers"]]
        headers = dict(raw_headers)  # h11 and h2 give header names in lower case
        refusal = guard_refusal(server, method, path, headers)
        if refusal is not None:
            await reply.frame(refusal)
            return
        if path in SHELL_PATHS:  # guarded as every path is, before its method is even looked at
            await self.shell(scope, receive, reply.send)
            return
        gen = server.live.gen
        try:
            match = gen.match(method, path)
        except NoRoute as missing:
            await reply.frame(self._unrouted(method, path, missing.allowed))
            return
        await server.pacer.turn()  # a wave of requests is read and started a few per turn (flow.serve.pacing)
        try:
            body = await _read_body(receive, headers.get("content-length"), server.body_limit(),
                                    server.graph.spec.server.body_timeout_seconds)
        except _Refused as refused:
            await reply.frame(http_refusal(server, refused.code, method, path))
            return
        http = HttpRequest(method=method, path=path, query=scope["query_string"].decode("latin-1"),
                           headers=tuple(raw_headers), body=body, request_id=new_request_id(),
                           params=tuple(match.params.items()))
        async with trio.open_nursery() as watching:
            watching.start_soon(_cancel_when_gone, receive, watching.cancel_scope)
            answer = await server.respond(gen, match.runner, http, self.nursery(), runs, ConnectionWriter(reply.send))
            await reply.answer(answer)
            watching.cancel_scope.cancel()

    def _unrouted(self, method: str, path: str, allowed: list[str]) -> WireFrame:
        """The answer to a request no route of the graph takes."""
        server = self.server
        if path == "/" and method in ("GET", "HEAD"):  # a graph without a console page: connectivity checks
            return WireFrame(dumps({"name": "flow", "graph": server.live.gen.info(), "status": "ok"}),
                             headers=(("content-type", "application/json"),))
        if not allowed:
            return http_refusal(server, 404, method, path)
        if method == "OPTIONS":
            return WireFrame(b"", headers=(("allow", ", ".join([*allowed, "OPTIONS"])),))
        return http_refusal(server, 405, method, path, allowed=allowed)


class _Reply:
    """A request's response through its ASGI ``send``: whether the head went out."""

    def __init__(self, send: Any) -> None:
        self.send = send
        self.started = False

    async def _head(self, frame: WireFrame, length: int | None) -> None:
        headers = [(name.encode("latin-1"), value.encode("latin-1")) for name, value in frame.headers]
        if length is not None:
            headers.append((b"content-length", b"%d" % length))
        self.started = True
        await self.send({"type": "http.response.start", "status": frame.status, "headers": headers})

    async def frame(self, frame: WireFrame) -> None:
        """A whole response."""
        await self._head(frame, len(frame.data))
        await self.send({"type": "http.response.body", "body": frame.data, "more_body": False})

    async def answer(self, answer: Answer) -> None:
        """A graph route's answer: whole, or a stream whose run writes its body once the head is out."""
        if answer.body is None:
            await self.frame(answer.first)
            return
        await self._head(answer.first, None)
        async with aclosing(answer.body) as pieces:
            async for piece in pieces:
                await self.send({"type": "http.response.body", "body": piece, "more_body": True})
        await self.send({"type": "http.response.body", "body": b"", "more_body": False})


async def _read_body(receive: Any, declared: str | None, limit: int, timeout: float | None) -> bytes:
    """The request's body: 413 when it is (or says it will be) larger than ``limit``, 408 when it has not all
    come within ``timeout`` seconds."""
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise _Refused(413)
    pieces: list[bytes] = []
    size = 0
    with trio.move_on_after(math.inf if timeout is None else timeout) as deadline:
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                raise _ClientGone
            piece = message.get("body", b"")
            size += len(piece)
            if size > limit:
                raise _Refused(413)
            pieces.append(piece)
            if not message.get("more_body", False):
                break
    if deadline.cancelled_caught:
        raise _Refused(408)
    return pieces[0] if len(pieces) == 1 else b"".join(pieces)


async def _cancel_when_gone(receive: Any, scope: trio.CancelScope) -> None:
    """Cancel ``scope`` when the client closes the connection."""
    while (await receive())["type"] != "http.disconnect":
        pass
    scope.cancel()
