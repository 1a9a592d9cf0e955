"""Structured output's cost in the batch: decode throughput with every row, half the rows or no row constrained.

    eval "$(.venv/bin/python -m flow.cli.blas)"
    .venv/bin/python scripts/bench_structured.py --model tiny:bench-80m [--streams 1,8] [--max-tokens 64]

One ``flow serve`` (the default graph on the model); per level, ``--streams`` greedy streams start at once and
each decodes ``--max-tokens`` tokens: all free text, all constrained by a JSON schema that cannot close before
``--max-tokens`` (an array of at least 500 digits: every row decodes as many tokens), or half and half. Figures:
each stream's decode tok/s (after its first token), the median over the constrained rows and over the free
rows, and the ratios to the all-free run: what a constrained row pays, and what its free neighbours pay.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

import httpx
import trio

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))

from bench_concurrency import (  # noqa: E402
    RequestResult,
    free_port,
    prompt_text,
    start_flow,
    stream_one,
    wait_ready,
)

LONG_ARRAY = {"type": "json_schema", "json_schema": {"name": "digits", "strict": True, "schema": {
    "type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9}, "minItems": 500}}}


async def level(url: str, streams: int, constrained: int, max_tokens: int) -> list[tuple[bool, RequestResult]]:
    """``streams`` streams at once, the first ``constrained`` of them under the schema."""
    out: list[tuple[bool, RequestResult]] = []
    limits = httpx.Limits(max_connections=streams + 4, max_keepalive_connections=streams + 4)
    async with httpx.AsyncClient(timeout=httpx.Timeout(900.0), limits=limits) as client:
        async def one(i: int) -> None:
            extra = {"response_format": LONG_ARRAY, "reasoning_effort": "none"} if i < constrained else {
                "reasoning_effort": "none"}
            out.append((i < constrained, await stream_one(client, url, "bench", prompt_text(i), max_tokens,
                                                          extra=extra)))

        async with trio.open_nursery() as nursery:
            for i in range(streams):
                nursery.start_soon(one, i)
    return out


def decode_tps(result: RequestResult) -> float | None:
    if not result.ok or result.first is None or result.end is None or result.tokens < 2:
        return None
    return (result.tokens - 1) / (result.end - result.first)


def median_tps(results: list[tuple[bool, RequestResult]], constrained: bool) -> float | None:
    values = [t for c, r in results if c == constrained and (t := decode_tps(r)) is not None]
    return round(statistics.median(values), 2) if values else None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="tiny:bench-80m", help="tiny:PRESET or a local model directory")
    parser.add_argument("--streams", default="1,8", help="stream counts, comma-separated")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3, help="repeat each run; medians are reported")
    args = parser.parse_args(argv)
    if args.model.startswith("tiny:"):
        from runtime.tiny import ensure_tiny_model

        model_dir = ensure_tiny_model(args.model[5:])
    else:
        model_dir = Path(args.model).expanduser()
    engine = argparse.Namespace(max_batch=32, prefill_chunk=512, strategy="decode_first")
    with tempfile.TemporaryDirectory(prefix="flow-bench-structured-") as tmp:
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        proc = start_flow(model_dir, port, engine, Path(tmp))
        try:
            wait_ready(url, proc)
            trio.run(level, url, 2, 1, 8)  # warm-up: the grammar's vocabulary data, first-request paths
            rows: list[dict[str, Any]] = []
            for streams in (int(n) for n in args.streams.split(",")):
                for name, constrained in (("free", 0), ("half", streams // 2), ("all", streams)):
                    if name == "half" and streams < 2:
                        continue
                    runs = [trio.run(level, url, streams, constrained, args.max_tokens) for _ in range(args.rounds)]
                    merged = [item for run in runs for item in run]
                    failed = sum(not r.ok for _, r in merged)
                    rows.append({"streams": streams, "run": name, "constrained_tps": median_tps(merged, True),
                                 "free_tps": median_tps(merged, False), "failed": failed})
                    print(rows[-1], flush=True)
        finally:
            proc.terminate()
            proc.wait(60)
    print(f"\n{args.model}, {args.max_tokens} tokens per stream, medians of {args.rounds} rounds\n")
    print("| streams | run | free rows tok/s | constrained rows tok/s | constrained / free-run | free / free-run |")
    print("|---|---|---|---|---|---|")
    for row in rows:
        base = next(r["free_tps"] for r in rows if r["streams"] == row["streams"] and r["run"] == "free")
        def ratio(value: float | None) -> str:
            return f"{value / base:.3f}" if value and base else "-"
        print(f"| {row['streams']} | {row['run']} | {row['free_tps'] or '-'} | {row['constrained_tps'] or '-'} | "
              f"{ratio(row['constrained_tps'])} | {ratio(row['free_tps'])} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
