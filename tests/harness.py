"""Test helpers: graphs pointed at tiny local models, and the embedded server."""

from __future__ import annotations

import copy
import json
import socket
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx

from flow.builtins import compile_tables
from flow.graph.compiled import CompiledGraph
from flow.graph.spec import load_tables
from flow.serve.embedded import RunningServer, running_server

GRAPHS = Path(__file__).resolve().parent.parent / "graphs"
WEATHER_TOOLS: list[Any] = [{"type": "function", "function": {
    "name": "get_weather", "description": "Weather for a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
"""One OpenAI function tool, as the tool-call tests declare it."""

__all__ = ["GRAPHS", "RunningServer", "feed_events", "free_port", "graph_with_key", "graph_with_model", "merged",
           "openai_error", "running_server", "serve_process", "tables_with_model", "tables_with_prefix_cache"]


def tables_with_model(model_path: Path | str, *, graph: str = "default.toml", name: str = "tiny",
                      **overrides: Any) -> dict[str, Any]:
    """The named graph file's tables with its model resource pointed at ``model_path`` (to adjust further)."""
    tables = load_tables(GRAPHS / graph)
    tables["resources"]["model"].update(path=str(model_path), name=name, aliases=["default"], **overrides)
    return tables


def tables_with_prefix_cache(model_path: Path | str, directory: Path, block_tokens: int,
                             **cache: Any) -> dict[str, Any]:
    """The default graph's tables with a test model, its prefix cache's disk tier in ``directory``."""
    tables = tables_with_model(model_path)
    tables["resources"]["prefix_cache"].update(directory=str(directory), block_tokens=block_tokens, **cache)
    return tables


def graph_with_model(model_path: Path | str, *, graph: str = "default.toml", name: str = "tiny",
                     **overrides: Any) -> CompiledGraph:
    """The named graph file with its model resource pointed at ``model_path``."""
    return compile_tables(tables_with_model(model_path, graph=graph, name=name, **overrides), f"{graph} (test)")


def graph_with_key(model_path: Path | str, api_key: str, name: str) -> CompiledGraph:
    """The default graph on ``model_path`` with ``server.api_key`` set."""
    tables = tables_with_model(model_path)
    tables["server"] = {"api_key": api_key}
    return compile_tables(tables, name)


def openai_error(response: httpx.Response, status: int = 400) -> dict[str, Any]:
    """The OpenAI-shaped error of a ``status`` response (asserted), with a message and no stack trace."""
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert isinstance(error, dict) and error["message"] and "Traceback" not in error["message"]
    return error


def merged(reading: dict[str, Any], change: dict[str, Any]) -> dict[str, Any]:
    """``reading`` with a ``/stats/events`` change merged in, as the console's script does (``merge`` in
    viz/static/console.js): objects key by key, anything else replaced."""
    out = copy.deepcopy(reading)
    for key, value in change.items():
        old = out.get(key)
        out[key] = merged(old, value) if isinstance(value, dict) and isinstance(old, dict) else copy.deepcopy(value)
    return out


def feed_events(response: httpx.Response) -> Iterator[tuple[str, Any]]:
    """The ``(event, data)`` pairs of a server-sent events response (one ``data:`` line each)."""
    name = "message"
    for line in response.iter_lines():
        if line.startswith("event: "):
            name = line[7:]
        elif line.startswith("data: "):
            yield name, json.loads(line[6:])
            name = "message"


def free_port() -> int:
    """A loopback port nothing listens on now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@contextmanager
def serve_process(command: list[str], *, log: Path, cwd: Path | None = None, env: dict[str, str] | None = None,
                  seconds: float = 120) -> Iterator[tuple[subprocess.Popen[bytes], str]]:
    """A real ``flow serve`` process (``command`` without host and port) on a free loopback port, once its
    ``/health`` says ok; killed at the end if still running. Its output goes to ``log``."""
    port = free_port()
    with log.open("ab") as out:
        proc = subprocess.Popen([*command, "--host", "127.0.0.1", "--port", str(port)], cwd=cwd, env=env,
                                stdout=out, stderr=out)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + seconds
        while True:
            assert proc.poll() is None, f"flow serve exited {proc.returncode}:\n{log.read_text()[-3000:]}"
            assert time.monotonic() < deadline, f"flow serve did not start:\n{log.read_text()[-3000:]}"
            try:
                if httpx.get(base + "/health", timeout=5).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        yield proc, base
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(30)
