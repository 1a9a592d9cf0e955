"""The prefix cache with the real engine on tiny real models: reuse is exact, memory is accounted.

Every test compares greedy output with mlx-lm's own generate loop (no cache at all):
whatever the cache supplies must not change a single token.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
import pytest
import trio

from protocols.ir import CachePolicy
from runtime.device import DeviceThread
from runtime.engine import Engine
from runtime.engine_config import EngineConfig
from runtime.kv_disk import DiskTier
from runtime.prefix_cache import PrefixCache, PrefixConfig, _pieces, namespace_of
from runtime.sequence import DecodeBatch
from runtime.tiny import TinySpec, ensure_tiny_model
from tests.runtime.test_engine import GREEDY, Loaded, collect

BLOCK = 8
SYSTEM = ("You are a careful assistant for a lighthouse keeper. Answer in short sentences, mention the sea "
          "when you can, and never forget the lamp. ") * 3


@pytest.fixture(scope="module")
def device() -> Iterator[DeviceThread]:
    thread = DeviceThread("test-prefix-device")
    thread.start()
    yield thread
    thread.stop()


def load(device: DeviceThread, preset: str | TinySpec) -> Loaded:
    """A tiny model on this module's device thread (models are bound to the thread that loaded them)."""
    from mlx_lm.utils import load as mlx_load

    path = ensure_tiny_model(preset)
    model, tokenizer = device.call(lambda: mlx_load(str(path))[:2])
    return Loaded(str(preset), model, tokenizer, device)


@pytest.fixture(scope="module")
def qwen3(device: DeviceThread) -> Loaded:
    return load(device, "tiny-qwen3")


def conversation(loaded: Loaded, *turns: str, system: str = SYSTEM) -> list[int]:
    messages: list[dict[str, str]] = [{"role": "system", "content": system}]
    for i, text in enumerate(turns):
        messages.append({"role": "user" if i % 2 == 0 else "assistant", "content": text})
    return list(loaded.tokenizer.apply_chat_template(messages, add_generation_prompt=True))


class Rig:
    """An engine with a prefix cache on the test's device thread."""

    def __init__(self, loaded: Loaded, cache: PrefixCache, **config: Any) -> None:
        self.loaded = loaded
        self.cache = cache
        config.setdefault("stream_interval", 0)  # every step's tokens as they come: tests time arrivals by them
        self.engine = Engine(loaded.model, loaded.device, EngineConfig(**config), cache, namespace_of(loaded.name))

    async def run(self, prompt: list[int], max_tokens: int = 12, policy: CachePolicy = CachePolicy()
                  ) -> tuple[list[int], int]:
        """(greedy tokens, cached prompt tokens), checked against mlx-lm without any cache."""
        hit = await self.engine.match_prefix(prompt, policy)
        handle = self.engine.submit(prompt, max_tokens=max_tokens, stop_ids=self.loaded.eos, sampling=GREEDY,
                                    prefix=hit, policy=policy)
        result = await collect(handle)
        assert result.tokens == self.loaded.reference(prompt, max_tokens), "the cache changed the output"
        await trio.to_thread.run_sync(self.cache.settled)  # the answer is stored just after its stream ended
        return result.tokens, handle.cached_tokens

    def close(self) -> None:
        self.engine.close()


@pytest.fixture
def rigs() -> Iterator[list[Rig]]:
    made: list[Rig] = []
    yield made
    for rig in made:
        rig.close()
        assert rig.cache.referenced() == 0, "a block is still referenced after every sequence ended"


def rig(rigs: list[Rig], loaded: Loaded, cache: PrefixCache | None = None, **config: Any) -> Rig:
    made = Rig(loaded, cache or PrefixCache(PrefixConfig(block_tokens=BLOCK)), **config)
    rigs.append(made)
    return made


async def test_repeat_extension_and_shared_prefix_are_reused_exactly(qwen3: Loaded, rigs: list[Rig]) -> None:
    r = rig(rigs, qwen3)
    first = conversation(qwen3, "Where is the lamp?")
    answer, cached = await r.run(first)
    assert cached == 0
    # Exact repeat: every prompt token but the last comes from the cache (its full blocks, then its tail).
    _, cached = await r.run(first)
    assert cached == len(first) - 1
    # The conversation's next turn: the earlier prompt, and the answer (cache_mode full) as far as its text
    # tokenizes back to the generated ids (the random model's often does not).
    follow = conversation(qwen3, "Where is the lamp?", qwen3.tokenizer.decode(answer), "And the keeper?")
    _, cached = await r.run(follow)
    assert cached >= len(first) - 1, (cached, len(first))
    # Another session with the same system prompt reuses the system prompt's blocks.
    other = conversation(qwen3, "Tell me about boats.")
    common = next(i for i, (a, b) in enumerate(zip(first, other)) if a != b)
    _, cached = await r.run(other)
    assert cached == common // BLOCK * BLOCK and cached > 0
    stats = r.cache.stats_json()
    assert stats["hits"] == 3 and stats["reused_tokens"] > 0 and 0 < stats["hit_rate"] < 1
    assert stats["blocks"]["hot"] == stats["stored_blocks"] + stats["stored_tails"] and stats["hot_bytes"] > 0
    assert stats["stored_tails"] > 0


async def test_a_stream_ends_before_its_answer_is_stored_and_the_next_turn_waits_for_the_store(
        qwen3: Loaded, rigs: list[Rig]) -> None:
    """A finished answer's blocks are copied into the cache after its last tokens went out (the stream's end does
    not wait for the copies); a next turn's match that comes meanwhile waits for them, and finds them."""
    r = rig(rigs, qwen3)
    prompt = conversation(qwen3, "Where is the lamp?")
    ended = threading.Event()
    waited: list[bool] = []  # per store of a finished answer: whether its stream had ended when the store began
    store = r.cache.store

    def held_store(namespace: bytes, tokens: list[int], *args: Any, **kwargs: Any) -> int:
        if len(tokens) > len(prompt):  # the prompt and its answer: the finish's store (a prompt's is shorter)
            waited.append(ended.wait(30))
        return store(namespace, tokens, *args, **kwargs)

    r.cache.store = held_store  # type: ignore[method-assign]
    handle = r.engine.submit(prompt, max_tokens=12, stop_ids=qwen3.eos, sampling=GREEDY)
    answer = (await collect(handle)).tokens  # the store is held until this stream has ended
    hits: list[Any] = []

    async def next_turn() -> None:
        hits.append(await r.engine.match_prefix(prompt + answer + answer[:1]))

    async with trio.open_nursery() as nursery:
        nursery.start_soon(next_turn)
        await trio.sleep(0.2)
        assert not hits, "the next turn's match did not wait for the answer's store"
        ended.set()
    assert waited == [True], "the answer was stored before its stream ended"
    hit = hits[0]
    assert hit is not None and hit.tokens > len(prompt), "the next turn missed the answer's blocks"
    r.cache.release(hit)
    assert answer == qwen3.reference(prompt, 12)  # (on the device thread: once the store has gone on)


async def test_a_step_that_fails_before_its_store_leaves_no_reader_waiting(
        qwen3: Loaded, rigs: list[Rig], monkeypatch: pytest.MonkeyPatch) -> None:
    """A step that fails between a row's finish and its store drops what it held: the cache's readers do not
    wait for a store that will not come (here the step fails as the finished row leaves the batch)."""
    r = rig(rigs, qwen3)
    settle = DecodeBatch.settle

    def failing_settle(self: DecodeBatch) -> bool:
        if self.staying is not None:
            raise RuntimeError("the filter failed")
        return settle(self)

    monkeypatch.setattr(DecodeBatch, "settle", failing_settle)
    long = r.engine.submit(conversation(qwen3, "Tell me about the harbour."), max_tokens=40,
                           stop_ids=frozenset(), sampling=GREEDY)
    short = r.engine.submit(conversation(qwen3, "Where is the lamp?"), max_tokens=4, stop_ids=frozenset(),
                            sampling=GREEDY)
    assert len((await collect(short)).tokens) == 4  # its last chunk went out before the step failed
    async with long:
        async for _ in long.chunks:
            pass
    assert long.error is not None  # the batch failed with the step
    assert r.cache.settled(timeout=0), "a reader would wait for the store of a failed step"


async def test_prefix_mode_keeps_the_prompt_only(qwen3: Loaded, rigs: list[Rig]) -> None:
    r = rig(rigs, qwen3)
    prompt = conversation(qwen3, "Describe the harbour at night, slowly.")
    await r.run(prompt, 30, CachePolicy(mode="prefix"))
    prompt_blocks = r.cache.stats.stored_blocks
    assert prompt_blocks == (len(prompt) - 1) // BLOCK
    await r.run(prompt, 30, CachePolicy(mode="full"))
    assert r.cache.stats.stored_blocks > prompt_blocks  # the answer's blocks joined


async def test_concurrent_grouped_prompts_share_and_store(qwen3: Loaded, rigs: list[Rig]) -> None:
    """Short prompts prefilled together (one batch) store their blocks from their batch rows."""
    r = rig(rigs, qwen3)
    prompts = [conversation(qwen3, q) for q in ("hi", "What is the capital of France?", "ok")]
    results: list[Any] = [None] * 3

    async def one(i: int) -> None:
        results[i] = await r.run(prompts[i], 6)

    async with trio.open_nursery() as nursery:
        for i in range(3):
            nursery.start_soon(one, i)
    assert r.engine.stats.grouped_prefills >= 1
    for prompt in prompts:
        _, cached = await r.run(prompt, 6)
        assert cached == len(prompt) - 1


async def run_together(r: Rig, prompts: list[list[int]], max_tokens: int) -> tuple[list[Any], list[Any]]:
    """Every prompt submitted (with its prefix hit) while the device thread is held, so that one step finds them
    all queued; their handles and greedy results."""
    hits = [await r.engine.match_prefix(p, CachePolicy()) for p in prompts]
    hold = threading.Event()
    r.loaded.device.submit(lambda: hold.wait(10))
    handles = [r.engine.submit(p, max_tokens=max_tokens, stop_ids=r.loaded.eos, sampling=GREEDY, prefix=h,
                               policy=CachePolicy()) for p, h in zip(prompts, hits)]
    results: list[Any] = [None] * len(handles)

    async def one(i: int) -> None:
        results[i] = await collect(handles[i])

    hold.set()
    async with trio.open_nursery() as nursery:
        for i in range(len(handles)):
            nursery.start_soon(one, i)
    return handles, results


async def test_prompts_that_share_a_cached_system_prompt_are_prefilled_together(qwen3: Loaded,
                                                                               rigs: list[Rig]) -> None:
    """Requests that share a cached system prompt (an agent's common case) are prefilled in one pass, each
    row from its own prefix hit, with output unchanged."""
    r = rig(rigs, qwen3)
    await r.run(conversation(qwen3, "Where is the lamp?"), 4)  # stores the system prompt's blocks
    prompts = [conversation(qwen3, q) for q in ("hi", "What is the capital of France, and why is it there?",
                                                  "ok", "Tell me about boats.")]
    prompts.append(conversation(qwen3, "Where is the lamp?", "By the sea.", "And the keeper?"))  # a longer hit
    before = r.engine.stats.grouped_prefills, r.engine.stats.prefill_chunks
    handles, results = await run_together(r, prompts, 6)
    assert (r.engine.stats.grouped_prefills, r.engine.stats.prefill_chunks) == (before[0] + 1, before[1] + 1)
    assert len({handle.cached_tokens for handle in handles}) == 2  # rows from hits of different lengths
    for prompt, handle, result in zip(prompts, handles, results):
        assert 0 < handle.cached_tokens < len(prompt) - 1
        assert result.tokens == qwen3.reference(prompt, 6), "prefilled from a hit in a group, the output changed"


async def test_prompts_cached_whole_start_in_one_pass(qwen3: Loaded, rigs: list[Rig]) -> None:
    """Requests whose whole prompt is cached (a retry, a regenerated answer) have only their last token to run:
    queued together, they start in one pass of one row each, not one pass per request."""
    r = rig(rigs, qwen3)
    prompts = [conversation(qwen3, q) for q in ("hi", "Tell me about boats.", "Where is the lamp?")]
    for prompt in prompts:
        await r.run(prompt, 4)
    passes: list[tuple[int, ...]] = []
    model = r.engine.model

    class Counting:
        def __call__(self, inputs: mx.array, cache: Any = None) -> mx.array:
            passes.append(tuple(inputs.shape))
            out: mx.array = model(inputs, cache=cache)
            return out

        def __getattr__(self, name: str) -> Any:
            return getattr(model, name)

    r.engine.model = Counting()
    handles, results = await run_together(r, prompts, 4)
    assert [handle.cached_tokens for handle in handles] == [len(p) - 1 for p in prompts]
    assert passes[0] == (3, 1)  # the three last prompt tokens, together
    for prompt, result in zip(prompts, results):
        assert result.tokens == qwen3.reference(prompt, 4)


async def test_a_repeat_queued_between_prompts_does_not_split_their_group(qwen3: Loaded, rigs: list[Rig]) -> None:
    """A request whose whole prompt is cached, queued between two that share the system prompt, is passed over
    by the group (one grouped pass for the two) and starts right after; every output unchanged."""
    r = rig(rigs, qwen3)
    repeat = conversation(qwen3, "Where is the lamp?")
    await r.run(repeat, 4)  # caches the system prompt, and the whole of this prompt
    prompts = [conversation(qwen3, "hi"), repeat, conversation(qwen3, "Tell me about boats, and the sea.")]
    before = r.engine.stats.grouped_prefills, r.engine.stats.prefill_chunks
    handles, results = await run_together(r, prompts, 4)
    assert (r.engine.stats.grouped_prefills, r.engine.stats.prefill_chunks) == (before[0] + 1, before[1] + 1)
    assert handles[1].cached_tokens == len(repeat) - 1
    for prompt, result in zip(prompts, results):
        assert result.tokens == qwen3.reference(prompt, 4)


async def test_a_row_cancelled_during_a_grouped_pass_from_hits_leaves_nothing_referenced(qwen3: Loaded,
                                                                                       rigs: list[Rig]) -> None:
    """A client leaving while its prompt is prefilled from a hit beside another: no first token for it, the other
    row's output unchanged, and no cached block left referenced (the ``rigs`` fixture checks at the end)."""
    from tests.runtime.test_engine import DuringPass, wait_until

    r = rig(rigs, qwen3)
    await r.run(conversation(qwen3, "Where is the lamp?"), 4)
    prompts = [conversation(qwen3, q) for q in ("hi", "Tell me about boats, and the sea.")]
    hits = [await r.engine.match_prefix(p, CachePolicy()) for p in prompts]
    hold = threading.Event()
    qwen3.device.submit(lambda: hold.wait(10))
    a, b = (r.engine.submit(p, max_tokens=3, stop_ids=qwen3.eos, sampling=GREEDY, prefix=h, policy=CachePolicy())
            for p, h in zip(prompts, hits))
    width = max(len(p) - 1 - handle.cached_tokens for p, handle in zip(prompts, (a, b)))
    r.engine.model = DuringPass(r.engine.model, width, b.cancel)  # the grouped pass: B leaves as it begins
    hold.set()
    result = await collect(a)
    await wait_until(lambda: not r.engine.has_work())
    assert r.engine.stats.cancelled == 1 and r.engine.stats.grouped_prefills == 1
    assert result.tokens == qwen3.reference(prompts[0], 3)
    with pytest.raises(trio.WouldBlock):
        b.chunks.receive_nowait()  # nothing was handed out
    b.chunks.close()


async def test_memory_limit_evicts_unreferenced_blocks(qwen3: Loaded, rigs: list[Rig]) -> None:
    per_block = qwen3.model.args.num_hidden_layers * 2 * qwen3.model.args.num_key_value_heads * BLOCK * \
        qwen3.model.args.head_dim * 4
    cache = PrefixCache(PrefixConfig(block_tokens=BLOCK, hot_bytes=per_block * 10))
    r = rig(rigs, qwen3, cache)
    for question in ("Where is the lamp?", "Tell me about boats.", "Why is the sea salty?"):
        await r.run(conversation(qwen3, question))
    stats = cache.stats_json()
    assert stats["evictions"] > 0 and stats["hot_bytes"] <= per_block * 10 and stats["blocks"]["hot"] <= 10
    await r.run(conversation(qwen3, "Where is the lamp?"))  # whatever is left is still exact


def disk_cache(directory: Path, **config: Any) -> PrefixCache:
    return PrefixCache(PrefixConfig(block_tokens=BLOCK, **config), DiskTier(directory, 1 << 30))


async def on_disk(loaded: Loaded, rigs: list[Rig], directory: Path, prompt: list[int], max_tokens: int = 12
                  ) -> list[int]:
    """Run ``prompt`` on a cache with a disk tier in ``directory``, then close it (as a process that ends)."""
    cache = disk_cache(directory)
    answer, _ = await rig(rigs, loaded, cache).run(prompt, max_tokens)
    assert cache.disk is not None
    cache.disk.close()
    return answer


async def test_disk_tier_survives_a_restart(qwen3: Loaded, rigs: list[Rig], tmp_path: Path) -> None:
    prompt = conversation(qwen3, "Where is the lamp?")
    await on_disk(qwen3, rigs, tmp_path, prompt)
    # A new process: an empty memory tier over the same directory.
    second = disk_cache(tmp_path)
    _, cached = await rig(rigs, qwen3, second).run(prompt)
    assert cached == (len(prompt) - 1) // BLOCK * BLOCK
    assert second.stats.disk_reads == cached // BLOCK and second.tier_of(None) == "cold"
    # A ttl=0 request stays in memory only.
    assert second.disk is not None
    written = second.disk.stats()["written"]
    await rig(rigs, qwen3, second).run(conversation(qwen3, "Something else entirely."), policy=CachePolicy(ttl_seconds=0))
    second.disk.flush()
    assert second.disk.stats()["written"] == written
    second.disk.close()


async def test_damaged_disk_blocks_are_never_served(qwen3: Loaded, rigs: list[Rig], tmp_path: Path) -> None:
    prompt = conversation(qwen3, "Where is the lamp?")
    await on_disk(qwen3, rigs, tmp_path, prompt)
    files = sorted((tmp_path / "blocks").rglob("*.safetensors"))
    assert len(files) >= 4
    # Restart order is the chain order only by chance: damage blocks by position in the prompt's chain.
    from runtime.prefix_cache import chain_keys

    keys = chain_keys(namespace_of(qwen3.name), prompt, (len(prompt) - 1) // BLOCK, BLOCK)
    truncated = DiskTier.path_in(tmp_path, keys[3])
    truncated.write_bytes(truncated.read_bytes()[:100])  # caught on start (size)
    flipped = DiskTier.path_in(tmp_path, keys[1])
    data = bytearray(flipped.read_bytes())
    data[-5] ^= 0xFF
    flipped.write_bytes(bytes(data))  # same size: caught on read (checksum)
    second = disk_cache(tmp_path)
    assert second.disk is not None and second.disk.stats()["corrupt"] == 1
    _, cached = await rig(rigs, qwen3, second).run(prompt)
    assert cached == BLOCK  # block 0 only: block 1 is damaged, so nothing after it is reachable
    assert second.disk.stats()["corrupt"] == 2
    # The recomputed blocks were written again, whole this time.
    second.disk.flush()
    assert flipped.read_bytes() != bytes(data) and second.disk.read(keys[1]) is not None
    second.disk.close()


def test_a_block_deleted_while_its_write_is_queued_stays_deleted(tmp_path: Path) -> None:
    """A superseded chunk-end snapshot is deleted right after its store queued its write (runtime/prefix_cache.py's
    forget_state): the write must not bring its index entry back once the file is gone."""
    from runtime.kv_disk import HostBlock

    tier = DiskTier(tmp_path, 1 << 30)
    block = HostBlock((np.zeros((1, 2, 4, 4), np.float32), None), "float32")
    keys = [bytes([i]) * 20 for i in range(8)]
    for key in keys:
        tier.write(key, None, b"n" * 16, block, time.time() + 60)
        tier.delete(key)
    tier.flush()
    assert not any(tier.has(key) for key in keys) and tier.stats()["blocks"] == 0 and tier.stats()["bytes"] == 0
    assert not list((tmp_path / "blocks").rglob("*.safetensors"))
    tier.close()


def test_blocks_read_at_once_are_each_checked(tmp_path: Path) -> None:
    """read_many (a hit's run of blocks from disk, on a few threads) gives what read gives for each block, and
    None for a damaged one, never its bytes."""
    from runtime.kv_disk import HostBlock

    tier = DiskTier(tmp_path, 1 << 30)
    keys = [bytes([i]) * 20 for i in range(12)]
    for i, key in enumerate(keys):
        tier.write(key, None, b"n" * 16, HostBlock((np.full((1, 2, 4, 4), i, np.float32), None), "float32"),
                   time.time() + 60)
    tier.flush()
    damaged = DiskTier.path_in(tmp_path, keys[5])
    data = bytearray(damaged.read_bytes())
    data[-3] ^= 0xFF
    damaged.write_bytes(bytes(data))
    got = tier.read_many(keys)
    assert got[5] is None and tier.stats()["corrupt"] == 1
    for i, host in enumerate(got):
        if i != 5:
            assert host is not None and host.arrays[1] is None and (host.arrays[0] == i).all()
    assert tier.read_many(keys[:1])[0] is not None and tier.read_many([]) == []
    tier.close()


async def test_expired_blocks_are_deleted(qwen3: Loaded, rigs: list[Rig], tmp_path: Path) -> None:
    cache = disk_cache(tmp_path)
    r = rig(rigs, qwen3, cache)
    prompt = conversation(qwen3, "Where is the lamp?")
    await r.run(prompt, policy=CachePolicy(ttl_seconds=0.2))
    assert cache.stats_json()["blocks"]["hot"] > 0
    time.sleep(0.3)
    assert qwen3.device.call(cache.sweep) > 0
    assert cache.disk is not None
    cache.disk.flush()
    stats = cache.stats_json()
    assert stats["blocks"] == {"hot": 0, "warm": 0} and stats["expired"] > 0
    _, cached = await r.run(prompt)
    assert cached == 0
    cache.disk.close()


GEMMA = TinySpec(arch="gemma3", num_layers=2, sliding_window=32)  # layer 0 slides over 32 positions, layer 1 is global


@pytest.fixture(scope="module")
def gemma(device: DeviceThread) -> Loaded:
    return load(device, GEMMA)


@pytest.mark.parametrize("chunk", [512, 16])
async def test_sliding_window_layers_are_rebuilt_exactly(gemma: Loaded, rigs: list[Rig], chunk: int) -> None:
    """Gemma 3's rotating caches: with prompts far longer than the window, in one prefill chunk or many
    (the window wraps between chunks), reuse is exact and covers every full block."""
    r = rig(rigs, gemma, prefill_chunk=chunk)
    assert r.engine.windows == (32, None) and r.engine.stats_json()["prefix_cache"] == "on"
    first = conversation(gemma, "Where is the lamp?")
    assert len(first) > 4 * 32
    answer, cached = await r.run(first, 40)
    assert cached == 0
    _, cached = await r.run(first, 40)
    assert cached == (len(first) - 1) // BLOCK * BLOCK
    follow = conversation(gemma, "Where is the lamp?", gemma.tokenizer.decode(answer), "And the keeper?")
    _, cached = await r.run(follow, 12)
    assert cached >= (len(first) - 1) // BLOCK * BLOCK
    other = conversation(gemma, "Tell me about boats.")
    _, cached = await r.run(other, 12)
    assert cached > 0


async def test_sliding_window_blocks_survive_a_restart(gemma: Loaded, rigs: list[Rig], tmp_path: Path) -> None:
    """Partial blocks (an answer longer than the window lacks the sliding layer's early positions) go to
    disk and come back as they were."""
    first = conversation(gemma, "Where is the lamp?")
    answer = await on_disk(gemma, rigs, tmp_path, first, 48)
    restarted = disk_cache(tmp_path)
    follow = conversation(gemma, "Where is the lamp?", gemma.tokenizer.decode(answer), "And the keeper?")
    _, cached = await rig(rigs, gemma, restarted).run(follow, 12)
    assert cached >= (len(first) - 1) // BLOCK * BLOCK and restarted.stats.disk_reads > 0
    assert restarted.disk is not None
    restarted.disk.close()


def test_reuse_stops_where_a_sliding_window_lacks_its_positions() -> None:
    """A block copied out after the window moved on lacks the sliding layer's part; a prefix is only
    reused to a depth whose last ``window`` positions all have it."""
    from runtime.prefix_cache import Block, usable_depth

    def block(i: int, sliding: bool) -> Block:
        part = mx.zeros((1, 1, BLOCK, 2))
        return Block(bytes([i]), None, b"", 0, 0.0, False, BLOCK,
                     [part if sliding else None, None if not sliding else part, part, part])

    windows = (16, None)  # layer 0 slides over two blocks
    blocks = [block(i, i >= 4) for i in range(8)]
    assert usable_depth(blocks, windows, BLOCK) == 8  # the last two blocks have it
    blocks[7] = block(7, False)
    assert usable_depth(blocks, windows, BLOCK) == 7
    blocks[5] = block(5, False)
    assert usable_depth(blocks, windows, BLOCK) == 0  # depth 5 would need blocks 3 and 4: 3 lacks it, and so on
    blocks = [block(i, i != 2) for i in range(8)]
    assert usable_depth(blocks, windows, BLOCK) == 8  # a gap far behind the window does not matter
    assert usable_depth(blocks[:4], windows, BLOCK) == 2  # depth 4 needs blocks 2 and 3
    assert usable_depth(blocks, (None, None), BLOCK) == 8  # no sliding layer: every block counts


def test_keep_or_nested_caches_fall_back_and_say_so() -> None:
    from mlx_lm.models.cache import ArraysCache, CacheList, KVCache, RotatingKVCache

    from runtime.prefix_cache import Recurrent, layer_windows

    assert layer_windows([KVCache(), RotatingKVCache(max_size=64)]) == (None, 64)
    assert layer_windows([KVCache(), ArraysCache(2)]) == (None, Recurrent(2))  # snapshots: test_prefix_hybrid.py
    # Falcon-H1's layers: a recurrent state and a KV cache in one CacheList, kept as both.
    assert layer_windows([CacheList(ArraysCache(2), KVCache())]) == (Recurrent(2, kv=True),)
    reason = layer_windows([KVCache(), CacheList(KVCache(), KVCache())])  # DeepSeek-V3.2's indexer keys beside KV
    assert isinstance(reason, str) and "CacheList" in reason and "prefilled in full" in reason
    assert isinstance(layer_windows([RotatingKVCache(max_size=64, keep=4)]), str)


async def test_sessions_report_their_tier(qwen3: Loaded, rigs: list[Rig], tmp_path: Path) -> None:
    cache = disk_cache(tmp_path, hot_bytes=1 << 20)
    r = rig(rigs, qwen3, cache)
    prompt = conversation(qwen3, "Where is the lamp?")
    await r.run(prompt, policy=CachePolicy(session_id="keeper"))
    state = cache.session("keeper")
    assert state is not None and state["tier"] == "hot" and state["turns"] == 1 and state["tokens"] >= len(prompt)
    assert cache.disk is not None
    cache.disk.flush()
    qwen3.device.call(cache.clear)
    state = cache.session("keeper")
    assert state is not None and state["tier"] == "warm"
    assert cache.session("nobody") is None
    cache.disk.close()


def test_block_keys_extend_a_growing_sequence_without_rehashing(monkeypatch: pytest.MonkeyPatch) -> None:
    """A sequence stores after every prefill chunk and at its finish: each block is hashed once, and the
    keys equal those of a chain computed in one go."""
    import hashlib

    from runtime.prefix_cache import BlockKeys, chain_keys

    tokens = list(range(1000, 1300))
    namespace = namespace_of("some model")
    calls = 0
    real = hashlib.sha256

    def counting(data: bytes) -> Any:
        nonlocal calls
        calls += 1
        return real(data)

    chain = BlockKeys(namespace, BLOCK)
    monkeypatch.setattr(hashlib, "sha256", counting)
    for end in (40, 41, 100, 100, 300):  # prefill chunks, then prompt and answer
        assert chain.upto(tokens[:end], end // BLOCK) == chain_keys(namespace, tokens, end // BLOCK, BLOCK)
    calls_for_chain = calls - sum(end // BLOCK for end in (40, 41, 100, 100, 300))  # minus the references
    assert calls_for_chain == 300 // BLOCK


@pytest.mark.parametrize("dtype", [mx.float32, mx.float16, mx.bfloat16])
def test_disk_blocks_round_trip_every_dtype_and_missing_layers(tmp_path: Path, dtype: Any) -> None:
    """A block file gives back exactly the arrays written: each KV dtype (bfloat16 goes through uint16),
    and the gaps of sliding-window layers that no longer held the block's positions."""
    from runtime.prefix_cache import _to_device, _to_host

    arrays = [mx.random.normal((1, 2, 16, 8)).astype(dtype), None, mx.arange(256).reshape(1, 2, 16, 8).astype(dtype)]
    disk = DiskTier(tmp_path, 1 << 30)
    disk.write(b"k" * 20, None, b"n" * 16, _to_host(arrays), time.time() + 60)
    disk.flush()
    back = _to_device(disk.read(b"k" * 20))  # type: ignore[arg-type]
    disk.close()
    assert back[1] is None
    for got, want in ((back[0], arrays[0]), (back[2], arrays[2])):
        assert got is not None and want is not None
        assert got.dtype == dtype and got.shape == want.shape and mx.array_equal(got, want).item()


# --------------------------------------------------------------------------- tails, without a model

LAYERS = 2


def positions(n: int) -> list[mx.array]:
    """Per layer keys and values whose every element is its token position: what a slice came from shows."""
    grid = mx.broadcast_to(mx.arange(n, dtype=mx.float32)[None, None, :, None], (1, 1, n, 2))
    return [grid + 1000 * layer for layer in range(2 * LAYERS)]


def store(cache: PrefixCache, tokens: list[int], *, tail: bool = True, windows: Any = (None,) * LAYERS) -> None:
    kv = positions(len(tokens))
    cache.store(NS, tokens, lambda a, b: [x[..., a:b, :] for x in kv], tail=tail, windows=windows)


NS = namespace_of("tails")
FULL = (None,) * LAYERS


def test_a_tail_continues_the_blocks_and_rebuilds_exactly() -> None:
    cache = PrefixCache(PrefixConfig(block_tokens=BLOCK))
    seq = list(range(100, 120))  # 2 blocks of 8 and a 4-token tail
    store(cache, seq)
    assert cache.stats.stored_blocks == 2 and cache.stats.stored_tails == 1
    hit = cache.match(NS, seq + [7, 8], FULL)
    assert hit.tokens == 20 and cache.referenced() == 3
    built = cache.build(hit)
    assert cache.referenced() == 0
    for layer, c in enumerate(built):
        assert c.offset == 20 and mx.array_equal(c.keys, positions(20)[2 * layer]).item()
        assert mx.array_equal(c.values, positions(20)[2 * layer + 1]).item()


def test_the_longest_matching_tail_wins_and_a_divergent_one_is_not_used() -> None:
    cache = PrefixCache(PrefixConfig(block_tokens=BLOCK))
    seq = list(range(100, 130))
    store(cache, seq[:18])  # tail of 2
    store(cache, seq[:21])  # tail of 5
    hit = cache.match(NS, seq, FULL)
    assert hit.tokens == 21
    cache.release(hit)
    diverged = seq[:19] + [5] + seq[20:]  # differs inside the 5-token tail: only the 2-token one fits
    hit = cache.match(NS, diverged, FULL)
    assert hit.tokens == 18
    cache.release(hit)
    # A hit always leaves the prompt's last token to compute, even where a longer tail exists.
    hit = cache.match(NS, seq[:21], FULL)
    assert hit.tokens == 18
    cache.release(hit)
    assert cache.referenced() == 0


def test_tails_need_full_layers_and_an_end() -> None:
    cache = PrefixCache(PrefixConfig(block_tokens=BLOCK))
    seq = list(range(100, 120))
    store(cache, seq, windows=(16, None))  # a sliding-window layer: whole blocks only
    store(cache, seq, tail=False)  # a prefill chunk that is not the prompt's end
    assert cache.stats.stored_tails == 0
    hit = cache.match(NS, seq + [1], FULL)
    assert hit.tokens == 16
    cache.release(hit)
    # Under no full block at all, a short sequence's tail still continues from the model's namespace.
    store(cache, [1, 2, 3, 4, 5])
    hit = cache.match(NS, [1, 2, 3, 4, 5, 6], FULL)
    assert hit.tokens == 5
    cache.release(hit)


def test_a_referenced_tail_outlives_eviction() -> None:
    per_token = 2 * LAYERS * 2 * 4  # bytes: keys and values, 2 floats a position
    cache = PrefixCache(PrefixConfig(block_tokens=BLOCK, hot_bytes=per_token * 24))
    seq = list(range(100, 120))
    store(cache, seq)
    hit = cache.match(NS, seq + [9], FULL)
    assert hit.tokens == 20
    store(cache, list(range(500, 540)))  # pushes everything unreferenced out
    assert cache.stats.evictions > 0
    built = cache.build(hit)  # the hit's blocks and tail were held
    assert built[0].offset == 20 and mx.array_equal(built[0].keys, positions(20)[0]).item()
    assert cache.referenced() == 0 and cache.hot_bytes <= per_token * 24


def test_blocks_stored_together_are_rebuilt_from_one_slice_per_layer() -> None:
    """A store's new blocks are views into one segment: a match across two stores and a tail joins three pieces
    per layer, not one per block (MLX's concatenate costs per input: a 16k-token prefix was over a second)."""
    cache = PrefixCache(PrefixConfig(block_tokens=BLOCK))
    seq = list(range(100, 150))  # 6 blocks of 8 and a 2-token tail
    store(cache, seq[:24], tail=False)  # blocks 0-2
    store(cache, seq)  # blocks 3-5 (0-2 are known) and the tail
    hit = cache.match(NS, seq + [7], FULL)
    assert hit.tokens == 50
    first, second = hit.blocks[0].segment, hit.blocks[3].segment
    assert first is not None and second is not None and first is not second
    assert [b.segment for b in hit.blocks] == [first] * 3 + [second] * 3 + [None]
    assert [p.shape[2] for p in _pieces(hit.blocks, 0)] == [24, 24, 2]
    # A block of a segment still reads as its own positions (views made when read), and counts its own bytes.
    fifth = hit.blocks[4]
    assert fifth.arrays is not None and len(fifth.arrays) == 2 * LAYERS and fifth.nbytes == 2 * LAYERS * BLOCK * 2 * 4
    assert all(mx.array_equal(a, positions(50)[i][..., 32:40, :]).item() for i, a in enumerate(fifth.arrays))
    assert fifth.arrays[-1] is fifth.arrays[2 * LAYERS - 1] and len(fifth.arrays[1:3]) == 2
    # A match that starts past a segment's first block (a sliding window's) reads its slice from there.
    assert [p.shape[2] for p in _pieces(hit.blocks[1:5], 1)] == [16, 16]
    built = cache.build(hit)
    for layer, c in enumerate(built):
        assert c.offset == 50 and mx.array_equal(c.keys, positions(50)[2 * layer]).item()
        assert mx.array_equal(c.values, positions(50)[2 * layer + 1]).item()


@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16])
def test_blocks_read_back_from_disk_are_joined_on_the_host(tmp_path: Path, dtype: Any) -> None:
    """After a restart, the blocks a match reads back from disk become one segment (concatenated by numpy, then
    one device array per layer), and rebuild exactly."""
    cache = PrefixCache(PrefixConfig(block_tokens=BLOCK), DiskTier(tmp_path, 1 << 30))
    kv = [a.astype(dtype) for a in positions(40)]
    cache.store(NS, list(range(100, 140)), lambda a, b: [x[..., a:b, :] for x in kv], windows=FULL)
    assert cache.disk is not None
    cache.disk.close()
    restarted = PrefixCache(PrefixConfig(block_tokens=BLOCK), DiskTier(tmp_path, 1 << 30))
    hit = restarted.match(NS, list(range(100, 141)), FULL)
    assert hit.tokens == 40 and all(b.host is not None for b in hit.blocks)
    blocks = list(hit.blocks)
    built = restarted.build(hit)
    assert blocks[0].segment is not None and all(b.segment is blocks[0].segment for b in blocks)
    for layer, c in enumerate(built):
        assert c.keys.dtype == dtype and mx.array_equal(c.keys, kv[2 * layer]).item()
        assert mx.array_equal(c.values, kv[2 * layer + 1]).item()
    assert restarted.hot_bytes == sum(b.nbytes for b in blocks) == 40 * 2 * LAYERS * 2 * dtype.size


def test_a_segment_counts_as_hot_until_most_of_it_has_left() -> None:
    """Blocks that leave memory while the rest of their segment holds its buffer still count as hot; once the
    rest holds less than half of it, each run of the rest is copied into a segment of its own and the buffer's
    bytes leave the count."""
    per_block = 2 * LAYERS * BLOCK * 2 * 4  # keys and values, 2 floats a position
    cache = PrefixCache(PrefixConfig(block_tokens=BLOCK, hot_bytes=per_block * 8))
    seq = list(range(100, 164))
    store(cache, seq, tail=False)  # 8 blocks, one segment: the whole budget
    old = cache.match(NS, seq[:25], FULL)  # references blocks 0-2
    assert cache.hot_bytes == 8 * per_block and old.tokens == 24
    segment = old.blocks[0].segment
    store(cache, list(range(500, 516)), tail=False)  # 2 blocks more: over the budget
    # Blocks 3-6 leaving free nothing (0-2 and 7 hold the buffer); block 7 leaving leaves less than half held.
    assert cache.stats.evictions == 5 and cache.hot_bytes == 5 * per_block
    new = cache.match(NS, seq[:25], FULL)
    assert new.blocks == old.blocks and new.blocks[0].segment not in (None, segment)
    assert [p.shape[2] for p in _pieces(new.blocks, 0)] == [24]
    for hit in (old, new):
        built = cache.build(hit)
        assert all(mx.array_equal(c.keys, positions(24)[2 * i]).item() for i, c in enumerate(built))
    assert cache.referenced() == 0


@pytest.mark.parametrize("bits", [None, 8])
def test_rows_stored_together_write_what_each_store_alone_would(tmp_path: Path, bits: int | None) -> None:
    """Rows stored inside ``storing()`` (a prefilled group's) are hot at once — a later row shares an earlier
    one's blocks — and settle in one wait at its end: every block file holds exactly what a store settled on its
    own writes, cut from its segment's host arrays (quantized: a block's codes are its segment's at its positions)."""
    base = [mx.random.normal((1, 2, 48, 32), key=mx.random.key(i)) for i in range(2 * LAYERS)]
    rows = [list(range(100, 140)), list(range(100, 116)) + list(range(300, 330))]  # two blocks shared

    def slicer(a: int, b: int) -> list[mx.array | None]:
        return [x[..., a:b, :] for x in base]

    caches = {}
    for name in ("together", "alone"):
        caches[name] = PrefixCache(PrefixConfig(block_tokens=BLOCK, disk_kv_bits=bits),
                                   DiskTier(tmp_path / name, 1 << 30))
    together, alone = caches["together"], caches["alone"]
    with together.storing():
        for tokens in rows:
            together.store(NS, tokens, slicer, tail=True, windows=FULL)
        assert together.match(NS, rows[1] + [1], FULL).tokens == 46  # hot before the settle
    for tokens in rows:
        alone.store(NS, tokens, slicer, tail=True, windows=FULL)
    assert together.stats.stored_blocks == alone.stats.stored_blocks == 5 + 3
    for cache in (together, alone):
        assert cache.disk is not None
        cache.disk.flush()
    assert together.disk is not None and alone.disk is not None
    assert set(together.disk.index) == set(alone.disk.index) and len(alone.disk.index) == 8
    for key in alone.disk.index:
        mine, theirs = together.disk.read(key), alone.disk.read(key)
        assert mine is not None and theirs is not None and mine.dtype == theirs.dtype
        assert len(mine.arrays) == len(theirs.arrays) == 2 * LAYERS * (3 if bits else 1)
        assert all(np.array_equal(a, b) for a, b in zip(mine.arrays, theirs.arrays))
    hit = together.match(NS, rows[0] + [1], FULL)
    built = together.build(hit)
    assert all(mx.array_equal(c.keys, base[2 * i][..., :40, :]).item() for i, c in enumerate(built))
    for cache in (together, alone):
        assert cache.disk is not None
        cache.disk.close()


def test_a_settle_that_fails_leaves_no_block_behind(monkeypatch: pytest.MonkeyPatch, caplog: Any) -> None:
    """Should the one evaluation of a group's stores fail (the device ran out of memory), its blocks leave the
    cache, the failure is logged, and nothing is raised: the sequences go on without their blocks stored."""
    cache = PrefixCache(PrefixConfig(block_tokens=BLOCK))

    def failing(*arrays: Any) -> None:
        raise RuntimeError("out of memory")

    with monkeypatch.context() as patch:
        patch.setattr(mx, "eval", failing)
        with cache.storing():
            store(cache, list(range(100, 124)))
            early = cache.match(NS, list(range(100, 125)), FULL)
            assert early.tokens == 24  # hot until the settle
    assert "could not store blocks" in caplog.text
    assert cache.hot_bytes == 0 and not cache._blocks
    cache.release(early)
    store(cache, list(range(100, 124)))  # the next store goes in whole
    again = cache.match(NS, list(range(100, 125)), FULL)
    assert again.tokens == 24 and cache.referenced() == 3
    cache.release(again)
    assert cache.referenced() == 0


@pytest.mark.parametrize("damage", ["header size", "unknown dtype", "negative offset", "past the end", "shape"])
def test_a_block_file_that_does_not_parse_is_refused(damage: str) -> None:
    """A file passes its checksum only if it was written whole; a header that lies is refused anyway."""
    import json
    import struct

    from runtime.kv_disk import _parse_block

    def block(header: dict[str, Any], payload: bytes, size: int | None = None) -> bytes:
        raw = json.dumps({"__metadata__": {"count": "1", "dtype": "float32"}, **header}).encode()
        return struct.pack("<Q", len(raw) if size is None else size) + raw + payload

    good = {"0": {"dtype": "F32", "shape": [1, 1, 2, 2], "data_offsets": [0, 16]}}
    assert _parse_block(block(good, bytes(16)))[0].shape == (1, 1, 2, 2)  # type: ignore[union-attr]
    bad = {
        "header size": block(good, bytes(16), size=10_000),
        "unknown dtype": block({"0": {**good["0"], "dtype": "I64"}}, bytes(16)),
        "negative offset": block({"0": {**good["0"], "data_offsets": [-16, 0]}}, bytes(16)),
        "past the end": block({"0": {**good["0"], "data_offsets": [16, 32]}}, bytes(16)),
        "shape": block({"0": {**good["0"], "shape": [1, 1, 2, -2]}}, bytes(16)),
    }[damage]
    with pytest.raises((ValueError, KeyError)):
        _parse_block(bad)


async def test_quantized_disk_blocks_round_trip_in_their_own_namespace(device: DeviceThread, rigs: list[Rig],
                                                                        tmp_path: Path) -> None:
    """``disk_kv_bits = 8``: blocks go to disk quantized (about a quarter of float32's bytes), come back close to
    the originals, and live in a namespace of their own: a cache without the setting never reads them."""
    from runtime.prefix_cache import _to_device, _to_host

    wide = load(device, TinySpec(num_heads=2, num_kv_heads=1))  # head_dim 32: a quantization group fits
    prompt = conversation(wide, "Where is the lamp?")
    cached_blocks = (len(prompt) - 1) // BLOCK

    async def cached_tokens(cache: PrefixCache) -> int:
        engine = rig(rigs, wide, cache).engine
        hit = await engine.match_prefix(prompt, CachePolicy())
        handle = engine.submit(prompt, max_tokens=4, stop_ids=wide.eos, sampling=GREEDY, prefix=hit)
        await collect(handle)  # the output of a lossy cache is the model's on slightly different KV
        return handle.cached_tokens

    first = disk_cache(tmp_path, disk_kv_bits=8)
    assert await cached_tokens(first) == 0
    assert first.disk is not None
    first.disk.close()
    files = list((tmp_path / "blocks").rglob("*.safetensors"))
    assert len(files) >= cached_blocks  # the prompt's, and the answer's full blocks
    plain = disk_cache(tmp_path)  # the same directory without quantization: another namespace
    assert await cached_tokens(plain) == 0
    assert plain.disk is not None
    plain.disk.close()
    again = disk_cache(tmp_path, disk_kv_bits=8)
    assert await cached_tokens(again) == cached_blocks * BLOCK and again.stats.disk_reads == cached_blocks
    assert again.disk is not None
    again.disk.close()
    # Bytes per block at a real model's shapes (16 tokens, 8 KV heads of 128): 8-bit codes with a scale and a
    # bias per 128 values.
    for dtype, ratio in ((mx.float32, 3.7), (mx.bfloat16, 1.9)):
        block = [mx.zeros((1, 8, 16, 128), dtype=dtype)] * 4
        host_bytes = [sum(a.nbytes for a in _to_host(block, kv_bits=bits).arrays if a is not None)
                      for bits in (None, 8)]
        assert host_bytes[0] >= ratio * host_bytes[1], (dtype, host_bytes)

    keys = mx.random.normal((1, 1, BLOCK, 32), key=mx.random.key(1))
    values = mx.random.normal((1, 1, BLOCK, 32), key=mx.random.key(2))
    restored = _to_device(_to_host([keys, None, values, values], kv_bits=8))
    assert restored[1] is None and restored[0] is not None and restored[2] is not None
    assert restored[0].shape == keys.shape and restored[0].dtype == keys.dtype
    assert float(mx.abs(restored[0] - keys).max()) < 0.02 * float(mx.abs(keys).max())
    assert float(mx.abs(restored[2] - values).max()) < 0.02 * float(mx.abs(values).max())
