"""The console's cost: decode throughput at 8 streams with the console open and updating, against without.

Run (OpenBLAS preloaded first, as the test script does)::

    eval "$(.venv/bin/python -m flow.cli.blas)"
    .venv/bin/python scripts/bench_console.py --model tiny:bench-80m --rounds 5 --json console.json

One ``flow serve`` subprocess (the default graph on ``--model``), one load generator: each round starts
8 greedy streams of ``--max-tokens`` at once on ``/v1/chat/completions`` and measures aggregate decode
tok/s (completion tokens / wall time from the first streamed token to the last), and, while a page is open,
the CPU time the browser's processes took (all of Chromium's processes under this one, from ``/proc``), as a
share of one core: on a machine others load, tok/s swings more than the console's cost, while the browser's own
CPU time is what the page costs whatever else runs. Rounds alternate the conditions so drift hits all alike;
medians are reported:

* ``closed``: nobody watches;
* ``feed``: a client follows ``/stats/events`` (one reading a second), as the page does (the server's side
  of the console's cost, without a browser);
* ``page``: the console open in headless Chromium (the system's, through Playwright), drawing and
  updating live; the browser runs on the same machine, as it does for a local user;
* ``page_at`` (with ``--page-update-seconds S``): the same page, its figures sent every ``S`` seconds instead
  of the graph's ``update_seconds``;
* ``baseline_page`` (with ``--baseline-page FILE``): the same, with another version of the page (the HTML
  ``GET /`` answered then, saved to a file) shown in its place, to compare two versions side by side.
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
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import trio

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from flow.cli.bench import report  # noqa: E402
from tests.browser import chromium_path, headless_chromium  # noqa: E402
from tests.harness import serve_process  # noqa: E402
from viz.console import PAGE_HEADERS  # noqa: E402

CONDITIONS = ("closed", "feed", "page", "page_at", "baseline_page")
TICK = os.sysconf("SC_CLK_TCK")
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


def browser_cpu_seconds() -> float:
    """CPU time used so far by the Chromium processes under this one (Playwright's driver, then the browser)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                parent = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                continue  # gone meanwhile
            children.setdefault(parent, []).append(int(entry.name))
    total, todo = 0.0, list(children.get(os.getpid(), []))
    while todo:
        pid = todo.pop()
        todo.extend(children.get(pid, []))
        try:
            if "chrom" not in os.readlink(f"/proc/{pid}/exe"):
                continue
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        total += (int(fields[11]) + int(fields[12])) / TICK  # utime + stime
    return total


@contextmanager
def follower(base: str, seconds: float = 1.0) -> Iterator[None]:
    """A client following the figures' feed, as the console does, for the block's duration."""
    stop = threading.Event()

    def run() -> None:
        with httpx.Client(base_url=base, timeout=30) as client, \
                client.stream("GET", f"/stats/events?interval={seconds:g}") as feed:
            for _ in feed.iter_raw():
                if stop.is_set():
                    return

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
    parser.add_argument("--page-update-seconds", type=float,
                        help="also measure the page with its figures sent this often (condition page_at)")
    parser.add_argument("--baseline-page", type=Path,
                        help="a console page (HTML) to measure in place of the server's, as a fourth condition")
    args = parser.parse_args(argv)
    baseline = args.baseline_page.read_bytes() if args.baseline_page else None
    conditions = [c for c in CONDITIONS if (c != "baseline_page" or baseline is not None)
                  and (c != "page_at" or args.page_update_seconds is not None)]
    chromium = chromium_path()
    if chromium is None:
        print("bench_console: needs a system Chromium (apt-get install chromium)", file=sys.stderr)
        return 2
    detail: dict[str, list[float]] = {c: [] for c in conditions}
    browser_cpu: dict[str, list[float]] = {c: [] for c in conditions if c != "closed" and c != "feed"}
    load_before = os.getloadavg()  # the machine is shared: the figures are read against its load
    log = Path(tempfile.mkdtemp(prefix="bench-console-")) / "serve.log"
    command = [sys.executable, "-m", "flow.cli", "serve", "default", "--model", args.model]
    with serve_process(command, log=log, cwd=ROOT, seconds=600) as (_, base), headless_chromium(chromium) as browser:
        trio.run(load_round, base, args.streams, 8)  # warm-up: kernels compiled, weights touched
        served = httpx.get(base + "/", timeout=30).text
        intervals = {"page": float(served[slice(*page_interval(served))]), "page_at": args.page_update_seconds}
        for i in range(args.rounds):
            for condition in conditions:
                page = None
                if condition.endswith("page") or condition == "page_at":
                    page = browser.new_page(viewport={"width": 1500, "height": 1000})
                    html = baseline if condition == "baseline_page" else \
                        at_interval(base, args.page_update_seconds) if condition == "page_at" else None
                    if html is not None:
                        page.route(base + "/", serve_page(html))
                    page.goto(base + "/")
                    page.wait_for_selector("#graph svg g[data-stage]", timeout=60_000)
                    # Measured from its steady state: the first reading painted, the library listed (what a page
                    # costs once, on opening, is not what it costs to keep it open).
                    page.wait_for_selector("#conn.ok", timeout=60_000)  # live (no string eval: the CSP forbids it)
                    page.wait_for_selector("#library tbody tr", timeout=60_000)
                    time.sleep(2)
                cpu_before, wall_before = browser_cpu_seconds(), time.perf_counter()
                try:
                    if condition == "feed":
                        with follower(base):
                            tps, tokens = trio.run(load_round, base, args.streams, args.max_tokens)
                    else:
                        tps, tokens = trio.run(load_round, base, args.streams, args.max_tokens)
                    if page is not None:  # the page really updated during the round
                        assert page.locator("#conn").text_content() == "live"
                        browser_cpu[condition].append(
                            100 * (browser_cpu_seconds() - cpu_before) / (time.perf_counter() - wall_before))
                finally:
                    if page is not None:
                        page.close()
                detail[condition].append(tps)
                print(f"round {i + 1}/{args.rounds} {condition}: {tps:.1f} tok/s ({tokens} tokens)", file=sys.stderr)
    medians = {c: round(statistics.median(v), 1) for c, v in detail.items()}
    watched = [c for c in conditions if c != "closed"]
    result = {"model": args.model, "streams": args.streams, "max_tokens": args.max_tokens, "rounds": args.rounds,
              "openblas": "openblas" in os.environ.get("LD_PRELOAD", ""), "cpu_count": os.cpu_count(),
              "update_seconds": {c: intervals[c] for c in conditions if c in intervals},
              "load_average_before": [round(x, 2) for x in load_before],
              "load_average_after": [round(x, 2) for x in os.getloadavg()],
              "median_decode_tps": medians,
              "range_decode_tps": {c: [round(min(v), 1), round(max(v), 1)] for c, v in detail.items()},
              "ratio_to_closed": {c: round(medians[c] / medians["closed"], 3) for c in watched},
              # Each round's conditions ran back to back: the median of their ratios cancels slow drift.
              "paired_ratio_to_closed": {c: paired(detail[c], detail["closed"]) for c in watched},
              "browser_cpu_percent_of_one_core": {c: round(statistics.median(v), 2) for c, v in browser_cpu.items()},
              "browser_cpu_range": {c: [round(min(v), 2), round(max(v), 2)] for c, v in browser_cpu.items()},
              "rounds_detail": detail}
    return report(result, args.json, markdown)


def serve_page(html: bytes) -> Callable[[Any], None]:
    """A Playwright route handler answering with ``html`` in place of the server's page."""
    return lambda route: route.fulfill(status=200, body=html, headers=dict(PAGE_HEADERS))


UPDATE_SETTING = '"update_seconds": '


def page_interval(page: str) -> tuple[int, int]:
    """Where the value of the page's inline ``update_seconds`` setting is: (start, end)."""
    start = page.index(UPDATE_SETTING) + len(UPDATE_SETTING)
    return start, start + len(page[start:]) - len(page[start:].lstrip("0123456789."))


def at_interval(base: str, seconds: float) -> bytes:
    """The server's console page with its figures asked for every ``seconds`` (its inline settings rewritten)."""
    page = httpx.get(base + "/", timeout=30).text
    start, end = page_interval(page)
    return (page[:start] + repr(float(seconds)) + page[end:]).encode()


def paired(a: list[float], b: list[float]) -> float:
    return round(statistics.median(x / y for x, y in zip(a, b) if y > 0), 3)


LABELS = {"closed": "console closed", "feed": "/stats/events followed", "page": "console open",
          "page_at": "console open", "baseline_page": "baseline page open"}


def markdown(result: dict[str, Any]) -> str:
    m, spread = result["median_decode_tps"], result["range_decode_tps"]
    lines = [
        f"model `{result['model']}`, {result['streams']} streams × {result['max_tokens']} tokens, median of "
        f"{result['rounds']} alternating rounds, OpenBLAS {'on' if result['openblas'] else 'off'}, "
        f"{result['cpu_count']} CPUs, load average (1, 5, 15 min) {result['load_average_before']} before, "
        f"{result['load_average_after']} after",
        "",
        "| condition | decode tok/s (median) | range | / closed | / closed, paired rounds | browser CPU, % of a core "
        "(median, range) |",
        "|---|---|---|---|---|---|",
    ]
    cpu, cpu_range = result["browser_cpu_percent_of_one_core"], result["browser_cpu_range"]
    for c, tps in m.items():
        low, high = spread[c]
        ratio = result["ratio_to_closed"].get(c, 1.0)
        pair = result["paired_ratio_to_closed"].get(c, 1.0)
        browser = f"{cpu[c]} ({cpu_range[c][0]}–{cpu_range[c][1]})" if c in cpu else "–"
        every = result["update_seconds"].get(c)
        label = LABELS[c] + (f", figures every {every:g} s" if every is not None else "")
        lines.append(f"| {label} | {tps} | {low}–{high} | {ratio} | {pair} | {browser} |")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
