"""The live quantized KV cache (runtime.quantized_kv) in the real engine, on tiny real models.

Greedy output is compared with mlx-lm's own single-sequence path with ``kv_bits`` (``generate_step``:
``KVCache`` quantized to ``QuantizedKVCache`` once it holds ``quantized_kv_start`` tokens), token for token:
alone, in a ragged batch that merges rows later, and through a prefix-cache hit.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import mlx.core as mx
import pytest

from runtime.device import DeviceThread
from runtime.engine import Engine
from runtime.engine_config import EngineConfig, KVQuantization
from runtime.kv_disk import DiskTier
from runtime.prefix_cache import PrefixCache, PrefixConfig, namespace_of
from runtime.quantized_kv import BatchQuantizedKVCache, KVQuantizationUnsupported, check_support
from runtime.tiny import PRESETS, TinySpec, ensure_tiny_model
from tests.runtime.test_engine import GREEDY, PROMPTS, Loaded, collect, run_all

CHUNK = 64  # prefill chunk of the engine and of mlx-lm's reference alike
# Head dimension 32 (a quantization group fits); the llama one has grouped-query attention (2 queries per KV head).
QWEN3 = TinySpec(num_heads=2, num_kv_heads=1)
LLAMA = TinySpec(arch="llama", hidden_size=128, num_heads=4, num_kv_heads=2)


@pytest.fixture(scope="module")
def device() -> Iterator[DeviceThread]:
    thread = DeviceThread("test-kvq-device")
    thread.start()
    yield thread
    thread.stop()


_loaded: dict[str, Loaded] = {}


def load(device: DeviceThread, spec: TinySpec) -> Loaded:
    key = spec.cache_key()
    if key not in _loaded:
        from mlx_lm.utils import load as mlx_load

        path = ensure_tiny_model(spec)
        model, tokenizer = device.call(lambda: mlx_load(str(path))[:2])
        _loaded[key] = Loaded(spec.arch, model, tokenizer, device)
    return _loaded[key]


def reference(loaded: Loaded, prompt: list[int], max_tokens: int, bits: int, start: int, chunk: int = CHUNK
              ) -> list[int]:
    """Greedy tokens from mlx-lm's generate loop with its own quantized KV cache."""
    from mlx_lm.generate import generate_step

    def run() -> list[int]:
        out: list[int] = []
        for token, _ in generate_step(mx.array(prompt), loaded.model, max_tokens=max_tokens, kv_bits=bits,
                                      kv_group_size=32, quantized_kv_start=start, prefill_step_size=chunk):
            if int(token) in loaded.eos:
                break
            out.append(int(token))
        return out

    return loaded.device.call(run)


def make_engine(loaded: Loaded, made: list[Engine], bits: int = 8, start: int = 0, prefix: PrefixCache | None = None,
                chunk: int = CHUNK, **config: Any) -> Engine:
    config.setdefault("stream_interval", 0)  # every step's tokens as they come: the tests watch each step
    engine = Engine(loaded.model, loaded.device,
                    EngineConfig(prefill_chunk=chunk, kv_quantization=KVQuantization(bits, None, start), **config),
                    prefix, namespace_of(loaded.name))
    made.append(engine)
    return engine


@pytest.fixture
def made() -> Iterator[list[Engine]]:
    engines: list[Engine] = []
    yield engines
    for engine in engines:
        engine.close()


@pytest.mark.parametrize("spec", [QWEN3, LLAMA], ids=["qwen3", "llama"])
@pytest.mark.parametrize("bits", [8, 4])
async def test_alone_the_quantized_batch_gives_mlx_lm_quantized_tokens(device: DeviceThread, made: list[Engine],
                                                                      spec: TinySpec, bits: int) -> None:
    loaded = load(device, spec)
    prompt = loaded.chat("Tell me a long story about a lighthouse keeper and the sea. " * 3)
    assert len(prompt) > CHUNK  # prefilled in two chunks, quantized after the first
    # The start before the prompt's end (quantized during prefill) and after it (during decoding).
    for start in (16, len(prompt) + 6):
        want = reference(loaded, prompt, 24, bits, start)
        engine = make_engine(loaded, made, bits, start)
        kinds: set[type] = set()
        got = await collect(engine.submit(prompt, max_tokens=24, stop_ids=loaded.eos, sampling=GREEDY),
                            lambda _: kinds.update(type(c) for c in engine._batch.cache))
        assert got.tokens == want
        assert BatchQuantizedKVCache in kinds  # it was decoding from quantized KV


async def test_a_ragged_batch_merged_later_gives_each_row_mlx_lm_quantized_tokens(device: DeviceThread,
                                                                                  made: list[Engine]) -> None:
    loaded = load(device, LLAMA)
    prompts = [loaded.chat(p) for p in PROMPTS]
    prompts[2] = loaded.chat("Count the waves, keeper, and tell me their names. " * 4)  # prefilled alone, chunked
    expected = [reference(loaded, p, 20, 8, 8) for p in prompts]
    engine = make_engine(loaded, made, 8, 8)
    results = await run_all(engine, prompts, 20, stop=loaded.eos, stagger_after=3)
    assert [r.tokens for r in results] == expected
    assert engine.stats.peak_batch >= 4
    assert engine.active == 0 and engine.stats.kv_bytes == 0


async def test_a_batch_is_quantized_once_its_longest_row_reaches_the_start(device: DeviceThread,
                                                                           made: list[Engine]) -> None:
    """A full-precision batch turns quantized, all its rows, once its longest row holds ``start`` tokens: that
    row's tokens are mlx-lm's (its cache turned at the same step), and the batch's KV bytes shrink."""
    import trio

    from mlx_lm.models.cache import BatchKVCache

    loaded = load(device, QWEN3)
    short, long = loaded.chat("hi"), loaded.chat("the sea " * 40)
    start = len(long) + 6
    want = reference(loaded, long, 24, 8, start)
    engine = make_engine(loaded, made, 8, start)
    seen: list[tuple[type, int, int]] = []  # (layer cache type, KV bytes, rows) after each chunk

    def watch(_: Any) -> None:
        if engine._batch.cache:
            seen.append((type(engine._batch.cache[0]), engine.stats.kv_bytes, len(engine._batch)))

    got: list[list[int]] = [[], []]

    async def run(i: int, prompt: list[int]) -> None:
        handle = engine.submit(prompt, max_tokens=24, stop_ids=frozenset(), sampling=GREEDY)
        got[i] = (await collect(handle, watch)).tokens

    async with trio.open_nursery() as nursery:
        nursery.start_soon(run, 0, long)
        nursery.start_soon(run, 1, short)
    assert got[0] == want[: len(got[0])] and len(got[1]) == 24
    kinds = [kind for kind, _, rows in seen if rows == 2]
    assert BatchKVCache in kinds and BatchQuantizedKVCache in kinds
    assert kinds.index(BatchQuantizedKVCache) > kinds.index(BatchKVCache)  # full precision first, then quantized
    full = max(b for kind, b, rows in seen if kind is BatchKVCache and rows == 2)
    quantized = min(b for kind, b, rows in seen if kind is BatchQuantizedKVCache and rows == 2)
    assert quantized < full


async def test_a_prefix_cache_hit_gives_the_same_tokens_and_keeps_the_namespaces_apart(
        device: DeviceThread, made: list[Engine]) -> None:
    loaded = load(device, QWEN3)
    cache = PrefixCache(PrefixConfig(block_tokens=16))
    prompt = loaded.chat("Where is the lamp of the lighthouse, and who keeps it lit at night? " * 2)
    want = reference(loaded, prompt, 16, 8, 24)
    engine = make_engine(loaded, made, 8, 24, prefix=cache)
    for expect_cached in (0, len(prompt) - 1):  # the second time every prompt token but the last is cached
        hit = await engine.match_prefix(prompt)
        handle = engine.submit(prompt, max_tokens=16, stop_ids=loaded.eos, sampling=GREEDY, prefix=hit)
        assert (await collect(handle)).tokens == want
        assert handle.cached_tokens == expect_cached
    blocks = [b for b in cache._blocks.values() if b.arrays]
    assert any(a is not None and a.dtype == mx.uint32 for b in blocks for a in b.arrays or [])  # codes kept as is
    # The same model without kv_bits shares the prefix cache but none of these blocks.
    plain = Engine(loaded.model, loaded.device, EngineConfig(prefill_chunk=CHUNK), cache, namespace_of(loaded.name))
    made.append(plain)
    assert plain.namespace != engine.namespace
    assert await plain.match_prefix(prompt) is None
    assert cache.referenced() == 0


async def test_quantized_blocks_round_trip_through_the_disk_tier_as_they_are(
        device: DeviceThread, made: list[Engine], tmp_path: Path) -> None:
    """Blocks cut from quantized rows go to disk as their codes (``disk_kv_bits`` does not quantize them again)
    and come back after a restart exactly: the same tokens as mlx-lm's quantized path (prefilled in block-sized
    chunks there and here, so the positions after the hit are computed alike)."""
    loaded = load(device, QWEN3)
    prompt = loaded.chat("The ships pass the lighthouse at night and the keeper counts them. " * 2)
    want = reference(loaded, prompt, 12, 8, 16, chunk=16)
    for restart in (False, True):
        cache = PrefixCache(PrefixConfig(block_tokens=16, disk_kv_bits=8), DiskTier(tmp_path, 1 << 30))
        engine = make_engine(loaded, made, 8, 16, prefix=cache, chunk=16)
        hit = await engine.match_prefix(prompt)
        handle = engine.submit(prompt, max_tokens=12, stop_ids=loaded.eos, sampling=GREEDY, prefix=hit)
        assert (await collect(handle)).tokens == want
        assert handle.cached_tokens == ((len(prompt) - 1) // 16 * 16 if restart else 0)
        assert cache.stats.disk_reads == (handle.cached_tokens // 16 if restart else 0)
        assert cache.disk is not None
        cache.disk.close()


async def test_speculative_decoding_trims_quantized_rows(device: DeviceThread, made: list[Engine],
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """Drafts verified on a quantized batch, accepted in part (ragged across rows): the rejected positions are
    trimmed from the quantized rows and greedy output is still mlx-lm's."""
    import runtime.speculative_step
    from runtime.engine_config import SpeculativeConfig
    from runtime.speculative import DraftState
    from tests.runtime.test_speculative import oracle

    loaded = load(device, QWEN3)
    prompts = [loaded.chat("the lamp, the sea, the keeper " * 3), loaded.chat("one two three")]
    expected = [reference(loaded, p, 24, 8, 0) for p in prompts]
    monkeypatch.setattr(runtime.speculative_step, "worth_verifying", lambda lengths, *_: max(lengths))
    for wrong_after in (None, 2):
        monkeypatch.setattr(DraftState, "propose",
                            oracle({len(p): want for p, want in zip(prompts, expected)}, wrong_after))
        engine = make_engine(loaded, made, 8, 0, speculative=SpeculativeConfig("ngram", max_draft=6))
        results = await run_all(engine, prompts, 24, stop=loaded.eos)
        assert [r.tokens for r in results] == expected
        assert engine.stats.speculative_steps > 0 and engine.stats.accepted_tokens > 0
        assert (engine.stats.accepted_tokens < engine.stats.draft_tokens) == (wrong_after is not None)


@pytest.mark.parametrize("preset, reason", [
    ("tiny-gemma3", "RotatingKVCache"),  # sliding-window layers
    ("tiny-qwen3-next", "ArraysCache"),  # recurrent (gated-delta) layers
    ("tiny-deepseek-v3", "head dimensions"),  # MLA: its latent and rope parts are no group's multiple
])
async def test_families_that_cannot_keep_quantized_kv_are_refused_at_load(device: DeviceThread, preset: str,
                                                                          reason: str) -> None:
    loaded = load(device, PRESETS[preset])
    with pytest.raises(KVQuantizationUnsupported, match=f"kv_bits = 8: .*{reason}.*remove kv_bits"):
        Engine(loaded.model, loaded.device, EngineConfig(kv_quantization=KVQuantization(8)))


def test_a_model_whose_attention_reads_the_cache_itself_is_refused_by_the_probe(device: DeviceThread) -> None:
    """Per layer a plain KVCache, but attention that takes its keys as an array: the probe pass says so."""
    loaded = load(device, QWEN3)

    class OwnAttention:
        def __init__(self, model: Any) -> None:
            self.model = model
            self.layers = model.layers

        def __call__(self, inputs: mx.array, cache: Any = None) -> mx.array:
            if cache is not None and hasattr(cache[0], "bits"):
                raise TypeError("keys must be an array")
            out: mx.array = self.model(inputs, cache=cache)
            return out

        def __getattr__(self, name: str) -> Any:
            return getattr(self.model, name)

    with pytest.raises(KVQuantizationUnsupported, match="attention does not take a quantized cache"):
        device.call(lambda: check_support(OwnAttention(loaded.model), KVQuantization(8), "own-attention"))


def test_the_group_must_divide_the_head_dimension(device: DeviceThread) -> None:
    loaded = load(device, QWEN3)
    assert device.call(lambda: check_support(loaded.model, KVQuantization(8))).group_size == 32
    with pytest.raises(KVQuantizationUnsupported, match="kv_group_size 64 does not divide"):
        device.call(lambda: check_support(loaded.model, KVQuantization(8, 64)))
    with pytest.raises(ValueError, match="kv_bits must be 4 or 8"):
        KVQuantization(3)



async def test_admission_counts_a_context_past_the_start_at_its_quantized_size(device: DeviceThread,
                                                                               made: list[Engine]) -> None:
    """The admission estimate (``Engine.kv_bytes_for``) of a context quantized from its first token equals what
    mlx-lm's quantized caches of the model hold for it; below the start, the full-precision figure."""
    from mlx_lm.models.cache import make_prompt_cache

    loaded = load(device, QWEN3)
    tokens = 256  # one whole allocation step of mlx-lm's caches: no spare room in the bytes held

    def held() -> int:
        cache = make_prompt_cache(loaded.model)
        loaded.model(mx.array([list(range(1, tokens + 1))]), cache=cache)
        quantized = [c.to_quantized(group_size=32, bits=8) for c in cache]
        mx.eval([c.state for c in quantized])
        return sum(c.nbytes for c in quantized)

    engine = make_engine(loaded, made, 8, 0)
    assert engine.kv_quantizer is not None and engine.kv_quantizer.group_size == 32
    assert engine.kv_bytes_for(tokens) == device.call(held)
    late = make_engine(loaded, made, 8, 100)
    per_token = late.kv_bytes_per_token()
    assert late.kv_bytes_for(100) == 100 * per_token
    assert 100 * per_token < late.kv_bytes_for(tokens) < tokens * per_token
