"""Vision requests: time to first token cold, with a repeated image (the feature cache), on the next turn of a
conversation (the prefix cache), against ``mlx_vlm.generate``; and 8 text streams' throughput while image
requests arrive.

    eval "$(.venv/bin/python -m flow.cli.blas)"
    .venv/bin/python scripts/bench_vision.py [--model tiny:bench-vlm,tiny:bench-qwen2.5-vl] [--rounds 5]
        [--size 640x480]

One ``flow serve`` per model, one after the other (the default graph on the model, its prefix cache in a temporary
directory): by default a Gemma 3 (1-D positions) and a Qwen2.5-VL (3-D M-RoPE positions, each picture at its own
size) of the same sizes. TTFT is the
latency of a non-streamed ``max_tokens=1`` chat request (prefill and one token), median over ``--rounds``:

* **cold**: an image the server has not seen, after text it has not seen;
* **repeated image**: an image it served before, after other text (the prefix cache misses before the image;
  the feature cache has the image's features, so the vision tower does not run);
* **next turn**: the conversation's next user message, the image in its first message (the prefix cache holds
  the image span's KV);
* **mlx_vlm.generate**: the same cold prompt and image in this process, ``max_tokens=1`` (its prefill and first
  token), after the server has stopped.

Then 8 streaming text requests (``--max-tokens`` each), alone, while cold image requests arrive every
``--image-every`` seconds, and while a client sends them back to back: aggregate decode tok/s (tokens after each stream's first, over the span from the first first
token to the last token).
"""

from __future__ import annotations

import argparse
import base64
import io
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import trio
from PIL import Image

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))
sys.path.insert(0, str(ROOT))

from bench_concurrency import (
    RequestResult,
    free_port,
    prompt_text,
    stream_one,
    wait_ready,
)


def photo(seed: int, size: tuple[int, int]) -> Image.Image:
    """A smooth random picture (PNG-compressible like a photo or screenshot, unlike white noise)."""
    rng = np.random.default_rng(seed)
    small = rng.integers(0, 256, (size[1] // 16 + 1, size[0] // 16 + 1, 3), dtype=np.uint8)
    return Image.fromarray(small).resize(size, Image.Resampling.BICUBIC)


def data_url(image: Image.Image) -> str:
    out = io.BytesIO()
    image.save(out, format="PNG")
    return "data:image/png;base64," + base64.b64encode(out.getvalue()).decode()


def image_message(text_before: str, image: Image.Image, question: str) -> dict[str, Any]:
    return {"role": "user", "content": [{"type": "text", "text": text_before},
                                        {"type": "image_url", "image_url": {"url": data_url(image)}},
                                        {"type": "text", "text": question}]}


def ttft(client: httpx.Client, url: str, messages: list[dict[str, Any]]) -> tuple[float, dict[str, Any]]:
    start = time.perf_counter()
    response = client.post(url + "/v1/chat/completions", json={
        "model": "bench", "messages": messages, "max_tokens": 1, "temperature": 0})
    seconds = time.perf_counter() - start
    response.raise_for_status()
    return seconds, response.json()


def ttfts(url: str, rounds: int, size: tuple[int, int]) -> dict[str, Any]:
    cold, repeated, turn, cached, tower = [], [], [], [], []
    with httpx.Client(timeout=600) as client:
        ttft(client, url, [image_message("Warm-up.", photo(999, size), "What is this?")])
        for r in range(rounds):
            image = photo(r, size)
            first = [image_message(f"Round {r}, a new picture.", image, "What is in it?")]
            seconds, body = ttft(client, url, first)
            cold.append(seconds)
            before = client.get(url + "/stats").json()["models"]["bench"]["engine"]["vision"]["tower_passes"]
            seconds, _ = ttft(client, url, [image_message(f"Other words {r} first, then the same picture.", image,
                                                          "Describe it.")])
            repeated.append(seconds)
            after = client.get(url + "/stats").json()["models"]["bench"]["engine"]["vision"]["tower_passes"]
            tower.append(after - before)
            answer = body["choices"][0]["message"]["content"] or "It is a picture."
            seconds, body = ttft(client, url, [*first, {"role": "assistant", "content": answer},
                                               {"role": "user", "content": "And what colours does it have?"}])
            turn.append(seconds)
            cached.append(body["usage"]["prompt_tokens_details"]["cached_tokens"] / body["usage"]["prompt_tokens"])
    return {"cold": statistics.median(cold), "repeated": statistics.median(repeated),
            "next_turn": statistics.median(turn), "next_turn_cached_share": statistics.median(cached),
            "tower_passes_on_repeat": sum(tower)}


async def text_streams(url: str, streams: int, max_tokens: int, size: tuple[int, int], every: float | None
                       ) -> tuple[float, list[float]]:
    """Aggregate decode tok/s of ``streams`` text streams, and the latencies of the image requests (8 tokens each)
    served meanwhile: one arriving every ``every`` seconds (0: back to back; None: none)."""
    results: list[RequestResult] = []
    latencies: list[float] = []
    limits = httpx.Limits(max_connections=streams + 4, max_keepalive_connections=streams + 4)
    async with httpx.AsyncClient(timeout=httpx.Timeout(900.0), limits=limits) as client:
        async def text(i: int) -> None:
            results.append(await stream_one(client, url, "bench", prompt_text(i), max_tokens))

        async def images(cancel: trio.CancelScope) -> None:
            seed = 10_000
            start = trio.current_time()
            with cancel:
                while True:
                    seed += 1
                    if every:
                        await trio.sleep_until(start + (seed - 10_001) * every)
                    sent = time.perf_counter()
                    response = await client.post(url + "/v1/chat/completions", json={
                        "model": "bench", "max_tokens": 8, "temperature": 0,
                        "messages": [image_message(f"Picture {seed}.", photo(seed, size), "What is in it?")]})
                    response.raise_for_status()
                    latencies.append(time.perf_counter() - sent)

        async with trio.open_nursery() as nursery:
            scope = trio.CancelScope()
            if every is not None:
                nursery.start_soon(images, scope)
            async with trio.open_nursery() as texts:
                for i in range(streams):
                    texts.start_soon(text, i)
            scope.cancel()
    done = [r for r in results if r.ok and r.first is not None and r.end is not None and r.tokens > 1]
    if len(done) < streams:
        raise RuntimeError(f"text streams failed: {[r.error for r in results if not r.ok]}")
    span = max(r.end for r in done if r.end) - min(r.first for r in done if r.first)
    return sum(r.tokens - 1 for r in done) / span, latencies


def mlx_vlm_ttft(model_dir: Path, rounds: int, size: tuple[int, int]) -> float:
    from mlx_vlm import generate, load

    model, processor = load(str(model_dir))
    seconds = []
    for r in range(-1, rounds):  # the first is a warm-up
        messages = [{"role": "user", "content": [{"type": "text", "text": f"Round {r}, a new picture."},
                                                 {"type": "image"}, {"type": "text", "text": "What is in it?"}]}]
        prompt = processor.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        start = time.perf_counter()
        generate(model, processor, prompt, image=[photo(100 + r, size)], max_tokens=1, temperature=0.0,
                 verbose=False)
        if r >= 0:
            seconds.append(time.perf_counter() - start)
    return statistics.median(seconds)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="tiny:bench-vlm,tiny:bench-qwen2.5-vl",
                        help="tiny:PRESET or a local vision model directory; several, comma-separated")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--size", default="640x480", help="the pictures' size, WxH")
    parser.add_argument("--streams", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=384, help="each text stream's tokens")
    parser.add_argument("--image-every", type=float, default=1.0, help="seconds between image requests arriving "
                                                                      "during the text streams (also run back to back)")
    args = parser.parse_args(argv)
    width, height = (int(x) for x in args.size.split("x"))
    for model in args.model.split(","):
        bench(model.strip(), args, (width, height))
    return 0


def bench(model: str, args: argparse.Namespace, size: tuple[int, int]) -> None:
    from runtime.models import resolve_model_path

    model_dir = resolve_model_path(model)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    with tempfile.TemporaryDirectory(prefix="flow-bench-vision-") as tmp_name:
        tmp = Path(tmp_name)
        graph = tmp / "graph.toml"
        graph.write_text(f'extends = "{ROOT / "graphs" / "default.toml"}"\n\n[resources.model]\n'
                         f'path = "{model_dir}"\nname = "bench"\naliases = []\n\n'
                         f'[resources.prefix_cache]\ndirectory = "{tmp / "kv"}"\n')
        import subprocess

        flow_bin = Path(sys.executable).parent / "flow"
        with open(tmp / "flow.log", "wb") as log:
            proc = subprocess.Popen([str(flow_bin), "--log-level", "WARNING", "serve", str(graph), "--port",
                                     str(port)], cwd=ROOT, stdout=subprocess.DEVNULL, stderr=log)
        try:
            wait_ready(url, proc)
            first = ttfts(url, args.rounds, size)
            print(f"TTFT cold {first['cold'] * 1000:.0f} ms, repeated image {first['repeated'] * 1000:.0f} ms, "
                  f"next turn {first['next_turn'] * 1000:.0f} ms", file=sys.stderr)
            trio.run(text_streams, url, 2, 8, size, None)  # warm-up
            alone, _ = trio.run(text_streams, url, args.streams, args.max_tokens, size, None)
            paced, paced_served = trio.run(text_streams, url, args.streams, args.max_tokens, size, args.image_every)
            busy, served = trio.run(text_streams, url, args.streams, args.max_tokens, size, 0.0)
        finally:
            proc.terminate()
            proc.wait(timeout=60)
    direct = mlx_vlm_ttft(model_dir, args.rounds, size)
    cold = first["cold"]
    print(f"\n{model} ({args.size} pictures), medians of {args.rounds} rounds\n")
    print("| | TTFT | vs cold |")
    print("|---|---|---|")
    print(f"| mlx_vlm.generate (cold, direct) | {direct * 1000:.0f} ms | {cold / direct:.2f}x flow's cold |")
    print(f"| flow, cold | {cold * 1000:.0f} ms | 1.00x |")
    print(f"| flow, repeated image (feature cache; tower passes: {first['tower_passes_on_repeat']}) | "
          f"{first['repeated'] * 1000:.0f} ms | **{cold / first['repeated']:.2f}x** faster |")
    print(f"| flow, next turn (prefix cache: {first['next_turn_cached_share']:.0%} of the prompt) | "
          f"{first['next_turn'] * 1000:.0f} ms | **{cold / first['next_turn']:.2f}x** faster |")
    def served_text(latencies: list[float]) -> str:
        middle = f", median {statistics.median(latencies):.2f} s each" if latencies else ""
        return f"{len(latencies)} image requests served{middle}"

    print(f"\n| {args.streams} text streams | decode tok/s | vs alone | image requests meanwhile |")
    print("|---|---|---|---|")
    print(f"| alone | {alone:.1f} | 1.00x | |")
    print(f"| an image request every {args.image_every:g} s | {paced:.1f} | **{paced / alone:.2f}x** | "
          f"{served_text(paced_served)} |")
    print(f"| image requests back to back | {busy:.1f} | {busy / alone:.2f}x | {served_text(served)} |")


if __name__ == "__main__":
    raise SystemExit(main())
