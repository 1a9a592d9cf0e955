"""Prefix cache: an agent's multi-turn conversation, cold against cached, and ``mlx_lm.server`` beside it.

Run (OpenBLAS preloaded first, as the test script does)::

    eval "$(.venv/bin/python -m flow.cli.blas)"
    .venv/bin/python scripts/bench_prefix.py --model tiny:bench-80m --json bench-prefix.json

    # a hybrid model beside the dense one, turn by turn in one run
    .venv/bin/python scripts/bench_prefix.py --model tiny:bench-80m --model tiny:bench-qwen3.5 --turns 12 \
        --system-tokens 3600 --no-mlx-lm --json bench-prefix.json

A conversation of ``--turns`` turns under a system prompt of about
``--system-tokens`` tokens (an agent's harness: instructions and tool
descriptions). Each turn adds a user message; the answer (``--answer-tokens``,
greedy) comes from the cached flow server and goes into the history, so every
system sees the very same messages. Time to first token (TTFT) of a turn is
the time of a ``max_tokens = 1`` request for it: prefill plus one token.

Systems, all in subprocesses on the same model:

* **flow, cold**: ``graphs/default.toml`` without its ``prefix_cache`` resource;
* **flow, cached**: with it (memory and disk tiers; the disk tier in a temporary
  directory), then restarted over the same directory to resume the conversation;
* **mlx_lm.server**: with its own prompt cache, same requests.

Several ``--model`` options run their conversations side by side: each model's own servers, its turns
interleaved with the others' (which model goes first alternates from turn to turn), so every model meets the
same load on a shared machine. The servers run ``flow`` from ``--source`` (a checkout; default this one).

On a hybrid model (``--model tiny:bench-qwen3.5``: recurrent layers kept as state snapshots) each turn also
reports the snapshots the cached server stored for it (the probe's and the answer's: the turn point, the
prompt's end, the finish) and their bytes. Beside each TTFT the server's CPU time for the request is read
(every thread, from ``/proc``), a cold/cached ratio that swings less with other jobs' load than the wall clock's.
``--second-turn-rounds N`` measures, apart from the conversation, N fresh two-turn conversations (each under its
own system prompt): the second turn's TTFT cold and from the cache, side by side, the order alternating from
round to round, and their medians.

Figures: TTFT per turn for each system and cold/cached ratios; a second session
with the same system prompt (its first turn's TTFT cold against cached, and the
KV bytes it adds to the cache against the bytes of its own suffix); the turn
after a restart, against cold.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

from server_env import checkout_env

ROOT = Path(__file__).resolve().parent.parent

TOPICS = ["the lamp", "the fog", "the supply boat", "the logbook", "the storm", "the gulls", "the keeper's cat",
          "the lens", "the tide tables", "the radio", "the paint", "the stairs", "the winter", "the visitors"]


def system_prompt(tokens: int, model_dir: Path) -> str:
    """An agent-harness-like system prompt: rules and tool descriptions, ``tokens`` tokens of this model."""
    from mlx_lm.utils import load_tokenizer

    tokenizer = load_tokenizer(model_dir)  # type: ignore[no-untyped-call]
    parts = ["You are Keeper, an agent that maintains a remote lighthouse. Follow the rules and use the tools."]
    i = 0
    while len(tokenizer.encode("\n".join(parts))) < tokens:
        parts.append(f"Rule {i}: when {TOPICS[i % len(TOPICS)]} needs attention, write it in the log, check the "
                     f"weather first, and report to the harbour master with the time and your initials.")
        parts.append(f'Tool tool_{i}: {{"name": "tool_{i}", "description": "Inspect {TOPICS[i % len(TOPICS)]}", '
                     f'"parameters": {{"type": "object", "properties": {{"detail": {{"type": "string"}}}}}}}}')
        i += 1
    return "\n".join(parts)


def chat(url: str, model: str, messages: list[dict[str, str]], max_tokens: int) -> tuple[float, dict[str, Any]]:
    """(seconds, response JSON) of one greedy, non-streaming chat completion."""
    started = time.perf_counter()
    r = httpx.post(url + "/v1/chat/completions", timeout=3600, json={
        "model": model, "messages": messages, "max_tokens": max_tokens, "temperature": 0})
    seconds = time.perf_counter() - started
    r.raise_for_status()
    return seconds, r.json()


def start_server(kind: str, model_dir: Path, port: int, tmp: Path, cache_dir: Path, block_tokens: int | None,
                 source: Path) -> subprocess.Popen[bytes]:
    label = f"{kind}-{model_dir.name}"
    log = (tmp / f"{label}.log").open("ab")  # the server's, from here on
    if kind == "mlx_lm.server":
        cmd = [sys.executable, "-m", "mlx_lm.server", "--model", str(model_dir), "--port", str(port),
               "--log-level", "WARNING"]
        return subprocess.Popen(cmd, cwd=tmp, stdout=subprocess.DEVNULL, stderr=log)
    graph = tmp / f"{label}.toml"
    text = (f'extends = "{source / "graphs" / "default.toml"}"\n\n[resources.model]\npath = "{model_dir}"\n'
            f'name = "bench"\naliases = []\n')
    if kind == "flow-cold":
        text = 'drop = ["prefix_cache"]\n' + text
    else:
        text += f'\n[resources.prefix_cache]\ndirectory = "{cache_dir}"\n'
        if block_tokens:
            text += f"block_tokens = {block_tokens}\n"
    graph.write_text(text)
    home = tmp / f"{label}-home"
    home.mkdir(exist_ok=True)
    env = checkout_env(source, FLOW_DATA_DIR=str(home))
    cmd = [sys.executable, "-m", "flow.cli", "--log-level", "WARNING", "serve", str(graph), "--port", str(port)]
    return subprocess.Popen(cmd, cwd=source, env=env, stdout=subprocess.DEVNULL, stderr=log)


def cpu_seconds(pid: int) -> float:
    """CPU time of every thread of process ``pid`` so far (``/proc``'s schedstat, in ns)."""
    total = 0
    for stat in Path(f"/proc/{pid}/task").glob("*/schedstat"):
        try:
            total += int(stat.read_text().split()[0])
        except (OSError, ValueError, IndexError):  # a thread that ended meanwhile
            pass
    return total / 1e9


class Server:
    def __init__(self, kind: str, model_dir: Path, tmp: Path, cache_dir: Path, block_tokens: int | None = None,
                 source: Path = ROOT) -> None:
        from scripts.bench_concurrency import free_port, wait_ready

        self.kind = kind
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.model = "default_model" if kind == "mlx_lm.server" else "bench"
        self.proc = start_server(kind, model_dir, self.port, tmp, cache_dir, block_tokens, source)
        self.last_cpu = 0.0
        wait_ready(self.url, self.proc)
        chat(self.url, self.model, [{"role": "user", "content": "warm up"}], 2)

    def ttft(self, messages: list[dict[str, str]]) -> float:
        return self.probe(messages)[0]

    def probe(self, messages: list[dict[str, str]]) -> tuple[float, int]:
        """(TTFT, prompt tokens it read from a cache) of a one-token request; the CPU time the server spent on it
        (every thread) goes to ``last_cpu``."""
        cpu = cpu_seconds(self.proc.pid)
        seconds, body = chat(self.url, self.model, messages, 1)
        self.last_cpu = cpu_seconds(self.proc.pid) - cpu
        return seconds, int((body["usage"].get("prompt_tokens_details") or {}).get("cached_tokens") or 0)

    def prefix_stats(self) -> dict[str, Any]:
        return httpx.get(self.url + "/stats", timeout=10).json()["resources"]["prefix_cache"]  # type: ignore[no-any-return]

    def kv_bytes_per_token(self) -> int:
        return int(httpx.get(self.url + "/health", timeout=10).json()["models"][0]["engine"]["kv_bytes_per_token"])

    def stop(self) -> float | None:
        from scripts.bench_concurrency import peak_rss_mb

        peak = peak_rss_mb(self.proc.pid)
        self.proc.terminate()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        return peak


class Conversation:
    """One model's agent conversation: its servers (cold, cached, ``mlx_lm.server``), system prompt and history."""

    def __init__(self, args: argparse.Namespace, model: str, tmp: Path) -> None:
        from runtime.models import resolve_model_path

        self.args = args
        self.model = model
        self.model_dir = resolve_model_path(model)
        self.tmp = tmp
        self.cache_dir = tmp / f"kv-{self.model_dir.name}"
        self.system = system_prompt(args.system_tokens, self.model_dir)
        self.cached = self.server("flow-cached")
        self.cold = self.server("flow-cold")
        self.mlx = self.server("mlx_lm.server") if args.mlx_lm else None
        self.history: list[dict[str, str]] = [{"role": "system", "content": self.system}]
        self.turns: list[dict[str, Any]] = []

    def server(self, kind: str, cache_dir: Path | None = None) -> Server:
        return Server(kind, self.model_dir, self.tmp, cache_dir or self.cache_dir, self.args.block_tokens,
                      self.args.source)

    def turn(self, turn: int) -> None:
        """The turn's TTFT cold, cached (and on ``mlx_lm.server``); then its answer, into the history. What the
        cached server stored for the turn (both requests: the probe and the answer) is read from /stats."""
        history, cached = self.history, self.cached
        history.append({"role": "user", "content": f"Turn {turn + 1}: what should I do about "
                                                   f"{TOPICS[turn % len(TOPICS)]} today?"})
        row: dict[str, Any] = {"turn": turn + 1}
        row["cold_ms"] = round(self.cold.ttft(history) * 1000, 1)
        row["cold_cpu_ms"] = round(self.cold.last_cpu * 1000, 1)
        before = cached.prefix_stats()
        seconds, row["cached_tokens"] = cached.probe(history)
        row["cached_ms"] = round(seconds * 1000, 1)
        row["cached_cpu_ms"] = round(cached.last_cpu * 1000, 1)
        if self.mlx is not None:
            row["mlx_lm_ms"] = round(self.mlx.ttft(history) * 1000, 1)
        _, answer = chat(cached.url, cached.model, history, self.args.answer_tokens)
        after = cached.prefix_stats()
        row["prompt_tokens"] = answer["usage"]["prompt_tokens"]
        row["added_bytes"] = after["hot_bytes"] - before["hot_bytes"]
        if after.get("stored_states"):
            row["snapshots"] = after["stored_states"] - before["stored_states"]
            row["snapshot_bytes"] = after["stored_state_bytes"] - before["stored_state_bytes"]
        row["speedup"] = round(row["cold_ms"] / row["cached_ms"], 1)
        row["cpu_speedup"] = round(row["cold_cpu_ms"] / row["cached_cpu_ms"], 1)
        history.append({"role": "assistant", "content": answer["choices"][0]["message"]["content"] or ""})
        self.turns.append(row)
        print(json.dumps({"model": self.model, **row}), file=sys.stderr)

    def second_session(self) -> dict[str, Any]:
        """A second session with the same system prompt: its first turn, and what it adds to the cache."""
        cold, cached, args = self.cold, self.cached, self.args
        other = [{"role": "system", "content": self.system},
                 {"role": "user", "content": "A new session: check the lens."}]
        second: dict[str, Any] = {"cold_ms": round(cold.ttft(other) * 1000, 1)}
        before = cached.prefix_stats()["hot_bytes"]
        seconds, shared = cached.probe(other)  # what it shares with the first session
        second["cached_ms"] = round(seconds * 1000, 1)
        _, answer = chat(cached.url, cached.model, other, args.answer_tokens)
        added = cached.prefix_stats()["hot_bytes"] - before
        usage = answer["usage"]
        own_tokens = usage["prompt_tokens"] + usage["completion_tokens"] - shared  # its suffix: prompt rest + answer
        own_bytes = own_tokens * cached.kv_bytes_per_token()
        second.update(speedup=round(second["cold_ms"] / second["cached_ms"], 1), shared_tokens=shared,
                      own_suffix_tokens=own_tokens, added_kv_bytes=added, own_suffix_kv_bytes=own_bytes,
                      added_over_suffix=round(added / own_bytes, 3))
        if self.mlx is not None:
            second["mlx_lm_ms"] = round(self.mlx.ttft(other) * 1000, 1)
        print(json.dumps({"model": self.model, "second_session": second}), file=sys.stderr)
        return second

    def restart(self) -> tuple[dict[str, Any], dict[str, float | None]]:
        """Restart the cached server over the same cache directory and resume the conversation; peak RSS."""
        peaks = {"flow-cached": self.cached.stop()}
        time.sleep(1)
        resumed = self.cached = self.server("flow-cached")
        history = [*self.history, {"role": "user", "content": "After the restart: what was the first thing I asked?"}]
        restart: dict[str, Any] = {"cold_ms": round(self.cold.ttft(history) * 1000, 1)}
        seconds, restart["resumed_tokens_from_cache"] = resumed.probe(history)
        restart["resumed_ms"] = round(seconds * 1000, 1)
        restart["speedup"] = round(restart["cold_ms"] / restart["resumed_ms"], 1)
        restart["disk_reads"] = resumed.prefix_stats()["disk_reads"]
        # The same history with another last message, on the resumed server: its memory tier now holds the
        # blocks, and whatever a process's first long prompt costs once (kernels for new shapes) is paid.
        again = [*history[:-1], {"role": "user", "content": "After the restart, again: what came first?"}]
        restart["resumed_again_ms"] = round(resumed.ttft(again) * 1000, 1)
        if self.mlx is not None:
            restart["mlx_lm_ms"] = round(self.mlx.ttft(history) * 1000, 1)  # not restarted: its cache is warm
        print(json.dumps({"model": self.model, "restart": restart}), file=sys.stderr)
        peaks["flow-cached (restarted)"] = resumed.stop()
        peaks["flow-cold"] = self.cold.stop()
        if self.mlx is not None:
            peaks["mlx_lm.server"] = self.mlx.stop()
        return restart, peaks

    def close(self) -> None:
        """Stop whatever servers still run (a run that failed)."""
        for server in (self.cached, self.cold, self.mlx):
            if server is not None and server.proc.poll() is None:
                server.stop()

    def result(self, second: dict[str, Any], restart: dict[str, Any], peaks: dict[str, float | None]
               ) -> dict[str, Any]:
        later = [t["speedup"] for t in self.turns[1:]]
        later_cpu = [t["cpu_speedup"] for t in self.turns[1:]]
        return {"model": self.model, "turns": self.turns, "second_session": second, "restart": restart,
                "peak_rss_mb": peaks, "min_speedup_after_first_turn": min(later) if later else None,
                "median_speedup_after_first_turn": statistics.median(later) if later else None,
                "median_cpu_speedup_after_first_turn": statistics.median(later_cpu) if later_cpu else None}


def run(args: argparse.Namespace, tmp: Path) -> list[dict[str, Any]]:
    """Every model's conversation, turn by turn side by side (which model goes first alternates), then each one's
    second session and restart, then the second-turn rounds."""
    convs: list[Conversation] = []
    try:
        for model in args.model:
            convs.append(Conversation(args, model, tmp))
        for turn in range(args.turns):
            for conv in convs if turn % 2 == 0 else reversed(convs):
                conv.turn(turn)
        seconds = [conv.second_session() for conv in convs]
        restarts = [conv.restart() for conv in convs]
    except BaseException:
        for conv in convs:
            conv.close()
        raise
    results = [conv.result(second, restart, peaks) for conv, second, (restart, peaks) in zip(convs, seconds, restarts)]
    if args.second_turn_rounds:
        for conv, result in zip(convs, results):
            result["second_turn"] = second_turn_rounds(conv)
    return results


def second_turn_rounds(conv: Conversation) -> dict[str, Any]:
    """Fresh two-turn conversations: the second turn's TTFT cold and cached, side by side, alternating which goes
    first; medians over the rounds."""
    args, model_dir = conv.args, conv.model_dir
    cached = conv.server("flow-cached", conv.tmp / f"kv-rounds-{model_dir.name}")
    cold = conv.server("flow-cold")
    rounds: list[dict[str, Any]] = []
    for i in range(args.second_turn_rounds):
        system = f"Session {i}. " + system_prompt(args.system_tokens, model_dir)  # its own: no earlier round's blocks
        history = [{"role": "system", "content": system}, {"role": "user", "content": f"Round {i}: check the lamp."}]
        _, answer = chat(cached.url, cached.model, history, args.answer_tokens)  # turn 1, on the cached server
        history += [{"role": "assistant", "content": answer["choices"][0]["message"]["content"] or "The lamp."},
                    {"role": "user", "content": "And now the fog: what next?"}]
        row: dict[str, Any] = {"round": i + 1}
        first, second = (cold, cached) if i % 2 == 0 else (cached, cold)
        for server in (first, second):
            seconds, hit = server.probe(history)
            key = "cold" if server is cold else "cached"
            row[f"{key}_ms"], row[f"{key}_tokens_from_cache"] = round(seconds * 1000, 1), hit
        rounds.append(row)
        print(json.dumps({"model": conv.model, "second_turn": row}), file=sys.stderr)
    stats = cached.prefix_stats()
    cached.stop()
    cold.stop()
    cold_ms = statistics.median(r["cold_ms"] for r in rounds)
    cached_ms = statistics.median(r["cached_ms"] for r in rounds)
    return {"rounds": rounds, "median_cold_ms": cold_ms, "median_cached_ms": cached_ms,
            "speedup": round(cold_ms / cached_ms, 1), "state_hits": stats.get("state_hits"),
            "stored_states": stats.get("stored_states"), "stored_state_bytes": stats.get("stored_state_bytes")}


def model_markdown(result: dict[str, Any]) -> str:
    """One model's tables: its turns, second session, restart and second-turn rounds."""
    mlx = "mlx_lm_ms" in result["turns"][0]
    head = "| turn | prompt tokens | read from cache | flow cold TTFT | flow cached TTFT | cold / cached |" + (
        " mlx_lm.server TTFT |" if mlx else "")
    snapshots = "snapshot_bytes" in result["turns"][0]
    head += " snapshot bytes added |" if snapshots else ""
    lines = [f"{result['model']}:", "", head, "|" + "---|" * (6 + mlx + snapshots)]
    for t in result["turns"]:
        lines.append(f"| {t['turn']} | {t['prompt_tokens']} | {t['cached_tokens']} | {t['cold_ms']:.0f} ms | "
                     f"{t['cached_ms']:.0f} ms | {t['speedup']}× |" + (f" {t['mlx_lm_ms']:.0f} ms |" if mlx else "")
                     + (f" {t['snapshot_bytes']} ({t['snapshots']}) |" if snapshots else ""))
    s, r = result["second_session"], result["restart"]
    second = (f"Second session, same system prompt: {s['cold_ms']:.0f} ms cold, {s['cached_ms']:.0f} ms cached "
              f"({s['speedup']}×); it shares {s['shared_tokens']} tokens and adds {s['added_kv_bytes']} KV bytes "
              f"for its own {s['own_suffix_tokens']}-token suffix ({s['own_suffix_kv_bytes']} bytes): "
              f"{s['added_over_suffix']}×.")
    restart = (f"After a restart: {r['cold_ms']:.0f} ms cold, {r['resumed_ms']:.0f} ms resumed from disk "
               f"({r['speedup']}×, {r['disk_reads']} blocks read, {r['resumed_tokens_from_cache']} tokens from the "
               f"cache); the next request on it {r['resumed_again_ms']:.0f} ms.")
    lines += ["", second, restart]
    rounds = result.get("second_turn")
    if rounds:
        lines += ["", "| round | second turn cold | from cache | tokens from cache |", "|---|---|---|---|"]
        lines += [f"| {r['round']} | {r['cold_ms']:.0f} ms | {r['cached_ms']:.0f} ms | {r['cached_tokens_from_cache']} |"
                  for r in rounds["rounds"]]
        lines.append(f"| median | {rounds['median_cold_ms']:.0f} ms | {rounds['median_cached_ms']:.0f} ms | "
                     f"{rounds['speedup']}× |")
    return "\n".join(lines)


def side_by_side(models: list[dict[str, Any]]) -> str:
    """The models' turns in one table: per model its prompt, cold and cached TTFT, speedup (and snapshot bytes)."""
    head, rule = "| turn |", "|---|"
    for m in models:
        snapshots = "snapshot_bytes" in m["turns"][0]
        head += f" {m['model']}: prompt / from cache | cold | cached | cold / cached | (CPU time) |"
        head += " snapshot bytes (count) |" if snapshots else ""
        rule += "---|" * (5 + snapshots)
    lines = [head, rule]
    for i in range(len(models[0]["turns"])):
        line = f"| {i + 1} |"
        for m in models:
            t = m["turns"][i]
            line += (f" {t['prompt_tokens']} / {t['cached_tokens']} | {t['cold_ms']:.0f} ms | {t['cached_ms']:.0f} ms |"
                     f" {t['speedup']}× | {t['cpu_speedup']}× |")
            line += f" {t['snapshot_bytes']} ({t['snapshots']}) |" if "snapshot_bytes" in t else ""
        lines.append(line)
    line = "| turns 2+: median (lowest) |"
    for m in models:
        line += (f" | | | {m['median_speedup_after_first_turn']}× ({m['min_speedup_after_first_turn']}×) | "
                 f"{m['median_cpu_speedup_after_first_turn']}× |")
        line += " |" if "snapshot_bytes" in m["turns"][0] else ""
    lines.append(line)
    return "\n".join(lines)


def markdown(result: dict[str, Any]) -> str:
    models = result["models"]
    parts = [side_by_side(models)] if len(models) > 1 else []
    return "\n\n".join([*parts, *(model_markdown(m) for m in models)])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--model", action="append", help="tiny:PRESET or a local model directory; repeat to run "
                        "several models' conversations side by side, turn by turn (default tiny:bench-80m)")
    parser.add_argument("--turns", type=int, default=12)
    parser.add_argument("--system-tokens", type=int, default=3500)
    parser.add_argument("--answer-tokens", type=int, default=48)
    parser.add_argument("--block-tokens", type=int, help="the prefix cache's block size (default: the graph's)")
    parser.add_argument("--no-mlx-lm", dest="mlx_lm", action="store_false", help="skip mlx_lm.server")
    parser.add_argument("--second-turn-rounds", type=int, default=0,
                        help="also time this many fresh conversations' second turn, cold against cached")
    parser.add_argument("--source", type=Path, default=ROOT,
                        help="the checkout of flow the servers run (default: this one)")
    parser.add_argument("--json", help="also write the full result here")
    args = parser.parse_args(argv)

    args.model = args.model or ["tiny:bench-80m"]
    args.source = args.source.resolve()
    sys.path[:0] = [str(args.source), str(ROOT)]  # flow from the checkout it serves; these scripts

    from flow.cli import blas
    from flow.cli.bench import report

    blas.advise()
    with tempfile.TemporaryDirectory(prefix="flow-bench-prefix-") as tmpdir:
        models = run(args, Path(tmpdir))
    result = {"models": models, "source": str(args.source), "openblas": blas.openblas_active(),
              "cpus": os.cpu_count(), "block_tokens": args.block_tokens, "system_tokens": args.system_tokens,
              "answer_tokens": args.answer_tokens, "command": " ".join([Path(sys.executable).name, *sys.argv])}
    return report(result, args.json, markdown)


if __name__ == "__main__":
    sys.exit(main())
