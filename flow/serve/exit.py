"""Where a request's frames go over HTTP: the first to the response, the rest straight to the connection.

A run's exit stage sends :class:`WireFrame` items to its exit outbox. Over HTTP that is a
:class:`ResponseExit`:

* the first frame (status, headers, the body or its first bytes) is what :meth:`FlowServer.respond` waits
  for and answers with;
* for a stream, the HTTP app sends that head, then :meth:`ResponseExit.attach` hands over the connection's
  ASGI ``send``, and every later frame is written by the run's own task as the exit stage sends it: no
  channel, no task switch and no iterator between the stage that encodes a frame and the connection. The
  connection's own back-pressure holds the run (an engine's chunks wait, and merge, upstream);
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

from collections.abc import Awaitable, Callable

import trio

from flow.graph.stage import Outbox
from protocols.ir import WireFrame

Write = Callable[[bytes], Awaitable[None]]


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
        self._write: Write | None = None
        self._attached = trio.Event()
        self._last_write = 0.0

    async def send(self, frame: WireFrame) -> None:
        if self.ended.is_set():
            raise trio.ClosedResourceError("the run's exit is closed")
        if self.first is None:
            self.first = frame
            self.sent += 1
            self.started.set()
            return
        if not self.first.streaming:
            raise trio.BrokenResourceError("the response was whole: nothing follows it")
        if self._write is None:
            await self._attached.wait()  # the head is not on the wire yet
        assert self._write is not None
        self.sent += 1
        self._last_write = trio.current_time()
        await self._write(frame.data)

    def end(self) -> None:
        self.started.set()
        self.ended.set()

    def attach(self, write: Write) -> None:
        """The response head (and the first frame's bytes) are sent: later frames go to ``write``."""
        self._write = write
        self._last_write = trio.current_time()
        self._attached.set()

    async def serve(self) -> None:
        """Wait for the run to end, keeping a quiet stream open with its keepalive (call after :meth:`attach`)."""
        first = self.first
        assert first is not None and self._write is not None
        if not first.keepalive or first.keepalive_seconds <= 0:
            await self.ended.wait()
            return
        while not self.ended.is_set():
            with trio.move_on_at(self._last_write + first.keepalive_seconds):
                await self.ended.wait()
            if not self.ended.is_set() and trio.current_time() - self._last_write >= first.keepalive_seconds:
                self._last_write = trio.current_time()
                await self._write(first.keepalive)
