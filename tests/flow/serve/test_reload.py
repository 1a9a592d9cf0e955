"""Live reload through the real server: under load, across protocols, keeping the loaded model and its cache.

The server's loader compiles the tables the test holds; each reload edits them first, as a user edits the
graph file, and asks ``POST /admin/reload``.
"""

from __future__ import annotations

import copy
import json
import threading
from pathlib import Path
from typing import Any

import httpx
import pytest

from flow.builtins import compile_tables
from tests.harness import running_server, tables_with_prefix_cache

SYSTEM = "You are a careful assistant. " * 24  # several prefix-cache blocks, shared by every turn below
STREAMS = 32
MAX_TOKENS = 320


def _stream(base: str, protocol: int, index: int, out: dict[int, dict[str, Any]], started: threading.Semaphore) -> None:
    """One streaming request in one of three protocols; records whether it ended as its protocol says."""
    user = f"Tell me story number {index}."
    if protocol == 0:
        url, body, done = "/v1/chat/completions", {
            "model": "tiny", "stream": True, "max_tokens": MAX_TOKENS, "stream_options": {"include_usage": True},
            "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": user}]}, ("data: [DONE]",)
    elif protocol == 1:
        url, body, done = "/v1/messages", {
            "model": "tiny", "stream": True, "max_tokens": MAX_TOKENS, "system": SYSTEM,
            "messages": [{"role": "user", "content": user}]}, ("event: message_stop",)
    else:
        url, body, done = "/v1/responses", {
            "model": "tiny", "stream": True, "max_output_tokens": MAX_TOKENS, "instructions": SYSTEM,
            "input": user, "store": False}, ("event: response.completed", "event: response.incomplete")
    text = ""
    first = True
    try:
        with httpx.stream("POST", base + url, json=body, timeout=120) as response:
            status = response.status_code
            for chunk in response.iter_text():
                text += chunk
                if first:
                    first = False
                    started.release()
    finally:
        if first:
            started.release()
    out[index] = {"status": status, "complete": any(marker in text for marker in done), "error": "event: error" in text or 'data: {"error"' in text, "bytes": len(text)}


def _reload(base: str) -> dict[str, Any]:
    response = httpx.post(base + "/admin/reload", timeout=120)
    return {"status": response.status_code, **response.json()}


def _chat(base: str, path: str = "/v1/chat/completions", **extra: Any) -> httpx.Response:
    body = {"model": "tiny", "messages": [{"role": "system", "content": SYSTEM},
                                          {"role": "user", "content": "Hello again."}], **extra}
    return httpx.post(base + path, json=body, timeout=120)


def test_reload_under_load_keeps_the_model_and_its_cache(tiny_qwen3: Path, tmp_path: Path) -> None:
    base_tables = tables_with_prefix_cache(tiny_qwen3, tmp_path / "kv", block_tokens=16)
    state = {"tables": copy.deepcopy(base_tables)}
    graph = compile_tables(copy.deepcopy(state["tables"]), "reload test v1")
    with running_server(graph, loader=lambda: compile_tables(copy.deepcopy(state["tables"]), "reload test")) as running:
        base = running.base_url
        model = running.server.models[0]
        assert _chat(base, max_tokens=4).status_code == 200  # the shared system prompt's blocks are cached
        hits_before = running.server.observer.stats_json()["resources"]["prefix_cache"]["hits"]

        results: dict[int, dict[str, Any]] = {}
        started = threading.Semaphore(0)
        threads = [threading.Thread(target=_stream, args=(base, i % 3, i, results, started)) for i in range(STREAMS)]
        for thread in threads:
            thread.start()
        for _ in range(STREAMS):
            assert started.acquire(timeout=120)  # every stream has its first bytes: all are in flight

        # 1. A sampling default changed: requests without max_tokens now get 7 tokens at most.
        state["tables"]["stages"]["prepare"]["default_max_tokens"] = 7
        first = _reload(base)
        assert first["status"] == 200 and first["reloaded"] and first["version"] == 2, first
        assert first["in_flight"] > 0, "the streams were meant to be running during the reload"
        assert {"model", "prefix_cache", "agent_store", "response_store"} <= set(first["kept"]) and not first["built"]
        usage = _chat(base, temperature=0).json()["usage"]  # greedy: sampling may draw EOS first
        assert 1 <= usage["completion_tokens"] <= 7, usage

        # 2. A route added: a second chat entry on another path, into the same inference path.
        state["tables"]["stages"]["chat_v2"] = {"type": "openai.chat.decode", "routes": ["POST /v2/chat/completions"],
                                               "exit": "openai_chat_out"}
        state["tables"]["stages"]["prepare"]["inputs"].append("chat_v2")
        second = _reload(base)
        assert second["status"] == 200 and second["version"] == 3, second
        assert _chat(base, "/v2/chat/completions", max_tokens=3).status_code == 200

        # 3. A stage removed: the legacy completions entry and exit go, and so does their route.
        for sid in ("completions", "completions_out"):
            del state["tables"]["stages"][sid]
        state["tables"]["stages"]["prepare"]["inputs"].remove("completions")
        third = _reload(base)
        assert third["status"] == 200 and third["version"] == 4, third
        gone = httpx.post(base + "/v1/completions", json={"model": "tiny", "prompt": "hi"}, timeout=30)
        assert gone.status_code == 404 and "No route POST /v1/completions" in gone.json()["error"]["message"]

        # A broken graph changes nothing and says what is wrong, as `flow check` would.
        working = copy.deepcopy(state["tables"])
        state["tables"]["resources"]["prefix_cache"]["models"] = ["modle"]
        state["tables"]["stages"]["openai_chat"]["exit"] = "agents_generate_out"
        broken = _reload(base)
        assert broken["status"] == 422 and not broken["reloaded"], broken
        assert "resources.prefix_cache.models[0]: no resource named 'modle'" in broken["errors"]
        assert "did you mean 'model'?" in broken["errors"]
        assert "stages.openai_chat.exit: contract mismatch" in broken["errors"]
        state["tables"] = working
        health = running.health()
        assert health["graph"]["version"] == 4 and health["graph"]["failed_reloads"] == 1
        assert _chat(base, "/v2/chat/completions", max_tokens=3).status_code == 200  # still the 4th graph

        for thread in threads:
            thread.join(120)
        assert len(results) == STREAMS
        failed = {i: r for i, r in results.items() if r["status"] != 200 or not r["complete"] or r["error"]}
        assert not failed, failed

        # The model was loaded once, and is the same object; the cache kept its blocks and keeps hitting.
        assert model.loads == 1 and running.server.models[0] is model
        assert health["models"][0]["loads"] == 1
        cached = _chat(base, max_tokens=2).json()["usage"]
        assert cached["prompt_tokens_details"]["cached_tokens"] > 0, cached
        hits_after = running.server.observer.stats_json()["resources"]["prefix_cache"]["hits"]
        assert hits_after > hits_before


def test_a_changed_resource_is_rebuilt_and_the_old_one_closed(tiny_qwen3: Path, tmp_path: Path) -> None:
    """A resource whose config changed is built before the switch and the old one closed after; a model
    whose config is unchanged stays loaded."""
    tables = tables_with_prefix_cache(tiny_qwen3, tmp_path / "kv", block_tokens=16)
    state = {"tables": tables}
    with running_server(compile_tables(copy.deepcopy(tables), "v1"),
                        loader=lambda: compile_tables(copy.deepcopy(state["tables"]), "v2")) as running:
        base = running.base_url
        old_store = running.server.resources["response_store"]
        state["tables"]["resources"]["response_store"]["ttl_seconds"] = 60
        report = _reload(base)
        assert report["status"] == 200 and report["built"] == ["response_store"], report
        assert report["retiring"] == ["response_store"] and "model" in report["kept"]
        new_store = running.server.resources["response_store"]
        assert new_store is not old_store and new_store.config.ttl_seconds == 60
        created = httpx.post(base + "/v1/responses", json={"model": "tiny", "input": "hi", "max_output_tokens": 3},
                             timeout=60)
        assert created.status_code == 200
        got = httpx.get(base + f"/v1/responses/{created.json()['id']}", timeout=30)
        assert got.status_code == 200
        for _ in range(100):  # the old store closes once its generation has no request left
            if not old_store.state.open:
                break
            threading.Event().wait(0.05)
        assert not old_store.state.open
        assert running.server.models[0].loads == 1


@pytest.mark.parametrize("change", ["port", "unreadable", "unstartable"])
def test_a_reload_that_cannot_apply_changes_nothing(tiny_qwen3: Path, tmp_path: Path, change: str) -> None:
    tables = tables_with_prefix_cache(tiny_qwen3, tmp_path / "kv", block_tokens=16)
    state: dict[str, Any] = {"tables": tables}

    def loader() -> Any:
        if change == "unreadable":
            raise OSError("graph file vanished")
        return compile_tables(copy.deepcopy(state["tables"]), "v2")

    with running_server(compile_tables(copy.deepcopy(tables), "v1"), loader=loader) as running:
        if change == "unstartable":  # compiles, but its new model cannot load: the old graph serves on
            state["tables"]["resources"]["second"] = {"type": "model", "path": str(tmp_path / "no-such-model")}
        else:
            state["tables"]["server"] = {"port": 9}
        report = _reload(running.base_url)
        assert report["status"] == 422 and not report["reloaded"]
        expected = {"port": "server.port changed", "unreadable": "graph file vanished",
                    "unstartable": "the new graph's resources failed to start"}[change]
        assert expected in report["errors"], report
        assert [m.name for m in running.server.models] == ["tiny"]
        assert running.health()["graph"]["version"] == 1
        assert _chat(running.base_url, max_tokens=2).status_code == 200


def test_reload_needs_the_api_key(tiny_qwen3: Path, tmp_path: Path) -> None:
    tables = tables_with_prefix_cache(tiny_qwen3, tmp_path / "kv", block_tokens=16)
    tables["server"] = {"api_key": "sesame"}
    with running_server(compile_tables(copy.deepcopy(tables), "v1"),
                        loader=lambda: compile_tables(copy.deepcopy(tables), "v2")) as running:
        refused = httpx.post(running.base_url + "/admin/reload", timeout=30)
        assert refused.status_code == 401
        ok = httpx.post(running.base_url + "/admin/reload", headers={"authorization": "Bearer sesame"}, timeout=60)
        assert ok.status_code == 200 and json.loads(ok.content)["version"] == 2
