"""A bounded queue: beyond it, 429 (OpenAI protocols) or 529 (Anthropic) with retry-after; never a crash."""

from __future__ import annotations

import concurrent.futures
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.harness import RunningServer, graph_with_model, running_server

USER = [{"role": "user", "content": "Tell me a long story."}]


@pytest.fixture(scope="module")
def narrow_server(tiny_qwen3: Path) -> Iterator[RunningServer]:
    # The narrowest engine: one row, one waiting place, one prefill chunk a step even in a burst.
    with running_server(graph_with_model(tiny_qwen3, max_batch=1, max_queue=1, prefill_burst=1)) as server:
        assert server.engine_stats()["prefill_burst"] == 1  # the graph's setting reaches the engine
        yield server


def flood(server: RunningServer, path: str, body: dict[str, Any], n: int = 8) -> list[httpx.Response]:
    def one(_: int) -> httpx.Response:
        return httpx.post(server.base_url + path, json=body, timeout=120)

    with concurrent.futures.ThreadPoolExecutor(n) as pool:
        return list(pool.map(one, range(n)))


def test_openai_overflow_is_429_with_retry_after(narrow_server: RunningServer) -> None:
    responses = flood(narrow_server, "/v1/chat/completions", {"model": "tiny", "messages": USER, "max_tokens": 150})
    statuses = sorted(r.status_code for r in responses)
    assert 200 in statuses and 429 in statuses and set(statuses) <= {200, 429}, statuses
    refused = next(r for r in responses if r.status_code == 429)
    assert int(refused.headers["retry-after"]) >= 1 and refused.headers["x-should-retry"] == "true"
    assert "busy" in refused.json()["error"]["message"]
    assert narrow_server.health()["status"] == "ok"


def test_anthropic_overflow_is_529_overloaded_error(narrow_server: RunningServer) -> None:
    responses = flood(narrow_server, "/v1/messages", {"model": "tiny", "messages": USER, "max_tokens": 150})
    statuses = sorted(r.status_code for r in responses)
    assert 200 in statuses and 529 in statuses and set(statuses) <= {200, 529}, statuses
    refused = next(r for r in responses if r.status_code == 529)
    assert refused.json()["error"]["type"] == "overloaded_error" and int(refused.headers["retry-after"]) >= 1


def test_request_beyond_the_kv_budget_is_refused_up_front(tiny_qwen3: Path) -> None:
    with running_server(graph_with_model(tiny_qwen3, kv_budget_bytes=64 * 1024)) as server:
        per_token = server.server.models[0].require().engine.kv_bytes_per_token()
        fits = max(1, (64 * 1024) // per_token - 40)
        ok = httpx.post(server.url + "/chat/completions", json={
            "model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": min(fits, 8)})
        assert ok.status_code == 200, ok.text
        r = httpx.post(server.url + "/chat/completions", json={
            "model": "tiny", "messages": USER, "max_tokens": 2000})
        assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
        assert "KV cache" in r.json()["error"]["message"] and "MiB" in r.json()["error"]["message"]
        a = httpx.post(server.base_url + "/v1/messages", json={"model": "tiny", "messages": USER, "max_tokens": 2000})
        assert a.status_code == 400 and a.json()["error"]["type"] == "invalid_request_error"
        assert server.health()["models"][0]["kv_budget_bytes"] == 64 * 1024
