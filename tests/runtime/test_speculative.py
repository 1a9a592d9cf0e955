"""Speculative decoding (prompt lookup) in the continuous batch, on tiny real models: greedy output identical
with speculation on and off — alone, in a batch whose rows accept different amounts, with stops and limits
landing inside accepted drafts; sampled rows keep the model's distribution (rejection sampling, measured);
the drafter's lookup and its adaptive length."""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
import pytest
import trio

from protocols.ir import SamplingParams
from runtime.device import DeviceThread
from runtime.engine import Engine
from runtime.engine_config import EngineConfig, SpeculativeConfig
from runtime.models import LoadedModel, load_model
from runtime.sampling import SequenceSampler
from runtime.speculative import DraftState, sampled_verify
from runtime.tiny import ensure_tiny_model

NGRAM = SpeculativeConfig(kind="ngram", max_draft=6)
GREEDY = SamplingParams()
REPEATING = list(range(5, 45)) * 3  # a prompt the model's random weights tend to continue by repetition
PLAIN = list(range(200, 260))


@pytest.fixture(scope="module")
def device() -> Iterator[DeviceThread]:
    thread = DeviceThread("test-speculative-device")
    thread.start()
    yield thread
    thread.stop()


def pair(device: DeviceThread, preset: str) -> tuple[LoadedModel, LoadedModel]:
    """The same model twice: speculation off, and on."""
    path = ensure_tiny_model(preset)
    return (load_model(f"{preset}-off", path, device, EngineConfig()),
            load_model(f"{preset}-on", path, device, EngineConfig(speculative=NGRAM)))


async def tokens(engine: Engine, prompt: list[int], max_tokens: int = 40, sampling: SamplingParams = GREEDY,
                 stop: frozenset[int] = frozenset()) -> tuple[list[int], str | None]:
    handle = engine.submit(prompt, max_tokens=max_tokens, stop_ids=stop, sampling=sampling)
    out: list[int] = []
    finish = None
    async with handle:
        async for chunk in handle.chunks:
            out.extend(chunk.token_ids)
            finish = chunk.finish_reason
    assert handle.error is None
    return out, finish


async def together(engine: Engine, prompts: list[list[int]], **kwargs: Any) -> list[list[int]]:
    results: list[list[int]] = [[] for _ in prompts]

    async def one(i: int) -> None:
        results[i] = (await tokens(engine, prompts[i], **kwargs))[0]

    async with trio.open_nursery() as nursery:
        for i in range(len(prompts)):
            nursery.start_soon(one, i)
    return results


@pytest.mark.parametrize("preset", ["tiny-llama", "tiny-qwen3", "tiny-qwen3.5"])
async def test_greedy_output_is_identical_with_lookup_drafts(device: DeviceThread, preset: str) -> None:
    """With the n-gram drafter's own proposals (verified or not, as the measured cost decides)."""
    off, on = pair(device, preset)
    try:
        prompts = [REPEATING, PLAIN, REPEATING[::-1] + REPEATING[:30]]
        for prompt in prompts:
            assert (await tokens(on.engine, prompt))[0] == (await tokens(off.engine, prompt))[0]
        assert await together(on.engine, prompts) == await together(off.engine, prompts)
    finally:
        off.engine.close()
        on.engine.close()


@pytest.fixture
def always_verify(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every step with drafts verifies them, whatever the measured cost says (it depends on this machine's load):
    the tests that check what verification does must see it happen."""
    import runtime.speculative_step

    monkeypatch.setattr(runtime.speculative_step, "worth_verifying",
                        lambda lengths, states, cost, draft_cost=None: max(lengths))


def oracle(futures: dict[int, list[int]], wrong_after: int | None = None) -> Any:
    """A stand-in for the n-gram lookup that proposes each row's true greedy continuation (its future known from
    a run without speculation, keyed by prompt length), or that continuation with a wrong token after
    ``wrong_after`` correct ones: drafts accepted in full or in part, at will."""

    def propose(self: DraftState, limit: int) -> list[int]:
        prompt_length = min(futures, key=lambda n: abs(self.count - n) if self.count >= n else 10**9)
        done = self.count - prompt_length  # generated tokens in the history, the current input included
        draft = futures[prompt_length][done : done + min(limit, 6)]
        if wrong_after is not None and len(draft) > wrong_after:
            draft = [*draft[:wrong_after], (draft[wrong_after] + 1) % 1000, *draft[wrong_after + 1 :]]
        return draft
    return propose


async def test_stops_and_limits_inside_accepted_drafts(device: DeviceThread, monkeypatch: pytest.MonkeyPatch,
                                                      always_verify: None) -> None:
    off, on = pair(device, "tiny-llama")
    try:
        full, _ = await tokens(off.engine, REPEATING, max_tokens=60)
        monkeypatch.setattr(DraftState, "propose", oracle({len(REPEATING): full}))
        for max_tokens in (1, 2, 7, 13, 60):  # limits landing anywhere in a step's accepted tokens
            assert await tokens(on.engine, REPEATING, max_tokens=max_tokens) == (full[:max_tokens], "length")
        assert on.engine.stats.accepted_tokens > 40  # the oracle's drafts are accepted
        stop = frozenset({full[17]})
        expected = full[: full.index(full[17])]
        assert await tokens(on.engine, REPEATING, max_tokens=60, stop=stop) == (expected, "stop")
    finally:
        off.engine.close()
        on.engine.close()


@pytest.mark.parametrize("preset", ["tiny-qwen3", "tiny-qwen3.5", "tiny-qwen3-next"])
async def test_rows_rejecting_at_different_places_share_the_batch(device: DeviceThread,
                                                                  monkeypatch: pytest.MonkeyPatch,
                                                                  always_verify: None, preset: str) -> None:
    """Also on hybrid models, whose gated-delta layers' states are rolled back to each row's accepted tokens."""
    off, on = pair(device, preset)
    try:
        prompts = [REPEATING[:k] for k in (50, 70, 90, 110)]
        futures = {len(p): (await tokens(off.engine, p, max_tokens=40))[0] for p in prompts}
        for wrong_after in (0, 1, 3):
            monkeypatch.setattr(DraftState, "propose", oracle(futures, wrong_after))
            before = on.engine.stats.accepted_tokens
            assert await together(on.engine, prompts) == [futures[len(p)] for p in prompts]
            assert on.engine.stats.accepted_tokens - before >= wrong_after * 10
    finally:
        off.engine.close()
        on.engine.close()


async def test_sliding_window_models_decode_without_drafts(device: DeviceThread) -> None:
    off, on = pair(device, "tiny-gemma3")  # rotating caches: per-row trimming does not apply
    try:
        assert (await tokens(on.engine, REPEATING))[0] == (await tokens(off.engine, REPEATING))[0]
        assert on.engine.stats.speculative_steps == 0
    finally:
        off.engine.close()
        on.engine.close()


async def test_cancelling_a_speculating_row_frees_its_kv(device: DeviceThread,
                                                         monkeypatch: pytest.MonkeyPatch,
                                                         always_verify: None) -> None:
    off, on = pair(device, "tiny-llama")
    try:
        future, _ = await tokens(off.engine, REPEATING, max_tokens=60)
        monkeypatch.setattr(DraftState, "propose", oracle({len(REPEATING): future}))
        handle = on.engine.submit(REPEATING, max_tokens=10_000, stop_ids=frozenset(), sampling=GREEDY)
        seen = 0
        async for chunk in handle.chunks:
            seen += len(chunk.token_ids)
            if seen > 20:
                break
        handle.cancel()
        handle.chunks.close()
        with trio.fail_after(30):
            while on.engine.has_work():
                await trio.sleep(0.01)
        assert on.engine.stats.kv_bytes == 0 and on.engine.stats.speculative_steps > 0
    finally:
        off.engine.close()
        on.engine.close()


async def test_sampled_rows_give_what_the_seed_gives_without_speculation(device: DeviceThread,
                                                                         monkeypatch: pytest.MonkeyPatch,
                                                                  always_verify: None) -> None:
    off, on = pair(device, "tiny-llama")
    try:
        sampled = SamplingParams(temperature=0.02, seed=4)  # sharp: the greedy future is often what it draws
        plain, _ = await tokens(off.engine, REPEATING, sampling=sampled)
        greedy_future, _ = await tokens(off.engine, REPEATING, max_tokens=40)
        monkeypatch.setattr(DraftState, "propose", oracle({len(REPEATING): greedy_future}))
        assert (await tokens(on.engine, REPEATING, sampling=sampled))[0] == plain  # token for token
        assert on.engine.stats.draft_tokens > 0
    finally:
        off.engine.close()
        on.engine.close()


def test_rejection_sampling_keeps_the_models_distribution() -> None:
    """Tokens from sampled_verify follow the target distribution whatever the draft: the first token's
    frequencies match p0, the second's (after an accepted first) match p1 (chi-square, 6,000 draws)."""
    p0 = np.array([0.5, 0.2, 0.15, 0.1, 0.05])
    p1 = np.array([0.1, 0.1, 0.6, 0.1, 0.1])
    logprobs = mx.log(mx.array(np.stack([p0, p1, p1]), dtype=mx.float32))
    sampler = SequenceSampler(SamplingParams(temperature=1.0, seed=1))
    draft = [1, 2]  # a token the model gives 0.2, then one it gives 0.6
    first, second = np.zeros(5), np.zeros(5)
    draws = 6000
    for _ in range(draws):
        accepted, following = sampled_verify(sampler, logprobs, draft)
        out = [*draft[:accepted], following]
        first[out[0]] += 1
        if accepted >= 1:
            second[out[1]] += 1
    for observed, expected in ((first, p0), (second, p1)):
        total = observed.sum()
        chi2 = float((((observed - total * expected) ** 2) / (total * expected)).sum())
        assert chi2 < 18.5, (observed / total, expected)  # p ≈ 0.001 at 4 degrees of freedom
    assert abs(first[1] / draws - 0.2) < 0.03  # the draft token itself is not favoured


def test_the_drafter_looks_up_the_latest_longest_match() -> None:
    state = DraftState(SpeculativeConfig(kind="ngram", max_draft=4, min_ngram=2, max_ngram=3))
    state.extend([1, 2, 3, 9, 9, 1, 2, 3, 7, 8, 5, 1, 2, 3])
    assert state.length == 2
    assert state.propose(10) == [7, 8]  # after the latest earlier "1 2 3", not the first
    state.record(2, 2)
    assert state.length == 4 and state.propose(10) == [7, 8, 5, 1]
    assert state.propose(1) == [7]  # never more than asked
    state.extend([4, 4])
    assert state.propose(10) == []  # "3 4 4" and "4 4" never occurred before
    for _ in range(3):
        state.record(3, 0)
    state.extend([1, 2])
    assert state.cool_down > 0 and state.propose(10) == []  # cooling down


def test_the_graph_setting_reaches_the_engine(tmp_path: Path) -> None:
    from flow.builtins import compile_tables
    from tests.harness import tables_with_model

    tables = tables_with_model(ensure_tiny_model("tiny-llama"))
    tables["resources"]["model"]["speculative"] = {"kind": "ngram", "max_draft": 3, "max_batch": 2}
    graph = compile_tables(tables, "speculative (test)")
    assert graph.resources["model"].config.speculative.max_draft == 3  # type: ignore[attr-defined]
    tables["resources"]["model"]["speculative"] = {"kind": "ngram", "min_ngram": 5, "max_ngram": 3}
    with pytest.raises(Exception, match="min_ngram"):
        compile_tables(tables, "speculative (test)")


def test_the_window_is_as_wide_as_the_measured_cost_pays_for() -> None:
    from runtime.pass_cost import PassCost
    from runtime.speculative import worth_verifying

    config = SpeculativeConfig(kind="ngram", max_draft=8)
    good, poor = DraftState(config), DraftState(config)
    good.proposed, good.accepted = 100, 95
    poor.proposed, poor.accepted = 100, 2
    flat, steep = PassCost(weight=0.5), PassCost(weight=0.5)
    for tokens in (1, 4, 9, 2):
        flat.add(tokens, 0.010 + 0.0001 * tokens)  # a pass costs about the same whatever its tokens (a GPU)
        steep.add(tokens, 0.001 + 0.010 * tokens)  # a pass costs its tokens (a CPU on a big model)
    assert worth_verifying([8, 8], [good, good], flat) == 8
    assert worth_verifying([8, 8], [poor, poor], steep) == 0  # rejected drafts are not worth the tokens
    assert worth_verifying([8], [good], None) == 8  # no measured cost (a GPU): the widest
    assert worth_verifying([0, 0], [good, good], flat) == 0


def test_what_drafting_costs_counts_against_verifying() -> None:
    """With the drafter's own passes measured: one as slow per token as the target never pays (each draft token
    costs a target pass and is accepted less than always), a cheap one that is mostly right does."""
    from runtime.pass_cost import PassCost
    from runtime.speculative import worth_verifying

    config = SpeculativeConfig(kind="draft", max_draft=8)
    good = DraftState(config)
    good.proposed, good.accepted = 100, 95
    target, as_slow, cheap = PassCost(weight=0.5), PassCost(weight=0.5), PassCost(weight=0.5)
    for tokens in (1, 4, 9, 2):
        target.add(tokens, 0.010 + 0.0001 * tokens)  # passes this small cost about the same (a GPU, a big model)
        as_slow.add(tokens, 0.010 * tokens)  # one drafter pass per token, each as long as a target pass
        cheap.add(tokens, 0.0005 * tokens)  # a twentieth of that
    assert worth_verifying([8], [good], target) == 8  # drafting for free (prompt lookup): the widest
    assert worth_verifying([8], [good], target, as_slow) == 0
    assert worth_verifying([8], [good], target, cheap) == 8
    assert worth_verifying([8, 8], [good, good], target, cheap) == 8
    alike = PassCost(weight=0.5)
    for _ in range(4):
        alike.add(1, 0.010)  # passes all of one size: what more tokens cost is not known
    assert worth_verifying([8], [good], alike) == 8  # so it is tried
    assert worth_verifying([8], [good], alike, as_slow) == 0  # unless drafting alone costs more than it brings


# --------------------------------------------------------------------------- draft-model drafts

DRAFTED = SpeculativeConfig(kind="draft", max_draft=4)


def small_draft_of(preset: str) -> Path:
    """A smaller random-weight model of the preset's architecture: the same tokenizer, other weights."""
    import dataclasses

    from runtime.tiny import PRESETS

    return ensure_tiny_model(dataclasses.replace(PRESETS[preset], hidden_size=32, num_heads=2, num_kv_heads=1,
                                                 num_layers=1, intermediate_size=64, seed=7))


@pytest.mark.parametrize("preset", ["tiny-llama", "tiny-qwen3", "tiny-phi4-mini"])
@pytest.mark.parametrize("drafter", ["itself", "smaller"])
async def test_greedy_output_is_identical_with_a_draft_model(device: DeviceThread, always_verify: None,
                                                             preset: str, drafter: str) -> None:
    """A draft model that agrees with the target (itself: every draft accepted) and one that mostly does not (a
    smaller random model: rows reject at different places) both leave the greedy output as it is without."""
    path = ensure_tiny_model(preset)
    draft = load_model(f"{preset}-draft", path if drafter == "itself" else small_draft_of(preset), device,
                       EngineConfig())
    off = load_model(f"{preset}-off", path, device, EngineConfig())
    on = load_model(f"{preset}-on", path, device, EngineConfig(speculative=DRAFTED), draft_model=draft.model)
    try:
        prompts = [REPEATING, PLAIN, REPEATING[::-1] + REPEATING[:30]]
        assert await together(on.engine, prompts) == await together(off.engine, prompts)
        assert (await tokens(on.engine, PLAIN, max_tokens=17))[0] == (await tokens(off.engine, PLAIN, max_tokens=17))[0]
        stats = on.engine.stats
        assert stats.speculative_steps > 0 and stats.draft_tokens > 0
        if drafter == "itself":
            assert stats.accepted_tokens == stats.draft_tokens  # the same model proposes what it would choose
        else:
            assert stats.accepted_tokens < stats.draft_tokens
    finally:
        for loaded in (draft, off, on):
            loaded.engine.close()


async def test_sampled_rows_with_a_draft_model_give_what_the_seed_gives(device: DeviceThread,
                                                                        always_verify: None) -> None:
    path = ensure_tiny_model("tiny-qwen3")
    draft = load_model("draft", path, device, EngineConfig())
    off = load_model("off", path, device, EngineConfig())
    on = load_model("on", path, device, EngineConfig(speculative=DRAFTED), draft_model=draft.model)
    try:
        sampling = SamplingParams(temperature=0.7, top_k=2, seed=11)  # two candidates: drafts often drawn
        assert (await tokens(on.engine, PLAIN, sampling=sampling))[0] == \
            (await tokens(off.engine, PLAIN, sampling=sampling))[0]
        assert on.engine.stats.accepted_tokens > 0
    finally:
        for loaded in (draft, off, on):
            loaded.engine.close()


def test_a_draft_model_with_another_tokenizer_is_refused_by_the_compiler() -> None:
    from flow.builtins import compile_tables
    from flow.graph.compiled import CompileError
    from tests.harness import tables_with_model

    tables = tables_with_model(ensure_tiny_model("tiny-llama"))
    tables["resources"]["model"]["speculative"] = {"kind": "draft", "draft": "drafter"}
    tables["resources"]["drafter"] = {"type": "model", "path": str(small_draft_of("tiny-llama")), "name": "drafter"}
    graph = compile_tables(tables, "draft (test)")
    assert graph.resources["model"].refs["speculative.draft"] == ("drafter",)
    tables["resources"]["drafter"]["path"] = str(ensure_tiny_model("tiny-qwen3"))
    with pytest.raises(CompileError, match="has another tokenizer"):
        compile_tables(tables, "draft (test)")
    tables["resources"]["model"]["speculative"] = {"kind": "draft"}
    with pytest.raises(CompileError, match="go together"):
        compile_tables(tables, "draft (test)")


def test_a_graph_serves_a_model_with_its_draft_model() -> None:
    """``speculative = {kind = "draft", draft = "drafter"}`` through the real server: the draft model loads first,
    is pinned for its target, and the answers are the ones without speculation."""
    import httpx

    from flow.builtins import compile_tables
    from tests.harness import running_server, tables_with_model

    def answers(tables: dict[str, Any]) -> tuple[list[str], dict[str, Any]]:
        with running_server(compile_tables(tables, "draft (test)")) as server:
            texts = [httpx.post(server.url + "/chat/completions", timeout=60, json={
                "model": "tiny", "max_tokens": 24, "temperature": 0,
                "messages": [{"role": "user", "content": text}]}).json()["choices"][0]["message"]["content"]
                for text in ("Tell me about lighthouses.", "one two three one two three one two")]
            stats = httpx.get(server.base_url + "/stats", timeout=30).json()["models"]
            pinned = {m.name: m.pinned for m in server.server.models}
        return texts, {"stats": stats, "pinned": pinned}

    tables = tables_with_model(ensure_tiny_model("tiny-llama"))
    plain, _ = answers(tables)
    tables["resources"]["model"]["speculative"] = {"kind": "draft", "draft": "drafter", "max_draft": 4}
    tables["resources"]["drafter"] = {"type": "model", "path": str(small_draft_of("tiny-llama")), "name": "drafter"}
    drafted, seen = answers(tables)
    assert drafted == plain
    assert seen["pinned"] == {"tiny": False, "drafter": True}
    assert seen["stats"]["tiny"]["engine"]["draft_tokens"] > 0
