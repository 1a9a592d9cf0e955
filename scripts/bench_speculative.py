"""Prompt-lookup speculation against none, side by side in one run: a file rewrite (1 stream, greedy), a chat
answer with nothing to look up (1 stream), and 8 mixed streams.

    eval "$(.venv/bin/python -m flow.cli.blas)"
    .venv/bin/python scripts/bench_speculative.py --model ~/.cache/flow/real-models/qwen2.5-coder-0.5b-instruct

Two ``flow serve`` processes on the same model (speculation off, and ``kind = "ngram"``), run one after the
other so they never share the CPU. Figures: decode tok/s after the first token (per stream; aggregate for the
8 streams), the ratio on/off, whether the greedy outputs are identical, and the accepted share of drafts.
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

from bench_concurrency import RequestResult, free_port, stream_one, wait_ready  # noqa: E402

FILE = (ROOT / "protocols" / "stops.py").read_text().splitlines()
SOURCE = "\n".join(FILE[:120])
EDIT = ("Rename the class StopMatcher to StopScanner everywhere in this file and reply with the whole file, in "
        f"one python code block, nothing else.\n\n```python\n{SOURCE}\n```")
CHAT = "Write a short poem about a lighthouse keeper and the winter sea."
MIXED = [EDIT, CHAT, "List ten uses of a paperclip.", EDIT, "Explain recursion to a child.", CHAT,
         "Describe a rainy afternoon in Lisbon.", EDIT]


def start(model_dir: Path, port: int, tmp: Path, speculative: str) -> Any:
    import subprocess

    graph = tmp / f"graph-{speculative}.toml"
    graph.write_text(f'extends = "{ROOT / "graphs" / "default.toml"}"\n\n[resources.model]\npath = "{model_dir}"\n'
                     f'name = "bench"\naliases = []\nspeculative = {{ kind = "{speculative}", max_draft = 8 }}\n\n'
                     f'[resources.prefix_cache]\ndirectory = "{tmp / ("kv-" + speculative)}"\n')
    flow_bin = Path(sys.executable).parent / "flow"
    return subprocess.Popen([str(flow_bin), "--log-level", "WARNING", "serve", str(graph), "--port", str(port)],
                            cwd=ROOT, stdout=subprocess.DEVNULL, stderr=open(tmp / f"flow-{speculative}.log", "wb"))


async def streams(url: str, prompts: list[str], max_tokens: int) -> list[RequestResult]:
    out: list[RequestResult] = [RequestResult(ok=False, start=0.0)] * len(prompts)
    async with httpx.AsyncClient(timeout=httpx.Timeout(1800.0)) as client:
        async def one(i: int) -> None:
            out[i] = await stream_one(client, url, "bench", prompts[i], max_tokens)

        async with trio.open_nursery() as nursery:
            for i in range(len(prompts)):
                nursery.start_soon(one, i)
    return out


def texts(url: str, prompts: list[str], max_tokens: int) -> list[str]:
    return [httpx.post(url + "/v1/chat/completions", timeout=1800, json={
        "model": "bench", "messages": [{"role": "user", "content": p}], "max_tokens": max_tokens,
        "temperature": 0}).json()["choices"][0]["message"]["content"] for p in prompts]


def decode_tps(results: list[RequestResult]) -> tuple[float, float]:
    """(median stream tok/s, aggregate tok/s) after each stream's first token."""
    done = [r for r in results if r.ok and r.first and r.end and r.tokens > 1]
    per = statistics.median((r.tokens - 1) / (r.end - r.first) for r in done if r.end and r.first)
    span = max(r.end for r in done if r.end) - min(r.first for r in done if r.first)
    return per, sum(r.tokens - 1 for r in done) / span


def run(model_dir: Path, speculative: str, tmp: Path, args: argparse.Namespace) -> dict[str, Any]:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    proc = start(model_dir, port, tmp, speculative)
    try:
        wait_ready(url, proc)
        trio.run(streams, url, [CHAT], 8)  # warm-up
        figures: dict[str, Any] = {}
        figures["edit"] = decode_tps(trio.run(streams, url, [EDIT], args.edit_tokens))[0]
        figures["chat"] = decode_tps(trio.run(streams, url, [CHAT], args.chat_tokens))[0]
        figures["mixed"] = decode_tps(trio.run(streams, url, MIXED, args.chat_tokens))[1]
        figures["texts"] = texts(url, [EDIT, CHAT], args.chat_tokens)
        engine = httpx.get(url + "/health", timeout=30).json()["models"][0]["engine"]
        figures["drafted"], figures["accepted"] = engine.get("draft_tokens", 0), engine.get("accepted_tokens", 0)
        return figures
    finally:
        proc.terminate()
        proc.wait(60)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True, help="a local MLX model directory")
    parser.add_argument("--edit-tokens", type=int, default=400)
    parser.add_argument("--chat-tokens", type=int, default=96)
    args = parser.parse_args(argv)
    model_dir = Path(args.model).expanduser()
    with tempfile.TemporaryDirectory(prefix="flow-bench-speculative-") as tmp:
        off = run(model_dir, "off", Path(tmp), args)
        print("off:", {k: v for k, v in off.items() if k != "texts"}, flush=True)
        on = run(model_dir, "ngram", Path(tmp), args)
        print("ngram:", {k: v for k, v in on.items() if k != "texts"}, flush=True)
    print(f"\n{model_dir.name}, greedy; file rewrite {args.edit_tokens} tokens, chat {args.chat_tokens}\n")
    print("| workload | off tok/s | ngram tok/s | ngram / off |")
    print("|---|---|---|---|")
    for key, name in (("edit", "file rewrite, 1 stream"), ("chat", "chat, nothing to look up, 1 stream"),
                      ("mixed", "8 mixed streams, aggregate")):
        print(f"| {name} | {off[key]:.1f} | {on[key]:.1f} | {on[key] / off[key]:.2f} |")
    same = off["texts"] == on["texts"]
    share = on["accepted"] / on["drafted"] if on["drafted"] else 0.0
    print(f"\ngreedy outputs identical: {same}; drafts accepted: {on['accepted']} of {on['drafted']} ({share:.0%})")
    return 0 if same else 1


if __name__ == "__main__":
    raise SystemExit(main())
