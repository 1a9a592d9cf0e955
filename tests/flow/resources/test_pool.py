"""The model pool: several models per graph, lazy loading, LRU eviction, pinning, idle unload.

Each test builds the default graph with two or three tiny models (real MLX) and a
``model_pool`` resource, and drives it through the real server by naming models in
requests.
"""

from __future__ import annotations

import concurrent.futures
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import openai

from flow.builtins import compile_tables
from flow.graph.spec import load_tables
from tests.harness import GRAPHS, RunningServer, running_server


@contextmanager
def pool_server(models: dict[str, tuple[Path, dict[str, Any]]], **pool: Any) -> Iterator[RunningServer]:
    """The default graph serving ``models`` (name → (path, model config)) under one pool."""
    tables = load_tables(GRAPHS / "default.toml")
    del tables["resources"]["model"]
    for name, (path, config) in models.items():
        tables["resources"][name] = {"type": "model", "path": str(path), **config}
    tables["resources"]["pool"] = {"type": "model_pool", **pool}
    with running_server(compile_tables(tables, "default.toml (pool test)")) as server:
        yield server


def ask(server: RunningServer, model: str, **extra: Any) -> httpx.Response:
    return httpx.post(server.url + "/chat/completions", timeout=120, json={
        "model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, **extra})


def pool_stats(server: RunningServer) -> dict[str, Any]:
    return httpx.get(server.base_url + "/stats", timeout=60).json()["resources"]["pool"]  # type: ignore[no-any-return]


def test_lazy_models_load_on_demand_and_the_least_recent_is_evicted(tiny_qwen3: Path, tiny_llama: Path) -> None:
    lazy = {"load": "lazy"}
    with pool_server({"a": (tiny_qwen3, lazy), "b": (tiny_llama, lazy)}, max_loaded=1) as server:
        assert server.health()["status"] == "ok"  # lazy models do not hold the server back
        assert pool_stats(server)["loaded"] == []
        assert ask(server, "a").status_code == 200
        assert pool_stats(server)["loaded"] == ["a"]
        assert ask(server, "b").status_code == 200
        stats = pool_stats(server)
        assert stats["loaded"] == ["b"] and stats["evictions"] == 1

        # Several requests for an unloaded model wait for one load.
        with concurrent.futures.ThreadPoolExecutor(4) as threads:
            answers = list(threads.map(lambda _: ask(server, "a"), range(4)))
        assert [r.status_code for r in answers] == [200] * 4
        stats = pool_stats(server)
        assert stats["models"]["a"] == {"state": "ready", "loads": 2}
        assert stats["loaded"] == ["a"] and stats["evictions"] == 2

        missing = ask(server, "nope")
        assert missing.status_code == 404 and missing.json()["error"]["code"] == "model_not_found"
        assert "a, b" in missing.json()["error"]["message"]


def test_a_pinned_model_is_never_evicted(tiny_qwen3: Path, tiny_llama: Path) -> None:
    models = {"pinned": (tiny_qwen3, {"pin": True}), "b": (tiny_llama, {"load": "lazy"}),
              "c": (tiny_llama, {"load": "lazy"})}
    with pool_server(models, max_loaded=2) as server:
        assert pool_stats(server)["loaded"] == ["pinned"]  # eager: loaded at start
        for model in ("b", "c", "b", "pinned", "c"):
            assert ask(server, model).status_code == 200, model
            assert "pinned" in pool_stats(server)["loaded"]
        stats = pool_stats(server)
        assert stats["pinned"] == ["pinned"] and stats["models"]["pinned"]["loads"] == 1
        assert stats["evictions"] == 3  # c evicts b, b evicts c, c evicts b


def test_idle_models_are_unloaded_and_come_back(tiny_qwen3: Path) -> None:
    # Idle for 2 s: a request's own stages never leave the model that long, even on a loaded machine (with a few
    # tenths of a second, an event-loop stall between prepare and generate let the model go mid-request).
    with pool_server({"a": (tiny_qwen3, {})}, idle_unload_seconds=2.0, grace_seconds=0.1) as server:
        assert ask(server, "a").status_code == 200
        loads = pool_stats(server)["models"]["a"]["loads"]  # 1, or 2 if it went idle before the request came
        deadline = time.monotonic() + 60
        while pool_stats(server)["loaded"] and time.monotonic() < deadline:
            time.sleep(0.1)
        stats = pool_stats(server)
        assert stats["loaded"] == [] and stats["idle_unloads"] >= 1
        assert server.health()["models"][0]["state"] == "unloaded"
        assert ask(server, "a").status_code == 200
        assert pool_stats(server)["models"]["a"]["loads"] == loads + 1  # loaded again, once


def _long_stream(server: RunningServer, model: str, tokens: int) -> tuple[int, float]:
    """Stream ``tokens`` tokens from ``model`` (its end tokens and its family's stop tokens suppressed: a random
    model samples ChatML's ``<|im_start|>`` now and then); (tokens received, finish time)."""
    resource = next(m for m in server.server.models if m.name == model)
    tokenizer = resource.require().tokenizer
    stops = {*tokenizer.eos_token_ids, *(tokenizer.convert_tokens_to_ids(t) for t in resource.family.stop_tokens)}
    bias = {str(t): -100 for t in stops if t is not None}
    client = openai.OpenAI(base_url=server.url, api_key="unused", max_retries=0)
    received = 0
    stream = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Tell a story."}],
                                            max_tokens=tokens, logit_bias=bias, stream=True,
                                            stream_options={"include_usage": True})
    for chunk in stream:
        if chunk.usage is not None:
            received = chunk.usage.completion_tokens
    return received, time.monotonic()


def _overlapping(server: RunningServer, threads: concurrent.futures.Executor, tokens: int
                 ) -> concurrent.futures.Future[tuple[int, float]]:
    """A long stream from model "a", returned once its sequence is decoding."""
    running = threads.submit(_long_stream, server, "a", tokens)
    deadline = time.monotonic() + 120
    while server.server.models[0].require().engine.active == 0:
        if running.done():
            running.result()  # the stream failed before it began: its error, rather than a wait for nothing
        assert time.monotonic() < deadline, "the stream never began decoding"
        time.sleep(0.01)
    return running


def test_eviction_waits_for_in_flight_requests(tiny_qwen3: Path, tiny_llama: Path) -> None:
    """A model with a sequence running is never evicted: a load that needs its room waits (or, past
    ``wait_seconds``, is answered 429/529 with retry-after), and the running stream completes."""
    models = {"a": (tiny_qwen3, {}), "b": (tiny_llama, {"load": "lazy"})}
    with pool_server(models, max_loaded=1, grace_seconds=0.1, wait_seconds=0.5) as server:
        with concurrent.futures.ThreadPoolExecutor(1) as threads:
            running = _overlapping(server, threads, 3000)
            refused = ask(server, "b")
            anthropic_refused = httpx.post(server.base_url + "/v1/messages", timeout=60, json={
                "model": "b", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]})
            assert not running.done(), "the stream ended before the test could overlap it: make it longer"
            tokens, _ = running.result()
        assert tokens == 3000
        assert refused.status_code == 429 and int(refused.headers["retry-after"]) >= 1, refused.text
        assert "busy or pinned" in refused.json()["error"]["message"]
        assert anthropic_refused.status_code == 529
        assert anthropic_refused.json()["error"]["type"] == "overloaded_error"
        assert pool_stats(server)["loaded"] == ["a"]

    with pool_server(models, max_loaded=1, grace_seconds=0.1, wait_seconds=120) as server:
        with concurrent.futures.ThreadPoolExecutor(1) as threads:
            running = _overlapping(server, threads, 1500)
            waited = ask(server, "b")
            b_done = time.monotonic()
            tokens, a_done = running.result()
        assert tokens == 1500 and waited.status_code == 200, waited.text
        assert a_done < b_done  # b loaded only once a's stream was over
        assert pool_stats(server)["loaded"] == ["b"]


def test_embedding_models_count_in_the_pool_like_any_other(tiny_qwen3: Path) -> None:
    from runtime.tiny import ensure_tiny_model

    lazy = {"load": "lazy"}
    models = {"chat": (tiny_qwen3, lazy), "vectors": (ensure_tiny_model("tiny-bert"), lazy)}
    with pool_server(models, max_loaded=1) as server:
        def embed() -> httpx.Response:
            return httpx.post(server.url + "/embeddings", json={"model": "vectors", "input": ["a", "b c"]}, timeout=60)

        first = embed()
        assert first.status_code == 200 and pool_stats(server)["loaded"] == ["vectors"]
        assert ask(server, "chat").status_code == 200
        stats = pool_stats(server)
        assert stats["loaded"] == ["chat"] and stats["evictions"] == 1
        again = embed()  # reloaded after its eviction: the same vectors
        assert again.status_code == 200  # the same vectors, to float32 rounding (a pass's shape may differ)
        assert np.allclose([d["embedding"] for d in again.json()["data"]],
                           [d["embedding"] for d in first.json()["data"]], atol=1e-6)
        stats = pool_stats(server)
        assert stats["loaded"] == ["vectors"] and stats["models"]["vectors"] == {"state": "ready", "loads": 2}
