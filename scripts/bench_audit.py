"""The prefix-cache audit's cost: throughput with ``audit_rate`` 0, 0.01 and 1, alternating, in one server.

Run (OpenBLAS preloaded first, as the test script does)::

    eval "$(.venv/bin/python -m flow.cli.blas)"
    .venv/bin/python scripts/bench_audit.py --model tiny:bench-80m --rounds 3

One flow server (the default graph, an in-memory prefix cache) and ``--clients`` concurrent clients that each send
``--requests`` chat requests under one shared system prompt (every request after the first is a prefix-cache hit)
with a question of its own, ``--max-tokens`` greedy tokens each. Each round runs every rate once, in an order that
rotates from round to round; the rate is the engine's own setting, changed between runs. Figures per rate: the
median over rounds of completion tokens per second (all clients) and of this process's CPU time per completion token
(server and clients share the process; the clients' share is the same at every rate), each also as the median of
the per-round ratios to rate 0 (a machine shared with other jobs moves whole rounds; a ratio within a round less),
and the audits run and dropped (an audit only runs on idle device time, so under steady load most sampled hits are
dropped rather than slowing the batch).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from flow.builtins import compile_tables
from flow.catalog.bundled import graphs_dir
from flow.graph.spec import load_tables
from flow.serve.embedded import RunningServer, running_server

SYSTEM = "You are a careful assistant for the harbour office; answer in one short sentence. " * 20


def client(url: str, index: int, requests: int, max_tokens: int, salt: str) -> int:
    tokens = 0
    with httpx.Client(timeout=600) as http:
        for i in range(requests):
            body = {"model": "bench", "max_tokens": max_tokens, "temperature": 0,
                    "messages": [{"role": "system", "content": SYSTEM},
                                 {"role": "user", "content": f"Question {salt}-{index}-{i}: which ships leave?"}]}
            answer = http.post(url + "/v1/chat/completions", json=body)
            answer.raise_for_status()
            tokens += answer.json()["usage"]["completion_tokens"]
    return tokens


def run_once(server: RunningServer, rate: float, args: argparse.Namespace, salt: str) -> dict[str, Any]:
    engine = server.server.models[0].require().engine
    engine._auditor.rate = rate
    audit = engine.prefix.audit
    before = (audit.audits, audit.dropped)
    cpu = time.process_time()
    start = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(args.clients) as pool:
        tokens = sum(pool.map(lambda i: client(server.base_url, i, args.requests, args.max_tokens, salt),
                              range(args.clients)))
    seconds = time.perf_counter() - start
    cpu = time.process_time() - cpu
    deadline = time.monotonic() + 60  # the audits sampled in this run finish on the idle device before the next
    while engine._auditor.pending and time.monotonic() < deadline:
        time.sleep(0.05)
    return {"tps": tokens / seconds, "cpu_ms_per_token": 1000 * cpu / tokens, "audits": audit.audits - before[0], "dropped": audit.dropped - before[1]}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--model", default="tiny:bench-80m")
    parser.add_argument("--rates", default="0,0.01,1")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--requests", type=int, default=6, help="requests per client per run")
    parser.add_argument("--max-tokens", type=int, default=32)
    args = parser.parse_args()
    rates = [float(r) for r in args.rates.split(",")]
    tables = load_tables(graphs_dir() / "default.toml")
    tables["resources"]["model"].update(path=args.model, name="bench", aliases=[], max_batch=args.clients)
    tables["resources"]["prefix_cache"].update(disk=False)
    runs: dict[float, list[dict[str, Any]]] = {rate: [] for rate in rates}
    with running_server(compile_tables(tables, "bench audit")) as server:
        run_once(server, 0.0, argparse.Namespace(clients=2, requests=2, max_tokens=4), "warm")
        for r in range(args.rounds):
            order = rates[r % len(rates):] + rates[: r % len(rates)]
            for rate in order:
                runs[rate].append(run_once(server, rate, args, f"r{r}"))
                print(f"round {r + 1}: rate {rate:g}: {runs[rate][-1]['tps']:.1f} tok/s, "
                      f"{runs[rate][-1]['cpu_ms_per_token']:.1f} CPU ms/token", file=sys.stderr)
    base = statistics.median(run["tps"] for run in runs[rates[0]])
    print(f"model `{args.model}`, {args.clients} clients x {args.requests} requests x {args.max_tokens} tokens, "
          f"medians of {args.rounds} rounds (alternating)\n")
    print("| audit_rate | tok/s | vs rate 0 | per round: vs rate 0 | CPU ms/token | vs rate 0 | per round: vs rate 0 "
          "| audits run | sampled but dropped |")
    print("|---|---|---|---|---|---|---|---|---|")
    base_cpu = statistics.median(run["cpu_ms_per_token"] for run in runs[rates[0]])
    for rate in rates:
        tps = statistics.median(run["tps"] for run in runs[rate])
        cpu = statistics.median(run["cpu_ms_per_token"] for run in runs[rate])
        paired = statistics.median(a["tps"] / b["tps"] for a, b in zip(runs[rate], runs[rates[0]]))
        paired_cpu = statistics.median(a["cpu_ms_per_token"] / b["cpu_ms_per_token"]
                                       for a, b in zip(runs[rate], runs[rates[0]]))
        print(f"| {rate:g} | {tps:.1f} | {tps / base:.3f} | {paired:.3f} | {cpu:.1f} | {cpu / base_cpu:.3f} | "
              f"{paired_cpu:.3f} | {sum(r['audits'] for r in runs[rate])} | {sum(r['dropped'] for r in runs[rate])} |")
    return 0


if __name__ == "__main__":
    from flow.cli.main import end_process

    end_process(main())  # its embedded server's threads ran MLX: no interpreter teardown (it could abort, exit 134)
