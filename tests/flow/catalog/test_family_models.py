"""The 2026 families on tiny random-weight models of their own architectures, with their real chat templates
(MiniCPM 5's rebuilt from the published renders of its real one, runtime/tiny/templates.py):
DeepSeek V3.1 and R1, Gemma 4, Kimi K2, MiniMax M2, Phi-4-mini, Qwen3.5, Qwen3-Next (the qwen3 family),
Seed-OSS, Granite 3.2 and 4.0-H, Llama 4 (its text decoder), MiniCPM 5 and Hermes 3 (gpt-oss has its own file,
``test_gpt_oss.py``).

For each: detection (also of a renamed copy), the family's exact markup driven through the real tokenizer,
parsers and formatters of all three protocols by ``generate.echo``, earlier calls and their results rendered
back by the template, and one round of real MLX generation.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anthropic
import openai
import pytest
from mlx_lm.utils import load_tokenizer

from flow.builtins import compile_tables
from flow.catalog.families import builtin_families, resolve_family
from protocols.ir import ChatRequest, Message
from runtime.tiny import ensure_tiny_model
from stages.chat import render_prompt
from tests.harness import WEATHER_TOOLS, RunningServer, graph_with_model, running_server, tables_with_model

TOOLS = WEATHER_TOOLS
ANTHROPIC_TOOLS: Any = [{"name": "get_weather", "description": "Weather",
                         "input_schema": TOOLS[0]["function"]["parameters"]}]
REASONING = "The user wants the weather."
RESPONSES_TOOLS: Any = [{"type": "function", "name": "get_weather", "parameters": TOOLS[0]["function"]["parameters"]}]


@dataclass(frozen=True)
class Family:
    preset: str
    family: str
    script: str  # the model's output, as the family writes it: reasoning, "Let me check.", one call
    call_id: str | None  # the id the model wrote for its call (Kimi), else None: flow makes one
    rendered_call: str  # how the template writes the call back into the next prompt
    rendered_result: str  # and its result
    reasoning: bool = True  # the script holds reasoning: "The user wants the weather."
    interleaved: str | None = None  # for families that think between calls: a script doing so


FAMILIES = [
    Family("tiny-deepseek-v3", "deepseek-v3",
           # The template opens <think> itself when thinking is on (mlx-lm's default for a vocabulary with it).
           "The user wants the weather.</think>Let me check.<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather"
           '<｜tool▁sep｜>{"city": "Paris"}<｜tool▁call▁end｜><｜tool▁calls▁end｜>', None,
           '<｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{"city": "Paris"}<｜tool▁call▁end｜>',
           "<｜tool▁output▁begin｜>Sunny<｜tool▁output▁end｜>"),
    Family("tiny-deepseek-r1", "deepseek-r1",
           "The user wants the weather.\n</think>\n\nLet me check.<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function"
           '<｜tool▁sep｜>get_weather\n```json\n{"city": "Paris"}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>', None,
           '<｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n```json\n{"city": "Paris"}\n```<｜tool▁call▁end｜>',
           "<｜tool▁outputs▁begin｜><｜tool▁output▁begin｜>Sunny<｜tool▁output▁end｜>"),
    Family("tiny-kimi-k2", "kimi-k2",
           "<think>The user wants the weather.</think>Let me check.<|tool_calls_section_begin|><|tool_call_begin|>"
           'functions.get_weather:0<|tool_call_argument_begin|>{"city": "Paris"}<|tool_call_end|>'
           "<|tool_calls_section_end|>", "functions.get_weather:0",
           '<|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>{"city": "Paris"}<|tool_call_end|>',
           "## Return of functions.get_weather:0\nSunny"),
    Family("tiny-minimax-m2", "minimax-m2",
           # The template opens <think> in the prompt.
           'The user wants the weather.\n</think>\n\nLet me check.\n<minimax:tool_call>\n<invoke name="get_weather">\n'
           '<parameter name="city">Paris</parameter>\n</invoke>\n</minimax:tool_call>', None,
           '<invoke name="get_weather">\n<parameter name="city">Paris</parameter>', "]~b]tool\n<response>Sunny</response>",
           interleaved='The user wants the weather.\n</think>\n\nLet me check.\n<minimax:tool_call>\n'
           '<invoke name="get_weather">\n<parameter name="city">Paris</parameter>\n</invoke>\n</minimax:tool_call>\n'
           '<think>\nAnd Rome too.\n</think>\n\n<minimax:tool_call>\n<invoke name="get_weather">\n'
           '<parameter name="city">Rome</parameter>\n</invoke>\n</minimax:tool_call>'),
    Family("tiny-gemma4", "gemma4",
           '<|channel>thought\nThe user wants the weather.<channel|>Let me check.<|tool_call>call:get_weather{city:<|"|>'
           'Paris<|"|>}<tool_call|>', None,
           '<|tool_call>call:get_weather{city:<|"|>Paris<|"|>}<tool_call|>', "<|turn>tool\nSunny<turn|>"),
    Family("tiny-phi4-mini", "phi4-mini",
           'Let me check. functools[{"name": "get_weather", "arguments": {"city": "Paris"}}]', None,
           'functools[{"name": "get_weather", "arguments": {"city": "Paris"}}]', "<|tool|>Sunny<|end|>", reasoning=False),
    Family("tiny-qwen3.5", "qwen3.5",
           # Thinking is on by default: the template opens <think> in the prompt.
           "The user wants the weather.\n</think>\n\nLet me check.\n<tool_call>\n<function=get_weather>\n"
           "<parameter=city>\nParis\n</parameter>\n</function>\n</tool_call>", None,
           "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n</function>\n</tool_call>",
           "<tool_response>\nSunny\n</tool_response>"),
    Family("tiny-qwen3-next", "qwen3",
           '<think>The user wants the weather.</think>Let me check.\n<tool_call>\n{"name": "get_weather", '
           '"arguments": {"city": "Paris"}}\n</tool_call>', None,
           '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>',
           "<tool_response>\nSunny\n</tool_response>"),
    Family("tiny-seed-oss", "seed-oss",
           "<seed:think>The user wants the weather.</seed:think>Let me check.\n<seed:tool_call>\n"
           "<function=get_weather>\n<parameter=city>Paris</parameter>\n</function>\n</seed:tool_call>", None,
           "<seed:tool_call>\n<function=get_weather>\n<parameter=city>Paris</parameter>\n</function>\n</seed:tool_call>",
           "<seed:bos>tool\nSunny<seed:eos>"),
    Family("tiny-granite3", "granite",
           # Granite 3.2 thinking (the template's thinking=True) in its phrases; calls after <|tool_call|>.
           "Here is my thought process:\nThe user wants the weather.\n\nHere is my response:\nLet me check."
           '<|tool_call|>[{"name": "get_weather", "arguments": {"city": "Paris"}}]', None,
           # The template renders no calls: they go back as text in the assistant's turn.
           '<|start_of_role|>assistant<|end_of_role|><|tool_call|>[{"name": "get_weather", "arguments": {"city": '
           '"Paris"}}]<|end_of_text|>', "<|start_of_role|>tool<|end_of_role|>Sunny<|end_of_text|>"),
    Family("tiny-granite4", "granite4",
           'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>', None,
           '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>',
           "<|start_of_role|>user<|end_of_role|>\n<tool_response>\nSunny\n</tool_response><|end_of_text|>",
           reasoning=False),
    Family("tiny-llama4", "llama4",
           # A call turn as the template writes one: the prose in python tags, then the call as JSON.
           '<|python_start|>Let me check.<|python_end|>{"name": "get_weather", "parameters": {"city": "Paris"}}', None,
           '<|python_start|><|python_end|>{"name": "get_weather", "parameters": {"city": "Paris"}}<|eot|>',
           '<|header_start|>ipython<|header_end|>\n\n"Sunny"<|eot|>', reasoning=False),
    Family("tiny-minicpm5", "minicpm",
           # The template opens no <think> unless enable_thinking is asked for: the model writes it.
           '<think>\nThe user wants the weather.\n</think>\n\nLet me check.\n<function name="get_weather">'
           '<param name="city">Paris</param></function>', None,
           '<|im_start|>assistant\n<think>\n\n</think>\n\n<function name="get_weather"><param name="city">Paris'
           '</param></function><|im_end|>', "<|im_start|>user\n<tool_response>\nSunny\n</tool_response><|im_end|>"),
    Family("tiny-hermes3", "hermes",
           '<think>The user wants the weather.</think>Let me check.\n<tool_call>\n{"name": "get_weather", '
           '"arguments": {"city": "Paris"}}\n</tool_call>', None,
           '<|im_start|>assistant\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>',
           "<|im_start|>tool\n<tool_response>\nSunny\n</tool_response><|im_end|>"),
]


@pytest.fixture(scope="module", params=FAMILIES, ids=[f.family for f in FAMILIES])
def case(request: pytest.FixtureRequest) -> Family:
    family: Family = request.param
    return family


@pytest.fixture(scope="module")
def echo(case: Family) -> Iterator[RunningServer]:
    tables = tables_with_model(ensure_tiny_model(case.preset))
    tables["stages"]["generate"]["type"] = "generate.echo"
    with running_server(compile_tables(tables, f"echo {case.family}")) as server:
        yield server


def test_detected_and_so_is_a_renamed_copy(case: Family, tmp_path: Path) -> None:
    path = ensure_tiny_model(case.preset)
    template = load_tokenizer(path).chat_template
    assert resolve_family("auto", path, case.preset, template).name == case.family
    renamed = tmp_path / "my-model"
    shutil.copytree(path, renamed)
    assert resolve_family("auto", renamed, "my-model", template).name == case.family


def test_openai_chat(case: Family, echo: RunningServer) -> None:
    c = openai.OpenAI(base_url=echo.url, api_key="x", max_retries=0)
    messages: Any = [{"role": "user", "content": case.script}]
    out = c.chat.completions.create(model="tiny", messages=messages, tools=TOOLS, max_tokens=300)
    message = out.choices[0].message
    assert out.choices[0].finish_reason == "tool_calls" and message.content == "Let me check."
    assert (message.model_extra or {}).get("reasoning_content") == REASONING if case.reasoning else (
        not (message.model_extra or {}).get("reasoning_content"))
    assert message.tool_calls and message.tool_calls[0].function.name == "get_weather"
    assert json.loads(message.tool_calls[0].function.arguments) == {"city": "Paris"}
    if case.call_id is not None:
        assert message.tool_calls[0].id == case.call_id
    with c.chat.completions.stream(model="tiny", messages=messages, tools=TOOLS, max_tokens=300) as stream:
        contents = [e.delta for e in stream if e.type == "content.delta"]
        final = stream.get_final_completion()
    assert "".join(contents) == "Let me check." and not any("<" in piece for piece in contents)
    call = (final.choices[0].message.tool_calls or [])[0]
    assert json.loads(call.function.arguments) == {"city": "Paris"}


def test_anthropic_messages(case: Family, echo: RunningServer) -> None:
    c = anthropic.Anthropic(base_url=echo.base_url, api_key="x", max_retries=0, _strict_response_validation=True)
    with c.messages.stream(model="tiny", max_tokens=300, messages=[{"role": "user", "content": case.script}],
                           tools=ANTHROPIC_TOOLS) as stream:
        final = stream.get_final_message()
    blocks = ["thinking", "text", "tool_use"] if case.reasoning else ["text", "tool_use"]
    assert [b.type for b in final.content] == blocks and final.stop_reason == "tool_use"
    tool_use = final.content[-1]
    assert tool_use.type == "tool_use" and tool_use.input == {"city": "Paris"}
    if case.call_id is not None:
        assert tool_use.id == case.call_id


def test_responses(case: Family, echo: RunningServer) -> None:
    c = openai.OpenAI(base_url=echo.url, api_key="x", max_retries=0)
    response = c.responses.create(model="tiny", input=case.script, tools=RESPONSES_TOOLS, max_output_tokens=300)
    items = ["reasoning", "message", "function_call"] if case.reasoning else ["message", "function_call"]
    assert [o.type for o in response.output] == items
    call = response.output[-1]
    assert call.type == "function_call" and json.loads(call.arguments) == {"city": "Paris"}
    if case.call_id is not None:
        assert call.call_id == case.call_id


INTERLEAVED = [f for f in FAMILIES if f.interleaved is not None]


@pytest.mark.parametrize("case", INTERLEAVED, ids=[f.family for f in INTERLEAVED], indirect=True)
def test_interleaved_thinking_in_every_protocol(case: Family, echo: RunningServer) -> None:
    """Thinking between calls (MiniMax M2): every block is reasoning, in its place where the protocol streams it."""
    assert case.interleaved is not None
    chat = openai.OpenAI(base_url=echo.url, api_key="x", max_retries=0)
    messages: Any = [{"role": "user", "content": case.interleaved}]
    out = chat.chat.completions.create(model="tiny", messages=messages, tools=TOOLS, max_tokens=300)
    message = out.choices[0].message
    assert (message.model_extra or {}).get("reasoning_content") == REASONING + "And Rome too."
    assert message.content == "Let me check."
    assert [json.loads(c.function.arguments) for c in message.tool_calls or []] == [{"city": "Paris"}, {"city": "Rome"}]
    with chat.chat.completions.stream(model="tiny", messages=messages, tools=TOOLS, max_tokens=300) as stream:
        events = list(stream)
    reasoning = "".join(getattr(e.chunk.choices[0].delta, "reasoning_content", None) or ""
                        for e in events if e.type == "chunk" and e.chunk.choices)
    assert reasoning == REASONING + "And Rome too."
    assert not any("think>" in e.delta for e in events if e.type == "content.delta")
    claude = anthropic.Anthropic(base_url=echo.base_url, api_key="x", max_retries=0, _strict_response_validation=True)
    with claude.messages.stream(model="tiny", max_tokens=300, messages=[{"role": "user", "content": case.interleaved}],
                                tools=ANTHROPIC_TOOLS) as claude_stream:
        final = claude_stream.get_final_message()
    assert [b.type for b in final.content] == ["thinking", "text", "tool_use", "thinking", "tool_use"]
    assert [b.thinking for b in final.content if b.type == "thinking"] == [REASONING, "And Rome too."]
    # A whole (non-streamed) answer keeps the same blocks in the same order: stream and non-stream agree.
    claude_whole = claude.messages.create(model="tiny", max_tokens=300, tools=ANTHROPIC_TOOLS,
                                          messages=[{"role": "user", "content": case.interleaved}])
    assert [b.model_dump(exclude={"id"}) for b in claude_whole.content] == [
        b.model_dump(exclude={"id"}) for b in final.content]
    with chat.responses.stream(model="tiny", input=case.interleaved, tools=RESPONSES_TOOLS,
                               max_output_tokens=300) as responses_stream:
        streamed = responses_stream.get_final_response()
    assert [o.type for o in streamed.output] == ["reasoning", "message", "function_call", "reasoning", "function_call"]
    whole = chat.responses.create(model="tiny", input=case.interleaved, tools=RESPONSES_TOOLS, max_output_tokens=300)
    assert [o.model_dump(exclude={"id", "call_id"}, exclude_none=True) for o in whole.output] == [
        o.model_dump(exclude={"id", "call_id"}, exclude_none=True) for o in streamed.output]
    assert [[c.text for c in o.content or []] for o in whole.output if o.type == "reasoning"] == [
        [REASONING], ["And Rome too."]]


def test_calls_and_results_go_back_through_the_template(case: Family) -> None:
    call_id = case.call_id or "call_1"
    history = [
        Message("user", "Weather in Paris?"),
        Message("assistant", "", extra=(("tool_calls", [
            {"id": call_id, "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}},
        ]),)),
        Message("tool", "Sunny", extra=(("tool_call_id", call_id),)),
    ]
    request = ChatRequest(model="m", messages=tuple(history), tools=tuple(TOOLS))
    text = render_prompt(load_tokenizer(ensure_tiny_model(case.preset)), request, builtin_families()[case.family])
    assert case.rendered_call in text and case.rendered_result in text
    assert text.index(case.rendered_call) < text.index(case.rendered_result)
    assert TOOLS[0]["function"]["description"] in text  # the tool itself is described


def test_real_generation_in_every_protocol(case: Family) -> None:
    """Random weights: what is tested is the architecture's real MLX generation under the family's template,
    parsers and stop tokens, in every protocol's shape."""
    with running_server(graph_with_model(ensure_tiny_model(case.preset), name="m")) as server:
        assert server.health()["models"][0]["family"] == case.family
        chat = openai.OpenAI(base_url=server.url, api_key="x", max_retries=0)
        out = chat.chat.completions.create(model="m", messages=[{"role": "user", "content": "Weather in Paris?"}],
                                           tools=TOOLS, max_tokens=5)
        assert out.usage is not None and out.usage.completion_tokens <= 5
        assert out.choices[0].finish_reason in ("stop", "length", "tool_calls")
        claude = anthropic.Anthropic(base_url=server.base_url, api_key="x", max_retries=0)
        with claude.messages.stream(model="m", max_tokens=5, messages=[{"role": "user", "content": "Hi"}],
                                    tools=ANTHROPIC_TOOLS) as stream:
            message = stream.get_final_message()
        assert message.stop_reason in ("end_turn", "max_tokens", "tool_use")
        responses = chat.responses.create(model="m", input="Hi", max_output_tokens=5)
        assert responses.status in ("completed", "incomplete")


@pytest.mark.parametrize("preset", ["tiny-granite4", "tiny-qwen3.5"])
def test_recurrent_layers_prefill_together(preset: str) -> None:
    """Mamba-2 (Granite 4.0-H) and gated-delta (Qwen3.5) layers keep state, not positions: prompts that arrive
    together are prefilled together (their prefix cache keeps snapshots at the prompts' ends only), greedy
    answers as each alone gives."""
    from concurrent.futures import ThreadPoolExecutor

    with running_server(graph_with_model(ensure_tiny_model(preset), name="m")) as server:
        chat = openai.OpenAI(base_url=server.url, api_key="x", max_retries=0)

        def answer(i: int) -> str | None:
            out = chat.chat.completions.create(model="m", messages=[{"role": "user", "content": "Hi " * (1 + 40 * i)}],
                                               max_tokens=8, temperature=0)
            return out.choices[0].message.content

        with ThreadPoolExecutor(4) as pool:
            together = list(pool.map(answer, range(4)))
        assert together == [answer(i) for i in range(4)]


def test_probe_keeps_the_family_markers_and_serving_drops_them_for_another_parser(tmp_path: Path) -> None:
    """``flow probe`` reads a real answer with the family's own parser configured by its file (Seed-OSS:
    ``xml_calls`` in ``<seed:tool_call>``); if it records another parser, serving gives that one its defaults."""
    from dataclasses import replace

    from flow.catalog.capabilities import CapabilityStore, family_from_capabilities
    from flow.cli.main import main
    from protocols.parsers import make_tool_parser

    db = tmp_path / "caps.sqlite"
    assert main(["probe", "tiny:tiny-seed-oss", "--max-tokens", "8", "--db", str(db)]) == 0
    (caps,) = CapabilityStore(db).all()
    assert (caps.family, caps.tool_delivery, caps.reasoning_parser) == ("seed-oss", "template", "think_tag")
    served = family_from_capabilities(replace(caps, tool_parser="xml_calls"), builtin_families())
    assert served.tools.options["wrapper"] == ["<seed:tool_call>", "</seed:tool_call>"]
    other = family_from_capabilities(replace(caps, tool_parser="hermes_json"), builtin_families())
    assert other.tools.options == {} and other.reasoning.options["start"] == "<seed:think>"
    make_tool_parser(other.tools.parser, TOOLS, options=other.tools.options)  # a parser it can make


def test_granite_thinking_switch_reaches_the_template() -> None:
    """Granite 3.2's ``thinking`` asks for the thought-process sections (the template does so only without tools or
    a system message of the client's); thinking off or unsaid leaves the plain system message."""
    tokenizer = load_tokenizer(ensure_tiny_model("tiny-granite3"))
    family = builtin_families()["granite"]
    hi = (Message("user", "Hi"),)
    on = render_prompt(tokenizer, ChatRequest(model="m", messages=hi, thinking=True), family)
    assert "Write your thoughts after 'Here is my thought process:'" in on
    assert on.endswith("<|start_of_role|>assistant<|end_of_role|>")
    for thinking in (False, None):
        plain = render_prompt(tokenizer, ChatRequest(model="m", messages=hi, thinking=thinking), family)
        assert "thought process" not in plain and "You are a helpful AI assistant." in plain


def test_seed_oss_thinking_budget_reaches_the_template() -> None:
    """Anthropic's ``budget_tokens`` becomes Seed-OSS's ``thinking_budget``; thinking switched off is a budget of 0."""
    tokenizer = load_tokenizer(ensure_tiny_model("tiny-seed-oss"))
    family = builtin_families()["seed-oss"]
    hi = (Message("user", "Hi"),)
    budgeted = render_prompt(tokenizer, ChatRequest(model="m", messages=hi, thinking=True, reasoning_budget=512), family)
    assert "your thinking budget" not in budgeted and "which is 512" in budgeted
    off = render_prompt(tokenizer, ChatRequest(model="m", messages=hi, thinking=False), family)
    assert "your thinking budget is 0" in off and off.endswith("<seed:think><seed:cot_budget_reflect>")
    default = render_prompt(tokenizer, ChatRequest(model="m", messages=hi), family)
    assert "thinking budget" not in default
