"""Clients that leave during a prefill stop it at its next chunk boundary, through the real server.

Six clients — the three protocols, streaming and not, half of them resetting the connection — send
long prompts and leave while the first prompt's chunk is being computed. Which chunk that is does not
depend on timing: the engine's model is wrapped so that its first prefill pass waits, on the device
thread, until the test lets it go, and the test lets it go only once the server has seen every client
leave (no request is in flight any more, so every sequence's cancellation has reached the engine).
Then the engine must compute nothing more for them: not the rest of the first prompt, not its first
token, not another prompt's chunk in the same step; all six count as cancelled, the engine is idle and
holds no KV memory.

Last, a streaming client that leaves after the view returned its response but before the body began.
"""

from __future__ import annotations

import json
import socket
import struct
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import mlx.core as mx
import pytest

from flow.builtins import compile_tables
from tests.harness import RunningServer, graph_with_model, running_server, tables_with_prefix_cache

CHUNK = 256
CLIENTS = [  # (protocol, streaming, reset the connection rather than close it)
    ("chat", False, True), ("messages", True, False), ("responses", False, False),
    ("chat", True, True), ("messages", False, True), ("responses", True, False),
]


class HeldPrefill:
    """The engine's model; its first prefill pass waits (on the device thread) for :meth:`release`."""

    def __init__(self, model: Any) -> None:
        self.model = model
        self.entered = threading.Event()
        self.released = threading.Event()
        self.tokens = 0  # prompt tokens in the held pass

    def __call__(self, inputs: mx.array, cache: Any = None) -> mx.array:
        if inputs.shape[1] > 1 and not self.entered.is_set():  # a prefill pass: several tokens per row
            self.tokens = inputs.shape[0] * inputs.shape[1]
            self.entered.set()
            self.released.wait(60)
        out: mx.array = self.model(inputs, cache=cache)
        return out

    def release(self) -> None:
        self.released.set()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.model, name)


@pytest.fixture(scope="module")
def server(tiny_qwen3: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    tables = tables_with_prefix_cache(tiny_qwen3, tmp_path_factory.mktemp("kv"), 16)
    tables["resources"]["model"]["prefill_chunk"] = CHUNK
    with running_server(compile_tables(tables, "default.toml (cancel test)")) as running:
        yield running


def prompt(i: int, words: int) -> str:
    return f"Request {i}: " + " ".join(f"lamp{(i * 7919 + k) % 997} ships" for k in range(words))


def request(protocol: str, stream: bool, text: str) -> tuple[str, dict[str, Any]]:
    if protocol == "chat":
        return "/v1/chat/completions", {"model": "tiny", "messages": [{"role": "user", "content": text}],
                                        "max_tokens": 200, "stream": stream}
    if protocol == "messages":
        return "/v1/messages", {"model": "tiny", "messages": [{"role": "user", "content": text}],
                                "max_tokens": 200, "stream": stream}
    return "/v1/responses", {"model": "tiny", "input": text, "max_output_tokens": 200, "stream": stream}


def connect(server: RunningServer, path: str, body: dict[str, Any]) -> socket.socket:
    """A raw HTTP/1.1 request (no client library that could retry or linger), left open."""
    host, port = server.base_url.removeprefix("http://").rsplit(":", 1)
    data = json.dumps(body).encode()
    sock = socket.create_connection((host, int(port)))
    sock.sendall(f"POST {path} HTTP/1.1\r\nhost: {host}:{port}\r\ncontent-type: application/json\r\n"
                 f"content-length: {len(data)}\r\n\r\n".encode() + data)
    return sock


def leave(sock: socket.socket, reset: bool) -> None:
    if reset:  # an abrupt close: RST instead of FIN
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    sock.close()


def wait_for(check: Any, what: str, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.02)


def leave_during_the_first_chunk(server: RunningServer, words: int, first: int) -> tuple[dict[str, int], HeldPrefill]:
    """Six clients send prompts of ``words`` words (about 8.5 tokens each; numbered from ``first``, unlike
    any other test's, so no prefix-cache hit shortens them), the first one alone (so the held pass is its
    own), and all leave while that pass is held. Returns what the engine did from then on, once idle."""
    engine = server.server.models[0].loaded.engine  # type: ignore[union-attr]
    held = HeldPrefill(engine.model)
    before = server.engine_stats()
    engine.model = held
    socks: list[socket.socket] = []
    try:
        socks.append(connect(server, *request(*CLIENTS[0][:2], prompt(first, words))))
        assert held.entered.wait(20), "the first prompt's prefill did not start"
        for i, (protocol, stream, _) in enumerate(CLIENTS[1:], 1):
            socks.append(connect(server, *request(protocol, stream, prompt(first + i, words))))
        wait_for(lambda: server.engine_stats()["submitted"] - before["submitted"] == len(CLIENTS),
                 "all six prompts to reach the engine")
        for sock, (_, _, reset) in zip(socks, CLIENTS):
            leave(sock, reset)
        # Every run has ended (the server saw each client leave): each one's cancellation is in the engine.
        wait_for(lambda: server.health()["requests"]["active"] == 0, "the server to notice all six leave")
        at_leave = server.engine_stats()
    finally:
        held.release()
        for sock in socks:
            sock.close()
        try:
            wait_for(lambda: (lambda s: s["active"] == 0 and s["waiting"] == 0)(server.engine_stats()),
                     "the engine to be idle", timeout=10)
        finally:
            engine.model = held.model
    after = server.engine_stats()
    assert at_leave["prompt_tokens"] == before["prompt_tokens"]  # the held pass is not counted yet
    delta = {key: after[key] - before[key] for key in
             ("submitted", "cancelled", "finished", "failed", "prompt_tokens", "generated_tokens", "prefill_chunks")}
    delta["kv_bytes"] = after["kv_bytes"]
    return delta, held


def test_long_prompts_stop_at_the_chunk_being_computed(server: RunningServer) -> None:
    """~1.4k-token prompts, 256-token chunks: the first prompt's held chunk is all the engine computes."""
    delta, held = leave_during_the_first_chunk(server, 165, first=0)
    assert held.tokens == CHUNK
    assert delta == {"submitted": 6, "cancelled": 6, "finished": 0, "failed": 0, "prompt_tokens": CHUNK,
                     "generated_tokens": 0, "prefill_chunks": 1, "kv_bytes": 0}


def test_nothing_more_runs_in_the_step_of_the_pass_that_was_running(server: RunningServer) -> None:
    """Prompts shorter than a chunk: the held pass is the first prompt's whole prefill, and the same step
    would go on to its last token's pass (its first token), then to queued prompts' chunks. None of that
    runs: its prefill stops short of the whole prompt and no token is generated."""
    delta, held = leave_during_the_first_chunk(server, 20, first=100)
    assert 0 < held.tokens < CHUNK
    assert delta == {"submitted": 6, "cancelled": 6, "finished": 0, "failed": 0, "prompt_tokens": held.tokens,
                     "generated_tokens": 0, "prefill_chunks": 1, "kv_bytes": 0}


@pytest.fixture
def own_server(tiny_qwen3: Path) -> Iterator[RunningServer]:
    with running_server(graph_with_model(tiny_qwen3)) as running:
        yield running


def test_a_stream_left_before_its_body_began_is_cancelled(own_server: RunningServer,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """The run has sent its first frame and the stream's answer is ready; the client leaves before the head
    is sent (the send is held here until the disconnect cancels it, as a lagging event loop would). The body
    iterator, whose ``finally`` cancels the run, never starts: the run must end all the same."""
    import trio

    from flow.serve import graph_routes

    holding = threading.Event()
    answer = graph_routes._Reply.answer

    async def held_answer(self: Any, reply: Any) -> None:
        if reply.body is not None:
            holding.set()
            await trio.sleep_forever()  # until the client's disconnect cancels the request
        await answer(self, reply)

    monkeypatch.setattr(graph_routes._Reply, "answer", held_answer)
    before = own_server.engine_stats()
    sock = connect(own_server, "/v1/chat/completions", {
        "model": "tiny", "messages": [{"role": "user", "content": "hello"}], "max_tokens": 1000,
        "temperature": 0, "stream": True})
    assert holding.wait(20)
    leave(sock, reset=True)
    wait_for(lambda: own_server.health()["requests"]["active"] == 0, "the run to end", timeout=5)
    wait_for(lambda: (lambda s: s["active"] == 0 and s["waiting"] == 0)(own_server.engine_stats()),
             "the engine to be idle", timeout=5)
    after = own_server.engine_stats()
    assert after["cancelled"] - before["cancelled"] == 1 and after["finished"] == before["finished"]
