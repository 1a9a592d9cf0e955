"""A fix to hypercorn's trio TCP server, applied when flow serves.

When a response ends a connection (``Connection: close``, or an error before the
request's body was read), hypercorn closes the socket from inside the ASGI app's
own task, and quart-trio cancels that task's nursery as soon as the response is
sent. The cancellation lands on ``send_eof``'s checkpoint, before ``aclose``: the
socket stays open, h11 refuses whatever the client sends next, and the client
waits for an answer that never comes (a wedged keep-alive connection). Closing
must finish whatever cancels the task that asked for it, so it is shielded — as
hypercorn already shields the close of an idle connection.
"""

from __future__ import annotations

from typing import Any

import trio
from hypercorn.trio.tcp_server import TCPServer

_original_close = TCPServer._close


async def _shielded_close(self: Any) -> None:
    with trio.CancelScope(shield=True):
        await _original_close(self)


def apply() -> None:
    """Idempotent."""
    TCPServer._close = _shielded_close  # type: ignore[method-assign]
