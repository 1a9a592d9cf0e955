"""Benchmark: live reload under load — reload latency and the throughput dip, against the same run without reloads.

    python scripts/bench_reload.py [--model tiny:bench-80m] [--streams 16] [--seconds 30] [--reloads 5]

The server serves a graph file (the default graph on ``--model``, a temporary data directory) with a
loader that compiles that file, as ``flow serve --watch`` does. ``--streams`` clients each loop streaming
chat requests (max_tokens 128, starts staggered so the load is steady) for ``--seconds``. Run A: no
reloads. Run B: the same load, and every ``seconds / (reloads + 1)`` seconds the file is edited (a new
route ``GET /vN/models``, a sampling default changed) and ``POST /admin/reload`` is sent. The runs
alternate A, B, A, B.

Reported: failed requests per run; generated tokens per second (read from the engine every 0.1 s) over the
whole run (B against A); in the 2 s after each reload against the mean of every 2 s window of the A runs
(with the spread of those windows: the noise a dip must stand out of); reload latency = from the file edit
to the first request answered by the new graph (a GET of the route only it has).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import statistics
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parent.parent
WINDOW = 2.0  # seconds after a reload whose throughput is compared with the baseline


def graph_text(model: str, version: int) -> str:
    routes = [f'"GET /v{n}/models"' for n in range(2, version + 1)]
    lines = [f'extends = "{ROOT / "graphs" / "default.toml"}"', "[resources.model]", f'path = "{model}"',
             'name = "bench"', "[stages.prepare]", f"default_max_tokens = {100 + version}"]
    if routes:
        lines += ["[stages.models_new]", 'type = "models.list"', f"routes = [{', '.join(routes)}]",
                  'exit = "models_new"']
    return "\n".join(lines) + "\n"


def client(base: str, stop: threading.Event, outcomes: list[bool], index: int, streams: int) -> None:
    body = {"model": "bench", "stream": True, "max_tokens": 128, "temperature": 0.7,
            "messages": [{"role": "user", "content": f"Client {index}: tell me about rivers."}]}
    time.sleep(3.0 * index / streams)  # staggered: prefills spread over the run, not all at once
    with httpx.Client(timeout=120) as http:
        while not stop.is_set():
            try:
                with http.stream("POST", base + "/v1/chat/completions", json=body) as response:
                    text = "".join(response.iter_text())
                outcomes.append(response.status_code == 200 and "data: [DONE]" in text
                                and 'data: {"error"' not in text)
            except httpx.HTTPError:
                outcomes.append(False)


def load(base: str, streams: int, stop: Any, results: Any) -> None:
    """The load generator, in its own process (its threads would otherwise share the server's GIL)."""
    halt = threading.Event()
    outcomes: list[bool] = []
    threads = [threading.Thread(target=client, args=(base, halt, outcomes, i, streams)) for i in range(streams)]
    for thread in threads:
        thread.start()
    stop.wait()
    halt.set()
    for thread in threads:
        thread.join(120)
    results.put(outcomes)


def run(server: Any, base: str, path: Path, model: str, streams: int, seconds: float,
        reloads: int) -> dict[str, Any]:
    engine = server.models[0].loaded.engine
    samples: list[tuple[float, int]] = []
    spawn = multiprocessing.get_context("spawn")
    stop, queue = spawn.Event(), spawn.Queue()
    loader = spawn.Process(target=load, args=(base, streams, stop, queue))
    loader.start()
    time.sleep(8.0)  # the process started, every client in its loop
    start = time.perf_counter()
    reload_at: list[float] = []
    latencies: list[float] = []
    next_reload = [start + seconds * (k + 1) / (reloads + 1) for k in range(reloads)]
    version = server.live.gen.version
    admin = httpx.Client(timeout=120)  # one connection, as an operator's tool keeps (a new client costs ~50 ms)
    while (now := time.perf_counter()) - start < seconds:
        samples.append((now, engine.stats.generated_tokens))
        if next_reload and now >= next_reload[0]:
            next_reload.pop(0)
            version += 1
            edited = time.perf_counter()
            path.write_text(graph_text(model, version))
            answer = admin.post(base + "/admin/reload").json()
            assert answer.get("reloaded"), answer
            probe = admin.get(base + f"/v{version}/models")
            assert probe.status_code == 200, probe.text
            latencies.append(time.perf_counter() - edited)
            reload_at.append(edited)
        time.sleep(0.1)
    stop.set()
    admin.close()
    outcomes: list[bool] = queue.get(timeout=180)
    loader.join(30)
    total = (samples[-1][1] - samples[0][1]) / (samples[-1][0] - samples[0][0])

    def rate(t0: float, t1: float) -> float:
        inside = [s for s in samples if t0 <= s[0] <= t1]
        return (inside[-1][1] - inside[0][1]) / (inside[-1][0] - inside[0][0])

    windows = [rate(t, t + WINDOW) for t in (samples[0][0] + WINDOW * k for k in range(int(seconds / WINDOW) - 1))]
    return {"tokens_per_s": total, "requests": len(outcomes), "failed": outcomes.count(False),
            "after_reload_tokens_per_s": [rate(t, t + WINDOW) for t in reload_at],
            "windows_tokens_per_s": windows, "reload_latency_s": latencies}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="tiny:bench-80m")
    parser.add_argument("--streams", type=int, default=16)
    parser.add_argument("--seconds", type=float, default=30.0)
    parser.add_argument("--reloads", type=int, default=5)
    args = parser.parse_args()
    os.environ["FLOW_DATA_DIR"] = tempfile.mkdtemp(prefix="flow-bench-reload-")
    from flow.builtins import compile_file
    from flow.serve.embedded import running_server

    path = Path(os.environ["FLOW_DATA_DIR"]) / "graph.toml"
    path.write_text(graph_text(args.model, 1))
    with running_server(compile_file(path), loader=lambda: compile_file(path)) as running:
        server = running.server
        results: dict[str, dict[str, Any]] = {}
        for name, reloads in (("A1", 0), ("B1", args.reloads), ("A2", 0), ("B2", args.reloads)):
            results[name] = run(server, running.base_url, path, args.model, args.streams, args.seconds, reloads)
            print(name, json.dumps(results[name]), flush=True)
        a = [results[k] for k in ("A1", "A2")]
        b = [results[k] for k in ("B1", "B2")]
        baseline = statistics.mean(r["tokens_per_s"] for r in a)
        a_windows = [w for r in a for w in r["windows_tokens_per_s"]]
        window_mean = statistics.mean(a_windows)
        after = [w for r in b for w in r["after_reload_tokens_per_s"]]
        latencies = [x for r in b for x in r["reload_latency_s"]]
        print(f"\nmodel {args.model}, {args.streams} streams, {args.seconds:g} s per run, {args.reloads} reloads per "
              f"B run; model loads: {server.models[0].loads}")
        print("failed requests: " + ", ".join(f"{k} {v['failed']}/{v['requests']}" for k, v in results.items()))
        print("throughput tokens/s: " + ", ".join(f"{k} {v['tokens_per_s']:.1f}" for k, v in results.items())
              + f"; mean(B) / mean(A) = {statistics.mean(r['tokens_per_s'] for r in b) / baseline:.3f}")
        print(f"{WINDOW:g} s after each reload, against the mean {WINDOW:g} s window of A ({window_mean:.1f} tok/s; "
              f"A's windows spread {min(a_windows) / window_mean:.2f}-{max(a_windows) / window_mean:.2f}): mean "
              f"{statistics.mean(after) / window_mean:.3f}, worst {min(after) / window_mean:.3f}")
        print(f"reload latency (edit → first request on the new graph): median "
              f"{statistics.median(latencies) * 1000:.0f} ms, max {max(latencies) * 1000:.0f} ms")


if __name__ == "__main__":
    main()
