"""``flow launch``: an agent CLI (Claude Code, Codex, OpenCode) on a flow server, in one command.

Theory of operation:

* **The clients are data.** :data:`CLIENTS` holds, for each, its npm package and program, the protocol it speaks
  best and the flow route that protocol arrives on, the environment variables that point it at flow (templates
  over :class:`Target`'s values), the variables of the user's environment that would send it elsewhere, and the
  files of its configuration directory. One code path reads that table to launch any of them, to print its
  settings (``--print``) and to list them (``flow launch list``).
* **The server.** A flow server already answering on the default address (the default graph's ``[server]`` host
  and port) or on ``--url`` is used when it serves the model asked for (its key: ``$FLOW_API_KEY``, as ``flow
  serve`` reads it). Otherwise launch starts ``flow serve`` with ``--graph``/``--model`` on a free loopback port,
  in its own session (the terminal's Ctrl-C goes to the client, not to it), waits until ``/health`` says it is
  ready, and stops it (SIGTERM: its graceful drain) when the client exits, on every way out of launch (an error,
  Ctrl-C while it loads, SIGTERM or SIGHUP). It is tethered to launch (:mod:`flow.cli.tethered`: the kernel's
  parent-death signal on Linux, a watch on its parent elsewhere), so a launch killed outright (SIGKILL, a test's
  timeout) takes it along too. The model's context window comes from ``/health``.
* **The client's configuration** lives in a directory of its own, ``launch/CLIENT`` in flow's data directory
  (``$FLOW_DATA_DIR``, else ``~/.local/share/flow``; ``--config-dir`` names another), which the client is pointed
  at through its documented variable (``CLAUDE_CONFIG_DIR``, ``CODEX_HOME``, ``OPENCODE_CONFIG``). launch rewrites
  its own files there each time; the client keeps its sessions there, so ``resume`` works from one launch to the
  next. Not a temporary directory: Codex refuses to put its helper programs (``apply_patch``) on PATH from a
  CODEX_HOME under the system's temporary directory. The user's own configuration files are never read or
  written. ``flow serve``'s log, when launch starts one, is ``launch/CLIENT-serve.log`` beside it.
* **The run.** The client runs in the foreground with the arguments after ``--``; launch ignores Ctrl-C while
  it runs (the client decides what Ctrl-C means: Claude Code and Codex cancel a turn), passes SIGTERM and SIGHUP
  on to it, and exits with its status.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import shlex
import shutil
import signal
import socket
import string
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from typing import Any

import httpx

KEY_VARIABLE = "FLOW_API_KEY"  # the variable `flow serve` takes its key from
NO_KEY_TOKEN = "flow"  # what a client that insists on a key sends to a server without one
START_TIMEOUT_S = 1800.0  # a first start may download the model
STOP_TIMEOUT_S = 30.0  # a graceful drain fits inside `docker stop`'s grace period; then SIGKILL
GENERATIVE_KINDS = (None, "text", "vision")  # None: a pooled model not loaded yet, kind still unknown


class LaunchError(Exception):
    """A problem to tell the user in one message (no traceback)."""


# ------------------------------------------------------------------------------------------------ the clients

@dataclass(frozen=True)
class Target:
    """Where a client is pointed and what it is told about the model."""

    url: str  # the server's base URL, without /v1
    model: str  # the id the server serves it under
    key: str | None  # the server's API key (None: it has none)
    context: int | None  # the model's context window in tokens (None: not known, the model is not loaded)
    config: Path  # the client's configuration directory

    @property
    def output(self) -> int | None:
        """The output budget a client may ask for per turn: a quarter of the context, at most 32k. A client that
        asks for more than the context leaves after its prompt gets a context_length_exceeded error from flow."""
        return None if self.context is None else min(32000, self.context // 4)

    def values(self) -> dict[str, Any]:
        """What a client's environment templates may name."""
        return {"url": self.url, "v1": f"{self.url}/v1", "model": self.model, "key": self.key,
                "token": self.key or NO_KEY_TOKEN, "context": self.context, "output": self.output,
                "config": str(self.config)}


@dataclass(frozen=True)
class ConfigFile:
    """A file launch writes in a client's configuration directory."""

    render: Callable[[Target], str]
    seed: bool = False  # the client's own state file: written only where there is none, never replaced


@dataclass(frozen=True)
class Client:
    """An agent CLI and how launch configures it."""

    name: str  # what the user types: flow launch NAME
    title: str
    package: str  # on npm
    binary: str
    protocol: str  # what it speaks to flow, in words
    route: str  # the flow route its turns arrive on
    configured: str  # how launch configures it, in words
    env: Mapping[str, str]  # variables set for it, templates over Target.values(); unknown values leave one out
    unset: tuple[str, ...] = ()  # variables of the user's environment that would send it somewhere else
    files: Mapping[str, ConfigFile] = field(default_factory=dict)

    @property
    def install(self) -> str:
        return f"npm install -g {self.package}"


def _toml_string(value: str) -> str:
    """A TOML basic string (JSON's escapes are TOML's)."""
    return json.dumps(value)


def codex_config(target: Target) -> str:
    """Codex's ``config.toml``: flow as a Responses provider (WebSocket mode, which Codex prefers and flow serves;
    Codex falls back to HTTP where a graph has no WebSocket route), the model's context window, and none of the
    features that reach OpenAI's or GitHub's servers at start."""
    lines = [f"# Written by `flow launch codex` for the flow server at {target.url}.",
             f"model = {_toml_string(target.model)}",
             'model_provider = "flow"',
             "check_for_update_on_startup = false",
             'web_search = "disabled"  # OpenAI\'s hosted search: a local server has none']
    if target.context is not None:  # Codex compacts the conversation before it outgrows the window
        lines += [f"model_context_window = {target.context}",
                  f"model_auto_compact_token_limit = {target.context * 9 // 10}"]
    lines += ["", "[model_providers.flow]", 'name = "flow"', f"base_url = {_toml_string(target.url + '/v1')}",
              'wire_api = "responses"', "supports_websockets = true"]
    if target.key is not None:  # without env_key Codex sends no Authorization header, which a keyless flow takes
        lines.append(f"env_key = {_toml_string(KEY_VARIABLE)}")
    lines += ["", "[features]", "plugins = false", "apps = false", "remote_plugin = false",
              "", "[analytics]", "enabled = false", ""]
    return "\n".join(lines)


def opencode_config(target: Target) -> str:
    """OpenCode's ``opencode.json``: flow as an ``@ai-sdk/openai-compatible`` provider (Chat Completions) with
    the model's context and output limits (a custom model without ``limit`` never compacts), no auto-update, no
    sharing."""
    model: dict[str, Any] = {"name": target.model, "tool_call": True}
    if target.context is not None and target.output is not None:
        model["limit"] = {"context": target.context, "output": target.output}
    options: dict[str, Any] = {"baseURL": f"{target.url}/v1"}
    if target.key is not None:
        options["apiKey"] = "{env:" + KEY_VARIABLE + "}"  # OpenCode's own substitution: the key stays out of the file
    config = {"$schema": "https://opencode.ai/config.json",
              "model": f"flow/{target.model}", "small_model": f"flow/{target.model}",
              "autoupdate": False, "share": "disabled",
              "provider": {"flow": {"npm": "@ai-sdk/openai-compatible", "name": "flow", "options": options,
                                    "models": {target.model: model}}}}
    return json.dumps(config, indent=2) + "\n"


def claude_state(target: Target) -> str:
    """Claude Code's ``.claude.json`` in a new config directory: onboarding marked done. Without it the first run
    in a fresh CLAUDE_CONFIG_DIR asks for a theme and a login, whatever the environment says; no variable or flag
    skips that (anthropics/claude-code#4714). The folder-trust question still comes, as it should."""
    return json.dumps({"hasCompletedOnboarding": True}) + "\n"


_OFF = "1"
CLIENTS: dict[str, Client] = {c.name: c for c in (
    Client(
        name="claude", title="Claude Code", package="@anthropic-ai/claude-code", binary="claude",
        protocol="Anthropic Messages", route="POST /v1/messages",
        configured="environment variables; CLAUDE_CONFIG_DIR",
        env={
            "ANTHROPIC_BASE_URL": "{url}",
            "ANTHROPIC_AUTH_TOKEN": "{token}",  # Authorization: Bearer, which flow takes
            "ANTHROPIC_MODEL": "{model}",
            # Every model slot Claude Code picks from (main, side tasks, subagents) is the one model.
            "ANTHROPIC_DEFAULT_OPUS_MODEL": "{model}",
            "ANTHROPIC_DEFAULT_SONNET_MODEL": "{model}",
            "ANTHROPIC_DEFAULT_HAIKU_MODEL": "{model}",
            "ANTHROPIC_SMALL_FAST_MODEL": "{model}",  # the name Claude Code 1.x read
            "CLAUDE_CODE_SUBAGENT_MODEL": "{model}",
            # The window of a model whose id does not start with "claude-" (else Claude Code assumes 200k and
            # compacts too late); and a per-turn output budget that leaves room for the prompt.
            "CLAUDE_CODE_MAX_CONTEXT_TOKENS": "{context}",
            "CLAUDE_CODE_MAX_OUTPUT_TOKENS": "{output}",
            # A local prefill of Claude Code's ~20k-token prompt can take minutes on a small machine, with no event
            # before the first token: its stream watchdog (5 minutes by default) would cut the stream and send it
            # all again. 30 minutes is the byte watchdog's ceiling; the request timeout matches it.
            "CLAUDE_STREAM_IDLE_TIMEOUT_MS": "1800000",
            "API_TIMEOUT_MS": "1800000",
            "CLAUDE_CONFIG_DIR": "{config}",
            "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": _OFF,
            "DISABLE_TELEMETRY": _OFF,
            "DISABLE_ERROR_REPORTING": _OFF,
            "DISABLE_AUTOUPDATER": _OFF,
            "CLAUDE_CODE_DISABLE_OFFICIAL_MARKETPLACE_AUTOINSTALL": _OFF,
        },
        # An API key would be offered for approval over the token; the cloud switches ignore the base URL.
        unset=("ANTHROPIC_API_KEY", "CLAUDE_CODE_USE_BEDROCK", "CLAUDE_CODE_USE_VERTEX", "CLAUDE_CODE_USE_FOUNDRY"),
        files={".claude.json": ConfigFile(claude_state, seed=True)},
    ),
    Client(
        name="codex", title="Codex", package="@openai/codex", binary="codex",
        protocol="OpenAI Responses over WebSocket", route="WEBSOCKET /v1/responses",
        configured="CODEX_HOME/config.toml (a model provider)",
        env={"CODEX_HOME": "{config}", KEY_VARIABLE: "{key}"},
        files={"config.toml": ConfigFile(codex_config)},
    ),
    Client(
        name="opencode", title="OpenCode", package="opencode-ai", binary="opencode",
        protocol="OpenAI Chat Completions", route="POST /v1/chat/completions",
        configured="OPENCODE_CONFIG=opencode.json (a provider)",
        env={"OPENCODE_CONFIG": "{config}/opencode.json", KEY_VARIABLE: "{key}",
             "OPENCODE_DISABLE_AUTOUPDATE": _OFF,
             "OPENCODE_DISABLE_MODELS_FETCH": _OFF},  # the models.dev catalogue: not needed for a local model
        files={"opencode.json": ConfigFile(opencode_config)},
    ),
)}


def render(template: str, values: Mapping[str, Any]) -> str | None:
    """``template`` with ``values`` filled in; None when it names a value that is not known."""
    names = [name for _, name, _, _ in string.Formatter().parse(template) if name]
    if any(values.get(name) is None for name in names):
        return None
    return template.format_map(values)


def client_settings(client: Client, target: Target) -> dict[str, str]:
    """The variables launch sets for ``client``."""
    values = target.values()
    rendered = {name: render(template, values) for name, template in client.env.items()}
    return {name: value for name, value in rendered.items() if value is not None}


def client_env(client: Client, target: Target, base: Mapping[str, str]) -> dict[str, str]:
    """The client's whole environment: ``base`` less what would send it elsewhere, plus its settings.

    OpenBLAS leaves ``LD_PRELOAD`` (``flow.cli.blas``): node, which the clients run on, fails to start its
    threads with it, so it is taken out (other preloads stay)."""
    env = {k: v for k, v in base.items() if k not in client.unset}
    preload = [p for p in env.get("LD_PRELOAD", "").split(":") if p and "blas" not in p]
    if preload:
        env["LD_PRELOAD"] = ":".join(preload)
    else:
        env.pop("LD_PRELOAD", None)
    env.update(client_settings(client, target))
    return env


def launch_dir() -> Path:
    """``launch`` in flow's data directory: the clients' configuration directories and the servers' logs."""
    from flow.catalog.capabilities import data_dir

    return data_dir() / "launch"


def write_config(client: Client, target: Target) -> None:
    """The client's configuration files in ``target.config`` (a seed file only where none is yet)."""
    from runtime.private_files import private_dir

    private_dir(target.config)  # made 0700 where missing: the client keeps its sessions there
    for name, config_file in client.files.items():
        path = target.config / name
        if config_file.seed and path.exists():
            continue
        path.write_text(config_file.render(target), encoding="utf-8")
        path.chmod(0o600)  # it may name the key's variable and the server; the user's alone


# --------------------------------------------------------------------------------------------- finding clients

def npm_cache_bin() -> Path:
    """Where flow's tests install the CLIs with npm (``$FLOW_CACHE_DIR/npm``, default ``~/.cache/flow/npm``)."""
    root = os.environ.get("FLOW_CACHE_DIR")
    return (Path(root) if root else Path.home() / ".cache" / "flow") / "npm" / "node_modules" / ".bin"


def find_client(client: Client) -> Path | None:
    """The client's program: on PATH, else in flow's npm cache."""
    on_path = shutil.which(client.binary)
    if on_path:
        return Path(on_path)
    cached = npm_cache_bin() / client.binary
    return cached if cached.is_file() and os.access(cached, os.X_OK) else None


def missing_message(client: Client) -> str:
    return (f"flow launch: {client.title} ({client.binary}) is not installed: not on PATH, not in {npm_cache_bin()}.\n"
            f"Install it with:  {client.install}")


def cmd_list() -> int:
    rows = [["CLIENT", "PROGRAM", "SPEAKS", "INSTALLED"]]
    for client in CLIENTS.values():
        found = find_client(client)
        rows.append([client.name, client.title, f"{client.protocol} ({client.route})",
                     str(found) if found else f"no — {client.install}"])
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    for row in rows:
        print("  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip())
    return 0


# ------------------------------------------------------------------------------------------------- the server

@dataclass(frozen=True)
class ServedModel:
    id: str
    aliases: tuple[str, ...]
    kind: str | None
    context: int | None


def default_url(graph: str) -> str:
    """The address ``flow serve GRAPH`` listens on by default: the graph's ``[server]`` host and port."""
    from flow.catalog.bundled import resolve_graph_path
    from flow.graph.spec import SpecError, load_tables

    try:
        server = load_tables(resolve_graph_path(graph)).get("server", {})
    except SpecError:
        server = {}
    host = str(server.get("host", "127.0.0.1"))
    return f"http://{'127.0.0.1' if host in ('0.0.0.0', '::', '') else host}:{int(server.get('port', 8080))}"


def served_models(url: str) -> list[ServedModel] | None:
    """The models a flow server at ``url`` serves (its ``/health``, which needs no key); None when no flow
    server answers there."""
    try:
        health = httpx.get(f"{url}/health", timeout=3).json()
    except (httpx.HTTPError, ValueError):
        return None
    if not isinstance(health, dict) or not isinstance(health.get("models"), list) or "graph" not in health:
        return None  # something else listens there
    return [ServedModel(m["id"], tuple(m.get("aliases", ())), m.get("kind"), m.get("context_length"))
            for m in health["models"] if isinstance(m, dict) and "id" in m]


def pick_model(models: list[ServedModel], wanted: str | None) -> ServedModel | None:
    """The served model ``wanted`` names (an id, an alias, or the path or repo ``flow serve --model`` would serve
    under that id); with none wanted, the first that generates text."""
    if wanted is None:
        return next((m for m in models if m.kind in GENERATIVE_KINDS), None)
    from flow.catalog.local_models import served_name

    names = {wanted, served_name(wanted)}
    return next((m for m in models if m.id in names or names & set(m.aliases)), None)


def check_access(url: str, key: str | None) -> None:
    """A clear message now, rather than the client's own error later, when the server wants another key."""
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    try:
        status = httpx.get(f"{url}/v1/models", headers=headers, timeout=60).status_code
    except httpx.HTTPError as exc:
        raise LaunchError(f"flow launch: the flow server at {url} did not answer: {exc}") from None
    if status in (401, 403):
        raise LaunchError(f"flow launch: the flow server at {url} needs an API key"
                          f"{' other than $' + KEY_VARIABLE if key else ''}: set {KEY_VARIABLE} to the key it "
                          "was started with.")


def model_context(url: str, key: str | None, model: ServedModel) -> int | None:
    """The model's context window: from /health, else from its listing (a pooled model loaded since)."""
    if model.context is not None:
        return model.context
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    try:
        entry = httpx.get(f"{url}/v1/models/{model.id}", headers=headers, timeout=60).json()
    except (httpx.HTTPError, ValueError):
        return None
    value = entry.get("max_input_tokens") if isinstance(entry, dict) else None
    return value if isinstance(value, int) else None


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


@dataclass
class OwnServer:
    """A ``flow serve`` launch started, in its own session, logging to ``log``."""

    process: subprocess.Popen[bytes]
    url: str
    log: Path

    def tail(self, lines: int = 30) -> str:
        try:
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"

    def stop(self) -> None:
        """SIGTERM (flow's graceful drain), then SIGKILL if it has not ended in STOP_TIMEOUT_S."""
        if self.process.poll() is not None:
            return
        self.process.terminate()
        try:
            self.process.wait(STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


def start_server(graph: str, model: str | None, log: Path) -> OwnServer:
    """``flow serve`` on a free loopback port; returns at once (see :func:`wait_ready`).

    Its own session keeps the terminal's Ctrl-C, which is the client's, from reaching it; it is tethered to
    launch (:mod:`flow.cli.tethered`), so it ends with launch however launch ends. Its key is ``$FLOW_API_KEY`` if
    set, as for any ``flow serve``."""
    port = free_port()
    # Tethered to launch (flow.cli.tethered): it gets SIGTERM when launch ends, even by SIGKILL, so a killed launch
    # leaves no server behind; its own session would keep anything else from ending it.
    command = [sys.executable, "-m", "flow.cli.tethered", str(os.getpid()),
               "serve", graph, "--host", "127.0.0.1", "--port", str(port)]
    if model is not None:
        command += ["--model", model]
    from runtime.private_files import private_dir

    private_dir(log.parent)
    print(f"flow launch: starting `flow serve {graph}{' --model ' + model if model else ''}` on 127.0.0.1:{port}; "
          f"its log: {log}", file=sys.stderr)
    with log.open("wb") as out:
        process = subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                                   start_new_session=True)
    return OwnServer(process, f"http://127.0.0.1:{port}", log)


def wait_ready(url: str, server: OwnServer | None = None, timeout: float = START_TIMEOUT_S) -> list[ServedModel]:
    """Poll ``/health`` until the server at ``url`` says ``ok`` (a running server may still be loading its model;
    one launch started is loading it); fail if it reports a model it cannot load, takes longer than ``timeout``,
    or (``server``: one launch started) exits, with the end of its log."""
    where = f"; see {server.log}" if server is not None else ""
    started = said = time.monotonic()
    while True:
        if server is not None and server.process.poll() is not None:
            raise LaunchError(f"flow launch: `flow serve` exited ({server.process.returncode}) before it was "
                              f"ready. The end of its log ({server.log}):\n{server.tail()}")
        try:
            health = httpx.get(f"{url}/health", timeout=10).json()
        except (httpx.HTTPError, ValueError):
            health = None
        status = health.get("status") if isinstance(health, dict) else None
        if status == "ok":
            return served_models(url) or []
        if status == "unavailable":
            log = f" The end of its log ({server.log}):\n{server.tail()}" if server is not None else ""
            raise LaunchError(f"flow launch: the server at {url} cannot serve its model.{log}")
        now = time.monotonic()
        if now - started > timeout:
            raise LaunchError(f"flow launch: the server at {url} was not ready after {timeout:.0f} s{where}")
        if now - said >= 30:
            print(f"flow launch: the server is still starting ({now - started:.0f} s: loading or downloading the "
                  f"model{where})", file=sys.stderr)
            said = now
        time.sleep(0.5)


# ------------------------------------------------------------------------------------------------- a session

@dataclass(frozen=True)
class Options:
    client: Client
    model: str | None
    graph: str
    url: str | None  # --url: this server and no other
    config_dir: Path | None
    client_args: list[str]


def existing_target(options: Options, key: str | None) -> tuple[str, ServedModel] | None:
    """The running server and model to use, or None when launch should start its own."""
    explicit = options.url is not None
    url = (options.url or default_url(options.graph)).rstrip("/")
    if served_models(url) is None:
        if explicit:
            raise LaunchError(f"flow launch: no flow server answers at {url}.")
        return None
    models = wait_ready(url)
    if not explicit and options.graph != "default":
        return None  # a graph was asked for: the one running may be another
    model = pick_model(models, options.model)
    if model is None:
        served = ", ".join(m.id for m in models) or "no models"
        if explicit:
            raise LaunchError(f"flow launch: the server at {url} serves {served}, not {options.model or 'a chat model'}.")
        print(f"flow launch: the server at {url} serves {served}; starting one for {options.model}", file=sys.stderr)
        return None
    check_access(url, key)
    return url, model


@contextlib.contextmanager
def session_target(options: Options) -> Iterator[Target]:
    """The target a client is pointed at, with the server it names running for as long as the block lasts."""
    key = os.environ.get(KEY_VARIABLE) or None
    config = options.config_dir or launch_dir() / options.client.name
    found = existing_target(options, key)
    if found is not None:
        url, model = found
        print(f"flow launch: using the flow server at {url}", file=sys.stderr)
        yield Target(url, model.id, key, model_context(url, key, model), config)
        return
    server = start_server(options.graph, options.model, launch_dir() / f"{options.client.name}-serve.log")
    try:
        models = wait_ready(server.url, server)
        chosen = pick_model(models, options.model) or pick_model(models, None)
        if chosen is None:
            raise LaunchError(f"flow launch: the graph {options.graph!r} serves no chat model.")
        yield Target(server.url, chosen.id, key, model_context(server.url, key, chosen), config)
        if server.process.poll() is not None:
            print(f"flow launch: the server ended while the client ran ({server.process.returncode}). The end of "
                  f"its log:\n{server.tail()}", file=sys.stderr)
    finally:
        server.stop()


class Terminated(Exception):
    """SIGTERM or SIGHUP reached launch before the client ran."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


def _raise_terminated(signum: int, frame: FrameType | None) -> None:
    raise Terminated(signum)


def run_client(command: list[str], env: Mapping[str, str]) -> int:
    """The client in the foreground; its exit status (128 + N when signal N ended it, as a shell says).

    The handlers are in place before the client starts: a SIGTERM or SIGHUP that comes while it is being started
    is kept and passed on once it runs (never lost, and never a client left running by a launch that left), and
    a Ctrl-C from the moment it exists is its own. Ctrl-C gets a handler that does nothing rather than SIG_IGN,
    which the client would inherit."""
    process: subprocess.Popen[bytes] | None = None
    pending: list[int] = []

    def forward(signum: int, frame: FrameType | None) -> None:
        if process is None:
            pending.append(signum)
        else:
            process.send_signal(signum)

    def ignore(signum: int, frame: FrameType | None) -> None:
        """Ctrl-C reaches the client through the terminal's process group; launch stays to stop the server."""

    previous = {sig: signal.signal(sig, handler) for sig, handler in
                ((signal.SIGINT, ignore), (signal.SIGTERM, forward), (signal.SIGHUP, forward))}
    try:
        process = subprocess.Popen(command, env=dict(env))
        for signum in pending:
            process.send_signal(signum)
        code = process.wait()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    return 128 - code if code < 0 else code


def launch(options: Options) -> int:
    binary = find_client(options.client)
    if binary is None:
        print(missing_message(options.client), file=sys.stderr)
        return 127
    previous = {sig: signal.signal(sig, _raise_terminated) for sig in (signal.SIGTERM, signal.SIGHUP)}
    try:
        with session_target(options) as target:
            write_config(options.client, target)
            context = f"{target.context} tokens of context" if target.context else "context window unknown"
            print(f"flow launch: {options.client.title} on {target.model} ({context}) at {target.url}, "
                  f"{options.client.protocol}", file=sys.stderr)
            return run_client([str(binary), *options.client_args], client_env(options.client, target, os.environ))
    except Terminated as exc:
        return 128 + exc.signum
    except KeyboardInterrupt:  # Ctrl-C before the client ran (while the server loads): the server is stopped
        print("flow launch: interrupted", file=sys.stderr)
        return 128 + signal.SIGINT
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


# -------------------------------------------------------------------------------------------------- --print

def print_target(options: Options) -> Target:
    """The target ``--print`` describes: the server at --url or the default address (it must be running: the
    model's id and context come from it), with the configuration directory the user will keep."""
    key = os.environ.get(KEY_VARIABLE) or None
    url = (options.url or default_url(options.graph)).rstrip("/")
    models = served_models(url)
    if models is None:
        model_flag = f" --model {shlex.quote(options.model)}" if options.model else ""
        raise LaunchError(f"flow launch --print: no flow server answers at {url}. Start one first "
                          f"(`flow serve {options.graph}{model_flag}`), or name one with --url.")
    model = pick_model(models, options.model)
    if model is None:
        raise LaunchError(f"flow launch --print: the server at {url} serves {', '.join(m.id for m in models)}, "
                          f"not {options.model or 'a chat model'}.")
    check_access(url, key)
    config = options.config_dir or launch_dir() / options.client.name
    return Target(url, model.id, key, model_context(url, key, model), config.absolute())


def shell_lines(client: Client, target: Target) -> str:
    """The client's settings as lines for a POSIX shell: its files as heredocs, its variables as exports. The
    key is referred to as ``$FLOW_API_KEY``, never printed."""
    config = shlex.quote(str(target.config))
    lines = [f"# {client.title} on flow: {target.model} at {target.url} ({client.protocol}); "
             + (f"context {target.context} tokens" if target.context else "context window unknown"),
             f"mkdir -p {config}"]
    for name, config_file in client.files.items():
        path = shlex.quote(str(target.config / name))
        write = f"cat > {path} <<'EOF'"
        lines.append(f"[ -e {path} ] || {write}" if config_file.seed else write)
        lines += [config_file.render(target).rstrip("\n"), "EOF"]
    lines += [f"unset {name}" for name in client.unset]
    for name, template in client.env.items():
        if name == KEY_VARIABLE:
            continue  # it is already in the user's environment, where the key came from
        value = render(template, {**target.values(), "key": target.key and "$" + KEY_VARIABLE,
                                  "token": f"${KEY_VARIABLE}" if target.key else NO_KEY_TOKEN})
        if value is not None:
            quoted = f'"${KEY_VARIABLE}"' if value == f"${KEY_VARIABLE}" else shlex.quote(value)
            lines.append(f"export {name}={quoted}")
    lines.append(f"# then: {client.binary}")
    return "\n".join(lines) + "\n"


# ------------------------------------------------------------------------------------------------ the command

def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="flow launch",
        description="Run an agent CLI on a flow server: the one running on the default address if it serves the "
                    "model, else one started for the session and stopped after. The client is configured through "
                    "its own environment variables and a configuration directory of its own; your own "
                    "configuration files are left alone. `flow launch list`: which clients are installed.",
        epilog="Arguments after -- go to the client: flow launch claude -- -p 'explain main.py'")
    parser.add_argument("client", choices=[*CLIENTS, "list"], help="the client to run, or list")
    parser.add_argument("--model", help="a model the running server serves (id), or a local directory, GGUF file "
                                        "or Hugging Face repo id for a server started for the session")
    parser.add_argument("--graph", default="default", help="the graph of a server started for the session "
                                                          "(a file or bundled name; default: default)")
    parser.add_argument("--url", help="use the flow server at this URL (and start none)")
    parser.add_argument("--config-dir", type=Path, help="the client's configuration directory, where it keeps its "
                                                        "sessions too (default: launch/CLIENT in flow's data "
                                                        "directory)")
    parser.add_argument("--print", action="store_true", dest="print_only",
                        help="print the settings as shell lines instead of running the client")
    return parser


def split_client_args(argv: list[str]) -> tuple[list[str], list[str]]:
    """launch's own arguments, and the client's: everything after the first ``--``."""
    if "--" in argv:
        cut = argv.index("--")
        return argv[:cut], argv[cut + 1:]
    return argv, []


def main(argv: list[str]) -> int:
    logging.getLogger("httpx").setLevel(logging.WARNING)  # launch's own requests are not the user's business
    own, client_args = split_client_args(argv)
    args = build_parser().parse_args(own)
    if args.client == "list":
        return cmd_list()
    options = Options(CLIENTS[args.client], args.model, args.graph, args.url,
                      args.config_dir.expanduser().absolute() if args.config_dir else None, client_args)
    try:
        if args.print_only:
            sys.stdout.write(shell_lines(options.client, print_target(options)))
            return 0
        return launch(options)
    except LaunchError as exc:
        print(exc, file=sys.stderr)
        return 1


__all__ = ["CLIENTS", "Client", "ConfigFile", "Target", "main"]
