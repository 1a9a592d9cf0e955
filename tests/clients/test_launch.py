"""``flow launch``: the real CLIs through it, its settings, its list, its server's life.

* **The real CLIs** (marker ``agents``; found or installed by tests/clients/conftest.py, skipped with the reason
  where npm cannot install them) run once each, non-interactively, through ``flow launch CLIENT -- ARGS`` against
  the session's test server (``--url``), and once against a server launch starts itself from the tiny model's
  directory. Each run has HOME, the XDG directories, TMPDIR and flow's data directory in the test's tmp
  directory; the test checks that the client exited 0, that its turns reached flow on the route of the protocol
  launch chose for it (``/stats``' recent requests; Codex's WebSocket turns are counted in ``/metrics`` only),
  and that the real home's client configuration is as it was.
* **A stand-in client** (a shell script named ``codex`` that records its arguments and environment, then sleeps)
  shows what launch hands a client and that the server it started goes when the client is stopped by Ctrl-C or
  launch by SIGTERM.
* **``--print`` and ``list``** are checked as text, and the printed lines are run by a shell.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

import httpx
import pytest

from flow.cli import launch
from flow.cli.launch import CLIENTS, Target
from tests.clients.conftest import MODEL, _stop_tokens, base_env
from tests.harness import GRAPHS, RunningServer

PROMPT = "Say hello in one short sentence."
TIMEOUT_S = 300
CODEX_EXEC = ["exec", "--skip-git-repo-check", "--sandbox", "read-only", "--ephemeral", "--color", "never", "--json"]


# ------------------------------------------------------------------------------------------------- helpers

def launch_env(tmp: Path, cli: list[str] | None = None) -> dict[str, str]:
    """The environment launch runs in: everything the user owns moved into ``tmp``; the CLI's directory on PATH."""
    env = base_env(tmp / "home")
    env.update(FLOW_DATA_DIR=str(tmp / "data"), TMPDIR=str(tmp / "tmp"), FLOW_CACHE_DIR=str(tmp / "cache"))
    env.pop(launch.KEY_VARIABLE, None)
    (tmp / "tmp").mkdir(exist_ok=True)
    if cli is not None:
        env["PATH"] = f"{Path(cli[0]).parent}{os.pathsep}{env['PATH']}"
    return env


def run_launch(args: list[str], env: dict[str, str], cwd: Path) -> subprocess.CompletedProcess[str]:
    """launch to its end, in a session of its own: past TIMEOUT_S (a hang guard) the whole session is killed, the
    client with launch, so no client is left holding the output pipes (its server goes with launch: tethered)."""
    command = [sys.executable, "-m", "flow.cli", "launch", *args]
    with subprocess.Popen(command, env=env, cwd=cwd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE, text=True, start_new_session=True) as process:
        try:
            out, err = process.communicate(timeout=TIMEOUT_S)
        except subprocess.TimeoutExpired:
            kill_session(process)
            out, err = process.communicate()
            pytest.fail(f"flow launch {' '.join(args[:1])} did not finish in {TIMEOUT_S} s.\n"
                        f"stdout: {out[-3000:]}\nstderr: {err[-3000:]}")
    return subprocess.CompletedProcess(command, process.returncode, out, err)


def kill_session(process: subprocess.Popen[str]) -> None:
    """SIGKILL to the process group ``process`` leads (started with ``start_new_session``), if any of it is left."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGKILL)


def described(proc: subprocess.CompletedProcess[str]) -> str:
    return f"\n--- stdout\n{proc.stdout[-3000:]}\n--- stderr\n{proc.stderr[-3000:]}"


def recent_requests(url: str) -> list[dict[str, Any]]:
    recent: list[dict[str, Any]] = httpx.get(f"{url}/stats", timeout=10).json()["recent_requests"]
    return recent


def route_counts(url: str) -> Counter[str]:
    """Requests answered so far by route (``flow_requests_total`` in /metrics), WebSocket routes included."""
    counts: Counter[str] = Counter()
    for line in httpx.get(f"{url}/metrics", timeout=10).text.splitlines():
        found = re.match(r'flow_requests_total\{route="([^"]+)",.*\} ([0-9.e+]+)$', line)
        if found:
            counts[found.group(1)] += int(float(found.group(2)))
    return counts


CLIENT_STATE = (".claude", ".claude.json", ".codex", ".config/opencode", ".local/share/opencode",
                ".local/state/opencode", ".cache/opencode", ".local/share/flow/launch")


def home_snapshot(home: Path) -> dict[str, tuple[int, int]]:
    """Every file of the clients' own configuration and state in ``home``: size and mtime."""
    files: dict[str, tuple[int, int]] = {}
    for name in CLIENT_STATE:
        root = home / name
        paths = [root] if root.is_file() else list(root.rglob("*")) if root.is_dir() else []
        for path in paths:
            with_stat = path.lstat()
            files[str(path)] = (with_stat.st_size, with_stat.st_mtime_ns)
    return files


@pytest.fixture
def real_home_untouched() -> Iterator[None]:
    """The developer's own client configuration is the same after the test as before."""
    home = Path.home()
    before = home_snapshot(home)
    yield
    after = home_snapshot(home)
    changed = sorted(set(before.items()) ^ set(after.items()))
    assert not changed, f"files of the real home changed: {changed[:20]}"


def server_processes(port: int) -> list[str]:
    """``flow serve`` processes listening on ``port`` (from ps, as on macOS): ``python -m flow.cli serve …`` or,
    before its OpenBLAS re-exec, ``python -m flow.cli.tethered PID serve …``."""
    listing = subprocess.run(["ps", "-A", "-ww", "-o", "pid,args"], capture_output=True, text=True, check=True).stdout
    return [line for line in listing.splitlines()
            if "-m flow.cli" in line and " serve " in line and re.search(rf"--port {port}( |$)", line)]


def servers_gone(port: int, within: float) -> list[str]:
    """The ``flow serve`` processes on ``port`` still there after up to ``within`` seconds (a hang guard)."""
    deadline = time.monotonic() + within
    while (left := server_processes(port)) and time.monotonic() < deadline:
        time.sleep(0.5)
    return left


def kill_servers(port: int) -> None:
    """What a failed test would leave: the servers on ``port``, killed."""
    for line in server_processes(port):
        with contextlib.suppress(ProcessLookupError):
            os.kill(int(line.split()[0]), signal.SIGKILL)


def started_port(stderr: str) -> int:
    found = re.search(r"on 127\.0\.0\.1:(\d+); its log", stderr)
    assert found, f"launch did not say where it started its server:\n{stderr[-2000:]}"
    return int(found.group(1))


def check_session(client: str, proc: subprocess.CompletedProcess[str], tmp: Path) -> None:
    """The client exited 0; launch's files are in the tmp data directory; launch left nothing in TMPDIR."""
    assert proc.returncode == 0, f"flow launch {client} exited with {proc.returncode}{described(proc)}"
    config = tmp / "data" / "launch" / client
    for name in CLIENTS[client].files:
        assert (config / name).is_file(), f"no {name} in {config}{described(proc)}"
    assert not list((tmp / "tmp").glob("flow-launch-*")), list((tmp / "tmp").iterdir())


# --------------------------------------------------------------------------------------- the real CLIs

def new_requests(url: str, before: list[dict[str, Any]]) -> list[dict[str, Any]]:
    seen = {r["id"] for r in before}
    return [r for r in recent_requests(url) if r["id"] not in seen]


@pytest.mark.agents
def test_launch_claude_on_the_running_server(agent_server: RunningServer, claude_cli: list[str], tmp_path: Path,
                                             real_home_untouched: None) -> None:
    before = recent_requests(agent_server.base_url)
    proc = run_launch(["claude", "--url", agent_server.base_url, "--", "-p", PROMPT, "--output-format", "json"],
                      launch_env(tmp_path, claude_cli), tmp_path)
    check_session("claude", proc, tmp_path)
    result = json.loads(proc.stdout)
    assert result["is_error"] is False, result
    # Claude Code read the model's window from launch (CLAUDE_CODE_MAX_CONTEXT_TOKENS), not its 200k default.
    assert result["modelUsage"][MODEL]["contextWindow"] == 131072, result["modelUsage"]
    turns = [r for r in new_requests(agent_server.base_url, before) if r["route"] == "POST /v1/messages"]
    assert turns and all(r["model"] == MODEL and r["status"] == 200 for r in turns), turns


@pytest.mark.agents
def test_launch_codex_on_the_running_server(agent_server: RunningServer, codex_cli: list[str], tmp_path: Path,
                                            real_home_untouched: None) -> None:
    before = route_counts(agent_server.base_url)
    proc = run_launch(["codex", "--url", agent_server.base_url, "--", *CODEX_EXEC, PROMPT],
                      launch_env(tmp_path, codex_cli), tmp_path)
    check_session("codex", proc, tmp_path)
    types = [json.loads(line).get("type") for line in proc.stdout.splitlines() if line.startswith("{")]
    assert "turn.completed" in types and "turn.failed" not in types, types + [described(proc)]
    assert "could not create PATH aliases" not in proc.stderr, proc.stderr  # a CODEX_HOME outside TMPDIR
    grown = route_counts(agent_server.base_url) - before
    assert grown["WEBSOCKET /v1/responses"] >= 1, f"Codex did not use the Responses WebSocket: {grown}"
    assert grown["POST /v1/responses"] == 0, grown


@pytest.mark.agents
def test_launch_opencode_on_the_running_server(agent_server: RunningServer, opencode_cli: list[str],
                                               tmp_path: Path, real_home_untouched: None) -> None:
    before = recent_requests(agent_server.base_url)
    proc = run_launch(["opencode", "--url", agent_server.base_url, "--", "run", PROMPT],
                      launch_env(tmp_path, opencode_cli), tmp_path)
    check_session("opencode", proc, tmp_path)
    turns = [r for r in new_requests(agent_server.base_url, before) if r["route"] == "POST /v1/chat/completions"]
    assert turns and all(r["model"] == MODEL and r["status"] == 200 for r in turns), turns + [described(proc)]
    config = json.loads((tmp_path / "data" / "launch" / "opencode" / "opencode.json").read_text())
    assert config["provider"]["flow"]["models"][MODEL]["limit"]["context"] == 131072


def agent_graph(model_dir: Path, path: Path) -> Path:
    """A graph file on the default one with the agent tests' end-of-turn tokens (see conftest: random weights
    would otherwise write until the length limit), for a server launch starts itself."""
    default = GRAPHS / "default.toml"
    stops = [*tomllib.loads(default.read_text())["stages"]["prepare"].get("stop_tokens", []), *_stop_tokens(model_dir)]
    path.write_text(f"extends = {json.dumps(str(default))}\n\n[resources.model]\ndefault_max_tokens = 256\n\n"
                    f"[stages.prepare]\nstop_tokens = [{', '.join(json.dumps(t) for t in stops)}]\n", encoding="utf-8")
    return path


@pytest.mark.agents
def test_launch_starts_a_server_and_stops_it(agent_model: Path, codex_cli: list[str], tmp_path: Path,
                                             real_home_untouched: None) -> None:
    graph = agent_graph(agent_model, tmp_path / "agent.toml")
    proc = run_launch(["codex", "--graph", str(graph), "--model", str(agent_model), "--", *CODEX_EXEC, PROMPT],
                      launch_env(tmp_path, codex_cli), tmp_path)
    check_session("codex", proc, tmp_path)
    types = [json.loads(line).get("type") for line in proc.stdout.splitlines() if line.startswith("{")]
    assert "turn.completed" in types and "turn.failed" not in types, types + [described(proc)]
    port = started_port(proc.stderr)
    config = tomllib.loads((tmp_path / "data" / "launch" / "codex" / "config.toml").read_text())
    assert config["model_providers"]["flow"]["base_url"] == f"http://127.0.0.1:{port}/v1"
    assert config["model"] == agent_model.name and config["model_context_window"] == 131072
    # The turn was prefilled by that server: its prefix cache kept the prompt's blocks in the tmp data directory.
    assert list((tmp_path / "data" / "kv-cache" / "blocks").rglob("*.safetensors"))
    assert "received SIGTERM" in (tmp_path / "data" / "launch" / "codex-serve.log").read_text()
    assert not server_processes(port), server_processes(port)


# -------------------------------------------------------------------------------- a stand-in client

HANG_GUARD_S = 600  # the longest a step may take on a loaded machine before the test calls it a hang


def fake_client(tmp: Path) -> Path:
    """A ``codex`` that writes its arguments and environment to ``seen.json`` (whole: written beside it, then
    renamed) and then sleeps."""
    bin_dir = tmp / "bin"
    bin_dir.mkdir()
    script = bin_dir / "codex"
    seen = tmp / "seen.json"
    script.write_text(f"#!{sys.executable}\nimport json, os, sys, time\n"
                      f"open({str(seen) + '.part'!r}, 'w').write(json.dumps({{'args': sys.argv[1:], "
                      "'env': dict(os.environ)}))\n"
                      f"os.replace({str(seen) + '.part'!r}, {str(seen)!r})\ntime.sleep(3600)\n", encoding="utf-8")
    script.chmod(0o755)
    return script


def start_launch(args: list[str], env: dict[str, str], tmp: Path) -> tuple[subprocess.Popen[str], int, dict[str, Any]]:
    """launch in a session of its own (its own process group, as in a terminal), once its client runs: the
    process, its server's port, what the client saw. Its output goes to files (``launch.out``, ``launch.err``)."""
    with (tmp / "launch.out").open("w") as out, (tmp / "launch.err").open("w") as err:
        process = subprocess.Popen([sys.executable, "-m", "flow.cli", "launch", *args], env=env, cwd=tmp,
                                   stdin=subprocess.DEVNULL, stdout=out, stderr=err, text=True, start_new_session=True)
    seen = tmp / "seen.json"
    deadline = time.monotonic() + HANG_GUARD_S  # the server loads its model first
    while not seen.exists():
        if process.poll() is not None or time.monotonic() > deadline:
            kill_session(process)
            process.wait()
            pytest.fail(f"the client never started ({process.returncode})\n{launch_output(tmp)}")
        time.sleep(0.2)
    return process, started_port((tmp / "launch.err").read_text()), json.loads(seen.read_text())


def launch_output(tmp: Path) -> str:
    return "".join(f"\n--- {name}\n{(tmp / name).read_text()[-3000:]}" for name in ("launch.out", "launch.err"))


@pytest.mark.parametrize("how", ["ctrl-c", "sigterm", "sighup", "sigkill"])
def test_the_started_server_goes_with_the_client(how: str, agent_model: Path, tmp_path: Path) -> None:
    """Ctrl-C (SIGINT to the terminal's process group) ends the client, not launch, which then stops its server;
    SIGTERM or SIGHUP to launch is passed to the client, and the server goes too; launch killed outright (SIGKILL:
    no handler, no clean-up) takes its server along all the same (it is tethered). What the client was handed is
    checked on the way: its arguments, CODEX_HOME with the config naming the started server, no OpenBLAS preload.
    No timing is assumed: each wait is a hang guard."""
    fake_client(tmp_path)
    env = launch_env(tmp_path)
    env["PATH"] = f"{tmp_path / 'bin'}{os.pathsep}{env['PATH']}"
    env["LD_PRELOAD"] = "/usr/lib/libopenblas.so.0"  # as `eval "$(python -m flow.cli.blas)"` leaves it
    process, port, seen = start_launch(["codex", "--model", str(agent_model), "--", "resume", "--last"],
                                       env, tmp_path)
    try:
        assert server_processes(port), f"no server on port {port}, where launch said it started one"
        assert seen["args"] == ["resume", "--last"]
        assert seen["env"]["CODEX_HOME"] == str(tmp_path / "data" / "launch" / "codex")
        assert "LD_PRELOAD" not in seen["env"]
        config = tomllib.loads((tmp_path / "data" / "launch" / "codex" / "config.toml").read_text())
        assert config["model_providers"]["flow"]["base_url"] == f"http://127.0.0.1:{port}/v1"
        assert config["model"] == agent_model.name
        sent = {"ctrl-c": signal.SIGINT, "sigterm": signal.SIGTERM, "sighup": signal.SIGHUP,
                "sigkill": signal.SIGKILL}[how]
        if how == "ctrl-c":
            os.killpg(process.pid, sent)  # the terminal sends it to the foreground group: launch and its client
        else:
            process.send_signal(sent)
        try:
            code = process.wait(HANG_GUARD_S)  # launch stops its server (a drain, then SIGKILL) before it exits
        except subprocess.TimeoutExpired:
            pytest.fail(f"flow launch did not exit in {HANG_GUARD_S} s after {how}{launch_output(tmp_path)}")
        expected = -signal.SIGKILL if how == "sigkill" else 128 + sent
        assert code == expected, f"exit status {code}, not {expected}{launch_output(tmp_path)}"
        # A launch that exited has stopped its server already; a killed one's server gets SIGTERM and drains.
        left = servers_gone(port, 0 if how != "sigkill" else HANG_GUARD_S)
        assert not left, f"the server outlived launch ({how}): {left}"
        if how == "sigkill":
            assert "received SIGTERM" in (tmp_path / "data" / "launch" / "codex-serve.log").read_text()
    finally:
        kill_session(process)  # the client too, which a killed launch leaves
        process.wait()
        kill_servers(port)


def test_a_missing_client_says_how_to_install_it(tmp_path: Path) -> None:
    env = launch_env(tmp_path)
    env["PATH"] = str(Path(sys.executable).parent)  # python, and no agent CLI
    proc = run_launch(["opencode"], env, tmp_path)
    assert proc.returncode == 127, described(proc)
    assert "npm install -g opencode-ai" in proc.stderr and "not installed" in proc.stderr, proc.stderr


# ------------------------------------------------------------------------------------------- list, --print

def test_list_shows_what_is_installed_and_how_to_install_the_rest(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                  capsys: pytest.CaptureFixture[str]) -> None:
    fake = fake_client(tmp_path)
    monkeypatch.setenv("PATH", str(fake.parent))
    monkeypatch.setenv("FLOW_CACHE_DIR", str(tmp_path / "cache"))
    assert launch.main(["list"]) == 0
    rows = {line.split()[0]: line for line in capsys.readouterr().out.splitlines()[1:]}
    assert set(rows) == {"claude", "codex", "opencode"}
    assert str(fake) in rows["codex"] and "Responses" in rows["codex"]
    assert "npm install -g @anthropic-ai/claude-code" in rows["claude"]
    assert "npm install -g opencode-ai" in rows["opencode"]


def target(tmp: Path, *, key: str | None = None, context: int | None = 32768) -> Target:
    return Target("http://127.0.0.1:8080", "qwen2.5-coder-0.5b-instruct", key, context, tmp / "cfg")


def test_codex_config_is_a_responses_provider_with_the_window(tmp_path: Path) -> None:
    config = tomllib.loads(launch.codex_config(target(tmp_path, key="k")))
    provider = config["model_providers"][config["model_provider"]]
    assert provider["base_url"] == "http://127.0.0.1:8080/v1" and provider["wire_api"] == "responses"
    assert provider["env_key"] == "FLOW_API_KEY" and provider["supports_websockets"] is True
    assert config["model"] == "qwen2.5-coder-0.5b-instruct"
    assert config["model_context_window"] == 32768 and config["model_auto_compact_token_limit"] < 32768
    assert config["analytics"]["enabled"] is False and config["check_for_update_on_startup"] is False
    keyless = tomllib.loads(launch.codex_config(target(tmp_path, context=None)))
    assert "env_key" not in keyless["model_providers"]["flow"] and "model_context_window" not in keyless


def test_opencode_config_is_an_openai_compatible_provider_with_limits(tmp_path: Path) -> None:
    config = json.loads(launch.opencode_config(target(tmp_path, key="k")))
    provider = config["provider"]["flow"]
    assert provider["npm"] == "@ai-sdk/openai-compatible"
    assert provider["options"] == {"baseURL": "http://127.0.0.1:8080/v1", "apiKey": "{env:FLOW_API_KEY}"}
    assert provider["models"]["qwen2.5-coder-0.5b-instruct"]["limit"] == {"context": 32768, "output": 8192}
    assert config["model"] == "flow/qwen2.5-coder-0.5b-instruct" and config["autoupdate"] is False
    assert "limit" not in json.loads(launch.opencode_config(target(tmp_path, context=None)))["provider"]["flow"][
        "models"]["qwen2.5-coder-0.5b-instruct"]


def test_claude_settings_leave_out_what_is_not_known_and_what_would_send_it_elsewhere(tmp_path: Path) -> None:
    claude = CLIENTS["claude"]
    base = {"ANTHROPIC_API_KEY": "sk-real", "CLAUDE_CODE_USE_BEDROCK": "1", "PATH": "/bin",
            "LD_PRELOAD": "/x/libjemalloc.so:/usr/lib/libopenblas.so.0"}
    env = launch.client_env(claude, target(tmp_path, context=None), base)
    assert "ANTHROPIC_API_KEY" not in env and "CLAUDE_CODE_USE_BEDROCK" not in env
    assert env["LD_PRELOAD"] == "/x/libjemalloc.so"  # OpenBLAS out, the rest kept
    assert env["ANTHROPIC_AUTH_TOKEN"] == launch.NO_KEY_TOKEN and env["ANTHROPIC_MODEL"] == "qwen2.5-coder-0.5b-instruct"
    assert "CLAUDE_CODE_MAX_CONTEXT_TOKENS" not in env and "CLAUDE_CODE_MAX_OUTPUT_TOKENS" not in env
    env = launch.client_env(claude, target(tmp_path, key="k"), base)
    assert env["ANTHROPIC_AUTH_TOKEN"] == "k" and env["CLAUDE_CODE_MAX_CONTEXT_TOKENS"] == "32768"
    assert env["CLAUDE_CONFIG_DIR"] == str(tmp_path / "cfg")


def test_the_seed_file_is_never_replaced(tmp_path: Path) -> None:
    claude = CLIENTS["claude"]
    launch.write_config(claude, target(tmp_path))
    state = tmp_path / "cfg" / ".claude.json"
    assert json.loads(state.read_text()) == {"hasCompletedOnboarding": True}
    state.write_text('{"hasCompletedOnboarding": true, "projects": {}}')  # Claude Code's own state since
    launch.write_config(claude, target(tmp_path))
    assert "projects" in state.read_text()


@pytest.mark.parametrize("client", sorted(CLIENTS))
def test_printed_lines_set_up_the_client_in_a_shell(client: str, tmp_path: Path) -> None:
    """``--print``'s lines, run by sh, write the configuration files and set the variables launch would; the
    key is referred to as $FLOW_API_KEY, never printed."""
    settings = target(tmp_path, key="secret-key")
    lines = launch.shell_lines(CLIENTS[client], settings)
    assert "secret-key" not in lines
    shell = subprocess.run(["sh", "-c", lines + "env"], env={"PATH": os.environ["PATH"], "FLOW_API_KEY": "secret-key",
                                                           "ANTHROPIC_API_KEY": "sk-real"},
                           capture_output=True, text=True, check=True)
    env = dict(line.split("=", 1) for line in shell.stdout.splitlines() if "=" in line)
    expected = launch.client_env(CLIENTS[client], settings, {"FLOW_API_KEY": "secret-key"})
    assert {k: env.get(k) for k in expected} == expected
    assert "ANTHROPIC_API_KEY" not in env or client != "claude"
    for name, config_file in CLIENTS[client].files.items():
        assert (settings.config / name).read_text() == config_file.render(settings)


def test_print_against_the_running_server(agent_server: RunningServer, tmp_path: Path,
                                          monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """The model's id and window come from the server; nothing is written, not even the configuration directory."""
    monkeypatch.setenv("FLOW_DATA_DIR", str(tmp_path / "data"))
    monkeypatch.delenv("FLOW_API_KEY", raising=False)
    assert launch.main(["--print", "codex", "--url", agent_server.base_url]) == 0
    out = capsys.readouterr().out
    assert f'model = "{MODEL}"' in out and "model_context_window = 131072" in out
    assert f"export CODEX_HOME={tmp_path / 'data' / 'launch' / 'codex'}" in out
    assert not (tmp_path / "data").exists()
    assert launch.main(["--print", "claude", "--url", agent_server.base_url, "--model", "no-such-model"]) == 1
    assert "serves tiny" in capsys.readouterr().err


def test_client_args_are_what_follows_the_double_dash() -> None:
    assert launch.split_client_args(["codex", "--model", "m", "--", "exec", "--", "x"]) == (
        ["codex", "--model", "m"], ["exec", "--", "x"])
    assert launch.split_client_args(["--print", "claude"]) == (["--print", "claude"], [])


def test_a_model_is_found_by_id_alias_or_the_path_it_is_served_from() -> None:
    models = [launch.ServedModel("embed", (), "embeddings", None),
              launch.ServedModel("qwen2.5-coder-0.5b-instruct", ("default", "claude-*"), "text", 32768)]
    assert launch.pick_model(models, None) is models[1]  # the first that generates text
    assert launch.pick_model(models, "default") is models[1]
    assert launch.pick_model(models, "/models/qwen2.5-coder-0.5b-instruct/") is models[1]
    assert launch.pick_model(models, "other") is None
