"""``flow serve --watch`` and SIGHUP: the real command reloads its graph file, and a broken edit changes nothing."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx

from tests.harness import GRAPHS, free_port


def _until(check: Callable[[], Any], seconds: float = 60) -> Any:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        try:
            found = check()
        except httpx.HTTPError:
            found = None
        if found:
            return found
        time.sleep(0.2)
    raise AssertionError(f"not within {seconds} s")


def _graph(model: Path, extra: str = "", cache: str = "") -> str:
    return (f'extends = "{GRAPHS / "default.toml"}"\n[resources.model]\npath = "{model}"\nname = "tiny"\n'
            f'[resources.prefix_cache]\ndisk = false\n{cache}{extra}')


def test_watch_and_sighup_reload_the_graph_file(tiny_qwen3: Path, tmp_path: Path) -> None:
    graph = tmp_path / "graph.toml"
    graph.write_text(_graph(tiny_qwen3))
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    env = {**os.environ, "FLOW_DATA_DIR": str(tmp_path / "data")}
    process = subprocess.Popen([sys.executable, "-m", "flow.cli", "serve", str(graph), "--port", str(port), "--watch"],
                               env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        def version() -> int:
            response = httpx.get(base + "/health", timeout=5)
            return int(response.json()["graph"]["version"]) if response.status_code == 200 else 0

        assert _until(version) == 1
        # An edit: a second model listing on a new path. The watcher sees it and reloads.
        graph.write_text(_graph(tiny_qwen3, '[stages.models_v2]\ntype = "models.list"\n'
                                            'routes = ["GET /v2/models"]\nexit = "models_v2"\n'))
        _until(lambda: version() == 2)
        listing = httpx.get(base + "/v2/models", timeout=10)
        assert listing.status_code == 200 and listing.json()["data"][0]["id"] == "tiny"
        # SIGHUP reloads the same file again: a new version, the model still loaded once.
        process.send_signal(signal.SIGHUP)
        _until(lambda: version() == 3)
        health = httpx.get(base + "/health", timeout=10).json()
        assert health["models"][0]["loads"] == 1
        # A broken edit: nothing changes, the error is logged as `flow check` prints it.
        graph.write_text(_graph(tiny_qwen3, cache='models = ["modle"]\n'))
        _until(lambda: httpx.get(base + "/health", timeout=5).json()["graph"]["failed_reloads"] == 1)
        assert version() == 3
        assert httpx.get(base + "/v2/models", timeout=10).status_code == 200
        chat = httpx.post(base + "/v1/chat/completions", timeout=60, json={
            "model": "tiny", "max_tokens": 3, "messages": [{"role": "user", "content": "hi"}]})
        assert chat.status_code == 200
    finally:
        process.send_signal(signal.SIGTERM)
        try:
            output, _ = process.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()
            output, _ = process.communicate()
    assert process.returncode == 0, output[-3000:]
    assert "resources.prefix_cache.models[0]: no resource named 'modle'" in output
    assert "reload refused; the running graph is unchanged" in output
