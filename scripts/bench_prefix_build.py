"""How long the prefix cache takes to rebuild a sequence's KV cache from a hit, by prefix length.

Run (OpenBLAS preloaded first, as the test script does)::

    eval "$(.venv/bin/python -m flow.cli.blas)"
    .venv/bin/python scripts/bench_prefix_build.py --layers 30 --kv-heads 3 --head-dim 64

For each length: one sequence's keys and values (random, float32, the given geometry; SmolLM2-135M's by
default) are stored in a fresh :class:`~runtime.prefix_cache.PrefixCache` as a prefill would store them, then
the longest hit is matched and built, ``--repeats`` times (best kept). With ``--disk`` the cache has a disk tier
and is restarted first, so the hit's blocks are read back from files, as after a restart. The time is what a
request with that hit waits before its first prefill chunk can start. No model and no server: the cache alone.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path
from typing import Any

import mlx.core as mx

from runtime.kv_disk import DiskTier
from runtime.prefix_cache import PrefixCache, PrefixConfig, namespace_of


def build_seconds(tokens: int, layers: int, heads: int, dim: int, block: int, repeats: int, disk: Path | None
                  ) -> float:
    kv = [mx.random.normal((1, heads, tokens, dim)) for _ in range(2 * layers)]
    mx.eval(kv)
    windows = (None,) * layers
    namespace, prompt = namespace_of("bench"), list(range(tokens))

    def cache() -> PrefixCache:
        return PrefixCache(PrefixConfig(block_tokens=block, hot_bytes=16 << 30),
                           DiskTier(disk, 16 << 30) if disk is not None else None)

    stored = cache()
    stored.store(namespace, prompt, lambda a, b: [x[..., a:b, :] for x in kv], windows=windows)
    best = float("inf")
    for _ in range(repeats):
        if disk is not None:
            assert stored.disk is not None
            stored.disk.close()  # a restart: the next cache reads the blocks back from their files
            stored = cache()
        hit = stored.match(namespace, [*prompt, 0], windows)
        assert hit.tokens == tokens, f"matched {hit.tokens} of {tokens} tokens"
        started = time.perf_counter()
        built = stored.build(hit)
        best = min(best, time.perf_counter() - started)
        assert mx.array_equal(built[-1].values, kv[-1]).item(), "the rebuilt cache differs from what was stored"
    if stored.disk is not None:
        stored.disk.close()
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lengths", default="1200,4000,16000", help="prefix lengths in tokens, comma-separated")
    parser.add_argument("--layers", type=int, default=30)
    parser.add_argument("--kv-heads", type=int, default=3)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--block-tokens", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--disk", action="store_true", help="read the blocks back from a disk tier (a restart)")
    parser.add_argument("--json", help="also write the result here")
    args = parser.parse_args()
    result: dict[str, Any] = {"layers": args.layers, "kv_heads": args.kv_heads, "head_dim": args.head_dim,
                              "block_tokens": args.block_tokens, "disk": args.disk, "build_ms": {}}
    for tokens in (int(n) for n in args.lengths.split(",")):
        with tempfile.TemporaryDirectory(prefix="flow-bench-build-") as tmp:
            seconds = build_seconds(tokens, args.layers, args.kv_heads, args.head_dim, args.block_tokens,
                                    args.repeats, Path(tmp) if args.disk else None)
        result["build_ms"][tokens] = round(seconds * 1000, 1)
        print(f"{tokens:>6} tokens ({tokens // args.block_tokens} blocks, {args.layers} layers"
              f"{', read back from disk' if args.disk else ''}): build {seconds * 1000:.1f} ms", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
