"""Qwen3.5's vision variant (mlx-vlm's ``qwen3_5``: 3-D positions and a hybrid language model, gated-delta layers with
recurrent states between attention layers) in the batched engine, driven directly: its layer caches are mlx-lm's
(runtime/vision.py, ``_hybrid_forward``), batched, snapshotted and rolled back as the text Qwen3.5's, so greedy
output equals ``mlx_vlm.stream_generate`` for every row — alone, in a batch of image rows and text rows joining a
running batch (left-padded, chunked), with n-gram speculation, and on the next turn from the prefix cache."""

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
from runtime.recurrent_rollback import RecurrentRollback
from runtime.tiny import ensure_tiny_model
from tests.runtime.test_engine import collect
from tests.runtime.test_speculative import always_verify, oracle  # noqa: F401  (a fixture)

GREEDY = SamplingParams()
MAX_TOKENS = 12
PRESET = "tiny-qwen3.5-vl"
GENERATION_PROMPT = "<|im_start|>assistant\n<think>\n"


def picture(seed: int, size: tuple[int, int] = (80, 48)) -> Image.Image:
    pixels = np.random.default_rng(seed).integers(0, 256, (size[1], size[0], 3), dtype=np.uint8)
    return Image.fromarray(pixels)


A, B, C = picture(1), picture(2), picture(3, (32, 64))  # C: a tall picture, another grid


def ask(*parts: str | Image.Image) -> dict[str, Any]:
    return {"role": "user", "pictures": tuple(p for p in parts if isinstance(p, Image.Image)),
            "content": [{"type": "image"} if isinstance(p, Image.Image) else {"type": "text", "text": p}
                        for p in parts]}


@dataclass(frozen=True)
class Prompt:
    ids: list[int]
    images: PromptImages | None
    text: str
    pictures: tuple[Image.Image, ...]
    turn_point: int  # where the messages end (the generation prompt follows): the hybrid's snapshot for the next turn

    @property
    def keyed(self) -> list[int]:
        return self.ids if self.images is None else key_tokens(self.ids, self.images.spans)



@dataclass
class Qwen35VL:
    device: DeviceThread
    model: Any  # flow's VisionLanguageModel, on the device thread
    processor: Any
    reference_model: Any  # mlx-vlm's own, on the test's thread
    stop: frozenset[int]

    def prompt(self, *messages: dict[str, Any]) -> Prompt:
        """The prompt as flow's chat.prepare makes it: the template rendered, then the processor (images) or the
        tokenizer (text)."""
        from runtime.vision import prompt_inputs

        plain = [{k: v for k, v in m.items() if k != "pictures"} for m in messages]
        text = self.processor.tokenizer.apply_chat_template(plain, add_generation_prompt=True, tokenize=False)
        pictures = tuple(p for m in messages for p in m.get("pictures", ()))
        assert text.endswith(GENERATION_PROMPT)
        tail = len(self.processor.tokenizer.encode(GENERATION_PROMPT, add_special_tokens=False))
        if not pictures:
            ids = list(self.processor.tokenizer.encode(text, add_special_tokens=False))
            return Prompt(ids, None, text, (), len(ids) - tail)
        digests = [hashlib.sha256(p.tobytes() + str(p.size).encode()).digest() for p in pictures]
        ids, images = prompt_inputs(self.processor, "qwen3_5", text, list(pictures), digests,
                                    self.model.image_token_id)
        return Prompt(list(ids), images, text, pictures, len(ids) - tail)

    def reference(self, prompt: Prompt, max_tokens: int = MAX_TOKENS) -> list[int]:
        """mlx-vlm's greedy tokens for the prompt, up to a stop token."""
        from mlx_vlm import stream_generate

        tokens = [r.token for r in stream_generate(self.reference_model, self.processor, prompt.text,
                                                   image=list(prompt.pictures) or None, max_tokens=max_tokens,
                                                   temperature=0.0)][:max_tokens]
        for i, token in enumerate(tokens):
            if token in self.stop:
                return tokens[:i]
        return tokens


@pytest.fixture(scope="module")
def qwen() -> Iterator[Qwen35VL]:
    from mlx_vlm import load

    from runtime.cpu_activations import use_fast_gelu
    from runtime.vision import load_vision_model

    path = ensure_tiny_model(PRESET)
    device = DeviceThread("test-qwen3.5-vl-device")
    device.start()
    model, processor = device.call(lambda: load_vision_model(path, device))
    reference_model, _ = load(str(path))
    use_fast_gelu(reference_model)  # as flow runs the tower
    vocab = processor.tokenizer.get_vocab()
    stop = frozenset(vocab[t] for t in ("<|im_end|>", "<|endoftext|>"))
    yield Qwen35VL(device, model, processor, reference_model, stop)
    device.stop()


async def run(engine: Engine, qwen: Qwen35VL, prompts: list[Prompt], *, max_tokens: int = MAX_TOKENS,
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
                                        stop_ids=qwen.stop, prefix=hit, images=prompt.images,
                                        turn_point=prompt.turn_point)
        for c, handle in enumerate(handles):
            out[i * choices + c] = (await collect(handle, lambda _: first.set())).tokens

    async with trio.open_nursery() as nursery:
        for i in range(len(prompts)):
            nursery.start_soon(one, i)
    return out


@pytest.fixture
def engines(qwen: Qwen35VL) -> Iterator[Any]:
    made: list[Engine] = []

    def make(prefix: PrefixCache | None = None, **config: Any) -> Engine:
        engine = Engine(qwen.model, qwen.device, EngineConfig(**config), prefix, b"qwen3.5-vl-test")
        made.append(engine)
        return engine

    yield make
    for engine in made:
        engine.close()


ONE = (ask("Hello first. ", A, "What is in the picture?"),)
TWO = (ask(A, "then", B, "Compare them."),)
TALL = (ask("Describe it. ", C),)
TEXTS = [(ask(f"Tell me a long story, number {i}."),) for i in range(3)]


def test_its_layer_caches_are_mlx_lms(qwen: Qwen35VL) -> None:
    """Gated-delta layers get mlx-lm's ArraysCache (what the engine batches and snapshots), attention layers its
    KVCache; the speculator finds every gated-delta layer to roll back."""
    from mlx_lm.models.cache import ArraysCache, KVCache

    caches = qwen.model.make_cache()
    layers = qwen.model.layers
    assert qwen.model.hybrid and qwen.model.mrope
    assert [type(c) for c in caches] == [ArraysCache if layer.is_linear else KVCache for layer in layers]
    rollback = qwen.device.call(lambda: RecurrentRollback.of(qwen.model))
    assert rollback is not None and set(rollback.mixers) == {i for i, layer in enumerate(layers) if layer.is_linear}


async def test_an_image_row_alone_equals_mlx_vlm(qwen: Qwen35VL, engines: Any) -> None:
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
async def test_image_and_text_rows_decode_together_as_each_alone(qwen: Qwen35VL, engines: Any, chunk: int) -> None:
    """Rows with one image, two images or a picture of another grid, and text rows: each row's positions and
    recurrent states its own; rows join the running batch and leave as they stop. ``chunk`` 8: prompts prefilled
    in several chunks (the recurrent states carried from chunk to chunk)."""
    prompts = [qwen.prompt(*c) for c in (ONE, TEXTS[0], TWO, TEXTS[1], TALL, TEXTS[2])]
    expected = [qwen.reference(p, 24) for p in prompts]
    engine = engines(prefill_chunk=chunk)
    assert await run(engine, qwen, prompts, max_tokens=24, stagger=True) == expected
    assert engine.stats.peak_batch >= 3
    assert engine.active == 0 and engine.stats.kv_bytes == 0


async def test_two_choices(qwen: Qwen35VL, engines: Any) -> None:
    prompt = qwen.prompt(*TWO)
    want = qwen.reference(prompt)
    assert await run(engines(), qwen, [prompt], choices=2) == [want, want]


@pytest.mark.parametrize("wrong_after", [None, 2])
async def test_speculation_on_image_rows(qwen: Qwen35VL, engines: Any, monkeypatch: pytest.MonkeyPatch,
                                         always_verify: None, wrong_after: int | None) -> None:
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


async def test_the_next_turn_with_the_same_picture_is_a_prefix_hit(qwen: Qwen35VL, engines: Any) -> None:
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
