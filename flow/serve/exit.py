"""Where a request's frames go over HTTP: the first to the response, the rest straight to the connection.

A run's exit stage sends :class:`WireFrame` items to its exit outbox. Over HTTP that is a
:class:`ResponseExit`:

* the first frame (status, headers, the body or its first bytes) is what :meth:`FlowServer.respond` waits
  for and answers with;
* for a stream, the HTTP app sends that head, then :meth:`ResponseExit.attach` hands over the connection
  (a :class:`BodyWriter`), and every later frame is written by the run's own task as the exit stage sends it:
  no channel, no task switch and no iterator between the stage that encodes a frame and the connection. The
  connection's own back-pressure holds the run (an engine's chunks wait, and merge, upstream);
* a frame sent without waiting (:meth:`ResponseExit.send_now`: an engine step handing a row its token, the
  row's stages run synchronously) goes to the socket at once when it takes it (``BodyWriter.write_now``);
  what it does not take waits, in order, for the run's task to write it (:meth:`ResponseExit.drain`), and
  until then nothing is sent without waiting;
* while the run is quiet (a long prefill), the HTTP app's task, which waits for the run to end
  (:meth:`ResponseExit.serve`), writes the stream's keepalive each ``keepalive_seconds`` the head asked for.

A frame sent after a whole (non-streaming) response has nowhere to go: its send raises
``BrokenResourceError``, as a closed channel's would.

The stages' end of the stream (``close``, ``finish``) does not end a run's exit: after a stage failed, the
server still sends the error frames that end the stream in the protocol's shape. The request's owner ends it
(:meth:`RunExit.end`) when the run is over. Over a WebSocket, frames go through a channel instead
(:class:`ChannelExit`).
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from typing import Protocol

import trio

from flow.graph.stage import Outbox
from protocols.ir import WireFrame

class BodyWriter(Protocol):
    """A streamed response body's connection, once its head is sent."""

    async def write(self, data: bytes) -> None:
        """Write a piece of the body, waiting while the socket is full."""

    def write_now(self, data: bytes) -> bytes | None:
        """Write a piece of the body now, without waiting: the bytes the socket did not take (framed: they go to
        :meth:`write_raw`), or ``None`` when it cannot write now at all (nothing was written)."""

    async def write_raw(self, data: bytes) -> None:
        """The rest of what :meth:`write_now` began, as it framed it."""


class RunExit(Outbox[WireFrame]):
    """A run's exit outbox: closing it from the stages' side does nothing; :meth:`end` ends it."""

    def close(self) -> None:
        pass

    def end(self) -> None:
        raise NotImplementedError


class ChannelExit(RunExit):
    """Frames into a channel (a WebSocket session forwards them)."""

    def __init__(self, channel: trio.MemorySendChannel[WireFrame]) -> None:
        super().__init__(())
        self._channel = channel

    async def send(self, frame: WireFrame) -> None:
        self.sent += 1
        await self._channel.send(frame)

    def end(self) -> None:
        self._channel.close()


class ResponseExit(RunExit):
    """One HTTP response's exit outbox."""

    def __init__(self) -> None:
        super().__init__(())
        self.first: WireFrame | None = None
        self.started = trio.Event()  # the first frame is here, or the run ended without one
        self.ended = trio.Event()  # the run sends nothing more
        self._writer: BodyWriter | None = None
        self._write_now: Callable[[bytes], bytes | None] | None = None  # the writer's, bound once it is attached
        self._attached = trio.Event()
        self._closed = False  # ``ended`` is set (read per frame: a field, not the event's method)
        self._last_write = 0.0  # time.perf_counter() of the last frame (per frame: no trio clock lookup)
        # Frames sent without waiting that are not on the wire yet, in order: (framed by write_now, bytes).
        self._pending: deque[tuple[bool, bytes]] = deque()
        self._writing = False  # the run's task is writing pending bytes

    def _take_first(self, frame: WireFrame) -> bool:
        """Whether ``frame`` is the first (kept for the HTTP app); a closed exit, or a frame after a whole
        response, raises as a closed channel would."""
        if self._closed:
            raise trio.ClosedResourceError("the run's exit is closed")
        self.sent += 1
        if self.first is None:
            self.first = frame
            self.started.set()
            return True
        if not self.first.streaming:
            raise trio.BrokenResourceError("the response was whole: nothing follows it")
        self._last_write = time.perf_counter()
        return False

    async def send(self, frame: WireFrame) -> None:
        if self._take_first(frame):
            return
        if self._writer is None:
            await self._attached.wait()  # the head is not on the wire yet
        assert self._writer is not None
        if self._pending:
            await self.drain()
        await self._writer.write(frame.data)

    def sends_now(self) -> bool:
        return True

    def ready(self) -> bool:
        first = self.first
        return not self._closed and (
            first is None or (first.streaming and self._writer is not None and not self._pending
                              and not self._writing))

    def send_now(self, frame: WireFrame) -> None:
        write_now = self._write_now
        if write_now is None or self._pending or self._closed:  # not attached yet, bytes ahead of it, or ended
            if self._take_first(frame):
                return
            self._pending.append((False, frame.data))
            return
        # Per streamed token: a frame of a stream under way (only a stream's head attaches a writer), as
        # _take_first would count it, straight to the writer's own method.
        self.sent += 1
        self._last_write = time.perf_counter()
        left = write_now(frame.data)
        if left is None:
            self._pending.append((False, frame.data))
        elif left:
            self._pending.append((True, left))

    async def drain(self) -> None:
        if not self._pending:
            return  # (a whole response never attaches: nothing of it is ever pending)
        if self._writer is None:
            await self._attached.wait()
        assert self._writer is not None
        self._writing = True
        try:
            while self._pending:
                framed, data = self._pending.popleft()
                await (self._writer.write_raw(data) if framed else self._writer.write(data))
        finally:
            self._writing = False

    def end(self) -> None:
        self._closed = True
        self.started.set()
        self.ended.set()

    def attach(self, writer: BodyWriter) -> None:
        """The response head (and the first frame's bytes) are sent: later frames go to ``writer``."""
        self._writer = writer
        self._write_now = writer.write_now
        self._last_write = time.perf_counter()
        self._attached.set()

    async def serve(self) -> None:
        """Wait for the run to end, keeping a quiet stream open with its keepalive (call after :meth:`attach`),
        then write what the run left unwritten."""
        first, writer = self.first, self._writer
        assert first is not None and writer is not None
        if not first.keepalive or first.keepalive_seconds <= 0:
            await self.ended.wait()
        while not self.ended.is_set():
            with trio.move_on_after(self._last_write + first.keepalive_seconds - time.perf_counter()):
                await self.ended.wait()
            if not self.ended.is_set() and time.perf_counter() - self._last_write >= first.keepalive_seconds:
                self._last_write = time.perf_counter()
                if self._pending or self._writing:
                    continue  # bytes are on their way: the stream is not quiet
                await writer.write(first.keepalive)
        if self._pending and not self._writing:
            await self.drain()
