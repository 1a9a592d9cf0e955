"""Llama 3.2 Vision (mlx-vlm's ``mllama``) in the batched engine, driven directly: each row's cross-attention
states are its own (runtime/cross_attention.py), so greedy output equals ``mlx_vlm.stream_generate`` for every row —
alone, in a batch of image rows (one image or two, of other tile counts) and text rows joining a running batch,
chunked, as two choices of one prompt, with n-gram speculation — and the prefix cache serves an image row only from
blocks made with the same images (tests/mllama_reference.py: the text rows' reference)."""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import hashlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest
import trio
from PIL import Image

from protocols.ir import PromptImages, SamplingParams
from runtime.device import DeviceThread
from runtime.engine import Engine
from runtime.engine_config import EngineConfig, SpeculativeConfig
from runtime.image_spans import key_tokens
from runtime.prefix_cache import PrefixCache, PrefixConfig
from runtime.tiny import ensure_tiny_model
from tests.mllama_reference import text_rows_skip_cross_attention
from tests.runtime.test_engine import collect

GREEDY = SamplingParams()
MAX_TOKENS = 12


def picture(seed: int, size: tuple[int, int] = (80, 48)) -> Image.Image:
    pixels = np.random.default_rng(seed).integers(0, 256, (size[1], size[0], 3), dtype=np.uint8)
    return Image.fromarray(pixels)


A, B, C = picture(1), picture(2), picture(3, (20, 30))  # C: a tall picture, fewer tiles than A and B


def user(*parts: str | Image.Image) -> dict[str, Any]:
    return {"role": "user", "content": [{"type": "image"} if isinstance(p, Image.Image) else {"type": "text", "text": p}
                                        for p in parts]}


@dataclass(frozen=True)
class Prompt:
    ids: list[int]
    images: PromptImages | None
    messages: tuple[dict[str, Any], ...]
    pictures: tuple[Image.Image, ...]

    @property
    def keyed(self) -> list[int]:
        """The prompt as the generate stage matches it in the prefix cache (image positions by their pixels)."""
        return self.ids if self.images is None else key_tokens(self.ids, self.images.spans)


@dataclass
class Mllama:
    device: DeviceThread
    model: Any  # flow's VisionLanguageModel, on the device thread
    processor: Any
    reference_model: Any  # mlx-vlm's own, on the test's thread
    stop: frozenset[int]

    def prompt(self, *messages: dict[str, Any]) -> Prompt:
        """The prompt as flow's chat.prepare makes it: the template rendered, then the processor (images) or the
        tokenizer (text)."""
        from runtime.vision import prompt_inputs

        text = self.processor.tokenizer.apply_chat_template(list(messages), add_generation_prompt=True, tokenize=False)
        pictures = tuple(p for m in messages if not isinstance(m["content"], str) for p in m.get("pictures", ()))
        if not pictures:
            return Prompt(list(self.processor.tokenizer.encode(text, add_special_tokens=False)), None, messages, ())
        digests = [hashlib.sha256(p.tobytes() + str(p.size).encode()).digest() for p in pictures]
        ids, images = prompt_inputs(self.processor, "mllama", text, list(pictures), digests, self.model.image_token_id)
        return Prompt(list(ids), images, messages, pictures)

    def reference(self, prompt: Prompt, max_tokens: int = MAX_TOKENS) -> list[int]:
        """mlx-vlm's greedy tokens for the prompt, up to a stop token."""
        from mlx_vlm import stream_generate

        messages = [{k: v for k, v in m.items() if k != "pictures"} for m in prompt.messages]
        text = self.processor.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        if not prompt.pictures:
            text = text.removeprefix(self.processor.tokenizer.bos_token)  # mlx-vlm adds it when it tokenizes
        with text_rows_skip_cross_attention():
            tokens = [r.token for r in stream_generate(self.reference_model, self.processor, text,
                                                       image=list(prompt.pictures) or None, max_tokens=max_tokens,
                                                       temperature=0.0)][:max_tokens]
        for i, token in enumerate(tokens):
            if token in self.stop:
                return tokens[:i]
        return tokens


def ask(*parts: str | Image.Image) -> dict[str, Any]:
    message = user(*parts)
    message["pictures"] = tuple(p for p in parts if isinstance(p, Image.Image))
    return message


@pytest.fixture(scope="module")
def mllama() -> Iterator[Mllama]:
    from mlx_vlm import load

    from runtime.cpu_activations import use_fast_gelu
    from runtime.vision import load_vision_model

    path = ensure_tiny_model("tiny-mllama")
    device = DeviceThread("test-mllama-device")
    device.start()
    model, processor = device.call(lambda: load_vision_model(path, device))
    reference_model, _ = load(str(path))
    use_fast_gelu(reference_model)  # as flow runs the tower (its accuracy: test_cpu_activations)
    vocab = processor.tokenizer.get_vocab()
    stop = frozenset(vocab[t] for t in ("<|eot_id|>", "<|end_of_text|>", "<|eom_id|>"))
    yield Mllama(device, model, processor, reference_model, stop)
    device.stop()


async def run(engine: Engine, mllama: Mllama, prompts: list[Prompt], *, max_tokens: int = MAX_TOKENS,
              stagger: bool = False, choices: int = 1) -> list[list[int]]:
    """Every prompt's greedy tokens (each choice's), run at once; ``stagger``: the second half joins the running
    batch once the first row has handed out a token."""
    out: list[list[int]] = [[] for _ in range(len(prompts) * choices)]
    first = trio.Event()

    async def one(i: int) -> None:
        if stagger and i >= len(prompts) // 2:
            await first.wait()
        prompt = prompts[i]
        hit = await engine.match_prefix(prompt.keyed, images=prompt.images)
        handles = engine.submit_choices(prompt.ids, [(GREEDY, None)] * choices, max_tokens=max_tokens,
                                        stop_ids=mllama.stop, prefix=hit, images=prompt.images)
        for c, handle in enumerate(handles):
            out[i * choices + c] = (await collect(handle, lambda _: first.set())).tokens

    async with trio.open_nursery() as nursery:
        for i in range(len(prompts)):
            nursery.start_soon(one, i)
    return out


@pytest.fixture
def engines(mllama: Mllama) -> Iterator[Any]:
    made: list[Engine] = []

    def make(prefix: PrefixCache | None = None, **config: Any) -> Engine:
        engine = Engine(mllama.model, mllama.device, EngineConfig(**config), prefix, b"mllama-test")
        made.append(engine)
        return engine

    yield make
    for engine in made:
        engine.close()


def test_mlx_vlm_text_rows_depend_on_its_prefill_chunks(mllama: Mllama) -> None:
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


async def test_an_image_row_alone_equals_mlx_vlm(mllama: Mllama, engines: Any) -> None:
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
async def test_image_and_text_rows_decode_together_as_each_alone(mllama: Mllama, engines: Any, chunk: int) -> None:
    """Rows with one image, two images or a picture of fewer tiles, and text rows: every pass groups the image rows
    by their vision tokens' count; rows join the running batch and leave as they stop. ``chunk`` 8: image prompts
    prefilled in several chunks, each with its window of the cross-attention mask."""
    prompts = [mllama.prompt(*c) for c in (ONE, TEXTS[0], TWO, TEXTS[1], TALL, TEXTS[2])]
    expected = [mllama.reference(p, 24) for p in prompts]
    engine = engines(prefill_chunk=chunk)
    assert await run(engine, mllama, prompts, max_tokens=24, stagger=True) == expected
    assert engine.stats.peak_batch >= 3
    assert engine.active == 0 and engine.stats.kv_bytes == 0


async def test_two_choices_share_the_rows_states(mllama: Mllama, engines: Any) -> None:
    prompt = mllama.prompt(*TWO)
    want = mllama.reference(prompt)
    assert await run(engines(), mllama, [prompt], choices=2) == [want, want]


async def test_n_gram_speculation_on_image_rows(mllama: Mllama, engines: Any) -> None:
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


async def test_the_prefix_cache_serves_an_image_row_only_with_its_images(mllama: Mllama, engines: Any) -> None:
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


async def test_a_prompt_cached_whole_still_gets_its_rows_states(mllama: Mllama, engines: Any) -> None:
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
