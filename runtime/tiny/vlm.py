"""Tiny random-weight vision-language models, built locally as mlx-vlm loads real ones (see :mod:`runtime.tiny`).

Five of mlx-vlm's architectures, each written as the real Hugging Face repositories ship them — config.json with
``text_config`` and ``vision_config``, one ``model.safetensors``, a tokenizer holding the real image tokens,
``tokenizer_config.json``, ``special_tokens_map.json``, ``preprocessor_config.json``, ``processor_config.json``
and the chat template as both ``chat_template.json`` and ``chat_template.jinja``:

* **idefics3** (SmolVLM-Instruct): a Llama-style text model, a SigLIP vision tower and a connector that
  pixel-shuffles ``scale_factor**2`` patches into one image token. The image processor resizes an image so
  its longest edge is ``image_size * max_tiles_per_side`` (small images are scaled up), cuts it into
  ``image_size`` tiles and adds a global view, so an image costs ``(rows * cols + 1) * tokens_per_image``
  tokens (:func:`image_tokens`; with one tile per side, just ``tokens_per_image``). The prompt wraps them in
  ``<fake_token_around_image>``, ``<row_R_col_C>`` and ``<global-img>`` as SmolVLM's processor does.
* **gemma3** (gemma-3-4b-it): a Gemma 3 text model (sliding-window and global layers), a SigLIP vision tower
  and Gemma 3's projector, which average-pools the patch grid to ``tokens_per_image`` soft tokens. Every image
  is resized to ``image_size`` square, so it always costs ``tokens_per_image`` ``<image_soft_token>``s between
  ``<start_of_image>`` and ``<end_of_image>``.
* **qwen2_vl**, **qwen2_5_vl**, **qwen3_vl** (Qwen2-VL, Qwen2.5-VL, Qwen3-VL): language models with 3-D (M-RoPE)
  positions and images at any size; what is particular to them is :mod:`runtime.tiny.qwen_vl`'s.

The vision side's sizes are a :class:`~runtime.tiny.spec.VisionSpec` (beside TinySpec, which holds one).
Weights are drawn from the parameters of mlx-vlm's own model class for the config (named as its ``sanitize``
leaves them, which is a no-op on them), with the same deterministic N(0, 0.02) recipe as the text models.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

import mlx.core as mx
from mlx.utils import tree_flatten

from runtime.tiny.archs import ArchInfo
from runtime.tiny.mllama import (
    GATE,
    mllama_info,
    mllama_model_config,
    mllama_preprocessor_config,
    mllama_processor_config,
)
from runtime.tiny.qwen_vl import (
    QWEN_VL_ARCHS,
    qwen_vl_info,
    qwen_vl_model_config,
    qwen_vl_preprocessor_config,
    qwen_vl_tokenizer_extras,
    qwen_vl_video_config,
)
from runtime.tiny.spec import (
    BUILDER_VERSION,
    INIT_STD,
    ROWS_COLS,
    SMOKE_TEST_LABEL,
    TinySpec,
    VisionSpec,
    arch_info,
    size_fields,
)
from runtime.tiny.tokenizer import special_tokens_map, tokenizer_config, train_tokenizer

_IMAGE_MEAN_STD = [0.5, 0.5, 0.5]  # both SmolVLM and Gemma 3 normalise pixels to [-1, 1]
_RESCALE = 1 / 255


def _idefics3_info() -> ArchInfo:
    rows_cols = tuple(f"<row_{r}_col_{c}>" for r in range(1, ROWS_COLS + 1) for c in range(1, ROWS_COLS + 1))
    return ArchInfo(
        model_type="idefics3",
        architecture="Idefics3ForConditionalGeneration",
        # SmolLM2's first specials, then the image tokens SmolVLM adds to it.
        special=("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<fake_token_around_image>", "<image>",
                 "<end_of_utterance>", "<global-img>", *rows_cols),
        reserved_fmt="<|reserved_special_token_{}|>",
        bos="<|im_start|>",
        eos="<end_of_utterance>",
        pad="<|im_end|>",
        unk="<|endoftext|>",
        prepend_bos=False,  # the template writes <|im_start|> itself
        config_bos="<|im_start|>",
        config_eos=("<end_of_utterance>",),
        stop_tokens=("<end_of_utterance>",),
        tie_embeddings=False,  # a random model with a tied head mostly repeats its last input token
        chat_template=SMOLVLM_TEMPLATE,
    )


def _gemma3_info() -> ArchInfo:
    text = arch_info("gemma3")
    return replace(text, model_type="gemma3", architecture="Gemma3ForConditionalGeneration",
                   special=(*text.special, "<start_of_image>", "<end_of_image>", "<image_soft_token>"))


def vlm_arch_info(arch: str) -> ArchInfo:
    """What the real checkpoints of a vision arch (``idefics3``, ``gemma3_vision``, the Qwen-VL ones) have."""
    if arch in QWEN_VL_ARCHS:
        return qwen_vl_info(arch)
    if arch == "mllama":
        return mllama_info()
    if arch == "idefics3":
        return _idefics3_info()
    if arch == "gemma3_vision":
        return _gemma3_info()
    raise ValueError(f"not a vision arch: {arch!r}")


# HuggingFaceTB/SmolVLM-Instruct's chat_template.json: content is a list of {"type": "image"} and
# {"type": "text"} parts; "User:" takes no space before an image that opens the message.
SMOLVLM_TEMPLATE = (
    "<|im_start|>{% for message in messages %}{{message['role'] | capitalize}}"
    "{% if message['content'][0]['type'] == 'image' %}{{':'}}{% else %}{{': '}}{% endif %}"
    "{% for line in message['content'] %}{% if line['type'] == 'text' %}{{line['text']}}"
    "{% elif line['type'] == 'image' %}{{ '<image>' }}{% endif %}{% endfor %}<end_of_utterance>\n"
    "{% endfor %}{% if add_generation_prompt %}{{ 'Assistant:' }}{% endif %}"
)


def _vision_config(arch: str, vision: VisionSpec) -> dict[str, Any]:
    return {
        # SmolVLM-Instruct names its tower "idefics3"; Gemma 3 a plain SigLIP.
        "model_type": "idefics3" if arch == "idefics3" else "siglip_vision_model",
        "hidden_size": vision.hidden_size,
        "intermediate_size": vision.intermediate_size,
        "num_attention_heads": vision.num_heads,
        "num_hidden_layers": vision.num_layers,
        "image_size": vision.image_size,
        "patch_size": vision.patch_size,
        "num_channels": 3,
        "layer_norm_eps": 1e-6,
        "hidden_act": "gelu_pytorch_tanh",
        **({} if arch == "idefics3" else {"vision_use_head": False}),
    }


def _text_config(arch: str, spec: TinySpec, vision: VisionSpec, token_id: dict[str, int],
                 info: ArchInfo) -> dict[str, Any]:
    common: dict[str, Any] = {
        **size_fields(spec),
        "rms_norm_eps": 1e-5 if arch == "idefics3" else 1e-6,
        "tie_word_embeddings": info.tie_embeddings,
        "pad_token_id": token_id[info.pad],
    }
    if arch == "idefics3":
        return {**common, "model_type": "llama", "architectures": ["VLlama3ForCausalLM"], "hidden_act": "silu",
                "rope_theta": 273768.0, "rope_traditional": False}
    return {
        **common,
        "model_type": "gemma3_text",
        "hidden_activation": "gelu_pytorch_tanh",
        "query_pre_attn_scalar": spec.head_dim,
        "rope_theta": 1_000_000.0,
        "rope_global_base_freq": 1_000_000.0,
        "rope_local_base_freq": 10_000.0,
        "rope_scaling": None,
        "sliding_window": spec.sliding_window,
        # mlx-vlm builds masks from cache[pattern - 1]: the pattern can't exceed the layer count.
        "sliding_window_pattern": min(6, spec.num_layers),
        # mlx-vlm's projector reads the pooled token count from the text config.
        "mm_tokens_per_image": vision.tokens_per_image,
        "attn_logit_softcapping": None,
        "final_logit_softcapping": None,
    }


def _model_config(arch: str, spec: TinySpec, vision: VisionSpec, info: ArchInfo,
                  token_id: dict[str, int]) -> dict[str, Any]:
    if arch in QWEN_VL_ARCHS:
        return {**qwen_vl_model_config(arch, spec, vision, info, token_id), **_markers(spec)}
    if arch == "mllama":
        return {**mllama_model_config(spec, vision, info, token_id), **_markers(spec)}
    eos = [token_id[t] for t in info.config_eos]
    config: dict[str, Any] = {
        "architectures": [info.architecture],
        "model_type": info.model_type,
        "text_config": _text_config(arch, spec, vision, token_id, info),
        "vision_config": _vision_config(arch, vision),
        "vocab_size": spec.vocab_size,
        "bos_token_id": token_id[info.config_bos],
        "eos_token_id": eos,
        "pad_token_id": token_id[info.pad],
        "initializer_range": INIT_STD,
        "tie_word_embeddings": info.tie_embeddings,
        "torch_dtype": spec.dtype,
        "use_cache": True,
    }
    if arch == "idefics3":
        config.update({"image_token_id": token_id["<image>"], "scale_factor": vision.pool})
    else:
        config.update({"image_token_index": token_id["<image_soft_token>"],
                       "boi_token_index": token_id["<start_of_image>"],
                       "eoi_token_index": token_id["<end_of_image>"],
                       "mm_tokens_per_image": vision.tokens_per_image})
    config.update(_markers(spec))
    return config


def _markers(spec: TinySpec) -> dict[str, Any]:
    return {"flow_smoke_test": True, "flow_smoke_test_label": SMOKE_TEST_LABEL, "flow_tiny_spec": asdict(spec),
            "flow_builder_version": BUILDER_VERSION}


def _mlx_vlm_model(config: dict[str, Any]) -> Any:
    """mlx-vlm's model for ``config``, built as ``mlx_vlm.utils.load_model`` builds it."""
    # mlx-vlm takes seconds to import (it brings transformers): only a vision model's build pays for it.
    from mlx_vlm.utils import get_model_and_args, update_module_configs

    config = json.loads(json.dumps(config))  # from_dict writes into the dict it is given
    config.setdefault("text_config", {})
    config.setdefault("vision_config", {})
    module, _ = get_model_and_args(config=config)
    model_config = module.ModelConfig.from_dict(config)
    model_config = update_module_configs(model_config, module, config, ["text", "vision"])  # type: ignore[no-untyped-call]
    return module.Model(model_config)


def _random_weights(arch: str, spec: TinySpec, config: dict[str, Any]) -> dict[str, mx.array]:
    """Every parameter of mlx-vlm's model, named as it names them, drawn deterministically from ``spec.seed``."""
    mx.random.seed(spec.seed)
    params = dict(tree_flatten(_mlx_vlm_model(config).parameters()))
    if arch == "gemma3_vision":
        params.pop("language_model.lm_head.weight", None)  # tied: mlx-vlm's sanitize copies the embeddings
    names = sorted(params)
    keys = mx.random.split(mx.random.key(spec.seed), len(names))
    dtype = getattr(mx, spec.dtype)
    layer_std = vlm_arch_info(arch).layer_std or INIT_STD  # the language model's matrices (not its embeddings)
    weights: dict[str, mx.array] = {}
    for i, name in enumerate(names):
        value = params[name]
        if value.ndim >= 2:  # embeddings, projections, conv patches: HF-style N(0, 0.02)
            text = name.startswith("language_model.") and "embed" not in name
            value = mx.random.normal(value.shape, key=keys[i]) * (layer_std if text else INIT_STD)
        elif name.endswith("bias"):
            value = mx.zeros_like(value)
        elif arch == "gemma3_vision" and not name.startswith("vision_tower."):
            value = mx.zeros_like(value)  # gemma norms scale by (1 + w): identity is w = 0
        elif arch == "mllama" and "gate" in name.rsplit(".", 1)[-1]:
            value = mx.full(value.shape, GATE)  # tanh(0) would shut every cross-attention layer and gated embedding
        if value.ndim == 5:
            # A 3-D patch convolution (Qwen-VL's temporal patches) is stored as PyTorch lays it out, [out, in, t, h,
            # w]: mlx-vlm's sanitize transposes every 5-D patch weight it reads into MLX's [out, t, h, w, in].
            value = value.transpose(0, 4, 1, 2, 3)
        weights[name] = value.astype(dtype)
    mx.eval(weights)
    return weights


def _preprocessor_config(arch: str, vision: VisionSpec) -> dict[str, Any]:
    common: dict[str, Any] = {"do_convert_rgb": True, "do_normalize": True, "do_rescale": True,
                              "do_resize": True, "image_mean": _IMAGE_MEAN_STD, "image_std": _IMAGE_MEAN_STD,
                              "rescale_factor": _RESCALE}
    if arch == "idefics3":
        return {**common, "image_processor_type": "Idefics3ImageProcessor", "processor_class": "Idefics3Processor",
                "do_image_splitting": True, "do_pad": True, "resample": 1,
                "size": {"longest_edge": vision.image_size * vision.max_tiles_per_side},
                "max_image_size": {"longest_edge": vision.image_size}}
    return {**common, "image_processor_type": "Gemma3ImageProcessor", "processor_class": "Gemma3Processor",
            "image_seq_length": vision.tokens_per_image, "do_pan_and_scan": None,
            "pan_and_scan_max_num_crops": None, "pan_and_scan_min_crop_size": None,
            "pan_and_scan_min_ratio_to_activate": None, "resample": 2,
            "size": {"height": vision.image_size, "width": vision.image_size}}


def _processor_config(arch: str, vision: VisionSpec) -> dict[str, Any]:
    if arch == "idefics3":
        return {"image_seq_len": vision.tokens_per_image, "processor_class": "Idefics3Processor"}
    return {"image_seq_length": vision.tokens_per_image, "processor_class": "Gemma3Processor"}


def image_tokens(arch: str, vision: VisionSpec, width: int, height: int) -> int:
    """How many image tokens the processor gives an image of ``width`` x ``height`` pixels (the arithmetic of
    transformers' Idefics3 image processor, step by step; gemma3 resizes every image to one square; Qwen-VL's
    resize to whole merged patches, HF's ``smart_resize``; mllama's prompt holds one token per image)."""
    if arch in QWEN_VL_ARCHS:
        factor = vision.patch_size * vision.pool
        least, most = factor * factor, vision.image_size * vision.image_size
        h, w = round(height / factor) * factor, round(width / factor) * factor
        if h * w > most:
            beta = math.sqrt(height * width / most)
            h, w = (max(factor, math.floor(side / beta / factor) * factor) for side in (height, width))
        elif h * w < least:
            beta = math.sqrt(least / (height * width))
            h, w = (math.ceil(side * beta / factor) * factor for side in (height, width))
        return (h // factor) * (w // factor)
    if arch == "mllama":
        return 1  # one <|image|> token: the image reaches the text by cross-attention (runtime/tiny/mllama.py)
    if arch != "idefics3":
        return vision.tokens_per_image
    tile = vision.image_size
    # 1. The longest edge becomes tile * max_tiles_per_side, the other keeps the aspect ratio, rounded up to even.
    longest, aspect = tile * vision.max_tiles_per_side, width / height
    if width >= height:
        w, h = longest, int(longest / aspect)
        h += h % 2
    else:
        h, w = longest, int(longest * aspect)
        w += w % 2
    h, w = max(h, 1), max(w, 1)
    # 2. Both sides grow to whole tiles (the short one from the aspect ratio of step 1).
    aspect = w / h
    if w >= h:
        w = math.ceil(w / tile) * tile
        h = math.ceil(int(w / aspect) / tile) * tile
    else:
        h = math.ceil(h / tile) * tile
        w = math.ceil(int(h * aspect) / tile) * tile
    # 3. More than one tile: every tile plus a global view; one tile is the image alone.
    if h > tile or w > tile:
        return ((h - tile) // tile + 1) * ((w - tile) // tile + 1) * vision.tokens_per_image + vision.tokens_per_image
    return vision.tokens_per_image


def write_vlm_files(out: Path, spec: TinySpec) -> None:
    """A vision-language checkpoint of ``spec.arch`` (one of ``VLM_ARCHS``) in ``out``."""
    if spec.vision is None:
        raise ValueError(f"{spec.arch} needs a vision spec")
    arch, vision = spec.arch, spec.vision
    info = vlm_arch_info(arch)
    tok = train_tokenizer(info, spec.vocab_size)
    token_id = tok.get_vocab()
    config = _model_config(arch, spec, vision, info, token_id)
    weights = _random_weights(arch, spec, config)

    def dump(name: str, obj: Any) -> None:
        (out / name).write_text(json.dumps(obj, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")

    mx.save_safetensors(str(out / "model.safetensors"), weights, metadata={"format": "mlx"})
    dump("config.json", config)
    dump("generation_config.json", {"bos_token_id": token_id[info.config_bos],
                                    "eos_token_id": [token_id[t] for t in info.stop_tokens],
                                    "pad_token_id": token_id[info.pad], **info.generation_defaults})
    tok.save(str(out / "tokenizer.json"))
    tok_config = tokenizer_config(info, tok, spec)
    if arch in QWEN_VL_ARCHS:
        qwen_vl_tokenizer_extras(tok_config, arch)
    elif arch == "mllama":
        tok_config["processor_class"] = "MllamaProcessor"
    elif arch == "idefics3":
        tok_config["additional_special_tokens"] = ["<fake_token_around_image>", "<image>", "<end_of_utterance>"]
        tok_config["processor_class"] = "Idefics3Processor"
    else:
        # What Gemma3Processor reads as tokenizer.boi_token / image_token / eoi_token (and their ids).
        tok_config["extra_special_tokens"] = {"boi_token": "<start_of_image>", "eoi_token": "<end_of_image>",
                                              "image_token": "<image_soft_token>"}
        tok_config["processor_class"] = "Gemma3Processor"
    dump("tokenizer_config.json", tok_config)
    dump("special_tokens_map.json", special_tokens_map(info))
    if arch in QWEN_VL_ARCHS:
        dump("preprocessor_config.json", qwen_vl_preprocessor_config(arch, vision))
        dump("video_preprocessor_config.json", qwen_vl_video_config(arch, vision))
    elif arch == "mllama":
        dump("preprocessor_config.json", mllama_preprocessor_config(vision))
        dump("processor_config.json", mllama_processor_config())
    else:
        dump("preprocessor_config.json", _preprocessor_config(arch, vision))
        dump("processor_config.json", _processor_config(arch, vision))
    # The real repositories ship the template both ways (older transformers read the .json, newer the .jinja).
    dump("chat_template.json", {"chat_template": info.chat_template})
    (out / "chat_template.jinja").write_text(info.chat_template, encoding="utf-8")
    n_params = sum(v.size for v in weights.values())
    (out / "README.md").write_text(
        f"# {SMOKE_TEST_LABEL}\n\nA `{info.model_type}` vision-language model with random weights "
        f"({n_params:,} parameters, cache key `{spec.cache_key()}`): whatever it says about an image means "
        f"nothing.\n", encoding="utf-8")
