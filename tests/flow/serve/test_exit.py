"""A streamed response's exit (flow/serve/exit.py): frames sent without waiting reach the connection in order,
whatever the socket takes at once.

A fake connection stands in for hypercorn's: ``write_now`` takes a set number of bytes (the rest comes back
to be written later), or refuses (nothing written); every byte it gets is recorded in the order it would
reach the wire.
"""

from __future__ import annotations

import trio

from flow.serve.exit import ResponseExit
from protocols.ir import WireFrame


class Connection:
    def __init__(self) -> None:
        self.wire = b""
        self.takes: int | None = 1 << 20  # bytes write_now takes now; None: it cannot write at all
        self.calls: list[str] = []

    async def write(self, data: bytes) -> None:
        await trio.lowlevel.checkpoint()
        self.calls.append("write")
        self.wire += data

    def write_now(self, data: bytes) -> bytes | None:
        self.calls.append("now")
        if self.takes is None:
            return None
        taken, left = data[:self.takes], data[self.takes:]
        self.wire += taken
        return left

    async def write_raw(self, data: bytes) -> None:
        await trio.lowlevel.checkpoint()
        self.calls.append("raw")
        self.wire += data


def test_frames_sent_without_waiting_keep_their_order_through_a_full_socket() -> None:
    async def main() -> None:
        exit = ResponseExit()
        assert exit.ready()  # the first frame is only kept
        exit.send_now(WireFrame(b"head;", streaming=True))
        assert exit.first is not None and exit.started.is_set() and not exit.ready()  # not attached yet
        connection = Connection()
        exit.attach(connection)
        assert exit.ready()
        exit.send_now(WireFrame(b"one;"))
        connection.takes = 2  # the socket is nearly full: "tw" now, "o;" later
        exit.send_now(WireFrame(b"two;"))
        assert not exit.ready()
        exit.send_now(WireFrame(b"three;"))  # behind the rest of "two;": not offered to the socket
        connection.takes = 1 << 20
        await exit.send(WireFrame(b"four;"))  # the task's own send writes what waits first
        assert connection.wire == b"one;two;three;four;" and exit.ready()
        connection.takes = None  # hypercorn cannot be written to directly now (another write under way)
        exit.send_now(WireFrame(b"five;"))
        assert not exit.ready()
        await exit.drain()
        assert connection.wire == b"one;two;three;four;five;" and exit.ready()
        assert connection.calls == ["now", "now", "raw", "write", "write", "now", "write"]
        assert exit.sent == 6

    trio.run(main)


def test_what_the_run_leaves_unwritten_is_written_when_it_ends() -> None:
    async def main() -> None:
        exit = ResponseExit()
        await exit.send(WireFrame(b"head;", streaming=True))
        connection = Connection()
        exit.attach(connection)
        connection.takes = 0
        exit.send_now(WireFrame(b"last;"))
        exit.end()
        assert not exit.ready()
        await exit.serve()
        assert connection.wire == b"last;"

    trio.run(main)


def test_a_quiet_stream_gets_its_keepalive_and_a_frame_puts_it_off() -> None:
    async def main() -> None:
        exit = ResponseExit()
        exit.send_now(WireFrame(b"head;", streaming=True, keepalive=b"ping;", keepalive_seconds=0.5))
        connection = Connection()
        exit.attach(connection)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(exit.serve)
            for _ in range(4):  # a frame every 0.05 s: never quiet for 0.5 s
                await trio.sleep(0.05)
                exit.send_now(WireFrame(b"tok;"))
            assert b"ping" not in connection.wire
            await trio.sleep(1.2)  # quiet: a keepalive every 0.5 s
            exit.end()
        assert connection.wire.startswith(b"tok;tok;tok;tok;ping;") and 1 <= connection.wire.count(b"ping;") <= 2

    trio.run(main)
