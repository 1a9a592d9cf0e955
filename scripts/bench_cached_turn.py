"""A cached turn against its floor: flow's time to first token for a conversation's next turn, against mlx-lm's.

Run (OpenBLAS preloaded first, as the test script does)::

    eval "$(.venv/bin/python -m flow.cli.blas)"
    .venv/bin/python scripts/bench_cached_turn.py --model tiny:bench-80m --model tiny:bench-qwen3.5 \\
        --prefix 1024 --prefix 4096 --prefix 16384 --rounds 5 --json cached-turn.json

    # the server from another checkout (a commit of its own: git archive COMMIT | tar -x -C DIR)
    .venv/bin/python scripts/bench_cached_turn.py --source /tmp/flow-src --prefix 1024

Per model and prefix size (``--prefix``, tokens): a conversation under a system prompt of about that size. Each
**round** is a branch of it, as a fresh session of an agent on the same harness: a first question of its own
(untimed, flow and the floor at once), answered (``--answer-tokens``, greedy, by the flow server: that answer
goes into the history), then the next turn — the history and a next question — timed twice, the order
alternating from round to round:

* **the floor**: mlx-lm alone, in this process. The cache of the turn's reusable prefix is in place: mlx-lm's
  ``make_prompt_cache``, the system prompt prefilled once, the round's first turn prefilled from there and
  answered by ``generate_step``, then the cache put back at the prefix (attention layers trimmed, recurrent
  layers' states restored from before the first turn's end, the few tokens to the prefix prefilled again, and
  room made in the attention layers' buffers for the new tokens, all untimed: mlx-lm grows a buffer 256
  positions at a time by copying the whole cache, which a floor should not count). The reusable prefix is the
  longest one the next turn's tokens share with the first turn's prompt and answer: what a perfect cache could
  reuse. Timed: ``generate_step`` on the rest of the tokens until it yields the first token. No templating,
  tokenizing or HTTP;
* **flow**: the same messages as a streamed OpenAI chat request (``max_tokens = 1``) to ``flow serve`` on the
  same model with its prefix cache, timed from the request to the first frame with the token.

Two tiers: **hot**, the server that answered the first turn (its prefix cache in memory); then **disk**, a server
over the same cache directory whose memory tier is 1 MiB, so every hit is read back from the disk tier (the
process warm, the files in the OS's page cache).

Where flow's time goes: the server runs with timers around the functions of a cached turn's path (this
script's ``traced-serve`` command: templating, tokenizing, matching, hashing, disk reads, rebuilding the cache,
prefill passes, storing blocks, the first-token pass), each call's start and end written to a file on the
clock this process reads too (``time.perf_counter``, CLOCK_MONOTONIC), so each round's TTFT is split into
them; what lies between them (HTTP in, stage hops, the device thread's wake-up, the first token's way out to the
client) is reported as gaps.

Each side's CPU time is read too (the floor: this process's; flow: the server process's, every thread, from
``/proc``, less what the server spends idle over as long: its rate is read for a second before the request).
On a machine shared with other jobs a wall-clock ratio swings with their load, the CPU each side spent on the
turn much less.

Figures, per model, prefix and tier: the medians over the rounds of the floor's and flow's TTFT and CPU time, of
their ratios per round, of the tokens each computed, and of flow's parts.
"""

from __future__ import annotations

import argparse
import functools
import importlib
import inspect
import json
import os
import runpy
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parent.parent
NEXT_QUESTION = ("Now the fog needs attention again: tell me which rule applies, which tool to call and with what "
                 "detail, what to write in the log, and what to report to the harbour master this evening, in that "
                 "order.")
FALLBACK_ANSWER = "The lamp is lit and the lens is clean."  # when the first answer has no content (all thinking)
DISK_HOT_BYTES = 1 << 20  # the disk tier's server: the smallest memory tier flow allows
IDLE_SECONDS = 1.0  # how long the server's idle CPU is read before each timed request

# What the traced server times: (module, attribute, label). A method is traced on its class (every instance).
TRACED = (
    ("flow.serve.server", "FlowServer.respond", "request"),
    ("stages.chat", "ChatPrepare.prepare", "prepare"),
    ("stages.chat", "render_prompt", "template"),
    ("runtime.prefix_cache", "PrefixCache.match", "match"),
    ("runtime.prefix_cache", "BlockKeys.upto", "hashing"),
    ("runtime.kv_disk", "DiskTier.read", "disk read"),
    ("runtime.engine", "Engine.submit_choices", "submit"),
    ("runtime.prefix_keeper", "PrefixKeeper.new_cache", "build"),
    ("runtime.prefix_keeper", "PrefixKeeper.keep", "store"),
    ("runtime.prefill", "Prefill._run_chunk", "prefill pass"),
    ("runtime.prefill", "Prefill.start", "first-token pass"),
)


# ---------------------------------------------------------------------------------------------- the traced server
def traced_serve(trace: Path, flow_args: list[str]) -> None:
    """``flow FLOW_ARGS`` with each call of :data:`TRACED` appended to ``trace`` as a JSON line: label, start, end
    (``time.perf_counter``). Run with the checkout to serve first on ``PYTHONPATH``."""
    out = trace.open("a", buffering=1)
    lock = threading.Lock()

    def write(label: str, start: float) -> None:
        line = json.dumps({"name": label, "t0": start, "t1": time.perf_counter()})
        with lock:
            out.write(line + "\n")

    def traced(fn: Callable[..., Any], label: str) -> Callable[..., Any]:
        if inspect.iscoroutinefunction(fn):
            @functools.wraps(fn)
            async def timed_async(*args: Any, **kwargs: Any) -> Any:
                start = time.perf_counter()
                try:
                    return await fn(*args, **kwargs)
                finally:
                    write(label, start)
            return timed_async

        @functools.wraps(fn)
        def timed(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                write(label, start)
        return timed

    for module, attribute, label in TRACED:
        owner_name, _, name = attribute.rpartition(".")
        owner: Any = importlib.import_module(module)
        if owner_name:
            owner = getattr(owner, owner_name, None)
        fn = getattr(owner, name, None)
        if fn is None:
            print(f"traced-serve: {module}.{attribute} not found; {label!r} is not timed", file=sys.stderr)
            continue
        setattr(owner, name, traced(fn, label))
    sys.argv = ["flow", *flow_args]
    runpy.run_module("flow.cli", run_name="__main__", alter_sys=True)


@dataclass
class Server:
    """``flow serve`` from ``source`` in a subprocess, traced: the default graph on one model, its prefix cache in
    ``cache_dir``."""

    label: str
    source: Path
    model_dir: Path
    tmp: Path
    cache_dir: Path
    hot_bytes: int | None = None
    proc: subprocess.Popen[bytes] = field(init=False)
    trace: Path = field(init=False)
    client: httpx.Client = field(init=False)
    url: str = field(init=False)

    def __post_init__(self) -> None:
        from scripts.bench_concurrency import free_port, wait_ready

        port = free_port()
        self.url = f"http://127.0.0.1:{port}"
        graph = self.tmp / f"{self.label}.toml"
        text = (f'extends = "{self.source / "graphs" / "default.toml"}"\n\n[resources.model]\npath = "{self.model_dir}"\n'
                f'name = "bench"\naliases = []\n\n[resources.prefix_cache]\ndirectory = "{self.cache_dir}"\n')
        if self.hot_bytes is not None:
            text += f"hot_bytes = {self.hot_bytes}\n"
        graph.write_text(text)
        self.trace = self.tmp / f"{self.label}.trace.jsonl"
        self.trace.write_text("")
        home = self.tmp / f"{self.label}-home"
        home.mkdir(exist_ok=True)
        env = {**os.environ, "PYTHONPATH": str(self.source), "FLOW_DATA_DIR": str(home)}
        cmd = [sys.executable, str(Path(__file__).resolve()), "traced-serve", str(self.trace), "--", "--log-level",
               "WARNING", "serve", str(graph), "--port", str(port)]
        log = (self.tmp / f"{self.label}.log").open("ab")
        self.proc = subprocess.Popen(cmd, cwd=self.tmp, env=env, stdout=subprocess.DEVNULL, stderr=log)
        wait_ready(self.url, self.proc)
        self.client = httpx.Client(base_url=self.url, timeout=6 * 3600)  # a first prefill of 16K tokens on a busy CPU
        self.complete([{"role": "user", "content": "warm up"}], 2)

    def complete(self, messages: list[dict[str, str]], max_tokens: int) -> dict[str, Any]:
        """One greedy, non-streamed chat completion's response."""
        r = self.client.post("/v1/chat/completions", json={
            "model": "bench", "messages": messages, "max_tokens": max_tokens, "temperature": 0})
        r.raise_for_status()
        return r.json()  # type: ignore[no-any-return]

    def first_token(self, messages: list[dict[str, str]]) -> dict[str, Any]:
        """A streamed one-token request: when it was sent, when its token's frame came, its usage."""
        body = {"model": "bench", "messages": messages, "max_tokens": 1, "temperature": 0, "stream": True,
                "stream_options": {"include_usage": True}}
        from scripts.bench_prefix import cpu_seconds

        usage: dict[str, Any] = {}
        first = None
        idle = cpu_seconds(self.proc.pid)
        time.sleep(IDLE_SECONDS)  # the server's own background CPU (its event-loop watch, pollers), while idle
        cpu = cpu_seconds(self.proc.pid)
        idle = (cpu - idle) / IDLE_SECONDS
        sent = time.perf_counter()
        with self.client.stream("POST", "/v1/chat/completions", json=body) as r:
            r.raise_for_status()
            for line in r.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                frame = json.loads(line[6:])
                if first is None and any(c["delta"].get("content") or c["delta"].get("reasoning_content")
                                         or c.get("finish_reason") for c in frame.get("choices", [])):
                    first = time.perf_counter()
                    cpu = cpu_seconds(self.proc.pid) - cpu
                usage = frame.get("usage") or usage
        if first is None:
            raise RuntimeError("the stream ended without a token")
        details = usage.get("prompt_tokens_details") or {}
        return {"sent": sent, "first": first, "cpu": cpu, "idle_cpu": idle * (first - sent),
                "prompt_tokens": usage["prompt_tokens"],
                "cached_tokens": int(details.get("cached_tokens") or 0)}

    def prefix_stats(self) -> dict[str, Any]:
        return self.client.get("/stats").json()["resources"]["prefix_cache"]  # type: ignore[no-any-return]

    def events(self) -> list[dict[str, Any]]:
        return [json.loads(line) for line in self.trace.read_text().splitlines() if line.strip()]

    def stop(self) -> None:
        self.client.close()
        self.proc.terminate()
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.proc.kill()


# ---------------------------------------------------------------------------------------------- the floor
class Floor:
    """mlx-lm alone in this process, for one conversation: its cache put back at a turn's reusable prefix, then
    ``generate_step`` on the rest of the turn's tokens until the first token.

    The shared system prompt is prefilled once, up to ``base`` (before the first user message). A round's first
    turn branches off there: restored to ``base``, its first question prefilled and answered (``generate_step``,
    greedy), the cache remembered at ``keep`` on the way (before whatever the next turn renders differently)."""

    def __init__(self, model: Any, prompt: list[int], base: int) -> None:
        from mlx_lm.models.cache import make_prompt_cache

        self.model = model
        self.cache = make_prompt_cache(model)
        self._prefill(prompt[:base])
        self.base, self.base_states = base, self._states()
        self.keep, self.keep_states = base, self.base_states
        self.turn: list[int] = []  # the round's first turn: its prompt and answer

    def _states(self) -> list[list[Any] | None]:
        """The recurrent layers' states now (their arrays are replaced, never changed, by later passes)."""
        return [list(c.cache) if _recurrent(c) else None for c in self.cache]

    def _restore(self, position: int, states: list[list[Any] | None]) -> None:
        for layer, state in zip(self.cache, states):
            if state is None:
                layer.trim(layer.offset - position)
            else:
                layer.cache = list(state)

    def _make_room(self, tokens: int) -> None:
        """Grow the attention layers' buffers, untimed, to hold ``tokens`` more: mlx-lm grows them 256 positions at
        a time, copying the whole cache, and a floor should not count that copy for the turns that cross a step."""
        import mlx.core as mx

        for layer in self.cache:
            if not _recurrent(layer) and layer.keys is not None and layer.offset + tokens > layer.keys.shape[2]:
                room = mx.zeros((*layer.keys.shape[:2], tokens, layer.keys.shape[3]), layer.keys.dtype)
                layer.update_and_fetch(room, mx.zeros((*room.shape[:3], layer.values.shape[3]), layer.values.dtype))
                layer.trim(tokens)
        mx.eval([c.state for c in self.cache])

    def _prefill(self, tokens: list[int], step: int = 512) -> None:
        import mlx.core as mx

        for start in range(0, len(tokens), step):
            self.model(mx.array(tokens[start : start + step])[None], cache=self.cache)
            mx.eval([c.state for c in self.cache])
        mx.clear_cache()

    def branch(self, prompt: list[int], keep: int, answer_tokens: int) -> list[int]:
        """A round's first turn from the system prompt's cache: its greedy answer's tokens."""
        import mlx.core as mx
        from mlx_lm.generate import generate_step

        self._restore(self.base, self.base_states)
        self._prefill(prompt[self.base : keep])
        self.keep, self.keep_states = keep, self._states()
        answer = [int(token) for token, _ in generate_step(mx.array(prompt[keep:]), self.model,
                                                            prompt_cache=self.cache, max_tokens=answer_tokens)]
        mx.synchronize()
        self.turn = prompt + answer
        return answer

    def time_turn(self, tokens: list[int]) -> tuple[float, float, int]:
        """Seconds from the next turn's new tokens to its first token, the cache at its reusable prefix (wall and
        this process's CPU time); that prefix."""
        import mlx.core as mx
        from mlx_lm.generate import generate_step

        prefix = min(_common(tokens, self.turn), len(tokens) - 1)
        if prefix < self.keep:
            raise RuntimeError(f"the turn shares {prefix} tokens, fewer than the {self.keep} kept")
        self._restore(self.keep, self.keep_states)
        self._prefill(tokens[self.keep : prefix])
        self._make_room(len(tokens) - prefix)
        cpu = time.process_time()
        start = time.perf_counter()
        next(generate_step(mx.array(tokens[prefix:]), self.model, prompt_cache=self.cache, max_tokens=1))
        seconds = time.perf_counter() - start
        cpu = time.process_time() - cpu
        mx.synchronize()  # generate_step has queued the next token's pass: done before anything else is timed
        return seconds, cpu, prefix


def _recurrent(layer: Any) -> bool:
    from mlx_lm.models.cache import ArraysCache

    return isinstance(layer, ArraysCache)


def _common(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


# ---------------------------------------------------------------------------------------------- a conversation
@dataclass
class Conversation:
    """One prefix size's conversation: a system prompt; each round a branch of it, a first question of its own
    and that question's answer, then the next turn (timed)."""

    prefix: int
    system: str
    tokenizer: Any
    branches: int = 0
    floor: Floor | None = None

    def first_turn(self) -> list[dict[str, str]]:
        """A new branch's first turn: a question no branch asked before (its first word differs)."""
        from scripts.bench_prefix import TOPICS

        self.branches += 1
        topic = TOPICS[self.branches % len(TOPICS)]
        return [{"role": "system", "content": self.system},
                {"role": "user", "content": f"{self.branches}. Check {topic} and tell me what you see."}]

    @staticmethod
    def next_turn(first: list[dict[str, str]], answer: str) -> list[dict[str, str]]:
        return [*first, {"role": "assistant", "content": answer}, {"role": "user", "content": NEXT_QUESTION}]

    def tokens(self, messages: list[dict[str, str]]) -> list[int]:
        """The prompt's tokens as flow renders them for these plain messages (checked against its usage)."""
        text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def keep(self, first: list[dict[str, str]]) -> int:
        """Where the floor keeps a first turn's cache: before whatever the next turn renders differently."""
        probe = self.next_turn(first, "Yes.")
        return max(0, _common(self.tokens(first), self.tokens(probe)) - 8)


def together(flow: Callable[[], Any], floor: Callable[[], Any]) -> tuple[Any, Any]:
    """Run flow's request (in a thread) and the floor's work at once (neither is timed: the machine is shared,
    and each waits on the other's CPU otherwise); their results."""
    out: dict[str, Any] = {}

    def ask() -> None:
        try:
            out["flow"] = flow()
        except (httpx.HTTPError, ValueError, RuntimeError) as exc:  # raised again below, in the main thread
            out["error"] = exc

    asking = threading.Thread(target=ask)
    asking.start()
    floor_result = floor()
    asking.join()
    if "error" in out:
        raise out["error"]
    return out["flow"], floor_result


def start(conv: Conversation, server: Server, model: Any) -> dict[str, Any]:
    """The system prompt, prefilled by flow (a first request of it) and by the floor."""
    first, other = conv.first_turn(), conv.first_turn()
    base = max(0, _common(conv.tokens(first), conv.tokens(other)) - 4)  # the branches' shared start
    started = time.perf_counter()
    body, conv.floor = together(lambda: server.complete(first, 1),
                                lambda: Floor(model, conv.tokens(first), base))
    return {"prefix": conv.prefix, "system_tokens": base, "prompt_tokens": body["usage"]["prompt_tokens"],
            "prefill_ms_both": round((time.perf_counter() - started) * 1000)}


def settle(server: Server, timeout: float = 60) -> None:
    """Wait until the disk tier has written what it was given (its count of written blocks stands still)."""
    deadline = time.monotonic() + timeout
    written = -1
    while time.monotonic() < deadline:
        now = server.prefix_stats().get("disk", {}).get("written", 0)
        if now == written:
            return
        written = now
        time.sleep(0.5)


# ---------------------------------------------------------------------------------------------- one round
def breakdown(events: list[dict[str, Any]], sent: float, first: float) -> dict[str, float]:
    """Flow's part of one round, in ms: each traced function's own time within [sent, first] and the gaps."""
    window = [e for e in events if e["t0"] >= sent - 1e-4 and e["t0"] <= first]

    def named(name: str) -> list[dict[str, Any]]:
        return [e for e in window if e["name"] == name]

    def total(items: list[dict[str, Any]]) -> float:
        return float(sum(e["t1"] - e["t0"] for e in items))

    def inside(name: str, outer: list[dict[str, Any]]) -> list[dict[str, Any]]:
        return [e for e in named(name) if any(o["t0"] <= e["t0"] and e["t1"] <= o["t1"] for o in outer)]

    request, prepare_, match = named("request"), named("prepare"), named("match")
    submit, start = named("submit"), named("first-token pass")
    chunks, builds = named("prefill pass"), named("build")
    if not (request and prepare_ and match and submit and start):
        raise RuntimeError(f"the trace lacks a step of this round: {sorted({e['name'] for e in window})}")
    start_ = start[0]
    stores = [e for e in named("store") if e["t0"] < start_["t0"]]  # after the first token: not on its path
    template = total(inside("template", prepare_))
    hashing = total(inside("hashing", match))
    disk = total(inside("disk read", match))
    device = [*builds, *chunks, start_]
    device_start = min(e["t0"] for e in device)
    own = total(builds) + total(chunks) + total([start_]) - total(inside("build", chunks))
    passes = total(chunks) - total(inside("store", chunks)) - total(inside("build", chunks))
    parts = {
        "http in": request[0]["t0"] - sent,
        "to prepare": prepare_[0]["t0"] - request[0]["t0"],
        "template": template,
        "tokenize + checks": total(prepare_) - template,
        "to match": match[0]["t0"] - prepare_[0]["t1"],
        "hashing": hashing,
        "disk read": disk,
        "lookup": total(match) - hashing - disk,
        "to submit": submit[0]["t0"] - match[0]["t1"],
        "device wake-up": device_start - submit[0]["t0"],
        "build": total(builds),
        "prefill passes": passes,
        "store": total(stores),
        "first-token pass": total([start_]),
        "device other": (start_["t1"] - device_start) - own,
        "token out": first - start_["t1"],
    }
    out = {key: round(seconds * 1000, 2) for key, seconds in parts.items()}
    out["prefill passes (count)"] = len(chunks)
    return out


def run_round(conv: Conversation, server: Server, floor_first: bool, answer_tokens: int) -> dict[str, Any]:
    """A new branch's first turn (flow and the floor at once, untimed), then its next turn, timed on both."""
    floor = conv.floor
    assert floor is not None
    first = conv.first_turn()
    prompt, keep = conv.tokens(first), conv.keep(first)
    body, floor_answer = together(lambda: server.complete(first, answer_tokens),
                                  lambda: floor.branch(prompt, keep, answer_tokens))
    if body["usage"]["prompt_tokens"] != len(prompt):
        raise RuntimeError(f"flow counted {body['usage']['prompt_tokens']} prompt tokens, this script {len(prompt)}:"
                           " the floor would time another prompt")
    content = body["choices"][0]["message"].get("content")
    said = conv.tokenizer.decode(floor_answer[: body["usage"]["completion_tokens"]])
    settle(server)
    messages = conv.next_turn(first, content or FALLBACK_ANSWER)
    tokens = conv.tokens(messages)
    row: dict[str, Any] = {"prompt_tokens": len(tokens), "answers_equal": said == content if content else None}
    before = server.prefix_stats()
    for side in ("floor", "flow") if floor_first else ("flow", "floor"):
        if side == "floor":
            seconds, cpu, prefix = floor.time_turn(tokens)
            row.update(floor_ms=round(seconds * 1000, 1), floor_cpu_ms=round(cpu * 1000, 1), floor_prefix=prefix,
                       floor_new_tokens=len(tokens) - prefix)
            continue
        got = server.first_token(messages)
        if got["prompt_tokens"] != len(tokens):
            raise RuntimeError(f"flow counted {got['prompt_tokens']} prompt tokens, this script {len(tokens)}")
        row.update(flow_ms=round((got["first"] - got["sent"]) * 1000, 1),
                   flow_cpu_ms=round((got["cpu"] - got["idle_cpu"]) * 1000, 1),
                   flow_idle_cpu_ms=round(got["idle_cpu"] * 1000, 1),
                   flow_cached=got["cached_tokens"], flow_new_tokens=len(tokens) - got["cached_tokens"],
                   parts=breakdown(server.events(), got["sent"], got["first"]))
    after = server.prefix_stats()
    row["disk_reads"] = after["disk_reads"] - before["disk_reads"]
    row["state_hits"] = after["state_hits"] - before["state_hits"]
    row["ratio"] = round(row["flow_ms"] / row["floor_ms"], 2)
    row["cpu_ratio"] = round(row["flow_cpu_ms"] / row["floor_cpu_ms"], 2)
    return row


def rounds(conv: Conversation, server: Server, args: argparse.Namespace, tier: str) -> dict[str, Any]:
    """``args.warmup`` untimed rounds, then ``args.rounds`` rounds alternating which side goes first; medians."""
    for i in range(args.warmup):
        run_round(conv, server, i % 2 == 0, args.answer_tokens)
    rows = []
    for i in range(args.rounds):
        row = run_round(conv, server, i % 2 == 0, args.answer_tokens)
        rows.append(row)
        print(json.dumps({"prefix": conv.prefix, "tier": tier, **row}), file=sys.stderr)
        time.sleep(0.5)  # the disk tier's writes of the round's own blocks settle
    parts = {key: statistics.median(r["parts"][key] for r in rows) for key in rows[0]["parts"]}
    med = {key: statistics.median(r[key] for r in rows)
           for key in ("floor_ms", "flow_ms", "ratio", "floor_cpu_ms", "flow_cpu_ms", "cpu_ratio", "floor_new_tokens", "flow_new_tokens", "floor_prefix",
                       "flow_cached", "prompt_tokens", "disk_reads", "state_hits")}
    return {"prefix": conv.prefix, "tier": tier, "rounds": rows, "median": med, "parts": parts}


# ---------------------------------------------------------------------------------------------- the run
def measure(args: argparse.Namespace, model_ref: str, tmp: Path) -> dict[str, Any]:
    from mlx_lm.utils import load

    from runtime.models import resolve_model_path
    from scripts.bench_prefix import system_prompt

    model_dir = resolve_model_path(model_ref)
    model, tokenizer = load(str(model_dir))[:2]
    cache_dir = tmp / f"kv-{model_dir.name}"
    convs = [Conversation(size, f"Session {size}. " + system_prompt(size, model_dir), tokenizer)
             for size in args.prefix]
    out: dict[str, Any] = {"model": model_ref, "system_prompts": [], "cells": []}
    hot = Server(f"{model_dir.name}-hot", args.source, model_dir, tmp, cache_dir)
    try:
        for conv in convs:
            out["system_prompts"].append(start(conv, hot, model))
            print(json.dumps({"model": model_ref, "system_prompt": out["system_prompts"][-1]}), file=sys.stderr)
            out["cells"].append(rounds(conv, hot, args, "hot"))
    finally:
        hot.stop()
    if args.disk:
        disk = Server(f"{model_dir.name}-disk", args.source, model_dir, tmp, cache_dir, DISK_HOT_BYTES)
        try:
            for conv in convs:
                out["cells"].append(rounds(conv, disk, args, "disk"))
        finally:
            disk.stop()
    return out


def markdown(result: dict[str, Any]) -> str:
    head = ("| model | prefix | tier | new tokens: floor / flow | floor TTFT | flow TTFT | flow / floor | "
            "CPU: floor / flow | flow / floor (CPU) |")
    lines = [head, "|---|---|---|---|---|---|---|---|---|"]
    for model in result["models"]:
        for cell in model["cells"]:
            m = cell["median"]
            lines.append(f"| {model['model']} | {m['floor_prefix']:.0f} | {cell['tier']} | "
                         f"{m['floor_new_tokens']:.0f} / {m['flow_new_tokens']:.0f} | {m['floor_ms']:.0f} ms | "
                         f"{m['flow_ms']:.0f} ms | **{m['ratio']:.2f}×** | {m['floor_cpu_ms']:.0f} / "
                         f"{m['flow_cpu_ms']:.0f} ms | {m['cpu_ratio']:.2f}× |")
    keys = list(result["models"][0]["cells"][0]["parts"])
    lines += ["", "Flow's TTFT by part (ms, medians over the rounds):", "",
              "| model | prefix | tier | " + " | ".join(keys) + " |", "|---|---|---|" + "---|" * len(keys)]
    for model in result["models"]:
        for cell in model["cells"]:
            lines.append(f"| {model['model']} | {cell['median']['floor_prefix']:.0f} | {cell['tier']} | "
                         + " | ".join(f"{cell['parts'][k]:.1f}" if not k.endswith("(count)")
                                      else f"{cell['parts'][k]:.0f}" for k in keys) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["traced-serve"]:  # the server's own process: nothing of this checkout goes on its path
        split = argv.index("--")
        traced_serve(Path(argv[1]), argv[split + 1 :])
        return 0
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--model", action="append", help="tiny:PRESET or a local model directory (repeat; default "
                        "tiny:bench-80m and tiny:bench-qwen3.5)")
    parser.add_argument("--prefix", action="append", type=int, help="tokens of the system prompt (repeat; default "
                        "1024 and 4096)")
    parser.add_argument("--rounds", type=int, default=5, help="timed rounds per cell")
    parser.add_argument("--warmup", type=int, default=1, help="untimed rounds before them")
    parser.add_argument("--answer-tokens", type=int, default=16, help="each round's first answer")
    parser.add_argument("--no-disk", dest="disk", action="store_false", help="the hot tier only")
    parser.add_argument("--source", type=Path, default=ROOT, help="the checkout flow serves from (default: this one)")
    parser.add_argument("--json", help="also write the full result here")
    args = parser.parse_args(argv)
    args.model = args.model or ["tiny:bench-80m", "tiny:bench-qwen3.5"]
    args.prefix = args.prefix or [1024, 4096]
    args.source = args.source.resolve()
    sys.path[:0] = [str(args.source), str(ROOT)]  # flow from the checkout it serves; these scripts

    from flow.cli import blas
    from flow.cli.bench import report

    blas.advise()
    with tempfile.TemporaryDirectory(prefix="flow-bench-cached-turn-") as tmpdir:
        models = [measure(args, model, Path(tmpdir)) for model in args.model]
    commit = subprocess.run(["git", "-C", str(args.source), "rev-parse", "--short", "HEAD"], check=False,
                            capture_output=True, text=True).stdout.strip()
    result = {"models": models, "source": str(args.source), "source_commit": commit or None,
              "openblas": blas.openblas_active(), "cpus": os.cpu_count(), "rounds": args.rounds,
              "warmup": args.warmup, "answer_tokens": args.answer_tokens,
              "command": " ".join([Path(sys.executable).name, *sys.argv])}
    return report(result, args.json, markdown)


if __name__ == "__main__":
    sys.exit(main())
