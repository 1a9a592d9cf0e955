"""Speculative kind "mtp": a tiny random-weight Qwen3.5 with its MTP layer in the safetensors drafts for itself.
Greedy output identical with and without (engine, and through the server), seeded sampling identical, the
hidden states the drafter sees are the model's own, its drafts are what the MTP layer computes from them, and a
model without MTP layers is refused (compiler and load)."""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import mlx.core as mx
import pytest
import trio

from protocols.ir import SamplingParams
from runtime.device import DeviceThread
from runtime.engine_config import EngineConfig, SpeculativeConfig
from runtime.errors import ModelNotAvailable
from runtime.models import LoadedModel, load_model
from runtime.mtp import MTPDrafter, MTPDraftState
from runtime.tiny import ensure_tiny_model
from tests.runtime.test_speculative import PLAIN, REPEATING, always_verify, together, tokens  # noqa: F401

MTP = SpeculativeConfig(kind="mtp", max_draft=4)


@pytest.fixture(scope="module")
def device() -> Iterator[DeviceThread]:
    thread = DeviceThread("test-mtp-device")
    thread.start()
    yield thread
    thread.stop()


@pytest.fixture(scope="module")
def models(device: DeviceThread) -> Iterator[tuple[LoadedModel, LoadedModel]]:
    path = ensure_tiny_model("tiny-qwen3.5-mtp")
    off = load_model("off", path, device, EngineConfig())
    on = load_model("on", path, device, EngineConfig(speculative=MTP))
    yield off, on
    for loaded in (off, on):
        loaded.engine.close()


async def test_greedy_output_is_identical_with_mtp_drafts(models: tuple[LoadedModel, LoadedModel],
                                                          always_verify: None) -> None:  # noqa: F811
    off, on = models
    prompts = [REPEATING, PLAIN, REPEATING[::-1] + REPEATING[:30]]
    assert await together(on.engine, prompts) == await together(off.engine, prompts)
    assert (await tokens(on.engine, PLAIN, max_tokens=17))[0] == (await tokens(off.engine, PLAIN, max_tokens=17))[0]
    assert on.engine.stats.speculative_steps > 0 and on.engine.stats.draft_tokens > 0


async def test_sampled_rows_with_mtp_drafts_give_what_the_seed_gives(models: tuple[LoadedModel, LoadedModel],
                                                                     always_verify: None) -> None:  # noqa: F811
    off, on = models
    sampling = SamplingParams(temperature=0.7, top_k=2, seed=11)
    assert (await tokens(on.engine, PLAIN, sampling=sampling))[0] == \
        (await tokens(off.engine, PLAIN, sampling=sampling))[0]


async def test_rows_that_decoded_long_without_drafting_draft_later(models: tuple[LoadedModel, LoadedModel],
                                                                   always_verify: None) -> None:  # noqa: F811
    """Five rows: over ``max_batch`` (4), no step drafts, for more steps than a row keeps hidden states unfed; then
    one row finishes and the other four draft — the same tokens as without."""
    off, on = models
    prompts = [REPEATING, PLAIN, REPEATING[::-1], PLAIN[::-1], REPEATING[7:77]]
    limits = [100, 100, 100, 100, 70]

    async def run(loaded: LoadedModel) -> list[list[int]]:
        results: list[list[int]] = [[] for _ in prompts]

        async def one(i: int) -> None:
            results[i] = (await tokens(loaded.engine, prompts[i], max_tokens=limits[i]))[0]

        async with trio.open_nursery() as nursery:
            for i in range(len(prompts)):
                nursery.start_soon(one, i)
        return results

    before = on.engine.stats.speculative_steps
    assert await run(on) == await run(off)
    assert on.engine.stats.speculative_steps > before


@pytest.mark.parametrize("prefill_chunk", [512, 32])  # the prompt prefilled in one piece, or in chunks
async def test_the_drafter_sees_the_models_own_hidden_states(device: DeviceThread,
                                                             models: tuple[LoadedModel, LoadedModel],
                                                             monkeypatch: pytest.MonkeyPatch,
                                                             always_verify: None,  # noqa: F811
                                                             prefill_chunk: int) -> None:
    """What prefill and the decode and verify passes hand each row (no second pass) is, position for position,
    what one plain pass of the model over the row's prompt and output computes."""
    on = models[1] if prefill_chunk == 512 else load_model(
        "chunked", ensure_tiny_model("tiny-qwen3.5-mtp"), device, EngineConfig(prefill_chunk=prefill_chunk,
                                                                               speculative=MTP))
    seen: dict[int, mx.array] = {}
    observe = MTPDraftState.observe

    def record(self: MTPDraftState, position: int, hidden: mx.array) -> None:
        for j in range(hidden.shape[0]):
            seen[position + j] = hidden[j]
        observe(self, position, hidden)

    monkeypatch.setattr(MTPDraftState, "observe", record)
    out, _ = await tokens(on.engine, REPEATING, max_tokens=24)
    drafter = on.engine.speculator.drafter
    assert isinstance(drafter, MTPDrafter)

    def differences() -> list[float]:
        hidden = drafter.forward(mx.array([REPEATING + out]), None)[1][0]  # type: ignore[arg-type]
        return [mx.abs(row - hidden[position]).max().item() for position, row in seen.items()]  # type: ignore[misc]

    # The prompt's positions (prefill) and every output token's (each the input of a decode or verify pass).
    assert sorted(seen) == list(range(len(REPEATING) + len(out)))
    assert max(device.call(differences)) < 1e-4
    if on is not models[1]:
        assert on.engine.stats.prefill_chunks >= 4  # 119 prompt tokens before the last, 32 at a time
        on.engine.close()


def test_drafts_are_what_the_mtp_layer_computes(device: DeviceThread, models: tuple[LoadedModel, LoadedModel]) -> None:
    """A row's draft is the MTP chain computed directly: its first token from the pairs (hidden state at i, token
    at i + 1) fed so far, each next from the layer's own output and the token before; after a proposal the
    layer's cache holds only the model's own pairs (a later draft is what one pass over all of them gives)."""
    _, on = models
    drafter = on.engine.speculator.drafter
    assert isinstance(drafter, MTPDrafter)
    history = REPEATING[:50]
    start = 30

    def direct(end: int, length: int) -> list[int]:
        """The MTP chain from scratch over the pairs at positions start .. end - 1."""
        cache = drafter.new_state(MTP).cache
        hidden = drafter.forward(mx.array([history[:end]]), None)[1][0]  # type: ignore[arg-type]
        last = drafter.run(history[start + 1 : end + 1], hidden[start:end], cache)[-1:]
        draft: list[int] = []
        while len(draft) < length:
            draft.append(int(mx.argmax(drafter.logits(last)[-1]).item()))  # type: ignore[arg-type]
            last = drafter.run([draft[-1]], last, cache)
        return draft

    def through_state() -> tuple[list[int], list[int]]:
        state = drafter.new_state(MTP)
        state.length = 3
        state.extend(history[:41])
        hidden = drafter.forward(mx.array([history]), None)[1][0]  # type: ignore[arg-type]
        state.observe(start, hidden[start:40])
        first = state.propose(8)
        state.extend(history[41:46])  # the model went on another way: the chained entries must be gone
        state.observe(40, hidden[40:45])
        return first, state.propose(8)

    first, second = device.call(through_state)
    assert first == device.call(lambda: direct(40, 3))
    assert second == device.call(lambda: direct(45, 3))


def test_a_model_without_mtp_layers_is_refused(device: DeviceThread, tmp_path: Path) -> None:
    import json
    import shutil

    from flow.builtins import compile_tables
    from flow.graph.compiled import CompileError
    from tests.harness import tables_with_model

    tables = tables_with_model(ensure_tiny_model("tiny-qwen3.5-mtp"), speculative={"kind": "mtp"})
    compile_tables(tables, "mtp (test)")
    # Qwen3.5 as it ships is a vision-language checkpoint: MTP drafting needs it served as text.
    shutil.copytree(ensure_tiny_model("tiny-qwen3.5-mtp"), tmp_path / "vl")
    config = json.loads((tmp_path / "vl" / "config.json").read_text())
    (tmp_path / "vl" / "config.json").write_text(json.dumps({**config, "vision_config": {}}))
    with pytest.raises(CompileError, match="loads as a vision model"):
        compile_tables(tables_with_model(tmp_path / "vl", speculative={"kind": "mtp"}), "mtp (test)")
    compile_tables(tables_with_model(tmp_path / "vl", kind="text", speculative={"kind": "mtp"}), "mtp (test)")
    for preset, why in (("tiny-qwen3.5", "declares no MTP layers"), ("tiny-qwen3", "is a 'qwen3' model")):
        tables = tables_with_model(ensure_tiny_model(preset), speculative={"kind": "mtp"})
        with pytest.raises(CompileError, match=why):
            compile_tables(tables, "mtp (test)")
    with pytest.raises(ModelNotAvailable, match="needs the model's MTP layers"):
        load_model("plain", ensure_tiny_model("tiny-qwen3"), device, EngineConfig(speculative=MTP))


def test_a_graph_serves_a_model_drafting_with_its_mtp_layers() -> None:
    import httpx

    from flow.builtins import compile_tables
    from tests.harness import running_server, tables_with_model

    def answers(tables: dict[str, Any]) -> tuple[list[str], dict[str, Any]]:
        with running_server(compile_tables(tables, "mtp (test)")) as server:
            texts = [httpx.post(server.url + "/chat/completions", timeout=60, json={
                "model": "tiny", "max_tokens": 24, "temperature": 0,
                "messages": [{"role": "user", "content": text}]}).json()["choices"][0]["message"]["content"]
                for text in ("Tell me about lighthouses.", "one two three one two three one two")]
            engine = httpx.get(server.base_url + "/stats", timeout=30).json()["models"]["tiny"]["engine"]
        return texts, engine

    path = ensure_tiny_model("tiny-qwen3.5-mtp")
    plain, _ = answers(tables_with_model(path))
    drafted, engine = answers(tables_with_model(path, speculative={"kind": "mtp", "max_draft": 4}))
    assert drafted == plain
    assert engine["draft_tokens"] > 0
