"""Tiny random-weight models of real mlx-lm architectures, built offline.

Theory of operation
-------------------
Tests, demos and benchmarks need models without a network or a model hub, so
this module writes a complete Hugging Face style checkpoint directory that
``mlx_lm.load(path)`` reads like any downloaded model:

* **weights**: the real mlx-lm model class (``qwen3``, ``llama`` or
  ``gemma3_text``) is instantiated from the same config dict that goes into
  ``config.json``; every matrix is then re-drawn from N(0, 0.02) (the HF
  ``initializer_range``) with keys derived from ``spec.seed`` only, so a build
  is byte-for-byte deterministic. qwen3 and llama keep a separate ``lm_head``:
  with tied embeddings a random model mostly repeats its last input token.
* **tokenizer**: a byte-level BPE (Llama-3 style split regex + ByteLevel
  pre-tokenizer and decoder, so any UTF-8 round-trips) trained with the
  ``tokenizers`` library on a corpus embedded below, padded with
  deterministic pseudo-words so it can reach the requested vocabulary size.
  Each architecture gets its real special tokens and a chat template shaped
  like the real model's; any shortfall in the vocabulary is filled with
  reserved special tokens (Llama 3 and Gemma do the same).
* **marker**: ``config.json`` carries ``"flow_smoke_test": true`` and a
  README says the output is gibberish, so nobody mistakes it for a real model.

A build is staged in a temporary directory next to its destination and
renamed into place, so a crash never leaves half a model. ``ensure_tiny_model``
caches builds under ``$FLOW_CACHE_DIR`` (or ``~/.cache/flow``) keyed by a hash
of the spec; when two processes race, the first rename wins and the loser
discards its copy.
"""

from __future__ import annotations

import hashlib
import importlib
import json
import os
import random
import shutil
import tempfile
import uuid
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any, Literal, get_args

import mlx.core as mx
from mlx.utils import tree_flatten
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, processors, trainers

from runtime.tiny.archs import FAMILY_ARCHS, ArchInfo, qwen3_next_fields
from runtime.tiny.vlm import VLM_ARCHS, VisionSpec

Arch = Literal["qwen3", "llama", "gemma3", "bert", "modernbert", "gpt_oss", "deepseek_v3", "kimi_k2", "minimax",
               "seed_oss", "qwen3_5", "gemma4", "phi3", "granite", "granitemoehybrid", "llama4_text", "hermes3",
               "minicpm5", "deepseek_r1", "qwen3_next", "whisper", "soprano", "idefics3", "gemma3_vision", "qwen2",
               "qwen3_tts"]
DType = Literal["float32", "bfloat16", "float16"]

# Bump when the bytes a spec builds change, so cached builds are not reused.
BUILDER_VERSION = 1

SMOKE_TEST_LABEL = "flow-smoke-test (random weights; output is gibberish)"

_INIT_STD = 0.02
_MIN_VOCAB = 512  # 256 byte tokens + specials + some merges


@dataclass(frozen=True)
class TinySpec:
    """Everything that determines a tiny model's files."""

    arch: Arch = "qwen3"
    hidden_size: int = 64
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int = 2
    intermediate_size: int = 128
    vocab_size: int = 1024  # BPE vocab size target (special tokens included)
    max_position_embeddings: int = 4096
    seed: int = 0
    dtype: DType = "float32"
    sliding_window: int = 512  # gemma3: the window of its sliding-window layers
    embedding: bool = False  # qwen3: a bare Qwen3Model (no language-model head), as embedding models ship
    vision: VisionSpec | None = None  # idefics3, gemma3_vision: the vision tower (runtime/tiny_vlm.py)
    mtp_layers: int = 0  # qwen3_5: multi-token-prediction layers in the safetensors (``mtp.*``, as Qwen ships them)

    def __post_init__(self) -> None:
        if self.arch not in get_args(Arch):
            raise ValueError(f"unknown arch {self.arch!r}; expected one of {get_args(Arch)}")
        if self.dtype not in get_args(DType):
            raise ValueError(f"unsupported dtype {self.dtype!r}")
        sizes = (self.hidden_size, self.num_layers, self.num_heads, self.num_kv_heads, self.intermediate_size)
        if min(*sizes, self.max_position_embeddings) < 1:
            raise ValueError("model sizes must be positive")
        if self.hidden_size % self.num_heads:
            raise ValueError("hidden_size must be a multiple of num_heads")
        if self.num_heads % self.num_kv_heads:
            raise ValueError("num_heads must be a multiple of num_kv_heads")
        if self.vocab_size < _MIN_VOCAB:
            raise ValueError(f"vocab_size must be at least {_MIN_VOCAB}")
        if (self.arch in VLM_ARCHS) != (self.vision is not None):
            raise ValueError("a vision spec goes with a vision arch, and only with one")
        if self.mtp_layers and self.arch != "qwen3_5":
            raise ValueError("mtp_layers is a qwen3_5 setting")

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    def cache_key(self) -> str:
        """A short hash of every field and the builder version."""
        fields = asdict(self)
        if fields["sliding_window"] == 512:
            del fields["sliding_window"]  # added later: builds from before keep their keys
        if not fields["embedding"]:
            del fields["embedding"]
        if fields["vision"] is None:
            del fields["vision"]
        if not fields["mtp_layers"]:
            del fields["mtp_layers"]  # added later: builds without it keep their keys
        payload = json.dumps({"builder": BUILDER_VERSION, **fields}, sort_keys=True)
        return hashlib.sha256(payload.encode()).hexdigest()[:12]


PRESETS: dict[str, TinySpec] = {
    "tiny-qwen3": TinySpec(),
    "tiny-llama": TinySpec(arch="llama"),
    "tiny-gemma3": TinySpec(arch="gemma3"),
    # The model families' architectures (runtime/tiny_archs.py), with their real chat templates.
    "tiny-gpt-oss": TinySpec(arch="gpt_oss", intermediate_size=64),
    "tiny-deepseek-v3": TinySpec(arch="deepseek_v3", intermediate_size=64),
    "tiny-deepseek-r1": TinySpec(arch="deepseek_r1", intermediate_size=64),
    "tiny-kimi-k2": TinySpec(arch="kimi_k2", intermediate_size=64),
    "tiny-minimax-m2": TinySpec(arch="minimax", intermediate_size=64),
    "tiny-seed-oss": TinySpec(arch="seed_oss", intermediate_size=64),
    "tiny-qwen3.5": TinySpec(arch="qwen3_5", intermediate_size=64),
    # Qwen3.5 with its MTP layer in the safetensors, as Qwen ships it (speculative kind "mtp").
    "tiny-qwen3.5-mtp": TinySpec(arch="qwen3_5", intermediate_size=64, mtp_layers=1),
    "tiny-qwen3-next": TinySpec(arch="qwen3_next", intermediate_size=64),
    # Qwen2 / Qwen2.5: in mlx-lm both tensor and pipeline parallel (runtime.distributed).
    "tiny-qwen2": TinySpec(arch="qwen2"),
    "tiny-gemma4": TinySpec(arch="gemma4", intermediate_size=64),
    "tiny-phi4-mini": TinySpec(arch="phi3", intermediate_size=64),
    "tiny-granite3": TinySpec(arch="granite", intermediate_size=64),
    "tiny-granite4": TinySpec(arch="granitemoehybrid", intermediate_size=64),
    "tiny-llama4": TinySpec(arch="llama4_text", intermediate_size=64),
    "tiny-hermes3": TinySpec(arch="hermes3", intermediate_size=64),
    "tiny-minicpm5": TinySpec(arch="minicpm5", intermediate_size=64),
    # Embedding models (mlx-embeddings): an encoder with a WordPiece tokenizer, and a decoder-style one.
    "tiny-bert": TinySpec(arch="bert", hidden_size=32, num_heads=2, num_kv_heads=2, intermediate_size=128,
                          vocab_size=1000, max_position_embeddings=512),
    "tiny-qwen3-embedding": TinySpec(embedding=True),
    # Speech to text (mlx-audio): a multilingual Whisper layout (runtime/tiny_audio.py).
    "tiny-whisper": TinySpec(arch="whisper", hidden_size=64, num_heads=2, num_kv_heads=2, intermediate_size=256),
    # Text to speech (mlx-audio): a Soprano (Qwen3 language model + Vocos decoder) (runtime/tiny_audio.py).
    "tiny-soprano": TinySpec(arch="soprano", vocab_size=600),
    # Text to speech that batches requests: a Qwen3-TTS CustomVoice (talker, code predictor, 12 Hz codec decoder).
    "tiny-qwen3-tts": TinySpec(arch="qwen3_tts", vocab_size=600),
    "tiny-reranker": TinySpec(arch="modernbert", hidden_size=32, num_heads=2, num_kv_heads=2, intermediate_size=64,
                              vocab_size=1000, max_position_embeddings=512),
    # Vision-language models (mlx-vlm), runtime/tiny_vlm.py. SmolVLM: 16 image tokens per 64 px tile, an image
    # split into at most 2x2 tiles plus a global view (80 tokens; 48 for a wide strip).
    "tiny-smolvlm": TinySpec(arch="idefics3", vision=VisionSpec()),
    # Gemma 3: every image is 16 soft tokens; a 32-token window on the sliding layer, so a prompt with an image
    # already wraps the rotating cache.
    "tiny-gemma3-vision": TinySpec(arch="gemma3_vision", sliding_window=32, vision=VisionSpec()),
    # A vision tower that costs real time on a CPU: SigLIP-B/14-224's width at half its depth (256 patches, 6
    # layers of 768, ~43M parameters; real VLMs' towers are larger still), 64 tokens per image.
    "bench-vlm": TinySpec(arch="gemma3_vision", hidden_size=384, num_layers=4, num_heads=6, num_kv_heads=2,
                          intermediate_size=1024, vocab_size=4096, vision=VisionSpec(
                              hidden_size=768, num_layers=6, num_heads=12, intermediate_size=3072, image_size=224,
                              patch_size=14, tokens_per_image=64)),
    # ~88M parameters (untied lm_head): big enough that decode speed means something.
    "bench-80m": TinySpec(
        arch="qwen3",
        hidden_size=768,
        num_layers=12,
        num_heads=12,
        num_kv_heads=4,
        intermediate_size=2048,
        vocab_size=8192,
        max_position_embeddings=32768,
        dtype="float32",
    ),
}


# ---------------------------------------------------------------------------
# Chat templates: the real models' templates (raw strings, so the Jinja source
# keeps its '\n' escapes exactly like tokenizer_config.json files do).

_QWEN3_TEMPLATE = r"""{%- if tools %}
    {{- '<|im_start|>system\n' }}
    {%- if messages[0].role == 'system' %}
        {{- messages[0].content + '\n\n' }}
    {%- endif %}
    {{- "# Tools\n\nYou may call one or more functions to assist with the user query.\n\nYou are provided with function signatures within <tools></tools> XML tags:\n<tools>" }}
    {%- for tool in tools %}
        {{- "\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\n</tools>\n\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": <args-json-object>}\n</tool_call><|im_end|>\n" }}
{%- else %}
    {%- if messages[0].role == 'system' %}
        {{- '<|im_start|>system\n' + messages[0].content + '<|im_end|>\n' }}
    {%- endif %}
{%- endif %}
{%- set ns = namespace(multi_step_tool=true, last_query_index=messages|length - 1) %}
{%- for message in messages[::-1] %}
    {%- set index = (messages|length - 1) - loop.index0 %}
    {%- if ns.multi_step_tool and message.role == "user" and message.content is string and not(message.content.startswith('<tool_response>') and message.content.endswith('</tool_response>')) %}
        {%- set ns.multi_step_tool = false %}
        {%- set ns.last_query_index = index %}
    {%- endif %}
{%- endfor %}
{%- for message in messages %}
    {%- if message.content is string %}
        {%- set content = message.content %}
    {%- else %}
        {%- set content = '' %}
    {%- endif %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) %}
        {{- '<|im_start|>' + message.role + '\n' + content + '<|im_end|>' + '\n' }}
    {%- elif message.role == "assistant" %}
        {%- set reasoning_content = '' %}
        {%- if message.reasoning_content is string %}
            {%- set reasoning_content = message.reasoning_content %}
        {%- else %}
            {%- if '</think>' in content %}
                {%- set reasoning_content = content.split('</think>')[0].rstrip('\n').split('<think>')[-1].lstrip('\n') %}
                {%- set content = content.split('</think>')[-1].lstrip('\n') %}
            {%- endif %}
        {%- endif %}
        {%- if loop.index0 > ns.last_query_index %}
            {%- if loop.last or (not loop.last and reasoning_content) %}
                {{- '<|im_start|>' + message.role + '\n<think>\n' + reasoning_content.strip('\n') + '\n</think>\n\n' + content.lstrip('\n') }}
            {%- else %}
                {{- '<|im_start|>' + message.role + '\n' + content }}
            {%- endif %}
        {%- else %}
            {{- '<|im_start|>' + message.role + '\n' + content }}
        {%- endif %}
        {%- if message.tool_calls %}
            {%- for tool_call in message.tool_calls %}
                {%- if (loop.first and content) or (not loop.first) %}
                    {{- '\n' }}
                {%- endif %}
                {%- if tool_call.function %}
                    {%- set tool_call = tool_call.function %}
                {%- endif %}
                {{- '<tool_call>\n{"name": "' }}
                {{- tool_call.name }}
                {{- '", "arguments": ' }}
                {%- if tool_call.arguments is string %}
                    {{- tool_call.arguments }}
                {%- else %}
                    {{- tool_call.arguments | tojson }}
                {%- endif %}
                {{- '}\n</tool_call>' }}
            {%- endfor %}
        {%- endif %}
        {{- '<|im_end|>\n' }}
    {%- elif message.role == "tool" %}
        {%- if loop.first or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\n<tool_response>\n' }}
        {{- content }}
        {{- '\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\n' }}
    {%- if enable_thinking is defined and enable_thinking is false %}
        {{- '<think>\n\n</think>\n\n' }}
    {%- endif %}
{%- endif %}"""

# Llama 3.1's template, quirks included: tools go into the first user turn by
# default, a tool result that is a string is still passed through tojson
# (strings are iterable), and only one tool call per assistant turn is allowed.
_LLAMA_TEMPLATE = r"""{{- bos_token }}
{%- if custom_tools is defined %}
    {%- set tools = custom_tools %}
{%- endif %}
{%- if not tools_in_user_message is defined %}
    {%- set tools_in_user_message = true %}
{%- endif %}
{%- if not date_string is defined %}
    {%- set date_string = "26 Jul 2024" %}
{%- endif %}
{%- if not tools is defined %}
    {%- set tools = none %}
{%- endif %}

{#- This block extracts the system message, so we can slot it into the right place. #}
{%- if messages[0]['role'] == 'system' %}
    {%- set system_message = messages[0]['content']|trim %}
    {%- set messages = messages[1:] %}
{%- else %}
    {%- set system_message = "" %}
{%- endif %}

{#- System message + builtin tools #}
{{- "<|start_header_id|>system<|end_header_id|>\n\n" }}
{%- if builtin_tools is defined or tools is not none %}
    {{- "Environment: ipython\n" }}
{%- endif %}
{%- if builtin_tools is defined %}
    {{- "Tools: " + builtin_tools | reject('equalto', 'code_interpreter') | join(", ") + "\n\n"}}
{%- endif %}
{{- "Cutting Knowledge Date: December 2023\n" }}
{{- "Today Date: " + date_string + "\n\n" }}
{%- if tools is not none and not tools_in_user_message %}
    {{- "You have access to the following functions. To call a function, please respond with JSON for a function call." }}
    {{- 'Respond in the format {"name": function name, "parameters": dictionary of argument name and its value}.' }}
    {{- "Do not use variables.\n\n" }}
    {%- for t in tools %}
        {{- t | tojson(indent=4) }}
        {{- "\n\n" }}
    {%- endfor %}
{%- endif %}
{{- system_message }}
{{- "<|eot_id|>" }}

{#- Custom tools are passed in a user message with some extra guidance #}
{%- if tools_in_user_message and not tools is none %}
    {#- Extract the first user message so we can plug it in here #}
    {%- if messages | length != 0 %}
        {%- set first_user_message = messages[0]['content']|trim %}
        {%- set messages = messages[1:] %}
    {%- else %}
        {{- raise_exception("Cannot put tools in the first user message when there's no first user message!") }}
    {%- endif %}
    {{- '<|start_header_id|>user<|end_header_id|>\n\n' -}}
    {{- "Given the following functions, please respond with a JSON for a function call " }}
    {{- "with its proper arguments that best answers the given prompt.\n\n" }}
    {{- 'Respond in the format {"name": function name, "parameters": dictionary of argument name and its value}.' }}
    {{- "Do not use variables.\n\n" }}
    {%- for t in tools %}
        {{- t | tojson(indent=4) }}
        {{- "\n\n" }}
    {%- endfor %}
    {{- first_user_message + "<|eot_id|>"}}
{%- endif %}

{%- for message in messages %}
    {%- if not (message.role == 'ipython' or message.role == 'tool' or 'tool_calls' in message) %}
        {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'+ message['content'] | trim + '<|eot_id|>' }}
    {%- elif 'tool_calls' in message %}
        {%- if not message.tool_calls|length == 1 %}
            {{- raise_exception("This model only supports single tool-calls at once!") }}
        {%- endif %}
        {%- set tool_call = message.tool_calls[0].function %}
        {%- if builtin_tools is defined and tool_call.name in builtin_tools %}
            {{- '<|start_header_id|>assistant<|end_header_id|>\n\n' -}}
            {{- "<|python_tag|>" + tool_call.name + ".call(" }}
            {%- for arg_name, arg_val in tool_call.arguments | items %}
                {{- arg_name + '="' + arg_val + '"' }}
                {%- if not loop.last %}
                    {{- ", " }}
                {%- endif %}
            {%- endfor %}
            {{- ")" }}
        {%- else  %}
            {{- '<|start_header_id|>assistant<|end_header_id|>\n\n' -}}
            {{- '{"name": "' + tool_call.name + '", ' }}
            {{- '"parameters": ' }}
            {{- tool_call.arguments | tojson }}
            {{- "}" }}
        {%- endif %}
        {%- if builtin_tools is defined %}
            {#- This means we're in ipython mode #}
            {{- "<|eom_id|>" }}
        {%- else %}
            {{- "<|eot_id|>" }}
        {%- endif %}
    {%- elif message.role == "tool" or message.role == "ipython" %}
        {{- "<|start_header_id|>ipython<|end_header_id|>\n\n" }}
        {%- if message.content is mapping or message.content is iterable %}
            {{- message.content | tojson }}
        {%- else %}
            {{- message.content }}
        {%- endif %}
        {{- "<|eot_id|>" }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|start_header_id|>assistant<|end_header_id|>\n\n' }}
{%- endif %}
"""

# Gemma 3's template: no system role (it is folded into the first user turn),
# "assistant" is rendered as "model", strict user/model alternation, no tools.
_GEMMA3_TEMPLATE = r"""{{ bos_token }}
{%- if messages[0]['role'] == 'system' -%}
    {%- if messages[0]['content'] is string -%}
        {%- set first_user_prefix = messages[0]['content'] + '\n\n' -%}
    {%- else -%}
        {%- set first_user_prefix = messages[0]['content'][0]['text'] + '\n\n' -%}
    {%- endif -%}
    {%- set loop_messages = messages[1:] -%}
{%- else -%}
    {%- set first_user_prefix = "" -%}
    {%- set loop_messages = messages -%}
{%- endif -%}
{%- for message in loop_messages -%}
    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}
        {{ raise_exception("Conversation roles must alternate user/assistant/user/assistant/...") }}
    {%- endif -%}
    {%- if (message['role'] == 'assistant') -%}
        {%- set role = "model" -%}
    {%- else -%}
        {%- set role = message['role'] -%}
    {%- endif -%}
    {{ '<start_of_turn>' + role + '\n' + (first_user_prefix if loop.first else "") }}
    {%- if message['content'] is string -%}
        {{ message['content'] | trim }}
    {%- elif message['content'] is iterable -%}
        {%- for item in message['content'] -%}
            {%- if item['type'] == 'image' -%}
                {{ '<start_of_image>' }}
            {%- elif item['type'] == 'text' -%}
                {{ item['text'] | trim }}
            {%- endif -%}
        {%- endfor -%}
    {%- else -%}
        {{ raise_exception("Invalid content type") }}
    {%- endif -%}
    {{ '<end_of_turn>\n' }}
{%- endfor -%}
{%- if add_generation_prompt -%}
    {{'<start_of_turn>model\n'}}
{%- endif -%}
"""


_ARCHS: dict[str, ArchInfo] = {
    "qwen3": ArchInfo(
        model_type="qwen3",
        architecture="Qwen3ForCausalLM",
        special=("<|endoftext|>", "<|im_start|>", "<|im_end|>"),
        added=("<think>", "</think>", "<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"),
        reserved_fmt="<|extra_{}|>",
        bos=None,
        eos="<|im_end|>",
        pad="<|endoftext|>",
        unk=None,
        prepend_bos=False,
        config_bos="<|endoftext|>",
        config_eos=("<|im_end|>",),
        stop_tokens=("<|im_end|>", "<|endoftext|>"),
        tie_embeddings=False,
        chat_template=_QWEN3_TEMPLATE,
        generation_defaults={"do_sample": True, "temperature": 0.6, "top_k": 20, "top_p": 0.95},
    ),
    "llama": ArchInfo(
        model_type="llama",
        architecture="LlamaForCausalLM",
        special=(
            "<|begin_of_text|>",
            "<|end_of_text|>",
            "<|finetune_right_pad_id|>",
            "<|start_header_id|>",
            "<|end_header_id|>",
            "<|eom_id|>",
            "<|eot_id|>",
            "<|python_tag|>",
        ),
        added=(),
        reserved_fmt="<|reserved_special_token_{}|>",
        bos="<|begin_of_text|>",
        eos="<|eot_id|>",
        pad="<|finetune_right_pad_id|>",
        unk=None,
        prepend_bos=True,
        config_bos="<|begin_of_text|>",
        config_eos=("<|end_of_text|>", "<|eom_id|>", "<|eot_id|>"),
        stop_tokens=("<|end_of_text|>", "<|eom_id|>", "<|eot_id|>"),
        tie_embeddings=False,
        chat_template=_LLAMA_TEMPLATE,
        generation_defaults={"do_sample": True, "temperature": 0.6, "top_p": 0.9},
    ),
    "gemma3": ArchInfo(
        model_type="gemma3_text",
        architecture="Gemma3ForCausalLM",
        # Same order as the real vocab for the first four (pad=0, eos=1, bos=2, unk=3).
        special=("<pad>", "<eos>", "<bos>", "<unk>", "<start_of_turn>", "<end_of_turn>"),
        added=(),
        reserved_fmt="<unused{}>",
        bos="<bos>",
        eos="<end_of_turn>",
        pad="<pad>",
        unk="<unk>",
        prepend_bos=True,
        config_bos="<bos>",
        config_eos=("<eos>", "<end_of_turn>"),
        stop_tokens=("<eos>", "<end_of_turn>"),
        # mlx-lm's gemma3_text ties the head whenever lm_head.weight is absent.
        tie_embeddings=True,
        chat_template=_GEMMA3_TEMPLATE,
        generation_defaults={"do_sample": True, "top_k": 64, "top_p": 0.95},
    ),
}

_ARCHS.update(FAMILY_ARCHS)
# Qwen/Qwen3-Next: Qwen3's vocabulary and template (the Instruct model's is Qwen3's, thinking parts aside) on
# the hybrid architecture.
_ARCHS["qwen3_next"] = replace(_ARCHS["qwen3"], model_type="qwen3_next", architecture="Qwen3NextForCausalLM",
                               module="qwen3_next", fields=qwen3_next_fields)
# Qwen/Qwen2.5: Qwen3's vocabulary and ChatML template (its tools branch is Qwen2.5's) on the Qwen2 layers
# (biased q/k/v projections, no q/k norms).
_ARCHS["qwen2"] = replace(_ARCHS["qwen3"], model_type="qwen2", architecture="Qwen2ForCausalLM", module="qwen2",
                          fields=lambda layers: {"hidden_act": "silu", "rms_norm_eps": 1e-6, "rope_theta": 1_000_000.0,
                                                 "rope_scaling": None, "sliding_window": None,
                                                 "use_sliding_window": False, "max_window_layers": layers})

# ---------------------------------------------------------------------------
# Tokenizer

# Varied text so common English, code, JSON and non-ASCII pieces get merges.
_CORPUS = r"""
The quick brown fox jumps over the lazy dog. A journey of a thousand miles begins with a single step.
It was a bright cold day in April, and the clocks were striking thirteen. The weather today is sunny
with a high of 23 degrees and a light breeze from the west. Please remember to bring an umbrella tomorrow.
Hello, world! How are you doing today? I'm fine, thanks for asking. What's the plan for the weekend?
We'll meet at the café near the station at 10:30 and then walk to the museum. Don't forget the tickets.
The committee reviewed the proposal and agreed that the budget should be increased by 15% next year.
Machine learning models learn patterns from data; large language models predict the next token.
The assistant answered the user's question politely, explained the reasoning, and cited its sources.
You are a helpful assistant. Answer the question concisely. If you don't know the answer, say so.
System: be brief. User: what is the capital of France? Assistant: The capital of France is Paris.
Once upon a time there was a little robot who wanted to learn how to paint the ocean at sunset.
She opened the window, listened to the rain, and wrote three pages before the kettle began to whistle.
Numbers: 0 1 2 3 4 5 6 7 8 9 10 11 12 42 100 256 1024 2048 4096 65536 3.14159 2.71828 -17 1e-6 0.02
Dates and times: 2024-07-26, 12/31/1999, 09:15:00 UTC, Monday, Tuesday, Wednesday, January, February.
Money and units: $19.99, €5.50, £3, ¥1200, 5 km, 12 kg, 37.5 °C, 60 mph, 8 GB of RAM, 2.4 GHz.

def fibonacci(n: int) -> int:
    if n < 2:
        return n
    return fibonacci(n - 1) + fibonacci(n - 2)

class Stack:
    def __init__(self) -> None:
        self.items: list[int] = []

    def push(self, item: int) -> None:
        self.items.append(item)

    def pop(self) -> int:
        return self.items.pop()

for i in range(10):
    print(f"value = {i * i}")

import json
with open("config.json", "r", encoding="utf-8") as f:
    config = json.load(f)

function add(a, b) { return a + b; }
const result = await fetch("https://example.com/api/v1/items?limit=10");
if (result.status !== 200) { throw new Error("request failed"); }
SELECT id, name, created_at FROM users WHERE active = 1 ORDER BY created_at DESC LIMIT 20;
#include <stdio.h>
int main(void) { printf("hello\n"); return 0; }
fn main() { let v: Vec<u32> = (0..10).collect(); println!("{:?}", v); }

{"name": "get_weather", "arguments": {"location": "Paris", "unit": "celsius"}}
{"type": "function", "function": {"name": "search", "description": "Search the web", "parameters": {"type": "object", "properties": {"query": {"type": "string"}}, "required": ["query"]}}}
{"id": 7, "tags": ["alpha", "beta"], "score": 0.875, "ok": true, "next": null}
[1, 2, 3, {"key": "value"}, "text", false]
<tool_call>
{"name": "lookup", "arguments": {"id": 42}}
</tool_call>
<think>
The user wants a short answer, so I should keep it to one sentence.
</think>

Café, naïve, résumé, façade, jalapeño, München, Zürich, São Paulo, Kraków, Ελληνικά, русский язык.
日本語のテキストも少し含めます。東京は日本の首都です。こんにちは、世界！
中文：你好，世界。今天天气很好。我们去公园散步吧。
한국어: 안녕하세요, 만나서 반갑습니다.
العربية: مرحبا بالعالم. हिन्दी: नमस्ते दुनिया।
Emoji: 🎉 😀 🚀 ❤️ 👍 🔥 ✨ 🌍 🤖 ☕ — “quotes”, ‘single’, ellipsis… and bullets • here.
Math: ∑ x² + √y ≤ ∞, α β γ δ π λ, 3 × 4 = 12, 10 ÷ 2 = 5, ±1, ≠, ≈.
"""

# Llama 3's split regex: words, 1-3 digit number groups, punctuation runs, whitespace.
_SPLIT_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

_ONSETS = ("", *"b c d f g h k l m n p r s t v w z st tr ch sh pl gr".split())
_VOWELS = ("a", "e", "i", "o", "u", "ai", "ou", "ea")
_CODAS = ("", "", "", "n", "r", "s", "t", "l", "m", "ng", "ck")


def _pseudo_text(n_words: int) -> list[str]:
    """Deterministic word-like filler so BPE has enough distinct pairs to merge."""
    rng = random.Random(0x71A7)  # fixed: the tokenizer must not depend on spec.seed
    lines: list[str] = []
    words: list[str] = []
    for _ in range(n_words):
        syllables = rng.randint(1, 4)
        word = "".join(rng.choice(_ONSETS) + rng.choice(_VOWELS) + rng.choice(_CODAS) for _ in range(syllables))
        if rng.random() < 0.15:
            word = word.capitalize()
        words.append(word)
        if len(words) == 12:
            lines.append(" ".join(words) + rng.choice((".", ",", "!", "?", ";", ":")))
            words = []
    if words:
        lines.append(" ".join(words))
    return lines


def _train_tokenizer(info: ArchInfo, vocab_size: int) -> Tokenizer:
    """Byte-level BPE with exactly ``vocab_size`` tokens and the arch's specials."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(_SPLIT_PATTERN), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size - len(info.added),
        special_tokens=[AddedToken(t, special=True, normalized=False) for t in info.special],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    corpus = _CORPUS.splitlines() + _pseudo_text(n_words=vocab_size * 3)
    tok.train_from_iterator(corpus, trainer=trainer)
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in info.added])
    shortfall = vocab_size - tok.get_vocab_size()
    if shortfall > 0:
        tok.add_special_tokens(
            [AddedToken(info.reserved_fmt.format(i), special=True, normalized=False) for i in range(shortfall)]
        )
    if info.prepend_bos:
        assert info.bos is not None
        bos_id = tok.token_to_id(info.bos)
        tok.post_processor = processors.TemplateProcessing(
            single=f"{info.bos} $A", pair=f"{info.bos} $A {info.bos}:1 $B:1", special_tokens=[(info.bos, bos_id)]
        )
    else:
        tok.post_processor = processors.ByteLevel(trim_offsets=False)
    if tok.get_vocab_size() != vocab_size:
        raise RuntimeError(f"tokenizer has {tok.get_vocab_size()} tokens, expected {vocab_size}")
    return tok


def _token_entry(content: str) -> dict[str, Any]:
    return {"content": content, "lstrip": False, "normalized": False, "rstrip": False, "single_word": False}


def _tokenizer_config(info: ArchInfo, tok: Tokenizer, spec: TinySpec) -> dict[str, Any]:
    decoder = {
        str(i): {**_token_entry(t.content), "special": t.special}
        for i, t in sorted(tok.get_added_tokens_decoder().items())
    }
    return {
        "added_tokens_decoder": decoder,
        "bos_token": info.bos,
        "eos_token": info.eos,
        "pad_token": info.pad,
        "unk_token": info.unk,
        "chat_template": ([{"name": name, "template": text} for name, text in info.named_templates]
                          if info.named_templates else info.chat_template),
        "clean_up_tokenization_spaces": False,
        "model_max_length": spec.max_position_embeddings,
        "split_special_tokens": False,
        # The generic fast class loads tokenizer.json as-is, offline, on any transformers.
        "tokenizer_class": "PreTrainedTokenizerFast",
    }


def _special_tokens_map(info: ArchInfo) -> dict[str, Any]:
    roles = {"bos_token": info.bos, "eos_token": info.eos, "pad_token": info.pad, "unk_token": info.unk}
    return {role: _token_entry(t) for role, t in roles.items() if t is not None}


# ---------------------------------------------------------------------------
# Model



def size_fields(spec: TinySpec) -> dict[str, Any]:
    """A config's size fields, as every transformer config writes them."""
    return {"hidden_size": spec.hidden_size, "intermediate_size": spec.intermediate_size,
            "num_hidden_layers": spec.num_layers, "num_attention_heads": spec.num_heads,
            "num_key_value_heads": spec.num_kv_heads, "head_dim": spec.head_dim, "vocab_size": spec.vocab_size,
            "max_position_embeddings": spec.max_position_embeddings}

def _model_config(info: ArchInfo, spec: TinySpec, token_id: dict[str, int]) -> dict[str, Any]:
    """config.json as the real checkpoints write it, plus the smoke-test marker."""
    eos_ids = [token_id[t] for t in info.config_eos]
    common: dict[str, Any] = {
        "architectures": [info.architecture],
        "model_type": info.model_type,
        **size_fields(spec),
        "bos_token_id": token_id[info.config_bos],
        "eos_token_id": eos_ids[0] if len(eos_ids) == 1 else eos_ids,
        "pad_token_id": token_id[info.pad],
        "initializer_range": _INIT_STD,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "tie_word_embeddings": info.tie_embeddings,
        "torch_dtype": spec.dtype,
        "use_cache": True,
    }
    if info.fields is not None:
        arch_fields: dict[str, Any] = info.fields(spec.num_layers)
        if spec.mtp_layers:
            arch_fields["mtp_num_hidden_layers"] = spec.mtp_layers
    elif spec.arch == "qwen3":
        arch_fields = {
            "hidden_act": "silu",
            "rms_norm_eps": 1e-6,
            "rope_theta": 1_000_000.0,
            "rope_scaling": None,
            "sliding_window": None,
            "use_sliding_window": False,
            "max_window_layers": spec.num_layers,
        }
    elif spec.arch == "llama":
        arch_fields = {
            "hidden_act": "silu",
            "mlp_bias": False,
            "pretraining_tp": 1,
            "rms_norm_eps": 1e-5,
            "rope_theta": 500_000.0,
            "rope_scaling": {
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                # Real 3.1: 8192 of 131072. Kept below max_position_embeddings,
                # which transformers checks when it reads the config.
                "original_max_position_embeddings": max(1, spec.max_position_embeddings // 16),
                "rope_type": "llama3",
            },
        }
    else:
        arch_fields = {
            "hidden_activation": "gelu_pytorch_tanh",
            "rms_norm_eps": 1e-6,
            "rope_theta": 1_000_000.0,
            "rope_local_base_freq": 10_000.0,
            "rope_scaling": None,
            "query_pre_attn_scalar": spec.head_dim,
            "sliding_window": spec.sliding_window,
            # mlx-lm indexes cache[pattern - 1], so the pattern can't exceed the
            # layer count; with 2 layers this gives one sliding + one global layer.
            "sliding_window_pattern": min(6, spec.num_layers),
            "attn_logit_softcapping": None,
            "final_logit_softcapping": None,
        }
    marker = {
        "flow_smoke_test": True,
        "flow_smoke_test_label": SMOKE_TEST_LABEL,
        "flow_tiny_spec": asdict(spec),
        "flow_builder_version": BUILDER_VERSION,
    }
    return {**common, **arch_fields, **marker}


def arch_info(arch: Arch) -> ArchInfo:
    """What the real checkpoints of ``arch`` have: special tokens, stop tokens, chat template."""
    return _ARCHS[arch]


_MODULES: dict[str, str] = {"qwen3": "qwen3", "llama": "llama", "gemma3": "gemma3_text"}


def _model_module(arch: Arch) -> Any:
    return importlib.import_module(f"mlx_lm.models.{_ARCHS[arch].module or _MODULES[arch]}")


def _random_weights(spec: TinySpec, config: dict[str, Any]) -> dict[str, mx.array]:
    """Weights named exactly as the real mlx-lm model class names its parameters."""
    module = _model_module(spec.arch)
    mx.random.seed(spec.seed)  # what module init draws and the loop below keeps (gated-delta decay rates) is fixed
    model = module.Model(module.ModelArgs.from_dict(config))
    params = dict(tree_flatten(model.parameters()))
    if spec.arch == "gemma3":
        # Absent lm_head is how mlx-lm (and HF) know gemma3's head is tied.
        params.pop("lm_head.weight", None)
    names = sorted(params)
    keys = mx.random.split(mx.random.key(spec.seed), len(names))
    dtype = getattr(mx, spec.dtype)
    weights: dict[str, mx.array] = {}
    for i, name in enumerate(names):
        value = params[name]
        if value.ndim >= 2:  # embeddings, projections, experts' stacks: HF-style N(0, 0.02)
            value = mx.random.normal(value.shape, key=keys[i]) * _INIT_STD
        elif name.endswith(("bias", "sinks")):  # module init draws these at random: zero them, deterministic
            value = mx.zeros_like(value)
        elif spec.arch == "gemma3":  # gemma norms scale by (1 + w); identity is w = 0
            value = mx.zeros_like(value)
        weights[name] = value.astype(dtype)
    mx.eval(weights)
    return weights


def _random_mtp_weights(spec: TinySpec, config: dict[str, Any]) -> dict[str, mx.array]:
    """The MTP layers' weights as the real checkpoints store them: ``mtp.``-prefixed, norms as ``w`` of ``1 + w``."""
    from runtime.mtp import MTPHead

    params = dict(tree_flatten(MTPHead(config).parameters()))  # type: ignore[no-untyped-call]
    names = sorted(params)
    keys = mx.random.split(mx.random.key(spec.seed + 1), len(names))
    weights: dict[str, mx.array] = {}
    for i, name in enumerate(names):
        value = params[name]
        value = mx.random.normal(value.shape, key=keys[i]) * _INIT_STD if value.ndim >= 2 else value - 1.0
        weights[f"mtp.{name}"] = value.astype(getattr(mx, spec.dtype))
    mx.eval(weights)
    return weights


# ---------------------------------------------------------------------------
# Files


def _readme(spec: TinySpec, info: ArchInfo, n_params: int) -> str:
    fields = "\n".join(f"| {k} | {v} |" for k, v in asdict(spec).items())
    return f"""# {SMOKE_TEST_LABEL}

This is **not a real model**. It is a `{info.model_type}` checkpoint with
**random weights** and a tiny byte-level BPE tokenizer, built locally by
`runtime/tiny.py` (flow) for tests, demos and benchmarks. Whatever it
generates is gibberish.

- parameters: {n_params:,}
- cache key: `{spec.cache_key()}` (builder version {BUILDER_VERSION})
- `config.json` carries `"flow_smoke_test": true`

| field | value |
| --- | --- |
{fields}
"""


def _write_model_files(out: Path, spec: TinySpec) -> None:
    """Write every file of the checkpoint into the (empty) directory ``out``."""
    if spec.arch in ("bert", "modernbert"):
        _write_encoder_files(out, spec)
        return
    if spec.arch in ("whisper", "soprano", "qwen3_tts"):
        from runtime.tiny.audio import write_qwen3_tts_files, write_soprano_files, write_whisper_files

        writers = {"whisper": write_whisper_files, "soprano": write_soprano_files, "qwen3_tts": write_qwen3_tts_files}
        writers[spec.arch](out, spec)
        return
    if spec.arch in VLM_ARCHS:
        from runtime.tiny.vlm import write_vlm_files

        write_vlm_files(out, spec)
        return
    info = _ARCHS[spec.arch]
    tok = _train_tokenizer(info, spec.vocab_size)
    token_id = tok.get_vocab()
    config = _model_config(info, spec, token_id)
    if spec.embedding:
        config["architectures"] = [info.architecture.replace("ForCausalLM", "Model")]
    weights = _random_weights(spec, config)
    if spec.mtp_layers:
        weights.update(_random_mtp_weights(spec, config))

    def dump(name: str, obj: Any) -> None:
        (out / name).write_text(json.dumps(obj, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")

    mx.save_safetensors(str(out / "model.safetensors"), weights, metadata={"format": "mlx"})
    dump("config.json", config)
    dump(
        "generation_config.json",
        {
            "bos_token_id": token_id[info.config_bos],
            "eos_token_id": [token_id[t] for t in info.stop_tokens],
            "pad_token_id": token_id[info.pad],
            **info.generation_defaults,
        },
    )
    tok.save(str(out / "tokenizer.json"))
    dump("tokenizer_config.json", _tokenizer_config(info, tok, spec))
    dump("special_tokens_map.json", _special_tokens_map(info))
    n_params = sum(v.size for v in weights.values())
    (out / "README.md").write_text(_readme(spec, info, n_params), encoding="utf-8")


_BERT_SPECIALS = ("[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]")


def _wordpiece_tokenizer(spec: TinySpec) -> Tokenizer:
    """A lower-casing WordPiece tokenizer as BERT-family checkpoints ship it: ``[CLS] a [SEP]``, and
    ``[CLS] a [SEP] b [SEP]`` for pairs."""
    from tokenizers import normalizers

    tok = Tokenizer(models.WordPiece(unk_token="[UNK]", max_input_chars_per_word=100))
    tok.normalizer = normalizers.BertNormalizer(clean_text=True, handle_chinese_chars=True, strip_accents=None,
                                                lowercase=True)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.decoder = decoders.WordPiece(prefix="##")
    trainer = trainers.WordPieceTrainer(vocab_size=spec.vocab_size, special_tokens=list(_BERT_SPECIALS))
    tok.train_from_iterator([_CORPUS, *_pseudo_text(20000)], trainer=trainer)
    cls, sep = tok.token_to_id("[CLS]"), tok.token_to_id("[SEP]")
    tok.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] $B:1 [SEP]:1", special_tokens=[("[CLS]", cls), ("[SEP]", sep)])
    return tok


def _encoder_config(spec: TinySpec, vocab: dict[str, int]) -> dict[str, Any]:
    """The config of an encoder-only model: a ``BertModel`` sentence encoder, or (``modernbert``) a ModernBERT
    cross-encoder with one relevance output, as rerankers ship (gte-reranker-modernbert)."""
    common = {"vocab_size": len(vocab), "hidden_size": spec.hidden_size, "num_hidden_layers": spec.num_layers,
              "num_attention_heads": spec.num_heads, "intermediate_size": spec.intermediate_size,
              "max_position_embeddings": spec.max_position_embeddings, "pad_token_id": vocab["[PAD]"],
              "flow_smoke_test": True}
    if spec.arch == "modernbert":
        return {"architectures": ["ModernBertForSequenceClassification"], "model_type": "modernbert", **common,
                "id2label": {"0": "LABEL_0"}, "label2id": {"LABEL_0": 0}, "classifier_pooling": "mean",
                "cls_token_id": vocab["[CLS]"], "sep_token_id": vocab["[SEP]"], "local_attention": 16,
                "global_attn_every_n_layers": 2, "hidden_activation": "gelu"}
    return {"architectures": ["BertModel"], "model_type": "bert", **common, "type_vocab_size": 2,
            "hidden_act": "gelu", "layer_norm_eps": 1e-12}


def _write_encoder_files(out: Path, spec: TinySpec) -> None:
    """An encoder as embedding and reranking checkpoints ship it: WordPiece tokenizer, weights named as
    mlx-embeddings' module for the architecture names them."""
    from mlx_embeddings.models import bert, modernbert

    tok = _wordpiece_tokenizer(spec)
    vocab = tok.get_vocab()
    config = _encoder_config(spec, vocab)
    module: Any = modernbert if spec.arch == "modernbert" else bert
    model = module.Model(module.ModelArgs.from_dict(config))
    params = dict(tree_flatten(model.parameters()))
    names = sorted(params)
    keys = mx.random.split(mx.random.key(spec.seed), len(names))
    weights = {name: (mx.random.normal(params[name].shape, key=keys[i]) * _INIT_STD if params[name].ndim == 2
                      else params[name]).astype(getattr(mx, spec.dtype)) for i, name in enumerate(names)}
    mx.eval(weights)
    mx.save_safetensors(str(out / "model.safetensors"), weights, metadata={"format": "mlx"})
    tok.save(str(out / "tokenizer.json"))
    (out / "vocab.txt").write_text("".join(t + "\n" for t, _ in sorted(vocab.items(), key=lambda kv: kv[1])))
    for name, obj in (("config.json", config), ("tokenizer_config.json", {
            "tokenizer_class": "BertTokenizer", "do_lower_case": True, "model_max_length": spec.max_position_embeddings,
            "unk_token": "[UNK]", "sep_token": "[SEP]", "pad_token": "[PAD]", "cls_token": "[CLS]",
            "mask_token": "[MASK]", "padding_side": "right", "clean_up_tokenization_spaces": True})):
        (out / name).write_text(json.dumps(obj, indent=2) + "\n", encoding="utf-8")
    role = "cross-encoder (reranker)" if spec.arch == "modernbert" else "encoder"
    (out / "README.md").write_text(f"# {SMOKE_TEST_LABEL}\n\nA `{spec.arch}` {role} with random weights (cache "
                                   f"key `{spec.cache_key()}`): its outputs mean nothing.\n", encoding="utf-8")


_REQUIRED_FILES = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json")


def _is_complete(path: Path) -> bool:
    return all((path / name).is_file() for name in _REQUIRED_FILES)


def _stage(dest: Path, spec: TinySpec) -> Path:
    """Build into a fresh temp dir beside ``dest`` (same filesystem, so rename is atomic)."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    staged = Path(tempfile.mkdtemp(dir=dest.parent, prefix=f".{dest.name}.tmp-"))
    try:
        _write_model_files(staged, spec)
    except BaseException:
        shutil.rmtree(staged, ignore_errors=True)
        raise
    return staged


def _swap_in(staged: Path, dest: Path) -> None:
    """Replace an existing ``dest`` with ``staged``; dest is never half-written."""
    old = dest.with_name(f".{dest.name}.old-{uuid.uuid4().hex[:8]}")
    os.rename(dest, old)
    os.rename(staged, dest)
    shutil.rmtree(old, ignore_errors=True)


def build_tiny_model(dest: Path, spec: TinySpec = TinySpec()) -> Path:
    """Build a random-weight checkpoint for ``spec`` at ``dest`` (replacing what is there)."""
    dest = Path(dest)
    staged = _stage(dest, spec)
    if dest.exists():
        _swap_in(staged, dest)
    else:
        os.rename(staged, dest)
    return dest


def _default_cache_dir() -> Path:
    env = os.environ.get("FLOW_CACHE_DIR")
    return Path(env) if env else Path.home() / ".cache" / "flow"


def tiny_models_dir(cache_dir: Path | None = None) -> Path:
    """Where tiny models are built (``$FLOW_CACHE_DIR/tiny-models``, default ``~/.cache/flow``)."""
    return (Path(cache_dir) if cache_dir is not None else _default_cache_dir()) / "tiny-models"


def _resolve(name_or_spec: str | TinySpec) -> tuple[str, TinySpec]:
    if isinstance(name_or_spec, TinySpec):
        for name, spec in PRESETS.items():
            if spec == name_or_spec:
                return name, spec
        return f"custom-{name_or_spec.arch}", name_or_spec
    try:
        return name_or_spec, PRESETS[name_or_spec]
    except KeyError:
        raise ValueError(f"unknown tiny model {name_or_spec!r}; presets: {sorted(PRESETS)}") from None


def ensure_tiny_model(name_or_spec: str | TinySpec, cache_dir: Path | None = None) -> Path:
    """Return the cached build for a preset name or spec, building it on first use."""
    name, spec = _resolve(name_or_spec)
    dest = tiny_models_dir(cache_dir) / f"{name}-{spec.cache_key()}"
    if _is_complete(dest):
        return dest
    staged = _stage(dest, spec)
    try:
        os.rename(staged, dest)
    except OSError:
        # Another process renamed its build in first (dest is a non-empty dir):
        # use the winner's, it is the same spec.
        if _is_complete(dest):
            shutil.rmtree(staged, ignore_errors=True)
            return dest
        if not dest.exists():
            raise
        _swap_in(staged, dest)  # dest was junk (not one of our builds): replace it
    return dest


def is_smoke_test_model(path: Path) -> bool:
    """True when ``path`` holds a checkpoint built by this module."""
    try:
        config = json.loads((Path(path) / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return isinstance(config, dict) and config.get("flow_smoke_test") is True
