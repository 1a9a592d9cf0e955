"""The Qwen vision-language architectures of the tiny models: Qwen2-VL, Qwen2.5-VL, Qwen3-VL and Qwen3.5's vision
variant (see :mod:`runtime.tiny.vlm`, which writes their files).

What sets them apart from the other vision models, and what these tiny ones keep of it:

* **3-D positions (M-RoPE)**: the language model rotates each head's dimensions in three sections by a
  temporal, a height and a width position. Text tokens carry one position in all three; an image's tokens carry
  their place in the image's grid of merged patches, and the text after an image goes on from the largest of
  them (so a prompt's positions end below its length: mlx-vlm's ``rope_deltas``). ``mrope_section`` splits the
  tiny head's 8 frequency pairs as the real ones split 64 (Qwen3-VL interleaves the sections).
* **Images at any size**: the image processor resizes an image to whole multiples of ``patch_size *
  merge_size`` pixels, between ``min_pixels`` and ``max_pixels`` (here: at most ``image_size`` squared), so an
  image costs ``(h / 16) * (w / 16)`` tokens with 8-pixel patches — 15 for 80 x 48, at most 16. The prompt writes
  ``<|vision_start|><|image_pad|><|vision_end|>`` and the processor repeats the pad once per image token.
* **Sharper attention**: the language model's matrices are drawn at 0.1 (:attr:`ArchInfo.layer_std`), so that its
  greedy output changes when an image's positions or a row's rope delta are wrong.
* **The towers**: Qwen2-VL's ViT with 2x2 patch merging; Qwen2.5-VL's with window attention (``window_size``
  pixels; ``fullatt_block_indexes`` attend globally); Qwen3-VL's with learned position embeddings
  (``num_position_embeddings``, a square grid it interpolates) and **deepstack**: the outputs of the tower layers
  in ``deepstack_visual_indexes`` are added to the hidden states at the image's positions after the first
  decoder layers, one per layer.
* **Qwen3.5** (arch ``qwen3_5_vision``, model type ``qwen3_5``): Qwen3-VL's tower without deepstack beside a
  *hybrid* language model — gated-delta (linear-attention) layers with recurrent-state caches between full
  attention layers, every second one here (:func:`runtime.tiny.archs._qwen3_5_fields`) — whose attention layers
  take 3-D positions on the whole head (the real ones rotate a quarter of it: a tiny head's quarter is 2 pairs).

Configs carry the real checkpoints' keys (Qwen2-VL and Qwen2.5-VL keep the text fields at the top level, Qwen3-VL
in ``text_config``); the processor files are what mlx-vlm's numpy Qwen-VL processors read offline.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from runtime.tiny.archs import ARCHS, ArchInfo, _qwen3_5_fields
from runtime.tiny.spec import TinySpec, VisionSpec, size_fields
from runtime.tiny.templates import QWEN2_VL_TEMPLATE, QWEN3_VL_TEMPLATE

QWEN_VL_ARCHS = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen3_5_vision")

# Qwen2's special tokens in their order (ids 151643… in the real vocabulary, 0… here).
_SPECIAL = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|object_ref_start|>", "<|object_ref_end|>",
            "<|box_start|>", "<|box_end|>", "<|quad_start|>", "<|quad_end|>", "<|vision_start|>", "<|vision_end|>",
            "<|vision_pad|>", "<|image_pad|>", "<|video_pad|>")
# The CLIP statistics Qwen2-VL and Qwen2.5-VL normalise with; Qwen3-VL uses 0.5.
_CLIP_MEAN = [0.48145466, 0.4578275, 0.40821073]
_CLIP_STD = [0.26862954, 0.26130258, 0.27577711]


def qwen_vl_info(arch: str) -> ArchInfo:
    """What the real checkpoints of a Qwen-VL arch have: Qwen2's vocabulary specials, ChatML turns."""
    if arch == "qwen3_5_vision":  # the text Qwen3.5's tokens and template (its vision placeholders included)
        return replace(ARCHS["qwen3_5"], tie_embeddings=False, layer_std=0.1)
    names = {"qwen2_vl": ("Qwen2VLForConditionalGeneration", ()),
             "qwen2_5_vl": ("Qwen2_5_VLForConditionalGeneration", ("<tool_call>", "</tool_call>")),
             "qwen3_vl": ("Qwen3VLForConditionalGeneration",
                          ("<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>", "<think>",
                           "</think>"))}
    architecture, added = names[arch]
    return ArchInfo(
        model_type=arch,
        architecture=architecture,
        special=_SPECIAL,
        added=added,
        reserved_fmt="<|extra_{}|>",
        bos=None,
        eos="<|im_end|>",
        pad="<|endoftext|>",
        config_bos="<|endoftext|>",
        config_eos=("<|im_end|>",),
        stop_tokens=("<|im_end|>", "<|endoftext|>"),
        chat_template=QWEN3_VL_TEMPLATE if arch == "qwen3_vl" else QWEN2_VL_TEMPLATE,
        tie_embeddings=False,  # a random model with a tied head mostly repeats its last input token
        generation_defaults={"do_sample": True, "temperature": 0.7, "top_k": 20, "top_p": 0.8},
        # The language model's layers at 0.1: at 0.02 its attention is nearly uniform, so its output hardly
        # depends on positions, and no test could tell an image's 3-D positions (or a lost rope delta) from 1-D ones.
        layer_std=0.1,
    )


def _mrope_section(arch: str, spec: TinySpec) -> list[int]:
    """The frequency pairs of a head (head_dim / 2) split into temporal, height and width sections, in the real
    checkpoints' proportions (Qwen2/2.5-VL: 16, 24, 24 of 64; Qwen3-VL: 24, 20, 20)."""
    pairs = spec.head_dim // 2
    first = pairs // 2 if arch not in ("qwen3_vl", "qwen3_5_vision") else pairs * 3 // 8
    rest = pairs - first
    return [first, rest // 2, rest - rest // 2]


def qwen_vl_vision_config(arch: str, spec: TinySpec, vision: VisionSpec) -> dict[str, Any]:
    common: dict[str, Any] = {"depth": vision.num_layers, "num_heads": vision.num_heads,
                              "patch_size": vision.patch_size, "spatial_merge_size": vision.pool,
                              "temporal_patch_size": 2}
    if arch == "qwen2_vl":
        return {**common, "model_type": "qwen2_vl", "embed_dim": vision.hidden_size,
                "hidden_size": spec.hidden_size, "mlp_ratio": vision.intermediate_size // vision.hidden_size,
                "in_chans": 3, "spatial_patch_size": vision.patch_size}
    if arch == "qwen2_5_vl":
        # Windows of 2x2 merged tokens (the real 112 px over 14 px patches and 2x2 merging make 4x4); the last
        # layer attends globally, as every eighth does in the real tower.
        return {**common, "model_type": "qwen2_5_vl", "hidden_act": "silu", "hidden_size": vision.hidden_size,
                "intermediate_size": vision.intermediate_size, "out_hidden_size": spec.hidden_size, "in_chans": 3,
                "spatial_patch_size": vision.patch_size, "window_size": vision.patch_size * vision.pool * 2,
                "fullatt_block_indexes": [vision.num_layers - 1], "tokens_per_second": 2}
    side = vision.patches_per_side
    if arch == "qwen3_5_vision":  # Qwen3-VL's tower without deepstack (mlx-vlm refuses deepstack indexes for it)
        return {**qwen_vl_vision_config("qwen3_vl", spec, vision), "model_type": "qwen3_5",
                "deepstack_visual_indexes": []}
    return {**common, "model_type": "qwen3_vl", "hidden_act": "gelu_pytorch_tanh", "hidden_size": vision.hidden_size,
            "intermediate_size": vision.intermediate_size, "out_hidden_size": spec.hidden_size, "in_channels": 3,
            "initializer_range": 0.02, "num_position_embeddings": side * side,
            # Every tower layer feeds a decoder layer (the real 27-layer tower: layers 8, 16 and 24).
            "deepstack_visual_indexes": list(range(min(vision.num_layers, spec.num_layers)))}


def qwen_vl_model_config(arch: str, spec: TinySpec, vision: VisionSpec, info: ArchInfo,
                         token_id: dict[str, int]) -> dict[str, Any]:
    """config.json as the real checkpoints write it (without flow's smoke-test markers)."""
    tokens = {"image_token_id": token_id["<|image_pad|>"], "video_token_id": token_id["<|video_pad|>"],
              "vision_start_token_id": token_id["<|vision_start|>"],
              "vision_end_token_id": token_id["<|vision_end|>"]}
    text: dict[str, Any] = {
        **size_fields(spec),
        "hidden_act": "silu",
        "rms_norm_eps": 1e-6,
        "tie_word_embeddings": info.tie_embeddings,
        "bos_token_id": token_id[info.config_bos],
        "eos_token_id": token_id[info.eos],
        "initializer_range": 0.02,
        "attention_dropout": 0.0,
        "use_cache": True,
    }
    common = {"architectures": [info.architecture], "model_type": arch, **tokens,
              "vision_config": qwen_vl_vision_config(arch, spec, vision), "tie_word_embeddings": info.tie_embeddings,
              "torch_dtype": spec.dtype}
    if arch == "qwen3_5_vision":
        fields = _qwen3_5_fields(spec.num_layers)
        rope = {**fields["rope_parameters"], "partial_rotary_factor": 1.0,
                "mrope_section": _mrope_section(arch, spec), "mrope_interleaved": True}
        return {**common, "model_type": "qwen3_5", "text_config": {
            **text, **fields, "model_type": "qwen3_5_text", "attention_bias": False, "rope_parameters": rope}}
    if arch == "qwen3_vl":
        return {**common, "text_config": {
            **text, "model_type": "qwen3_vl_text", "attention_bias": False, "rope_theta": 5_000_000.0,
            "rope_scaling": {"mrope_interleaved": True, "mrope_section": _mrope_section(arch, spec),
                             "rope_type": "default"}}}
    return {**common, **text, "vision_token_id": token_id["<|vision_pad|>"], "rope_theta": 1_000_000.0,
            "rope_scaling": {"type": "mrope", "mrope_section": _mrope_section(arch, spec)},
            "sliding_window": spec.max_position_embeddings, "use_sliding_window": False,
            "max_window_layers": spec.num_layers}


def qwen_vl_preprocessor_config(arch: str, vision: VisionSpec) -> dict[str, Any]:
    """preprocessor_config.json: images resized to whole ``patch_size * merge_size`` multiples, at most
    ``image_size`` squared pixels and at least one merged token."""
    factor = vision.patch_size * vision.pool
    processor = {"qwen2_vl": "Qwen2VLProcessor", "qwen2_5_vl": "Qwen2_5_VLProcessor",
                 "qwen3_vl": "Qwen3VLProcessor", "qwen3_5_vision": "Qwen3VLProcessor"}[arch]
    later = arch in ("qwen3_vl", "qwen3_5_vision")
    mean, std = (_CLIP_MEAN, _CLIP_STD) if not later else ([0.5] * 3, [0.5] * 3)
    out: dict[str, Any] = {"do_convert_rgb": True, "do_normalize": True, "do_rescale": True, "do_resize": True,
                           "image_mean": mean, "image_std": std, "rescale_factor": 1 / 255,
                           "patch_size": vision.patch_size, "temporal_patch_size": 2, "merge_size": vision.pool,
                           "image_processor_type": "Qwen2VLImageProcessor", "processor_class": processor}
    pixels = {"shortest_edge": factor * factor, "longest_edge": vision.image_size * vision.image_size}
    if later:
        return {**out, "size": pixels}
    return {**out, "min_pixels": pixels["shortest_edge"], "max_pixels": pixels["longest_edge"]}


def qwen_vl_video_config(arch: str, vision: VisionSpec) -> dict[str, Any]:
    """video_preprocessor_config.json (mlx-vlm's processor reads it; without it, it would ask the Hub)."""
    image = qwen_vl_preprocessor_config(arch, vision)
    return {**{k: v for k, v in image.items() if k not in ("image_processor_type", "min_pixels", "max_pixels")},
            "video_processor_type": "Qwen2VLVideoProcessor", "fps": 2.0, "min_frames": 4, "max_frames": 16,
            "size": {"shortest_edge": image.get("min_pixels", 256), "longest_edge": vision.image_size ** 2 * 2}}


def qwen_vl_tokenizer_extras(tok_config: dict[str, Any], arch: str) -> None:
    """What the real tokenizer_config.json adds for the processor."""
    tok_config["processor_class"] = qwen_vl_preprocessor_config(arch, VisionSpec())["processor_class"]
    tok_config["errors"] = "replace"
