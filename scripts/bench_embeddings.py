"""Benchmark: embeddings under concurrency — flow against vllm-mlx and direct mlx-embeddings calls.

    python scripts/bench_embeddings.py --model DIR_OR_tiny:PRESET [--clients 64] [--requests 32]

A real ``flow serve`` (subprocess; the default graph with the embedding model added), where installed a
``vllm-mlx serve --embedding-model DIR`` beside it (``--vllm-mlx PATH``, its own environment; it inherits this
one's, ``LD_PRELOAD`` included; it needs a chat model too, which it never loads here), and, in this process
while the servers idle, the baselines on the same sentences:

* **naive**: a loop of direct ``mlx_embeddings`` calls, one input per call (what a server without batching
  does at best);
* **batched**: direct calls of 64 inputs each (the ceiling);
* **batched, as flow runs the model**: the same, after flow's load-time changes (on the CPU, a faster GELU).

The machine's speed drifts from minute to minute (on a shared 2-core VM, by up to 1.5x), so the throughput
comparison runs in ``--rounds`` rounds, each the naive loop, then flow under the concurrent clients, then
vllm-mlx under the same clients, then the batched calls; every round gives its own ratios, and the summary is
their median. Both sides get the same statistic: one measurement per round each.

In each round, ``--clients`` concurrent clients each send ``--requests`` requests of one short sentence
(inputs/s, p50/p95 latency). Then, ``--job-rounds`` times, one client embeds 2,048 sentences in one request,
alone, and again while another sends one short sentence at a time, ``--short-interval`` seconds apart: its
p50/p95 beside the job against the same client, asking at the same pace, on the idle server (each server in
turn). The large job's
client runs in a process of its own: reading its 2,048 vectors in this process would hold the one-sentence
client's thread.
Real weights: ``python ../shared/tools/fetch_real_models.py DIR --models all-minilm-l6-v2``.
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import functools
import json
import math
import multiprocessing
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path

import httpx
import numpy as np

ROOT = Path(__file__).resolve().parent.parent
VLLM_MLX = Path("/tmp/vllm-venv/bin/vllm-mlx")  # --vllm-mlx's default, where it is installed
WORDS = ("river sea mountain cloud forest city road bridge light stone window garden winter summer "
         "letter music engine market harbour station").split()


def sentences(n: int, seed: int = 0) -> list[str]:
    rng = np.random.default_rng(seed)
    return [" ".join(rng.choice(WORDS, size=int(rng.integers(6, 14)))) for _ in range(n)]


def percentile(values: list[float], q: float) -> float:
    return float(np.percentile(values, q)) * 1000


def model_path(ref: str) -> Path:
    if ref.startswith("tiny:"):
        from runtime.tiny import ensure_tiny_model

        return ensure_tiny_model(ref[5:])
    return Path(ref).expanduser()


class Direct:
    """Direct ``mlx_embeddings`` calls in this process: the model as mlx-embeddings loads it, and again as flow
    runs it (on the CPU, flow's GELU: ``runtime/cpu_activations``)."""

    def __init__(self, path: Path) -> None:
        from mlx_embeddings.utils import load

        from runtime.cpu_activations import use_fast_gelu

        self.model, wrapper = load(str(path))
        self.tokenizer = wrapper._tokenizer
        self.flow_model, _ = load(str(path))
        self.swapped = use_fast_gelu(self.flow_model) > 0

    def rate(self, texts: list[str], size: int, count: int, as_flow: bool = False) -> float:
        """Inputs/s embedding ``count`` of ``texts``, ``size`` per call (after one warm-up call)."""
        import mlx.core as mx

        model = self.flow_model if as_flow else self.model

        def run(batch: list[str]) -> None:
            encoded = self.tokenizer(batch, padding=True, return_tensors="np")
            out = model(mx.array(encoded["input_ids"]), attention_mask=mx.array(encoded["attention_mask"]))
            mx.eval(out.text_embeds)

        run(texts[:size])
        started = time.perf_counter()
        for i in range(0, count, size):
            run(texts[i:i + size])
        return count / (time.perf_counter() - started)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@dataclass
class Server:
    name: str
    proc: subprocess.Popen[bytes]
    base: str
    model: str  # what its requests name


def start_server(path: Path, data: Path, pass_seconds: float) -> Server:
    graph = data / "graph.toml"
    graph.write_text(f'extends = "{ROOT / "graphs" / "demo.toml"}"\n[resources.embedder]\npath = "{path}"\n'
                     f'name = "embedder"\nembed_pass_seconds = {pass_seconds}\n'
                     '[resources.prefix_cache]\ndisk = false\n')
    return launch("flow", [sys.executable, "-m", "flow.cli", "serve", str(graph)], "embedder", data,
                   {**os.environ, "FLOW_DATA_DIR": str(data)})


def start_vllm_mlx(executable: str, path: Path, data: Path) -> Server:
    """``vllm-mlx serve`` takes a chat model whatever else it serves: the tiny one, never loaded (lazily)."""
    from runtime.tiny import ensure_tiny_model

    return launch("vllm-mlx", [executable, "serve", str(ensure_tiny_model("tiny-qwen3")), "--lazy-load-model",
                                "--embedding-model", str(path), "--host", "127.0.0.1"], str(path), data)


def launch(name: str, cmd: list[str], model: str, data: Path, env: dict[str, str] | None = None) -> Server:
    """``cmd --port PORT`` in a subprocess, once its ``/health`` answers."""
    port = free_port()
    log = (data / f"{name}.log").open("wb")
    proc = subprocess.Popen([*cmd, "--port", str(port)], env=env, stdout=log, stderr=log)
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            if httpx.get(base + "/health", timeout=5).status_code == 200:
                return Server(name, proc, base, model)
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    proc.kill()
    raise SystemExit(f"{name} did not start; see {data / f'{name}.log'}")


class LeanConnection:
    """One keep-alive HTTP/1.1 connection that POSTs JSON and reads a Content-Length answer: the least a client
    can spend per request. httpx's AsyncClient, measured here with 64 coroutines, kept only 2 to 8 requests in
    the server at a time (its ``/stats``): the client, not the server, set the pace."""

    def __init__(self, base: str) -> None:
        self.host, port = base.split("//", 1)[1].rsplit(":", 1)
        self.port = int(port)
        self.streams: tuple[asyncio.StreamReader, asyncio.StreamWriter] | None = None

    async def post(self, path: str, body: dict[str, object]) -> tuple[int, bytes]:
        if self.streams is None:
            self.streams = await asyncio.open_connection(self.host, self.port)
        reader, writer = self.streams
        data = json.dumps(body).encode()
        writer.write(f"POST {path} HTTP/1.1\r\nHost: {self.host}:{self.port}\r\nContent-Type: application/json\r\n"
                     f"Content-Length: {len(data)}\r\n\r\n".encode() + data)
        status = int((await reader.readline()).split()[1])
        length = None
        while (line := await reader.readline()) not in (b"\r\n", b""):
            name, _, value = line.decode("latin-1").partition(":")
            if name.strip().lower() == "content-length":
                length = int(value)
        if length is None:
            raise RuntimeError("the answer has no Content-Length")
        return status, await reader.readexactly(length)

    def close(self) -> None:
        if self.streams is not None:
            self.streams[1].close()


def concurrent_clients(base: str, texts: list[str], clients: int, requests: int, client_kind: str,
                       model: str = "embedder") -> dict[str, float]:
    """``clients`` concurrent clients, each sending ``requests`` one-sentence requests one after another. The
    clients are coroutines of one event loop: they share the machine's two cores with the server, so they
    should cost as little as a client can (``client_kind`` "lean", see :class:`LeanConnection`; "httpx" for
    comparison)."""
    latencies: list[float] = []
    failed = [0]

    async def client(post: Callable[[dict[str, object]], Awaitable[tuple[int, bytes]]], index: int) -> None:
        for k in range(requests):
            text = texts[(index * requests + k) % len(texts)]
            started = time.perf_counter()
            status, body = await post({"model": model, "input": text})
            latencies.append(time.perf_counter() - started)
            failed[0] += status != 200 or b'"embedding"' not in body

    async def run() -> float:
        if client_kind == "lean":
            connections = [LeanConnection(base) for _ in range(clients)]
            started = time.perf_counter()
            try:
                await asyncio.gather(*(client(functools.partial(c.post, "/v1/embeddings"), i)
                                       for i, c in enumerate(connections)))
            finally:
                for connection in connections:
                    connection.close()
            return time.perf_counter() - started
        limits = httpx.Limits(max_connections=clients, max_keepalive_connections=clients)
        async with httpx.AsyncClient(timeout=300, limits=limits) as http:
            async def post(body: dict[str, object]) -> tuple[int, bytes]:
                response = await http.post(base + "/v1/embeddings", json=body)
                return response.status_code, response.content

            started = time.perf_counter()
            await asyncio.gather(*(client(post, i) for i in range(clients)))
            return time.perf_counter() - started

    seconds = asyncio.run(run())
    return {"inputs_per_s": clients * requests / seconds, "p50_ms": percentile(latencies, 50),
            "p95_ms": percentile(latencies, 95), "failed": failed[0]}


def short_latencies(base: str, texts: list[str], stop: threading.Event, limit: int,
                    interval: float = 0.0, model: str = "embedder") -> list[float]:
    """One-sentence requests one after another, ``interval`` seconds apart (0: back to back)."""
    out: list[float] = []
    with httpx.Client(timeout=300) as http:
        while not stop.is_set() and len(out) < limit:
            started = time.perf_counter()
            http.post(base + "/v1/embeddings", json={"model": model, "input": texts[len(out) % len(texts)]})
            out.append(time.perf_counter() - started)
            stop.wait(interval)
    return out


def large_job(base: str, texts: list[str], model: str = "embedder") -> tuple[int, float]:
    """One request embedding all ``texts`` (run in a process of its own): its status and seconds."""
    started = time.perf_counter()
    status = httpx.post(base + "/v1/embeddings", json={"model": model, "input": texts}, timeout=600).status_code
    return status, time.perf_counter() - started


def job_test(server: Server, texts: list[str], job_rounds: int, interval: float) -> dict[str, list[float]]:
    """The 2,048-sentence job alone and beside the one-sentence client, and that client on the idle server."""
    # the one-sentence client on the idle server, asking as it will beside the large job: a client asking
    # back to back finds the device's threads awake, one asking every so often may not
    idle = short_latencies(server.base, texts, threading.Event(), 50 * job_rounds, interval, server.model)
    alone: list[float] = []
    beside: list[float] = []
    during: list[float] = []
    with concurrent.futures.ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
        pool.submit(time.sleep, 0).result()  # the process started before the clock does
        for _ in range(job_rounds):
            status, seconds = pool.submit(large_job, server.base, texts, server.model).result()
            alone.append(seconds if status == 200 else math.inf)
            stop = threading.Event()
            worker = threading.Thread(target=lambda: during.extend(
                short_latencies(server.base, texts, stop, 10**6, interval, server.model)))
            worker.start()
            status, seconds = pool.submit(large_job, server.base, texts, server.model).result()
            beside.append(seconds if status == 200 else math.inf)
            stop.set()
            worker.join()
    return {"idle": idle, "alone": alone, "beside": beside, "during": during}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="tiny:tiny-bert")
    parser.add_argument("--clients", type=int, default=64)
    parser.add_argument("--requests", type=int, default=32,
                        help="requests per client, one after another (more: closer to the steady state)")
    parser.add_argument("--pass-seconds", type=float, default=0.1, help="the model's embed_pass_seconds")
    parser.add_argument("--client", choices=("lean", "httpx"), default="lean",
                        help="the concurrent clients' HTTP: a minimal keep-alive client, or httpx's AsyncClient")
    parser.add_argument("--short-interval", type=float, default=0.0,
                        help="seconds between the one-sentence client's requests during the large job (0: back to "
                             "back, a stress pattern; an interactive user asks every so often)")
    parser.add_argument("--job-rounds", type=int, default=3,
                        help="times the 2,048-sentence job runs alone and beside the one-sentence client (more: a "
                             "steadier p95)")
    parser.add_argument("--rounds", type=int, default=3,
                        help="rounds of naive loop / flow / vllm-mlx / batched calls, alternated; the summary is "
                             "their median")
    parser.add_argument("--vllm-mlx", default=str(VLLM_MLX) if VLLM_MLX.is_file() else "", metavar="PATH",
                        help="the vllm-mlx executable (in its own environment), served beside flow; '' for none; "
                             "default %(default)r")
    args = parser.parse_args()
    if args.vllm_mlx and not os.access(args.vllm_mlx, os.X_OK):
        parser.error(f"--vllm-mlx {args.vllm_mlx} is not an executable; install vllm-mlx in a venv of its own, "
                     "or pass --vllm-mlx '' to leave it out")
    path = model_path(args.model)
    texts = sentences(2048)
    data = Path(tempfile.mkdtemp(prefix="flow-bench-embeddings-"))
    direct = Direct(path)
    servers = [start_server(path, data, args.pass_seconds)]
    rounds: list[dict[str, float]] = []
    jobs: dict[str, dict[str, list[float]]] = {}
    try:
        if args.vllm_mlx:
            servers.append(start_vllm_mlx(args.vllm_mlx, path, data))
        for server in servers:
            httpx.post(server.base + "/v1/embeddings", json={"model": server.model, "input": texts[:64]},
                       timeout=300)  # warm-up
            concurrent_clients(server.base, texts, args.clients, 4, args.client, server.model)  # every connection once
        count = min(len(texts), 1024)
        for number in range(1, args.rounds + 1):
            naive = direct.rate(texts, 1, 256)
            loads = {server.name: concurrent_clients(server.base, texts, args.clients, args.requests, args.client,
                                                     server.model) for server in servers}
            load = loads["flow"]
            batched = direct.rate(texts, 64, count)
            batched_flow = direct.rate(texts, 64, count, as_flow=True) if direct.swapped else batched
            rounds.append({**load, "naive": naive, "batched": batched, "batched_flow": batched_flow,
                           **{f"{name} {key}": value for name, figures in loads.items() if name != "flow"
                              for key, value in figures.items()}})
            others = "".join(f"; {name} {figures['inputs_per_s']:.1f} (p50 {figures['p50_ms']:.0f} ms, p95 "
                             f"{figures['p95_ms']:.0f} ms, failed {figures['failed']}) -> "
                             f"{load['inputs_per_s'] / figures['inputs_per_s']:.2f}x"
                             for name, figures in loads.items() if name != "flow")
            print(f"round {number}: flow {load['inputs_per_s']:.1f} inputs/s (p50 {load['p50_ms']:.0f} ms, p95 "
                  f"{load['p95_ms']:.0f} ms, failed {load['failed']}); naive loop {naive:.1f} -> "
                  f"{load['inputs_per_s'] / naive:.2f}x; batched 64 {batched:.1f} -> "
                  f"{load['inputs_per_s'] / batched:.2f}x; as flow runs the model {batched_flow:.1f} -> "
                  f"{load['inputs_per_s'] / batched_flow:.2f}x{others}", flush=True)
        for server in servers:
            jobs[server.name] = job_test(server, texts, args.job_rounds, args.short_interval)
    finally:
        for server in servers:
            server.proc.send_signal(signal.SIGTERM)
            server.proc.wait(60)

    def median(key: str) -> float:
        return float(np.median([r[key] for r in rounds]))

    def ratios(key: str) -> list[float]:
        """flow's inputs/s over a baseline's, per round."""
        return [r["inputs_per_s"] / r[key] for r in rounds]

    print(f"model {args.model}: {args.clients} clients x {args.requests} requests of one sentence ({args.client} "
          f"clients); embed_pass_seconds {args.pass_seconds}; medians of {len(rounds)} rounds")
    print(f"  flow        {median('inputs_per_s'):8.1f} inputs/s  p50 {median('p50_ms'):.1f} ms  "
          f"p95 {median('p95_ms'):.1f} ms  failed {sum(r['failed'] for r in rounds):.0f}")
    for server in servers[1:]:
        name = server.name
        print(f"  {name:<11} {median(f'{name} inputs_per_s'):8.1f} inputs/s  p50 {median(f'{name} p50_ms'):.1f} ms  "
              f"p95 {median(f'{name} p95_ms'):.1f} ms  failed {sum(r[f'{name} failed'] for r in rounds):.0f}")
    for key, label in (("naive", "naive loop "), ("batched", "batched 64 "),
                       ("batched_flow", "batched 64, the model as flow runs it"),
                       *((f"{s.name} inputs_per_s", s.name) for s in servers[1:])):
        per_round = ", ".join(f"{ratio:.2f}" for ratio in ratios(key))
        print(f"  {label} {median(key):8.1f} inputs/s   -> flow / that, per round: {per_round}; "
              f"median {float(np.median(ratios(key))):.2f}")
    for name, job in jobs.items():
        alone, beside, during, idle = job["alone"], job["beside"], job["during"], job["idle"]
        print(f"{name}: one request of 2,048 sentences alone, {args.job_rounds} times: "
              f"{', '.join(f'{2048 / t:.1f}' for t in alone)} inputs/s")
        print(f"  the same beside a one-sentence client: {', '.join(f'{2048 / t:.1f}' for t in beside)} inputs/s")
        print(f"  the one-sentence client ({args.short_interval:g} s between requests): {len(during)} requests "
              f"beside the job, p50 {percentile(during, 50):.1f} ms, p95 {percentile(during, 95):.1f} ms; "
              f"{len(idle)} on the idle server, p50 {percentile(idle, 50):.1f} ms, p95 {percentile(idle, 95):.1f} ms "
              f"-> p95 ratio {percentile(during, 95) / percentile(idle, 95):.2f}")

if __name__ == "__main__":
    main()
