"""Family detection by the chat template's fingerprint, and every family file's rules.

A model's config can mislead (SmolLM2 is a ``llama`` with a ChatML template; the DeepSeek-R1 distills
are ``qwen2``/``llama`` with DeepSeek's template) and a renamed copy has no telling name: the template's
markers decide. Templates here are the real models' (SmolLM2's is short enough to quote whole; the
others are the markers their templates are known to contain).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from flow.catalog.families import builtin_families, load_families, resolve_family

SMOLLM2_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}{{ '<|im_start|>system\n"
    "You are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n' }}{% endif %}{{'<|im_start|>' "
    "+ message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|im_start|>assistant\n' }}{% endif %}"
)
QWEN25_TEMPLATE = ("{%- if tools %}{{- '<|im_start|>system\\n' }}...<tool_call>\\n{\"name\": <function-name>, "
                   "\"arguments\": <args-json-object>}\\n</tool_call><|im_end|>\\n' }}")
LLAMA31_TEMPLATE = "{{- bos_token }}...{{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' }}"
R1_DISTILL_TEMPLATE = ("{{'<｜User｜>' + message['content']}}{{'<｜Assistant｜><｜tool▁calls▁begin｜><｜tool▁call▁begin｜>'"
                       " + tool['type']}}{% if add_generation_prompt %}{{'<｜Assistant｜><think>\\n'}}{% endif %}")
HERMES3_TEMPLATE = ("{{- '<|im_start|>system\\n' }}You are a function calling AI model. <tools>...</tools>"
                    "<tool_call>\\n{\"name\": <function-name>, \"arguments\": <args-dict>}\\n</tool_call>")
# Hermes 4 70B/405B and 4.3 36B: the flags their templates default at the top, the tools branch's first turn (as
# quoted from the real chat_template.jinja); Hermes 4 14B: its ChatML system turn (the same flags, ChatML tokens).
HERMES4_TEMPLATE = ("{%- if not thinking is defined %}{% set thinking = false %}{% endif %}...keep_cots..."
                    "{%- if tools %}{{- bos_token + '<|start_header_id|>system<|end_header_id|>\\n' }}")
HERMES4_14B_TEMPLATE = ("{%- if not thinking is defined %}{% set thinking = false %}{% endif %}...keep_cots..."
                        "{{- '<|im_start|>system\\n' + system_prompt + '<|im_end|>\\n' }}...<tool_call>")


def model_dir(tmp_path_factory: pytest.TempPathFactory, model_type: str, architectures: list[str]) -> Path:
    path = tmp_path_factory.mktemp("model")  # not tmp_path: its name holds the test's
    (path / "config.json").write_text(json.dumps({"model_type": model_type, "architectures": architectures}))
    return path


@pytest.mark.parametrize(("model_type", "architecture", "name", "template", "family"), [
    # SmolLM2: a llama whose template is ChatML; the llama3 family's fingerprint is absent
    ("llama", "LlamaForCausalLM", "SmolLM2-135M-Instruct", SMOLLM2_TEMPLATE, "chatml"),
    ("llama", "LlamaForCausalLM", "my-renamed-model", SMOLLM2_TEMPLATE, "chatml"),
    ("llama", "LlamaForCausalLM", "Llama-3.1-8B-Instruct", LLAMA31_TEMPLATE, "llama3"),
    ("llama", "LlamaForCausalLM", "my-renamed-model", LLAMA31_TEMPLATE, "llama3"),
    # Qwen2.5-Coder: qwen2, whatever its name says (coder) and however it is renamed
    ("qwen2", "Qwen2ForCausalLM", "Qwen2.5-Coder-0.5B-Instruct", QWEN25_TEMPLATE, "qwen2"),
    ("qwen2", "Qwen2ForCausalLM", "my-renamed-model", QWEN25_TEMPLATE, "qwen2"),
    # Hermes 3 is a Llama 3.1 fine-tune with a ChatML tools template
    ("llama", "LlamaForCausalLM", "Hermes-3-Llama-3.1-8B", HERMES3_TEMPLATE, "hermes"),
    ("llama", "LlamaForCausalLM", "my-renamed-model", HERMES3_TEMPLATE, "hermes"),
    # Hermes 4 70B is a Llama 3.1 in Llama 3 turns, 4.3 a Seed-OSS in them: their templates, not their configs
    ("llama", "LlamaForCausalLM", "Hermes-4-70B", HERMES4_TEMPLATE, "hermes4"),
    ("llama", "LlamaForCausalLM", "my-renamed-model", HERMES4_TEMPLATE, "hermes4"),
    ("seed_oss", "SeedOssForCausalLM", "Hermes-4.3-36B", HERMES4_TEMPLATE, "hermes4"),
    ("seed_oss", "SeedOssForCausalLM", "my-renamed-model", HERMES4_TEMPLATE, "hermes4"),
    ("qwen3", "Qwen3ForCausalLM", "Hermes-4-14B", HERMES4_14B_TEMPLATE, "hermes"),
    # The R1 distills: their base's config, DeepSeek's template
    ("qwen2", "Qwen2ForCausalLM", "DeepSeek-R1-Distill-Qwen-7B", R1_DISTILL_TEMPLATE, "deepseek-r1"),
    ("deepseek_v3", "DeepseekV3ForCausalLM", "DeepSeek-R1-0528", R1_DISTILL_TEMPLATE, "deepseek-r1"),
    ("kimi_k2", "DeepseekV3ForCausalLM", "Kimi-K2-Instruct", "<|im_user|>user<|im_middle|>", "kimi-k2"),
    ("kimi_k2", "DeepseekV3ForCausalLM", "renamed", "<|im_system|>tool_declare<|im_middle|>", "kimi-k2"),
    ("deepseek_v3", "DeepseekV3ForCausalLM", "renamed", "<|im_system|>tool_declare<|im_middle|>", "kimi-k2"),
    ("gpt_oss", "GptOssForCausalLM", "renamed", "<|start|>system<|message|>{{ x }}<|channel|>", "gpt-oss"),
    ("granite", "GraniteForCausalLM", "granite-3.3-2b-instruct", "<|start_of_role|>available_tools", "granite"),
    ("granitemoehybrid", "GraniteMoeHybridForCausalLM", "renamed", "<|start_of_role|><tool_call>", "granite4"),
    ("phi3", "Phi3ForCausalLM", "Phi-4-mini-instruct", "<|system|><|tool|><|end|><|assistant|>", "phi4-mini"),
    ("seed_oss", "SeedOssForCausalLM", "renamed", "<seed:bos><seed:tool_call>", "seed-oss"),
    ("minimax_m2", "MiniMaxM2ForCausalLM", "renamed", "<minimax:tool_call>", "minimax-m2"),
    ("qwen3_next", "Qwen3NextForCausalLM", "Qwen3-Next-80B-A3B", "<tool_call><function=", "qwen3.5"),
    ("qwen3_next", "Qwen3NextForCausalLM", "renamed", "<|im_start|><tool_call>{json}", "qwen3"),
    ("llama4", "Llama4ForConditionalGeneration", "renamed", "<|header_start|>", "llama4"),
])
def test_the_template_decides(tmp_path_factory: pytest.TempPathFactory, model_type: str, architecture: str,
                              name: str, template: str, family: str) -> None:
    path = model_dir(tmp_path_factory, model_type, [architecture])
    assert resolve_family("auto", path, name, template).name == family


def test_without_a_template_the_config_still_decides(tmp_path_factory: pytest.TempPathFactory) -> None:
    path = model_dir(tmp_path_factory, "llama", ["LlamaForCausalLM"])
    assert resolve_family("auto", path, "renamed", None).name == "llama3"


def test_named_templates_are_read_whole(tmp_path_factory: pytest.TempPathFactory) -> None:
    """Hermes 3 ships a plain ChatML "default" and a "tool_use" template with the markers: as
    tokenizer_config.json lists them, and as transformers hands them over (a mapping), all are searched."""
    from flow.catalog.local_models import chat_template

    path = model_dir(tmp_path_factory, "llama", ["LlamaForCausalLM"])
    default = SMOLLM2_TEMPLATE
    listed = [{"name": "default", "template": default}, {"name": "tool_use", "template": HERMES3_TEMPLATE}]
    (path / "tokenizer_config.json").write_text(json.dumps({"chat_template": listed}))
    assert resolve_family("auto", path, "renamed", listed).name == "hermes"
    assert resolve_family("auto", path, "renamed", {"default": default, "tool_use": HERMES3_TEMPLATE}).name == "hermes"
    assert resolve_family("auto", path, "renamed", chat_template(path)).name == "hermes"
    assert resolve_family("auto", path, "renamed", {"default": default}).name == "chatml"


def test_the_real_models_get_their_families() -> None:
    """The real SmolLM2 and Qwen2.5-Coder checkpoints (when this machine has them), by their own files."""
    from tests.real.conftest import real_models_source

    directory = Path(real_models_source()).expanduser()
    found = 0
    for name, family in [("smollm2-135m-instruct", "chatml"), ("qwen2.5-coder-0.5b-instruct", "qwen2")]:
        path = directory / name
        if not (path / "tokenizer_config.json").is_file():
            continue
        template = json.loads((path / "tokenizer_config.json").read_text())["chat_template"]
        assert resolve_family("auto", path, name, template).name == family
        assert resolve_family("auto", path, "renamed", template).name == family
        found += 1
    if not found:
        pytest.skip(f"no real models in {directory}")


def test_every_family_names_known_parsers_and_options() -> None:
    families = load_families()
    assert {"chatml", "hermes", "gpt-oss", "deepseek-v3", "deepseek-r1", "kimi-k2", "qwen3.5", "seed-oss",
            "minimax-m2", "minicpm", "granite", "granite4", "phi4-mini", "llama4", "gemma4"} <= set(families)
    assert families["gpt-oss"].reasoning.effort == "reasoning_effort"
    assert families["kimi-k2"].tools.options["model_ids"] is True


def test_bad_parser_options_in_a_family_file_are_reported(tmp_path: Path) -> None:
    (tmp_path / "mine.toml").write_text('name = "mine"\n[tools]\nparser = "xml_calls"\n[tools.options]\nwraper = []\n')
    from flow.catalog.families import FamilyError

    with pytest.raises(FamilyError, match="tools.options: unknown option.*wraper.*valid options: wrapper"):
        load_families(tmp_path)


def test_flow_families_lists_rules_and_parsers() -> None:
    out = subprocess.run([sys.executable, "-m", "flow.cli", "families"], capture_output=True, text=True, check=True,
                         cwd=Path(__file__).parents[3]).stdout
    for family in builtin_families():
        assert f"\n{family}: " in f"\n{out}"
    assert "rules this family out" in out and "sectioned_json parser (section = " in out
    assert "reasoning effort as reasoning_effort" in out
