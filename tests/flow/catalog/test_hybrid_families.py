"""The hybrid families: NVIDIA Nemotron-H / Nemotron Nano 2 (``nemotron-h``), Nemotron 3 (``nemotron-3``, the same
``nemotron_h`` model_type in ChatML) and TII Falcon-H1 (``falcon-h1``).

Detection from a config and the real templates' markers (Falcon-H1 used to fall to ``qwen2``: nothing claimed
``falcon_h1``, and qwen2's ``<tool_call>`` fingerprint won its tie with qwen3's by file order); each family's output
as the real models write it, parsed into the IR in every chunking; earlier calls and results rendered back by the
templates (Falcon-H1 Instruct's real one quoted whole); and the tiny random-weight models served for real.

Sources of the formats: NVIDIA-Nemotron-Nano-9B-v2's template as llama.cpp keeps it
(models/templates/NVIDIA-Nemotron-Nano-v2.jinja) and Megatron-LM's ``nemotron_h_5p5_reasoning_inference_template``;
llama.cpp's nemotron-v2 and nemotron-v3 chat parsers; Nemotron 3 Nano's template (llama.cpp's copy of unsloth's);
tiiuae/Falcon-H1-7B-Instruct's tokenizer_config.json (as copied into MLX conversions and HF's tiny-random model).
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
from mlx_lm.utils import load_tokenizer

from flow.builtins import compile_tables
from flow.catalog.families import builtin_families, resolve_family
from protocols.ir import ChatRequest, Message
from runtime.tiny import ensure_tiny_model
from stages.chat import render_prompt
from tests.flow.catalog.test_family_detection import QWEN25_TEMPLATE, model_dir
from tests.harness import (
    WEATHER_TOOLS,
    RunningServer,
    graph_with_model,
    running_server,
    tables_with_model,
)
from tests.protocols.test_family_formats import PARIS, ROME, family_parser
from tests.protocols.test_parsers import C, R, T, assert_chunking_invariant

# NVIDIA-Nemotron-Nano-9B-v2 / 12B-v2: the turns, the tools prompt and the thinking switch of the real template.
NANO_V2_TEMPLATE = (
    "{%- set ns = namespace(enable_thinking=true) -%}...{%- if '/think' in content -%}...{{- '<SPECIAL_10>System\n' "
    "+ ns.non_tool_system_content }}...{{- '\n<AVAILABLE_TOOLS>[' -}}...<TOOLCALL>[{{\"name\": \"tool_name1\", "
    "\"arguments\": \"tool_args1\"}}]</TOOLCALL>...{{- '<SPECIAL_11>User\n' + content }}...{{- '<SPECIAL_11>Assistant"
    "\n' -}}{{- '\n<SPECIAL_12>\n\n' -}}...{{- '<think>\n\n' -}}")
# Nemotron-H-8B-Reasoning-128K: the turns, thinking by "{'reasoning': True}" in the system prompt.
NEMOTRON_H_REASONING_TEMPLATE = (
    "{{ '<SPECIAL_10>System\\n' }}...{{ '\\n<SPECIAL_11>User\\n' + message['content'].strip() + "
    "'\\n<SPECIAL_11>Assistant\\n' }}{%- if \"{'reasoning': True}\" in messages[0]['content'] -%}{{ '<think>\\n' }}")
# NVIDIA-Nemotron-3-Nano-30B-A3B: ChatML, Qwen3-Coder's call markup, enable_thinking.
NEMOTRON3_TEMPLATE = (
    "{%- set enable_thinking = enable_thinking if enable_thinking is defined else True %}...{{- \"<|im_start|>system\\n"
    "\" + system_message }}...<tool_call>\\n<function=example_function_name>\\n<parameter=example_parameter_1>\\n"
    "value_1\\n</parameter>...{{- '<|im_start|>assistant\\n<think>\\n' }}")
# tiiuae/Falcon-H1-{0.5B,1.5B,3B,7B,34B}-Instruct's template, shortened to what it does: bos, ChatML turns, the
# tools in the system turn with the Hermes prompt (that turn left unclosed, as there), the assistant's text only (no
# calls), tool results as "tool" turns, every system message but the first skipped.
FALCON_H1_TEMPLATE = (
    "{{bos_token}}{%- if tools %}{{- '<|im_start|>system\\n' }}{%- if messages[0].role == 'system' %}"
    "{{- messages[0].content + '\\n\\n' }}{%- endif %}{{- 'You are a function calling AI model. ...\\n<tools>\\n' }}"
    "{%- for tool in tools %}[{{- tool | tojson }}]{%- endfor %}{{- \"\\n</tools>\\n...<tool_call>\\n{'arguments': "
    "<args-dict>, 'name': <function-name>}\\n</tool_call>\\n\" }}{%- elif messages[0].role == 'system' %}"
    "{{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}{%- endif %}{% for message in messages %}"
    "{%- if message.role != 'system' %}{{'<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>'"
    " + '\\n'}}{%- endif %}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")
# tiiuae/Falcon-H1-Tiny-*-Instruct (and Falcon 3): a JSON list of calls in one <tool_call>.
FALCON_H1_TINY_TEMPLATE = (
    "{%- if tools %} {{bos_token}}<|system|>...For each function call, you MUST return a JSON object inside "
    "<tool_call></tool_call> tags.\\n\\n<tools>' + tools|tojson(indent=2) + '</tools>...<tool_call>\\n[\\n  "
    "{\"name\": \"function_name\", \"arguments\": {\"arg1\": \"value1\"}}\\n]\\n</tool_call>...<|im_start|>user\\n")


@pytest.mark.parametrize(("model_type", "architecture", "name", "template", "family"), [
    ("nemotron_h", "NemotronHForCausalLM", "NVIDIA-Nemotron-Nano-9B-v2", NANO_V2_TEMPLATE, "nemotron-h"),
    ("nemotron_h", "NemotronHForCausalLM", "my-renamed-model", NANO_V2_TEMPLATE, "nemotron-h"),
    ("nemotron_h", "NemotronHForCausalLM", "Nemotron-H-8B-Reasoning-128K", NEMOTRON_H_REASONING_TEMPLATE, "nemotron-h"),
    ("nemotron_h", "NemotronHForCausalLM", "Nemotron-H-47B-Base-8K", None, "nemotron-h"),  # a base model: no template
    # Nemotron 3: the same model_type, ChatML and XML calls; not qwen3-coder, whose fingerprint it also has
    ("nemotron_h", "NemotronHForCausalLM", "NVIDIA-Nemotron-3-Nano-30B-A3B-4bit", NEMOTRON3_TEMPLATE, "nemotron-3"),
    ("nemotron_h", "NemotronHForCausalLM", "my-renamed-model", NEMOTRON3_TEMPLATE, "nemotron-3"),
    ("falcon_h1", "FalconH1ForCausalLM", "Falcon-H1-7B-Instruct", FALCON_H1_TEMPLATE, "falcon-h1"),
    ("falcon_h1", "FalconH1ForCausalLM", "my-renamed-model", FALCON_H1_TEMPLATE, "falcon-h1"),
    ("falcon_h1", "FalconH1ForCausalLM", "Falcon-H1-Tiny-Multilingual-100M-Instruct", FALCON_H1_TINY_TEMPLATE,
     "falcon-h1"),
    ("falcon_h1", "FalconH1ForCausalLM", "Falcon-H1R-7B", None, "falcon-h1"),
    # What they must not take: a Qwen2.5 stays qwen2
    ("qwen2", "Qwen2ForCausalLM", "my-renamed-model", QWEN25_TEMPLATE, "qwen2"),
])
def test_detected_by_config_and_template(tmp_path_factory: pytest.TempPathFactory, model_type: str, architecture: str,
                                         name: str, template: str | None, family: str) -> None:
    path = model_dir(tmp_path_factory, model_type, [architecture])
    assert resolve_family("auto", path, name, template).name == family


def test_what_claimed_them_before(tmp_path_factory: pytest.TempPathFactory) -> None:
    """The rule that misdetected: nothing claimed falcon_h1, so only template fingerprints scored. The Falcon 3-style
    template (tiny-falcon-h1's) has <tool_call> but no ChatML: qwen2's and qwen3's fingerprint alone, a tie that qwen2
    won by file order; the Instruct template's ChatML made it hermes. Nemotron Nano 2 matched nothing: default."""
    before = {k: v for k, v in builtin_families().items() if k not in ("falcon-h1", "nemotron-h", "nemotron-3")}
    falcon = model_dir(tmp_path_factory, "falcon_h1", ["FalconH1ForCausalLM"])
    falcon3_style = load_tokenizer(ensure_tiny_model("tiny-falcon-h1")).chat_template
    assert resolve_family("auto", falcon, "renamed", falcon3_style, before).name == "qwen2"
    assert resolve_family("auto", falcon, "renamed", FALCON_H1_TEMPLATE, before).name == "hermes"
    nemotron = model_dir(tmp_path_factory, "nemotron_h", ["NemotronHForCausalLM"])
    assert resolve_family("auto", nemotron, "renamed", NANO_V2_TEMPLATE, before).name == "default"
    for template in (falcon3_style, FALCON_H1_TEMPLATE):
        assert resolve_family("auto", falcon, "renamed", template).name == "falcon-h1"
    assert resolve_family("auto", nemotron, "renamed", NANO_V2_TEMPLATE).name == "nemotron-h"


NANO_V2_PROMPT = "<SPECIAL_11>User\nWeather in Paris?\n<SPECIAL_11>Assistant\n<think>\n"  # thinking on (the default)
NANO3_PROMPT = "<|im_start|>user\nWeather in Paris?<|im_end|>\n<|im_start|>assistant\n<think>\n"
CASES: list[tuple[str, str, str, list[Any], str, bool]] = [
    # Nemotron Nano 2 thinking (the prompt opened it), then text and a list of calls, as its template renders them
    ("nemotron-h", "thinking, content, two calls in one TOOLCALL",
     ("The user wants the weather.\n</think>\n\nLet me check.\n<TOOLCALL>[{\"name\": \"get_weather\", \"arguments\": "
     "{\"city\": \"Paris\"}}, {\"name\": \"get_weather\", \"arguments\": {\"city\": \"Rome\", \"days\": 3}}]</TOOLCALL>"),
     [R("The user wants the weather."), T("Let me check."), C(0, "get_weather", PARIS), C(1, "get_weather", ROME)],
     NANO_V2_PROMPT, True),
    # /no_think: the prompt ends in an empty block, the answer is plain
    ("nemotron-h", "thinking off, a call only", '<TOOLCALL>[{"name": "get_time", "arguments": {}}]</TOOLCALL>',
     [C(0, "get_time", {})], "<SPECIAL_11>Assistant\n<think></think>", True),
    ("nemotron-h", "arguments written as a JSON string are decoded once",
     '</think><TOOLCALL>[{"name": "get_weather", "arguments": "{\\"city\\": \\"Paris\\"}"}]</TOOLCALL>',
     [C(0, "get_weather", PARIS)], NANO_V2_PROMPT, True),
    ("nemotron-h", "without tools a TOOLCALL is text", "Done.\n</think>\nSay <TOOLCALL>[]</TOOLCALL>.",
     [R("Done."), T("Say <TOOLCALL>[]</TOOLCALL>.")], NANO_V2_PROMPT, False),
    ("nemotron-h", "an unclosed TOOLCALL with cut-off JSON is text", '</think><TOOLCALL>[{"name": "get_weather", "ar',
     [T('<TOOLCALL>[{"name": "get_weather", "ar')], NANO_V2_PROMPT, True),
    # Nemotron 3 Nano: Qwen3-Coder's XML calls after thinking
    ("nemotron-3", "thinking, content, an XML call",
     ("The user wants the weather.\n</think>\nLet me check.\n<tool_call>\n<function=get_weather>\n<parameter=city>\n"
     "Paris\n</parameter>\n</function>\n</tool_call>\n"),
     [R("The user wants the weather."), T("Let me check."), C(0, "get_weather", PARIS)], NANO3_PROMPT, True),
    # Falcon-H1 Instruct: Hermes calls, "arguments" first as its prompt's schema puts it
    ("falcon-h1", "a call after content", ('Let me check.\n<tool_call>\n{"arguments": {"city": "Paris"}, "name": '
     '"get_weather"}\n</tool_call>'), [T("Let me check."), C(0, "get_weather", PARIS)], "", True),
    # Falcon-H1-Tiny / Falcon 3: one <tool_call> holding a JSON list
    ("falcon-h1", "a list of calls in one tool_call", ('<tool_call>\n[\n  {"name": "get_weather", "arguments": '
     '{"city": "Paris"}},\n  {"name": "get_time", "arguments": {}}\n]\n</tool_call>'),
     [C(0, "get_weather", PARIS), C(1, "get_time", {})], "", True),
    # Falcon-H1R thinks in <think> tags
    ("falcon-h1", "H1R: thinking, then a call", ('<think>\nThe user wants the weather.\n</think>\n\n<tool_call>\n'
     '{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'),
     [R("The user wants the weather."), C(0, "get_weather", PARIS)], "", True),
    # A small Falcon-H1 forgetting its tags: the loose call is taken
    ("falcon-h1", "a bare JSON call", 'Sure.\n{"name": "get_weather", "arguments": {"city": "Paris"}}',
     [T("Sure."), C(0, "get_weather", PARIS)], "", True),
]


@pytest.mark.parametrize(("family", "name", "text", "expected", "prompt", "tools"), CASES,
                         ids=[f"{c[0]}: {c[1]}" for c in CASES])
def test_output_parsed_in_every_chunking(family: str, name: str, text: str, expected: list[Any], prompt: str,
                                         tools: bool) -> None:
    assert assert_chunking_invariant(lambda: family_parser(family, tools=tools, prompt=prompt), text) == expected


HISTORY = (
    Message("user", "Weather in Paris?"),
    Message("assistant", "", extra=(("tool_calls", [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}},
    ]),)),
    Message("tool", "Sunny", extra=(("tool_call_id", "call_1"),)),
)


def test_nemotron_h_tools_calls_results_and_the_thinking_switch() -> None:
    """The tools prompt goes into the system message as the template itself words it (the same text, whether or not
    the request has a system message); earlier calls and results are the template's."""
    tokenizer = load_tokenizer(ensure_tiny_model("tiny-nemotron-h"))
    family = builtin_families()["nemotron-h"]
    text = render_prompt(tokenizer, ChatRequest(model="m", messages=HISTORY, tools=tuple(WEATHER_TOOLS)), family)
    call = '<SPECIAL_11>Assistant\n<TOOLCALL>[{"name": "get_weather", "arguments": {"city": "Paris"}}]</TOOLCALL>'
    result = "<SPECIAL_11>User\n<TOOL_RESPONSE>[Sunny]</TOOL_RESPONSE>"
    assert text.startswith("<SPECIAL_10>System\nYou can use the following tools to assist the user if required:\n"
                           '<AVAILABLE_TOOLS>[{"name": "get_weather", "description": "Weather for a city"')
    assert '<TOOLCALL>[{{"name": "tool_name1", "arguments": "tool_args1"}}, ' in text
    assert call in text and result in text and text.index(call) < text.index(result)
    assert text.endswith("<SPECIAL_11>Assistant\n<think>\n")  # thinking on: the output starts inside it
    # With a system message (which the template needs to render tools at all), byte for byte the template's own.
    system = (Message("system", "/think Be brief."), *HISTORY)
    ours = render_prompt(tokenizer, ChatRequest(model="m", messages=system, tools=tuple(WEATHER_TOOLS)), family)
    native = tokenizer.apply_chat_template([m.to_template() for m in system], tools=WEATHER_TOOLS, tokenize=False,
                                           add_generation_prompt=True)
    assert ours == native and "Be brief.\n\nYou can use the following tools" in ours
    off = (Message("system", "/no_think"), Message("user", "Hi"))
    assert render_prompt(tokenizer, ChatRequest(model="m", messages=off), family).endswith("<think></think>")


def test_a_requests_thinking_switch_reaches_nemotron_h_as_its_words() -> None:
    """The template reads no toggle key, only /think and /no_think in the system message (and takes the word out
    of what it renders): a request that turns thinking off gets the word there, with or without a system message of
    its own, and its prompt ends in an empty thinking block; on, or no choice, the prompt opens thinking."""
    tokenizer = load_tokenizer(ensure_tiny_model("tiny-nemotron-h"))
    family = builtin_families()["nemotron-h"]
    hi = (Message("user", "Hi"),)
    brief = (Message("system", "Be brief."), *hi)

    def render(messages: tuple[Message, ...], thinking: bool | None) -> str:
        return render_prompt(tokenizer, ChatRequest(model="m", messages=messages, thinking=thinking), family)

    for messages in (hi, brief):
        assert render(messages, False).endswith("<SPECIAL_11>Assistant\n<think></think>"), render(messages, False)
        assert render(messages, True).endswith("<SPECIAL_11>Assistant\n<think>\n"), render(messages, True)
        assert render(messages, None).endswith("<SPECIAL_11>Assistant\n<think>\n"), render(messages, None)
    assert "Be brief." in render(brief, False)


def test_falcon_h1_instruct_template_gets_earlier_calls_as_text() -> None:
    """Falcon-H1 Instruct's real template renders an assistant turn's text only: the call goes back in it, written
    as the model writes calls; the result is a tool turn."""
    tokenizer = load_tokenizer(ensure_tiny_model("tiny-falcon-h1"))
    tokenizer.chat_template = FALCON_H1_TEMPLATE
    family = builtin_families()["falcon-h1"]
    text = render_prompt(tokenizer, ChatRequest(model="m", messages=HISTORY, tools=tuple(WEATHER_TOOLS)), family)
    call = '<|im_start|>assistant\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    assert "<tools>\n[{" in text and WEATHER_TOOLS[0]["function"]["description"] in text
    assert call in text and "<|im_start|>tool\nSunny<|im_end|>" in text
    assert text.endswith("<|im_start|>assistant\n")
    # A system message after the first would be dropped by the template: it is folded into a user turn.
    late = (Message("user", "Hi"), Message("assistant", "Hello"), Message("system", "Answer in French."))
    assert "Answer in French." in render_prompt(tokenizer, ChatRequest(model="m", messages=late), family)


@pytest.fixture(scope="module", params=[
    ("tiny-nemotron-h", "nemotron-h", ("The user wants the weather.\n</think>\n\nLet me check.\n<TOOLCALL>["
     '{"name": "get_weather", "arguments": {"city": "Paris"}}]</TOOLCALL>')),
    ("tiny-falcon-h1", "falcon-h1", ('Let me check.\n<tool_call>\n{"arguments": {"city": "Paris"}, "name": '
     '"get_weather"}\n</tool_call>')),
], ids=["nemotron-h", "falcon-h1"])
def echoed(request: pytest.FixtureRequest) -> Iterator[tuple[str, str, str, RunningServer]]:
    preset, family, script = request.param
    tables = tables_with_model(ensure_tiny_model(preset))
    tables["stages"]["generate"]["type"] = "generate.echo"
    with running_server(compile_tables(tables, f"echo {family}")) as server:
        yield preset, family, script, server


def test_a_renamed_tiny_model_keeps_its_family(echoed: tuple[str, str, str, RunningServer], tmp_path: Path) -> None:
    preset, family, _, _ = echoed
    path = ensure_tiny_model(preset)
    template = load_tokenizer(path).chat_template
    renamed = tmp_path / "my-model"
    shutil.copytree(path, renamed)
    assert resolve_family("auto", renamed, "my-model", template).name == family


def test_calls_reach_the_client_streamed_or_not(echoed: tuple[str, str, str, RunningServer]) -> None:
    """The family's real output (echoed through the tiny model's tokenizer and template) in OpenAI chat."""
    _, family, script, server = echoed
    c = openai.OpenAI(base_url=server.url, api_key="x", max_retries=0)
    messages: Any = [{"role": "user", "content": script}]
    out = c.chat.completions.create(model="tiny", messages=messages, tools=WEATHER_TOOLS, max_tokens=300)
    message = out.choices[0].message
    assert out.choices[0].finish_reason == "tool_calls" and message.content == "Let me check."
    thinking = "The user wants the weather." if family == "nemotron-h" else None  # Nemotron's prompt opens <think>
    assert ((message.model_extra or {}).get("reasoning_content") or None) == thinking
    assert message.tool_calls and message.tool_calls[0].function.name == "get_weather"
    assert json.loads(message.tool_calls[0].function.arguments) == PARIS
    with c.chat.completions.stream(model="tiny", messages=messages, tools=WEATHER_TOOLS, max_tokens=300) as stream:
        contents = [e.delta for e in stream if e.type == "content.delta"]
        final = stream.get_final_completion()
    assert "".join(contents) == "Let me check." and not any("<" in piece for piece in contents)
    assert json.loads((final.choices[0].message.tool_calls or [])[0].function.arguments) == PARIS


@pytest.mark.parametrize(("preset", "family"), [("tiny-nemotron-h", "nemotron-h"), ("tiny-falcon-h1", "falcon-h1")])
def test_real_server_detects_the_family_and_generates(preset: str, family: str) -> None:
    with running_server(graph_with_model(ensure_tiny_model(preset), name="m")) as server:
        assert server.health()["models"][0]["family"] == family
        chat = openai.OpenAI(base_url=server.url, api_key="x", max_retries=0)
        out = chat.chat.completions.create(model="m", messages=[{"role": "user", "content": "Weather in Paris?"}],
                                           tools=WEATHER_TOOLS, max_tokens=5)
        assert out.usage is not None and out.usage.completion_tokens <= 5
        assert out.choices[0].finish_reason in ("stop", "length", "tool_calls")
