"""The load side of ``bench_pipeline.py``: the four protocols' requests, a lean keep-alive HTTP/1.1 client, and
what the server's ``/proc`` and ``/metrics`` say before and after a load.

The client is a few lines of trio over a socket, not httpx: at 256 streams on two cores the load generator
must cost far less than the server it measures. It reads a response whole (a stream ends with the chunked
body's last chunk) and checks it afterwards: the protocol's last event is there, and the completion tokens
the server reports are the tokens asked for.
"""

from __future__ import annotations

import json
import math
import os
import re
import time
from dataclasses import dataclass
from typing import Any

import trio

# Each protocol's route, the field that counts completion tokens in its usage, and the markers of a complete
# answer, streamed and whole (a Responses answer cut by max_output_tokens is "incomplete", and complete).
PROTOCOLS: dict[str, tuple[str, str]] = {
    "openai": ("/v1/chat/completions", "completion_tokens"),
    "responses": ("/v1/responses", "output_tokens"),
    "anthropic": ("/v1/messages", "output_tokens"),
    "ollama": ("/api/chat", "eval_count"),
}
STREAM_END = {"openai": ("data: [DONE]",), "responses": ("event: response.completed", "event: response.incomplete"),
              "anthropic": ("event: message_stop",), "ollama": ('"done":true',)}
WHOLE_END = {"openai": ('"finish_reason"',), "responses": ('"status":"completed"', '"status":"incomplete"'),
             "anthropic": ('"stop_reason"',), "ollama": ('"done":true',)}


def request_body(protocol: str, text: str, tokens: int, stream: bool) -> bytes:
    user = [{"role": "user", "content": text}]
    body: dict[str, Any]
    if protocol == "openai":
        body = {"model": "bench", "messages": user, "max_tokens": tokens, "stream": stream}
        if stream:
            body["stream_options"] = {"include_usage": True}
    elif protocol == "responses":
        body = {"model": "bench", "input": text, "max_output_tokens": tokens, "stream": stream}
    elif protocol == "anthropic":
        body = {"model": "bench", "messages": user, "max_tokens": tokens, "stream": stream}
    else:
        body = {"model": "bench", "messages": user, "stream": stream, "options": {"num_predict": tokens}}
    return json.dumps(body).encode()


PROSE = ("The keeper climbed the stairs of the lighthouse at dusk, trimmed the wick, wound the clockwork and "
         "wrote in the log that the sea was calm, the wind from the west, and no ship in sight.")


def echo_text(words: int) -> str:
    """A user message the echo stage sends back: prose long enough for the tokens asked for."""
    base = PROSE.split()
    return " ".join(f"{base[i % len(base)]}{'' if i % 7 else ' ' + str(i)}" for i in range(words))


class LeanClient:
    """One keep-alive HTTP/1.1 connection."""

    def __init__(self, host: str, port: int) -> None:
        self.host, self.port = host, port
        self.stream: trio.SocketStream | None = None
        self.buffer = b""

    async def request(self, path: str, body: bytes | None = None) -> tuple[int, bytes]:
        """POST ``body`` (GET without one); the status and the whole body (de-chunked)."""
        if self.stream is None:
            self.stream = await trio.open_tcp_stream(self.host, self.port)
        if body is None:
            head = f"GET {path} HTTP/1.1\r\nhost: {self.host}:{self.port}\r\n\r\n".encode()
        else:
            head = (f"POST {path} HTTP/1.1\r\nhost: {self.host}:{self.port}\r\ncontent-type: application/json\r\n"
                    f"content-length: {len(body)}\r\n\r\n").encode() + body
        await self.stream.send_all(head)
        while b"\r\n\r\n" not in self.buffer:
            await self._read()
        header, _, self.buffer = self.buffer.partition(b"\r\n\r\n")
        lines = header.decode("latin-1").split("\r\n")
        status = int(lines[0].split()[1])
        fields = {k.strip().lower(): v.strip() for k, v in (line.split(":", 1) for line in lines[1:])}
        if fields.get("transfer-encoding") == "chunked":
            # Only the end is looked for while it streams: the body is parsed once, when it is whole.
            while not self.buffer.endswith(b"0\r\n\r\n"):
                await self._read()
            raw, self.buffer = self.buffer, b""
            data = dechunk(raw)
        else:
            length = int(fields.get("content-length", "0"))
            while len(self.buffer) < length:
                await self._read()
            data, self.buffer = self.buffer[:length], self.buffer[length:]
        if fields.get("connection") == "close":
            await self.aclose()
        return status, data

    async def _read(self) -> None:
        assert self.stream is not None
        more = await self.stream.receive_some(1 << 16)
        if not more:
            raise ConnectionError("the server closed the connection")
        self.buffer += more

    async def aclose(self) -> None:
        if self.stream is not None:
            await self.stream.aclose()
            self.stream = None


def dechunk(raw: bytes) -> bytes:
    out: list[bytes] = []
    at = 0
    while True:
        end = raw.index(b"\r\n", at)
        size = int(raw[at:end].split(b";")[0], 16)
        if size == 0:
            return b"".join(out)
        out.append(raw[end + 2:end + 2 + size])
        at = end + 2 + size + 2


@dataclass
class Answer:
    ok: bool
    tokens: int
    error: str = ""


def check(protocol: str, stream: bool, status: int, data: bytes) -> Answer:
    """Whether an answer is complete, and the completion tokens its usage reports."""
    text = data.decode("utf-8", "replace")
    if status != 200:
        return Answer(False, 0, f"HTTP {status}: {text[:160]}")
    field = PROTOCOLS[protocol][1]
    if not any(marker in text for marker in (STREAM_END if stream else WHOLE_END)[protocol]):
        return Answer(False, 0, f"incomplete answer: {text[-160:]!r}")
    counts = re.findall(rf'"{field}":(\d+)', text)
    return Answer(True, int(counts[-1]) if counts else 0, "" if counts else "no usage")


# --------------------------------------------------------------------------- the server's side

CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int) -> tuple[float, float]:
    """utime and stime of every thread of ``pid`` (``/proc/PID/stat`` fields 14 and 15): its own code, and the
    kernel's work for it (system calls: a socket write to a client on this machine takes its TCP stack's work)."""
    with open(f"/proc/{pid}/stat") as stat:
        fields = stat.read().rsplit(")", 1)[1].split()
    return int(fields[11]) / CLOCK_TICKS, int(fields[12]) / CLOCK_TICKS


LagHistogram = dict[float, float]  # upper bound (seconds) → cumulative count


def lag_histogram(metrics_text: str) -> LagHistogram:
    """``flow_event_loop_lag_seconds``' cumulative buckets from ``/metrics``."""
    out: LagHistogram = {}
    for match in re.finditer(r'^flow_event_loop_lag_seconds_bucket\{le="([^"]+)"\} (\S+)$', metrics_text,
                             re.MULTILINE):
        out[math.inf if match[1] == "+Inf" else float(match[1])] = float(match[2])
    return out


def lag_quantile(before: LagHistogram, after: LagHistogram, q: float) -> float | None:
    """The ``q`` quantile (seconds) of the lags observed between two readings, interpolated within its
    bucket; ``None`` without observations. A quantile in the last bucket is its lower bound."""
    bounds = sorted(after)
    counts = [after[b] - before.get(b, 0.0) for b in bounds]
    total = counts[-1] if counts else 0.0
    if total <= 0:
        return None
    rank = q * total
    lower, below = 0.0, 0.0
    for bound, cumulative in zip(bounds, counts):
        if cumulative >= rank:
            if math.isinf(bound):
                return lower
            inside = cumulative - below
            return lower + (bound - lower) * ((rank - below) / inside if inside else 1.0)
        lower, below = bound, cumulative
    return lower


async def get(host: str, port: int, path: str) -> str:
    """A GET on a connection of its own (the figures are read between loads)."""
    client = LeanClient(host, port)
    try:
        return (await client.request(path))[1].decode()
    finally:
        await client.aclose()


@dataclass
class Load:
    """What one load did: answers, tokens, wall time, and the server's CPU and loop lag over it."""

    requests: int
    failed: int
    tokens: int
    wall_s: float
    cpu_s: float  # user + system
    system_s: float
    lag_p50_ms: float | None
    lag_p99_ms: float | None
    errors: list[str]


async def run_load(host: str, port: int, pid: int, protocol: str, stream: bool, concurrency: int, waves: int,
                   text: str, tokens: int) -> Load:
    """``concurrency`` clients, each sending ``waves`` requests one after another on its connection."""
    path = PROTOCOLS[protocol][0]
    body = request_body(protocol, text, tokens, stream)
    answers: list[Answer] = []

    async def client() -> None:
        connection = LeanClient(host, port)
        try:
            for _ in range(waves):
                try:
                    answers.append(check(protocol, stream, *await connection.request(path, body)))
                except (OSError, ConnectionError, ValueError, trio.BrokenResourceError) as exc:
                    answers.append(Answer(False, 0, f"{type(exc).__name__}: {exc}"))
                    await connection.aclose()
        finally:
            await connection.aclose()

    lag_before = lag_histogram(await get(host, port, "/metrics"))
    user_before, system_before = cpu_seconds(pid)
    started = time.perf_counter()
    async with trio.open_nursery() as nursery:
        for _ in range(concurrency):
            nursery.start_soon(client)
    wall = time.perf_counter() - started
    user_after, system_after = cpu_seconds(pid)
    system = system_after - system_before
    cpu = user_after - user_before + system
    lag_after = lag_histogram(await get(host, port, "/metrics"))
    p50, p99 = lag_quantile(lag_before, lag_after, 0.5), lag_quantile(lag_before, lag_after, 0.99)
    good = [a for a in answers if a.ok]
    return Load(len(answers), len(answers) - len(good), sum(a.tokens for a in good), wall, cpu, system,
                None if p50 is None else p50 * 1000, None if p99 is None else p99 * 1000,
                sorted({a.error for a in answers if not a.ok})[:3])
