"""Llama 3.2 Vision (mlx-vlm's ``mllama``) in the batched engine, driven directly: each row's cross-attention
states are its own (runtime/cross_attention.py), so greedy output equals ``mlx_vlm.stream_generate`` for every row —
alone, in a batch of image rows (one image or two, of other tile counts) and text rows joining a running batch,
chunked, as two choices of one prompt, with n-gram speculation — and the prefix cache serves an image row only from
blocks made with the same images (tests/mllama_reference.py: the text rows' reference)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from PIL import Image

from runtime.engine_config import SpeculativeConfig
from runtime.prefix_cache import PrefixCache, PrefixConfig
from tests.mllama_reference import text_rows_skip_cross_attention
from tests.runtime import vision_rows
from tests.runtime.vision_rows import VisionRows, ask, run

A, B = vision_rows.picture(1), vision_rows.picture(2)
C = vision_rows.picture(3, (20, 30))  # a tall picture, fewer tiles than A and B


class Mllama(VisionRows):
    def generate(self, text: str, pictures: tuple[Image.Image, ...], max_tokens: int) -> list[int]:
        """mlx-vlm's tokens, its text rows as Hugging Face runs them (tests/mllama_reference.py)."""
        if not pictures:
            text = text.removeprefix(self.processor.tokenizer.bos_token)  # mlx-vlm adds it when it tokenizes
        with text_rows_skip_cross_attention():
            return super().generate(text, pictures, max_tokens)


@pytest.fixture(scope="module")
def mllama() -> Iterator[VisionRows]:
    yield from vision_rows.loaded_rows("tiny-mllama", ("<|eot_id|>", "<|end_of_text|>", "<|eom_id|>"), Mllama,
                                       model_type="mllama")


@pytest.fixture
def engines(mllama: VisionRows) -> Iterator[Any]:
    with vision_rows.engines_of(mllama, b"mllama-test") as make:
        yield make


def test_mlx_vlm_text_rows_depend_on_its_prefill_chunks(mllama: VisionRows) -> None:
    """Why the text rows' reference skips the cross-attention layers (tests/mllama_reference.py): mlx-vlm's own
    text-only path changes its output with the prefill chunk size, so it is no reference at all."""
    from mlx_vlm import generate

    text = mllama.processor.tokenizer.apply_chat_template([{"role": "user", "content": "Tell me a story."}],
                                                          add_generation_prompt=True, tokenize=False)
    runs = {step: generate(mllama.reference_model, mllama.processor, text, max_tokens=10, temperature=0.0,
                           verbose=False, prefill_step_size=step).text for step in (2048, 4)}
    assert runs[2048] != runs[4]
    with text_rows_skip_cross_attention():
        skipped = {step: generate(mllama.reference_model, mllama.processor, text, max_tokens=10, temperature=0.0,
                                  verbose=False, prefill_step_size=step).text for step in (2048, 4)}
    assert skipped[2048] == skipped[4]


ONE = (ask("Hello first. ", A, "What is in the picture?"),)
TWO = (ask(A, "then", B, "Compare them."),)
TALL = (ask("Describe it. ", C),)
TEXTS = [(ask(f"Tell me a long story, number {i}."),) for i in range(3)]


async def test_an_image_row_alone_equals_mlx_vlm(mllama: VisionRows, engines: Any) -> None:
    engine = engines()
    prompt = mllama.prompt(*ONE)
    assert prompt.images is not None and len(prompt.images.spans) == 1
    want = mllama.reference(prompt)
    assert len(want) > 3
    assert await run(engine, mllama, [prompt]) == [want]
    assert engine.stats.kv_bytes == 0  # the row left: its KV and cross-attention states with it
    # Text rows skip the cross-attention layers: their output is the model's without them.
    text = mllama.prompt(*TEXTS[0])
    assert await run(engine, mllama, [text]) == [mllama.reference(text)]


@pytest.mark.parametrize("chunk", [512, 8])
async def test_image_and_text_rows_decode_together_as_each_alone(mllama: VisionRows, engines: Any, chunk: int) -> None:
    """Rows with one image, two images or a picture of fewer tiles, and text rows: every pass groups the image rows
    by their vision tokens' count; rows join the running batch and leave as they stop. ``chunk`` 8: image prompts
    prefilled in several chunks, each with its window of the cross-attention mask."""
    prompts = [mllama.prompt(*c) for c in (ONE, TEXTS[0], TWO, TEXTS[1], TALL, TEXTS[2])]
    expected = [mllama.reference(p, 24) for p in prompts]
    engine = engines(prefill_chunk=chunk)
    assert await run(engine, mllama, prompts, max_tokens=24, stagger=True) == expected
    assert engine.stats.peak_batch >= 3
    assert engine.active == 0 and engine.stats.kv_bytes == 0


async def test_two_choices_share_the_rows_states(mllama: VisionRows, engines: Any) -> None:
    prompt = mllama.prompt(*TWO)
    want = mllama.reference(prompt)
    assert await run(engines(), mllama, [prompt], choices=2) == [want, want]


async def test_n_gram_speculation_on_image_rows(mllama: VisionRows, engines: Any) -> None:
    """A verify pass holds a row's input and draft, every one a generated token (no mask, the whole MLP), beside
    a text row's."""
    prompts = [mllama.prompt(ask(A, "1 2 3 4 " * 6)), mllama.prompt(ask("Say yes. Yes yes yes yes yes"))]
    expected = [mllama.reference(p, 40) for p in prompts]
    engine = engines(speculative=SpeculativeConfig(kind="ngram", max_draft=4))
    got = []
    for prompt in prompts:  # alone: each verify pass is the row's own
        got += await run(engine, mllama, [prompt], max_tokens=40)
    assert got == expected
    assert await run(engine, mllama, prompts, max_tokens=40) == expected


async def test_the_prefix_cache_serves_an_image_row_only_with_its_images(mllama: VisionRows, engines: Any) -> None:
    """Every token of an image row depends on all its images (the text before the first attends to every one), so
    its blocks are kept in a namespace of its images' digests: the next turn with the same picture is a hit that
    still gets the row's cross-attention states (from the feature cache: no tower pass); the same text with
    another picture, or with none, is not."""
    cache = PrefixCache(PrefixConfig(block_tokens=8))
    engine = engines(prefix=cache)
    first = mllama.prompt(*ONE)
    [answer] = await run(engine, mllama, [first])
    assert answer == mllama.reference(first)
    reply = mllama.processor.tokenizer.decode(answer)
    second = mllama.prompt(*ONE, {"role": "assistant", "content": reply}, ask("And the colours?"))
    towers = mllama.model.tower_passes
    hit = await engine.match_prefix(second.keyed, images=second.images)
    assert hit is not None and hit.tokens > first.ids.index(mllama.model.image_token_id)
    cache.release(hit)
    assert await run(engine, mllama, [second]) == [mllama.reference(second)]
    assert mllama.model.tower_passes == towers  # the picture's states came from the feature cache
    other = mllama.prompt(ask("Hello first. ", B, "What is in the picture?"))
    assert other.ids == first.ids  # the same tokens, another picture
    assert await engine.match_prefix(other.keyed, images=other.images) is None
    assert await run(engine, mllama, [other]) == [mllama.reference(other)]
    # The same tokens as a text row (its blocks are the model's without cross-attention): no hit either way.
    text = mllama.prompt(ask("Hello first. What is in the picture?"))
    assert await run(engine, mllama, [text]) == [mllama.reference(text)]
    again = mllama.prompt(ask("Hello first. What is in the picture? Again."))
    hit = await engine.match_prefix(again.keyed)
    assert hit is not None  # text rows share theirs
    cache.release(hit)
    both = mllama.prompt(ask("Hello first. ", A, "What is in the picture?", B))  # A, then another image too
    assert await engine.match_prefix(both.keyed, images=both.images) is None
    assert await run(engine, mllama, [both]) == [mllama.reference(both)]


async def test_a_prompt_cached_whole_still_gets_its_rows_states(mllama: VisionRows, engines: Any) -> None:
    """A hit covering every prompt token but the last leaves nothing to prefill: the row's states are made before
    its first pass all the same (the pass of its last prompt token reads them, masked; its decode steps too)."""
    first = mllama.prompt(*TWO)
    blocks = len(first.ids) - 1
    cache = PrefixCache(PrefixConfig(block_tokens=blocks))
    engine = engines(prefix=cache)
    want = mllama.reference(first)
    assert await run(engine, mllama, [first]) == [want]
    hit = await engine.match_prefix(first.keyed, images=first.images)
    assert hit is not None and hit.tokens == blocks
    cache.release(hit)
    assert await run(engine, mllama, [first], choices=2) == [want, want]
    assert engine.stats.cached_tokens == blocks
