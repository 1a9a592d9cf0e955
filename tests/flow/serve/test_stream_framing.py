"""A streamed response's bytes on the wire, read from a raw socket.

flow writes a stream's frames to the connection from the run itself and frames a chunked body's pieces
without h11 (flow/serve/exit.py, flow/serve/hypercorn_fixes.py). These tests read what a client gets with no
HTTP library in between: a strictly parsed chunked body for HTTP/1.1, the same events; the connection kept
alive for a whole (Content-Length) answer after it; a close-delimited body for an HTTP/1.0 client; a client
that reads slowly gets every byte in order, written without waiting until its socket is full, then by the
request's task.
"""

from __future__ import annotations

import json
import os
import socket
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from flow.builtins import compile_tables
from flow.serve.hypercorn_fixes import DirectWriter
from tests.harness import RunningServer, running_server, tables_with_model

TEXT = "The keeper trims the wick and writes the log: the sea is calm, the wind from the west."


@pytest.fixture(scope="module")
def server(tiny_qwen3: Path) -> Iterator[RunningServer]:
    tables = tables_with_model(tiny_qwen3)
    tables["stages"]["generate"]["type"] = "generate.echo"  # the user's text comes back as the model's output
    with running_server(compile_tables(tables, "stream framing (test)")) as running:
        yield running


def request(stream: bool, version: str = "1.1", text: str = TEXT, max_tokens: int = 64) -> bytes:
    body = json.dumps({"model": "tiny", "messages": [{"role": "user", "content": text}], "stream": stream,
                       "max_tokens": max_tokens, "reasoning_effort": "none"}).encode()
    return (f"POST /v1/chat/completions HTTP/{version}\r\nhost: localhost\r\ncontent-type: application/json\r\n"
            f"content-length: {len(body)}\r\n\r\n").encode() + body


class Reader:
    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.buffer = b""

    def more(self) -> bool:
        data = self.sock.recv(65536)
        self.buffer += data
        return bool(data)

    def line(self) -> bytes:
        while b"\r\n" not in self.buffer:
            assert self.more(), "the connection closed in the middle of a line"
        line, _, self.buffer = self.buffer.partition(b"\r\n")
        return line

    def exactly(self, size: int) -> bytes:
        while len(self.buffer) < size:
            assert self.more(), "the connection closed in the middle of a body"
        data, self.buffer = self.buffer[:size], self.buffer[size:]
        return data

    def head(self) -> tuple[str, dict[str, str]]:
        status = self.line().decode()
        headers: dict[str, str] = {}
        while line := self.line():
            name, _, value = line.decode().partition(":")
            headers[name.strip().lower()] = value.strip()
        return status, headers

    def chunked(self) -> bytes:
        """A chunked body, each chunk checked: its size line, exactly that many bytes, then CRLF."""
        body = b""
        while True:
            size = int(self.line(), 16)
            data = self.exactly(size)
            assert self.line() == b"", "a chunk's data must end with CRLF"
            if size == 0:
                return body
            body += data


def streamed_text(body: bytes) -> str:
    frames = body.decode().split("\n\n")
    assert frames[-1] == "" and frames[-2] == "data: [DONE]"
    chunks = [json.loads(frame.removeprefix("data: ")) for frame in frames[:-2]]
    return "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])


def test_http11_stream_is_strictly_chunked_and_the_connection_serves_on(server: RunningServer) -> None:
    port = int(server.base_url.rsplit(":", 1)[1])
    with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
        reader = Reader(sock)
        sock.sendall(request(stream=True))
        status, headers = reader.head()
        assert status.startswith("HTTP/1.1 200") and headers["transfer-encoding"] == "chunked"
        assert "content-length" not in headers and headers["content-type"] == "text/event-stream"
        assert streamed_text(reader.chunked()) == TEXT
        sock.sendall(request(stream=False))  # the same connection: kept alive after the chunked body
        status, headers = reader.head()
        assert status.startswith("HTTP/1.1 200") and "transfer-encoding" not in headers
        whole = json.loads(reader.exactly(int(headers["content-length"])))
        assert whole["choices"][0]["message"]["content"] == TEXT
        assert reader.buffer == b""


def test_http10_stream_is_close_delimited(server: RunningServer) -> None:
    port = int(server.base_url.rsplit(":", 1)[1])
    with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
        reader = Reader(sock)
        sock.sendall(request(stream=True, version="1.0"))
        status, headers = reader.head()
        assert status.startswith("HTTP/1.1 200") and "transfer-encoding" not in headers
        while reader.more():
            pass  # the body ends when the server closes the connection
        assert streamed_text(reader.buffer) == TEXT


def test_a_slow_reader_gets_every_byte_in_order(server: RunningServer, monkeypatch: pytest.MonkeyPatch) -> None:
    left: list[int] = []  # bytes a direct write left for the task, per write that could not finish
    write_now = DirectWriter.write_now

    def counted(self: DirectWriter, data: bytes) -> bytes | None:
        rest = write_now(self, data)
        if rest:
            left.append(len(rest))
        return rest

    monkeypatch.setattr(DirectWriter, "write_now", counted)
    text = " ".join([TEXT] * 40)  # ~1,600 tokens: ~240 KB of events, more than the sockets hold
    port = int(server.base_url.rsplit(":", 1)[1])
    with socket.socket() as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        sock.settimeout(60)
        sock.connect(("127.0.0.1", port))
        reader = Reader(sock)
        sock.sendall(request(stream=True, text=text, max_tokens=2048))
        time.sleep(1.0)  # the server fills the socket and must wait
        status, _ = reader.head()
        assert status.startswith("HTTP/1.1 200"), reader.buffer
        assert streamed_text(reader.chunked()) == text
    assert left, "the socket never filled: the test did not reach the path it is for"


def test_a_whole_answer_cut_by_a_stop_string_ends_its_run(server: RunningServer) -> None:
    """The stop string matches while the lane feeds the stages; the run's task finishes the answer and ends,
    its row cancelled: nothing of the request is left running."""
    body = {"model": "tiny", "messages": [{"role": "user", "content": TEXT}], "max_tokens": 64,
            "reasoning_effort": "none", "stop": ["the wind"]}
    answer = httpx.post(server.base_url + "/v1/chat/completions", json=body, timeout=30).json()
    choice = answer["choices"][0]
    assert choice["message"]["content"] == TEXT[:TEXT.index("the wind")] and choice["finish_reason"] == "stop"
    deadline = time.monotonic() + 10
    while server.health()["requests"]["active"] and time.monotonic() < deadline:
        time.sleep(0.05)
    assert server.health()["requests"]["active"] == 0


def test_a_head_goes_out_with_the_first_piece_and_an_empty_piece_is_not_written(
        server: RunningServer, monkeypatch: pytest.MonkeyPatch) -> None:
    """A whole answer is one write (head and body; no empty write for its end); a stream's head goes out in the
    same write as its first frame. Each write is a system call and, on a busy server, a wait for the
    interpreter lock."""
    import flow.serve.hypercorn_fixes as fixes

    writes: list[bytes] = []
    real_write = os.write

    def recorded(fd: int, data: Any) -> int:
        writes.append(bytes(data))
        return real_write(fd, data)

    monkeypatch.setattr(fixes.os, "write", recorded)
    port = int(server.base_url.rsplit(":", 1)[1])
    with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
        reader = Reader(sock)
        sock.sendall(request(stream=False))
        status, headers = reader.head()
        whole = json.loads(reader.exactly(int(headers["content-length"])))
        assert whole["choices"][0]["message"]["content"] == TEXT
        assert len(writes) == 1 and writes[0].startswith(b"HTTP/1.1 200") and writes[0].endswith(b"}"), writes
        writes.clear()
        sock.sendall(request(stream=True))
        status, _ = reader.head()
        assert status.startswith("HTTP/1.1 200") and streamed_text(reader.chunked()) == TEXT
    assert writes[0].startswith(b"HTTP/1.1 200") and b"\r\n\r\n" in writes[0]
    assert b"data: " in writes[0].split(b"\r\n\r\n", 1)[1], "the head went out without the first frame"
    assert all(writes), "an empty write"
