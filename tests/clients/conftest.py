"""Fixtures for running real agent CLIs (Claude Code, Codex, OpenCode) against a test server.

* **The model.** Agent CLIs send whole harnesses: Claude Code's first request is 75-115 KB of JSON
  (system prompt and two dozen tool schemas), Codex's about 40 KB. The tiny models' byte-level BPE
  turns that into 20-67 thousand tokens, so the model here has a 131072-token context. It has a
  single layer: a one-layer model's KV cache depends on the embeddings alone, so chunked prefill
  never runs attention over the whole prompt before the last chunk (measured on the 2-core dev
  machine: a 23k-token Claude Code prompt prefills in 0.3 s with one layer, 11-22 s with two, and
  its 66k-token full prompt takes 6-8 minutes with two).
* **Ending turns.** Random weights almost never emit EOS, and a generation cut off by the length
  limit is an error for Codex (``response.incomplete``) and makes Claude Code ask the model to go on
  (up to three more requests). So the test graph's ``chat.prepare`` stage treats one token in eight
  of the vocabulary as an end-of-turn token, as a real model's EOS: a turn ends after about eight
  tokens, and runs past 256 (``default_max_tokens``) with probability 1e-15.
* **Recording.** Each test talks to the server through :class:`RecordingProxy`, a small
  reverse proxy that keeps every request and response (streams included) for the assertions
  and for the failure report.
* **The CLIs.** Found on ``PATH``, or installed once with npm into ``$FLOW_CACHE_DIR/npm``
  (default ``~/.cache/flow/npm``). Without node/npm, or when the install fails (no registry), the
  tests are skipped with a message saying how to run them.
"""

from __future__ import annotations

import http.server
import json
import os
import shutil
import subprocess
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest

from flow.builtins import compile_tables
from flow.graph.spec import load_tables
from runtime.tiny import TinySpec, ensure_tiny_model
from tests.harness import GRAPHS, RunningServer, running_server

MODEL = "tiny"
AGENT_SPEC = TinySpec(num_layers=1, max_position_embeddings=131072)
STOP_EVERY = 8  # one vocabulary token in STOP_EVERY ends a turn
DEFAULT_MAX_TOKENS = 256

CLIS = {
    "claude": "@anthropic-ai/claude-code",
    "codex": "@openai/codex",
    "opencode": "opencode-ai",
}


# ---------------------------------------------------------------------------------------- server

def _stop_tokens(model_dir: Path) -> list[str]:
    """Every STOP_EVERY-th ordinary token of the model's vocabulary (token strings, as in tokenizer.json)."""
    tokenizer = json.loads((model_dir / "tokenizer.json").read_text(encoding="utf-8"))
    added = {t["content"] for t in tokenizer.get("added_tokens", [])}
    vocab: dict[str, int] = tokenizer["model"]["vocab"]
    return sorted((t for t, i in vocab.items() if i % STOP_EVERY == STOP_EVERY - 1 and t not in added),
                  key=vocab.__getitem__)


@pytest.fixture(scope="session")
def agent_model() -> Path:
    return ensure_tiny_model(AGENT_SPEC)


@pytest.fixture(scope="session")
def agent_server(agent_model: Path) -> Iterator[RunningServer]:
    """The default graph on the long-context one-layer model, with frequent end-of-turn tokens."""
    tables = load_tables(GRAPHS / "default.toml")
    # "claude-*": the README's recipe for Claude Code started plainly (it asks for its own model names).
    tables["resources"]["model"].update(path=str(agent_model), name=MODEL, aliases=["default", "claude-*"],
                                        default_max_tokens=DEFAULT_MAX_TOKENS)
    prepares = [s for s in tables["stages"].values() if s.get("type") == "chat.prepare"]
    assert prepares, "default.toml has no chat.prepare stage"
    for stage in prepares:
        stage["stop_tokens"] = [*stage.get("stop_tokens", []), *_stop_tokens(agent_model)]
    with running_server(compile_tables(tables, "default.toml (agent CLI tests)")) as server:
        yield server


# ---------------------------------------------------------------------------------------- proxy

_HOP_BY_HOP = {"connection", "keep-alive", "proxy-connection", "transfer-encoding", "te", "trailer", "upgrade",
               "content-length", "host", "accept-encoding"}


@dataclass
class Exchange:
    """One request through the proxy and what the server answered."""

    method: str
    path: str
    request_headers: dict[str, str]
    request_body: bytes
    status: int = 0
    response_headers: dict[str, str] = field(default_factory=dict)
    response_body: bytes = b""
    seconds: float = 0.0
    error: str | None = None  # the proxy's own trouble (upstream unreachable, client gone)

    def json(self) -> Any:
        try:
            return json.loads(self.request_body) if self.request_body else None
        except ValueError:
            return None

    def sse_events(self) -> list[tuple[str | None, Any]]:
        """``(event name, data)`` of a text/event-stream response (``data`` parsed as JSON when it is)."""
        events: list[tuple[str | None, Any]] = []
        text = self.response_body.decode("utf-8", errors="replace").replace("\r\n", "\n")
        for block in text.split("\n\n"):
            name, data = None, []
            for line in block.split("\n"):
                if line.startswith("event:"):
                    name = line[6:].strip()
                elif line.startswith("data:"):
                    data.append(line[5:].removeprefix(" "))
            if name is None and not data:
                continue
            raw = "\n".join(data)
            try:
                events.append((name, json.loads(raw)))
            except ValueError:
                events.append((name, raw))
        return events

    def summary(self) -> str:
        body = self.json()
        if isinstance(body, dict):
            shape = ", ".join(f"{k}=<{len(json.dumps(v))} chars>" if isinstance(v, (list, dict)) and len(json.dumps(v)) > 120
                              else f"{k}={json.dumps(v)}" for k, v in body.items())
        else:
            shape = f"<{len(self.request_body)} bytes>"
        return f"{self.method} {self.path} -> {self.status or self.error} ({self.seconds:.1f} s) {{{shape}}}"

    def describe(self) -> str:
        """The whole exchange, for a failure message."""
        headers = "\n".join(f"  {k}: {v}" for k, v in self.request_headers.items()
                            if k.lower() not in ("authorization", "x-api-key"))
        return (f"{self.summary()}\nrequest headers:\n{headers}\n"
                f"response: {self.response_body[:4000].decode('utf-8', errors='replace')}")


class RecordingProxy:
    """A reverse proxy on loopback that forwards to ``upstream`` and records every exchange."""

    def __init__(self, upstream: str) -> None:
        self.upstream = upstream.rstrip("/")
        self.exchanges: list[Exchange] = []
        self._lock = threading.Lock()
        self._client = httpx.Client(timeout=httpx.Timeout(600, connect=10))
        self._httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self._httpd.daemon_threads = True
        self._thread = threading.Thread(target=self._httpd.serve_forever, name="recording-proxy", daemon=True)
        self.base_url = f"http://127.0.0.1:{self._httpd.server_address[1]}"

    def __enter__(self) -> RecordingProxy:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()
        self._client.close()

    def failures(self) -> list[Exchange]:
        return [e for e in self.exchanges if e.error or e.status >= 400]

    def report(self) -> str:
        return "\n".join(e.summary() for e in self.exchanges) or "(no requests reached the server)"

    def save(self, path: Path) -> Path:
        path.write_text(json.dumps([
            {"method": e.method, "path": e.path, "status": e.status, "error": e.error, "seconds": e.seconds,
             "request_headers": e.request_headers, "request_body": e.request_body.decode("utf-8", "replace"),
             "response_headers": e.response_headers, "response_body": e.response_body.decode("utf-8", "replace")}
            for e in self.exchanges], indent=1), encoding="utf-8")
        return path

    def _forward(self, handler: http.server.BaseHTTPRequestHandler) -> None:
        if handler.headers.get("transfer-encoding", "").lower() == "chunked":
            body = b""
            while size := int(handler.rfile.readline().split(b";")[0].strip() or b"0", 16):
                body += handler.rfile.read(size)
                handler.rfile.readline()
            while handler.rfile.readline() not in (b"\r\n", b"\n", b""):
                pass
        else:
            body = handler.rfile.read(int(handler.headers.get("content-length") or 0))
        exchange = Exchange(handler.command, handler.path, dict(handler.headers.items()), body)
        headers = {k: v for k, v in handler.headers.items() if k.lower() not in _HOP_BY_HOP}
        started = time.monotonic()
        try:
            with self._client.stream(handler.command, self.upstream + handler.path, content=body,
                                     headers=headers) as response:
                exchange.status = response.status_code
                exchange.response_headers = dict(response.headers.items())
                handler.send_response(response.status_code)
                for key, value in response.headers.items():
                    if key.lower() not in _HOP_BY_HOP:
                        handler.send_header(key, value)
                handler.send_header("Connection", "close")  # the body ends when the connection does
                handler.end_headers()
                chunks = []
                for chunk in response.iter_raw():
                    chunks.append(chunk)
                    if handler.command != "HEAD":
                        handler.wfile.write(chunk)
                        handler.wfile.flush()
                exchange.response_body = b"".join(chunks)
        except httpx.HTTPError as exc:
            exchange.error = f"upstream: {type(exc).__name__}: {exc}"
            if not exchange.status:
                handler.send_error(502, exchange.error)
        except OSError as exc:  # the client went away mid-response
            exchange.error = f"client: {type(exc).__name__}: {exc}"
        finally:
            exchange.seconds = time.monotonic() - started
            handler.close_connection = True
            with self._lock:
                self.exchanges.append(exchange)

    def _handler(self) -> type[http.server.BaseHTTPRequestHandler]:
        proxy = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, format: str, *args: Any) -> None:
                pass

            def _any(self) -> None:
                proxy._forward(self)

            do_GET = do_POST = do_HEAD = do_PUT = do_DELETE = do_PATCH = do_OPTIONS = _any

        return Handler


@pytest.fixture
def recorder(agent_server: RunningServer, tmp_path: Path) -> Iterator[RecordingProxy]:
    with RecordingProxy(agent_server.base_url) as proxy:
        yield proxy
        proxy.save(tmp_path / "exchanges.json")


# ---------------------------------------------------------------------------------------- CLIs

def cache_dir() -> Path:
    env = os.environ.get("FLOW_CACHE_DIR")
    return Path(env) if env else Path.home() / ".cache" / "flow"


def base_env(home: Path) -> dict[str, str]:
    """The developer's environment without anything that would point a CLI elsewhere.

    Their own API keys and CLI configuration stay out; so does ``LD_PRELOAD`` (the test command
    preloads OpenBLAS for MLX, and node then fails to create its threads).
    """
    env = {k: v for k, v in os.environ.items()
           if k != "LD_PRELOAD" and not k.startswith(("ANTHROPIC_", "CLAUDE_", "OPENAI_", "CODEX_"))}
    home.mkdir(parents=True, exist_ok=True)
    env.update(HOME=str(home), XDG_CONFIG_HOME=str(home / ".config"), XDG_CACHE_HOME=str(home / ".cache"),
               XDG_DATA_HOME=str(home / ".local" / "share"), XDG_STATE_HOME=str(home / ".local" / "state"),
               NO_COLOR="1", TERM="dumb")
    return env


def _how_to_run(binary: str) -> str:
    return (f"To run it: install the CLI (`npm install -g {CLIS[binary]}`) or give the test node, npm and "
            f"access to the npm registry so it can install it into {cache_dir() / 'npm'}; "
            f"deselect these tests with -m 'not agents'.")


def _works(command: list[str]) -> str | None:
    """None when ``command --version`` runs, else what went wrong."""
    try:
        proc = subprocess.run([*command, "--version"], capture_output=True, text=True, timeout=120,
                              stdin=subprocess.DEVNULL, env=base_env(cache_dir() / "npm" / "home"))
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"{type(exc).__name__}: {exc}"
    return None if proc.returncode == 0 else (proc.stdout + proc.stderr).strip()[-500:]


def find_cli(binary: str) -> list[str]:
    """The command that runs ``binary``: from PATH, else from (or installed into) the npm cache dir."""
    on_path = shutil.which(binary)
    if on_path and _works([on_path]) is None:
        return [on_path]
    prefix = cache_dir() / "npm"
    local = prefix / "node_modules" / ".bin" / binary
    if not local.exists():
        npm, node = shutil.which("npm"), shutil.which("node")
        if not npm or not node:
            pytest.skip(f"{binary} is not installed and node/npm are missing. {_how_to_run(binary)}")
        prefix.mkdir(parents=True, exist_ok=True)
        try:
            proc = subprocess.run([npm, "install", "--prefix", str(prefix), "--no-audit", "--no-fund",
                                   "--loglevel=error", CLIS[binary]], capture_output=True, text=True,
                                  timeout=900, stdin=subprocess.DEVNULL, env=base_env(prefix / "home"))
        except (OSError, subprocess.TimeoutExpired) as exc:
            pytest.skip(f"npm install {CLIS[binary]} failed: {exc}. {_how_to_run(binary)}")
        if proc.returncode != 0 or not local.exists():
            pytest.skip(f"npm install {CLIS[binary]} failed: {(proc.stdout + proc.stderr).strip()[-800:]} "
                        f"{_how_to_run(binary)}")
    problem = _works([str(local)])
    package_dir = prefix / "node_modules" / CLIS[binary]
    if problem and (package_dir / "install.cjs").exists() and shutil.which("node"):
        # Claude Code's postinstall puts the native binary in place; npm may have skipped it.
        subprocess.run([shutil.which("node") or "node", "install.cjs"], cwd=package_dir, capture_output=True,
                       timeout=300, stdin=subprocess.DEVNULL, env=base_env(prefix / "home"))
        problem = _works([str(local)])
    if problem:
        pytest.skip(f"{local} does not run: {problem}. {_how_to_run(binary)}")
    return [str(local)]


@pytest.fixture(scope="session")
def claude_cli() -> list[str]:
    return find_cli("claude")


@pytest.fixture(scope="session")
def codex_cli() -> list[str]:
    return find_cli("codex")


@pytest.fixture(scope="session")
def opencode_cli() -> list[str]:
    return find_cli("opencode")
