"""Changes to hypercorn's HTTP/1.1 server, applied when flow serves: two fixes, two shortcuts for streams, two
for every request.

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

**A connection the client closed is closed now.** When the read loop sees the
client's end of file, hypercorn's trio server still waits for the keep-alive
idle timer before it closes its end: every client that closes its connection
after an answer (most SDKs' one-off requests, a connection that never sent a
byte) leaves a descriptor in CLOSE_WAIT for ``idle_timeout_seconds``. A burst
of a few thousand such clients runs the process out of descriptors. The timer
is stopped when the read loop ends, so the connection's tasks end with the
client's.

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

**A streamed body's pieces are framed without h11's state machine.** Each
piece of a response body goes through h11's ``Connection.send`` to be framed;
for a chunked body that is a few bytes around the data, yet the event's trip
through h11 cost more than everything else per frame. A data event does not
change h11's state, and a chunk's framing is fixed, so when h11 frames this
response as chunked — the peer speaks HTTP/1.1 and the response head has no
Content-Length, exactly h11's own rule — a body piece is framed here, as h11's
``ChunkedWriter`` would, and sent as raw data. Everything else (the head, the
end of the body, a fixed-length or close-delimited body, HTTP/1.0) still goes
through h11.

**A streamed body's piece can be written with no await at all.** An engine step
hands every row its token in one synchronous pass, and each row's stages run
in it (flow.serve.exit): :func:`direct_writer` gives such a pass the response's
socket, reached through hypercorn's objects from the ASGI ``send``. It writes
a piece framed as above, in one non-blocking ``send``, exactly when the
shortcut above would (plain TCP, a chunked HTTP/1.1 body under way, no other
piece on its way); otherwise it writes nothing and the piece takes the
ordinary path. What the socket does not take is written by the request's task
through the send lock (``write_raw``), before any later piece.

**A response's head goes out with its first body piece.** hypercorn sends a
response's head (``http.response.start``, held until the first body piece) and
that piece as two writes, one right after the other, and a fixed-length body's
end as a write of no bytes. Each write is a system call, and on a busy server
each gives the interpreter lock to the device thread and waits to take it
back: the head is held and written with the piece after it, and an empty piece
is not written. (A connection that closes in between had sent nothing of its
response either way.)

**A connection's idle timer is one task whose deadline moves.** hypercorn stops
its keep-alive timer when a request begins and starts it again, as a new task
(a nursery's ``start``, under a lock), when the response is done: per request
a task and half a dozen cancel scopes. :class:`IdleDeadline` keeps one task for
the connection's life and moves its deadline (to infinity while a request is
under way): the same timeouts — an idle or half-sent-headers connection is
closed after ``keep_alive_timeout``, a closing server closes it at once — and
no task, lock or shield per request.

**No read timeout, no timeout scope per read.** hypercorn wraps every read of a
connection in ``fail_after(read_timeout)``, a cancel scope per read, also when
there is no read timeout (flow sets none: the idle timer and the body deadline
bound a client). Then the reads go without it.
"""

from __future__ import annotations

import math
import os
from typing import Any

import h11
import trio
from hypercorn.events import Closed, Event, RawData, Updated
from hypercorn.protocol.events import Body, Response
from hypercorn.protocol.events import Event as StreamEvent
from hypercorn.protocol.h11 import H11Protocol
from hypercorn.protocol.http_stream import HTTPStream
from hypercorn.trio.tcp_server import MAX_RECV, TCPServer

_original_protocol_send = TCPServer.protocol_send
_original_stream_send = H11Protocol.stream_send
_original_read_data = TCPServer._read_data
_original_init = TCPServer.__init__


def _send_now(server: Any, data: bytes) -> int | None:
    """Send ``data`` to the connection of hypercorn's ``server`` in one non-blocking ``send``: how many bytes it
    took (0 on EAGAIN, or a broken or closed connection: hypercorn's path finds out which), or ``None`` when
    the piece must take hypercorn's path (TLS, or another piece on its way under the send lock)."""
    stream = server.stream
    if not isinstance(stream, trio.SocketStream) or server.send_lock.locked():
        return None
    try:
        return os.write(stream.socket.fileno(), data)
    except OSError:
        return 0


def _chunk(data: bytes) -> bytes:
    """``data`` framed as one chunk of a chunked body, as h11's ``ChunkedWriter`` frames it."""
    return b"%x\r\n%b\r\n" % (len(data), data)


async def _protocol_send(self: Any, event: Event) -> None:
    if isinstance(event, Updated):
        self.idle_task.move(idle=event.idle)  # synchronous: nothing to shield
        return
    if not isinstance(event, RawData):
        with trio.CancelScope(shield=True):
            await _original_protocol_send(self, event)
        return
    data = event.data
    held = self.__dict__.pop("_flow_head", None)
    if held is not None:
        data = held + data  # the response's head, with the piece after it
    elif self.__dict__.get("_flow_hold_head"):
        self._flow_hold_head = False
        self._flow_head = data  # a response's head: sent with the next piece (its body follows at once)
        return
    if not data:
        return  # a fixed-length body's end: nothing to write
    sent = _send_now(self, data)
    if sent is None:
        await _original_protocol_send(self, event if held is None else RawData(data=data))
        return
    if sent == len(data):
        return
    # The rest under the lock, taken now (free: nothing was awaited since _send_now found it so), so no other
    # piece goes between this one's parts.
    self.send_lock.acquire_nowait()
    try:
        with trio.CancelScope(shield=True):  # as hypercorn's own send: never half a piece
            await self.stream.send_all(memoryview(data)[sent:])
    except (trio.BrokenResourceError, trio.ClosedResourceError):
        await self.protocol.handle(Closed())
    finally:
        self.send_lock.release()


async def _stream_send(self: Any, event: StreamEvent) -> None:
    if isinstance(event, Body) and self.__dict__.get("_flow_chunked") and self.connection.our_state is h11.SEND_BODY:
        data = event.data
        if data:  # an empty chunk would end the body: h11 sends nothing for it either
            await self.send(RawData(data=_chunk(data)))
        return
    if isinstance(event, Response):
        # h11's rule (Connection._clean_up_response_headers_for_sending): a body of unknown length is chunked
        # for an HTTP/1.1 peer. Only then are its pieces framed here.
        version = getattr(self.connection, "their_http_version", None)  # a WebSocket upgrade's has none
        self._flow_chunked = (event.status_code >= 200 and version is not None and version >= b"1.1"
                              and not any(name.lower() == b"content-length" for name, _ in event.headers))
        server = getattr(self.send, "__self__", None)
        if event.status_code >= 200 and isinstance(server, TCPServer):
            server.__dict__["_flow_hold_head"] = True  # its bytes are the next piece _protocol_send sees
    await _original_stream_send(self, event)


class DirectWriter:
    """One HTTP/1.1 response's body pieces, written to its socket without awaiting (see the module's text)."""

    def __init__(self, stream: Any, protocol: Any, server: Any) -> None:
        self._stream = stream  # hypercorn's HTTPStream: its ASGI state
        self._server = server  # TCPServer: the socket and its send lock
        self._lock = server.send_lock
        # The socket itself (plain TCP), or None (TLS: always hypercorn's path). Its descriptor is read per
        # piece: a closed socket's is -1 (the write fails), never a number another connection may reuse.
        self._socket = server.stream.socket if isinstance(server.stream, trio.SocketStream) else None
        # Made once the response's head is on the wire (the exit binds the writer then): whether its body is
        # chunked, as _stream_send decided, is known and stays so until the body ends, after the run's last piece.
        self._chunked = (self._socket is not None and bool(protocol.__dict__.get("_flow_chunked"))
                         and protocol.connection.our_state is h11.SEND_BODY)

    def write_now(self, data: bytes) -> bytes | None:
        """Frame ``data`` as a chunk and send what the socket takes now: the framed bytes it did not take, or
        ``None`` (nothing written) when this response cannot be written to directly now. (Per streamed token:
        :func:`_send_now`'s checks and write with the socket, its lock and the body's framing looked up once per
        response.)"""
        if not self._chunked or self._stream.closed or self._lock.locked() or "_flow_head" in self._server.__dict__:
            return None
        if not data:
            return b""
        framed = _chunk(data)
        try:
            sent = os.write(self._socket.fileno(), framed)  # type: ignore[union-attr]
        except OSError:
            sent = 0  # EAGAIN, or a broken or closed connection: hypercorn's path finds out which
        return framed[sent:]

    async def write_raw(self, data: bytes) -> None:
        await self._server.protocol_send(RawData(data=data))


def direct_writer(send: Any) -> DirectWriter | None:
    """The direct writer for the response whose ASGI ``send`` this is, or ``None`` where there is none (not
    hypercorn's HTTP/1.1 over trio: HTTP/2, a WebSocket, another server)."""
    stream = getattr(send, "__self__", None)
    stream_send = getattr(stream, "send", None)
    protocol = getattr(stream_send, "__self__", None)
    protocol_send = getattr(protocol, "send", None)
    server = getattr(protocol_send, "__self__", None)
    if not (isinstance(stream, HTTPStream) and isinstance(protocol, H11Protocol) and isinstance(server, TCPServer)):
        return None
    return DirectWriter(stream, protocol, server)


class IdleDeadline:
    """A connection's keep-alive idle timer: one task for the connection's life, its deadline moved (see the
    module's text). Stands in for hypercorn's ``TrioSingleTask`` as ``TCPServer.idle_task``."""

    def __init__(self, server: Any) -> None:
        self._server = server  # TCPServer
        self._deadline = math.inf
        self._scope: trio.CancelScope | None = None  # the waiting task's, once it runs
        self._started = False
        self._ended = False  # the connection is over: the task ends without closing anything
        self._closing = False  # the server is closing

    async def restart(self, task_group: Any, action: Any) -> None:
        """hypercorn's call when the connection starts: idle from now."""
        self.move(idle=True, task_group=task_group)

    async def stop(self) -> None:
        self.move(idle=False)

    def move(self, *, idle: bool, task_group: Any = None) -> None:
        """Idle from now (closed after ``keep_alive_timeout`` unless a request begins; at once when the server is
        closing), or a request under way."""
        if not idle:
            self._deadline = math.inf
        else:
            self._deadline = trio.current_time() + (0 if self._closing else self._server.config.keep_alive_timeout)
        if self._scope is not None:
            self._scope.deadline = self._deadline
        if idle and not self._started and not self._ended:
            self._started = True
            (task_group or self._server._task_group)._nursery.start_soon(self._wait)

    def end(self) -> None:
        self._ended = True
        if self._scope is not None:
            self._scope.cancel()

    async def _wait(self) -> None:
        if self._ended:  # the connection ended before this task began
            return
        with trio.CancelScope(deadline=self._deadline) as scope:
            self._scope = scope
            await self._server.context.terminated.wait()
            # The server is closing: an idle connection closes now, one with a request under way once it is done.
            self._closing = True
            if self._deadline == math.inf:
                await trio.sleep_forever()
        self._scope = None
        if not self._ended:
            with trio.CancelScope(shield=True):
                await self._server._initiate_server_close()


def _init(self: Any, *args: Any, **kwargs: Any) -> None:
    _original_init(self, *args, **kwargs)
    self.idle_task = IdleDeadline(self)


async def _read_data(self: Any) -> None:
    try:
        if self.config.read_timeout is None:
            await _read_untimed(self)
        else:
            await _original_read_data(self)
    finally:  # the client is gone: nothing is left for the idle timer to close
        self.idle_task.end()


async def _read_untimed(self: Any) -> None:
    """hypercorn's read loop (``TCPServer._read_data``) without a timeout scope around each read."""
    while True:
        try:
            data = await self.stream.receive_some(MAX_RECV)
        except (trio.ClosedResourceError, trio.BrokenResourceError):
            break
        await self.protocol.handle(RawData(bytes(data)))
        if data == b"":
            break
    await self.protocol.handle(Closed())


def apply() -> None:
    """Idempotent."""
    TCPServer.protocol_send = _protocol_send  # type: ignore[method-assign]
    H11Protocol.stream_send = _stream_send  # type: ignore[method-assign]
    TCPServer._read_data = _read_data  # type: ignore[method-assign]
    TCPServer.__init__ = _init  # type: ignore[method-assign]
