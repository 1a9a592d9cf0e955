"""``flow bench``: single-stream decode, raw mlx-lm against the server, side by side.

One process, one loaded model, one device thread. Each round runs
``mlx_lm.stream_generate`` directly on the device thread (the ceiling), then
the same greedy request streamed through the server's whole graph over HTTP on
loopback. Rounds alternate so drift (thermal, other load) hits both alike;
medians are reported.

Figures:
* raw decode tok/s — mlx-lm's own ``generation_tps``;
* server decode tok/s — completion tokens after the first, over the time from
  the first to the last streamed token, as a client sees it (a client in a
  process of its own, :mod:`flow.cli.stream_client`: in this one its parsing
  would take the interpreter lock from the server's threads);
* server TTFT — request sent to first content token;
* graph overhead per token — server time per token minus raw time per token.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from mlx.utils import tree_flatten

from flow.builtins import compile_tables
from flow.catalog.bundled import graphs_dir
from flow.catalog.fit import record_measured_decode_tps
from flow.cli import blas
from flow.graph.spec import load_tables
from flow.serve.embedded import RunningServer, running_server

GRAPHS = graphs_dir()  # the bundled graphs (flow/bundled.py)
PROMPT = "Write a long, detailed story about a lighthouse keeper who finds a message in a bottle."


@dataclass
class Round:
    raw_decode_tps: float
    raw_prompt_tps: float
    raw_tokens: int
    server_decode_tps: float
    server_ttft_ms: float
    server_tokens: int


def raw_round(server: RunningServer, prompt_ids: list[int], max_tokens: int) -> tuple[float, float, int]:
    from mlx_lm import stream_generate

    loaded = server.server.models[0].require()

    def run() -> tuple[float, float, int]:
        last = None
        for last in stream_generate(loaded.model, loaded.tokenizer, prompt_ids, max_tokens=max_tokens):
            pass
        assert last is not None
        return last.generation_tps, last.prompt_tps, last.generation_tokens

    return server.server.device.call(run)


def server_round(server: RunningServer, max_tokens: int) -> tuple[float, float, int]:
    """The request streamed by a client in a process of its own (:mod:`flow.cli.stream_client`)."""
    body = {"model": "bench", "messages": [{"role": "user", "content": PROMPT}], "max_tokens": max_tokens,
            "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}
    done = subprocess.run([sys.executable, "-m", "flow.cli.stream_client", server.url + "/chat/completions",
                           json.dumps(body)], capture_output=True, text=True, timeout=900, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"the streaming client failed: {done.stderr.strip()[-500:]}")
    seen = json.loads(done.stdout)
    if seen["chunks"] < 2:
        raise RuntimeError("the server streamed fewer than two content chunks; raise --max-tokens")
    # Tokens from the usage: a chunk holds several where steps are quicker than the stream interval.
    decode_tps = (seen["tokens"] - 1) / (seen["last"] - seen["first"])
    return decode_tps, (seen["first"] - seen["start"]) * 1000, seen["tokens"]


def run_bench(model: str, max_tokens: int, rounds: int) -> dict[str, Any]:
    tables = load_tables(GRAPHS / "default.toml")
    tables["resources"]["model"].update(path=model, name="bench", aliases=[])
    graph = compile_tables(tables, "bench")
    results: list[Round] = []
    with running_server(graph) as server:
        loaded = server.server.models[0].require()
        prompt_ids = loaded.tokenizer.apply_chat_template([{"role": "user", "content": PROMPT}],
                                                          add_generation_prompt=True)
        raw_round(server, prompt_ids, 8)  # warm-up: compile kernels, touch weights
        server_round(server, 8)
        for i in range(rounds):
            raw_tps, raw_ptps, raw_tokens = raw_round(server, prompt_ids, max_tokens)
            srv_tps, ttft, srv_tokens = server_round(server, max_tokens)
            results.append(Round(raw_tps, raw_ptps, raw_tokens, srv_tps, ttft, srv_tokens))
            print(f"round {i + 1}/{rounds}: raw {raw_tps:.1f} tok/s, server {srv_tps:.1f} tok/s, "
                  f"TTFT {ttft:.1f} ms", file=sys.stderr)
        leaves: Any = tree_flatten(loaded.model.parameters())
        params = sum(v.size for _, v in leaves)
    raw = statistics.median(r.raw_decode_tps for r in results)
    srv = statistics.median(r.server_decode_tps for r in results)
    return {
        "model": model,
        "parameters": params,
        "prompt_tokens": len(prompt_ids),
        "max_tokens": max_tokens,
        "rounds": rounds,
        "openblas": blas.openblas_active(),
        "raw_decode_tps": round(raw, 1),
        "raw_prompt_tps": round(statistics.median(r.raw_prompt_tps for r in results), 1),
        "server_decode_tps": round(srv, 1),
        "server_ttft_ms_median": round(statistics.median(r.server_ttft_ms for r in results), 1),
        "ratio_server_to_raw": round(srv / raw, 3),
        "graph_overhead_us_per_token": round((1 / srv - 1 / raw) * 1e6, 1),
        "rounds_detail": [asdict(r) for r in results],
    }


def markdown(result: dict[str, Any]) -> str:
    return "\n".join([
        f"model `{result['model']}` ({result['parameters'] / 1e6:.1f}M parameters), prompt "
        f"{result['prompt_tokens']} tokens, {result['max_tokens']} new tokens, median of {result['rounds']} rounds, "
        f"OpenBLAS {'on' if result['openblas'] else 'off'}",
        "",
        "| raw mlx-lm decode tok/s | server decode tok/s | server / raw | server TTFT ms | graph overhead µs/token |",
        "|---|---|---|---|---|",
        f"| {result['raw_decode_tps']} | {result['server_decode_tps']} | {result['ratio_server_to_raw']} | "
        f"{result['server_ttft_ms_median']} | {result['graph_overhead_us_per_token']} |",
    ])


def report(result: dict[str, Any], json_path: str | None, render: Callable[[dict[str, Any]], str]) -> int:
    """A benchmark's ending: the full result as JSON (when asked), its tables on stdout; the exit status."""
    if json_path:
        Path(json_path).write_text(json.dumps(result, indent=2))
    print(render(result))
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="flow bench", description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--model", default="tiny:bench-80m",
                        help="model directory, hub id or tiny:PRESET (default tiny:bench-80m, ~88M float32)")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--json", help="also write the full result here")
    args = parser.parse_args(argv)
    blas.advise()
    result = run_bench(args.model, args.max_tokens, args.rounds)
    record_measured_decode_tps(args.model, result["server_decode_tps"])  # flow fit shows it beside its prediction
    return report(result, args.json, markdown)


if __name__ == "__main__":
    sys.exit(main())
