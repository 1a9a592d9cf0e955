"""Memory after a disconnect storm: the server's RSS before a storm of vanishing clients and for 30 s after it.

Run (OpenBLAS preloaded first, as the test script does)::

    eval "$(.venv/bin/python -m flow.cli.blas)"
    .venv/bin/python scripts/bench_storm.py                       # tiny-qwen3, 3 storms of 50 + 8
    .venv/bin/python scripts/bench_storm.py --model tiny:bench-80m --storms 2 --json storm.json

The script starts ``flow serve`` (``python -m flow.cli serve``) on a graph that
extends ``graphs/default.toml`` with the model, its data (prefix cache's disk
tier included) in a temporary directory. It warms the server up (a few
streams, then a storm like the others, so first-use allocations are made and
the prompts' blocks are in the prefix cache), lets it idle, and reads
``VmRSS`` from ``/proc/PID/status`` — the median of a few seconds of samples —
as the level before. Then each storm: ``--bad`` clients stream
``/v1/chat/completions`` with a large ``max_tokens`` and close the connection
after a few chunks (0 to ``--bad-chunks``: some during prefill, most
mid-decode), beside ``--good`` streams that run to their end. The clients of
a storm have distinct prompts; storms share them (clients coming back), unless
``--fresh-prompts``. After the storm's last client is gone, RSS is sampled
every second for ``--watch`` seconds.

The prefix cache's hot tier (``/stats``) is read before and after: what it
gains is kept on purpose (up to its ``hot_bytes``), and with fresh prompts on
a larger model it is most of the growth. The verdict of a storm: RSS at the
end of the watch, less the hot tier's growth, within ``--target`` MiB of the
level before.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import trio

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from flow.cli.bench import report  # noqa: E402
from scripts.bench_concurrency import free_port, wait_ready  # noqa: E402

MiB = 1 << 20


def rss_bytes(pid: int) -> int:
    """The process's resident set (``VmRSS``), in bytes."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no VmRSS for {pid}")


def stat(url: str, key: str) -> Any:
    """The first value of ``key`` in ``/stats`` (None when the server shows none)."""
    def find(node: Any) -> Any:
        if isinstance(node, dict):
            if node.get(key) is not None:
                return node[key]
            values = list(node.values())
        elif isinstance(node, list):
            values = node
        else:
            return None
        for value in values:
            found = find(value)
            if found is not None:
                return found
        return None

    try:
        return find(httpx.get(url + "/stats", timeout=10).json())
    except (httpx.HTTPError, ValueError):
        return None


def hot_bytes(url: str) -> int | None:
    """The prefix cache's hot tier."""
    found = stat(url, "hot_bytes")
    return int(found) if isinstance(found, int) else None


def prompt(tag: str, i: int) -> str:
    return (f"Client {tag}-{i}. Write a long, detailed story about a lighthouse keeper who finds message "
            f"number {i} of batch {tag} in a bottle on the shore, and what the message asks of her.")


async def stream(client: httpx.AsyncClient, url: str, text: str, max_tokens: int, stop_after: int | None
                 ) -> str:
    """One chat stream; with ``stop_after``, the client vanishes after that many chunks. Its outcome."""
    body = {"model": "default", "messages": [{"role": "user", "content": text}], "max_tokens": max_tokens,
            "temperature": 0, "stream": True}
    try:
        async with client.stream("POST", url + "/v1/chat/completions", json=body) as response:
            if response.status_code != 200:
                return f"HTTP {response.status_code}"
            chunks = 0
            async for line in response.aiter_lines():
                if stop_after is not None and chunks >= stop_after:
                    return "vanished"  # leaving the block closes the connection mid-stream
                if line == "data: [DONE]":
                    return "done"
                if line.startswith("data: "):
                    chunks += 1
            return "ended without [DONE]"
    except httpx.HTTPError as exc:
        return type(exc).__name__


async def storm(url: str, tag: str, bad: int, good: int, bad_chunks: int, good_tokens: int, seed: int
                ) -> dict[str, int]:
    """``bad`` clients that vanish mid-stream beside ``good`` streams, all started together; the outcomes."""
    rng = random.Random(seed)
    outcomes: dict[str, int] = {}
    limits = httpx.Limits(max_connections=bad + good + 4, max_keepalive_connections=good + 4)
    async with httpx.AsyncClient(timeout=httpx.Timeout(300.0), limits=limits) as client:
        async def one(i: int, stop_after: int | None, max_tokens: int) -> None:
            outcome = await stream(client, url, prompt(tag, i), max_tokens, stop_after)
            outcomes[outcome] = outcomes.get(outcome, 0) + 1

        async with trio.open_nursery() as nursery:
            for i in range(good):
                nursery.start_soon(one, i, None, good_tokens)
            for i in range(good, good + bad):
                nursery.start_soon(one, i, rng.randint(0, bad_chunks), 2048)
                await trio.sleep(rng.uniform(0, 0.02))
    return outcomes


async def sampled_storm(pid: int, *args: Any) -> tuple[dict[str, int], int]:
    """:func:`storm` with RSS sampled every 0.2 s meanwhile: its outcomes and the highest sample."""
    peak = rss_bytes(pid)
    outcomes: dict[str, int] = {}

    async def run_storm(cancel: trio.CancelScope) -> None:
        outcomes.update(await storm(*args))
        cancel.cancel()

    async with trio.open_nursery() as nursery:
        nursery.start_soon(run_storm, nursery.cancel_scope)
        while True:
            peak = max(peak, rss_bytes(pid))
            await trio.sleep(0.2)
    return outcomes, peak


def settle(pid: int, seconds: float) -> int:
    """The median of one RSS sample a second over ``seconds`` (the level of an idle server)."""
    samples = []
    for _ in range(max(1, int(seconds))):
        time.sleep(1.0)
        samples.append(rss_bytes(pid))
    return int(statistics.median(samples))


def run(args: argparse.Namespace) -> dict[str, Any]:
    from runtime.tiny import ensure_tiny_model

    model = args.model
    model_dir = ensure_tiny_model(model.removeprefix("tiny:")) if not Path(model).is_dir() else Path(model)
    with tempfile.TemporaryDirectory(prefix="flow-storm-") as tmp_name:
        tmp = Path(tmp_name)
        graph = tmp / "storm.toml"
        graph.write_text(f'extends = "{ROOT / "graphs" / "default.toml"}"\n\n[resources.model]\n'
                         f'path = "{model_dir}"\nname = "storm"\naliases = ["default"]\n\n'
                         f'[resources.prefix_cache]\ndirectory = "{tmp / "kv-cache"}"\n')
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        env = {**os.environ, "FLOW_DATA_DIR": str(tmp / "data"), **dict(e.split("=", 1) for e in args.env)}
        log = (tmp / "flow.log").open("wb")
        proc = subprocess.Popen([sys.executable, "-m", "flow.cli", "--log-level", "WARNING", "serve", str(graph),
                                 "--port", str(port)], cwd=ROOT, env=env, stdout=log, stderr=log)
        try:
            wait_ready(url, proc)
            trio.run(storm, url, "warm", 4, 2, 4, 16, 0)  # first-use allocations
            trio.run(storm, url, "s", args.bad, args.good, args.bad_chunks, args.good_tokens, 1)  # the prompts' blocks
            time.sleep(3.0)  # past the device's idle release
            storms = []
            for n in range(args.storms):
                before = settle(proc.pid, args.settle)
                hot_before = hot_bytes(url)
                start = time.monotonic()
                tag = f"s{n}" if args.fresh_prompts else "s"
                outcomes, peak = trio.run(sampled_storm, proc.pid, url, tag, args.bad, args.good, args.bad_chunks,
                                          args.good_tokens, 100 + n)
                took = time.monotonic() - start
                series = []
                for _ in range(args.watch):
                    time.sleep(1.0)
                    series.append(rss_bytes(proc.pid))
                peak = max(peak, *series)
                hot_after = hot_bytes(url)
                excess = series[-1] - before
                hot_growth = hot_after - hot_before if hot_after is not None and hot_before is not None else 0
                result = {"storm": n + 1, "outcomes": outcomes, "storm_s": round(took, 1),
                          "rss_before_mib": round(before / MiB, 1), "rss_peak_mib": round(peak / MiB, 1),
                          "rss_after_mib": round(series[-1] / MiB, 1), "excess_mib": round(excess / MiB, 1),
                          "hot_tier_growth_mib": round(hot_growth / MiB, 1),
                          "unheld_mib": round((excess - hot_growth) / MiB, 1),
                          "series_mib": [round(s / MiB) for s in series],
                          "last_idle_release": stat(url, "last_idle_release"),
                          "ok": excess - hot_growth <= args.target * MiB}
                storms.append(result)
                print(f"storm {n + 1}: {outcomes} in {took:.1f} s; RSS before {before / MiB:.0f} MiB, peak "
                      f"{peak / MiB:.0f}, after {args.watch} s {series[-1] / MiB:.0f} ({excess / MiB:+.0f}; hot tier "
                      f"{result['hot_tier_growth_mib']:+} MiB) {'ok' if result['ok'] else 'OVER'}", file=sys.stderr)
                print("  RSS each second (MiB): " + " ".join(str(s) for s in result["series_mib"]), file=sys.stderr)
                print(f"  the device's last idle release: {result['last_idle_release']}", file=sys.stderr)
        finally:
            proc.terminate()
            try:
                proc.wait(20)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            log.close()
            if proc.returncode not in (0, -15) and (tmp / "flow.log").exists():
                print((tmp / "flow.log").read_text()[-3000:], file=sys.stderr)
    return {"model": model, "fresh_prompts": args.fresh_prompts, "bad": args.bad, "good": args.good,
            "bad_chunks": args.bad_chunks, "good_tokens": args.good_tokens, "watch_s": args.watch,
            "target_mib": args.target,
            "env": args.env, "cpus": os.cpu_count(), "load_average": list(os.getloadavg()), "storms": storms}


def markdown(result: dict[str, Any]) -> str:
    lines = [f"model `{result['model']}`: {result['bad']} clients vanishing after 0-{result['bad_chunks']} chunks "
             f"beside {result['good']} streams of {result['good_tokens']} tokens; RSS {result['watch_s']} s after "
             f"each storm against the idle level before it, less the hot tier's growth (target: within "
             f"{result['target_mib']} MiB); prompts {'fresh each storm' if result['fresh_prompts'] else 'shared'}"
             + (f"; env {' '.join(result['env'])}" if result["env"] else ""), "",
             "| storm | storm s | RSS before MiB | peak | after | excess | hot tier growth | unheld | verdict |",
             "|---|---|---|---|---|---|---|---|---|"]
    for s in result["storms"]:
        lines.append(f"| {s['storm']} | {s['storm_s']} | {s['rss_before_mib']} | {s['rss_peak_mib']} | "
                     f"{s['rss_after_mib']} | {s['excess_mib']:+} | {s['hot_tier_growth_mib']} | {s['unheld_mib']:+} | "
                     f"{'ok' if s['ok'] else 'over'} |")
    lines.append("")
    for s in result["storms"]:
        lines.append(f"storm {s['storm']}, RSS each second after it (MiB): {' '.join(map(str, s['series_mib']))}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--model", default="tiny-qwen3", help="a tiny preset (tiny:NAME or NAME) or a model dir")
    parser.add_argument("--storms", type=int, default=3)
    parser.add_argument("--bad", type=int, default=50, help="clients that vanish mid-stream, per storm")
    parser.add_argument("--good", type=int, default=8, help="streams that run to their end, per storm")
    parser.add_argument("--bad-chunks", type=int, default=40, help="a vanishing client reads 0 to this many chunks")
    parser.add_argument("--good-tokens", type=int, default=256)
    parser.add_argument("--watch", type=int, default=32, help="seconds of RSS samples after each storm")
    parser.add_argument("--settle", type=float, default=4.0, help="seconds of idle samples for the level before")
    parser.add_argument("--target", type=int, default=64, help="MiB over the level before, at the watch's end")
    parser.add_argument("--fresh-prompts", action="store_true", help="new prompts each storm (the hot tier grows)")
    parser.add_argument("--env", action="append", default=[], help="NAME=VALUE for the server (repeatable)")
    parser.add_argument("--json", help="write the full result here")
    args = parser.parse_args(argv)
    result = run(args)
    code = report(result, args.json, markdown)
    return code if all(s["ok"] for s in result["storms"]) else max(code, 1)


if __name__ == "__main__":
    sys.exit(main())
