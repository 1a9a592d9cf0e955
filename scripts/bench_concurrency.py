"""Concurrent streaming load: flow's server against ``mlx_lm.server``, vllm-mlx and raw ``mlx_lm.batch_generate``.

Run (OpenBLAS preloaded first, as the test script does)::

    eval "$(.venv/bin/python -m flow.cli.blas)"
    .venv/bin/python scripts/bench_concurrency.py --model tiny:bench-80m --json bench-80m.json

One run, one model, one load generator, up to five systems one after the other:

1. **flow**: ``flow serve`` in a subprocess, a graph that extends
   ``graphs/default.toml`` with the engine settings given here;
2. **mlx_lm.server**: ``python -m mlx_lm.server --model DIR`` in a subprocess
   (its defaults: 32 decoding, 8 prompts prefilled together);
3. **vllm-mlx**: ``vllm-mlx serve DIR --continuous-batching --use-paged-cache``
   in a subprocess, from its own environment (``--vllm-mlx PATH``; it inherits
   this one's, ``LD_PRELOAD`` included, as ``mlx_lm.server`` does);
4. **engine**: flow's engine alone (its device thread, the server's engine
   defaults and ``--max-batch``) on the same chat-templated prompts in a
   subprocess, no server and no HTTP: what of the gap to raw is the engine's;
5. **raw**: ``mlx_lm.batch_generate`` on the same chat-templated prompts in a
   subprocess, no HTTP at all: the ceiling, with flow's ``--max-batch`` as its
   completion batch size (the same batch size; mlx-lm's default is 32).

The load generator streams ``/v1/chat/completions`` (greedy, a fixed
``max_tokens``, usage included), a connection per request, each stream read
off its socket (``--client lean``: the first delta with text and the usage are
all it looks for, a few µs of CPU per token; the cores are shared with the
server, and raw has no client at all) or parsed event by event by ``httpx``
(``--client httpx``, as an SDK would: 70-85 µs per token on this CPU). At
each concurrency level every request starts at once. Figures per level:
aggregate tok/s (all completion tokens / wall time of the level), median and
p95 time to first token, median per-stream decode tok/s, the gaps between a
stream's tokens (p50 and p99 over all streams, and the median of each stream's
longest: what running streams wait while others are prefilled), failed requests and
the completion tokens actually generated (random-weight models rarely emit
EOS, but ``mlx_lm`` and vllm-mlx stop there, and neither takes ``ignore_eos``
or ``min_tokens``; the counts, from each stream's usage, show whether the
comparison is even). Then "a request arriving while 8 others decode": its TTFT
against the same request's TTFT on the idle server. Peak RSS is each
subprocess's ``VmHWM``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import resource
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import trio

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from flow.cli.bench import report  # noqa: E402
from scripts.pipeline_load import cpu_seconds  # noqa: E402

SYSTEMS = ("flow", "mlx_lm.server", "vllm-mlx", "engine", "raw")
VLLM_MLX = Path("/tmp/vllm-venv/bin/vllm-mlx")  # --vllm-mlx's default, where it is installed


SHARED_SYSTEM: list[str] = []  # --system-words: one system prompt every request carries, as an agent's do


def shared_system(words: int) -> str:
    """A system prompt of about ``words`` words (rules an agent's harness might send with every request)."""
    rules = ("Answer the keeper of the lighthouse briefly and precisely, name the tool you would use, and "
             "never leave the lamp unattended while the fog is in. ").split()
    return " ".join(rules[i % len(rules)] for i in range(words))


def chat_messages(text: str) -> list[dict[str, str]]:
    system = [{"role": "system", "content": SHARED_SYSTEM[0]}] if SHARED_SYSTEM else []
    return [*system, {"role": "user", "content": text}]


def prompt_text(i: int) -> str:
    return (f"Request number {i}. Write a long, detailed story about a lighthouse keeper who finds "
            f"message number {i} in a bottle on the shore.")


# --------------------------------------------------------------------------- load generator

@dataclass
class RequestResult:
    ok: bool
    start: float
    first: float | None = None
    end: float | None = None
    tokens: int = 0
    error: str = ""
    gaps: list[float] = field(default_factory=list)  # seconds between a stream's reads that brought text


# The load generator's client: "lean" (default) reads each stream off a plain socket and looks only for its first
# content and its usage; "httpx" parses every event as an SDK would. The client shares the machine's cores with
# the server it measures (raw batch_generate has none): httpx cost 70-85 µs of CPU per token, the lean one a few.
CLIENT = ["lean"]
FIRST_CONTENT = re.compile(rb'"content":\s*"[^"]')  # a delta with text (the role's opening delta has "")


async def stream_one(client: httpx.AsyncClient | None, url: str, model: str, text: str, max_tokens: int,
                     on_first: Callable[[], None] | None = None, extra: dict[str, Any] | None = None
                     ) -> RequestResult:
    body = {"model": model, "messages": chat_messages(text), "max_tokens": max_tokens,
            "temperature": 0, "stream": True, "stream_options": {"include_usage": True}, **(extra or {})}
    if client is None:
        return await lean_stream(url, body, on_first)
    result = RequestResult(ok=False, start=time.perf_counter())
    chunks = 0
    last_text = result.start
    try:
        async with client.stream("POST", url + "/v1/chat/completions", json=body) as response:
            if response.status_code != 200:
                result.error = f"HTTP {response.status_code}: {(await response.aread())[:200]!r}"
                return result
            done = False
            async for line in response.aiter_lines():
                if not line.startswith("data: "):
                    continue
                if line == "data: [DONE]":
                    done = True
                    break
                data = json.loads(line[6:])
                if data.get("choices") and data["choices"][0].get("delta", {}).get("content"):
                    chunks += 1
                    now = time.perf_counter()
                    if result.first is None:
                        result.first = now
                        if on_first is not None:
                            on_first()
                    else:
                        result.gaps.append(now - last_text)
                    last_text = now
                if data.get("usage"):
                    result.tokens = int(data["usage"]["completion_tokens"])
            result.end = time.perf_counter()
            result.tokens = result.tokens or chunks
            result.ok = done and result.first is not None
            if not result.ok:
                result.error = "stream ended early" if not done else "no content"
    except Exception as exc:  # every failure counts, whatever its type
        result.error = f"{type(exc).__name__}: {exc}"
    return result


async def lean_stream(url: str, body: dict[str, Any], on_first: Callable[[], None] | None) -> RequestResult:
    """One streamed chat completion on a connection of its own, read off the socket: the time of the first delta
    with text, the end of the stream, and the completion tokens its usage reports (else its content deltas)."""
    host, port = url.removeprefix("http://").split(":")
    payload = json.dumps(body).encode()
    result = RequestResult(ok=False, start=time.perf_counter())
    try:
        stream = await trio.open_tcp_stream(host, int(port))
        async with stream:
            await stream.send_all(f"POST /v1/chat/completions HTTP/1.1\r\nHost: {host}:{port}\r\n"
                                  f"Content-Type: application/json\r\nAccept: text/event-stream\r\n"
                                  f"Content-Length: {len(payload)}\r\nConnection: close\r\n\r\n".encode() + payload)
            pieces: list[bytes] = []
            tail = b""  # the last bytes before this read: a marker may straddle two reads
            last: float | None = None  # when the last read with text came
            while True:
                data = await stream.receive_some(1 << 16)
                if not data:
                    break
                pieces.append(data)
                seen = tail + data
                if any(m.end() > len(tail) for m in FIRST_CONTENT.finditer(seen)):  # text this read brought
                    now = time.perf_counter()
                    if last is not None:
                        result.gaps.append(now - last)
                    last = now
                    if result.first is None:
                        result.first = now
                        if on_first is not None:
                            on_first()
                tail = data[-32:]
        result.end = time.perf_counter()
    except (OSError, trio.BrokenResourceError) as exc:  # refused, reset: a failed request, counted as one
        result.error = f"{type(exc).__name__}: {exc}"
        return result
    raw = b"".join(pieces)
    head, _, payload_in = raw.partition(b"\r\n\r\n")
    status = head.split(b" ", 2)[1] if head.startswith(b"HTTP/") else b"?"
    if status != b"200":
        result.error = f"HTTP {status.decode(errors='replace')}: {payload_in[:200]!r}"
        return result
    events = dechunk(payload_in) if b"transfer-encoding: chunked" in head.lower() else payload_in
    lines = [line for line in events.split(b"\n") if line.startswith(b"data: ")]
    done = bool(lines) and lines[-1].strip() == b"data: [DONE]"
    for line in reversed(lines):
        if b'"usage"' in line and line.strip() != b"data: [DONE]":
            usage = json.loads(line[6:]).get("usage")
            if usage:
                result.tokens = int(usage["completion_tokens"])
                break
    result.tokens = result.tokens or sum(1 for line in lines if FIRST_CONTENT.search(line))
    result.ok = done and result.first is not None
    if not result.ok:
        result.error = "stream ended early" if not done else "no content"
    return result


def dechunk(body: bytes) -> bytes:
    """An HTTP/1.1 chunked body's data."""
    out, at = [], 0
    while True:
        end = body.find(b"\r\n", at)
        if end < 0:
            break
        size = int(body[at:end].split(b";")[0] or b"0", 16)
        if size == 0:
            break
        out.append(body[end + 2:end + 2 + size])
        at = end + 2 + size + 2
    return b"".join(out)


def load_client(connections: int) -> contextlib.AbstractAsyncContextManager[httpx.AsyncClient | None]:
    """The client ``stream_one`` takes: ``None`` for the lean one (a connection per stream), else an httpx pool."""
    if CLIENT[0] == "lean":
        return contextlib.nullcontext()
    limits = httpx.Limits(max_connections=connections, max_keepalive_connections=connections)
    return httpx.AsyncClient(timeout=httpx.Timeout(900.0), limits=limits)


def first_prompt(position: int) -> int:
    """The first prompt number of the ``position``-th level: every level (and the warm-up, at 0) asks new prompts,
    so no server's prefix cache holds a level's prompts from the one before."""
    return 1_000 * (position + 1)


async def run_level(url: str, model: str, concurrency: int, max_tokens: int, first: int = 0) -> list[RequestResult]:
    results: list[RequestResult] = []
    async with load_client(concurrency + 8) as client:
        async def one(i: int) -> None:
            results.append(await stream_one(client, url, model, prompt_text(first + i), max_tokens))

        async with trio.open_nursery() as nursery:
            for i in range(concurrency):
                nursery.start_soon(one, i)
    return results


def percentile(ordered: list[float], q: float) -> float:
    """The ``q`` quantile of sorted values (the nearest rank)."""
    return ordered[min(len(ordered) - 1, int(round(q * (len(ordered) - 1))))]


def gap_figures(streams: list[list[float]]) -> dict[str, float | None]:
    """The streams' gaps between tokens, measured between the reads that brought text (tokens that came together
    count once, a stall shows whole): p50 and p99 over every gap of every stream, the median over streams of
    each one's longest gap — what a stream running beside new arrivals waits — and of each one's last gap (the wait
    for the answer's end, which is what an agent waits for before its next turn)."""
    every = sorted(g * 1000 for gaps in streams for g in gaps)
    longest = [max(gaps) * 1000 for gaps in streams if gaps]
    last = [gaps[-1] * 1000 for gaps in streams if gaps]
    if not every:
        return {"itl_ms_p50": None, "itl_ms_p99": None, "longest_gap_ms_p50": None, "last_gap_ms_p50": None}
    return {"itl_ms_p50": round(statistics.median(every), 1), "itl_ms_p99": round(percentile(every, 0.99), 1),
            "longest_gap_ms_p50": round(statistics.median(longest), 1),
            "last_gap_ms_p50": round(statistics.median(last), 1)}


def summarize(results: list[RequestResult]) -> dict[str, Any]:
    good = [r for r in results if r.ok]
    out: dict[str, Any] = {"requests": len(results), "failed": len(results) - len(good),
                           "errors": sorted({r.error for r in results if not r.ok})[:3]}
    if not good:
        return out
    assert all(r.first is not None and r.end is not None for r in good)
    wall = max(r.end for r in good if r.end) - min(r.start for r in results)
    ttfts = sorted((r.first - r.start) * 1000 for r in good if r.first)
    per_stream = [(r.tokens - 1) / (r.end - r.first) for r in good if r.end and r.first and r.end > r.first
                  and r.tokens > 1]
    tokens = sum(r.tokens for r in good)
    out.update(
        completion_tokens=tokens,
        tokens_per_request=round(tokens / len(good), 1),
        wall_s=round(wall, 2),
        aggregate_tps=round(tokens / wall, 1),
        ttft_ms_p50=round(statistics.median(ttfts), 1),
        ttft_ms_p95=round(percentile(ttfts, 0.95), 1),
        per_stream_tps_p50=round(statistics.median(per_stream), 2) if per_stream else None,
        **gap_figures([r.gaps for r in good]),
    )
    return out


async def arrival_test(url: str, model: str, max_tokens: int, background: int = 8, probes: int = 7
                       ) -> dict[str, Any]:
    """TTFT of a request arriving while ``background`` streams decode, against its idle TTFT (medians of
    ``probes`` requests each: on a tiny model both are a few milliseconds, and single probes scatter)."""
    probe_text = prompt_text(10_000)
    async with load_client(background + 8) as client:
        idle = []
        for _ in range(probes):
            r = await stream_one(client, url, model, probe_text, 4)
            if r.ok and r.first:
                idle.append((r.first - r.start) * 1000)
        decoding = failed = finished_early = 0
        all_decoding = trio.Event()

        def check() -> None:
            if decoding + failed >= background:
                all_decoding.set()

        def on_first() -> None:
            nonlocal decoding
            decoding += 1
            check()

        async def bg(i: int) -> None:
            nonlocal failed, finished_early
            r = await stream_one(client, url, model, prompt_text(20_000 + i), max(1024, 8 * max_tokens), on_first)
            if r.ok:
                finished_early += 1
            else:
                failed += 1
                check()

        busy: list[float] = []
        async with trio.open_nursery() as nursery:
            for i in range(background):
                nursery.start_soon(bg, i)
            with trio.move_on_after(300):
                await all_decoding.wait()
            await trio.sleep(0.5)  # well into decoding
            for _ in range(probes):
                probe = await stream_one(client, url, model, probe_text, 4)
                if probe.ok and probe.first and not finished_early:
                    busy.append((probe.first - probe.start) * 1000)
                await trio.sleep(0.1)
            nursery.cancel_scope.cancel()  # drop the background streams (the client goes away)
    out: dict[str, Any] = {"idle_ttft_ms": round(statistics.median(idle), 1) if idle else None,
                           "busy_ttft_ms": round(statistics.median(busy), 1) if busy else None,
                           "busy_ttft_samples_ms": [round(b, 1) for b in busy], "background": background,
                           "background_failed": failed}
    if idle and busy:
        out["ratio"] = round(statistics.median(busy) / statistics.median(idle), 2)
    return out


# --------------------------------------------------------------------------- servers

def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def peak_rss_mb(pid: int) -> float | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return round(int(line.split()[1]) / 1024, 1)
    except OSError:
        pass
    return None


def wait_ready(url: str, proc: subprocess.Popen[bytes], timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode} before it was ready")
        try:
            if httpx.get(url + "/v1/models", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    raise RuntimeError("server not ready in time")


def start_flow(model_dir: Path, port: int, args: argparse.Namespace, tmp: Path) -> subprocess.Popen[bytes]:
    graph = tmp / "bench-graph.toml"
    burst = getattr(args, "prefill_burst", None)  # the other benchmarks that start flow keep the graph's default
    interval = getattr(args, "stream_interval_ms", None)
    # The prefix cache's disk tier in a fresh directory at every start: the other servers start cold each round.
    graph.write_text(
        f'extends = "{ROOT / "graphs" / "default.toml"}"\n\n[resources.model]\npath = "{model_dir}"\n'
        f'name = "bench"\naliases = []\nmax_batch = {args.max_batch}\nprefill_chunk = {args.prefill_chunk}\n'
        + (f'prefill_burst = {burst}\n' if burst is not None else "")
        + (f'stream_interval_ms = {interval}\n' if interval is not None else "") +
        f'strategy = "{args.strategy}"\nmax_queue = 1024\n\n'
        f'[resources.prefix_cache]\ndirectory = "{tempfile.mkdtemp(prefix="kv-cache-", dir=tmp)}"\n')
    # As a module, not the console script: a checkout run from PYTHONPATH (a lent GPU machine) has no `flow` on PATH.
    cmd = [sys.executable, "-m", "flow.cli", "--log-level", "WARNING", "serve", str(graph), "--port", str(port)]
    return subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=open(tmp / "flow.log", "wb"))


def start_mlx_lm(model_dir: Path, port: int, args: argparse.Namespace, tmp: Path) -> subprocess.Popen[bytes]:
    cmd = [sys.executable, "-m", "mlx_lm.server", "--model", str(model_dir), "--port", str(port),
           "--log-level", "WARNING"]
    return subprocess.Popen(cmd, cwd=tmp, stdout=subprocess.DEVNULL, stderr=open(tmp / "mlx_lm.log", "wb"))


def start_vllm_mlx(model_dir: Path, port: int, args: argparse.Namespace, tmp: Path) -> subprocess.Popen[bytes]:
    """Its own defaults otherwise (256 sequences, 32 decoding, 8 prefilled together)."""
    cmd = [args.vllm_mlx, "serve", str(model_dir), "--host", "127.0.0.1", "--port", str(port),
           "--served-model-name", "bench", "--continuous-batching", "--use-paged-cache"]
    return subprocess.Popen(cmd, cwd=tmp, stdout=open(tmp / "vllm-mlx.log", "wb"), stderr=subprocess.STDOUT)


# Each server: how it starts serving a model directory on a port, and the model name its requests carry.
SERVERS: dict[str, tuple[Callable[[Path, int, argparse.Namespace, Path], subprocess.Popen[bytes]], str]] = {
    "flow": (start_flow, "bench"),
    "mlx_lm.server": (start_mlx_lm, "default_model"),
    "vllm-mlx": (start_vllm_mlx, "bench"),
}


def process_cpu_s(pid: int) -> float:
    """User + system CPU seconds of a process, all its threads."""
    return sum(cpu_seconds(pid))


def own_cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def cpu_figures(summary: dict[str, Any], cpu: dict[str, float]) -> None:
    """Add where the CPU went during a level: per completion token, by process, and the cores kept busy (the
    machine's cores are shared by the server, the load generator and everything else)."""
    tokens, wall = summary.get("completion_tokens"), summary.get("wall_s")
    if not tokens or not wall:
        return
    for name, seconds in cpu.items():
        summary[f"{name}_cpu_us_per_token"] = round(seconds / tokens * 1e6, 1)
    summary["cores_busy"] = round(sum(cpu.values()) / wall, 2)


def bench_server(name: str, proc: subprocess.Popen[bytes], url: str, model: str,
                 args: argparse.Namespace) -> dict[str, Any]:
    try:
        wait_ready(url, proc)
        trio.run(run_level, url, model, 2, 8)  # warm-up: kernels, first-request paths
        levels: dict[str, Any] = {}
        for position, level in enumerate(args.levels):
            server_cpu, client_cpu = process_cpu_s(proc.pid), own_cpu_s()
            summary = summarize(trio.run(run_level, url, model, level, args.max_tokens, first_prompt(position)))
            cpu_figures(summary, {"server": process_cpu_s(proc.pid) - server_cpu, "client": own_cpu_s() - client_cpu})
            levels[str(level)] = summary
            print(f"{name:>14} c={level:<3} {summary.get('aggregate_tps', 0):>7} tok/s  TTFT p50 "
                  f"{summary.get('ttft_ms_p50')} ms  failed {summary['failed']}", file=sys.stderr)
        arrival = trio.run(arrival_test, url, model, args.max_tokens)
        print(f"{name:>14} new arrival TTFT {arrival.get('busy_ttft_ms')} ms vs idle {arrival.get('idle_ttft_ms')} ms",
              file=sys.stderr)
        return {"levels": levels, "arrival": arrival, "peak_rss_mb": peak_rss_mb(proc.pid)}
    finally:
        proc.terminate()
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


# --------------------------------------------------------------------------- in process: raw, flow's engine

def in_process_levels(name: str, model_dir: str, levels: list[int], max_tokens: int, max_batch: int,
                      ) -> dict[str, Any]:
    """Runs in a subprocess, no HTTP: the chat-templated prompts of each level generated at once, at most
    ``max_batch`` rows decoding (mlx-lm's own default is 32: a level of 64 runs as two waves of 32) — by
    ``mlx_lm.batch_generate`` (``raw``: the ceiling) or by flow's engine on its device thread (``engine``: flow without
    its serving path, so the gap from raw to flow splits into the engine's part and the server's)."""
    from mlx_lm.utils import load

    generate: Callable[[list[list[int]], int], int]
    if name == "raw":
        from mlx_lm import batch_generate

        model, tokenizer = load(model_dir)[:2]

        def generate(prompts: list[list[int]], tokens: int) -> int:
            response = batch_generate(model, tokenizer, prompts, max_tokens=tokens, return_token_ids=True,
                                      completion_batch_size=max_batch)
            return sum(len(t) for t in (response.token_ids or []))
    else:
        generate, tokenizer = engine_generator(model_dir, max_batch)

    def prompts(n: int, first: int = 0) -> list[list[int]]:
        return [list(tokenizer.apply_chat_template(  # type: ignore[no-untyped-call]
            chat_messages(prompt_text(first + i)), add_generation_prompt=True)) for i in range(n)]

    generate(prompts(2), 8)  # warm-up
    out: dict[str, Any] = {}
    for position, level in enumerate(levels):
        p = prompts(level, first_prompt(position))
        start, cpu = time.perf_counter(), own_cpu_s()
        tokens = generate(p, max_tokens)
        wall, cpu = time.perf_counter() - start, own_cpu_s() - cpu
        out[str(level)] = {"requests": level, "failed": 0, "completion_tokens": tokens,
                           "tokens_per_request": round(tokens / level, 1), "wall_s": round(wall, 2),
                           "aggregate_tps": round(tokens / wall, 1), "prompt_tokens": sum(len(x) for x in p)}
        cpu_figures(out[str(level)], {"server": cpu})
        print(f"{name:>14} c={level:<3} {out[str(level)]['aggregate_tps']:>7} tok/s", file=sys.stderr)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return {"levels": out, "peak_rss_mb": round(peak, 1)}


def engine_generator(model_dir: str, max_batch: int) -> tuple[Callable[[list[list[int]], int], int], Any]:
    """Flow's engine with the server's defaults but no server: each level's prompts submitted at once from one trio
    run, greedy, no stop tokens (as raw), their chunks read as they come."""
    import trio
    from mlx_lm.utils import load

    from protocols.ir import SamplingParams
    from runtime.device import DeviceThread
    from runtime.engine import Engine
    from runtime.engine_config import EngineConfig

    device = DeviceThread("bench-engine")
    device.start()
    model, tokenizer = device.call(lambda: load(model_dir)[:2])
    engine = Engine(model, device, EngineConfig(max_batch=max_batch))

    def generate(prompts: list[list[int]], tokens: int) -> int:
        counted = [0]

        async def one(prompt: list[int]) -> None:
            handle = engine.submit(prompt, max_tokens=tokens, stop_ids=frozenset(), sampling=SamplingParams())
            async with handle:
                async for chunk in handle.chunks:
                    counted[0] += len(chunk.token_ids)

        async def level() -> None:
            async with trio.open_nursery() as nursery:
                for prompt in prompts:
                    nursery.start_soon(one, prompt)
        trio.run(level)
        return counted[0]
    return generate, tokenizer


def bench_in_process(name: str, model_dir: Path, args: argparse.Namespace) -> dict[str, Any]:
    cmd = [sys.executable, __file__, "--in-process", name, str(model_dir), "--max-tokens", str(args.max_tokens),
           "--levels", ",".join(str(x) for x in args.levels), "--system-words", str(args.system_words),
           "--max-batch", str(args.max_batch)]
    done = subprocess.run(cmd, cwd=ROOT, stdout=subprocess.PIPE, check=True)
    return json.loads(done.stdout)  # type: ignore[no-any-return]


# --------------------------------------------------------------------------- report

def combine(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Rounds of one system → the median of every figure; failures are summed, peak RSS is the max."""
    def merge(values: list[Any], key: str) -> Any:
        present = [v for v in values if v is not None]
        if not present:
            return None
        if all(isinstance(v, dict) for v in present):
            keys = {k for v in present for k in v}
            return {k: merge([v.get(k) for v in present], k) for k in sorted(keys)}
        if key in ("failed", "requests"):
            return sum(present)
        if key == "peak_rss_mb":
            return max(present)
        if all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in present):
            return round(statistics.median(present), 2)
        if all(isinstance(v, list) for v in present):
            return sorted({str(x) for v in present for x in v})[:5]
        return present[0]

    return merge(list(runs), "")  # type: ignore[no-any-return]


def ratio(a: float | None, b: float | None) -> float | None:
    return round(a / b, 2) if a and b else None


def markdown(result: dict[str, Any]) -> str:
    systems = [s for s in SYSTEMS if s in result["systems"]]
    lines = [
        f"model `{result['model']}`, {result['max_tokens']} max new tokens per request (greedy), "
        + (f"a shared system prompt of {result['system_words']} words, " if result.get("system_words") else "")
        + f"flow engine: strategy `{result['flow_config']['strategy']}`, max_batch "
        f"{result['flow_config']['max_batch']}, prefill_chunk {result['flow_config']['prefill_chunk']}, "
        f"prefill_burst {result['flow_config'].get('prefill_burst', 4)}"
        + (f", stream_interval_ms {result['flow_config']['stream_interval_ms']}"
           if result['flow_config'].get('stream_interval_ms') is not None else "") + "; "
        f"{result.get('client', 'httpx')} client; "
        f"OpenBLAS {'on' if result['openblas'] else 'off'}; {result['cpus']} CPUs; median of {result['rounds']} "
        f"round(s) (failed: summed over rounds); load average before/after "
        f"{result['load_average_before'][0]:.2f}/{result['load_average_after'][0]:.2f}",
        "",
        "| concurrency | system | aggregate tok/s | TTFT p50 ms | TTFT p95 ms | per-stream tok/s | ITL p50 / p99 ms | "
        "longest gap ms | last gap ms | failed | tokens/request |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for level in result["levels"]:
        for system in systems:
            row = result["systems"][system]["levels"].get(str(level), {})
            lines.append(
                f"| {level} | {system} | {row.get('aggregate_tps', '–')} | {row.get('ttft_ms_p50', '–')} | "
                f"{row.get('ttft_ms_p95', '–')} | {row.get('per_stream_tps_p50', '–')} | "
                f"{row.get('itl_ms_p50', '–')} / {row.get('itl_ms_p99', '–')} | {row.get('longest_gap_ms_p50', '–')} | "
                f"{row.get('last_gap_ms_p50', '–')} | {row.get('failed', '–')} | "
                f"{row.get('tokens_per_request', '–')} |")
    lines += ["", "Where the CPU went (the machine's cores are shared by the server and the load generator; engine and raw have no "
              "client):", "", "| concurrency | system | server CPU µs/token | client CPU µs/token | cores busy |",
              "|---|---|---|---|---|"]
    for level in result["levels"]:
        for system in systems:
            row = result["systems"][system]["levels"].get(str(level), {})
            lines.append(f"| {level} | {system} | {row.get('server_cpu_us_per_token', '–')} | "
                         f"{row.get('client_cpu_us_per_token', '–')} | {row.get('cores_busy', '–')} |")
    lines += ["", "| system | idle TTFT ms | TTFT while 8 decode ms | ratio | peak RSS MB |", "|---|---|---|---|---|"]
    for system in systems:
        data = result["systems"][system]
        arrival = data.get("arrival", {})
        lines.append(f"| {system} | {arrival.get('idle_ttft_ms', '–')} | {arrival.get('busy_ttft_ms', '–')} | "
                     f"{arrival.get('ratio', '–')} | {data.get('peak_rss_mb', '–')} |")
    others = [s for s in systems if s != "flow" and "flow" in systems]
    if others:
        levels = result["levels"]
        lines += ["", "| flow / | " + " | ".join(f"@{level}" for level in levels) + " |",
                  "|---|" + "---|" * len(levels)]
        for label, key in (("tok/s", "ratios"), ("tok/s, paired rounds", "paired_ratios"),
                           ("TTFT p50", "ttft_ratios")):
            for other in others:
                values = [result.get(key, {}).get(f"flow/{other} @{level}") for level in levels]
                lines.append(f"| {label}: flow / {other} | " + " | ".join(str(v or "–") for v in values) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--model", default="tiny:bench-80m", help="tiny:PRESET or a local model directory")
    parser.add_argument("--levels", default="1,8,16,32,64", help="concurrency levels, comma-separated")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--systems", help=f"any of {', '.join(SYSTEMS)}; default all (vllm-mlx where installed)")
    parser.add_argument("--vllm-mlx", default=str(VLLM_MLX) if VLLM_MLX.is_file() else None, metavar="PATH",
                        help="the vllm-mlx executable (in its own environment); default %(default)s")
    parser.add_argument("--strategy", default="decode_first")
    parser.add_argument("--max-batch", type=int, default=32)
    parser.add_argument("--prefill-chunk", type=int, default=512)
    parser.add_argument("--prefill-burst", type=int, default=4, help="flow's chunks a step while a burst waits")
    parser.add_argument("--stream-interval-ms", type=float, help="flow's stream interval (default: the graph's)")
    parser.add_argument("--rounds", type=int, default=1, help="repeat, alternating systems; medians are reported")
    parser.add_argument("--client", choices=("lean", "httpx"), default="lean",
                        help="the load generator's streams: read off a socket (lean), or parsed event by event by "
                             "httpx (costs the shared cores ~10x more per token)")
    parser.add_argument("--json", help="also write the full result here")
    parser.add_argument("--system-words", type=int, default=0,
                        help="every request carries the same system prompt of about this many words (an agent's "
                             "rules: the servers' prefix caches hold it after the warm-up); default none")
    parser.add_argument("--in-process", nargs=2, metavar=("SYSTEM", "MODEL_DIR"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    args.levels = [int(x) for x in args.levels.split(",") if x]
    CLIENT[0] = args.client
    if args.system_words:
        SHARED_SYSTEM.append(shared_system(args.system_words))
    if args.in_process:
        system, directory = args.in_process
        print(json.dumps(in_process_levels(system, directory, args.levels, args.max_tokens, args.max_batch)))
        return 0

    from flow.cli import blas
    from runtime.models import resolve_model_path

    blas.advise()
    model_dir = resolve_model_path(args.model)
    if args.systems is None:
        systems = [s for s in SYSTEMS if s != "vllm-mlx" or args.vllm_mlx]
    else:
        systems = [s for s in args.systems.split(",") if s]
    result: dict[str, Any] = {
        "model": args.model, "model_dir": str(model_dir), "max_tokens": args.max_tokens, "levels": args.levels,
        "openblas": blas.openblas_active(), "cpus": os.cpu_count(),
        "flow_config": {"strategy": args.strategy, "max_batch": args.max_batch, "prefill_chunk": args.prefill_chunk,
                        "prefill_burst": args.prefill_burst, "stream_interval_ms": args.stream_interval_ms},
        "vllm_mlx": args.vllm_mlx if "vllm-mlx" in systems else None,
        "system_words": args.system_words, "client": args.client,
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "systems": {},
    }
    for system in systems:
        if system not in SYSTEMS:
            parser.error(f"unknown system {system!r}")
    if "vllm-mlx" in systems and not (args.vllm_mlx and os.access(args.vllm_mlx, os.X_OK)):
        parser.error(f"system vllm-mlx needs its executable: --vllm-mlx PATH ({args.vllm_mlx or VLLM_MLX} "
                     "is not there); install it in a venv of its own: pip install vllm-mlx")
    runs: dict[str, list[dict[str, Any]]] = {system: [] for system in systems}
    result["load_average_before"] = os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="flow-bench-") as tmpdir:
        tmp = Path(tmpdir)
        # Rounds alternate the systems, so drift (other load on the machine) hits them alike.
        for round_no in range(args.rounds):
            print(f"round {round_no + 1}/{args.rounds}", file=sys.stderr)
            for system in systems:
                port = free_port()
                url = f"http://127.0.0.1:{port}"
                if system in SERVERS:
                    start, model = SERVERS[system]
                    runs[system].append(bench_server(system, start(model_dir, port, args, tmp), url, model, args))
                else:
                    runs[system].append(bench_in_process(system, model_dir, args))
    result["load_average_after"] = os.getloadavg()
    result["rounds"] = args.rounds
    result["systems"] = {system: combine(r) for system, r in runs.items()}
    result["runs"] = runs
    # Aggregate tok/s flow / other (above 1: flow ahead), TTFT p50 flow / other (below 1: flow ahead).
    got = result["systems"]
    for key, figure in (("ratios", "aggregate_tps"), ("ttft_ratios", "ttft_ms_p50")):
        result[key] = {}
        for level in args.levels:
            ours = got.get("flow", {}).get("levels", {}).get(str(level), {}).get(figure)
            for other in SYSTEMS[1:]:
                theirs = got.get(other, {}).get("levels", {}).get(str(level), {}).get(figure)
                if ours and theirs:
                    result[key][f"flow/{other} @{level}"] = ratio(ours, theirs)
    # The same ratio round by round, then its median: each round's systems ran minutes apart, so on a shared
    # machine whose load drifts this pairs like with like better than the ratio of the medians does.
    result["paired_ratios"] = {}
    for level in args.levels:
        for other in SYSTEMS[1:]:
            pairs = [ours / theirs for ours, theirs in zip(level_figures(runs.get("flow", []), level),
                                                           level_figures(runs.get(other, []), level))
                     if ours and theirs]
            if pairs:
                result["paired_ratios"][f"flow/{other} @{level}"] = round(statistics.median(pairs), 2)
    return report(result, args.json, markdown)


def level_figures(rounds: list[dict[str, Any]], level: int) -> list[float | None]:
    """One system's aggregate tok/s at a level, round by round."""
    return [r.get("levels", {}).get(str(level), {}).get("aggregate_tps") for r in rounds]


if __name__ == "__main__":
    sys.exit(main())
