"""Soak: mixed valid and invalid traffic at 16 concurrent clients, with a ``kill -9`` and restart every 5 minutes.

Run (OpenBLAS preloaded first, as the test script does)::

    eval "$(.venv/bin/python -m flow.cli.blas)"
    .venv/bin/python scripts/soak.py --compare --json soak.json                  # 2 × 20 minutes, tiny:bench-80m
    .venv/bin/python scripts/soak.py --model tiny-qwen3 --minutes 1 --restart-every 25 --compare   # a quick look

The script starts ``flow serve`` itself (``python -m flow.cli serve``) on a graph
that extends ``graphs/default.toml`` with the model, and ``FLOW_DATA_DIR`` in a
temporary directory, so ``agents.sqlite``, the response store and the KV disk
tier persist across the restarts of one run (each run starts empty).

``--clients`` workers (trio tasks, one ``httpx`` client per server lifetime)
loop without pause over a mix:

* **valid** requests across the protocols, small ``max_tokens``: OpenAI chat
  (streaming and not, sampling fields, in-vocabulary ``logit_bias``), Responses
  with ``store: true`` in ``previous_response_id`` chains (streaming and not),
  legacy completions (text and token-id prompts), Anthropic Messages (streaming
  and not), ``count_tokens``, and the agents API (create, then turns, streaming
  and not);
* **invalid** ones, a share ``--invalid-share`` of all (0.3; 0 is the baseline
  run): malformed JSON, wrong types, out-of-range sampling values, ``logit_bias``
  outside the vocabulary, huge bodies within the body cap, wrong content types,
  unknown routes and methods, missing fields, deep nesting, lone surrogates and
  invalid UTF-8, bad tools, unknown ids, bad turns on the worker's own agent.

Every ``--restart-every`` seconds the server gets ``SIGKILL`` and is started
again on the same data directory; the workers wait while it is down. Requests
cut by the kill are "connection errors during restarts", not failures. A server
that dies by itself is a crash, restarted the same way and reported.

**Acknowledged writes**: an agent the server answered 2xx on creation, every
agent turn whose answer the client received completely (its assistant text),
every Responses id returned with ``store: true``. After each restart and at the
end (on the live server, then once more after a last ``kill -9`` and restart)
every acknowledged write is checked: ``GET /v1/agents/{id}`` must hold the
acknowledged turns in order with the same assistant text, ``GET
/v1/responses/{id}`` must return the response with the same text. The check also
counts *phantom* turns: user messages in a history from turns the server
refused with an error. Goals: 0 lost, 0 phantom, 0 5xx.

Report: requests served by status class (valid and invalid apart), 5xx, error
events inside 200 streams, connection errors during restarts and elsewhere,
timeouts, crashes, p50/p95 latency of valid requests (complete 2xx answers), the
server's RSS (``VmRSS``) after warm-up and at the end of each lifetime, writes
made and lost, per-kind counts, and the first 5xx bodies with their requests.
``--compare`` runs the baseline (invalid share 0) and the mixed run one after
the other, same duration and restart schedule, and gives the p95 ratio.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import trio

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from flow.cli.bench import report  # noqa: E402
from scripts.bench_concurrency import free_port  # noqa: E402

WORDS = ("lamp fog boat log storm gull cat lens tide radio paint stair winter visitor keeper harbour rope bell "
         "signal rock wave light night shore bottle message map chart wind rain salt").split()
AGENT_TURNS = 6        # turns per agent before a worker starts a new one
CHAIN_LENGTH = 5       # Responses per previous_response_id chain
EXAMPLES = 8           # examples kept per list (5xx bodies, refusals, lost writes)


# --------------------------------------------------------------------------- records

@dataclass
class Outcome:
    kind: str
    valid: bool
    lifetime: int
    started: float
    ended: float
    status: int | None = None        # None: no HTTP answer (connection error, timeout)
    error: str = ""                  # the connection error or timeout
    timeout: bool = False
    stream_error: str | None = None  # an error event inside a 200 stream: its type/code
    complete: bool = False           # a valid request's answer arrived whole

    @property
    def seconds(self) -> float:
        return self.ended - self.started


@dataclass
class AgentLog:
    id: str
    turns: list[tuple[str, str]] = field(default_factory=list)  # acknowledged (user text, assistant text)
    doubtful: set[str] = field(default_factory=set)   # turns whose answer the client never saw (may be stored)
    refused: set[str] = field(default_factory=set)    # turns answered with an error (must not be stored)
    accepted: set[str] = field(default_factory=set)   # 'invalid' turns the server took (may be stored)


@dataclass
class Lifetime:
    no: int
    pid: int
    port: int
    started: float
    ready: float = 0.0
    rss_start_mb: float | None = None
    rss_end_mb: float | None = None
    hwm_end_mb: float | None = None
    ended: float | None = None
    ended_by: str = ""               # "kill -9", "crash (exit N)", "end"
    log: str = ""


@dataclass
class Req:
    method: str
    path: str
    content: bytes | None = None
    headers: dict[str, str] | None = None  # None: application/json when there is a body

    def describe(self, limit: int = 300) -> str:
        ctype = (self.headers or {}).get("content-type", "application/json" if self.content is not None else "")
        body = "" if self.content is None else self.content[:limit].decode("utf-8", "backslashreplace")
        more = f"… ({len(self.content)} bytes)" if self.content is not None and len(self.content) > limit else ""
        return f"{self.method} {self.path} [{ctype or 'no content-type'}] {body}{more}"


def jb(obj: Any) -> bytes:
    return json.dumps(obj).encode()


def proc_mb(pid: int, key: str) -> float | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith(key + ":"):
                return round(int(line.split()[1]) / 1024, 1)
    except OSError:
        pass
    return None


def pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return round(ordered[min(len(ordered) - 1, int(round(q * (len(ordered) - 1))))], 1)


def parse_sse(lines: list[str]) -> list[tuple[str | None, str]]:
    events: list[tuple[str | None, str]] = []
    name: str | None = None
    for line in lines:
        if not line:
            name = None
        elif line.startswith("event:"):
            name = line[6:].strip()
        elif line.startswith("data:"):
            events.append((name, line[5:].lstrip()))
    return events


def sse_json(events: list[tuple[str | None, str]]) -> list[tuple[str | None, Any]]:
    out = []
    for name, data in events:
        try:
            out.append((name, json.loads(data)))
        except ValueError:
            out.append((name, data))
    return out


def stream_error(events: list[tuple[str | None, Any]]) -> str | None:
    for name, data in events:
        if isinstance(data, dict) and (name == "error" or data.get("type") == "error" or "error" in data):
            inner: dict[str, Any] = data["error"] if isinstance(data.get("error"), dict) else data
            return str(inner.get("type") or inner.get("code") or "error")
    return None


SERVER_ERROR_TYPES = {"server_error", "api_error", "service_unavailable_error", "server_overloaded",
                      "overloaded_error", "internal"}


# --------------------------------------------------------------------------- one run

class Soak:
    def __init__(self, args: argparse.Namespace, model_dir: Path, share: float, label: str) -> None:
        self.args = args
        self.model_dir = model_dir
        self.share = share
        self.label = label
        self.vocab = int(json.loads((model_dir / "config.json").read_text()).get("vocab_size", 1024))
        self.tmp = Path(tempfile.mkdtemp(prefix=f"flow-soak-{label}-"))
        self.graph = self.tmp / "soak-graph.toml"
        self.graph.write_text(
            f'extends = "{ROOT / "graphs" / "default.toml"}"\n\n[resources.model]\npath = "{model_dir}"\n'
            f'name = "soak"\naliases = ["default"]\n')
        self.port = free_port()
        self.proc: subprocess.Popen[bytes] | None = None
        self.lifetimes: list[Lifetime] = []
        self.client: httpx.AsyncClient | None = None
        self.old_clients: list[httpx.AsyncClient] = []
        self.up = trio.Event()
        self.outcomes: list[Outcome] = []
        self.agents: dict[str, AgentLog] = {}
        self.agents_acked: list[str] = []
        self.responses: dict[str, str] = {}      # acknowledged id -> output text
        self.lost: dict[str, set[str]] = {"agents": set(), "turns": set(), "responses": set()}
        self.altered: set[str] = set()
        self.phantom: set[str] = set()
        self.checks: list[dict[str, Any]] = []
        self.examples: dict[str, list[str]] = {
            key: [] for key in ("5xx", "stream_errors", "valid_refused", "invalid_accepted", "lost",
                                "other_connection_errors", "crashes", "check_errors", "server_log")}
        self.huge: dict[str, bytes] = {}
        self.t0 = 0.0

    # ----------------------------------------------------------------------- server

    def spawn(self) -> Lifetime:
        from flow.cli import blas

        env = blas.preload_env() or dict(os.environ)
        env["FLOW_DATA_DIR"] = str(self.tmp / "data")
        no = len(self.lifetimes)
        log = self.tmp / f"server-{no}.log"
        cmd = [sys.executable, "-m", "flow.cli", "--log-level", "WARNING", "serve", str(self.graph),
               "--port", str(self.port)]
        self.proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=open(log, "wb"))
        lifetime = Lifetime(no, self.proc.pid, self.port, time.monotonic(), log=str(log))
        self.lifetimes.append(lifetime)
        return lifetime

    async def start_server(self) -> None:
        for attempt in range(3):
            lifetime = self.spawn()
            if await self.wait_ready(lifetime):
                break
            if self.proc is not None and self.proc.poll() is None:
                self.proc.kill()
                await trio.to_thread.run_sync(self.proc.wait)
            lifetime.ended, lifetime.ended_by = time.monotonic(), "failed to start"
            print(f"[{self.label}] server did not start (attempt {attempt + 1}): {self.log_tail(lifetime, 5)}",
                  file=sys.stderr)
            self.port = free_port()
        else:
            raise RuntimeError(f"the server would not start; logs in {self.tmp}")
        if self.client is not None:
            self.old_clients.append(self.client)
        limits = httpx.Limits(max_connections=self.args.clients + 16, max_keepalive_connections=self.args.clients + 16)
        self.client = httpx.AsyncClient(base_url=f"http://127.0.0.1:{self.port}", limits=limits,
                                        timeout=httpx.Timeout(self.args.timeout))
        await self.warm_up()
        lifetime.ready = time.monotonic()
        lifetime.rss_start_mb = proc_mb(lifetime.pid, "VmRSS")

    async def wait_ready(self, lifetime: Lifetime, timeout: float = 600) -> bool:
        deadline = time.monotonic() + timeout
        async with httpx.AsyncClient(timeout=2) as probe:
            while time.monotonic() < deadline:
                if self.proc is None or self.proc.poll() is not None:
                    return False
                try:
                    if (await probe.get(f"http://127.0.0.1:{lifetime.port}/health")).status_code == 200:
                        return True
                except httpx.HTTPError:
                    pass
                await trio.sleep(0.3)
        return False

    async def warm_up(self) -> None:
        """One request of each kind that writes nothing: kernels and first-request paths, before RSS."""
        assert self.client is not None
        msgs = [{"role": "user", "content": "warm up the lamp"}]
        for path, body in (("/v1/chat/completions", {"model": "default", "messages": msgs, "max_tokens": 4}),
                           ("/v1/chat/completions", {"model": "default", "messages": msgs, "max_tokens": 4,
                                                     "stream": True}),
                           ("/v1/completions", {"model": "default", "prompt": "warm up", "max_tokens": 4}),
                           ("/v1/messages", {"model": "default", "messages": msgs, "max_tokens": 4}),
                           ("/v1/messages/count_tokens", {"model": "default", "messages": msgs}),
                           ("/v1/responses", {"model": "default", "input": "warm up", "max_output_tokens": 4,
                                              "store": False})):
            try:
                await self.client.post(path, json=body)
            except httpx.HTTPError:
                pass

    def log_tail(self, lifetime: Lifetime, lines: int = 30) -> str:
        try:
            return "\n".join(Path(lifetime.log).read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

    async def take_down(self, reason: str) -> None:
        """Close the gate, note the lifetime's end (RSS first), SIGKILL unless it died by itself."""
        self.up = trio.Event()
        lifetime = self.lifetimes[-1]
        assert self.proc is not None
        lifetime.rss_end_mb = proc_mb(lifetime.pid, "VmRSS")
        lifetime.hwm_end_mb = proc_mb(lifetime.pid, "VmHWM")
        lifetime.ended = time.monotonic()
        if self.proc.poll() is None:
            lifetime.ended_by = reason
            self.proc.send_signal(signal.SIGKILL)
        else:
            lifetime.ended_by = f"crash (exit {self.proc.returncode})"
            self.examples["crashes"].append(f"lifetime {lifetime.no} (pid {lifetime.pid}) exited "
                                            f"{self.proc.returncode}; log tail:\n{self.log_tail(lifetime)}")
        await trio.to_thread.run_sync(self.proc.wait)

    async def restart(self, reason: str, check_label: str) -> None:
        await self.take_down(reason)
        await trio.sleep(0.5)  # let the cut requests report
        await self.start_server()
        await self.verify(check_label)
        self.up.set()

    async def supervise(self, deadline: float) -> None:
        k = 1
        while True:
            next_kill = min(self.t0 + k * self.args.restart_every, deadline)
            while time.monotonic() < next_kill:
                if self.proc is not None and self.proc.poll() is not None:
                    break
                await trio.sleep(0.25)
            if self.proc is not None and self.proc.poll() is not None:  # crashed
                print(f"[{self.label}] server exited by itself ({self.proc.returncode}); restarting", file=sys.stderr)
                await self.restart("", f"after crash of lifetime {len(self.lifetimes) - 1}")
                continue
            if time.monotonic() >= deadline:
                return
            print(f"[{self.label}] {self.elapsed()}: kill -9 and restart {k}", file=sys.stderr)
            await self.restart("kill -9", f"after restart {k}")
            k += 1

    def elapsed(self) -> str:
        s = int(time.monotonic() - self.t0)
        return f"{s // 60:02d}:{s % 60:02d}"

    async def progress(self, deadline: float) -> None:
        while time.monotonic() < deadline:
            await trio.sleep(min(30, max(0.1, deadline - time.monotonic())))
            by = Counter(_klass(o) for o in self.outcomes)
            print(f"[{self.label}] {self.elapsed()}: {sum(v for k, v in by.items() if k != 'conn')} served "
                  f"({by['2xx']} 2xx, {by['4xx']} 4xx, {by['5xx']} 5xx), {by['conn']} connection errors, "
                  f"writes acked: {len(self.agents_acked)} agents, "
                  f"{sum(len(a.turns) for a in self.agents.values())} turns, {len(self.responses)} responses",
                  file=sys.stderr)

    # ----------------------------------------------------------------------- requests

    async def call(self, kind: str, valid: bool, req: Req) -> tuple[Outcome, Any]:
        """One request; returns its outcome and the parsed answer (JSON, a list of SSE events, or text)."""
        client = self.client
        assert client is not None
        outcome = Outcome(kind, valid, len(self.lifetimes) - 1, time.monotonic(), 0.0)
        headers = req.headers
        if headers is None:
            headers = {"content-type": "application/json"} if req.content is not None else {}
        parsed: Any = None
        raw = b""
        try:
            async with client.stream(req.method, req.path, content=req.content, headers=headers) as response:
                outcome.status = response.status_code
                if "text/event-stream" in response.headers.get("content-type", ""):
                    lines = [line async for line in response.aiter_lines()]
                    parsed = sse_json(parse_sse(lines))
                    outcome.stream_error = stream_error(parsed)
                    raw = "\n".join(lines).encode()
                else:
                    raw = await response.aread()
                    try:
                        parsed = json.loads(raw)
                    except ValueError:
                        parsed = raw.decode("utf-8", "replace")
        except httpx.TimeoutException as exc:
            outcome.status, outcome.timeout, outcome.error = None, True, f"timeout ({type(exc).__name__})"
        except (httpx.HTTPError, OSError) as exc:
            outcome.status, outcome.error = None, f"{type(exc).__name__}: {exc}"
        outcome.ended = time.monotonic()
        self.outcomes.append(outcome)
        if outcome.status is not None and outcome.status >= 500:
            self.example("5xx", f"[{kind}] {req.describe()}\n    -> {outcome.status} "
                                f"{raw[:500].decode('utf-8', 'replace')}")
        elif outcome.stream_error is not None:
            self.example("stream_errors", f"[{kind}] {req.describe()}\n    -> {outcome.status} stream error "
                                          f"{outcome.stream_error}: {raw[-400:].decode('utf-8', 'replace')}")
        elif valid and outcome.status is not None and outcome.status >= 400:
            self.example("valid_refused", f"[{kind}] {req.describe(200)}\n    -> {outcome.status} "
                                          f"{raw[:300].decode('utf-8', 'replace')}")
        elif not valid and outcome.status is not None and outcome.status < 300:
            self.example("invalid_accepted", f"[{kind}] {req.describe(200)}\n    -> {outcome.status} "
                                             f"{raw[:200].decode('utf-8', 'replace')}")
        return outcome, parsed

    def example(self, key: str, text: str) -> None:
        if len(self.examples[key]) < EXAMPLES:
            self.examples[key].append(text)

    # ----------------------------------------------------------------------- workers

    async def worker(self, w: int, deadline: float) -> None:
        rng = random.Random(self.args.seed * 1000 + w)
        state = WorkerState(w)
        valid_ops = [(3, self.v_chat), (1.5, self.v_completions), (2, self.v_anthropic), (1, self.v_count),
                     (2, self.v_responses), (2.5, self.v_agent_turn)]
        weights = [x for x, _ in valid_ops]
        while time.monotonic() < deadline:
            if not self.up.is_set():
                await self.up.wait()
                continue
            if rng.random() < self.share:
                name, build = rng.choice(INVALID)
                req = build(self, rng, state)
                outcome, _ = await self.call(name, False, req)
                if state.marker_agent is not None:  # an invalid turn on the worker's own agent
                    log = self.agents[state.marker_agent]
                    if outcome.status is not None and outcome.status < 300 and outcome.stream_error is None:
                        log.accepted.add(state.marker_text)
                    elif outcome.status is None:
                        log.doubtful.add(state.marker_text)
                    else:
                        log.refused.add(state.marker_text)
                    state.marker_agent = None
            else:
                op = rng.choices(valid_ops, weights)[0][1]
                await op(rng, state)

    def text(self, rng: random.Random, tag: str) -> str:
        n = rng.randint(60, 200) if rng.random() < 0.1 else rng.randint(3, 30)
        return f"[{tag}] " + " ".join(rng.choice(WORDS) for _ in range(n))

    def max_tokens(self, rng: random.Random) -> int:
        return rng.randint(max(1, self.args.max_tokens // 4), self.args.max_tokens)

    def sampling(self, rng: random.Random) -> dict[str, Any]:
        out: dict[str, Any] = {"temperature": rng.choice([0, 0.7, 1.0])}
        if rng.random() < 0.3:
            out.update(top_p=0.9, seed=rng.randint(0, 2**31 - 1))
        if rng.random() < 0.2:
            out["logit_bias"] = {str(rng.randrange(self.vocab)): rng.choice([-5.0, 2.0])}
        return out

    async def v_chat(self, rng: random.Random, state: WorkerState) -> None:
        stream = rng.random() < 0.5
        body: dict[str, Any] = {"model": "default", "max_tokens": self.max_tokens(rng), "stream": stream,
                                "messages": [{"role": "system", "content": "Be brief."},
                                             {"role": "user", "content": self.text(rng, f"w{state.w}")}],
                                **self.sampling(rng)}
        if stream:
            body["stream_options"] = {"include_usage": True}
        elif rng.random() < 0.2:
            body.update(logprobs=True, top_logprobs=2)
        kind = "chat.stream" if stream else "chat"
        outcome, parsed = await self.call(kind, True, Req("POST", "/v1/chat/completions", jb(body)))
        outcome.complete = ok(outcome) and (done(parsed) if stream else answered(parsed))

    async def v_completions(self, rng: random.Random, state: WorkerState) -> None:
        stream = rng.random() < 0.5
        prompt: Any = self.text(rng, f"w{state.w}")
        if rng.random() < 0.3:
            prompt = [rng.randrange(self.vocab) for _ in range(rng.randint(4, 40))]
        body = {"model": "default", "prompt": prompt, "max_tokens": self.max_tokens(rng), "stream": stream,
                **self.sampling(rng)}
        kind = "completions.stream" if stream else "completions"
        outcome, parsed = await self.call(kind, True, Req("POST", "/v1/completions", jb(body)))
        outcome.complete = ok(outcome) and (done(parsed) if stream else answered(parsed))

    async def v_anthropic(self, rng: random.Random, state: WorkerState) -> None:
        stream = rng.random() < 0.5
        body: dict[str, Any] = {"model": "default", "max_tokens": self.max_tokens(rng), "stream": stream,
                                "system": [{"type": "text", "text": "Be brief."}],
                                "messages": [{"role": "user", "content": self.text(rng, f"w{state.w}")}],
                                "temperature": rng.choice([0, 0.7])}
        kind = "anthropic.stream" if stream else "anthropic"
        outcome, parsed = await self.call(kind, True, Req("POST", "/v1/messages", jb(body),
                                                          {"content-type": "application/json",
                                                           "anthropic-version": "2023-06-01"}))
        if stream:
            outcome.complete = ok(outcome) and any(n == "message_stop" for n, _ in parsed or [])
        else:
            outcome.complete = ok(outcome) and isinstance(parsed, dict) and parsed.get("type") == "message"

    async def v_count(self, rng: random.Random, state: WorkerState) -> None:
        body = {"model": "default", "messages": [{"role": "user", "content": self.text(rng, f"w{state.w}")}]}
        outcome, parsed = await self.call("count_tokens", True, Req("POST", "/v1/messages/count_tokens", jb(body)))
        outcome.complete = ok(outcome) and isinstance(parsed, dict) and "input_tokens" in parsed

    async def v_responses(self, rng: random.Random, state: WorkerState) -> None:
        stream = rng.random() < 0.33
        body: dict[str, Any] = {"model": "default", "input": self.text(rng, f"w{state.w}"), "store": True,
                                "max_output_tokens": self.max_tokens(rng), "stream": stream}
        chained = state.chain_id is not None and state.chain_len < CHAIN_LENGTH
        if chained:
            body["previous_response_id"] = state.chain_id
        else:
            body["instructions"] = "Be brief."
        kind = ("responses.chain" if chained else "responses") + (".stream" if stream else "")
        outcome, parsed = await self.call(kind, True, Req("POST", "/v1/responses", jb(body)))
        obj: Any = None
        if ok(outcome):
            if stream:
                finals = [d for n, d in parsed or [] if n in ("response.completed", "response.incomplete")]
                obj = finals[-1].get("response") if finals and isinstance(finals[-1], dict) else None
            elif isinstance(parsed, dict):
                obj = parsed
        if isinstance(obj, dict) and isinstance(obj.get("id"), str):
            outcome.complete = True
            self.responses[obj["id"]] = response_text(obj)
            state.chain_id, state.chain_len = obj["id"], (state.chain_len + 1 if chained else 1)
        elif outcome.status is not None:
            state.chain_id = None  # refused (a lost previous response?): start a new chain

    async def v_agent_turn(self, rng: random.Random, state: WorkerState) -> None:
        if state.agent is None or state.agent_turns >= AGENT_TURNS:
            state.agent_no += 1
            agent_id = f"soak-{self.label}-w{state.w}-a{state.agent_no}"
            create = {"id": agent_id, "model": "default", "system_prompt": "You keep a lighthouse. Be brief."}
            outcome, parsed = await self.call("agents.create", True, Req("POST", "/v1/agents", jb(create)))
            outcome.complete = ok(outcome) and isinstance(parsed, dict) and parsed.get("id") == agent_id
            if not outcome.complete:
                return  # (a create cut by a restart: the next try uses a new id)
            self.agents[agent_id] = AgentLog(agent_id)
            self.agents_acked.append(agent_id)
            state.agent, state.agent_turns = agent_id, 0
            if not self.up.is_set():
                return
        assert state.agent is not None
        log = self.agents[state.agent]
        stream = rng.random() < 0.5
        state.agent_turns += 1
        user = self.text(rng, f"{state.agent} turn {state.agent_turns}")
        body: dict[str, Any] = {"messages": [{"role": "user", "content": user}],
                                "max_tokens": self.max_tokens(rng), "stream": stream, **self.sampling(rng)}
        kind = "agents.turn.stream" if stream else "agents.turn"
        outcome, parsed = await self.call(kind, True, Req("POST", f"/v1/agents/{state.agent}/generate", jb(body)))
        text: str | None = None
        if ok(outcome):
            if stream and done(parsed):
                text = "".join(str(((d.get("choices") or [{}])[0].get("delta") or {}).get("content") or "")
                               for _, d in parsed if isinstance(d, dict))
            elif not stream and isinstance(parsed, dict) and parsed.get("choices"):
                text = parsed["choices"][0]["message"].get("content") or ""
        if text is not None:
            outcome.complete = True
            log.turns.append((user, text))
        elif outcome.status is None or (outcome.status < 300 and outcome.stream_error is None):
            log.doubtful.add(user)  # cut off: the server may or may not have kept it
        else:
            log.refused.add(user)

    # ----------------------------------------------------------------------- checks

    async def verify(self, label: str) -> None:
        """Every acknowledged write must be there: agents with their turns in order, stored responses."""
        assert self.client is not None
        started = time.monotonic()
        row: dict[str, Any] = {"check": label, "agents": len(self.agents_acked), "turns": 0,
                               "responses": len(self.responses), "lost_agents": 0, "lost_turns": 0,
                               "lost_responses": 0, "altered": 0, "phantom": 0, "errors": 0}
        limiter = trio.CapacityLimiter(8)
        client = self.client

        async def get(path: str) -> tuple[int | None, Any]:
            async with limiter:
                try:
                    r = await client.get(path)
                    try:
                        return r.status_code, r.json()
                    except ValueError:
                        return r.status_code, r.text[:300]
                except httpx.HTTPError as exc:
                    return None, f"{type(exc).__name__}: {exc}"

        async def check_agent(agent_id: str) -> None:
            log = self.agents[agent_id]
            turns = list(log.turns)
            row["turns"] += len(turns)
            status, body = await get(f"/v1/agents/{agent_id}")
            if status == 404:
                row["lost_agents"] += 1
                row["lost_turns"] += len(turns)
                self.lost["agents"].add(agent_id)
                self.lost["turns"].update(f"{agent_id}#{i}" for i in range(len(turns)))
                self.example("lost", f"{label}: agent {agent_id} (with {len(turns)} acknowledged turns) is gone")
                return
            if status != 200 or not isinstance(body, dict):
                row["errors"] += 1
                self.example("check_errors", f"{label}: GET /v1/agents/{agent_id} -> {status} {str(body)[:300]}")
                return
            history = body.get("history") or []
            users = [(i, m.get("content")) for i, m in enumerate(history)
                     if isinstance(m, dict) and m.get("role") == "user"]
            pos = 0
            acked_users = {u for u, _ in turns}
            for n, (user, answer) in enumerate(turns):
                found = next((i for i, c in users if i >= pos and c == user), None)
                if found is None:
                    row["lost_turns"] += 1
                    self.lost["turns"].add(f"{agent_id}#{n}")
                    self.example("lost", f"{label}: agent {agent_id} turn {n + 1} ({user[:60]!r}) missing "
                                         f"from its history of {len(history)} messages")
                    continue
                stored = history[found + 1] if found + 1 < len(history) else {}
                if not (isinstance(stored, dict) and stored.get("role") == "assistant"
                        and (stored.get("content") or "") == answer):
                    row["altered"] += 1
                    self.altered.add(f"{agent_id}#{n}")
                    self.example("lost", f"{label}: agent {agent_id} turn {n + 1}: stored answer "
                                         f"{str(stored)[:150]!r} != acknowledged {answer[:150]!r}")
                pos = found + 1
            for _, content in users:
                if content in acked_users or content in log.doubtful or content in log.accepted:
                    continue
                row["phantom"] += 1
                self.phantom.add(f"{agent_id}:{content}")
                self.example("lost", f"{label}: agent {agent_id} holds a turn the server refused: "
                                     f"{str(content)[:100]!r}")

        async def check_response(response_id: str, text: str) -> None:
            status, body = await get(f"/v1/responses/{response_id}")
            if status == 404:
                row["lost_responses"] += 1
                self.lost["responses"].add(response_id)
                self.example("lost", f"{label}: response {response_id} is gone (404)")
            elif status != 200 or not isinstance(body, dict):
                row["errors"] += 1
                self.example("check_errors", f"{label}: GET /v1/responses/{response_id} -> {status} {str(body)[:300]}")
            elif body.get("id") != response_id or response_text(body) != text:
                row["altered"] += 1
                self.altered.add(response_id)
                self.example("lost", f"{label}: response {response_id} came back different: {str(body)[:200]}")

        async with trio.open_nursery() as nursery:
            for agent_id in list(self.agents_acked):
                nursery.start_soon(check_agent, agent_id)
            for response_id, text in list(self.responses.items()):
                nursery.start_soon(check_response, response_id, text)
        row["seconds"] = round(time.monotonic() - started, 1)
        self.checks.append(row)
        print(f"[{self.label}] check {label}: {row['agents']} agents, {row['turns']} turns, {row['responses']} "
              f"responses; lost {row['lost_agents']}/{row['lost_turns']}/{row['lost_responses']}, altered "
              f"{row['altered']}, phantom {row['phantom']}, errors {row['errors']}", file=sys.stderr)

    # ----------------------------------------------------------------------- the run

    async def run(self) -> dict[str, Any]:
        print(f"[{self.label}] starting flow serve (data in {self.tmp})", file=sys.stderr)
        await self.start_server()
        self.up.set()
        self.t0 = time.monotonic()
        deadline = self.t0 + self.args.minutes * 60
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self.supervise, deadline)
            nursery.start_soon(self.progress, deadline)
            for w in range(self.args.clients):
                nursery.start_soon(self.worker, w, deadline)
        duration = time.monotonic() - self.t0
        await self.verify("end, live server")
        await self.take_down("end (kill -9)")
        await trio.sleep(0.5)
        await self.start_server()
        await self.verify("end, after kill -9 and restart")
        final = self.lifetimes[-1]
        final.rss_end_mb = proc_mb(final.pid, "VmRSS")
        final.ended, final.ended_by = time.monotonic(), "final check only"
        assert self.proc is not None
        self.proc.terminate()
        try:
            await trio.to_thread.run_sync(lambda: self.proc.wait(20) if self.proc else None)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        for client in [*self.old_clients, self.client]:
            if client is not None:
                await client.aclose()
        result = self.summary(duration)
        if self.args.keep:
            result["data_dir"] = str(self.tmp)
        else:
            shutil.rmtree(self.tmp, ignore_errors=True)
        return result

    def summary(self, duration: float) -> dict[str, Any]:
        ends = {lt.no: lt for lt in self.lifetimes}
        conn_restart = conn_crash = conn_other = timeouts = 0
        for o in self.outcomes:
            if o.status is not None:
                continue
            lt = ends[o.lifetime]
            if lt.ended is not None and o.ended >= lt.ended - 0.05:
                if lt.ended_by.startswith("crash"):
                    conn_crash += 1
                else:
                    conn_restart += 1
            elif o.timeout:
                timeouts += 1
            else:
                conn_other += 1
                self.example("other_connection_errors", f"[{o.kind}] lifetime {o.lifetime} at "
                                                        f"{o.ended - self.t0:.1f} s: {o.error}")
        log_errors = 0
        for lt in self.lifetimes:
            try:
                lines = Path(lt.log).read_text(errors="replace").splitlines()
            except OSError:
                continue
            for n, line in enumerate(lines):
                if " ERROR " in line or " CRITICAL " in line or line.startswith("Traceback"):
                    log_errors += 1
                    if not line.startswith("Traceback"):
                        self.example("server_log", f"lifetime {lt.no}: " + "\n".join(lines[n:n + 25]))
        served = [o for o in self.outcomes if o.status is not None]
        classes = {
            side: dict(sorted(Counter(_klass(o) for o in served if o.valid == (side == "valid")).items()))
            for side in ("valid", "invalid")}
        latencies = [o.seconds * 1000 for o in self.outcomes if o.valid and o.complete]
        kinds: dict[str, dict[str, Any]] = {}
        for o in self.outcomes:
            k = kinds.setdefault(o.kind, {"valid": o.valid, "n": 0, "2xx": 0, "3xx": 0, "4xx": 0, "5xx": 0,
                                          "conn": 0, "stream_errors": 0, "ms": []})
            k["n"] += 1
            k[_klass(o)] += 1
            k["stream_errors"] += o.stream_error is not None
            if o.complete or (not o.valid and o.status is not None):  # invalid ones: time to the refusal
                k["ms"].append(o.seconds * 1000)
        for k in kinds.values():
            ms = k.pop("ms")
            k["p50_ms"], k["p95_ms"] = pct(ms, 0.5), pct(ms, 0.95)
        server_stream_errors = sum(1 for o in self.outcomes if o.stream_error in SERVER_ERROR_TYPES)
        turns = sum(len(a.turns) for a in self.agents.values())
        lost = {k: len(v) for k, v in self.lost.items()}
        serving = [lt for lt in self.lifetimes if lt.ended_by != "failed to start"]
        return {
            "label": self.label, "invalid_share": self.share, "duration_s": round(duration, 1),
            "served": len(served), "classes": classes,
            "five_xx": sum(1 for o in served if o.status is not None and o.status >= 500),
            "stream_errors": sum(1 for o in self.outcomes if o.stream_error is not None),
            "server_stream_errors": server_stream_errors,
            "connection_errors_during_restarts": conn_restart, "connection_errors_at_crashes": conn_crash,
            "connection_errors_other": conn_other, "timeouts": timeouts,
            "crashes": sum(1 for lt in self.lifetimes if lt.ended_by.startswith("crash")),
            "server_log_errors": log_errors,
            "valid_latency_ms": {"n": len(latencies), "p50": pct(latencies, 0.5), "p95": pct(latencies, 0.95),
                                 "mean": round(statistics.fmean(latencies), 1) if latencies else None},
            "lifetimes": [{"no": lt.no, "pid": lt.pid, "up_s": round((lt.ended or time.monotonic()) - lt.ready, 1)
                           if lt.ready else None,
                           "requests": sum(1 for o in served if o.lifetime == lt.no),
                           "rss_start_mb": lt.rss_start_mb, "rss_end_mb": lt.rss_end_mb, "hwm_end_mb": lt.hwm_end_mb,
                           "ended_by": lt.ended_by} for lt in serving],
            "rss_start_mb": serving[0].rss_start_mb if serving else None,
            "rss_end_mb": next((lt.rss_end_mb for lt in reversed(serving) if lt.ended_by != "final check only"
                                and lt.rss_end_mb is not None), None),
            "writes": {"agents": len(self.agents_acked), "turns": turns, "responses": len(self.responses),
                       "total": len(self.agents_acked) + turns + len(self.responses),
                       "lost_agents": lost["agents"], "lost_turns": lost["turns"],
                       "lost_responses": lost["responses"],
                       "lost": lost["agents"] + lost["turns"] + lost["responses"],
                       "altered": len(self.altered), "phantom": len(self.phantom),
                       "turns_in_doubt": sum(len(a.doubtful) for a in self.agents.values())},
            "checks": self.checks,
            "kinds": dict(sorted(kinds.items(), key=lambda kv: (not kv[1]["valid"], kv[0]))),
            "examples": {k: v for k, v in self.examples.items() if v},
        }


@dataclass
class WorkerState:
    w: int
    agent: str | None = None
    agent_no: int = 0
    agent_turns: int = 0
    chain_id: str | None = None
    chain_len: int = 0
    marker_agent: str | None = None  # set by an invalid request on the worker's own agent
    marker_text: str = ""


def _klass(o: Outcome) -> str:
    return "conn" if o.status is None else f"{o.status // 100}xx"


def ok(o: Outcome) -> bool:
    return o.status is not None and 200 <= o.status < 300 and o.stream_error is None


def done(events: Any) -> bool:
    return isinstance(events, list) and any(d == "[DONE]" for _, d in events)


def answered(parsed: Any) -> bool:
    return isinstance(parsed, dict) and "choices" in parsed


def response_text(obj: dict[str, Any]) -> str:
    return "".join(str(part.get("text") or "") for item in obj.get("output") or [] if isinstance(item, dict)
                   and item.get("type") == "message" for part in item.get("content") or [] if isinstance(part, dict))


# --------------------------------------------------------------------------- invalid requests

POST_ROUTES = ("/v1/chat/completions", "/v1/completions", "/v1/messages", "/v1/messages/count_tokens",
               "/v1/responses", "/v1/agents")
MSG = [{"role": "user", "content": "hello keeper"}]


def chat_with(extra: dict[str, Any], stream: bool = False) -> Req:
    return Req("POST", "/v1/chat/completions", jb({"model": "default", "messages": MSG, "max_tokens": 4,
                                                    "stream": stream, **extra}))


def _json_malformed(s: Soak, rng: random.Random, st: WorkerState) -> Req:
    bodies = [b'{"model": "default", "messages": [{"role": "user", "content": "hi"', b"\x00\xff{not json",
              b'{"model": "default"} {"model": "default"}', b"", b"[1, 2, 3]", b"null", b"123", b'"a string"',
              b'{"model": "default", "messages": [], }', b"{'model': 'default'}", b'{"a": 1e99999}']
    return Req("POST", rng.choice(POST_ROUTES), rng.choice(bodies))


def _json_nan(s: Soak, rng: random.Random, st: WorkerState) -> Req:
    value = rng.choice(["NaN", "Infinity", "-Infinity"])
    return Req("POST", "/v1/chat/completions", b'{"model": "default", "messages": [{"role": "user", "content": "hi"}],'
               b' "max_tokens": 4, "temperature": ' + value.encode() + b"}")


def _wrong_types(s: Soak, rng: random.Random, st: WorkerState) -> Req:
    cases = [
        ("/v1/chat/completions", {"model": "default", "messages": "hello"}),
        ("/v1/chat/completions", {"model": "default", "messages": MSG, "max_tokens": "ten"}),
        ("/v1/chat/completions", {"model": "default", "messages": [{"role": 5, "content": {}}]}),
        ("/v1/chat/completions", {"model": "default", "messages": [{"role": "user", "content": [1, 2]}]}),
        ("/v1/chat/completions", {"model": 7, "messages": MSG}),
        ("/v1/chat/completions", {"model": "default", "messages": MSG, "stop": 5}),
        ("/v1/chat/completions", {"model": "default", "messages": MSG, "stream": "yes"}),
        ("/v1/completions", {"model": "default", "prompt": [1, "a", None], "max_tokens": 4}),
        ("/v1/completions", {"model": "default", "prompt": {"text": "hi"}, "max_tokens": 4}),
        ("/v1/messages", {"model": "default", "max_tokens": 4, "messages": [{"role": "user", "content": {"a": 1}}]}),
        ("/v1/messages", {"model": "default", "max_tokens": 4, "messages": MSG, "system": 5}),
        ("/v1/messages", {"model": "default", "max_tokens": 4,
                          "messages": [{"role": "user", "content": [{"type": "mystery", "x": 1}]}]}),
        ("/v1/responses", {"model": "default", "input": 42}),
        ("/v1/responses", {"model": "default", "input": [{"type": "function_call_output"}]}),
        ("/v1/agents", {"model": "default", "persist": "maybe"}),
        ("/v1/agents", {"model": "default", "id": "has spaces and /slashes"}),
    ]
    path, body = rng.choice(cases)
    return Req("POST", path, jb(body))


def _out_of_range(s: Soak, rng: random.Random, st: WorkerState) -> Req:
    chat: list[dict[str, Any]] = [
        {"temperature": -1}, {"temperature": 1e308}, {"top_p": 2}, {"top_p": 0}, {"top_k": -5}, {"min_p": 3},
        {"max_tokens": -1}, {"max_tokens": 0}, {"max_tokens": 10**12}, {"max_tokens": 2**70},
        {"presence_penalty": 1e9}, {"frequency_penalty": -1e9}, {"repetition_penalty": 0},
        {"repetition_penalty": -1}, {"seed": -1}, {"seed": 2**80}, {"logprobs": True, "top_logprobs": 1000},
        {"n": 1000}, {"max_completion_tokens": -5}, {"temperature": 1e-320}]
    other = [("/v1/messages", {"model": "default", "messages": MSG, "max_tokens": 0}),
             ("/v1/messages", {"model": "default", "messages": MSG, "max_tokens": 4, "temperature": 5}),
             ("/v1/messages", {"model": "default", "messages": MSG, "max_tokens": 4, "top_k": -1}),
             ("/v1/messages", {"model": "default", "messages": MSG, "max_tokens": 4,
                               "thinking": {"type": "enabled", "budget_tokens": -5}}),
             ("/v1/responses", {"model": "default", "input": "hi", "max_output_tokens": 0}),
             ("/v1/responses", {"model": "default", "input": "hi", "temperature": 3}),
             ("/v1/completions", {"model": "default", "prompt": "hi", "max_tokens": 4, "logprobs": 1000}),
             ("/v1/completions", {"model": "default", "prompt": [-1, 5], "max_tokens": 4}),
             ("/v1/completions", {"model": "default", "prompt": [s.vocab + 10, 2**40], "max_tokens": 4}),
             ("/v1/agents", {"model": "default", "max_context": -3})]
    if rng.random() < 0.6:
        extra = rng.choice(chat)
        return chat_with(extra, stream=rng.random() < 0.3)
    path, body = rng.choice(other)
    return Req("POST", path, jb(body))


def _logit_bias(s: Soak, rng: random.Random, st: WorkerState) -> Req:
    bias = rng.choice([{"999999999": 5}, {"-1": 1}, {"abc": 1}, {str(s.vocab): 1}, {str(s.vocab + 1000): -100},
                       {"5": 1e30}, {"5": "x"}, {"5": 101}, {"5": -101}, {"1e3": 1}, {str(2**70): 1}])
    return chat_with({"logit_bias": bias}, stream=rng.random() < 0.5)


def _huge(s: Soak, rng: random.Random, st: WorkerState) -> Req:
    size = s.args.huge_bytes if rng.random() < 0.25 else s.args.huge_bytes // 8
    which = rng.choice(["content", "messages", "stop", "logit_bias", "anthropic", "count_tokens", "padding"])
    key = f"{which}-{size}"
    if key not in s.huge:
        text = " ".join(WORDS[i % len(WORDS)] for i in range(size // 5))[:size]
        if which == "content":
            body = {"model": "default", "max_tokens": 4, "messages": [{"role": "user", "content": text}]}
        elif which == "messages":
            body = {"model": "default", "max_tokens": 4,
                    "messages": [{"role": "user", "content": "hi"}] * (size // 40)}
        elif which == "stop":
            body = {"model": "default", "max_tokens": 4, "messages": MSG, "stop": [f"s{i}" for i in range(size // 8)]}
        elif which == "logit_bias":
            body = {"model": "default", "max_tokens": 4, "messages": MSG,
                    "logit_bias": {str(i): 1 for i in range(size // 12)}}
        elif which == "anthropic":
            body = {"model": "default", "max_tokens": 4, "messages": MSG,
                    "stop_sequences": [f"s{i}" for i in range(size // 8)]}
        elif which == "count_tokens":
            body = {"model": "default", "messages": [{"role": "user", "content": text}]}
        else:
            body = {"model": "default", "max_tokens": 4, "messages": MSG, "metadata": {"padding": text}}
        s.huge[key] = jb(body)
    path = {"anthropic": "/v1/messages", "count_tokens": "/v1/messages/count_tokens"}.get(which, "/v1/chat/completions")
    return Req("POST", path, s.huge[key])


def _content_type(s: Soak, rng: random.Random, st: WorkerState) -> Req:
    body = jb({"model": "default", "messages": MSG, "max_tokens": 4})
    choice = rng.randrange(5)
    if choice == 0:
        return Req("POST", "/v1/chat/completions", body, {"content-type": "text/plain"})
    if choice == 1:
        return Req("POST", "/v1/chat/completions", b"model=default&messages=hi",
                   {"content-type": "application/x-www-form-urlencoded"})
    if choice == 2:
        return Req("POST", rng.choice(POST_ROUTES), body, {})  # no content-type at all
    if choice == 3:
        return Req("POST", "/v1/messages", b"--b\r\nContent-Disposition: form-data; name=\"x\"\r\n\r\n1\r\n--b--\r\n",
                   {"content-type": "multipart/form-data; boundary=b"})
    return Req("POST", "/v1/responses", body, {"content-type": "application/json; charset=latin-1"})


def _unknown_route(s: Soak, rng: random.Random, st: WorkerState) -> Req:
    return rng.choice([Req("POST", "/v1/chat/complete", b"{}"), Req("GET", "/v2/models"),
                       Req("POST", "/v1/agents/x/y/z", b"{}"), Req("DELETE", "/v1/chat/completions"),
                       Req("PUT", "/v1/messages", b"{}"), Req("GET", "/v1/responses/resp_doesnotexist"),
                       Req("DELETE", "/v1/responses/resp_doesnotexist"), Req("GET", "/v1/" + "a" * 6000),
                       Req("GET", "/v1/agents/no-such-agent"), Req("PATCH", "/v1/agents/no-such-agent", b"{}"),
                       Req("POST", "/v1/agents/no-such-agent/generate", jb({"messages": MSG})),
                       Req("GET", "/v1/models/no-such-model"), Req("OPTIONS", "/v1/chat/completions")])


def _missing_fields(s: Soak, rng: random.Random, st: WorkerState) -> Req:
    path, body = rng.choice([
        ("/v1/chat/completions", {"model": "default"}), ("/v1/chat/completions", {"messages": MSG}),
        ("/v1/chat/completions", {"model": "default", "messages": []}),
        ("/v1/chat/completions", {"model": "default", "messages": [{"content": "no role"}]}),
        ("/v1/messages", {"model": "default", "messages": MSG}), ("/v1/messages", {"max_tokens": 4, "messages": MSG}),
        ("/v1/messages", {"model": "default", "max_tokens": 4, "messages": []}),
        ("/v1/messages/count_tokens", {"model": "default"}), ("/v1/responses", {"input": "hi"}),
        ("/v1/completions", {"prompt": "hi"}), ("/v1/agents", {"id": "no-model"}), ("/v1/agents", {}),
        ("/v1/chat/completions", {"model": "no-such-model", "messages": MSG}),
        ("/v1/messages", {"model": "no-such-model", "max_tokens": 4, "messages": MSG}),
        ("/v1/responses", {"model": "default", "input": "hi", "previous_response_id": "resp_nope"}),
        ("/v1/chat/completions", {"model": "default", "messages": [{"role": "wizard", "content": "hi"}]}),
    ])
    return Req("POST", path, jb(body))


def _deep(s: Soak, rng: random.Random, st: WorkerState) -> Req:
    depth = rng.choice([600, 2000, 100_000])
    if rng.random() < 0.5:
        return Req("POST", rng.choice(POST_ROUTES),
                   b'{"model": "default", "max_tokens": 4, "messages": ' + b"[" * depth + b"]" * depth + b"}")
    nested = b'{"a": ' * depth + b"1" + b"}" * depth
    if rng.random() < 0.5:
        return Req("POST", "/v1/chat/completions", b'{"model": "default", "max_tokens": 4, "messages": '
                   b'[{"role": "user", "content": "hi"}], "tools": [{"type": "function", "function": '
                   b'{"name": "f", "parameters": ' + nested + b"}}]}")
    return Req("POST", "/v1/messages", b'{"model": "default", "max_tokens": 4, "messages": '
               b'[{"role": "user", "content": "hi"}], "metadata": ' + nested + b"}")


def _bad_unicode(s: Soak, rng: random.Random, st: WorkerState) -> Req:
    lone = rng.choice([b"\\ud800", b"\\udfff", b"a\\ud83dz"])
    msgs = b'[{"role": "user", "content": "bad ' + lone + b' here"}]'
    choice = rng.randrange(8)
    if choice == 0:
        return Req("POST", "/v1/chat/completions", b'{"model": "default", "max_tokens": 4, "messages": ' + msgs + b"}")
    if choice == 1:
        return Req("POST", "/v1/messages", b'{"model": "default", "max_tokens": 4, "stream": true, "messages": '
                   + msgs + b"}")
    if choice == 2:
        return Req("POST", "/v1/completions", b'{"model": "default", "max_tokens": 4, "prompt": "x' + lone + b'"}')
    if choice == 3:
        return Req("POST", "/v1/chat/completions", b'{"model": "' + lone + b'", "messages": [{"role": "user", '
                   b'"content": "hi"}]}')
    if choice == 4:
        return Req("POST", "/v1/responses", b'{"model": "default", "max_output_tokens": 4, "input": "x' + lone + b'"}')
    if choice == 5:
        return Req("POST", "/v1/chat/completions", b'{"model": "default", "max_tokens": 4, "stop": ["' + lone
                   + b'"], "messages": [{"role": "user", "content": "hi"}]}')
    if choice == 6:  # invalid UTF-8 bytes inside a JSON string
        return Req("POST", rng.choice(POST_ROUTES), b'{"model": "default", "max_tokens": 4, "messages": '
                   b'[{"role": "user", "content": "\xff\xfe\xc3"}]}')
    return Req("POST", "/v1/messages/count_tokens", b'{"model": "default", "messages": ' + msgs + b"}")


def _bad_tools(s: Soak, rng: random.Random, st: WorkerState) -> Req:
    tools_ok = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    extra: dict[str, Any] = rng.choice([{"tools": [{"type": "function", "function": {"name": 5}}]},
                        {"tools": [{"type": "function"}]}, {"tools": "all of them"},
                        {"tools": [{"type": "function", "function": {"name": "f", "parameters": "x"}}]},
                        {"tools": tools_ok, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
                        {"tools": tools_ok, "tool_choice": "sometimes"},
                        {"messages": [{"role": "tool", "content": "orphan result", "tool_call_id": "nope"}]},
                        {"messages": [{"role": "assistant", "tool_calls": [{"id": "c", "type": "function",
                                                                            "function": {"name": "f",
                                                                                         "arguments": "{not json"}}]},
                                      {"role": "user", "content": "hi"}]}])
    return chat_with(extra, stream=rng.random() < 0.3)


def _own_agent(s: Soak, rng: random.Random, st: WorkerState) -> Req:
    """A bad request on the worker's own agent: must be refused, and leave its history as it was."""
    if st.agent is None:
        return Req("POST", "/v1/agents/soak-never-created/generate", jb({"messages": MSG}))
    marker = f"[{st.agent} invalid {rng.randrange(10**9)}] do not store me"
    msgs = [{"role": "user", "content": marker}]
    choice = rng.randrange(8)
    if choice == 0:
        return Req("POST", "/v1/agents", jb({"id": st.agent, "model": "default"}))  # duplicate id: 409
    if choice == 1:
        return Req("PATCH", f"/v1/agents/{st.agent}", jb({"max_context": "x"}))
    if choice == 2:
        return Req("PATCH", f"/v1/agents/{st.agent}", jb({"model": None}))
    bodies: list[dict[str, Any]] = [
        {"messages": marker}, {"messages": msgs, "max_tokens": -1}, {"messages": msgs, "temperature": "hot"},
              {"messages": msgs, "logit_bias": {"999999999": 1}}, {"messages": msgs, "model": "no-such-model"}]
    st.marker_agent, st.marker_text = st.agent, marker
    return Req("POST", f"/v1/agents/{st.agent}/generate", jb({**rng.choice(bodies), "stream": rng.random() < 0.5}))


INVALID: list[tuple[str, Callable[[Soak, random.Random, WorkerState], Req]]] = [
    ("json.malformed", _json_malformed), ("json.nan", _json_nan), ("types.wrong", _wrong_types),
    ("range.sampling", _out_of_range), ("logit_bias.outside", _logit_bias), ("body.huge", _huge),
    ("content_type.wrong", _content_type), ("route.unknown", _unknown_route), ("fields.missing", _missing_fields),
    ("json.deep", _deep), ("unicode.bad", _bad_unicode), ("tools.bad", _bad_tools), ("agents.own_bad", _own_agent),
]


# --------------------------------------------------------------------------- report

def _mb(v: float | None) -> str:
    return "–" if v is None else f"{v:.0f}"


def _v(v: Any) -> str:
    return "–" if v is None else str(v)


def markdown(result: dict[str, Any]) -> str:
    runs = result["runs"]
    lines = [
        f"soak: model `{result['model']}`, {result['minutes']} min per run, {result['clients']} clients, kill -9 "
        f"and restart every {result['restart_every']} s, max_tokens ≤ {result['max_tokens']}, huge bodies "
        f"{result['huge_bytes'] // 8} and {result['huge_bytes']} bytes; OpenBLAS "
        f"{'on' if result['openblas'] else 'off'}; {result['cpus']} CPUs; "
        f"load average before/after {result['load_average_before'][0]:.2f}/{result['load_average_after'][0]:.2f}",
        "",
        "| run | invalid share | duration | served | valid 2xx / 4xx / 5xx | invalid 2xx / 4xx / 5xx | **5xx** | "
        "server errors in 200 streams | conn. errors in restarts | other conn. errors / timeouts | crashes | "
        "valid p50 ms | valid p95 ms | RSS start → end MB | writes acked | **writes lost** | altered / phantom |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, r in runs.items():
        c = r["classes"]
        v, i = c["valid"], c["invalid"]
        w = r["writes"]
        lines.append(
            f"| {name} | {r['invalid_share']} | {r['duration_s'] / 60:.1f} min | {r['served']} | "
            f"{v.get('2xx', 0)} / {v.get('4xx', 0)} / {v.get('5xx', 0)} | "
            f"{i.get('2xx', 0)} / {i.get('4xx', 0)} / {i.get('5xx', 0)} | **{r['five_xx']}** | "
            f"{r['server_stream_errors']} | {r['connection_errors_during_restarts']} | "
            f"{r['connection_errors_other'] + r['connection_errors_at_crashes']} / {r['timeouts']} | {r['crashes']} | "
            f"{_v(r['valid_latency_ms']['p50'])} | {_v(r['valid_latency_ms']['p95'])} | "
            f"{_mb(r['rss_start_mb'])} → {_mb(r['rss_end_mb'])} | {w['total']} ({w['agents']} agents, {w['turns']} "
            f"turns, {w['responses']} responses) | **{w['lost']}** ({w['lost_agents']} / {w['lost_turns']} / "
            f"{w['lost_responses']}) | {w['altered']} / {w['phantom']} |")
    if result.get("p95_ratio") is not None:
        lines += ["", f"valid p95 with invalid traffic / without: **{result['p95_ratio']}×** "
                      f"(p50 {result.get('p50_ratio')}×; the mixed run has fewer valid requests in flight, "
                      f"its other slots being invalid ones)"]
    for name, r in runs.items():
        lines += ["", f"#### {name} (invalid share {r['invalid_share']})", "",
                  "| server lifetime | pid | up s | requests | RSS after warm-up MB | RSS at end MB | peak RSS MB | "
                  "ended by |",
                  "|---|---|---|---|---|---|---|---|"]
        for lt in r["lifetimes"]:
            lines.append(f"| {lt['no']} | {lt['pid']} | {_v(lt['up_s'])} | {lt['requests']} | "
                         f"{_mb(lt['rss_start_mb'])} | "
                         f"{_mb(lt['rss_end_mb'])} | {_mb(lt['hwm_end_mb'])} | {lt['ended_by']} |")
        lines += ["", "| check | agents | turns | responses | lost agents / turns / responses | altered | phantom | "
                      "check errors | s |", "|---|---|---|---|---|---|---|---|---|"]
        for ch in r["checks"]:
            lines.append(f"| {ch['check']} | {ch['agents']} | {ch['turns']} | {ch['responses']} | "
                         f"{ch['lost_agents']} / "
                         f"{ch['lost_turns']} / {ch['lost_responses']} | {ch['altered']} | {ch['phantom']} | "
                         f"{ch['errors']} | {ch['seconds']} |")
        lines += ["", "Per kind (latency: valid kinds over complete answers, invalid ones over any answer):", "",
                  "| kind | valid | requests | 2xx | 4xx | 5xx | errors in 200 streams | conn. errors | p50 ms | "
                  "p95 ms |",
                  "|---|---|---|---|---|---|---|---|---|---|"]
        for kind, k in r["kinds"].items():
            lines.append(f"| {kind} | {'yes' if k['valid'] else 'no'} | {k['n']} | {k['2xx']} | {k['4xx']} | "
                         f"{k['5xx']} | "
                         f"{k['stream_errors']} | {k['conn']} | {_v(k['p50_ms'])} | {_v(k['p95_ms'])} |")
        titles = {"5xx": "5xx answers (first ones, with the request)", "stream_errors": "error events in 200 streams",
                  "valid_refused": "valid requests refused",
                  "invalid_accepted": "invalid requests answered 2xx (lenient, or a missing check)",
                  "lost": "lost, altered or phantom writes",
                  "other_connection_errors": "connection errors outside restarts", "crashes": "crashes",
                  "check_errors": "check errors", "server_log": "errors in the server's log (first ones)"}
        for key, title in titles.items():
            items = r["examples"].get(key)
            if items:
                lines += ["", f"{title}:", "", "```", *(x for item in items[:5] for x in (item, "")), "```"]
        if r.get("data_dir"):
            lines += ["", f"data and server logs kept in `{r['data_dir']}`"]
    return "\n".join(lines)


def resolve_model(ref: str) -> Path:
    from runtime.models import resolve_model_path
    from runtime.tiny import PRESETS

    if ref in PRESETS:
        ref = "tiny:" + ref
    return resolve_model_path(ref)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--model", default="bench-80m",
                        help="a tiny preset (bench-80m: the 80M random-weight model; tiny-qwen3 for quick runs), "
                             "tiny:PRESET, or a local model directory")
    parser.add_argument("--minutes", type=float, default=20, help="traffic per run (default 20)")
    parser.add_argument("--clients", type=int, default=16, help="concurrent client workers (default 16)")
    parser.add_argument("--restart-every", type=float, default=300, help="seconds between kill -9s (default 300)")
    parser.add_argument("--invalid-share", type=float, default=0.3, help="share of invalid requests (0: baseline)")
    parser.add_argument("--compare", action="store_true",
                        help="run the baseline (invalid share 0), then the mixed run; report both and the p95 ratio")
    parser.add_argument("--max-tokens", type=int, default=16, help="largest max_tokens of a valid request")
    parser.add_argument("--huge-bytes", type=int, default=8 << 20,
                        help="largest huge body (default 8 MiB; a quarter of them this size, the rest an eighth)")
    parser.add_argument("--timeout", type=float, default=180, help="client timeout per request, seconds")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--keep", action="store_true", help="keep each run's data directory and server logs")
    parser.add_argument("--json", help="also write the full result here")
    args = parser.parse_args(argv)
    if not 0 <= args.invalid_share <= 1:
        parser.error("--invalid-share is a fraction from 0 to 1")

    from flow.cli import blas

    blas.advise()
    print(f"model {args.model}: building or locating it…", file=sys.stderr)
    model_dir = resolve_model(args.model)
    plan = [("baseline", 0.0), ("mixed", args.invalid_share)] if args.compare else \
        [("mixed" if args.invalid_share else "baseline", args.invalid_share)]
    result: dict[str, Any] = {
        "model": args.model, "model_dir": str(model_dir), "minutes": args.minutes, "clients": args.clients,
        "restart_every": args.restart_every, "max_tokens": args.max_tokens, "huge_bytes": args.huge_bytes,
        "openblas": blas.openblas_active() or blas.preload_env() is not None, "cpus": os.cpu_count(),
        "command": " ".join([Path(sys.executable).name, *sys.argv]), "load_average_before": os.getloadavg(),
        "runs": {},
    }
    for label, share in plan:
        result["runs"][label] = trio.run(Soak(args, model_dir, share, label).run)
    result["load_average_after"] = os.getloadavg()
    runs = result["runs"]
    if "baseline" in runs and "mixed" in runs:
        base, mixed = runs["baseline"]["valid_latency_ms"], runs["mixed"]["valid_latency_ms"]
        for q in ("p95", "p50"):
            result[f"{q}_ratio"] = round(mixed[q] / base[q], 2) if mixed[q] and base[q] else None
    return report(result, args.json, markdown)


if __name__ == "__main__":
    sys.exit(main())
