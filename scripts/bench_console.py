"""The console's cost: decode throughput at 8 streams with the console open and updating, against without.

Run (OpenBLAS preloaded first, as the test script does)::

    eval "$(.venv/bin/python -m flow.blas)"
    .venv/bin/python scripts/bench_console.py --model tiny:bench-80m --rounds 5 --json console.json

One ``flow serve`` subprocess (the default graph on ``--model``), one load generator: each round starts
8 greedy streams of ``--max-tokens`` at once on ``/v1/chat/completions`` and measures aggregate decode
tok/s (completion tokens / wall time from the first streamed token to the last). Rounds alternate three
conditions so drift hits all alike; medians are reported:

* ``closed``: nobody watches;
* ``polling``: a client reads ``/stats`` and ``/downloads`` once a second, as the page does (the server's
  side of the console's cost, without a browser);
* ``page``: the console open in headless Chromium (the system's, through Playwright), drawing and
  updating live; the browser runs on the same machine, as it does for a local user.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import trio

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from flow.bench import report  # noqa: E402
from tests.browser import chromium_path, headless_chromium  # noqa: E402
from tests.harness import serve_process  # noqa: E402

CONDITIONS = ("closed", "polling", "page")
PROMPT = "Write a long, detailed story about a lighthouse keeper who finds a message in a bottle."


async def one_stream(client: httpx.AsyncClient, max_tokens: int, marks: list[float]) -> int:
    body = {"model": "default", "stream": True, "max_tokens": max_tokens, "temperature": 0,
            "stream_options": {"include_usage": True}, "messages": [{"role": "user", "content": PROMPT}]}
    tokens = 0
    async with client.stream("POST", "/v1/chat/completions", json=body) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if not line.startswith("data: {"):
                continue
            marks.append(time.perf_counter())
            if '"completion_tokens"' in line:  # the usage chunk (parsed alone: the rest is only timed)
                usage = json.loads(line[6:]).get("usage") or {}
                tokens = int(usage.get("completion_tokens") or tokens)
    return tokens


async def load_round(base: str, streams: int, max_tokens: int) -> tuple[float, int]:
    """``streams`` streams at once: aggregate decode tok/s (first to last token) and tokens generated."""
    marks: list[float] = []
    counts: list[int] = []
    async with httpx.AsyncClient(base_url=base, timeout=600) as client:
        async def run() -> None:
            counts.append(await one_stream(client, max_tokens, marks))

        async with trio.open_nursery() as nursery:
            for _ in range(streams):
                nursery.start_soon(run)
    total = sum(counts)
    span = max(marks) - min(marks)
    return (total - streams) / span if span > 0 else 0.0, total


@contextmanager
def poller(base: str, seconds: float = 1.0) -> Iterator[None]:
    stop = threading.Event()

    def run() -> None:
        with httpx.Client(base_url=base, timeout=30) as client:
            while not stop.wait(seconds):
                client.get("/stats")
                client.get("/downloads")

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join(30)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--model", default="tiny:bench-80m")
    parser.add_argument("--streams", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--json", help="also write the full result here")
    args = parser.parse_args(argv)
    chromium = chromium_path()
    if chromium is None:
        print("bench_console: needs a system Chromium (apt-get install chromium)", file=sys.stderr)
        return 2
    detail: dict[str, list[float]] = {c: [] for c in CONDITIONS}
    log = Path(tempfile.mkdtemp(prefix="bench-console-")) / "serve.log"
    command = [sys.executable, "-m", "flow.cli", "serve", "default", "--model", args.model]
    with serve_process(command, log=log, cwd=ROOT, seconds=600) as (_, base), headless_chromium(chromium) as browser:
        trio.run(load_round, base, args.streams, 8)  # warm-up: kernels compiled, weights touched
        for i in range(args.rounds):
            for condition in CONDITIONS:
                page = None
                if condition == "page":
                    page = browser.new_page(viewport={"width": 1500, "height": 1000})
                    page.goto(base + "/")
                    page.wait_for_selector("#graph svg g[data-stage]", timeout=60_000)
                try:
                    if condition == "polling":
                        with poller(base):
                            tps, tokens = trio.run(load_round, base, args.streams, args.max_tokens)
                    else:
                        tps, tokens = trio.run(load_round, base, args.streams, args.max_tokens)
                    if page is not None:  # the page really updated during the round
                        assert page.locator("#conn").text_content() == "live"
                finally:
                    if page is not None:
                        page.close()
                detail[condition].append(tps)
                print(f"round {i + 1}/{args.rounds} {condition}: {tps:.1f} tok/s ({tokens} tokens)", file=sys.stderr)
    medians = {c: round(statistics.median(v), 1) for c, v in detail.items()}
    result = {"model": args.model, "streams": args.streams, "max_tokens": args.max_tokens, "rounds": args.rounds,
              "openblas": "openblas" in os.environ.get("LD_PRELOAD", ""), "cpu_count": os.cpu_count(),
              "median_decode_tps": medians,
              "ratio_page_to_closed": round(medians["page"] / medians["closed"], 3),
              "ratio_polling_to_closed": round(medians["polling"] / medians["closed"], 3),
              # Each round's conditions ran back to back: the median of their ratios cancels slow drift.
              "paired_ratio_page_to_closed": paired(detail["page"], detail["closed"]),
              "paired_ratio_polling_to_closed": paired(detail["polling"], detail["closed"]),
              "rounds_detail": detail}
    return report(result, args.json, markdown)


def paired(a: list[float], b: list[float]) -> float:
    return round(statistics.median(x / y for x, y in zip(a, b) if y > 0), 3)


def markdown(result: dict[str, Any]) -> str:
    m = result["median_decode_tps"]
    return "\n".join([
        f"model `{result['model']}`, {result['streams']} streams × {result['max_tokens']} tokens, median of "
        f"{result['rounds']} alternating rounds, OpenBLAS {'on' if result['openblas'] else 'off'}, "
        f"{result['cpu_count']} CPUs",
        "",
        "| console closed tok/s | /stats polled 1/s tok/s | console open tok/s | open / closed (paired) | "
        "polled / closed (paired) |",
        "|---|---|---|---|---|",
        f"| {m['closed']} | {m['polling']} | {m['page']} | {result['ratio_page_to_closed']} "
        f"({result['paired_ratio_page_to_closed']}) | {result['ratio_polling_to_closed']} "
        f"({result['paired_ratio_polling_to_closed']}) |",
    ])


if __name__ == "__main__":
    sys.exit(main())
