"""Real agent CLIs against the server: Claude Code (Anthropic Messages) and Codex (OpenAI Responses).

Each test runs the CLI once, non-interactively, with its own throwaway configuration, against a
test server on a tiny random-weight model (its answers are gibberish: these tests check the
protocol, not the quality), through a recording proxy. A failure prints every request the CLI sent
and the server's answer to those that failed; the whole exchange is saved as ``exchanges.json``
in the test's tmp directory.

Deselect with ``-m "not agents"``; see tests/clients/conftest.py for how the CLIs are found or
installed and why the test model looks the way it does.
"""

from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest

from tests.clients.conftest import MODEL, RecordingProxy, base_env
from tests.harness import RunningServer

pytestmark = pytest.mark.agents

PROMPT = "Say hello in one short sentence."
TIMEOUT_S = 240


def run_cli(command: list[str], env: dict[str, str], cwd: Path, proxy: RecordingProxy,
            ) -> tuple[subprocess.CompletedProcess[str], float]:
    started = time.monotonic()
    try:
        proc = subprocess.run(command, env=env, cwd=cwd, capture_output=True, text=True, timeout=TIMEOUT_S,
                              stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired as exc:
        pytest.fail(f"{Path(command[0]).name} did not finish in {TIMEOUT_S} s.\n"
                    f"stdout: {exc.stdout!r:.2000}\nstderr: {exc.stderr!r:.2000}\n"
                    f"requests:\n{proxy.report()}\n{failures(proxy)}")
    return proc, time.monotonic() - started


def failures(proxy: RecordingProxy) -> str:
    failed = proxy.failures()
    if not failed:
        return ""
    return "failed requests:\n" + "\n\n".join(e.describe() for e in failed)


def check_run(name: str, proc: subprocess.CompletedProcess[str], proxy: RecordingProxy) -> None:
    context = (f"\n--- stdout\n{proc.stdout[-3000:]}\n--- stderr\n{proc.stderr[-3000:]}\n"
               f"--- requests\n{proxy.report()}\n{failures(proxy)}")
    assert not proxy.failures(), f"the server rejected or failed requests from {name}:{context}"
    assert proc.returncode == 0, f"{name} exited with {proc.returncode}{context}"


# ------------------------------------------------------------------------------------- Claude Code

def claude_env(base_url: str, tmp: Path) -> dict[str, str]:
    """Claude Code pointed at the server, with every background service it has switched off."""
    env = base_env(tmp / "home")
    env.update(
        ANTHROPIC_BASE_URL=base_url,
        ANTHROPIC_API_KEY="flow-test-key",  # any value: the server has no key configured
        ANTHROPIC_MODEL=MODEL,
        ANTHROPIC_SMALL_FAST_MODEL=MODEL,  # background calls (titles, summaries) go to the server too
        ANTHROPIC_DEFAULT_HAIKU_MODEL=MODEL,
        ANTHROPIC_DEFAULT_SONNET_MODEL=MODEL,
        ANTHROPIC_DEFAULT_OPUS_MODEL=MODEL,
        CLAUDE_CODE_SUBAGENT_MODEL=MODEL,
        CLAUDE_CONFIG_DIR=str(tmp / "claude-config"),
        CLAUDE_CODE_MAX_OUTPUT_TOKENS="32",
        CLAUDE_CODE_MAX_RETRIES="0",  # a failing request fails the run now, not after ten backoffs
        CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC="1",
        CLAUDE_CODE_DISABLE_OFFICIAL_MARKETPLACE_AUTOINSTALL="1",
        CLAUDE_CODE_IDE_SKIP_AUTO_INSTALL="1",
        DISABLE_TELEMETRY="1",
        DISABLE_ERROR_REPORTING="1",
        DISABLE_AUTOUPDATER="1",
        DISABLE_BUG_COMMAND="1",
    )
    return env


def test_claude_code_print(recorder: RecordingProxy, claude_cli: list[str], tmp_path: Path) -> None:
    workdir = tmp_path / "work"
    workdir.mkdir()
    command = [*claude_cli, "-p", PROMPT, "--model", MODEL, "--output-format", "json", "--no-session-persistence"]
    proc, seconds = run_cli(command, claude_env(recorder.base_url, tmp_path), workdir, recorder)
    print(f"claude -p: {seconds:.1f} s, {len(recorder.exchanges)} requests\n{recorder.report()}")
    check_run("claude", proc, recorder)

    result = json.loads(proc.stdout)
    assert result["type"] == "result" and result["is_error"] is False, result
    assert isinstance(result["result"], str)

    messages = [e for e in recorder.exchanges if e.method == "POST" and e.path.split("?")[0] == "/v1/messages"]
    assert messages, f"Claude Code never called /v1/messages:\n{recorder.report()}"
    assert any(e.path == "/v1/messages?beta=true" for e in messages)
    for exchange in messages:
        body: dict[str, Any] = exchange.json()
        assert body["model"] == MODEL
        if body.get("stream"):
            names = [name for name, _ in exchange.sse_events()]
            assert names[0] == "message_start" and names[-1] == "message_stop", names
            assert "error" not in names, exchange.describe()
    first = messages[0].json()
    assert first["tools"], "Claude Code sent no tools: the test would not cover tool definitions"


def test_claude_code_started_plainly(recorder: RecordingProxy, claude_cli: list[str], tmp_path: Path) -> None:
    """The README's recipe: only ANTHROPIC_BASE_URL and a token, no model settings; Claude Code asks for its own
    model names (a main model and a small one for side tasks), which the graph's ``claude-*`` alias answers."""
    workdir = tmp_path / "work"
    workdir.mkdir()
    env = {k: v for k, v in claude_env(recorder.base_url, tmp_path).items()
           if not k.startswith(("ANTHROPIC_MODEL", "ANTHROPIC_SMALL", "ANTHROPIC_DEFAULT", "CLAUDE_CODE_SUBAGENT"))}
    command = [*claude_cli, "-p", PROMPT, "--output-format", "json", "--no-session-persistence"]
    proc, seconds = run_cli(command, env, workdir, recorder)
    print(f"claude -p (plain): {seconds:.1f} s\n{recorder.report()}")
    check_run("claude", proc, recorder)
    assert json.loads(proc.stdout)["is_error"] is False
    models = {e.json()["model"] for e in recorder.exchanges if e.method == "POST" and "/v1/messages" in e.path
              and "count_tokens" not in e.path}
    assert models and all(m.startswith("claude-") for m in models), models


# ------------------------------------------------------------------------------------------- Codex

def codex_config(base_url: str) -> str:
    """``config.toml`` for a flow server as a Responses provider, without Codex's network features."""
    return f"""\
model = "{MODEL}"
model_provider = "flow"
approval_policy = "never"
sandbox_mode = "read-only"
web_search = "disabled"
check_for_update_on_startup = false
model_context_window = 131072

[model_providers.flow]
name = "flow"
base_url = "{base_url}/v1"
wire_api = "responses"
env_key = "FLOW_API_KEY"
request_max_retries = 0
stream_max_retries = 0

[features]
plugins = false
apps = false
remote_plugin = false

[analytics]
enabled = false
"""


def test_codex_exec(recorder: RecordingProxy, codex_cli: list[str], tmp_path: Path) -> None:
    codex_home = tmp_path / "codex-home"
    codex_home.mkdir()
    (codex_home / "config.toml").write_text(codex_config(recorder.base_url), encoding="utf-8")
    workdir = tmp_path / "work"
    workdir.mkdir()
    env = base_env(tmp_path / "home")
    env.update(CODEX_HOME=str(codex_home), FLOW_API_KEY="flow-test-key")
    last = tmp_path / "last-message.txt"
    command = [*codex_cli, "exec", "--skip-git-repo-check", "--sandbox", "read-only", "--ephemeral",
               "--color", "never", "--json", "--output-last-message", str(last), PROMPT]
    proc, seconds = run_cli(command, env, workdir, recorder)
    print(f"codex exec: {seconds:.1f} s, {len(recorder.exchanges)} requests\n{recorder.report()}")
    check_run("codex", proc, recorder)

    events = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    types = [e.get("type") for e in events]
    assert "turn.completed" in types and "turn.failed" not in types, types
    assert last.exists()

    responses = [e for e in recorder.exchanges if e.method == "POST" and e.path == "/v1/responses"]
    assert responses, f"Codex never called /v1/responses:\n{recorder.report()}"
    for exchange in responses:
        body: dict[str, Any] = exchange.json()
        assert body["model"] == MODEL and body.get("stream") is True
        events_ = exchange.sse_events()
        kinds = [data.get("type") for _, data in events_ if isinstance(data, dict)]
        assert kinds[0] == "response.created" and kinds[-1] == "response.completed", kinds
        numbers = [data["sequence_number"] for _, data in events_ if isinstance(data, dict)]
        assert numbers == sorted(numbers) and len(set(numbers)) == len(numbers)
        assert "response.output_item.done" in kinds
    assert responses[0].json()["tools"], "Codex sent no tools: the test would not cover tool definitions"


def test_codex_oss_with_its_ollama_provider(recorder: RecordingProxy, codex_cli: list[str], tmp_path: Path) -> None:
    """``codex --oss --local-provider ollama``, pointed at the server as at an Ollama: it asks /api/version and
    /api/tags (the model is there, so no pull), then runs the turn on /v1/responses."""
    codex_home = tmp_path / "codex-home"
    codex_home.mkdir()
    (codex_home / "config.toml").write_text(
        'approval_policy = "never"\nsandbox_mode = "read-only"\nweb_search = "disabled"\n'
        "check_for_update_on_startup = false\nmodel_context_window = 131072\n\n[analytics]\nenabled = false\n",
        encoding="utf-8")
    workdir = tmp_path / "work"
    workdir.mkdir()
    env = base_env(tmp_path / "home")
    env.update(CODEX_HOME=str(codex_home), CODEX_OSS_BASE_URL=recorder.base_url + "/v1")
    command = [*codex_cli, "exec", "--oss", "--local-provider", "ollama", "-m", MODEL, "--skip-git-repo-check",
               "--sandbox", "read-only", "--ephemeral", "--color", "never", "--json", PROMPT]
    proc, seconds = run_cli(command, env, workdir, recorder)
    print(f"codex --oss: {seconds:.1f} s, {len(recorder.exchanges)} requests\n{recorder.report()}")
    check_run("codex --oss", proc, recorder)
    paths = [(e.method, e.path) for e in recorder.exchanges]
    assert ("GET", "/api/version") in paths and ("GET", "/api/tags") in paths, paths
    assert not any(path == "/api/pull" for _, path in paths), "Codex did not find the model in /api/tags"
    events = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    types = [e.get("type") for e in events]
    assert "turn.completed" in types and "turn.failed" not in types, types
    assert any(path == "/v1/responses" for _, path in paths)


def test_codex_over_the_responses_websocket(agent_server: RunningServer, codex_cli: list[str], tmp_path: Path) -> None:
    """Codex with a provider that offers WebSockets runs its turn over the Responses WebSocket mode (straight to
    the server: the recording proxy speaks HTTP only); the server's request counter shows the route it took."""
    codex_home = tmp_path / "codex-home"
    codex_home.mkdir()
    config = codex_config(agent_server.base_url).replace('wire_api = "responses"\n',
                                                         'wire_api = "responses"\nsupports_websockets = true\n')
    (codex_home / "config.toml").write_text(config, encoding="utf-8")
    workdir = tmp_path / "work"
    workdir.mkdir()
    env = base_env(tmp_path / "home")
    env.update(CODEX_HOME=str(codex_home), FLOW_API_KEY="flow-test-key")
    before = websocket_requests(agent_server)
    command = [*codex_cli, "exec", "--skip-git-repo-check", "--sandbox", "read-only", "--ephemeral",
               "--color", "never", "--json", PROMPT]
    proc = subprocess.run(command, env=env, cwd=workdir, capture_output=True, text=True, timeout=TIMEOUT_S,
                          stdin=subprocess.DEVNULL)
    assert proc.returncode == 0, f"codex exited with {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    events = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    types = [e.get("type") for e in events]
    assert "turn.completed" in types and "turn.failed" not in types, types
    assert websocket_requests(agent_server) > before, "Codex did not use the WebSocket route"


def websocket_requests(server: RunningServer) -> float:
    """Responses answered over the WebSocket route so far (from /metrics)."""
    import httpx

    text = httpx.get(server.base_url + "/metrics", timeout=10).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("flow_requests_total{") and 'route="WEBSOCKET /v1/responses"' in line)
