"""Two changes to hypercorn's trio TCP server, applied when flow serves: one fix, one shortcut.

**What the protocol asks must be done.** hypercorn's HTTP/1.1 protocol tells its
TCP server what to do next — close the connection (``Connection: close``, an
error before the request's body was read), or start the keep-alive idle timer
once a response is done — from inside the ASGI app's own task, and quart-trio
cancels that task's nursery as soon as the response is sent. The cancellation
lands on the first checkpoint of that work:

* a close stops at ``send_eof``, before ``aclose``: the socket stays open, h11
  refuses what the client sends next, and the client waits for an answer that
  never comes (a wedged connection);
* the idle timer is never started: a kept-alive connection after its first
  request never times out (a slowloris holds it forever) and holds up a
  graceful stop until its deadline.

So those events are handled under a shield — as hypercorn already shields the
close of an idle connection and the sending of data.

**Data is written at once when the socket takes it.** hypercorn sends each
piece of a response (``RawData``: for a stream, one per frame) under its send
lock and a shield, through ``SocketStream.send_all``: taking the lock and the
send each give the event loop a turn, two trips through trio's scheduler per
frame, the largest part of what writing a streamed token cost. When no other
send holds the lock, the bytes go to the socket now, in one non-blocking
``send``; whatever it does not take (a full socket buffer, a client reading
slowly) goes on through ``send_all``, still under the lock, so pieces never
interleave. An error leaves the piece to hypercorn's own path, which handles a
broken connection as it always has. TLS streams always take hypercorn's path.
"""

from __future__ import annotations

import os
from typing import Any

import trio
from hypercorn.events import Closed, Event, RawData
from hypercorn.trio.tcp_server import TCPServer

_original_protocol_send = TCPServer.protocol_send


async def _protocol_send(self: Any, event: Event) -> None:
    if not isinstance(event, RawData):
        with trio.CancelScope(shield=True):
            await _original_protocol_send(self, event)
        return
    stream, lock = self.stream, self.send_lock
    if not isinstance(stream, trio.SocketStream) or lock.locked():
        await _original_protocol_send(self, event)  # TLS, or another piece on its way: hypercorn's path
        return
    data = event.data
    lock.acquire_nowait()
    try:
        try:
            sent = os.write(stream.socket.fileno(), data)
        except OSError:  # EAGAIN, or a broken or closed connection: hypercorn's path finds out which
            sent = 0
        if sent == len(data):
            return
        try:
            with trio.CancelScope(shield=True):  # as hypercorn's own send: never half a piece
                await stream.send_all(memoryview(data)[sent:])
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            await self.protocol.handle(Closed())
    finally:
        lock.release()


def apply() -> None:
    """Idempotent."""
    TCPServer.protocol_send = _protocol_send  # type: ignore[method-assign]
