"""One model on two ranks (mlx.distributed, ring over loopback) against the same model in one process.

    eval "$(.venv/bin/python -m flow.cli.blas)"
    .venv/bin/python scripts/bench_distributed.py --model tiny:bench-80m [--streams 1,8] [--parallel tensor]
        [--max-tokens 128] [--rounds 2]

For each setup — ``single`` (plain ``flow serve``), then ``flow serve -n 2 --parallel P`` per ``--parallel`` — one
server (the default graph on the model, prefix cache in memory only), a warm-up, then per stream count the streams
start at once and each decodes ``--max-tokens`` greedy tokens. Figures, medians over ``--rounds``: aggregate decode
tok/s (tokens after each stream's first, over the span from the first first token to the last token), engine
step time (rank 0; distributed: each rank's, from the step messages' figures), the share of rank 0's step time
spent in the step message's collective, and the bytes it carried per step. The model's own collectives (tensor
parallel all-sums, pipeline sends) run inside its forward passes and count in step time.

On one machine the ranks share its cores and memory bandwidth: this measures the distributed path's overhead,
not a speed-up (that needs ranks on separate machines).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import trio

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))
sys.path.insert(0, str(ROOT))

from bench_concurrency import RequestResult, free_port, prompt_text, stream_one, wait_ready  # noqa: E402


def start(model: str, setup: str, port: int, tmp: Path) -> Any:
    import os
    import subprocess

    graph = tmp / f"graph-{setup}.toml"
    distributed = "" if setup == "single" else f'distributed = {{ ranks = 2, parallel = "{setup}" }}\n'
    graph.write_text(f'extends = "{ROOT / "graphs" / "default.toml"}"\n\n[resources.model]\npath = "{model}"\n'
                     f'name = "bench"\naliases = []\n{distributed}\n[resources.prefix_cache]\ndisk = false\n')
    env = {**os.environ, "PYTHONPATH": str(ROOT), "FLOW_DATA_DIR": str(tmp / "data")}
    log = open(tmp / f"flow-{setup}.log", "wb")
    return subprocess.Popen([sys.executable, "-m", "flow.cli", "--log-level", "WARNING", "serve", str(graph),
                             "--port", str(port)], cwd=ROOT, env=env, stdout=log, stderr=log)


async def level(url: str, streams: int, max_tokens: int) -> list[RequestResult]:
    out: list[RequestResult] = []
    limits = httpx.Limits(max_connections=streams + 4, max_keepalive_connections=streams + 4)
    async with httpx.AsyncClient(timeout=httpx.Timeout(900.0), limits=limits) as client:
        async def one(i: int) -> None:
            out.append(await stream_one(client, url, "bench", prompt_text(i), max_tokens))

        async with trio.open_nursery() as nursery:
            for i in range(streams):
                nursery.start_soon(one, i)
    return out


def decode_tps(results: list[RequestResult]) -> float:
    done = [r for r in results if r.ok and r.first is not None and r.end is not None]
    if not done:
        return 0.0
    span = max(r.end for r in done if r.end) - min(r.first for r in done if r.first)
    return sum(r.tokens - 1 for r in done) / span if span > 0 else 0.0


def snapshot(url: str) -> dict[str, Any]:
    model: dict[str, Any] = httpx.get(url + "/health", timeout=10).json()["models"][0]
    return model


def step_figures(before: dict[str, Any], after: dict[str, Any], wall: float) -> dict[str, Any]:
    """``step_ms``: the level's time over rank 0's engine steps (every setup alike). Distributed, per rank: the
    time in steps (rank 0: from sending the step message to the step's end; a follower: from starting to wait
    for it), the share of it in the step message's collective, and the bytes that carried per step."""
    steps = after["engine"]["steps"] - before["engine"]["steps"]
    level = {"step_ms": round(1000 * wall / steps, 2) if steps else None}
    if "distributed" not in after:
        return {**level, "ranks": []}
    out = []
    for b, a in zip(before["distributed"]["per_rank"], after["distributed"]["per_rank"]):
        steps = a["steps"] - b["steps"]
        step_s = a["step_seconds"] - b["step_seconds"]
        coll = a["collective_seconds"] - b["collective_seconds"]
        out.append({"busy_ms": round(1000 * step_s / steps, 2) if steps else None,
                    "collective_share": round(coll / step_s, 3) if step_s else None,
                    "bytes_per_step": round((a["bytes"] - b["bytes"]) / steps) if steps else None})
    return {**level, "ranks": out}


def bench(model: str, setup: str, args: argparse.Namespace) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="flow-bench-dist-") as tmp:
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        proc = start(model, setup, port, Path(tmp))
        try:
            wait_ready(url, proc)
            trio.run(level, url, 2, 8)  # warm-up
            figures: dict[str, Any] = {}
            for streams in args.streams:
                rounds = []
                for _ in range(args.rounds):
                    before, started = snapshot(url), time.perf_counter()
                    results = trio.run(level, url, streams, args.max_tokens)
                    wall = time.perf_counter() - started
                    failed = [r.error for r in results if not r.ok]
                    assert not failed, failed
                    rounds.append({"tps": decode_tps(results), **step_figures(before, snapshot(url), wall)})
                best = sorted(rounds, key=lambda r: r["tps"])[len(rounds) // 2]  # the median round
                figures[str(streams)] = {**best, "tps": round(statistics.median(r["tps"] for r in rounds), 1)}
                print(f"{setup:>9} streams={streams:<2} {figures[str(streams)]}", file=sys.stderr)
            return figures
        finally:
            proc.terminate()
            proc.wait(30)


def markdown(results: dict[str, dict[str, Any]], streams: list[int]) -> str:
    lines = ["| setup | streams | decode tok/s | vs one process | ms/step | rank 0 collective share | "
             "rank 1 collective share | step message bytes/step |", "|---|---|---|---|---|---|---|---|"]
    for setup, figures in results.items():
        for s in streams:
            f = figures[str(s)]
            base = results["single"][str(s)]["tps"]
            ranks = f["ranks"] or [{}, {}]
            lines.append(f"| {setup} | {s} | {f['tps']} | {f['tps'] / base:.2f}x | {f['step_ms']} | "
                         f"{ranks[0].get('collective_share', '–')} | {ranks[1].get('collective_share', '–')} | "
                         f"{ranks[0].get('bytes_per_step', '–')} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="tiny:bench-80m", help="model directory or tiny:PRESET")
    parser.add_argument("--streams", default="1,8", help="concurrent streams per level (default 1,8)")
    parser.add_argument("--parallel", default="tensor", help="tensor, pipeline or both (comma-separated)")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args(argv)
    args.streams = [int(s) for s in args.streams.split(",")]
    results = {setup: bench(args.model, setup, args) for setup in ["single", *args.parallel.split(",")]}
    print(markdown(results, args.streams))
    return 0


if __name__ == "__main__":
    sys.exit(main())
