"""Qwen3.5's vision variant (mlx-vlm's ``qwen3_5``: 3-D positions and a hybrid language model, gated-delta layers with
recurrent states between attention layers) in the batched engine, driven directly: its layer caches are mlx-lm's
(runtime/vision.py, ``_hybrid_forward``), batched, snapshotted and rolled back as the text Qwen3.5's, so greedy
output equals ``mlx_vlm.stream_generate`` for every row — alone, in a batch of image rows and text rows joining a
running batch (left-padded, chunked), with n-gram speculation, and on the next turn from the prefix cache."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from runtime.engine_config import SpeculativeConfig
from runtime.prefix_cache import PrefixCache, PrefixConfig
from runtime.recurrent_rollback import RecurrentRollback
from tests.runtime import vision_rows
from tests.runtime.test_speculative import always_verify, oracle  # noqa: F401  (a fixture)
from tests.runtime.vision_rows import VisionRows, ask, run

PRESET = "tiny-qwen3.5-vl"
GENERATION_PROMPT = "<|im_start|>assistant\n<think>\n"

A, B = vision_rows.picture(1), vision_rows.picture(2)
C = vision_rows.picture(3, (32, 64))  # a tall picture, another grid


@pytest.fixture(scope="module")
def qwen() -> Iterator[VisionRows]:
    # Its prompts carry their turn point (where the messages end): the hybrid's snapshot for the next turn.
    yield from vision_rows.loaded_rows(PRESET, ("<|im_end|>", "<|endoftext|>"), model_type="qwen3_5",
                                       generation_prompt=GENERATION_PROMPT)


@pytest.fixture
def engines(qwen: VisionRows) -> Iterator[Any]:
    with vision_rows.engines_of(qwen, b"qwen3.5-vl-test") as make:
        yield make


ONE = (ask("Hello first. ", A, "What is in the picture?"),)
TWO = (ask(A, "then", B, "Compare them."),)
TALL = (ask("Describe it. ", C),)
TEXTS = [(ask(f"Tell me a long story, number {i}."),) for i in range(3)]


def test_its_layer_caches_are_mlx_lms(qwen: VisionRows) -> None:
    """Gated-delta layers get mlx-lm's ArraysCache (what the engine batches and snapshots), attention layers its
    KVCache; the speculator finds every gated-delta layer to roll back."""
    from mlx_lm.models.cache import ArraysCache, KVCache

    caches = qwen.model.make_cache()
    layers = qwen.model.layers
    assert qwen.model.hybrid and qwen.model.mrope
    assert [type(c) for c in caches] == [ArraysCache if layer.is_linear else KVCache for layer in layers]
    rollback = qwen.device.call(lambda: RecurrentRollback.of(qwen.model))
    assert rollback is not None and set(rollback.mixers) == {i for i, layer in enumerate(layers) if layer.is_linear}


async def test_an_image_row_alone_equals_mlx_vlm(qwen: VisionRows, engines: Any) -> None:
    engine = engines()
    prompt = qwen.prompt(*ONE)
    assert prompt.images is not None and len(prompt.images.spans) == 1
    want = qwen.reference(prompt)
    assert len(want) > 3
    assert await run(engine, qwen, [prompt]) == [want]
    text = qwen.prompt(*TEXTS[0])
    assert await run(engine, qwen, [text]) == [qwen.reference(text)]
    assert engine.stats.kv_bytes == 0


@pytest.mark.parametrize("chunk", [512, 8])
async def test_image_and_text_rows_decode_together_as_each_alone(qwen: VisionRows, engines: Any, chunk: int) -> None:
    """Rows with one image, two images or a picture of another grid, and text rows: each row's positions and
    recurrent states its own; rows join the running batch and leave as they stop. ``chunk`` 8: prompts prefilled
    in several chunks (the recurrent states carried from chunk to chunk)."""
    prompts = [qwen.prompt(*c) for c in (ONE, TEXTS[0], TWO, TEXTS[1], TALL, TEXTS[2])]
    expected = [qwen.reference(p, 24) for p in prompts]
    engine = engines(prefill_chunk=chunk)
    assert await run(engine, qwen, prompts, max_tokens=24, stagger=True) == expected
    assert engine.stats.peak_batch >= 3
    assert engine.active == 0 and engine.stats.kv_bytes == 0


async def test_two_choices(qwen: VisionRows, engines: Any) -> None:
    prompt = qwen.prompt(*TWO)
    want = qwen.reference(prompt)
    assert await run(engines(), qwen, [prompt], choices=2) == [want, want]


@pytest.mark.parametrize("wrong_after", [None, 2])
async def test_speculation_on_image_rows(qwen: VisionRows, engines: Any, monkeypatch: pytest.MonkeyPatch,
                                         always_verify: None, wrong_after: int | None) -> None:  # noqa: F811
    """A verify pass holds each row's input and draft at its own positions; the gated-delta layers' states are cut
    back to what each row accepted (runtime/recurrent_rollback.py). Drafts are each row's true continuation (all
    accepted) or wrong after two tokens (the states rolled back every step), an image row beside a text row."""
    from runtime.speculative import DraftState

    prompts = [qwen.prompt(ask(A, "1 2 3 4 " * 6)), qwen.prompt(ask("Say yes. Yes yes yes yes yes"))]
    assert len(prompts[0].ids) != len(prompts[1].ids)
    expected = [qwen.reference(p, 30) for p in prompts]
    monkeypatch.setattr(DraftState, "propose", oracle({len(p.ids): e for p, e in zip(prompts, expected)},
                                                      wrong_after))
    engine = engines(speculative=SpeculativeConfig(kind="ngram", max_draft=4))
    got = []
    for prompt in prompts:  # alone: each verify pass is the row's own
        got += await run(engine, qwen, [prompt], max_tokens=30)
    assert got == expected
    assert await run(engine, qwen, prompts, max_tokens=30) == expected
    assert engine.stats.speculative_steps > 0 and engine.stats.accepted_tokens > 0
    assert (engine.stats.accepted_tokens < engine.stats.draft_tokens) == (wrong_after is not None)


async def test_the_next_turn_with_the_same_picture_is_a_prefix_hit(qwen: VisionRows, engines: Any) -> None:
    """The prefix cache keeps the attention layers' blocks and the recurrent layers' snapshots of an image row in
    its images' digests: the next turn with the same picture restores both (no tower pass, exact), another picture
    with the same tokens never matches."""
    cache = PrefixCache(PrefixConfig(block_tokens=8))
    engine = engines(prefix=cache)
    first = qwen.prompt(*ONE)
    [answer] = await run(engine, qwen, [first])
    assert answer == qwen.reference(first)
    reply = qwen.processor.tokenizer.decode(answer)
    second = qwen.prompt(*ONE, {"role": "assistant", "content": reply}, ask("And the colours?"))
    towers = qwen.model.tower_passes
    hit = await engine.match_prefix(second.keyed, images=second.images)
    assert hit is not None and hit.state is not None
    assert hit.tokens == first.turn_point  # the first turn's messages, the picture's span with them
    cache.release(hit)
    assert await run(engine, qwen, [second]) == [qwen.reference(second)]
    assert qwen.model.tower_passes == towers  # the span came from the cache: no tower pass
    assert engine.stats.cached_tokens > 0
    other = qwen.prompt(ask("Hello first. ", B, "What is in the picture?"))
    assert other.ids == first.ids  # the same tokens, another picture
    hit = await engine.match_prefix(other.keyed, images=other.images)
    assert hit is None or hit.tokens <= first.ids.index(qwen.model.image_token_id)
    if hit is not None:
        cache.release(hit)
    assert await run(engine, qwen, [other]) == [qwen.reference(other)]
