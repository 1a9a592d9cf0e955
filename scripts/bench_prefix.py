"""Prefix cache: an agent's multi-turn conversation, cold against cached, and ``mlx_lm.server`` beside it.

Run (OpenBLAS preloaded first, as the test script does)::

    eval "$(.venv/bin/python -m flow.cli.blas)"
    .venv/bin/python scripts/bench_prefix.py --model tiny:bench-80m --json bench-prefix.json

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

On a hybrid model (``--model tiny:bench-qwen3.5``: recurrent layers kept as state snapshots) each turn also
reports the snapshot bytes and the KV bytes it added to the cache. ``--second-turn-rounds N`` measures, apart
from the conversation, N fresh two-turn conversations (each under its own system prompt): the second turn's TTFT
cold and from the cache, side by side, the order alternating from round to round, and their medians.

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

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from flow.cli.bench import report  # noqa: E402
from scripts.bench_concurrency import free_port, peak_rss_mb, wait_ready  # noqa: E402

TOPICS = ["the lamp", "the fog", "the supply boat", "the logbook", "the storm", "the gulls", "the keeper's cat",
          "the lens", "the tide tables", "the radio", "the paint", "the stairs", "the winter", "the visitors"]


def system_prompt(tokens: int, model_dir: Path) -> str:
    """An agent-harness-like system prompt: rules and tool descriptions, ``tokens`` tokens of this model."""
    from mlx_lm.utils import load_tokenizer

    tokenizer = load_tokenizer(model_dir)
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
    r = httpx.post(url + "/v1/chat/completions", timeout=600, json={
        "model": model, "messages": messages, "max_tokens": max_tokens, "temperature": 0})
    seconds = time.perf_counter() - started
    r.raise_for_status()
    return seconds, r.json()


def start_server(kind: str, model_dir: Path, port: int, tmp: Path, cache_dir: Path, block_tokens: int | None
                 ) -> subprocess.Popen[bytes]:
    log = open(tmp / f"{kind}.log", "ab")
    if kind == "mlx_lm.server":
        cmd = [sys.executable, "-m", "mlx_lm.server", "--model", str(model_dir), "--port", str(port),
               "--log-level", "WARNING"]
        return subprocess.Popen(cmd, cwd=tmp, stdout=subprocess.DEVNULL, stderr=log)
    graph = tmp / f"{kind}.toml"
    text = (f'extends = "{ROOT / "graphs" / "default.toml"}"\n\n[resources.model]\npath = "{model_dir}"\n'
            f'name = "bench"\naliases = []\n')
    if kind == "flow-cold":
        text = 'drop = ["prefix_cache"]\n' + text
    else:
        text += f'\n[resources.prefix_cache]\ndirectory = "{cache_dir}"\n'
        if block_tokens:
            text += f"block_tokens = {block_tokens}\n"
    graph.write_text(text)
    cmd = [str(Path(sys.executable).parent / "flow"), "--log-level", "WARNING", "serve", str(graph), "--port",
           str(port)]
    return subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=log)


class Server:
    def __init__(self, kind: str, model_dir: Path, tmp: Path, cache_dir: Path, block_tokens: int | None = None
                 ) -> None:
        self.kind = kind
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.model = "default_model" if kind == "mlx_lm.server" else "bench"
        self.proc = start_server(kind, model_dir, self.port, tmp, cache_dir, block_tokens)
        wait_ready(self.url, self.proc)
        chat(self.url, self.model, [{"role": "user", "content": "warm up"}], 2)

    def ttft(self, messages: list[dict[str, str]]) -> float:
        return self.probe(messages)[0]

    def probe(self, messages: list[dict[str, str]]) -> tuple[float, int]:
        """(TTFT, prompt tokens it read from a cache) of a one-token request."""
        seconds, body = chat(self.url, self.model, messages, 1)
        return seconds, int((body["usage"].get("prompt_tokens_details") or {}).get("cached_tokens") or 0)

    def prefix_stats(self) -> dict[str, Any]:
        return httpx.get(self.url + "/stats", timeout=10).json()["resources"]["prefix_cache"]  # type: ignore[no-any-return]

    def kv_bytes_per_token(self) -> int:
        return int(httpx.get(self.url + "/health", timeout=10).json()["models"][0]["engine"]["kv_bytes_per_token"])

    def stop(self) -> float | None:
        peak = peak_rss_mb(self.proc.pid)
        self.proc.terminate()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        return peak


def run(args: argparse.Namespace, model_dir: Path, tmp: Path) -> dict[str, Any]:
    cache_dir = tmp / "kv-cache"
    system = system_prompt(args.system_tokens, model_dir)
    cached = Server("flow-cached", model_dir, tmp, cache_dir, args.block_tokens)
    cold = Server("flow-cold", model_dir, tmp, cache_dir)
    mlx = Server("mlx_lm.server", model_dir, tmp, cache_dir) if args.mlx_lm else None
    turns: list[dict[str, Any]] = []
    history: list[dict[str, str]] = [{"role": "system", "content": system}]
    for turn in range(args.turns):
        history.append({"role": "user", "content": f"Turn {turn + 1}: what should I do about "
                                                   f"{TOPICS[turn % len(TOPICS)]} today?"})
        row: dict[str, Any] = {"turn": turn + 1}
        row["cold_ms"] = round(cold.ttft(history) * 1000, 1)
        seconds, row["cached_tokens"] = cached.probe(history)
        row["cached_ms"] = round(seconds * 1000, 1)
        if mlx is not None:
            row["mlx_lm_ms"] = round(mlx.ttft(history) * 1000, 1)
        before = cached.prefix_stats()
        _, answer = chat(cached.url, cached.model, history, args.answer_tokens)
        after = cached.prefix_stats()
        row["prompt_tokens"] = answer["usage"]["prompt_tokens"]
        row["added_bytes"] = after["hot_bytes"] - before["hot_bytes"]
        if after.get("stored_states"):
            row["snapshots"] = after["stored_states"] - before["stored_states"]
            row["snapshot_bytes"] = after["stored_state_bytes"] - before["stored_state_bytes"]
        row["speedup"] = round(row["cold_ms"] / row["cached_ms"], 1)
        history.append({"role": "assistant", "content": answer["choices"][0]["message"]["content"]})
        turns.append(row)
        print(json.dumps(row), file=sys.stderr)

    # A second session with the same system prompt: its first turn, and what it adds to the cache.
    other = [{"role": "system", "content": system}, {"role": "user", "content": "A new session: check the lens."}]
    second: dict[str, Any] = {"cold_ms": round(cold.ttft(other) * 1000, 1)}
    before = cached.prefix_stats()["hot_bytes"]
    seconds, shared = cached.probe(other)  # what it shares with the first session
    second["cached_ms"] = round(seconds * 1000, 1)
    _, answer = chat(cached.url, cached.model, other, args.answer_tokens)
    added = cached.prefix_stats()["hot_bytes"] - before
    usage = answer["usage"]
    own_tokens = usage["prompt_tokens"] + usage["completion_tokens"] - shared  # its suffix: prompt rest + answer
    second.update(speedup=round(second["cold_ms"] / second["cached_ms"], 1), shared_tokens=shared,
                  own_suffix_tokens=own_tokens, added_kv_bytes=added,
                  own_suffix_kv_bytes=own_tokens * cached.kv_bytes_per_token(),
                  added_over_suffix=round(added / (own_tokens * cached.kv_bytes_per_token()), 3))
    if mlx is not None:
        second["mlx_lm_ms"] = round(mlx.ttft(other) * 1000, 1)
    print(json.dumps({"second_session": second}), file=sys.stderr)

    # Restart the cached server over the same cache directory and resume the conversation.
    peaks = {"flow-cached": cached.stop()}
    time.sleep(1)
    resumed = Server("flow-cached", model_dir, tmp, cache_dir, args.block_tokens)
    history.append({"role": "user", "content": "After the restart: what was the first thing I asked?"})
    restart: dict[str, Any] = {"cold_ms": round(cold.ttft(history) * 1000, 1)}
    seconds, restart["resumed_tokens_from_cache"] = resumed.probe(history)
    restart["resumed_ms"] = round(seconds * 1000, 1)
    restart["speedup"] = round(restart["cold_ms"] / restart["resumed_ms"], 1)
    restart["disk_reads"] = resumed.prefix_stats()["disk_reads"]
    # The same history with another last message, on the resumed server: its memory tier now holds the blocks,
    # and whatever a process's first long prompt costs once (kernels for new shapes) is paid.
    again = [*history[:-1], {"role": "user", "content": "After the restart, again: what came first?"}]
    restart["resumed_again_ms"] = round(resumed.ttft(again) * 1000, 1)
    if mlx is not None:
        restart["mlx_lm_ms"] = round(mlx.ttft(history) * 1000, 1)  # not restarted: its cache is warm
    print(json.dumps({"restart": restart}), file=sys.stderr)
    peaks["flow-cached (restarted)"] = resumed.stop()
    peaks["flow-cold"] = cold.stop()
    if mlx is not None:
        peaks["mlx_lm.server"] = mlx.stop()
    later = [t["speedup"] for t in turns[1:]]
    second_turns = second_turn_rounds(args, model_dir, tmp) if args.second_turn_rounds else None
    return {"turns": turns, "second_session": second, "restart": restart, "peak_rss_mb": peaks,
            "second_turn": second_turns,
            "min_speedup_after_first_turn": min(later) if later else None,
            "median_speedup_after_first_turn": statistics.median(later) if later else None}


def second_turn_rounds(args: argparse.Namespace, model_dir: Path, tmp: Path) -> dict[str, Any]:
    """Fresh two-turn conversations: the second turn's TTFT cold and cached, side by side, alternating which goes
    first; medians over the rounds."""
    cached = Server("flow-cached", model_dir, tmp, tmp / "kv-rounds", args.block_tokens)
    cold = Server("flow-cold", model_dir, tmp, tmp / "kv-rounds")
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
        print(json.dumps({"second_turn": row}), file=sys.stderr)
    stats = cached.prefix_stats()
    cached.stop()
    cold.stop()
    cold_ms = statistics.median(r["cold_ms"] for r in rounds)
    cached_ms = statistics.median(r["cached_ms"] for r in rounds)
    return {"rounds": rounds, "median_cold_ms": cold_ms, "median_cached_ms": cached_ms,
            "speedup": round(cold_ms / cached_ms, 1), "state_hits": stats.get("state_hits"),
            "stored_states": stats.get("stored_states"), "stored_state_bytes": stats.get("stored_state_bytes")}


def markdown(result: dict[str, Any]) -> str:
    mlx = "mlx_lm_ms" in result["turns"][0]
    head = "| turn | prompt tokens | read from cache | flow cold TTFT | flow cached TTFT | cold / cached |" + (
        " mlx_lm.server TTFT |" if mlx else "")
    snapshots = "snapshot_bytes" in result["turns"][0]
    head += " snapshot bytes added |" if snapshots else ""
    lines = [head, "|" + "---|" * (6 + mlx + snapshots)]
    for t in result["turns"]:
        lines.append(f"| {t['turn']} | {t['prompt_tokens']} | {t['cached_tokens']} | {t['cold_ms']:.0f} ms | "
                     f"{t['cached_ms']:.0f} ms | {t['speedup']}× |" + (f" {t['mlx_lm_ms']:.0f} ms |" if mlx else "")
                     + (f" {t['snapshot_bytes']} ({t['snapshots']}) |" if snapshots else ""))
    s, r = result["second_session"], result["restart"]
    lines += ["", f"Second session, same system prompt: {s['cold_ms']:.0f} ms cold, {s['cached_ms']:.0f} ms cached "
              f"({s['speedup']}×); it shares {s['shared_tokens']} tokens and adds {s['added_kv_bytes']} KV bytes "
              f"for its own {s['own_suffix_tokens']}-token suffix ({s['own_suffix_kv_bytes']} bytes): "
              f"{s['added_over_suffix']}×.",
              f"After a restart: {r['cold_ms']:.0f} ms cold, {r['resumed_ms']:.0f} ms resumed from disk "
              f"({r['speedup']}×, {r['disk_reads']} blocks read, {r['resumed_tokens_from_cache']} tokens from the "
              f"cache); the next request on it {r['resumed_again_ms']:.0f} ms."]
    rounds = result.get("second_turn")
    if rounds:
        lines += ["", "| round | second turn cold | from cache | tokens from cache |", "|---|---|---|---|"]
        lines += [f"| {r['round']} | {r['cold_ms']:.0f} ms | {r['cached_ms']:.0f} ms | {r['cached_tokens_from_cache']} |"
                  for r in rounds["rounds"]]
        lines.append(f"| median | {rounds['median_cold_ms']:.0f} ms | {rounds['median_cached_ms']:.0f} ms | "
                     f"{rounds['speedup']}× |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--model", default="tiny:bench-80m", help="tiny:PRESET or a local model directory")
    parser.add_argument("--turns", type=int, default=12)
    parser.add_argument("--system-tokens", type=int, default=3500)
    parser.add_argument("--answer-tokens", type=int, default=48)
    parser.add_argument("--block-tokens", type=int, help="the prefix cache's block size (default: the graph's)")
    parser.add_argument("--no-mlx-lm", dest="mlx_lm", action="store_false", help="skip mlx_lm.server")
    parser.add_argument("--second-turn-rounds", type=int, default=0,
                        help="also time this many fresh conversations' second turn, cold against cached")
    parser.add_argument("--json", help="also write the full result here")
    args = parser.parse_args(argv)

    from flow.cli import blas
    from runtime.models import resolve_model_path

    blas.advise()
    model_dir = resolve_model_path(args.model)
    with tempfile.TemporaryDirectory(prefix="flow-bench-prefix-") as tmpdir:
        result = run(args, model_dir, Path(tmpdir))
    result.update(model=args.model, openblas=blas.openblas_active(), cpus=os.cpu_count(),
                  block_tokens=args.block_tokens,
                  system_tokens=args.system_tokens, answer_tokens=args.answer_tokens,
                  command=" ".join([Path(sys.executable).name, *sys.argv]))
    return report(result, args.json, markdown)


if __name__ == "__main__":
    sys.exit(main())
