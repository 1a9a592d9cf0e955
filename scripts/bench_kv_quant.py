"""What quantized KV does to a real model: the prefix cache's cold and disk tiers (``disk_kv_bits``), and the
live batch's quantized KV cache (the model resource's ``kv_bits``, runtime.quantized_kv).

    eval "$(.venv/bin/python -m flow.cli.blas)"
    .venv/bin/python scripts/bench_kv_quant.py --model ~/.cache/flow/real-models/smollm2-135m-instruct

A fixed text (the start of this repository's README: the same bytes on every machine) is split into a prefix
(``--prefix`` tokens) and a continuation (``--continuation`` tokens). The prefix's KV is computed once; then the
continuation is scored (its perplexity given the prefix) and a greedy answer is generated from that KV as it is,
and after the round trip a cached turn's blocks make through the cold tier — ``runtime.prefix_cache``'s own
quantize-to-host and back (8 and 4 bits, groups along the head dimension) — exactly the arrays a turn read from
the disk tier gets.

The live part runs the real engine on a long prompt (``--context`` tokens of the same text) with and without
``kv_bits = 8`` (``quantized_kv_start`` = ``--start``), side by side in alternating rounds: KV bytes per token of
context held by the batch while decoding, decode tokens/s at that context (from the first token to the last),
the continuation's perplexity given the prefix with the KV as the live cache holds it (quantized after the
prefix's prefill, the scored tokens' own KV quantized as they go in, as a decoding row's is), and how far the
greedy answers agree.
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True, help="a local MLX model directory (float32 or bfloat16)")
    parser.add_argument("--prefix", type=int, default=512, help="tokens whose KV goes through the cache")
    parser.add_argument("--continuation", type=int, default=256, help="tokens scored after the prefix")
    parser.add_argument("--answer", type=int, default=48, help="greedy tokens generated after the prefix")
    parser.add_argument("--context", type=int, default=3072, help="live part: prompt tokens (a long context)")
    parser.add_argument("--decode", type=int, default=128, help="live part: tokens decoded per run")
    parser.add_argument("--start", type=int, default=2048, help="live part: quantized_kv_start")
    parser.add_argument("--rounds", type=int, default=2, help="live part: alternating runs of each setting")
    args = parser.parse_args(argv)

    import mlx.core as mx
    from mlx_lm.models.cache import KVCache, make_prompt_cache
    from mlx_lm.utils import load

    from runtime.prefix_cache import _to_device, _to_host

    model: Any
    model, tokenizer = load(str(Path(args.model).expanduser()))[:2]
    text = (ROOT / "README.md").read_text()
    tokens = tokenizer.encode(text)[: args.prefix + args.continuation]
    prefix, continuation = tokens[: args.prefix], tokens[args.prefix:]

    cache = make_prompt_cache(model)
    model(mx.array(prefix)[None], cache=cache)
    mx.eval([c.state for c in cache])
    layers = [(c.keys[..., : c.offset, :], c.values[..., : c.offset, :]) for c in cache]

    def rebuilt(bits: int | None) -> list[Any]:
        """The prefix's KV as a cached turn reads it back: through the cold tier's host form."""
        arrays = [a for kv in layers for a in kv]
        back = _to_device(_to_host(arrays, bits)) if bits else arrays
        out = []
        for i in range(0, len(back), 2):
            c = KVCache()  # type: ignore[no-untyped-call]  # (mlx-lm is untyped)
            keys, values = back[i], back[i + 1]
            assert keys is not None and values is not None
            c.update_and_fetch(keys, values)  # type: ignore[no-untyped-call]
            out.append(c)
        return out

    def perplexity(kv: list[Any]) -> float:
        logits = model(mx.array([prefix[-1], *continuation[:-1]])[None], cache=_trimmed(kv))[0]
        logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        nll = -mx.take_along_axis(logprobs, mx.array(continuation)[:, None], axis=-1).mean()
        return math.exp(float(nll.item()))  # type: ignore[arg-type]  # (a float scalar)

    def _trimmed(kv: list[Any]) -> list[Any]:
        """The KV of all but the prefix's last token (which goes in again to predict the first scored one)."""
        for c in kv:
            c.trim(1)
        return kv

    def greedy(kv: list[Any]) -> list[int]:
        kv = _trimmed(kv)
        out: list[int] = []
        token = prefix[-1]
        for _ in range(args.answer):
            logits = model(mx.array([[token]]), cache=kv)[0, -1]
            token = int(mx.argmax(logits).item())  # type: ignore[arg-type]  # (an integer scalar)
            out.append(token)
        return out

    full_ppl, full_answer = perplexity(rebuilt(None)), greedy(rebuilt(None))
    rows: list[tuple[str, int | None, float, list[int]]] = [("full precision (as computed)", None, full_ppl,
                                                             full_answer)]
    for bits in (8, 4):
        rows.append((f"{bits}-bit blocks (disk_kv_bits = {bits})", bits, perplexity(rebuilt(bits)),
                     greedy(rebuilt(bits))))
    dtype = str(layers[0][0].dtype).removeprefix("mlx.core.")
    print(f"\n{Path(args.model).name} ({dtype}): prefix {len(prefix)} tokens of README.md, perplexity over the next "
          f"{len(continuation)}, greedy answer of {args.answer} tokens\n")
    print("| prefix KV read back as | perplexity | vs full | greedy answer identical |")
    print("|---|---|---|---|")
    for label, _, ppl, answer in rows:
        same = next((i for i, (a, b) in enumerate(zip(answer, full_answer)) if a != b), len(answer))
        agreement = "all" if same == len(answer) else f"first {same} of {len(answer)} tokens"
        print(f"| {label} | {ppl:.3f} | {ppl / full_ppl:.4f}× | {agreement} |")
    live(model, tokenizer.encode(text * (1 + args.context // max(1, len(tokens)))), args, full_ppl_of=(
        prefix, continuation))
    return 0


def _agreement(answer: list[int], reference: list[int]) -> str:
    same = next((i for i, (a, b) in enumerate(zip(answer, reference)) if a != b), min(len(answer), len(reference)))
    return "all" if same == len(reference) == len(answer) else f"first {same} of {len(reference)} tokens"


def live(model: Any, text_tokens: list[int], args: argparse.Namespace,
         full_ppl_of: tuple[list[int], list[int]]) -> None:
    """The live quantized KV cache through the real engine, against full precision, side by side."""
    import math
    import time
    from functools import partial

    import mlx.core as mx
    import trio
    from mlx_lm.models.cache import make_prompt_cache

    from protocols.ir import SamplingParams
    from runtime.device import DeviceThread
    from runtime.engine import Engine
    from runtime.engine_config import EngineConfig, KVQuantization
    from runtime.quantized_kv import KVQuantizer, check_support

    prompt = text_tokens[: args.context]
    device = DeviceThread("bench-kv-quant")
    device.start()
    settings = {"full": KVQuantization(), "kv_bits = 8": KVQuantization(8, None, args.start)}
    engines = {label: Engine(model, device, EngineConfig(prefill_chunk=512, kv_quantization=kv))
               for label, kv in settings.items()}
    rates: dict[str, list[float]] = {label: [] for label in settings}
    per_token: dict[str, int] = {}
    answers: dict[str, list[int]] = {}

    async def run(label: str) -> None:
        engine = engines[label]
        handle = engine.submit(prompt, max_tokens=args.decode, stop_ids=frozenset(), sampling=SamplingParams())
        times: list[float] = []
        tokens: list[int] = []
        async with handle:
            async for chunk in handle.chunks:
                times.append(time.perf_counter())
                tokens.extend(chunk.token_ids)
                if engine.stats.kv_bytes:
                    per_token[label] = engine.stats.kv_bytes // (len(prompt) + len(tokens))
        rates[label].append((len(tokens) - 1) / (times[-1] - times[0]))
        answers[label] = tokens

    async def rounds() -> None:
        for _ in range(args.rounds):
            for label in settings:
                await run(label)

    trio.run(rounds)
    for engine in engines.values():
        engine.close()

    # Perplexity of the fixed continuation with the KV as each setting's live cache holds it.
    prefix, continuation = full_ppl_of
    quantizer: KVQuantizer = device.call(lambda: check_support(model, KVQuantization(8, None, 0)))

    def perplexity(quantized: bool) -> float:
        cache = make_prompt_cache(model)
        model(mx.array(prefix[:-1])[None], cache=cache)
        if quantized:
            quantizer.apply(cache)  # past the start: the row's KV is quantized, and what goes in after it too
        logits = model(mx.array([prefix[-1], *continuation[:-1]])[None], cache=cache)[0]
        logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        nll = -mx.take_along_axis(logprobs, mx.array(continuation)[:, None], axis=-1).mean()
        return math.exp(float(nll.item()))  # type: ignore[arg-type]  # (a float scalar)

    ppl = {label: device.call(partial(perplexity, label != "full")) for label in settings}
    device.stop()
    print(f"\nLive KV: a {len(prompt)}-token prompt, {args.decode} greedy tokens, one stream, {args.rounds} "
          f"alternating rounds (quantized_kv_start = {args.start}, group {quantizer.group_size}); perplexity "
          f"of the {len(continuation)} tokens after the {len(prefix)}-token prefix\n")
    print("| live KV | bytes per token of context | decode tokens/s | vs full | perplexity | vs full | "
          "greedy answer vs full |")
    print("|---|---|---|---|---|---|---|")
    base = sum(rates["full"]) / len(rates["full"])
    for label in settings:
        rate = sum(rates[label]) / len(rates[label])
        print(f"| {label} | {per_token.get(label, 0)} | {rate:.1f} ({', '.join(f'{r:.1f}' for r in rates[label])})"
              f" | {rate / base:.2f}× | {ppl[label]:.3f} | {ppl[label] / ppl['full']:.4f}× | "
              f"{_agreement(answers[label], answers['full'])} |")


if __name__ == "__main__":
    raise SystemExit(main())
