"""Tiny vision-language models (runtime/tiny/vlm.py, runtime/tiny/qwen_vl.py): mlx-vlm loads them offline, its
processor expands the image placeholder into the image tokens, generation runs and is deterministic, the chat
template renders content lists; the Qwen-VL ones give an image's tokens 3-D positions from its grid."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
import pytest
from PIL import Image

from runtime.model_kinds import detect_kind_of
from runtime.tiny import PRESETS, TinySpec, ensure_tiny_model, is_smoke_test_model
from runtime.tiny.spec import VisionSpec
from runtime.tiny.vlm import image_tokens

FLAT_PRESETS = ("tiny-smolvlm", "tiny-gemma3-vision")  # language models with 1-D positions
QWEN_PRESETS = ("tiny-qwen2-vl", "tiny-qwen2.5-vl", "tiny-qwen3-vl")  # 3-D (M-RoPE) positions
VLM_PRESETS = (*FLAT_PRESETS, *QWEN_PRESETS)
PLACEHOLDER = {"idefics3": "<image>", "gemma3_vision": "<start_of_image>", "qwen2_vl": "<|image_pad|>",
               "qwen2_5_vl": "<|image_pad|>", "qwen3_vl": "<|image_pad|>"}


def image_token(model: Any) -> int:
    return int(getattr(model.config, "image_token_index", None) or model.config.image_token_id)


def _image(width: int, height: int, seed: int = 0) -> Image.Image:
    pixels = np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)
    return Image.fromarray(pixels)


@pytest.fixture(scope="module")
def loaded() -> dict[str, tuple[Any, Any]]:
    from mlx_vlm import load

    return {name: load(str(ensure_tiny_model(name))) for name in VLM_PRESETS}


@pytest.mark.parametrize("name", [*VLM_PRESETS, "bench-vlm", "tiny-mllama"])
def test_build_is_cached_marked_and_a_vision_model(name: str) -> None:
    path = ensure_tiny_model(name)
    assert ensure_tiny_model(name) == path
    assert is_smoke_test_model(path)
    assert detect_kind_of(path) == "vision"
    config = json.loads((path / "config.json").read_text())
    # Qwen2-VL and Qwen2.5-VL keep their text fields at the top level, as their repositories do.
    assert "vision_config" in config and ("text_config" in config or config["model_type"] in ("qwen2_vl", "qwen2_5_vl"))
    # Qwen-VL repositories ship the video processor's settings, not a processor_config.json.
    processor = "video_preprocessor_config.json" if name in QWEN_PRESETS else "processor_config.json"
    for file in ("model.safetensors", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                 "preprocessor_config.json", processor, "chat_template.json", "chat_template.jinja"):
        assert (path / file).is_file(), file
    template = json.loads((path / "chat_template.json").read_text())["chat_template"]
    assert template == (path / "chat_template.jinja").read_text()


@pytest.mark.parametrize("name", VLM_PRESETS)
def test_generate_is_deterministic_and_sees_the_image(name: str, loaded: dict[str, tuple[Any, Any]]) -> None:
    from mlx_vlm import generate
    from mlx_vlm.prompt_utils import apply_chat_template

    model, processor = loaded[name]
    prompt = apply_chat_template(processor, model.config, "Describe the image.", num_images=1)
    assert PLACEHOLDER[PRESETS[name].arch] in prompt
    runs = [generate(model, processor, prompt, image=[image], max_tokens=8, temperature=0.0, verbose=False)
            for image in (_image(80, 48), _image(80, 48), _image(80, 48, seed=1))]
    assert runs[0].generation_tokens > 0
    assert runs[0].text == runs[1].text
    # The image reaches the model: other pixels, other logits (random weights, so the text may still agree).
    embeds = []
    for image in (_image(80, 48), _image(80, 48, seed=1)):
        inputs = processor(images=[image], text=prompt)
        # Gemma 3's get_input_embeddings needs the attention mask (it builds a 4-D mask from it); idefics3's
        # takes the pixel mask of its tiles.
        extra = {k: inputs[k] for k in ("pixel_attention_mask", "image_grid_thw") if k in inputs}
        embeds.append(model.get_input_embeddings(inputs["input_ids"], inputs["pixel_values"],
                                                 mask=inputs["attention_mask"], **extra).inputs_embeds)
    assert not mx.array_equal(embeds[0], embeds[1])


@pytest.mark.parametrize("name", VLM_PRESETS)
@pytest.mark.parametrize("size", [(1, 1), (64, 64), (80, 48), (128, 20), (20, 128), (640, 480), (129, 65)])
def test_processor_expands_the_placeholder(name: str, size: tuple[int, int],
                                           loaded: dict[str, tuple[Any, Any]]) -> None:
    model, processor = loaded[name]
    spec = PRESETS[name]
    assert spec.vision is not None
    placeholder = PLACEHOLDER[spec.arch]
    out = processor(images=[_image(*size)], text=f"Look {placeholder} here.")
    ids = np.array(out["input_ids"])[0].tolist()
    expected = image_tokens(spec.arch, spec.vision, *size)
    assert ids.count(image_token(model)) == expected
    assert expected <= 100
    vocab = processor.tokenizer.get_vocab()
    if name in QWEN_PRESETS:
        # One temporal patch (an image is its own frame twice), the grid of 8-pixel patches merged 2x2.
        grid = np.array(out["image_grid_thw"]).tolist()
        assert len(grid) == 1 and grid[0][0] == 1 and grid[0][1] * grid[0][2] == expected * 4
        assert expected <= spec.vision.tokens_per_image
    elif spec.arch == "idefics3":
        tiles = expected // spec.vision.tokens_per_image
        assert ids.count(vocab["<global-img>"]) == 1
        assert ids.count(vocab["<fake_token_around_image>"]) == tiles + 1
        assert out["pixel_values"].shape[1] == tiles
    else:
        assert expected == spec.vision.tokens_per_image
        assert ids.count(vocab["<start_of_image>"]) == ids.count(vocab["<end_of_image>"]) == 1


_MESSAGES = [
    {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What is this?"}]},
    {"role": "assistant", "content": [{"type": "text", "text": "A cat."}]},
    {"role": "user", "content": [{"type": "text", "text": "And this?"}, {"type": "image"}]},
]
_RENDERED = {
    "tiny-smolvlm": "<|im_start|>User:<image>What is this?<end_of_utterance>\nAssistant: A cat.<end_of_utterance>\n"
                    "User: And this?<image><end_of_utterance>\nAssistant:",
    "tiny-gemma3-vision": "<bos><start_of_turn>user\n<start_of_image>What is this?<end_of_turn>\n<start_of_turn>model\n"
                          "A cat.<end_of_turn>\n<start_of_turn>user\nAnd this?<start_of_image><end_of_turn>\n"
                          "<start_of_turn>model\n",
    **dict.fromkeys(("tiny-qwen2-vl", "tiny-qwen2.5-vl"),
                    "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\n<|vision_start|>"
                    "<|image_pad|><|vision_end|>What is this?<|im_end|>\n<|im_start|>assistant\nA cat.<|im_end|>\n"
                    "<|im_start|>user\nAnd this?<|vision_start|><|image_pad|><|vision_end|><|im_end|>\n"
                    "<|im_start|>assistant\n"),
    "tiny-qwen3-vl": "<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>What is this?<|im_end|>\n"
                     "<|im_start|>assistant\nA cat.<|im_end|>\n<|im_start|>user\nAnd this?<|vision_start|>"
                     "<|image_pad|><|vision_end|><|im_end|>\n<|im_start|>assistant\n",
}


@pytest.mark.parametrize("name", VLM_PRESETS)
def test_chat_template_renders_content_lists(name: str, loaded: dict[str, tuple[Any, Any]]) -> None:
    _, processor = loaded[name]
    # mlx-vlm's Idefics3 and Gemma 3 processors leave the template on the tokenizer, as with the real repos.
    rendered = processor.tokenizer.apply_chat_template(_MESSAGES, tokenize=False, add_generation_prompt=True)
    assert rendered == _RENDERED[name]
    # The rendered prompt with two images goes through the processor as is.
    out = processor(images=[_image(40, 40), _image(50, 30)], text=rendered)
    spec = PRESETS[name]
    assert spec.vision is not None
    expected = image_tokens(spec.arch, spec.vision, 40, 40) + image_tokens(spec.arch, spec.vision, 50, 30)
    assert np.array(out["input_ids"]).tolist()[0].count(processor.image_token_id) == expected


def test_specs_are_checked() -> None:
    with pytest.raises(ValueError):
        TinySpec(arch="idefics3")  # no vision tower
    with pytest.raises(ValueError):
        TinySpec(arch="qwen3", vision=VisionSpec())
    with pytest.raises(ValueError):
        VisionSpec(image_size=64, patch_size=8, tokens_per_image=9)  # 3x3 tokens from an 8x8 patch grid
    with pytest.raises(ValueError):
        VisionSpec(image_size=60, patch_size=8)


def test_a_custom_spec_builds_where_asked(tmp_path: Path) -> None:
    spec = TinySpec(arch="idefics3", seed=7, vision=VisionSpec(image_size=32, tokens_per_image=4))
    path = ensure_tiny_model(spec, cache_dir=tmp_path)
    assert path.parent == tmp_path / "tiny-models"
    config = json.loads((path / "config.json").read_text())
    assert config["scale_factor"] == 2 and config["vision_config"]["image_size"] == 32


@pytest.mark.parametrize("name", [*FLAT_PRESETS, "tiny-qwen3-vl"])
def test_builds_are_deterministic(tmp_path: Path, name: str) -> None:
    from runtime.tiny import build_tiny_model

    a, b = (build_tiny_model(tmp_path / side, PRESETS[name]) for side in ("a", "b"))
    for f in sorted(p.name for p in a.iterdir()):
        assert (a / f).read_bytes() == (b / f).read_bytes(), f


def test_tiny_reference_resolves() -> None:
    from runtime.models import resolve_model_path

    assert resolve_model_path("tiny:tiny-smolvlm") == ensure_tiny_model("tiny-smolvlm")


def _mlx_lm_cache(name: str, model: Any) -> list[Any]:
    """mlx-lm's cache classes laid out as mlx-vlm's own make_cache lays them out (which, for gemma3, returns
    mlx-vlm's classes, not mlx-lm's): rotating caches on gemma3's sliding-window layers."""
    from mlx_lm.models.cache import KVCache, RotatingKVCache

    text = model.config.text_config
    if PRESETS[name].arch == "idefics3":
        return [KVCache() for _ in range(text.num_hidden_layers)]
    p = text.sliding_window_pattern
    return [KVCache() if i % p == p - 1 else RotatingKVCache(max_size=text.sliding_window, keep=0)
            for i in range(text.num_hidden_layers)]


@pytest.mark.parametrize("name", FLAT_PRESETS)
def test_language_model_decodes_batched_with_mlx_lm_caches(name: str, loaded: dict[str, tuple[Any, Any]]) -> None:
    """What a serving engine relies on: text embeddings with the image rows spliced in (a vision-feature cache)
    equal mlx-vlm's own; prompts prefilled one by one into mlx-lm caches, merged into one left-padded batch
    cache, decode as they do alone."""
    from mlx_vlm.prompt_utils import apply_chat_template

    model, processor = loaded[name]
    lm, image_id = model.language_model, model.config.image_token_index
    rows: list[tuple[mx.array, mx.array | None]] = []
    for text, image in (("Describe the image.", _image(80, 48)), ("Hello there, how are you?", None),
                        ("What is at the top left of this long picture?", _image(128, 20, seed=1))):
        prompt = apply_chat_template(processor, model.config, text, num_images=int(image is not None))
        if image is None:
            ids = mx.array([processor.tokenizer.encode(prompt, add_special_tokens=False)])
            rows.append((ids, None))
            continue
        inputs = processor(images=[image], text=prompt)
        ids = inputs["input_ids"]
        extra = {k: inputs[k] for k in ("pixel_attention_mask",) if k in inputs}
        full = model.get_input_embeddings(ids, inputs["pixel_values"], mask=inputs["attention_mask"], **extra)
        text_embeds = model.get_input_embeddings(ids, None).inputs_embeds
        spliced = mx.where((ids == image_id)[..., None], full.inputs_embeds, text_embeds)
        assert mx.array_equal(spliced, full.inputs_embeds)
        rows.append((ids, spliced))

    def prefill(ids: mx.array, embeds: mx.array | None, cache: list[Any]) -> mx.array:
        # `+ 0`: gemma3's language model scales the inputs_embeds array it is given in place.
        return lm(ids, inputs_embeds=None if embeds is None else embeds + 0, cache=cache).logits[:, -1, :]

    steps = 6
    alone = []
    for ids, embeds in rows:
        cache = _mlx_lm_cache(name, model)
        logits = prefill(ids, embeds, cache)
        out = []
        for _ in range(steps):
            logits = lm(mx.argmax(logits, axis=-1)[:, None], cache=cache).logits[:, -1, :]
            out.append(logits[0])
        alone.append(mx.stack(out))
    caches = [_mlx_lm_cache(name, model) for _ in rows]
    tokens = mx.concatenate([mx.argmax(prefill(ids, embeds, c), axis=-1) for (ids, embeds), c in zip(rows, caches)])
    merged = [layer[0].merge(list(layer)) for layer in zip(*caches)]
    batched = []
    for _ in range(steps):
        logits = lm(tokens[:, None], cache=merged).logits[:, -1, :]
        batched.append(logits)
        tokens = mx.argmax(logits, axis=-1)
    for row in range(len(rows)):
        got = mx.stack([b[row] for b in batched])
        assert mx.allclose(got, alone[row], atol=1e-5), float(mx.abs(got - alone[row]).max())
        assert mx.array_equal(mx.argmax(got, axis=-1), mx.argmax(alone[row], axis=-1))


@pytest.mark.parametrize("name", QWEN_PRESETS)
def test_qwen_image_tokens_take_3d_positions_from_their_grid(name: str, loaded: dict[str, tuple[Any, Any]]) -> None:
    """What the engine keeps per row for these models: an image's tokens sit at (t, row, column) of its merged
    patch grid after the text before it, the text after it goes on from the largest, and the prompt's last
    position ends below its length by the rope delta (which decoding adds to each token's index)."""
    model, processor = loaded[name]
    prompt = processor.tokenizer.apply_chat_template(_MESSAGES[:1], tokenize=False, add_generation_prompt=True)
    inputs = processor(images=[_image(80, 48)], text=prompt)
    ids = mx.array(inputs["input_ids"])
    positions, delta = model.language_model.get_rope_index(ids, mx.array(inputs["image_grid_thw"]))
    row = np.array(positions)[:, 0]  # 3 x tokens
    tokens = np.array(ids)[0]
    image = np.flatnonzero(tokens == image_token(model))
    first = int(image[0])
    assert (row[:, :first] == np.arange(first)).all()
    grid_h, grid_w = 48 // 16, 80 // 16
    assert len(image) == grid_h * grid_w
    assert (row[0, image] == first).all()
    assert (row[1, image] == first + np.repeat(np.arange(grid_h), grid_w)).all()
    assert (row[2, image] == first + np.tile(np.arange(grid_w), grid_h)).all()
    after = int(image[-1]) + 1
    assert (row[:, after:] == first + max(grid_h, grid_w) + np.arange(len(tokens) - after)).all()
    assert int(np.array(delta).item()) == int(row.max()) + 1 - len(tokens) < 0


def test_mllama_reads_each_image_by_cross_attention() -> None:
    """Llama 3.2 Vision (runtime/tiny/mllama.py): one <|image|> token per image in the prompt; every image is 4 tiles
    of 17 vision tokens (padding tiles masked), which the cross-attention layers read as keys and values; the mask
    gives each prompt token the tiles of the images from its own <|image|> token on; the gates let the image reach the
    text."""
    from mlx_vlm import generate, load

    model, processor = load(str(ensure_tiny_model("tiny-mllama")))
    messages = [{"role": "user", "content": [{"type": "text", "text": "First "}, {"type": "image"},
                                             {"type": "text", "text": "then"}, {"type": "image"}]}]
    prompt = processor.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert "system" not in prompt  # the template's rule: no system message beside images
    out = processor(images=[_image(80, 48), _image(20, 30)], text=prompt)
    ids = np.array(out["input_ids"])[0].tolist()
    image = image_token(model)
    at = [i for i, t in enumerate(ids) if t == image]
    assert len(at) == 2
    mask = np.array(out["cross_attention_mask"])[0]  # tokens x images x tiles
    assert mask.shape == (len(ids), 2, 4)
    assert not mask[: at[0]].any()  # before the first image: none
    assert mask[at[0]: at[1], 0].any(axis=-1).all() and not mask[at[0]: at[1], 1].any()
    assert mask[at[1]:, 1].any(axis=-1).all() and not mask[at[1]:, 0].any()
    assert mask[at[0], 0].sum() > mask[at[1], 1].sum()  # the tall small picture takes fewer tiles
    assert np.array(out["pixel_values"]).shape[1:3] == (2, 4)
    runs = [generate(model, processor, prompt, image=[_image(80, 48), _image(20, 30, seed)], max_tokens=8,
                     temperature=0.0, verbose=False).text for seed in (0, 0, 1)]
    assert runs[0] == runs[1] and runs[0] != runs[2]
