"""What differs between the tiny text models' architectures: the first three (qwen3, llama, gemma3) and the
model families' ones.

:class:`ArchInfo` holds, per architecture, what its real checkpoints have: special tokens, which of
them end generation, the chat template, and — for the architectures added for the model families
(:data:`FAMILY_ARCHS`) — the mlx-lm module and the config.json fields it needs beyond the common
ones (``fields``, given the layer count). :data:`ARCHS` is the whole table, keyed by ``TinySpec.arch``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

from runtime.tiny.templates import (
    DEEPSEEK_R1_TEMPLATE,
    DEEPSEEK_V31_TEMPLATE,
    FALCON3_TEMPLATE,
    GEMMA3_TEMPLATE,
    GEMMA4_TEMPLATE,
    GPT_OSS_TEMPLATE,
    GRANITE_4_TEMPLATE,
    GRANITE_32_TEMPLATE,
    HERMES3_DEFAULT_TEMPLATE,
    HERMES3_TOOL_USE_TEMPLATE,
    KIMI_K2_TEMPLATE,
    LLAMA31_TEMPLATE,
    LFM2_TEMPLATE,
    LLAMA4_TEMPLATE,
    MINICPM5_TEMPLATE,
    MINIMAX_M2_TEMPLATE,
    MISTRAL_SMALL_3_TEMPLATE,
    NEMOTRON_H_TEMPLATE,
    PHI4_MINI_TEMPLATE,
    QWEN3_TEMPLATE,
    QWEN35_TEMPLATE,
    SEED_OSS_TEMPLATE,
)


@dataclass(frozen=True)
class ArchInfo:
    """What differs between architectures, as the real checkpoints have it."""

    model_type: str
    architecture: str
    special: tuple[str, ...]  # special tokens, ids 0.. in this order
    reserved_fmt: str  # name of filler tokens when BPE falls short of the target
    bos: str | None  # what the tokenizer calls bos_token
    eos: str
    pad: str
    config_bos: str  # config.json's bos_token_id
    config_eos: tuple[str, ...]  # config.json's eos_token_id
    stop_tokens: tuple[str, ...]  # generation_config.json's eos_token_id
    chat_template: str
    added: tuple[str, ...] = ()  # non-special added tokens (survive skip_special_tokens)
    unk: str | None = None
    prepend_bos: bool = False  # tokenizer.encode adds bos (Llama 3 and Gemma do, Qwen does not)
    tie_embeddings: bool = False
    generation_defaults: dict[str, Any] = field(default_factory=dict)
    module: str = ""  # the mlx-lm module (mlx_lm.models.<module>); "" for the original three
    fields: Callable[[int], dict[str, Any]] | None = None  # config.json fields beyond the common ones
    # tokenizer_config.json's chat_template as a list of named templates (Hermes 3: "default" and "tool_use")
    named_templates: tuple[tuple[str, str], ...] = ()
    # The standard deviation of the layers' matrices (the embeddings keep HF's initializer_range), where HF's is too
    # small to matter: a model with tied embeddings whose layers are drawn at 0.02 adds next to nothing to its
    # residual stream, so it repeats its last input token whatever came before, and no test could see a wrong cache.
    layer_std: float | None = None


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


def _deepseek_v3_fields(layers: int) -> dict[str, Any]:
    # Multi-head latent attention and a mixture of experts behind one dense layer, as V3 and Kimi K2 have.
    return {
        "kv_lora_rank": 16,
        "q_lora_rank": 32,
        "qk_rope_head_dim": 8,
        "qk_nope_head_dim": 8,
        "v_head_dim": 16,
        "n_routed_experts": 4,
        "n_shared_experts": 1,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 32,
        "first_k_dense_replace": 1,
        "moe_layer_freq": 1,
        "n_group": 1,
        "topk_group": 1,
        "topk_method": "noaux_tc",
        "scoring_func": "sigmoid",
        "norm_topk_prob": True,
        "routed_scaling_factor": 2.5,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "hidden_act": "silu",
    }


def _minimax_fields(layers: int) -> dict[str, Any]:
    return {
        "num_local_experts": 4,
        "num_experts_per_tok": 2,
        "shared_intermediate_size": 0,
        "rms_norm_eps": 1e-6,
        "rope_theta": 5_000_000.0,
        "rotary_dim": 8,
        "scoring_func": "sigmoid",
        "use_qk_norm": True,
        "hidden_act": "silu",
    }


def _seed_oss_fields(layers: int) -> dict[str, Any]:
    return {
        "rms_norm_eps": 1e-6,
        "rope_theta": 10_000_000.0,
        "rope_scaling": None,
        "attention_bias": True,
        "attention_out_bias": False,
        "mlp_bias": False,
        "hidden_act": "silu",
    }


def _qwen3_5_fields(layers: int) -> dict[str, Any]:
    # Gated-delta linear attention with a full attention layer every second one (the real models: every fourth).
    return {
        "linear_num_value_heads": 4,
        "linear_num_key_heads": 2,
        "linear_key_head_dim": 16,
        "linear_value_head_dim": 16,
        "linear_conv_kernel_dim": 4,
        "full_attention_interval": 2,
        "rms_norm_eps": 1e-6,
        "rope_parameters": {"type": "default", "mrope_section": [1, 1, 0], "rope_theta": 100000,
                            "partial_rotary_factor": 0.25},
        "hidden_act": "silu",
    }


def _qwen3_next_fields(layers: int) -> dict[str, Any]:
    """Qwen3-Next: gated-delta layers with full attention every second one, a mixture of experts with a shared one."""
    return {
        "linear_num_value_heads": 4,
        "linear_num_key_heads": 2,
        "linear_key_head_dim": 16,
        "linear_value_head_dim": 16,
        "linear_conv_kernel_dim": 4,
        "full_attention_interval": 2,
        "num_experts": 4,
        "num_experts_per_tok": 2,
        "decoder_sparse_step": 1,
        "shared_expert_intermediate_size": 32,
        "mlp_only_layers": [],
        "moe_intermediate_size": 32,
        "norm_topk_prob": True,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10_000_000.0,
        "partial_rotary_factor": 0.25,
        "rope_scaling": None,
        "hidden_act": "silu",
    }


def _gemma4_fields(layers: int) -> dict[str, Any]:
    # One sliding and one full attention layer, no per-layer inputs or shared KV (the small real models have them).
    return {
        "global_head_dim": 16,
        "num_kv_shared_layers": 0,
        "hidden_size_per_layer_input": 0,
        "vocab_size_per_layer_input": 0,
        "sliding_window": 128,
        "sliding_window_pattern": 2,
        "layer_types": ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(layers - 1)]
        + ["full_attention"],
        "use_double_wide_mlp": False,
        "final_logit_softcapping": 30.0,
        "rms_norm_eps": 1e-6,
        "hidden_activation": "gelu_pytorch_tanh",
    }


def _phi3_fields(layers: int) -> dict[str, Any]:
    # Phi-4-mini rotates three quarters of each head.
    return {"rms_norm_eps": 1e-5, "rope_theta": 10000.0, "rope_scaling": None, "partial_rotary_factor": 0.75,
            "original_max_position_embeddings": 4096, "hidden_act": "silu"}


def _granite_fields(layers: int) -> dict[str, Any]:
    # Granite 3.2's scalings (granite-3.2-2b-instruct's values): embeddings, attention, residuals and logits.
    return {"embedding_multiplier": 12.0, "attention_multiplier": 0.015625, "residual_multiplier": 0.22,
            "logits_scaling": 8.0, "rms_norm_eps": 1e-5, "rope_theta": 10_000_000.0, "rope_scaling": None,
            "mlp_bias": False, "hidden_act": "silu"}


def _granite_hybrid_fields(layers: int) -> dict[str, Any]:
    # Granite 4.0-H: Mamba-2 layers with an attention layer among them (the real ones: one in ten), no
    # positional embedding, a mixture of experts beside a shared MLP.
    return {"embedding_multiplier": 12.0, "attention_multiplier": 0.0078125, "residual_multiplier": 0.22,
            "logits_scaling": 6.0, "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "position_embedding_type": "nope",
            "layer_types": ["attention" if i % 2 else "mamba" for i in range(layers)],
            "mamba_n_heads": 4, "mamba_d_head": 16, "mamba_d_state": 16, "mamba_d_conv": 4, "mamba_n_groups": 1,
            "mamba_expand": 1, "mamba_conv_bias": True, "mamba_proj_bias": False, "mamba_chunk_size": 256,
            "num_local_experts": 4, "num_experts_per_tok": 2, "shared_intermediate_size": 64, "hidden_act": "silu"}


def _llama4_text_fields(layers: int) -> dict[str, Any]:
    # Llama 4's decoder: query/key norms, every fourth layer without rotary embedding (NoPE), chunked attention.
    return {"intermediate_size_mlp": 128, "no_rope_layers": [int((i + 1) % 4 != 0) for i in range(layers)],
            "use_qk_norm": True, "attention_chunk_size": 8192, "rope_theta": 500000.0, "rope_scaling": None,
            "rms_norm_eps": 1e-5, "hidden_act": "silu"}


def _llama31_fields(layers: int) -> dict[str, Any]:
    # Llama 3.1's rotary scaling, as the Hermes 3 fine-tunes keep it.
    return {"hidden_act": "silu", "mlp_bias": False, "pretraining_tp": 1, "rms_norm_eps": 1e-5, "rope_theta": 500000.0,
            "rope_scaling": {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                             "original_max_position_embeddings": 256, "rope_type": "llama3"}}


def _minicpm5_fields(layers: int) -> dict[str, Any]:
    # MiniCPM5-2B's config.json: plain Llama, no rotary scaling, none of the older MiniCPMs' scale fields.
    return {"hidden_act": "silu", "mlp_bias": False, "rms_norm_eps": 1e-6, "rope_theta": 5_000_000.0,
            "rope_scaling": None}


def _nemotron_h_fields(layers: int) -> dict[str, Any]:
    # Nemotron-H: one block per layer, Mamba-2 (M), attention (*) or MLP (-), in hybrid_override_pattern; the real
    # ones mostly alternate Mamba-2 and MLP blocks with an attention block now and then ("M-M-M-M*-…"). Here the
    # second to last block is the attention one: every block type is there, and two Mamba-2 layers.
    pattern = "".join("*" if i == layers - 2 else "M-"[i % 2] for i in range(layers))
    return {"hybrid_override_pattern": pattern, "mamba_num_heads": 4, "mamba_head_dim": 16, "ssm_state_size": 16,
            "n_groups": 1, "conv_kernel": 4, "expand": 1, "chunk_size": 128, "mamba_proj_bias": False,
            "mamba_hidden_act": "silu", "use_bias": False, "use_conv_bias": True, "mlp_bias": False,
            "mlp_hidden_act": "relu2", "layer_norm_epsilon": 1e-5, "rms_norm_eps": 1e-5, "residual_in_fp32": False,
            "rescale_prenorm_residual": True, "time_step_limit": [0.0, float("inf")], "time_step_min": 0.001,
            "time_step_max": 0.1, "time_step_floor": 1e-4, "rope_theta": 10000, "sliding_window": None}


def _falcon_h1_fields(layers: int) -> dict[str, Any]:
    # Falcon-H1: every layer runs attention and a Mamba-2 mixer side by side on the same input and sums them (one
    # mlx-lm CacheList per layer: the mixer's state and the attention's KV); µP multipliers as Falcon-H1-0.5B's.
    return {"mamba_d_ssm": 64, "mamba_n_heads": 4, "mamba_d_head": 16, "mamba_d_state": 16, "mamba_n_groups": 1,
            "mamba_d_conv": 4, "mamba_expand": 1, "mamba_chunk_size": 128, "mamba_conv_bias": True,
            "mamba_proj_bias": False, "mamba_norm_before_gate": False, "mamba_rms_norm": False,
            "mamba_use_mlp": True, "projectors_bias": False, "mlp_bias": False, "mlp_expansion_factor": 8,
            "hidden_act": "silu", "rms_norm_eps": 1e-5, "rope_theta": 100000000000.0, "rope_scaling": None,
            "rope_traditional": False, "attention_in_multiplier": 1.0, "attention_out_multiplier": 0.9375,
            "embedding_multiplier": 5.656854249492381, "key_multiplier": 0.390625, "lm_head_multiplier": 0.0390625,
            "mlp_multipliers": [0.8838834764831844, 0.5859375], "ssm_in_multiplier": 1.25,
            "ssm_multipliers": [0.3535533905932738, 0.25, 0.3535533905932738, 0.5, 0.3535533905932738],
            "ssm_out_multiplier": 0.23570226039551587, "num_logits_to_keep": 1}


def _lfm2_fields(layers: int) -> dict[str, Any]:
    # LFM2: gated short-convolution layers (a 3-token window, no recurrent matrix) with an attention layer every
    # second one (the real ones: 6 of 16); the feed-forward size is rounded as the real config asks. Its sizes
    # under their own names (block_dim, block_ff_dim, conv_dim) are the spec's: runtime/tiny/build.py adds them.
    types = ["full_attention" if i % 2 else "conv" for i in range(layers)]
    return {"layer_types": types, "full_attn_idxs": [i for i, t in enumerate(types) if t == "full_attention"],
            "block_auto_adjust_ff_dim": True, "block_ffn_dim_multiplier": 1.0, "block_multiple_of": 32,
            "block_norm_eps": 1e-5, "conv_L_cache": 3, "conv_bias": False, "norm_eps": 1e-5,
            "rope_theta": 1000000.0, "tie_embedding": True, "use_pos_enc": True}


def _mamba2_fields(layers: int) -> dict[str, Any]:
    # Mamba-2 (Mamba-Codestral-7B's config): Mamba-2 layers only, no attention at all.
    return {"num_heads": 8, "head_dim": 16, "state_size": 16, "n_groups": 1, "conv_kernel": 4, "expand": 2,
            "chunk_size": 256, "hidden_act": "silu", "layer_norm_epsilon": 1e-5, "rms_norm": True,
            "residual_in_fp32": True, "rescale_prenorm_residual": False, "use_bias": False, "use_conv_bias": True,
            "time_step_limit": [0.0, float("inf")], "time_step_min": 0.001, "time_step_max": 0.1,
            "time_step_floor": 1e-4, "time_step_rank": 256, "time_step_init_scheme": "random",
            "time_step_scale": 1.0}


_GRANITE_ROLES = ("<|start_of_role|>", "<|end_of_role|>", "<|tool_call|>")

_DEEPSEEK_TOOL_TOKENS = ("<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>", "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>",
                         "<｜tool▁outputs▁begin｜>", "<｜tool▁outputs▁end｜>", "<｜tool▁output▁begin｜>",
                         "<｜tool▁output▁end｜>", "<｜tool▁sep｜>")

FAMILY_ARCHS: dict[str, ArchInfo] = {
    # openai/gpt-oss: the o200k harmony special tokens; <|return|> ends an answer, <|call|> a call.
    "gpt_oss": ArchInfo(
        model_type="gpt_oss",
        architecture="GptOssForCausalLM",
        special=("<|startoftext|>", "<|endoftext|>", "<|start|>", "<|end|>", "<|message|>", "<|channel|>",
                 "<|constrain|>", "<|return|>", "<|call|>"),
        reserved_fmt="<|reserved_{}|>",
        bos="<|startoftext|>",
        eos="<|return|>",
        pad="<|endoftext|>",
        config_bos="<|startoftext|>",
        config_eos=("<|return|>",),
        stop_tokens=("<|return|>", "<|endoftext|>", "<|call|>"),
        chat_template=GPT_OSS_TEMPLATE,
        module="gpt_oss",
        fields=_gpt_oss_fields,
    ),
    # deepseek-ai/DeepSeek-V3.1: <think> and </think> are ordinary added tokens, the tool markers special.
    "deepseek_v3": ArchInfo(
        model_type="deepseek_v3",
        architecture="DeepseekV3ForCausalLM",
        special=("<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜▁pad▁｜>", "<｜User｜>", "<｜Assistant｜>",
                 *_DEEPSEEK_TOOL_TOKENS),
        added=("<think>", "</think>"),
        reserved_fmt="<｜place▁holder▁no▁{}｜>",
        bos="<｜begin▁of▁sentence｜>",
        eos="<｜end▁of▁sentence｜>",
        pad="<｜▁pad▁｜>",
        prepend_bos=True,
        config_bos="<｜begin▁of▁sentence｜>",
        config_eos=("<｜end▁of▁sentence｜>",),
        stop_tokens=("<｜end▁of▁sentence｜>",),
        chat_template=DEEPSEEK_V31_TEMPLATE,
        generation_defaults={"do_sample": True, "temperature": 0.6, "top_p": 0.95},
        module="deepseek_v3",
        fields=_deepseek_v3_fields,
    ),
    # moonshotai/Kimi-K2: DeepSeek V3's architecture under its own model_type, ChatML-like im_ tokens.
    "kimi_k2": ArchInfo(
        model_type="kimi_k2",
        architecture="DeepseekV3ForCausalLM",
        special=("[BOS]", "[EOS]", "[PAD]", "[UNK]", "<|im_end|>", "<|im_user|>", "<|im_assistant|>", "<|im_system|>",
                 "<|im_middle|>", "<|tool_calls_section_begin|>", "<|tool_calls_section_end|>", "<|tool_call_begin|>",
                 "<|tool_call_argument_begin|>", "<|tool_call_end|>", "<think>", "</think>"),
        reserved_fmt="<|reserved_token_{}|>",
        bos="[BOS]",
        eos="<|im_end|>",
        pad="[PAD]",
        unk="[UNK]",
        config_bos="[BOS]",
        config_eos=("<|im_end|>",),
        stop_tokens=("<|im_end|>", "[EOS]"),
        chat_template=KIMI_K2_TEMPLATE,
        generation_defaults={"temperature": 1.0},
        module="deepseek_v3",
        fields=_deepseek_v3_fields,
    ),
    # MiniMaxAI/MiniMax-M2: ]~!b[ begins the text, ]~b] a turn, [e~[ ends one.
    "minimax": ArchInfo(
        model_type="minimax_m2",
        architecture="MiniMaxM2ForCausalLM",
        special=("]~!b[", "]~b]", "[e~[", "<think>", "</think>", "<minimax:tool_call>", "</minimax:tool_call>"),
        reserved_fmt="<minimax:reserved_{}>",
        bos="]~!b[",
        eos="[e~[",
        pad="[e~[",
        config_bos="]~!b[",
        config_eos=("[e~[",),
        stop_tokens=("[e~[",),
        chat_template=MINIMAX_M2_TEMPLATE,
        generation_defaults={"do_sample": True, "temperature": 1.0, "top_p": 0.95, "top_k": 40},
        module="minimax",
        fields=_minimax_fields,
    ),
    # ByteDance-Seed/Seed-OSS-36B-Instruct: <seed:…> turn, thinking and call tokens.
    "seed_oss": ArchInfo(
        model_type="seed_oss",
        architecture="SeedOssForCausalLM",
        special=("<seed:bos>", "<seed:eos>", "<seed:pad>", "<seed:think>", "</seed:think>", "<seed:tool_call>",
                 "</seed:tool_call>", "<seed:cot_budget_reflect>", "</seed:cot_budget_reflect>"),
        reserved_fmt="<[PLHD{}_never_used]>",
        bos="<seed:bos>",
        eos="<seed:eos>",
        pad="<seed:pad>",
        config_bos="<seed:bos>",
        config_eos=("<seed:eos>",),
        stop_tokens=("<seed:eos>",),
        chat_template=SEED_OSS_TEMPLATE,
        generation_defaults={"do_sample": True, "temperature": 1.1, "top_p": 0.95},
        module="seed_oss",
        fields=_seed_oss_fields,
    ),
    # Qwen/Qwen3.5: Qwen's ChatML tokens and vision placeholders; <think> and the tool tags are added tokens.
    "qwen3_5": ArchInfo(
        model_type="qwen3_5",
        architecture="Qwen3_5ForConditionalGeneration",
        special=("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>", "<|image_pad|>",
                 "<|video_pad|>"),
        added=("<think>", "</think>", "<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"),
        reserved_fmt="<|extra_{}|>",
        bos=None,
        eos="<|im_end|>",
        pad="<|endoftext|>",
        config_bos="<|endoftext|>",
        config_eos=("<|im_end|>",),
        stop_tokens=("<|im_end|>", "<|endoftext|>"),
        chat_template=QWEN35_TEMPLATE,
        generation_defaults={"do_sample": True, "temperature": 0.6, "top_k": 20, "top_p": 0.95},
        module="qwen3_5",
        fields=_qwen3_5_fields,
    ),
    # google/gemma-4: Gemma's <pad> <eos> <bos> <unk> first, then the turn, tool and channel tokens.
    "gemma4": ArchInfo(
        model_type="gemma4_text",
        architecture="Gemma4ForCausalLM",
        special=("<pad>", "<eos>", "<bos>", "<unk>", "<|turn>", "<turn|>", "<|tool>", "<tool|>", "<|tool_call>",
                 "<tool_call|>", "<|tool_response>", "<tool_response|>", '<|"|>', "<|channel>", "<channel|>",
                 "<|think|>", "<|image|>", "<|audio|>", "<|video|>"),
        reserved_fmt="<unused{}>",
        bos="<bos>",
        eos="<turn|>",
        pad="<pad>",
        unk="<unk>",
        prepend_bos=True,
        config_bos="<bos>",
        config_eos=("<eos>", "<turn|>"),
        stop_tokens=("<eos>", "<turn|>"),
        tie_embeddings=True,
        chat_template=GEMMA4_TEMPLATE,
        generation_defaults={"do_sample": True, "top_k": 64, "top_p": 0.95, "temperature": 1.0},
        module="gemma4_text",
        fields=_gemma4_fields,
    ),
    # microsoft/Phi-4-mini-instruct: <|ROLE|> turns ending in <|end|>, tool wrappers as special tokens.
    "phi3": ArchInfo(
        model_type="phi3",
        architecture="Phi3ForCausalLM",
        special=("<|endoftext|>", "<|system|>", "<|user|>", "<|assistant|>", "<|end|>", "<|tool|>", "<|/tool|>",
                 "<|tool_call|>", "<|/tool_call|>", "<|tool_response|>", "<|tag|>"),
        reserved_fmt="<|dummy_{}|>",
        bos="<|endoftext|>",
        eos="<|endoftext|>",
        pad="<|endoftext|>",
        config_bos="<|endoftext|>",
        config_eos=("<|endoftext|>", "<|end|>"),
        stop_tokens=("<|endoftext|>", "<|end|>"),
        chat_template=PHI4_MINI_TEMPLATE,
        module="phi3",
        fields=_phi3_fields,
    ),
    # ibm-granite/granite-3.2-2b-instruct: StarCoder's special tokens first, the role and call tokens last;
    # <|end_of_text|> is bos, eos and pad at once.
    "granite": ArchInfo(
        model_type="granite",
        architecture="GraniteForCausalLM",
        special=("<|end_of_text|>", "<fim_prefix>", "<fim_middle>", "<fim_suffix>", "<fim_pad>", "<filename>",
                 "<gh_stars>", "<issue_start>", "<issue_comment>", "<issue_closed>", "<jupyter_start>",
                 "<jupyter_text>", "<jupyter_code>", "<jupyter_output>", "<empty_output>", "<commit_before>",
                 "<commit_msg>", "<commit_after>", "<reponame>", *_GRANITE_ROLES),
        reserved_fmt="<|reserved_{}|>",
        bos="<|end_of_text|>",
        eos="<|end_of_text|>",
        pad="<|end_of_text|>",
        config_bos="<|end_of_text|>",
        config_eos=("<|end_of_text|>",),
        stop_tokens=("<|end_of_text|>",),
        tie_embeddings=True,
        chat_template=GRANITE_32_TEMPLATE,
        module="granite",
        fields=_granite_fields,
    ),
    # ibm-granite/granite-4.0-h-tiny: the dolma2 vocabulary's <|end_of_text|> and <|pad|>, Granite's role tokens.
    "granitemoehybrid": ArchInfo(
        model_type="granitemoehybrid",
        architecture="GraniteMoeHybridForCausalLM",
        special=("<|end_of_text|>", "<|pad|>", *_GRANITE_ROLES, "<|start_of_cite|>", "<|end_of_cite|>",
                 "<|start_of_plugin|>", "<|end_of_plugin|>"),
        added=("<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"),
        reserved_fmt="<|reserved_{}|>",
        bos="<|end_of_text|>",
        eos="<|end_of_text|>",
        pad="<|pad|>",
        config_bos="<|end_of_text|>",
        config_eos=("<|end_of_text|>",),
        stop_tokens=("<|end_of_text|>",),
        tie_embeddings=True,
        chat_template=GRANITE_4_TEMPLATE,
        generation_defaults={"temperature": 0.0},
        module="granitemoehybrid",
        fields=_granite_hybrid_fields,
    ),
    # meta-llama/Llama-4-Scout-17B-16E-Instruct's language model, text only (Llama4ForCausalLM): <|eot|> ends a
    # turn, <|eom|> a tool call's; calls may sit in <|python_start|>…<|python_end|>.
    "llama4_text": ArchInfo(
        model_type="llama4_text",
        architecture="Llama4ForCausalLM",
        special=("<|begin_of_text|>", "<|end_of_text|>", "<|fim_prefix|>", "<|fim_middle|>", "<|fim_suffix|>",
                 "<|header_start|>", "<|header_end|>", "<|eom|>", "<|eot|>", "<|step|>", "<|python_start|>",
                 "<|python_end|>", "<|finetune_right_pad|>", "<|image_start|>", "<|image_end|>", "<|image|>",
                 "<|patch|>"),
        reserved_fmt="<|text_post_train_reserved_special_token_{}|>",
        bos="<|begin_of_text|>",
        eos="<|eot|>",
        pad="<|finetune_right_pad|>",
        prepend_bos=True,
        config_bos="<|begin_of_text|>",
        config_eos=("<|end_of_text|>", "<|eom|>", "<|eot|>"),
        stop_tokens=("<|end_of_text|>", "<|eom|>", "<|eot|>"),
        chat_template=LLAMA4_TEMPLATE,
        generation_defaults={"temperature": 0.6, "top_p": 0.9},
        module="llama4_text",
        fields=_llama4_text_fields,
    ),
    # NousResearch/Hermes-3-Llama-3.1-8B: Llama 3.1's vocabulary with ChatML's tokens, the tool tags as added ones.
    "hermes3": ArchInfo(
        model_type="llama",
        architecture="LlamaForCausalLM",
        special=("<|begin_of_text|>", "<|end_of_text|>", "<|im_start|>", "<|im_end|>", "<|finetune_right_pad_id|>",
                 "<|start_header_id|>", "<|end_header_id|>", "<|eom_id|>", "<|eot_id|>", "<|python_tag|>"),
        added=("<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>", "<tools>", "</tools>"),
        reserved_fmt="<|reserved_special_token_{}|>",
        bos="<|begin_of_text|>",
        eos="<|im_end|>",
        pad="<|end_of_text|>",
        prepend_bos=True,
        config_bos="<|begin_of_text|>",
        config_eos=("<|im_end|>",),
        stop_tokens=("<|im_end|>", "<|end_of_text|>"),
        chat_template=HERMES3_TOOL_USE_TEMPLATE,
        named_templates=(("default", HERMES3_DEFAULT_TEMPLATE), ("tool_use", HERMES3_TOOL_USE_TEMPLATE)),
        module="llama",
        fields=_llama31_fields,
    ),
    # openbmb/MiniCPM5-2B: a Llama (model_type "llama") with ChatML's turns after <s>; the call markup's pieces are
    # special tokens, <think> and </think> added ones that survive skip_special_tokens, as its tokenizer has them.
    "minicpm5": ArchInfo(
        model_type="llama",
        architecture="LlamaForCausalLM",
        special=("<s>", "</s>", "<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>", "<tools>",
                 "</tools>", "<function", "</function>", "<param", "</param>", "<|im_start|>", "<|im_end|>", "<unk>"),
        added=("<think>", "</think>"),
        reserved_fmt="<|reserved_{}|>",
        bos="<s>",
        eos="</s>",
        pad="</s>",
        unk="<unk>",
        config_bos="<s>",
        config_eos=("</s>", "<|im_end|>"),
        stop_tokens=("</s>", "<|im_end|>"),
        chat_template=MINICPM5_TEMPLATE,
        module="llama",
        fields=_minicpm5_fields,
    ),
    # LiquidAI/LFM2-1.2B: <|startoftext|> begins the text, ChatML turns end in <|im_end|>; the tool markers are
    # special tokens.
    "lfm2": ArchInfo(
        model_type="lfm2",
        architecture="Lfm2ForCausalLM",
        special=("<|pad|>", "<|startoftext|>", "<|endoftext|>", "<|fim_pre|>", "<|fim_mid|>", "<|fim_suf|>",
                 "<|im_start|>", "<|im_end|>", "<|tool_list_start|>", "<|tool_list_end|>", "<|tool_call_start|>",
                 "<|tool_call_end|>", "<|tool_response_start|>", "<|tool_response_end|>"),
        reserved_fmt="<|reserved_{}|>",
        bos="<|startoftext|>",
        eos="<|im_end|>",
        pad="<|pad|>",
        prepend_bos=True,
        config_bos="<|startoftext|>",
        config_eos=("<|im_end|>",),
        stop_tokens=("<|im_end|>",),
        tie_embeddings=True,
        chat_template=LFM2_TEMPLATE,
        generation_defaults={"temperature": 0.3, "min_p": 0.15},
        module="lfm2",
        fields=_lfm2_fields,
        layer_std=0.1,  # LFM2 always ties its head to the embeddings
    ),
    # nvidia/NVIDIA-Nemotron-Nano-9B-v2: Mistral's Tekken vocabulary with its control tokens renamed <SPECIAL_n>
    # (token n), the tool and thinking tags as added tokens.
    "nemotron_h": ArchInfo(
        model_type="nemotron_h",
        architecture="NemotronHForCausalLM",
        special=("<unk>", "<s>", "</s>", *(f"<SPECIAL_{i}>" for i in range(3, 20))),
        added=("<think>", "</think>", "<TOOLCALL>", "</TOOLCALL>", "<AVAILABLE_TOOLS>", "</AVAILABLE_TOOLS>",
               "<TOOL_RESPONSE>", "</TOOL_RESPONSE>"),
        reserved_fmt="<SPECIAL_{}>",
        bos="<s>",
        eos="<SPECIAL_12>",
        pad="<SPECIAL_14>",
        unk="<unk>",
        prepend_bos=True,
        config_bos="<s>",
        config_eos=("<SPECIAL_12>",),
        stop_tokens=("</s>", "<SPECIAL_12>"),
        chat_template=NEMOTRON_H_TEMPLATE,
        generation_defaults={"temperature": 0.6, "top_p": 0.95},
        module="nemotron_h",
        fields=_nemotron_h_fields,
    ),
    # tiiuae/Falcon-H1-0.5B-Instruct's architecture with Falcon 3's vocabulary layout and template: the role markers
    # and tool tags as added tokens, <|endoftext|> ending an answer.
    "falcon_h1": ArchInfo(
        model_type="falcon_h1",
        architecture="FalconH1ForCausalLM",
        special=("<|pad|>", "<|endoftext|>", ">>TITLE<<", ">>ABSTRACT<<", ">>INTRODUCTION<<", ">>SUMMARY<<",
                 ">>COMMENT<<", ">>ANSWER<<", ">>QUESTION<<", ">>DOMAIN<<"),
        added=("<|system|>", "<|user|>", "<|assistant|>", "<tool_call>", "</tool_call>", "<tool_response>",
               "</tool_response>", "<tools>", "</tools>"),
        reserved_fmt=">>UNUSED_{}<<",
        bos=None,
        eos="<|endoftext|>",
        pad="<|pad|>",
        config_bos="<|endoftext|>",
        config_eos=("<|endoftext|>",),
        stop_tokens=("<|endoftext|>",),
        chat_template=FALCON3_TEMPLATE,
        module="falcon_h1",
        fields=_falcon_h1_fields,
    ),
    # mistralai/Mamba-Codestral-7B-v0.1's architecture with Tekken's control tokens (Mistral Small 3's order) and
    # Mistral Small 3's template.
    "mamba2": ArchInfo(
        model_type="mamba2",
        architecture="Mamba2ForCausalLM",
        special=("<unk>", "<s>", "</s>", "[INST]", "[/INST]", "[AVAILABLE_TOOLS]", "[/AVAILABLE_TOOLS]",
                 "[TOOL_RESULTS]", "[/TOOL_RESULTS]", "[TOOL_CALLS]", "[IMG]", "<pad>", "[IMG_BREAK]", "[IMG_END]",
                 "[PREFIX]", "[MIDDLE]", "[SUFFIX]", "[SYSTEM_PROMPT]", "[/SYSTEM_PROMPT]", "[TOOL_CONTENT]"),
        reserved_fmt="<SPECIAL_{}>",
        bos="<s>",
        eos="</s>",
        pad="<pad>",
        unk="<unk>",
        prepend_bos=True,
        config_bos="<s>",
        config_eos=("</s>",),
        stop_tokens=("</s>",),
        chat_template=MISTRAL_SMALL_3_TEMPLATE,
        module="mamba2",
        fields=_mamba2_fields,
    ),
}
# deepseek-ai/DeepSeek-R1: V3's architecture and vocabulary, R1's template.
FAMILY_ARCHS["deepseek_r1"] = replace(FAMILY_ARCHS["deepseek_v3"], chat_template=DEEPSEEK_R1_TEMPLATE)


# The first three architectures, as their real checkpoints have them.
_FIRST_ARCHS: dict[str, ArchInfo] = {
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
        chat_template=QWEN3_TEMPLATE,
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
        chat_template=LLAMA31_TEMPLATE,
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
        chat_template=GEMMA3_TEMPLATE,
        generation_defaults={"do_sample": True, "top_k": 64, "top_p": 0.95},
    ),
}


# Every text architecture of TinySpec.arch (the vision ones are runtime.tiny.vlm's, the encoders' and audio models'
# are written without one).
ARCHS: dict[str, ArchInfo] = {**_FIRST_ARCHS, **FAMILY_ARCHS}
# Qwen/Qwen3-Next: Qwen3's vocabulary and template (the Instruct model's is Qwen3's, thinking parts aside) on
# the hybrid architecture.
ARCHS["qwen3_next"] = replace(ARCHS["qwen3"], model_type="qwen3_next", architecture="Qwen3NextForCausalLM",
                              module="qwen3_next", fields=_qwen3_next_fields)
# Qwen/Qwen2.5: Qwen3's vocabulary and ChatML template (its tools branch is Qwen2.5's) on the Qwen2 layers
# (biased q/k/v projections, no q/k norms).
ARCHS["qwen2"] = replace(ARCHS["qwen3"], model_type="qwen2", architecture="Qwen2ForCausalLM", module="qwen2",
                         fields=lambda layers: {"hidden_act": "silu", "rms_norm_eps": 1e-6, "rope_theta": 1_000_000.0,
                                                "rope_scaling": None, "sliding_window": None,
                                                "use_sliding_window": False, "max_window_layers": layers})
