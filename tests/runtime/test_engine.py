"""The continuous-batching engine, driven directly: a device thread, tiny real models, trio."""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import threading
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import pytest
import trio
from mlx_lm.models.cache import BatchKVCache

from protocols.ir import SamplingParams, TokenChunk
from runtime.device import DeviceThread
from runtime.engine import Engine
from runtime.engine_config import STRATEGIES, EngineConfig, EngineOverloaded
from runtime.handle import SequenceHandle
from runtime.outbox import UNHELD_TOKENS
from runtime.step_phases import Phase, phases
from runtime.tiny import PRESETS, ensure_tiny_model

GREEDY = SamplingParams()


@dataclass
class Loaded:
    name: str
    model: Any
    tokenizer: Any
    device: DeviceThread

    def chat(self, text: str) -> list[int]:
        return list(self.tokenizer.apply_chat_template([{"role": "user", "content": text}],
                                                       add_generation_prompt=True))

    @property
    def eos(self) -> frozenset[int]:
        return frozenset(self.tokenizer.eos_token_ids)

    def reference(self, prompt: list[int], max_tokens: int) -> list[int]:
        """Greedy tokens from mlx-lm's own generate loop (``mlx_lm.generate`` runs this), up to EOS."""
        from mlx_lm.generate import generate_step

        def run() -> list[int]:
            out: list[int] = []
            for token, _ in generate_step(mx.array(prompt), self.model, max_tokens=max_tokens):
                if int(token) in self.eos:
                    break
                out.append(int(token))
            return out

        return self.device.call(run)


@pytest.fixture(scope="module")
def device() -> Iterator[DeviceThread]:
    thread = DeviceThread("test-engine-device")
    thread.start()
    yield thread
    thread.stop()


_loaded: dict[str, Loaded] = {}


def load(device: DeviceThread, preset: str) -> Loaded:
    if preset not in _loaded:
        from mlx_lm.utils import load as mlx_load

        path = ensure_tiny_model(preset)
        model, tokenizer = device.call(lambda: mlx_load(str(path))[:2])
        _loaded[preset] = Loaded(preset, model, tokenizer, device)
    return _loaded[preset]


@pytest.fixture(scope="module")
def qwen3(device: DeviceThread) -> Loaded:
    return load(device, "tiny-qwen3")


class Engines:
    """Makes engines on the test's device thread and closes them afterwards."""

    def __init__(self) -> None:
        self.made: list[Engine] = []

    def __call__(self, loaded: Loaded, **config: Any) -> Engine:
        # Every step's tokens handed out as they come: tests that start sequences once others have streamed some
        # see each step (the stream interval's own tests set one).
        config.setdefault("stream_interval", 0)
        engine = Engine(loaded.model, loaded.device, EngineConfig(**config))
        self.made.append(engine)
        return engine


@pytest.fixture
def engines() -> Iterator[Engines]:
    made = Engines()
    yield made
    for engine in made.made:
        engine.close()


@dataclass
class Result:
    tokens: list[int]
    finish: str | None
    chunks: list[TokenChunk]


async def collect(handle: SequenceHandle, on_chunk: Any = None) -> Result:
    tokens: list[int] = []
    chunks: list[TokenChunk] = []
    finish = None
    async with handle:
        async for chunk in handle.chunks:
            chunks.append(chunk)
            tokens.extend(chunk.token_ids)
            finish = chunk.finish_reason
            if on_chunk is not None:
                on_chunk(chunk)
    assert handle.error is None
    return Result(tokens, finish, chunks)


async def run_all(engine: Engine, prompts: list[list[int]], max_tokens: int, *,
                  sampling: list[SamplingParams] | None = None, stop: frozenset[int] = frozenset(),
                  stagger_after: int | None = None) -> list[Result]:
    """Run prompts concurrently; with ``stagger_after``, the second half joins once the
    first sequence has handed out that many tokens (so they merge into a running batch)."""
    results: list[Result | None] = [None] * len(prompts)
    params = sampling or [GREEDY] * len(prompts)
    first_half = len(prompts) if stagger_after is None else max(1, len(prompts) // 2)
    go = trio.Event()
    seen = 0

    def count(chunk: TokenChunk) -> None:
        nonlocal seen
        seen += len(chunk.token_ids)  # a chunk holds several when steps are quicker than the stream interval
        if stagger_after is not None and seen >= stagger_after:
            go.set()

    async def one(i: int) -> None:
        if i >= first_half:
            await go.wait()
        handle = engine.submit(prompts[i], max_tokens=max_tokens, stop_ids=stop, sampling=params[i])
        results[i] = await collect(handle, count if i == 0 else None)

    async with trio.open_nursery() as nursery:
        for i in range(len(prompts)):
            nursery.start_soon(one, i)
    return [r for r in results if r is not None]


PROMPTS = [
    "Tell me a story about a lighthouse.",
    "hi",
    "Count to ten and then explain why counting matters to people who like numbers.",
    "What is the capital of France?",
    "Write a haiku about the sea, the wind and a small boat sailing home at night.",
    "ok",
    "Describe a cat.",
]


async def wait_until(predicate: Any, timeout: float = 20.0) -> None:
    with trio.fail_after(timeout):
        while not predicate():
            await trio.sleep(0.01)


# --------------------------------------------------------------------------- greedy batch invariance

@pytest.mark.parametrize("preset", ["tiny-qwen3", "tiny-llama", "tiny-gemma3"])
async def test_batched_greedy_matches_mlx_lm_generate(device: DeviceThread, engines: Engines, preset: str) -> None:
    loaded = load(device, preset)
    prompts = [loaded.chat(p) for p in PROMPTS]
    if preset == "tiny-gemma3":
        # Past the 512-token sliding window: the rotating layers' batch cache wraps around.
        prompts[1] = loaded.chat("lighthouse keeper " * 160)
        prompts[5] = loaded.chat("sea " * 240)
        assert len(prompts[1]) > 512 and len(prompts[5]) > 480
    expected = [loaded.reference(p, 40) for p in prompts]
    engine = engines(loaded)
    results = await run_all(engine, prompts, 40, stop=loaded.eos, stagger_after=3)
    for got, want in zip(results, expected):
        assert got.tokens == want
        assert got.finish == ("length" if len(want) == 40 else "stop")
    assert engine.stats.peak_batch >= 4  # they really decoded together
    # (Whether some prompts were also prefilled together depends on arrival timing: not asserted here.)
    assert engine.active == 0 and engine.stats.kv_bytes == 0


async def test_chunked_prefill_of_a_linear_attention_model(device: DeviceThread, engines: Engines) -> None:
    """Qwen3.5's linear-attention layers keep a state, not position blocks (no prefix cache): a prompt prefilled in
    many chunks, beside short ones, still gives mlx-lm's tokens."""
    loaded = load(device, "tiny-qwen3.5")
    prompts = [loaded.chat("hi"), loaded.chat("Describe a cat."), loaded.chat("linear attention " * 40),
               loaded.chat("state space " * 30)]
    assert len(prompts[2]) > 4 * 16
    expected = [loaded.reference(p, 24) for p in prompts]
    # The long prompts arrive while the short ones decode: their chunks run beside the batch.
    results = await run_all(engines(loaded, prefill_chunk=16), prompts, 24, stop=loaded.eos, stagger_after=2)
    assert [r.tokens for r in results] == expected


async def test_a_lone_row_decodes_on_single_sequence_views_and_rows_join_it_after(
        qwen3: Loaded, engines: Engines, monkeypatch: pytest.MonkeyPatch) -> None:
    """A batch of one row runs its passes on KVCache views (runtime/cache_surgery.py's LoneRowViews) and hands their
    positions back: a row joining later, and the first row's steps after the second left (past 256 positions: the
    buffers grew while viewed), still give mlx-lm's tokens."""
    from runtime.cache_surgery import LoneRowViews

    viewed = 0
    done = LoneRowViews.done

    def counting(cache: list[Any], views: list[Any]) -> None:
        nonlocal viewed
        viewed += 1
        done(cache, views)

    monkeypatch.setattr(LoneRowViews, "done", staticmethod(counting))
    prompts = [qwen3.chat(PROMPTS[0]), qwen3.chat(PROMPTS[2])]
    expected = [qwen3.reference(prompts[0], 260), qwen3.reference(prompts[1], 12)]
    engine = engines(qwen3)
    first: list[Result] = []
    joined: list[Result] = []

    async def second(go: trio.Event) -> None:
        await go.wait()
        joined.append(await collect(engine.submit(prompts[1], max_tokens=12, stop_ids=qwen3.eos,
                                                  sampling=GREEDY)))

    go = trio.Event()
    seen = 0

    def count(chunk: TokenChunk) -> None:
        nonlocal seen
        seen += len(chunk.token_ids)
        if seen >= 20:
            go.set()

    async with trio.open_nursery() as nursery:
        nursery.start_soon(second, go)
        first.append(await collect(engine.submit(prompts[0], max_tokens=260, stop_ids=qwen3.eos,
                                                 sampling=GREEDY), count))
    assert len(expected[0]) == 260  # no EOS on the way: the row really decodes past 256 positions
    assert first[0].tokens == expected[0] and joined[0].tokens == expected[1]
    assert engine.stats.peak_batch == 2
    assert viewed > 200  # alone before the second came and after it left


# --------------------------------------------------------------------------- sampling inside the batch

SAMPLED = [
    SamplingParams(temperature=0.9, top_p=0.9, seed=1234),
    SamplingParams(temperature=1.2, top_k=20, min_p=0.05, seed=7, repetition_penalty=1.3),
    SamplingParams(temperature=0.7, seed=99, presence_penalty=0.5, frequency_penalty=0.4,
                   logit_bias=((17, 5.0), (23, 3.0))),
]


async def test_seeded_sampling_is_the_same_alone_and_in_a_batch(qwen3: Loaded, engines: Engines) -> None:
    prompts = [qwen3.chat(PROMPTS[i]) for i in range(len(SAMPLED))]
    alone = []
    for prompt, params in zip(prompts, SAMPLED):
        alone.append((await run_all(engines(qwen3), [prompt], 24, sampling=[params]))[0].tokens)
    # Inside a batch with greedy and unseeded neighbours, joining at different times.
    neighbours = [qwen3.chat(p) for p in PROMPTS[3:]]
    mixed = [*neighbours[:2], *prompts, *neighbours[2:]]
    mixed_params = [GREEDY, SamplingParams(temperature=1.0), *SAMPLED, SamplingParams(temperature=0.5, top_k=5),
                    GREEDY][: len(mixed)]
    engine = engines(qwen3)
    together = await run_all(engine, mixed, 24, sampling=mixed_params, stagger_after=2)
    assert [r.tokens for r in together[2 : 2 + len(SAMPLED)]] == alone
    assert engine.stats.peak_batch >= 4
    # The seed matters.
    other = await run_all(engines(qwen3), [prompts[0]], 24, sampling=[SamplingParams(temperature=0.9, top_p=0.9,
                                                                                     seed=4321)])
    assert other[0].tokens != alone[0]


async def test_logprobs_in_a_batch(qwen3: Loaded, engines: Engines) -> None:
    prompts = [qwen3.chat(p) for p in PROMPTS[:4]]
    params = [GREEDY, SamplingParams(logprobs=3), SamplingParams(temperature=0.8, seed=5, logprobs=0), GREEDY]
    results = await run_all(engines(qwen3), prompts, 12, sampling=params, stagger_after=2)
    assert all(not c.logprobs for r in (results[0], results[3]) for c in r.chunks)
    greedy = [lp for c in results[1].chunks for lp in c.logprobs]
    assert [lp.token for lp in greedy] == results[1].tokens
    for lp in greedy:
        assert len(lp.top) == 3 and lp.top[0][0] == lp.token and lp.top[0][1] == pytest.approx(lp.logprob)
        assert lp.logprob <= 0 and lp.top[0][1] >= lp.top[1][1] >= lp.top[2][1]
    sampled = [lp for c in results[2].chunks for lp in c.logprobs]
    assert [lp.token for lp in sampled] == results[2].tokens and all(not lp.top for lp in sampled)
    assert results[1].tokens == qwen3.reference(prompts[1], 12)


# --------------------------------------------------------------------------- scheduling

@pytest.mark.parametrize("strategy", STRATEGIES)
async def test_every_strategy_gives_the_same_greedy_output(qwen3: Loaded, engines: Engines, strategy: str) -> None:
    prompts = [qwen3.chat(p) for p in PROMPTS[:6]]
    expected = [qwen3.reference(p, 16) for p in prompts]
    # A small batch and chunk so that queueing, chunking and the balanced rule all happen.
    engine = engines(qwen3, strategy=strategy, max_batch=4, prefill_chunk=16)
    results = await run_all(engine, prompts, 16, stop=qwen3.eos, stagger_after=2)
    assert [r.tokens for r in results] == expected
    assert engine.stats.peak_batch == 4
    assert engine.stats.prefill_chunks > len(prompts)  # prompts were split into chunks


async def test_a_short_prompt_is_not_split_to_use_up_a_steps_budget(qwen3: Loaded, engines: Engines) -> None:
    # Three 10-token prompts queued before one step, a budget of 20: two are prefilled together (2 × 9 tokens);
    # the third would fit only in pieces (2 tokens now, 7 next step: two passes of one row) and waits for the
    # next step, where it is prefilled in one pass. Its answer is the same.
    engine = engines(qwen3, prefill_chunk=20)
    hold = threading.Event()
    qwen3.device.submit(lambda: hold.wait(10))
    prompts = [list(range(300 + 20 * i, 310 + 20 * i)) for i in range(3)]
    handles = [engine.submit(p, max_tokens=4, stop_ids=frozenset(), sampling=GREEDY) for p in prompts]
    hold.set()
    results = [await collect(h) for h in handles]
    assert engine.stats.grouped_prefills == 1 and engine.stats.prefill_chunks == 2
    assert [r.tokens for r in results] == [qwen3.reference(p, 4) for p in prompts]


async def _rows_after_each_step(qwen3: Loaded, engine: Engine, running: int, arriving: int,
                                rows_after_step: list[int]) -> list[int]:
    """``running`` rows decoding, then ``arriving`` 8-token prompts submitted at once: the decode batch's rows
    at the end of each step from there on (the prompts' answers checked against mlx-lm's)."""
    rows_after_step.clear()
    decoding = [engine.submit(list(range(200 + 20 * i, 212 + 20 * i)), max_tokens=64, stop_ids=frozenset(),
                              sampling=GREEDY) for i in range(running)]
    for handle in decoding:
        await handle.chunks.receive()
    await wait_until(lambda: len(engine._batch) == running)
    hold = threading.Event()
    qwen3.device.submit(lambda: hold.wait(10))
    start = len(rows_after_step)
    prompts = [list(range(300 + 20 * i, 308 + 20 * i)) for i in range(arriving)]
    handles = [engine.submit(p, max_tokens=3, stop_ids=frozenset(), sampling=GREEDY) for p in prompts]
    hold.set()
    results = [await collect(h) for h in handles]
    for handle in decoding:
        handle.cancel()
        handle.chunks.close()
    assert [r.tokens for r in results] == [qwen3.reference(p, 3) for p in prompts]
    return [n for n in rows_after_step[start:] if n > running]


async def test_a_burst_is_prefilled_before_its_first_rows_decode_alone(qwen3: Loaded, engines: Engines,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    # One row decodes; five 8-token prompts arrive at once. More prompts wait than rows decode: the step
    # prefills up to prefill_burst (4) chunks (passes of two prompts, 2 x 7 tokens each within the 16-token
    # chunk), so all five start in that one step and the next decode pass holds six rows. With the burst at 1,
    # one chunk a step: 3, 5, 6 rows a step apart. With as many rows decoding as prompts waiting, one chunk a
    # step either way.
    rows_after_step: list[int] = []
    close = Engine._close_step

    def recording_close(engine: Engine) -> bool:
        rows_after_step.append(len(engine._batch))
        return close(engine)

    monkeypatch.setattr(Engine, "_close_step", recording_close)
    burst = engines(qwen3, prefill_chunk=16)
    assert burst.config.prefill_burst == 4
    assert (await _rows_after_each_step(qwen3, burst, 1, 5, rows_after_step))[0] == 6
    assert (await _rows_after_each_step(qwen3, burst, 3, 3, rows_after_step))[:2] == [5, 6]
    one = engines(qwen3, prefill_chunk=16, prefill_burst=1)
    assert (await _rows_after_each_step(qwen3, one, 1, 5, rows_after_step))[:3] == [3, 5, 6]


async def test_an_idle_engine_waits_for_the_rest_of_a_burst(qwen3: Loaded, engines: Engines,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    # Three requests started by the server (runtime/arrivals.py), submitted a few turns of the loop apart: the
    # first is not prefilled alone while the others are on their way; all three go in one grouped pass.
    from runtime import arrivals

    monkeypatch.setattr(arrivals, "GATHER_SECONDS", 30.0)  # the wait ends with the arrivals, not with this bound
    engine = engines(qwen3)
    prompts = [list(range(300 + 20 * i, 310 + 20 * i)) for i in range(3)]
    places = [arrivals.ARRIVING.started() for _ in prompts]
    handles = []
    try:
        for prompt, place in zip(prompts, places):
            arrivals.CURRENT.set(place)  # as the server's request task has it
            handles.append(engine.submit(prompt, max_tokens=3, stop_ids=frozenset(), sampling=GREEDY))
            assert place.done  # the submit took it out of the count
            await trio.sleep(0.05)  # the device thread has long woken for the first one
        results = [await collect(h) for h in handles]
    finally:
        arrivals.CURRENT.set(None)
        for place in places:
            place.settle()
    assert arrivals.ARRIVING.count == 0
    assert engine.stats.grouped_prefills == 1 and engine.stats.prefill_chunks == 1
    assert [r.tokens for r in results] == [qwen3.reference(p, 3) for p in prompts]
    # A lone request, nothing else on its way: prefilled at once (alone, in a pass of its own).
    result = await collect(engine.submit(prompts[0], max_tokens=3, stop_ids=frozenset(), sampling=GREEDY))
    assert result.tokens == results[0].tokens and engine.stats.prefill_chunks == 2


async def test_long_prefill_interleaves_with_decoding(qwen3: Loaded, engines: Engines) -> None:
    engine = engines(qwen3, prefill_chunk=16)
    short = qwen3.chat("hi")
    long = qwen3.chat("a lighthouse on a rock, " * 60)
    assert len(long) > 300
    decoded_during_prefill = 0
    long_started = trio.Event()
    long_first_token = trio.Event()

    def on_short(chunk: TokenChunk) -> None:
        nonlocal decoded_during_prefill
        if long_started.is_set() and not long_first_token.is_set():
            decoded_during_prefill += len(chunk.token_ids)

    def on_long(_: TokenChunk) -> None:
        long_first_token.set()

    results: dict[str, Result] = {}

    async def run_short() -> None:
        results["short"] = await collect(engine.submit(short, max_tokens=400, stop_ids=frozenset(),
                                                       sampling=GREEDY), on_short)

    async def run_long() -> None:
        await wait_until(lambda: engine.stats.generated_tokens >= 3)
        handle = engine.submit(long, max_tokens=8, stop_ids=frozenset(), sampling=GREEDY)
        long_started.set()
        results["long"] = await collect(handle, on_long)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(run_short)
        nursery.start_soon(run_long)
    # The long prompt took len/16 prefill steps; the short stream got a token in (nearly) each.
    assert decoded_during_prefill >= (len(long) // 16) // 2
    assert results["long"].tokens == qwen3.reference(long, 8)
    assert results["short"].tokens == qwen3.reference(short, 400)


async def test_max_batch_bounds_the_batch(qwen3: Loaded, engines: Engines) -> None:
    engine = engines(qwen3, max_batch=2)
    prompts = [qwen3.chat(p) for p in PROMPTS[:5]]
    results = await run_all(engine, prompts, 6)
    assert all(len(r.tokens) == 6 for r in results)
    assert engine.stats.peak_batch == 2
    assert engine.stats.finished == 5


async def test_max_queue_overflow_raises(qwen3: Loaded, engines: Engines) -> None:
    engine = engines(qwen3, max_batch=1, max_queue=2)
    gate = threading.Event()
    blocked = qwen3.device.submit(lambda: gate.wait(30))  # hold the device thread
    prompt = qwen3.chat("hi")
    try:
        handles = [engine.submit(prompt, max_tokens=3, stop_ids=frozenset(), sampling=GREEDY) for _ in range(2)]
        with pytest.raises(EngineOverloaded) as raised:
            engine.submit(prompt, max_tokens=3, stop_ids=frozenset(), sampling=GREEDY)
        assert raised.value.retry_after >= 1
        assert engine.stats.rejected == 1 and engine.waiting == 2
    finally:
        gate.set()
    blocked.result(5)
    for handle in handles:
        assert len((await collect(handle)).tokens) == 3
    # Room again once the queue drains.
    assert len((await collect(engine.submit(prompt, max_tokens=2, stop_ids=frozenset(), sampling=GREEDY))).tokens) == 2


# --------------------------------------------------------------------------- cancellation and memory

async def test_a_row_that_finishes_beside_others_ends_before_the_batch_is_filtered(
        qwen3: Loaded, engines: Engines, monkeypatch: pytest.MonkeyPatch) -> None:
    """Filtering the batch cache reads its left padding, which waits for the pass in flight: the finished row's last
    chunk goes out first (a filter held until that stream has ended still lets it end)."""
    engine = engines(qwen3)
    ended = threading.Event()
    waited: list[bool] = []
    filter_rows = BatchKVCache.filter

    def held_filter(self: BatchKVCache, batch_indices: Any) -> None:
        if not waited:  # the first filter of the test: the short row's (its stream must have ended)
            waited.append(ended.wait(30))
        filter_rows(self, batch_indices)

    monkeypatch.setattr(BatchKVCache, "filter", held_filter)
    prompts = [qwen3.chat(p) for p in PROMPTS[:2]]
    long = engine.submit(prompts[0], max_tokens=40, stop_ids=frozenset(), sampling=GREEDY)
    short = engine.submit(prompts[1], max_tokens=4, stop_ids=frozenset(), sampling=GREEDY)
    async with trio.open_nursery() as nursery:
        results: list[Result] = []

        async def run_long() -> None:
            results.append(await collect(long))

        nursery.start_soon(run_long)
        first = await collect(short)
        ended.set()
    assert waited == [True], "the batch was filtered before the finished row's stream ended"
    assert first.finish == "length" and len(first.tokens) == 4
    assert results[0].tokens == qwen3.reference(prompts[0], 40)  # the rows that stayed decode on unchanged
    assert first.tokens == qwen3.reference(prompts[1], 4)


async def test_cancel_leaves_the_batch_and_frees_its_kv(qwen3: Loaded, engines: Engines) -> None:
    engine = engines(qwen3)
    prompts = [qwen3.chat(p) for p in PROMPTS[:3]]
    handles = [engine.submit(p, max_tokens=100_000, stop_ids=frozenset(), sampling=GREEDY) for p in prompts]
    for handle in handles:
        await handle.chunks.receive()
        await handle.chunks.receive()
    assert engine.active == 3 and engine.stats.kv_bytes > 0
    full = engine.stats.kv_bytes
    handles[1].cancel()
    await wait_until(lambda: engine.stats.cancelled == 1)
    assert engine.active == 2
    await wait_until(lambda: engine.stats.kv_bytes < full)
    # The others go on decoding after the filter.
    before = engine.stats.generated_tokens
    await wait_until(lambda: engine.stats.generated_tokens >= before + 4)
    for handle in (handles[0], handles[2]):
        handle.cancel()
    await wait_until(lambda: engine.stats.cancelled == 3)
    await wait_until(lambda: not engine.has_work())
    assert engine.active == 0 and engine.waiting == 0
    assert engine.stats.kv_bytes == 0
    stats = engine.stats_json()
    assert stats["active"] == 0 and stats["kv_bytes"] == 0 and stats["cancelled"] == 3
    for handle in handles:
        handle.chunks.close()


async def test_cancel_while_waiting_and_prefilling(qwen3: Loaded, engines: Engines) -> None:
    engine = engines(qwen3, max_batch=1, prefill_chunk=16)
    busy = engine.submit(qwen3.chat("hi"), max_tokens=100_000, stop_ids=frozenset(), sampling=GREEDY)
    await busy.chunks.receive()
    queued = engine.submit(qwen3.chat("sea " * 100), max_tokens=5, stop_ids=frozenset(), sampling=GREEDY)
    await wait_until(lambda: engine.waiting == 1)
    queued.cancel()
    await wait_until(lambda: engine.stats.cancelled == 1)
    assert engine.waiting == 0 and engine.active == 1
    busy.cancel()
    await wait_until(lambda: not engine.has_work())
    assert engine.stats.kv_bytes == 0
    for handle in (busy, queued):
        handle.chunks.close()


async def test_choices_share_one_prefill_and_outlive_a_cancelled_first(qwen3: Loaded, engines: Engines) -> None:
    engine = engines(qwen3, max_batch=8, prefill_chunk=16)
    prompt = qwen3.chat("tide " * 40)
    sampled = [SamplingParams(temperature=1.0, seed=s) for s in (1, 2, 3)]
    alone = [(await collect(engine.submit(prompt, max_tokens=6, stop_ids=frozenset(), sampling=p))).tokens
             for p in sampled]
    before = engine.stats.prompt_tokens
    handles = engine.submit_choices(prompt, [(p, None) for p in sampled], max_tokens=6, stop_ids=frozenset())
    results = [await collect(h) for h in handles]
    assert [r.tokens for r in results] == alone  # each choice samples as it would alone
    assert engine.stats.prompt_tokens - before == len(prompt) - 1 + 3  # one prefill; each choice's last token

    # The first choice's client leaves while its prompt waits (three choices need three rows, one is busy):
    # the others take its place and go on.
    engine = engines(qwen3, max_batch=3, prefill_chunk=16)
    busy = engine.submit(qwen3.chat("hi"), max_tokens=100_000, stop_ids=frozenset(), sampling=GREEDY)
    await busy.chunks.receive()
    other = qwen3.chat("foam " * 40)
    handles = engine.submit_choices(other, [(p, None) for p in sampled], max_tokens=6, stop_ids=frozenset())
    await wait_until(lambda: engine.waiting == 1)
    handles[0].cancel()
    await wait_until(lambda: engine.stats.cancelled == 1)
    assert engine.waiting == 1  # the two other choices, still waiting for rows
    busy.cancel()
    rest = [await collect(h) for h in handles[1:]]
    expected = [(await collect(engine.submit(other, max_tokens=6, stop_ids=frozenset(), sampling=p))).tokens
                for p in sampled[1:]]
    assert [r.tokens for r in rest] == expected
    await wait_until(lambda: not engine.has_work())
    assert engine.stats.kv_bytes == 0
    for handle in (busy, handles[0]):
        handle.chunks.close()


class DuringPass:
    """The engine's model, with ``action`` run on the device thread as its ``nth`` forward pass of ``tokens``
    input tokens per row begins: "the client leaves while this chunk is being computed"."""

    def __init__(self, model: Any, tokens: int, action: Any, nth: int = 1) -> None:
        self.model, self.tokens, self.action, self.left = model, tokens, action, nth

    def __call__(self, inputs: mx.array, cache: Any = None) -> mx.array:
        if self.action is not None and inputs.shape[1] == self.tokens:
            self.left -= 1
            if self.left == 0:
                action, self.action = self.action, None
                action()
        out: mx.array = self.model(inputs, cache=cache)
        return out

    def __getattr__(self, name: str) -> Any:
        return getattr(self.model, name)


PLAIN = list(range(300, 321))  # 21 tokens: with prefill_chunk=16, passes of 16 and 4, then its last token


async def test_a_waiting_sequence_cancelled_during_a_pass_gets_no_chunk_of_its_own(
        qwen3: Loaded, engines: Engines) -> None:
    """One step may prefill parts of several prompts (here the end of A's, then B's first tokens): B, cancelled
    while A's chunk runs, leaves before its own pass, not at the next step."""
    engine = engines(qwen3, prefill_chunk=16)
    a = engine.submit(PLAIN, max_tokens=2, stop_ids=frozenset(), sampling=GREEDY)
    b = engine.submit(list(range(400, 500)), max_tokens=2, stop_ids=frozenset(), sampling=GREEDY)
    engine.model = DuringPass(engine.model, 4, b.cancel)  # A's second chunk: 4 tokens, then 12 of B's in that step
    result = await collect(a)
    await wait_until(lambda: not engine.has_work())
    assert len(result.tokens) == 2
    assert engine.stats.cancelled == 1 and engine.stats.prefill_chunks == 2
    assert engine.stats.prompt_tokens == len(PLAIN)  # none of B's
    assert engine.waiting == engine.active == 0 and engine.stats.kv_bytes == 0
    b.chunks.close()


async def test_a_sequence_cancelled_during_its_last_chunk_gets_no_first_token(qwen3: Loaded, engines: Engines) -> None:
    engine = engines(qwen3, prefill_chunk=16)
    a = engine.submit(PLAIN, max_tokens=5, stop_ids=frozenset(), sampling=GREEDY)
    engine.model = DuringPass(engine.model, 4, a.cancel)
    await wait_until(lambda: engine.stats.cancelled == 1)
    await wait_until(lambda: not engine.has_work())
    assert engine.stats.prompt_tokens == len(PLAIN) - 1 and engine.stats.generated_tokens == 0
    assert engine.waiting == engine.active == 0 and engine.stats.kv_bytes == 0
    with pytest.raises(trio.WouldBlock):
        a.chunks.receive_nowait()  # nothing was handed out
    a.chunks.close()


async def test_a_prompt_prefilled_with_others_and_cancelled_meanwhile_gets_no_first_token(
        qwen3: Loaded, engines: Engines) -> None:
    engine = engines(qwen3)
    hold = threading.Event()
    qwen3.device.submit(lambda: hold.wait(10))  # both prompts are queued before the step that prefills them
    a = engine.submit(list(range(300, 310)), max_tokens=2, stop_ids=frozenset(), sampling=GREEDY)
    b = engine.submit(list(range(400, 412)), max_tokens=2, stop_ids=frozenset(), sampling=GREEDY)
    engine.model = DuringPass(engine.model, 11, b.cancel)  # the grouped pass: two rows of 11 tokens
    hold.set()
    result = await collect(a)
    await wait_until(lambda: not engine.has_work())
    assert len(result.tokens) == 2 and engine.stats.grouped_prefills == 1
    assert engine.stats.cancelled == 1 and engine.stats.generated_tokens == 2  # all of them A's
    assert engine.waiting == engine.active == 0 and engine.stats.kv_bytes == 0
    with pytest.raises(trio.WouldBlock):
        b.chunks.receive_nowait()
    b.chunks.close()


async def test_a_cancelled_long_prefill_stops_at_its_next_chunk(qwen3: Loaded, engines: Engines) -> None:
    engine = engines(qwen3, prefill_chunk=16)
    handle = engine.submit(list(range(300, 500)), max_tokens=5, stop_ids=frozenset(), sampling=GREEDY)
    engine.model = DuringPass(engine.model, 16, handle.cancel, nth=3)
    await wait_until(lambda: engine.stats.cancelled == 1)
    await wait_until(lambda: not engine.has_work())
    assert engine.stats.prompt_tokens == 3 * 16 and engine.stats.generated_tokens == 0
    assert engine.stats.kv_bytes == 0
    handle.chunks.close()


async def test_a_prefix_match_whose_caller_left_meanwhile_releases_its_hit(qwen3: Loaded) -> None:
    """The match runs on a worker thread that cannot be abandoned: a caller cancelled meanwhile gets Cancelled
    when it returns (it must not go on to submit), and the hit's block references are dropped."""
    from runtime.prefix_cache import PrefixCache, PrefixConfig, namespace_of

    cache = PrefixCache(PrefixConfig(block_tokens=4))
    engine = Engine(qwen3.model, qwen3.device, EngineConfig(), cache, namespace_of(qwen3.name))
    try:
        prompt = list(range(300, 340))
        await collect(engine.submit(prompt, max_tokens=1, stop_ids=frozenset(), sampling=GREEDY))
        match = cache.match
        token = trio.lowlevel.current_trio_token()
        matched: list[int] = []

        def leave_during_match(*args: Any) -> Any:
            token.run_sync_soon(scope.cancel)  # the client leaves while the match runs
            hit = match(*args)
            matched.append(len(hit.blocks))
            return hit

        cache.match = leave_during_match  # type: ignore[method-assign,assignment]
        with trio.CancelScope() as scope:
            await engine.match_prefix(prompt)
            pytest.fail("a cancelled caller got its hit")
        assert scope.cancelled_caught and matched[0] > 0
        assert all(block.refs == 0 for block in cache._blocks.values())
        assert engine.stats.submitted == 1
    finally:
        engine.close()


# --------------------------------------------------------------------------- stats (prefix cache: test_prefix_cache.py)

async def test_first_token_comes_from_the_prefill_not_a_batch_step(qwen3: Loaded, engines: Engines) -> None:
    """The last prompt token runs in a small pass right after the prefill and its logits give the first
    token: a one-token answer never waits for (or takes part in) a decode step of the batch."""
    engine = engines(qwen3)
    prompts = [qwen3.chat(p) for p in PROMPTS[:3]]
    results = await run_all(engine, prompts, 1)
    for prompt, result in zip(prompts, results):
        assert result.tokens == qwen3.reference(prompt, 1)[:1] and result.finish in ("length", "stop")
    assert engine.stats.decode_steps == 0 and engine.stats.finished == 3
    assert engine.stats.prompt_tokens == sum(len(p) for p in prompts)


async def test_stats_and_kv_estimate(qwen3: Loaded, engines: Engines) -> None:
    engine = engines(qwen3)
    spec = PRESETS["tiny-qwen3"]
    assert engine.kv_bytes_per_token() == spec.num_layers * spec.num_kv_heads * spec.head_dim * 2 * 4
    await run_all(engine, [qwen3.chat(p) for p in PROMPTS[:3]], 8)
    stats = engine.stats_json()
    for key in ("active", "waiting", "batch_size", "peak_batch", "kv_bytes", "kv_bytes_per_token", "steps",
                "decode_tokens_per_second", "prefill_tokens_per_second", "strategy", "max_batch", "rejected"):
        assert key in stats
    assert stats["generated_tokens"] == 24 and stats["finished"] == 3 and stats["decode_tokens_per_second"] > 0
    assert stats["prefill_tokens_per_second"] > 0 and stats["batch_size"] == 0


def test_config_is_validated() -> None:
    with pytest.raises(ValueError, match="strategy"):
        EngineConfig(strategy="fastest")  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        EngineConfig(max_batch=0)


@pytest.mark.skipif(mx.default_device().type != mx.DeviceType.cpu, reason="the CPU ordering of a step")
async def test_on_the_cpu_a_new_arrival_starts_before_the_batch_computes(qwen3: Loaded, engines: Engines,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """decode_first on the CPU: a step hands out the batch's tokens, then prefills and hands out new
    sequences' first tokens, and only then computes the batch's next pass (which the arrival would
    otherwise wait for)."""
    engine = engines(qwen3)
    events: list[str] = []
    real_step, real_start, real_async_eval = engine.step, engine.prefill.start, mx.async_eval

    def step() -> None:
        events.append("step")
        real_step()

    def start(rows: Any) -> None:
        events.append(f"start {len(rows)}")
        real_start(rows)

    def async_eval(*arrays: Any) -> None:
        events.append("batch pass")
        real_async_eval(*arrays)

    monkeypatch.setattr(engine, "step", step)
    monkeypatch.setattr(engine.prefill, "start", start)
    monkeypatch.setattr(mx, "async_eval", async_eval)
    prompts = [qwen3.chat(PROMPTS[0]), qwen3.chat(PROMPTS[4])]
    results = await run_all(engine, prompts, 24, stagger_after=4)
    assert [r.tokens for r in results] == [qwen3.reference(p, 24) for p in prompts]
    steps: list[list[str]] = []
    for event in events:
        if event == "step":
            steps.append([])
        elif steps:
            steps[-1].append(event)
    joined = [s for s in steps if "start 1" in s and "batch pass" in s]  # the arrival's step, a batch running
    assert joined and all(s.index("start 1") < s.index("batch pass") for s in joined), steps


@pytest.mark.skipif(mx.default_device().type != mx.DeviceType.cpu, reason="the CPU ordering of a step")
async def test_on_the_cpu_with_no_prompt_waiting_the_pass_runs_before_the_last_tokens_are_read(
        qwen3: Loaded, engines: Engines, monkeypatch: pytest.MonkeyPatch) -> None:
    """mlx-lm's order (step n+1's pass launched, then step n's tokens read), as on a GPU, while no prompt waits for
    the device; the launch phase's order while one does (the step above). The same tokens either way."""
    engine = engines(qwen3)
    decoder = engine._decoder
    passes: list[str] = []
    real_step, real_launch = decoder.step, decoder.launch

    def step(batch: Any, early: bool = False) -> Any:
        passes.append("early" if early else "in the launch phase")
        return real_step(batch, early)

    def launch(arrays: list[mx.array]) -> None:
        if arrays:
            passes.append("launched")
        real_launch(arrays)

    monkeypatch.setattr(decoder, "step", step)
    monkeypatch.setattr(decoder, "launch", launch)
    prompts = [qwen3.chat(PROMPTS[0]), qwen3.chat(PROMPTS[4])]
    results = await run_all(engine, prompts, 24, stagger_after=4)
    assert [r.tokens for r in results] == [qwen3.reference(p, 24) for p in prompts]
    assert passes.count("early") > 20 and passes.count("in the launch phase") >= 1, passes
    # each pass left to the launch phase is launched there, and only those
    assert passes.count("launched") == passes.count("in the launch phase"), passes
    assert all(after == "launched" for before, after in zip(passes, passes[1:]) if before == "in the launch phase")


@pytest.mark.parametrize("strategy", STRATEGIES)
async def test_every_step_runs_the_phase_tables_order(qwen3: Loaded, engines: Engines, strategy: str) -> None:
    """Each step the engine takes, with sequences arriving, prefilling, decoding and finishing, runs exactly the
    phases of runtime/step_phases.py's table for its strategy and device, in order; the output is unchanged."""
    engine = engines(qwen3, strategy=strategy, max_batch=4, prefill_chunk=32)
    steps: list[list[Phase]] = []

    def watched(phase: Phase, run: Any) -> Any:
        def wrapper() -> Any:
            if phase is Phase.INTAKE:
                steps.append([])
            steps[-1].append(phase)
            return run()
        return wrapper

    engine._run = {phase: watched(phase, run) for phase, run in engine._run.items()}
    engine._steps = engine._bound_steps()
    prompts = [qwen3.chat(p) for p in PROMPTS[:3]]
    results = await run_all(engine, prompts, 12, stagger_after=3)
    assert [r.tokens for r in results] == [qwen3.reference(p, 12) for p in prompts]
    want = list(phases(strategy, mx.default_device().type != mx.DeviceType.cpu))  # type: ignore[arg-type]
    assert len(steps) > 12 and all(step == want for step in steps), steps



# --------------------------------------------------------------------------- the stream interval (runtime/outbox.py)

async def test_quick_steps_hand_their_tokens_out_together(qwen3: Loaded, engines: Engines) -> None:
    """Steps quicker than the stream interval hand their tokens out together, one chunk a sequence: the same
    tokens as mlx-lm's, in order; a sequence's first tokens and its last (with its finish) never wait."""
    prompts = [qwen3.chat(p) for p in PROMPTS[:3]]
    every = await run_all(engines(qwen3, stream_interval=0), prompts, 24)
    grouped = await run_all(engines(qwen3, stream_interval=1.0), prompts, 24)
    for prompt, one, together in zip(prompts, every, grouped):
        assert one.tokens == together.tokens == qwen3.reference(prompt, 24)
        assert one.finish == together.finish and together.finish is not None
        assert all(len(c.token_ids) <= 1 for c in one.chunks) and len(one.chunks) >= len(one.tokens)
        if len(together.tokens) > UNHELD_TOKENS + 2:
            # the first tokens one by one, at once (the first from the prefill); the steps after them (~1 ms each)
            # share chunks, the last of which carries the finish
            assert [len(c.token_ids) for c in together.chunks[:UNHELD_TOKENS]] == [1] * UNHELD_TOKENS
            assert len(together.chunks) < len(together.tokens)
            assert together.chunks[-1].finish_reason == together.finish


async def test_tokens_held_for_the_interval_go_out_before_a_failure(qwen3: Loaded, engines: Engines,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """A step that fails hands out what earlier steps held back, then the failure: the client sees the same
    tokens and the same error as with every step's tokens handed out at once."""
    prompt = qwen3.chat(PROMPTS[0])
    seen: list[tuple[list[int], BaseException | None]] = []
    for interval in (0.0, 1.0):
        engine = engines(qwen3, stream_interval=interval)
        step = engine._decoder.step
        calls = 0

        def failing(*args: Any, **kwargs: Any) -> Any:
            nonlocal calls
            calls += 1
            if calls == 6:
                raise RuntimeError("the device broke")
            return step(*args, **kwargs)

        monkeypatch.setattr(engine._decoder, "step", failing)
        handle = engine.submit(prompt, max_tokens=64, stop_ids=frozenset(), sampling=GREEDY)
        tokens: list[int] = []
        with trio.fail_after(30):
            async with handle:
                async for chunk in handle.chunks:
                    tokens.extend(chunk.token_ids)
        seen.append((tokens, handle.error))
    (every, error), (grouped, grouped_error) = seen
    assert len(every) >= 4 and grouped == every == qwen3.reference(prompt, 64)[: len(every)]
    assert isinstance(error, RuntimeError) and isinstance(grouped_error, RuntimeError)
    assert str(grouped_error) == str(error) == "the device broke"


def test_the_stream_interval_is_validated() -> None:
    with pytest.raises(ValueError, match="stream_interval"):
        EngineConfig(stream_interval=-0.001)
