"""The tiny Llama 3.2 Vision (mlx-vlm's ``mllama``; see :mod:`runtime.tiny.vlm`, which writes its files).

What sets it apart from the other vision models, and what this tiny one keeps of it:

* **Images by cross-attention**: the prompt holds one ``<|image|>`` token per image, never the image's features;
  the vision tower's output (every tile's patches and class token, with intermediate layers concatenated) is
  projected to the text width and read by the language model's **cross-attention layers**
  (``cross_attention_layers``) as their keys and values. The processor's ``cross_attention_mask`` says which
  tiles of which image each prompt token may attend to: from an image's token until the next image's.
* **Tiles**: the image processor resizes an image to fit at most ``max_image_tiles`` tiles of ``image_size``
  pixels in one of the supported aspect ratios (1x1 … 4x1) and pads the rest: every image is ``max_image_tiles``
  tiles of ``(image_size / patch_size)**2 + 1`` vision tokens (here 4 x 17), the padding tiles masked.
* **Gates**: the cross-attention layers add their attention and MLP through ``tanh(gate)``; the real
  checkpoints' gates are trained away from zero, and so are these (:data:`GATE`), or the image would not reach
  the text at all. The vision tower's gated layers and embeddings likewise.
* **Sharper attention**: the language model's matrices are drawn at 0.1 (:attr:`ArchInfo.layer_std`), as the
  Qwen-VL ones, so that its greedy output changes when a row's cross-attention states or masks are wrong.

Config keys as meta-llama/Llama-3.2-11B-Vision-Instruct writes them; its chat template (images and text as
content parts, no system message beside images).
"""

from __future__ import annotations

from typing import Any

from runtime.tiny.archs import ARCHS, ArchInfo
from runtime.tiny.spec import TinySpec, VisionSpec, size_fields

MAX_TILES = 4
ASPECT_RATIOS = [[1, 1], [1, 2], [1, 3], [1, 4], [2, 1], [2, 2], [3, 1], [4, 1]]
GATE = 1.0  # every gate of the tiny model (tanh(1) = 0.76): the image reaches the text, the tiles their embeddings
# The CLIP statistics the real image processor normalises with.
_CLIP_MEAN = [0.48145466, 0.4578275, 0.40821073]
_CLIP_STD = [0.26862954, 0.26130258, 0.27577711]

# meta-llama/Llama-3.2-11B-Vision-Instruct's chat template (its tool-calling branches left out: the tiny model is
# served for images, and flow's family for it delivers no tools through the template).
MLLAMA_TEMPLATE = r"""{{- bos_token }}
{%- if not date_string is defined %}
    {%- set date_string = "26 Jul 2024" %}
{%- endif %}

{#- This block extracts the system message, so we can slot it into the right place. #}
{%- if messages[0]['role'] == 'system' %}
    {%- if messages[0]['content'] is string %}
        {%- set system_message = messages[0]['content']|trim %}
    {%- else %}
        {%- set system_message = messages[0]['content'][0]['text']|trim %}
    {%- endif %}
    {%- set messages = messages[1:] %}
{%- else %}
    {%- set system_message = "" %}
{%- endif %}

{#- Find out if there are any images #}
{% set image_ns = namespace(has_images=false) %}
{%- for message in messages %}
    {%- if message['content'] is not string %}
    {%- for content in message['content'] %}
        {%- if content['type'] == 'image' %}
            {%- set image_ns.has_images = true %}
        {%- endif %}
    {%- endfor %}
    {%- endif %}
{%- endfor %}

{#- Error out if there are images and system message #}
{%- if image_ns.has_images and not system_message == "" %}
    {{- raise_exception("Prompting with images is incompatible with system messages.") }}
{%- endif %}

{#- System message if there are no images #}
{%- if not image_ns.has_images %}
    {{- "<|start_header_id|>system<|end_header_id|>\n\n" }}
    {{- "Cutting Knowledge Date: December 2023\n" }}
    {{- "Today Date: " + date_string + "\n\n" }}
    {{- system_message }}
    {{- "<|eot_id|>" }}
{%- endif %}

{%- for message in messages %}
    {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n' }}
    {%- if message['content'] is string %}
        {{- message['content'] }}
    {%- else %}
        {%- for content in message['content'] %}
            {%- if content['type'] == 'image' %}
                {{- '<|image|>' }}
            {%- elif content['type'] == 'text' %}
                {{- content['text'] }}
            {%- endif %}
        {%- endfor %}
    {%- endif %}
    {{- '<|eot_id|>' }}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|start_header_id|>assistant<|end_header_id|>\n\n' }}
{%- endif %}
"""


def mllama_info() -> ArchInfo:
    """Llama 3's specials, the image token after them (id 128256 in the real vocabulary, past the text's)."""
    from dataclasses import replace

    llama = ARCHS["llama"]
    return replace(llama, model_type="mllama", architecture="MllamaForConditionalGeneration",
                   special=(*llama.special, "<|image|>"), chat_template=MLLAMA_TEMPLATE,
                   generation_defaults={"do_sample": True, "temperature": 0.6, "top_p": 0.9},
                   layer_std=0.1, module="", fields=None)


def cross_attention_layers(spec: TinySpec) -> list[int]:
    """Every other layer from the second on (the real 40 layers: 3, 8, 13, …; here 1 of 3)."""
    return list(range(1, spec.num_layers, 2))


def mllama_model_config(spec: TinySpec, vision: VisionSpec, info: ArchInfo,
                        token_id: dict[str, int]) -> dict[str, Any]:
    """config.json as the real checkpoint writes it (without flow's smoke-test markers)."""
    intermediate = [0] if vision.num_layers > 1 else []
    text = {**size_fields(spec), "model_type": "mllama_text_model", "hidden_act": "silu", "rms_norm_eps": 1e-5,
            "rope_theta": 500000.0, "rope_scaling": {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                                     "original_max_position_embeddings": 8192,
                                                     "rope_type": "llama3"},
            "cross_attention_layers": cross_attention_layers(spec), "tie_word_embeddings": False,
            "bos_token_id": token_id[info.config_bos], "eos_token_id": [token_id[t] for t in info.config_eos],
            "pad_token_id": token_id[info.pad], "initializer_range": 0.02}
    text.pop("head_dim", None)  # mllama's text config has none: hidden_size / num_attention_heads
    vision_config = {"model_type": "mllama_vision_model", "hidden_size": vision.hidden_size,
                     "intermediate_size": vision.intermediate_size, "num_hidden_layers": vision.num_layers,
                     "num_global_layers": 1, "num_attention_heads": vision.num_heads,
                     "image_size": vision.image_size, "patch_size": vision.patch_size, "num_channels": 3,
                     "max_num_tiles": MAX_TILES,
                     "supported_aspect_ratios": ASPECT_RATIOS, "norm_eps": 1e-5,
                     "intermediate_layers_indices": intermediate,
                     "vision_output_dim": vision.hidden_size * (1 + len(intermediate))}
    return {"architectures": [info.architecture], "model_type": "mllama",
            "image_token_index": token_id["<|image|>"], "text_config": text, "vision_config": vision_config,
            "torch_dtype": spec.dtype}


def mllama_preprocessor_config(vision: VisionSpec) -> dict[str, Any]:
    """preprocessor_config.json: tiles of ``image_size`` pixels, at most :data:`MAX_TILES` of them."""
    return {"do_convert_rgb": True, "do_normalize": True, "do_pad": True, "do_rescale": True, "do_resize": True,
            "image_mean": _CLIP_MEAN, "image_std": _CLIP_STD, "rescale_factor": 1 / 255, "resample": 2,
            "max_image_tiles": MAX_TILES, "size": {"height": vision.image_size, "width": vision.image_size},
            "image_processor_type": "MllamaImageProcessor", "processor_class": "MllamaProcessor"}


def mllama_processor_config() -> dict[str, Any]:
    return {"processor_class": "MllamaProcessor"}
