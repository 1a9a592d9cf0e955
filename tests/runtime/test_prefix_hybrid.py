"""The prefix cache on hybrid models: attention layers as blocks, recurrent layers as state snapshots.

Every run is compared with mlx-lm's own generate loop on the whole prompt (no cache): a hit restored from blocks
and a snapshot must give the same greedy tokens as a cold prefill, token for token.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import trio

from protocols.ir import CachePolicy
from runtime.prefix_keeper import TURN_MARGIN
from runtime.engine_config import SpeculativeConfig
from runtime.prefix_cache import MAX_CHUNK_STATES, PrefixCache, PrefixConfig, Recurrent, layer_windows
from tests.runtime.test_engine import GREEDY, Loaded, collect
from tests.runtime.test_prefix_cache import (BLOCK, Rig, conversation, device, disk_cache, load,  # noqa: F401
                                             rig, rigs)

HYBRIDS = ["tiny-qwen3.5", "tiny-qwen3-next", "tiny-granite4", "tiny-nemotron-h", "tiny-lfm2", "tiny-mamba2",
           "tiny-falcon-h1"]


@pytest.fixture(scope="module", params=HYBRIDS)
def hybrid(request: pytest.FixtureRequest, device: Any) -> Loaded:  # noqa: F811
    return load(device, request.param)


def test_recurrent_layers_are_snapshotted_not_refused(hybrid: Loaded) -> None:
    from mlx_lm.models.cache import make_prompt_cache

    windows = layer_windows(make_prompt_cache(hybrid.model))
    assert not isinstance(windows, str)
    # Recurrent layers, and attention ones with every position: on their own, or beside a recurrent state in one
    # layer (tiny-falcon-h1's). tiny-mamba2 has none: its blocks hold no KV.
    assert any(isinstance(w, Recurrent) for w in windows) and all(w is None or isinstance(w, Recurrent) for w in windows)
    positions = [w for w in windows if w is None or isinstance(w, Recurrent) and w.kv]
    assert bool(positions) != (hybrid.name == "tiny-mamba2")


async def test_repeat_next_turn_and_shared_system_prompt_are_exact(hybrid: Loaded, rigs: list[Rig]) -> None:  # noqa: F811
    r = rig(rigs, hybrid)
    assert r.engine.prefix is not None
    first = conversation(hybrid, "Where is the lamp?")
    answer, cached = await r.run(first, 16)
    assert cached == 0
    # An exact repeat: the snapshot at the prompt's end (all but its last token).
    _, cached = await r.run(first, 16)
    assert cached == len(first) - 1
    # The next turn renders the earlier prompt's last tokens otherwise: it resumes from the snapshot at the turn
    # point (the last block boundary TURN_MARGIN tokens or more before the earlier prompt's end), or deeper.
    follow = conversation(hybrid, "Where is the lamp?", hybrid.tokenizer.decode(answer), "And the keeper?")
    _, cached = await r.run(follow, 16)
    assert cached >= (len(first) - 1 - TURN_MARGIN) // BLOCK * BLOCK, (cached, len(first))
    stats = r.cache.stats_json()
    assert stats["stored_states"] > 0 and stats["state_hits"] == 2


async def test_chunk_end_snapshots_serve_a_shared_system_prompt(hybrid: Loaded, rigs: list[Rig]) -> None:  # noqa: F811
    """Small prefill chunks end on block boundaries: another session with the system prompt resumes from the
    deepest chunk end its prompt shares."""
    r = rig(rigs, hybrid, prefill_chunk=3 * BLOCK)
    first = conversation(hybrid, "Where is the lamp?")
    await r.run(first)
    other = conversation(hybrid, "Tell me about boats.")
    common = next(i for i, (a, b) in enumerate(zip(first, other)) if a != b)
    _, cached = await r.run(other)
    assert 0 < cached <= common and cached % BLOCK == 0 and common - cached < 3 * BLOCK + BLOCK


async def test_batched_hits_are_exact(hybrid: Loaded, rigs: list[Rig]) -> None:  # noqa: F811
    r = rig(rigs, hybrid, max_batch=8)
    prompts = [conversation(hybrid, q) for q in ("Where is the lamp?", "Tell me about boats.", "Is it late?")]
    for prompt in prompts:
        await r.run(prompt, 8)
    cached: list[int] = [0] * (2 * len(prompts))

    async def one(i: int) -> None:
        _, cached[i] = await r.run(prompts[i % len(prompts)], 10)

    async with trio.open_nursery() as nursery:
        for i in range(len(cached)):
            nursery.start_soon(one, i)
    assert all(c > 0 for c in cached)


async def test_speculative_rollback_with_hits_is_exact(hybrid: Loaded, rigs: list[Rig]) -> None:  # noqa: F811
    r = rig(rigs, hybrid, speculative=SpeculativeConfig(kind="ngram", max_draft=4))
    prompt = conversation(hybrid, "Repeat: the lamp, the lamp, the lamp, the lamp.")
    await r.run(prompt, 24)
    _, cached = await r.run(prompt, 24)
    assert cached == len(prompt) - 1


async def test_block_boundary_snapshots_survive_a_restart(hybrid: Loaded, rigs: list[Rig], tmp_path: Path
                                                          ) -> None:  # noqa: F811
    prompt = conversation(hybrid, "Where is the lamp?")
    cache = disk_cache(tmp_path)
    await rig(rigs, hybrid, cache, prefill_chunk=2 * BLOCK).run(prompt)
    assert cache.disk is not None
    cache.disk.close()
    second = disk_cache(tmp_path)  # a new process: memory empty, the disk tier kept
    _, cached = await rig(rigs, hybrid, second).run(prompt)
    # The deepest snapshot on a block boundary: the last chunk end on one (the deepest one is always kept), past
    # the turn point. Where the last chunk (up to the prompt's end) ends depends on the prompt's length.
    deepest = (len(prompt) - 1) // BLOCK * BLOCK
    assert cached % BLOCK == 0 and deepest - 2 * BLOCK < cached <= deepest, (cached, len(prompt))
    assert cached > (len(prompt) - 1 - TURN_MARGIN) // BLOCK * BLOCK
    assert second.stats.state_hits == 1 and second.stats.disk_reads == (len(prompt) - 1) // BLOCK + 1  # the blocks walked, one snapshot
    assert second.disk is not None
    second.disk.close()


async def test_damaged_snapshots_on_disk_are_never_served(hybrid: Loaded, rigs: list[Rig], tmp_path: Path
                                                          ) -> None:  # noqa: F811
    prompt = conversation(hybrid, "Where is the lamp?")
    cache = disk_cache(tmp_path)
    await rig(rigs, hybrid, cache, prefill_chunk=2 * BLOCK).run(prompt)
    assert cache.disk is not None
    cache.disk.close()
    files = sorted((tmp_path / "blocks").rglob("*.safetensors"))
    states = [f for f in files if f.stat().st_size < min(g.stat().st_size for g in files) * 100
              and "state" not in f.name]
    assert states
    for path in files:  # damage every file: whatever the match tries, it must refuse and prefill cold
        data = bytearray(path.read_bytes())
        data[-1] ^= 0xFF
        path.write_bytes(bytes(data))
    second = disk_cache(tmp_path)
    _, cached = await rig(rigs, hybrid, second).run(prompt)
    assert cached == 0 and second.disk is not None and second.disk.stats()["corrupt"] > 0
    second.disk.close()


async def test_a_cancelled_prefill_keeps_its_chunks(hybrid: Loaded, rigs: list[Rig]) -> None:  # noqa: F811
    """A client that leaves during a long prefill: its retry resumes from the last chunk it finished."""
    r = rig(rigs, hybrid, prefill_chunk=2 * BLOCK)
    prompt = conversation(hybrid, "Where is the lamp?", system="The keeper watches the lamp all night. " * 40)
    handle = r.engine.submit(prompt, max_tokens=4, stop_ids=hybrid.eos, sampling=GREEDY)
    while r.engine.stats.prefill_chunks < 12:  # past MAX_CHUNK_STATES: the deepest chunk end is kept
        await trio.sleep(0.005)
    handle.cancel()
    async with handle:
        pass
    await trio.sleep(0.05)
    held = sum(1 for block in r.cache._blocks.values() if block.length == 0)
    assert held == MAX_CHUNK_STATES < r.cache.stats.stored_states  # the first 7, and the deepest in place of the rest
    _, cached = await r.run(prompt)
    assert cached >= 12 * 2 * BLOCK and cached % BLOCK == 0


def test_snapshot_keys_differ_by_namespace(hybrid: Loaded) -> None:
    from runtime.prefix_cache import namespace_of, state_key

    assert state_key(namespace_of("a")) != state_key(namespace_of("b"))
    cache = PrefixCache(PrefixConfig(block_tokens=BLOCK))
    hit = cache.match(namespace_of("x"), list(range(40)), (None, Recurrent(2)))
    assert not hit.blocks and hit.state is None


_ = CachePolicy


def test_a_snapshot_of_mixed_dtypes_round_trips_through_disk(tmp_path: Path) -> None:
    """A bfloat16 model's gated-delta layer keeps its convolution window in bfloat16 and its recurrent state in
    float32: both come back from disk as they were."""
    import mlx.core as mx

    from runtime.kv_disk import DiskTier
    from runtime.prefix_cache import namespace_of

    windows = (None, Recurrent(2))
    tokens = list(range(2 * BLOCK))
    keys = mx.random.normal((1, 2, 2 * BLOCK, 4)).astype(mx.bfloat16)
    conv = mx.random.normal((1, 3, 8)).astype(mx.bfloat16)
    state = mx.random.normal((1, 2, 4, 4))
    cache = PrefixCache(PrefixConfig(block_tokens=BLOCK), DiskTier(tmp_path, 1 << 30))
    cache.store(namespace_of("m"), tokens, lambda a, b: [keys[..., a:b, :], keys[..., a:b, :], None, None],
                windows=windows, state=lambda: [conv, state])
    assert cache.disk is not None
    cache.disk.close()
    again = PrefixCache(PrefixConfig(block_tokens=BLOCK), DiskTier(tmp_path, 1 << 30))
    hit = again.match(namespace_of("m"), [*tokens, 7], windows)
    assert hit.tokens == 2 * BLOCK and hit.state is not None
    built = again.build(hit)
    assert built[1].cache[0].dtype == mx.bfloat16 and built[1].cache[1].dtype == mx.float32
    assert mx.array_equal(built[1].cache[0], conv) and mx.array_equal(built[1].cache[1], state)
    assert mx.array_equal(built[0].keys, keys)
    assert again.disk is not None
    again.disk.close()


def test_a_layer_of_kv_and_state_rebuilds_both(tmp_path: Path) -> None:
    """Falcon-H1's layers keep attention KV and a Mamba-2 state in one CacheList: the KV goes into the blocks, the
    state into the snapshot, and a hit, from memory or from disk, rebuilds the pair as the model made it."""
    import mlx.core as mx
    from mlx_lm.models.cache import CacheList

    from runtime.kv_disk import DiskTier
    from runtime.prefix_cache import namespace_of

    windows = (Recurrent(2, kv=True), Recurrent(2, kv=True))
    tokens = list(range(2 * BLOCK))
    keys, values = mx.random.normal((2, 1, 2, 2 * BLOCK, 4))
    conv, state = mx.random.normal((1, 3, 8)), mx.random.normal((1, 2, 4, 4))
    cache = PrefixCache(PrefixConfig(block_tokens=BLOCK), DiskTier(tmp_path, 1 << 30))
    cache.store(namespace_of("m"), tokens, lambda a, b: [keys[..., a:b, :], values[..., a:b, :]] * 2, windows=windows,
                state=lambda: [conv, state, conv * 2, state * 2])

    def rebuilt(where: PrefixCache) -> None:
        hit = where.match(namespace_of("m"), [*tokens, 7], windows)
        assert hit.tokens == 2 * BLOCK and hit.state is not None
        for i, layer in enumerate(where.build(hit)):
            assert isinstance(layer, CacheList) and layer[1].offset == 2 * BLOCK
            assert mx.array_equal(layer[1].keys, keys) and mx.array_equal(layer[1].values, values)
            assert mx.array_equal(layer[0].cache[0], conv * (i + 1)) and mx.array_equal(layer[0].cache[1], state * (i + 1))

    rebuilt(cache)
    assert cache.disk is not None
    cache.disk.close()
    again = PrefixCache(PrefixConfig(block_tokens=BLOCK), DiskTier(tmp_path, 1 << 30))  # a restart: from disk
    rebuilt(again)
    assert again.disk is not None and again.stats.disk_reads == 3  # two blocks and the snapshot
    again.disk.close()


async def test_several_choices_from_one_hit_are_exact(hybrid: Loaded, rigs: list[Rig]) -> None:  # noqa: F811
    """``n > 1``: the choices join the batch with copies of the first one's cache, restored from a snapshot."""
    r = rig(rigs, hybrid)
    prompt = conversation(hybrid, "Where is the lamp?")
    await r.run(prompt)
    hit = await r.engine.match_prefix(prompt)
    assert hit is not None and hit.tokens == len(prompt) - 1
    handles = r.engine.submit_choices(prompt, [(GREEDY, None)] * 3, max_tokens=10, stop_ids=hybrid.eos,
                                      prefix=hit)
    expected = hybrid.reference(prompt, 10)
    for handle in handles:
        assert (await collect(handle)).tokens == expected


async def test_mtp_speculation_from_a_snapshot_hit_is_exact(device: Any) -> None:  # noqa: F811
    """Qwen3.5's own MTP layers draft from a hit: their context starts where the hit ends; the output stays."""
    from runtime.engine import Engine
    from runtime.engine_config import EngineConfig
    from runtime.mtp import load_mtp_drafter
    from runtime.prefix_cache import namespace_of
    from runtime.tiny import ensure_tiny_model

    loaded = load(device, "tiny-qwen3.5-mtp")
    path = ensure_tiny_model("tiny-qwen3.5-mtp")
    drafter = device.call(lambda: load_mtp_drafter(path, loaded.model))
    cache = PrefixCache(PrefixConfig(block_tokens=BLOCK))
    engine = Engine(loaded.model, device, EngineConfig(speculative=SpeculativeConfig(kind="mtp", max_draft=4)),
                    cache, namespace_of("mtp"), draft_model=drafter)
    try:
        prompt = conversation(loaded, "Where is the lamp?")
        expected = loaded.reference(prompt, 16)
        for round in range(2):
            hit = await engine.match_prefix(prompt)
            assert (hit is not None) == (round == 1)
            handle = engine.submit(prompt, max_tokens=16, stop_ids=loaded.eos, sampling=GREEDY, prefix=hit)
            assert (await collect(handle)).tokens == expected
        assert engine.stats.speculative_steps > 0
    finally:
        engine.close()
    assert cache.referenced() == 0


async def test_prefix_mode_and_memory_only_ttl(hybrid: Loaded, rigs: list[Rig], tmp_path: Path) -> None:  # noqa: F811
    """``cache_mode = "prefix"`` keeps the prompt's snapshots, not the answer's; ``ttl = 0`` keeps them in memory only."""
    cache = disk_cache(tmp_path)
    assert cache.disk is not None
    r = rig(rigs, hybrid, cache, prefill_chunk=2 * BLOCK)
    prompt = conversation(hybrid, "Describe the harbour at night, slowly.")
    memory_only = CachePolicy(mode="prefix", ttl_seconds=0)
    await r.run(prompt, 20, memory_only)
    cache.disk.flush()
    assert cache.disk.stats()["written"] == 0
    states = cache.stats.stored_states
    _, cached = await r.run(prompt, 20, memory_only)
    assert cached == len(prompt) - 1 and cache.stats.stored_states == states  # nothing new: no answer's snapshot
    await r.run(prompt, 20, CachePolicy(mode="full"))
    assert cache.stats.stored_states == states + 1  # the finish's
    cache.disk.flush()
    assert cache.disk.stats()["written"] > 0  # the default ttl: the answer's full blocks go to disk
    cache.disk.close()
