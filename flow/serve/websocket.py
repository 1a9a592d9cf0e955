"""WebSocket transport: a graph route ``WEBSOCKET /path`` serves a persistent connection on the route's stages.

OpenAI's Responses API has a WebSocket mode (``client.responses.connect()`` in the SDKs; Codex uses it when a
provider offers it): the client sends ``{"type": "response.create", ...}`` events with the fields of a
``POST /v1/responses`` body, and receives each response's stream events as JSON messages — the same events the
SSE stream carries. Each ``response.create`` here becomes one request on the route, exactly as if it had been
POSTed with ``stream: true``; its SSE frames are unwrapped into messages. An optional ``stream_id`` names a lane:
responses on one lane run in order, lanes run side by side, and a response's events echo its ``stream_id``.
An error before a response starts is an ``error`` event (``{"type": "error", "status", "error": {…}}``); the
connection stays open. A WebSocket to a path without a ``WEBSOCKET`` route is refused before the upgrade with a
4xx in the path's protocol shape, so clients fall back to HTTP at once.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

import trio

from flow.serve.exit import ChannelExit
from flow.serve.live import NoRoute
from protocols.ir import HttpRequest, WireFrame, new_request_id
from protocols.sse import dumps

if TYPE_CHECKING:
    from flow.serve.server import FlowServer

log = logging.getLogger("flow.serve.websocket")

WS_METHOD = "WEBSOCKET"
CLIENT_EVENTS = ("response.create",)
MAX_LANES = 16


def sse_payloads(data: bytes) -> list[dict[str, Any]]:
    """The JSON objects of the ``data:`` lines in SSE bytes (comments, ``[DONE]`` and event names dropped)."""
    out = []
    for block in data.split(b"\n\n"):
        for line in block.split(b"\n"):
            if line.startswith(b"data: ") and line[6:].strip() != b"[DONE]":
                payload = json.loads(line[6:])
                if isinstance(payload, dict):
                    out.append(payload)
    return out


def error_event(error: dict[str, Any], status: int, stream_id: str | None = None) -> dict[str, Any]:
    event: dict[str, Any] = {"type": "error", "status": status, "error": error}
    if stream_id is not None:
        event["stream_id"] = stream_id
    return event


class ResponsesSocket:
    """One WebSocket connection: client events in, each response's events out, lane by lane."""

    def __init__(self, server: FlowServer, path: str, query: str, headers: list[tuple[str, str]],
                 send_text: Callable[[str], Awaitable[None]]) -> None:
        self.server = server
        self.path = path
        self.query = query
        self.headers = [(k, v) for k, v in headers if k.lower() not in ("content-type", "content-length")]
        self.headers.append(("content-type", "application/json"))
        self._send_text = send_text
        self._sending = trio.Lock()
        self._lanes: dict[str | None, trio.MemorySendChannel[dict[str, Any]]] = {}

    async def send(self, event: dict[str, Any]) -> None:
        async with self._sending:  # one message at a time, whichever lane it comes from
            await self._send_text(dumps(event).decode())

    async def serve(self, receive: Callable[[], Awaitable[str | bytes]]) -> None:
        """Read client events until the client closes; every response still running is cancelled then."""
        async with trio.open_nursery() as nursery:
            try:
                while True:
                    await self._handle(await receive(), nursery)
            finally:
                for lane in self._lanes.values():
                    lane.close()
                nursery.cancel_scope.cancel()

    async def _handle(self, message: str | bytes, nursery: trio.Nursery) -> None:
        try:
            event = json.loads(message)
        except ValueError:
            await self.send(error_event(_invalid("A client event must be a JSON object."), 400))
            return
        if not isinstance(event, dict) or event.get("type") not in CLIENT_EVENTS:
            kind = event.get("type") if isinstance(event, dict) else None
            await self.send(error_event(_invalid(f"Unsupported client event type {kind!r}; this server accepts "
                                                 f"{', '.join(CLIENT_EVENTS)}.", "type"), 400))
            return
        stream_id = event.get("stream_id")
        if stream_id is not None and not isinstance(stream_id, str):
            await self.send(error_event(_invalid("'stream_id' must be a string.", "stream_id"), 400))
            return
        lane = self._lanes.get(stream_id)
        if lane is None:
            if len(self._lanes) >= MAX_LANES:
                await self.send(error_event(_invalid(f"At most {MAX_LANES} stream_id lanes per connection.",
                                                     "stream_id"), 400, stream_id))
                return
            lane, queue = trio.open_memory_channel[dict[str, Any]](64)
            self._lanes[stream_id] = lane
            nursery.start_soon(self._run_lane, stream_id, queue)
        body = {k: v for k, v in event.items() if k not in ("type", "stream_id")}
        await lane.send({**body, "stream": True})

    async def _run_lane(self, stream_id: str | None, queue: trio.MemoryReceiveChannel[dict[str, Any]]) -> None:
        async for body in queue:
            await self._respond(body, stream_id)

    async def _respond(self, body: dict[str, Any], stream_id: str | None) -> None:
        server = self.server
        gen = server.live.gen  # each response on the generation current when it is asked for
        try:
            match = gen.match(WS_METHOD, self.path)
        except NoRoute:
            await self.send(error_event(_invalid(f"{self.path} no longer takes WebSocket requests.", None), 404,
                                        stream_id))
            return
        if server.draining.is_set():
            await self.send(error_event({"type": "server_error", "message": "The server is shutting down."}, 503,
                                        stream_id))
            return
        http = HttpRequest(method="POST", path=self.path, query=self.query, headers=tuple(self.headers),
                           body=json.dumps(body).encode(), request_id=new_request_id(),
                           params=tuple(match.params.items()))
        send, receive = trio.open_memory_channel[WireFrame](64)
        scope = trio.CancelScope()
        async with trio.open_nursery() as nursery:
            nursery.start_soon(server.run_request, gen, match.runner, http, ChannelExit(send), scope)
            try:
                async with receive:
                    first = await receive.receive()
                    server.observer.requests.inc(route=f"{WS_METHOD} {match.runner.route.path}",
                                                 status=str(first.status))
                    if not first.streaming:
                        error = json.loads(first.data).get("error") or {"message": first.data.decode(errors="replace")}
                        await self.send(error_event(error, first.status, stream_id))
                        return
                    await self._forward(first, stream_id)
                    async for frame in receive:
                        await self._forward(frame, stream_id)
            except trio.EndOfChannel:
                pass
            finally:
                scope.cancel()

    async def _forward(self, frame: WireFrame, stream_id: str | None) -> None:
        for payload in sse_payloads(frame.data):
            if stream_id is not None:
                payload["stream_id"] = stream_id
            await self.send(payload)


def _invalid(message: str, param: str | None = None) -> dict[str, Any]:
    return {"type": "invalid_request_error", "message": message, "param": param, "code": None}
