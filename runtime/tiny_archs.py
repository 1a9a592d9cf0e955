"""What differs between the tiny models' architectures (``runtime/tiny.py``), and the families' ones.

:class:`ArchInfo` holds, per architecture, what its real checkpoints have: special tokens, which of
them end generation, the chat template, and — for the architectures added for the model families
(:data:`FAMILY_ARCHS`) — the mlx-lm module and the config.json fields it needs beyond the common
ones (``fields``, given the layer count).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from runtime.tiny_templates import GPT_OSS_TEMPLATE


@dataclass(frozen=True)
class ArchInfo:
    """What differs between architectures, as the real checkpoints have it."""

    model_type: str
    architecture: str
    special: tuple[str, ...]  # special tokens, ids 0.. in this order
    added: tuple[str, ...]  # non-special added tokens (survive skip_special_tokens)
    reserved_fmt: str  # name of filler tokens when BPE falls short of the target
    bos: str | None  # what the tokenizer calls bos_token
    eos: str
    pad: str
    unk: str | None
    prepend_bos: bool  # tokenizer.encode adds bos (Llama 3 and Gemma do, Qwen does not)
    config_bos: str  # config.json's bos_token_id
    config_eos: tuple[str, ...]  # config.json's eos_token_id
    stop_tokens: tuple[str, ...]  # generation_config.json's eos_token_id
    tie_embeddings: bool
    chat_template: str
    generation_defaults: dict[str, Any] = field(default_factory=dict)
    module: str = ""  # the mlx-lm module (mlx_lm.models.<module>); "" for the original three
    fields: Callable[[int], dict[str, Any]] | None = None  # config.json fields beyond the common ones


def _gpt_oss_fields(layers: int) -> dict[str, Any]:
    # Alternating sliding and full attention as the real checkpoints have it (mlx-lm needs one of each),
    # and a few experts: the mixture-of-experts path is what makes this architecture.
    return {
        "num_local_experts": 4,
        "num_experts_per_tok": 2,
        "experts_per_token": 2,
        "rms_norm_eps": 1e-5,
        "rope_theta": 150000,
        "rope_scaling": None,
        "sliding_window": 128,
        "layer_types": ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(max(layers, 2))],
        "hidden_act": "silu",
        "swiglu_limit": 7.0,
        "attention_bias": True,
    }


FAMILY_ARCHS: dict[str, ArchInfo] = {
    # openai/gpt-oss: the o200k harmony special tokens; <|return|> ends an answer, <|call|> a call.
    "gpt_oss": ArchInfo(
        model_type="gpt_oss",
        architecture="GptOssForCausalLM",
        special=("<|startoftext|>", "<|endoftext|>", "<|start|>", "<|end|>", "<|message|>", "<|channel|>",
                 "<|constrain|>", "<|return|>", "<|call|>"),
        added=(),
        reserved_fmt="<|reserved_{}|>",
        bos="<|startoftext|>",
        eos="<|return|>",
        pad="<|endoftext|>",
        unk=None,
        prepend_bos=False,
        config_bos="<|startoftext|>",
        config_eos=("<|return|>",),
        stop_tokens=("<|return|>", "<|endoftext|>", "<|call|>"),
        tie_embeddings=False,
        chat_template=GPT_OSS_TEMPLATE,
        module="gpt_oss",
        fields=_gpt_oss_fields,
    ),
}
