"""LoRA adapters' cost in the batch: decode throughput of the base model, of a batch on one adapter, and of a batch
whose rows each use another adapter (or none).

    eval "$(.venv/bin/python -m flow.cli.blas)"
    .venv/bin/python scripts/bench_adapters.py --model tiny:bench-80m [--streams 1,8] [--rank 8] [--max-tokens 64]

One ``flow serve`` (the default graph on the model) with ``--adapters`` random LoRA adapters mounted through
``POST /v1/adapters`` (mlx-lm's default targets: every linear layer of every block, rank ``--rank``). Per stream
count, the streams start at once and each decodes ``--max-tokens`` greedy tokens: with no adapter (``base``), all
on adapter 0 (``single``), or stream i on adapter i mod N with every fourth stream on none (``mixed``). Figures:
aggregate decode tok/s (all streams' tokens after their first, over the span from the first first token to the
last token) and the median stream's tok/s, medians over ``--rounds`` rounds, and each run's ratio to ``base``.
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
sys.path.insert(0, str(ROOT))

from bench_concurrency import RequestResult, free_port, prompt_text, start_flow, stream_one, wait_ready  # noqa: E402

ALL_LINEAR = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj",
              "mlp.up_proj", "mlp.down_proj")


def adapter_of(run: str, i: int, count: int) -> str | None:
    if run == "base":
        return None
    if run == "single":
        return "a0"
    return None if i % 4 == 3 else f"a{i % count}"


async def level(url: str, streams: int, run: str, count: int, max_tokens: int) -> list[RequestResult]:
    out: list[RequestResult] = []
    limits = httpx.Limits(max_connections=streams + 4, max_keepalive_connections=streams + 4)
    async with httpx.AsyncClient(timeout=httpx.Timeout(900.0), limits=limits) as client:
        async def one(i: int) -> None:
            adapter = adapter_of(run, i, count)
            extra = {"adapter": adapter} if adapter else {}
            out.append(await stream_one(client, url, "bench", prompt_text(i), max_tokens, extra=extra))

        async with trio.open_nursery() as nursery:
            for i in range(streams):
                nursery.start_soon(one, i)
    return out


def figures(results: list[RequestResult]) -> tuple[float, float]:
    """(aggregate decode tok/s, median stream decode tok/s) of one run."""
    done = [r for r in results if r.ok and r.first is not None and r.end is not None and r.tokens > 1]
    if not done:
        return 0.0, 0.0
    span = max(r.end for r in done if r.end) - min(r.first for r in done if r.first)
    aggregate = sum(r.tokens - 1 for r in done) / span
    per_stream = statistics.median((r.tokens - 1) / (r.end - r.first) for r in done if r.end and r.first)
    return aggregate, per_stream


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="tiny:bench-80m", help="tiny:PRESET or a local model directory")
    parser.add_argument("--streams", default="1,8", help="stream counts, comma-separated")
    parser.add_argument("--adapters", type=int, default=4, help="adapters mounted (the mixed run uses them all)")
    parser.add_argument("--rank", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3, help="repeat each run; medians are reported")
    args = parser.parse_args(argv)
    from runtime.tiny import ensure_tiny_model
    from runtime.tiny.adapters import build_tiny_adapter

    model_dir = ensure_tiny_model(args.model[5:]) if args.model.startswith("tiny:") else Path(args.model).expanduser()
    engine = argparse.Namespace(max_batch=32, prefill_chunk=512, strategy="decode_first")
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="flow-bench-adapters-") as tmp:
        paths = [build_tiny_adapter(model_dir, Path(tmp) / f"a{i}", rank=args.rank, seed=i, keys=ALL_LINEAR)
                 for i in range(args.adapters)]
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        proc = start_flow(model_dir, port, engine, Path(tmp))
        try:
            wait_ready(url, proc)
            for i, path in enumerate(paths):
                answer = httpx.post(url + "/v1/adapters", json={"id": f"a{i}", "path": str(path)}, timeout=120)
                answer.raise_for_status()
            for run in ("base", "single", "mixed"):
                trio.run(level, url, 2, run, args.adapters, 8)  # warm-up
            for streams in (int(n) for n in args.streams.split(",")):
                for run in ("base", "single", "mixed"):
                    if run == "mixed" and streams < 2:
                        continue
                    measured = [figures(trio.run(level, url, streams, run, args.adapters, args.max_tokens))
                                for _ in range(args.rounds)]
                    rows.append({"streams": streams, "run": run,
                                 "aggregate": round(statistics.median(m[0] for m in measured), 1),
                                 "stream": round(statistics.median(m[1] for m in measured), 1)})
                    print(rows[-1], flush=True)
        finally:
            proc.terminate()
            proc.wait(60)
    print(f"\n{args.model}, {args.adapters} adapters of rank {args.rank} on every linear layer, "
          f"{args.max_tokens} tokens per stream, medians of {args.rounds} rounds\n")
    print("| streams | run | aggregate tok/s | median stream tok/s | aggregate / base |")
    print("|---|---|---|---|---|")
    for row in rows:
        base = next(r["aggregate"] for r in rows if r["streams"] == row["streams"] and r["run"] == "base")
        print(f"| {row['streams']} | {row['run']} | {row['aggregate']} | {row['stream']} | "
              f"{row['aggregate'] / base:.3f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
