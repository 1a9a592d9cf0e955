"""Loose tool calls end to end: the qwen2 family takes Qwen2.5's markup-less calls.

As in ``test_families.py``, ``generate`` is swapped for ``generate.echo``: the client's last message comes
back as the "model output" through the real tokenizer, detokenizer, family parsers and formatters, so a
bare JSON call is reproducible on a random-weight model. Real Qwen2.5-Coder writing such calls is
``tests/real/test_qwen_tools.py``.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anthropic
import openai
import pytest

from flow.builtins import compile_tables
from flow.catalog.families import builtin_families, resolve_family
from protocols.ir import ChatRequest, Message
from stages.chat import response_parser
from tests.harness import WEATHER_TOOLS, RunningServer, running_server, tables_with_model

TOOLS = WEATHER_TOOLS
CALL = '{"name": "get_weather", "arguments": {"city": "Paris"}}'
FENCED = f"I'll look it up.\n```json\n{CALL}\n```"


@pytest.fixture(scope="module")
def echo_qwen2(tiny_qwen3: Path) -> Iterator[RunningServer]:
    tables = tables_with_model(tiny_qwen3, family="qwen2")
    tables["stages"]["generate"]["type"] = "generate.echo"
    with running_server(compile_tables(tables, "echo qwen2")) as server:
        yield server


@pytest.mark.parametrize(("model_type", "name", "family"), [
    ("qwen2", "Qwen2.5-Coder-0.5B-Instruct", "qwen2"),
    ("qwen2", "Qwen2-7B-Instruct", "qwen2"),
    ("qwen2", "DeepSeek-R1-Distill-Qwen-7B", "qwen2"),
    ("qwen2", "QwQ-32B", "qwen3"),
    ("qwen3", "Qwen3-4B", "qwen3"),
])
def test_qwen2_models_get_the_qwen2_family(tmp_path_factory: pytest.TempPathFactory, model_type: str, name: str,
                                           family: str) -> None:
    path = tmp_path_factory.mktemp("model")  # not tmp_path: its name holds the test's, which says qwen2
    (path / "config.json").write_text(json.dumps({"model_type": model_type}))
    assert resolve_family("auto", path, name, "{{ '<tool_call>' }}").name == family


def test_loose_calls_are_on_for_qwen2_and_off_by_default() -> None:
    families = builtin_families()
    assert families["qwen2"].tools.loose_calls and families["qwen2"].reasoning.toggle == ""
    assert not families["qwen3"].tools.loose_calls and not families["default"].tools.loose_calls


def test_the_chat_stage_takes_the_option_from_the_family() -> None:
    family = builtin_families()["qwen2"]
    asked = ChatRequest(model="m", messages=(Message("user", "Weather?"),), tools=tuple(TOOLS))
    declined = ChatRequest(model="m", messages=(Message("user", "Weather?"),), tools=tuple(TOOLS), tool_choice="none")
    parser = response_parser(asked, family, "prompt")
    assert parser is not None and [type(e).__name__ for e in parser.parse(CALL)] == ["ToolCallDelta"]
    parser = response_parser(declined, family, "prompt")
    assert parser is not None and [type(e).__name__ for e in parser.parse(CALL)] == ["TextDelta"]


def test_openai_chat_takes_a_fenced_call_streamed_and_not(echo_qwen2: RunningServer) -> None:
    c = openai.OpenAI(base_url=echo_qwen2.url, api_key="x", max_retries=0)
    messages: Any = [{"role": "user", "content": FENCED}]
    out = c.chat.completions.create(model="tiny", messages=messages, tools=TOOLS, max_tokens=200)
    message = out.choices[0].message
    assert out.choices[0].finish_reason == "tool_calls" and message.content == "I'll look it up."
    assert message.tool_calls and message.tool_calls[0].function.name == "get_weather"
    assert json.loads(message.tool_calls[0].function.arguments) == {"city": "Paris"}
    with c.chat.completions.stream(model="tiny", messages=messages, tools=TOOLS, max_tokens=200) as stream:
        contents = [e.delta for e in stream if e.type == "content.delta"]
        final = stream.get_final_completion()
    assert "".join(contents) == "I'll look it up." and not any("`" in piece or "{" in piece for piece in contents)
    call = final.choices[0].message.tool_calls[0]  # type: ignore[index]
    assert call.function.name == "get_weather" and json.loads(call.function.arguments) == {"city": "Paris"}


def test_anything_else_stays_text(echo_qwen2: RunningServer) -> None:
    c = openai.OpenAI(base_url=echo_qwen2.url, api_key="x", max_retries=0)
    for text in ['{"name": "launch", "arguments": {}}', f"{CALL} and then?", FENCED]:
        tools = TOOLS if text != FENCED else openai.NOT_GIVEN  # without tools nothing is a call
        out = c.chat.completions.create(model="tiny", messages=[{"role": "user", "content": text}], tools=tools,
                                        max_tokens=200)
        assert out.choices[0].message.content == text and not out.choices[0].message.tool_calls


def test_anthropic_tool_use_from_a_bare_call(echo_qwen2: RunningServer) -> None:
    c = anthropic.Anthropic(base_url=echo_qwen2.base_url, api_key="x", max_retries=0,
                            _strict_response_validation=True)
    tools: Any = [{"name": "get_weather", "description": "Weather", "input_schema": TOOLS[0]["function"]["parameters"]}]
    with c.messages.stream(model="tiny", max_tokens=200, tools=tools,
                           messages=[{"role": "user", "content": CALL}]) as stream:
        final = stream.get_final_message()
    assert final.stop_reason == "tool_use" and [b.type for b in final.content] == ["tool_use"]
    assert final.content[0].type == "tool_use" and final.content[0].input == {"city": "Paris"}


def test_responses_function_call_from_a_list_of_calls(echo_qwen2: RunningServer) -> None:
    c = openai.OpenAI(base_url=echo_qwen2.url, api_key="x", max_retries=0)
    tools: Any = [{"type": "function", "name": "get_weather", "parameters": TOOLS[0]["function"]["parameters"]}]
    text = f'[{CALL}, {CALL.replace("Paris", "Rome")}]'
    response = c.responses.create(model="tiny", input=text, tools=tools, max_output_tokens=200)
    calls = [o for o in response.output if o.type == "function_call"]
    assert [json.loads(o.arguments)["city"] for o in calls] == ["Paris", "Rome"]
