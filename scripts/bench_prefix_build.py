"""How long the prefix cache takes to store a prefilled sequence's blocks, and to rebuild its KV cache from a hit,
by prefix length.

Run (OpenBLAS preloaded first, as the test script does)::

    eval "$(.venv/bin/python -m flow.cli.blas)"
    .venv/bin/python scripts/bench_prefix_build.py --layers 30 --kv-heads 3 --head-dim 64

For each length: one sequence's keys and values (random, float32, the given geometry; SmolLM2-135M's by
default) are stored in a fresh :class:`~runtime.prefix_cache.PrefixCache` as a prefill would store them, then
the longest hit is matched and built, ``--repeats`` times (best kept). With ``--disk`` the cache has a disk tier
and is restarted first, so the hit's blocks are read back from files, as after a restart. The build's time is what
a request with that hit waits before its first prefill chunk can start; the store's (into a fresh cache, with
``--disk`` its blocks' writes queued for the disk tier) is what the device thread spends after a prefill to keep
its blocks. No model and no server: the cache alone.
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


def store_and_build_seconds(tokens: int, layers: int, heads: int, dim: int, block: int, repeats: int,
                            disk: Path | None) -> tuple[float, float]:
    kv = [mx.random.normal((1, heads, tokens, dim)) for _ in range(2 * layers)]
    mx.eval(kv)
    windows = (None,) * layers
    namespace, prompt = namespace_of("bench"), list(range(tokens))

    def cache(directory: Path | None = disk) -> PrefixCache:
        return PrefixCache(PrefixConfig(block_tokens=block, hot_bytes=16 << 30),
                           DiskTier(directory, 16 << 30) if directory is not None else None)

    def slicer(a: int, b: int) -> list[mx.array | None]:
        return [x[..., a:b, :] for x in kv]

    store = float("inf")
    for i in range(repeats):  # each into a fresh cache (with its own disk tier): every block is new
        fresh = cache(disk / f"store-{i}" if disk is not None else None)
        started = time.perf_counter()
        fresh.store(namespace, prompt, slicer, windows=windows)
        store = min(store, time.perf_counter() - started)
        if fresh.disk is not None:
            fresh.disk.close()
    stored = cache()
    stored.store(namespace, prompt, slicer, windows=windows)
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
    return store, best


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
                              "block_tokens": args.block_tokens, "disk": args.disk, "store_ms": {}, "build_ms": {}}
    for tokens in (int(n) for n in args.lengths.split(",")):
        with tempfile.TemporaryDirectory(prefix="flow-bench-build-") as tmp:
            store, build = store_and_build_seconds(tokens, args.layers, args.kv_heads, args.head_dim,
                                                   args.block_tokens, args.repeats, Path(tmp) if args.disk else None)
        result["store_ms"][tokens] = round(store * 1000, 1)
        result["build_ms"][tokens] = round(build * 1000, 1)
        print(f"{tokens:>6} tokens ({tokens // args.block_tokens} blocks, {args.layers} layers"
              f"{', disk tier' if args.disk else ''}): store {store * 1000:.1f} ms, build {build * 1000:.1f} ms"
              f"{' (read back from disk)' if args.disk else ''}", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
