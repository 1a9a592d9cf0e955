"""What the engine tests of vision models driven directly share (test_vision_cross_attention.py,
test_vision_hybrid.py): random pictures, messages that carry them, the prompt as flow's chat.prepare makes it,
mlx-vlm's greedy tokens for it, the model loaded twice (flow's on a device thread, mlx-vlm's on the test's), prompts
run at once through an engine, and the engines a test makes, closed after it."""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import hashlib
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import numpy as np
import trio
from PIL import Image

from protocols.ir import MessageEnds, PromptImages, SamplingParams
from runtime.device import DeviceThread
from runtime.engine import Engine
from runtime.engine_config import EngineConfig
from runtime.image_spans import key_tokens
from runtime.prefix_cache import PrefixCache
from runtime.tiny import ensure_tiny_model
from tests.runtime.test_engine import collect

GREEDY = SamplingParams()
MAX_TOKENS = 12


def picture(seed: int, size: tuple[int, int] = (80, 48)) -> Image.Image:
    pixels = np.random.default_rng(seed).integers(0, 256, (size[1], size[0], 3), dtype=np.uint8)
    return Image.fromarray(pixels)


def user(*parts: str | Image.Image) -> dict[str, Any]:
    return {"role": "user", "content": [{"type": "image"} if isinstance(p, Image.Image) else {"type": "text", "text": p}
                                        for p in parts]}


def ask(*parts: str | Image.Image) -> dict[str, Any]:
    """A user message in HF multimodal shape, its pictures with it (``pictures``: left out of the template)."""
    message = user(*parts)
    message["pictures"] = tuple(p for p in parts if isinstance(p, Image.Image))
    return message


@dataclass(frozen=True)
class Prompt:
    ids: list[int]
    images: PromptImages | None
    text: str  # the template rendered
    pictures: tuple[Image.Image, ...]
    turn_point: int | None = None  # where the messages end (the generation prompt follows), when the rows say

    @property
    def keyed(self) -> list[int]:
        """The prompt as the generate stage matches it in the prefix cache (image positions by their pixels)."""
        return self.ids if self.images is None else key_tokens(self.ids, self.images.spans)


@dataclass
class VisionRows:
    device: DeviceThread
    model: Any  # flow's VisionLanguageModel, on the device thread
    processor: Any
    reference_model: Any  # mlx-vlm's own, on the test's thread
    stop: frozenset[int]
    model_type: str  # the processor's (runtime.vision.prompt_inputs)
    generation_prompt: str | None = None  # the template's, when prompts should carry their turn point

    def prompt(self, *messages: dict[str, Any]) -> Prompt:
        """The prompt as flow's chat.prepare makes it: the template rendered, then the processor (images) or the
        tokenizer (text)."""
        from runtime.vision import prompt_inputs

        plain = [{k: v for k, v in m.items() if k != "pictures"} for m in messages]
        text = self.processor.tokenizer.apply_chat_template(plain, add_generation_prompt=True, tokenize=False)
        pictures = tuple(p for m in messages for p in m.get("pictures", ()))
        if not pictures:
            ids = list(self.processor.tokenizer.encode(text, add_special_tokens=False))
            images = None
        else:
            digests = [hashlib.sha256(p.tobytes() + str(p.size).encode()).digest() for p in pictures]
            expanded, images = prompt_inputs(self.processor, self.model_type, text, list(pictures), digests,
                                             self.model.image_token_id)
            ids = list(expanded)
        turn_point = None
        if self.generation_prompt is not None:
            assert text.endswith(self.generation_prompt)
            turn_point = len(ids) - len(self.processor.tokenizer.encode(self.generation_prompt,
                                                                        add_special_tokens=False))
        return Prompt(ids, images, text, pictures, turn_point)

    def generate(self, text: str, pictures: tuple[Image.Image, ...], max_tokens: int) -> list[int]:
        """mlx-vlm's greedy tokens for the rendered prompt."""
        from mlx_vlm import stream_generate

        return [r.token for r in stream_generate(self.reference_model, self.processor, text,
                                                 image=list(pictures) or None, max_tokens=max_tokens,
                                                 temperature=0.0)]

    def reference(self, prompt: Prompt, max_tokens: int = MAX_TOKENS) -> list[int]:
        """mlx-vlm's greedy tokens for the prompt, up to a stop token."""
        tokens = self.generate(prompt.text, prompt.pictures, max_tokens)[:max_tokens]
        for i, token in enumerate(tokens):
            if token in self.stop:
                return tokens[:i]
        return tokens


def loaded_rows(preset: str, stop_tokens: tuple[str, ...], make: Callable[..., VisionRows] = VisionRows,
                **rows: Any) -> Iterator[VisionRows]:
    """The tiny model ``preset`` loaded by flow (on a device thread of its own, stopped after) and by mlx-vlm (its
    tower's GELU as flow runs it), for a module fixture to yield from; ``rows``: the rest of ``make``'s fields."""
    from mlx_vlm import load

    from runtime.cpu_activations import use_fast_gelu
    from runtime.vision import load_vision_model

    path = ensure_tiny_model(preset)
    device = DeviceThread(f"test-{preset}-device")
    device.start()
    try:
        model, processor = device.call(lambda: load_vision_model(path, device))
        reference_model, _ = load(str(path))
        use_fast_gelu(reference_model)  # as flow runs the tower (its accuracy: test_cpu_activations)
        vocab = processor.tokenizer.get_vocab()
        yield make(device, model, processor, reference_model, frozenset(vocab[t] for t in stop_tokens), **rows)
    finally:
        device.stop()


async def run(engine: Engine, rows: VisionRows, prompts: list[Prompt], *, max_tokens: int = MAX_TOKENS,
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
                                        stop_ids=rows.stop, prefix=hit, images=prompt.images,
                                        message_ends=MessageEnds(last=prompt.turn_point))
        for c, handle in enumerate(handles):
            out[i * choices + c] = (await collect(handle, lambda _: first.set())).tokens

    async with trio.open_nursery() as nursery:
        for i in range(len(prompts)):
            nursery.start_soon(one, i)
    return out


@contextmanager
def engines_of(rows: VisionRows, namespace: bytes) -> Iterator[Callable[..., Engine]]:
    """A maker of engines on the rows' model (a prefix cache, engine settings), every one closed at the end."""
    made: list[Engine] = []

    def make(prefix: PrefixCache | None = None, **config: Any) -> Engine:
        config.setdefault("stream_interval", 0)  # every step's tokens as they come: tests time arrivals by them
        engine = Engine(rows.model, rows.device, EngineConfig(**config), prefix, namespace)
        made.append(engine)
        return engine

    try:
        yield make
    finally:
        for engine in made:
            engine.close()
