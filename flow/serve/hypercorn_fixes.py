"""A fix to hypercorn's trio TCP server, applied when flow serves.

hypercorn's HTTP/1.1 protocol tells its TCP server what to do next — close the
connection (``Connection: close``, an error before the request's body was read),
or start the keep-alive idle timer once a response is done — from inside the
ASGI app's own task, and quart-trio cancels that task's nursery as soon as the
response is sent. The cancellation lands on the first checkpoint of that work:

* a close stops at ``send_eof``, before ``aclose``: the socket stays open, h11
  refuses what the client sends next, and the client waits for an answer that
  never comes (a wedged connection);
* the idle timer is never started: a kept-alive connection after its first
  request never times out (a slowloris holds it forever) and holds up a
  graceful stop until its deadline.

What the protocol asks of the TCP server must be done whatever cancels the
task that asked, so it is shielded — as hypercorn already shields the close of
an idle connection and the sending of data. Data (``RawData``) is left to
hypercorn's own shield: a second one per frame of a stream cost a cancel scope
for nothing.
"""

from __future__ import annotations

from typing import Any

import trio
from hypercorn.events import Event, RawData
from hypercorn.trio.tcp_server import TCPServer

_original_protocol_send = TCPServer.protocol_send


async def _shielded_protocol_send(self: Any, event: Event) -> None:
    if isinstance(event, RawData):  # hypercorn shields the sending itself
        await _original_protocol_send(self, event)
        return
    with trio.CancelScope(shield=True):
        await _original_protocol_send(self, event)


def apply() -> None:
    """Idempotent."""
    TCPServer.protocol_send = _shielded_protocol_send  # type: ignore[method-assign]
