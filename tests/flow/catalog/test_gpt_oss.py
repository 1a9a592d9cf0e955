"""gpt-oss end to end: a tiny random-weight ``gpt_oss`` model with the real harmony chat template.

With ``generate.echo`` the client's last message comes back as the model's output through the real
tokenizer (harmony's markers are its special tokens), the harmony parser and every protocol's
formatter; without it, real MLX generation runs the same path.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
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
ANALYSIS = "<|channel|>analysis<|message|>The user wants the weather in Paris.<|end|>"
CALL = ('<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>'
        '{"city": "Paris"}<|call|>')
SCRIPT = ANALYSIS + CALL
ANSWER = ANALYSIS + "<|start|>assistant<|channel|>final<|message|>It is sunny in Paris.<|return|>"


@pytest.fixture(scope="session")
def tiny_gpt_oss() -> Path:
    return ensure_tiny_model("tiny-gpt-oss")


@pytest.fixture(scope="module")
def echo(tiny_gpt_oss: Path) -> Iterator[RunningServer]:
    tables = tables_with_model(tiny_gpt_oss)
    tables["stages"]["generate"]["type"] = "generate.echo"
    with running_server(compile_tables(tables, "echo gpt-oss")) as server:
        yield server


def prompt(tiny_gpt_oss: Path, messages: list[Message], **kwargs: Any) -> str:
    request = ChatRequest(model="m", messages=tuple(messages), **kwargs)
    return render_prompt(load_tokenizer(tiny_gpt_oss), request, builtin_families()["gpt-oss"])


def test_detected_by_config_and_by_template_when_renamed(tiny_gpt_oss: Path, tmp_path: Path) -> None:
    template = load_tokenizer(tiny_gpt_oss).chat_template
    assert resolve_family("auto", tiny_gpt_oss, "tiny-gpt-oss", template).name == "gpt-oss"
    renamed = tmp_path / "my-assistant"
    shutil.copytree(tiny_gpt_oss, renamed)
    config = json.loads((renamed / "config.json").read_text())
    (renamed / "config.json").write_text(json.dumps({**config, "model_type": "custom", "architectures": []}))
    assert resolve_family("auto", renamed, "my-assistant", template).name == "gpt-oss"


def test_reasoning_effort_reaches_the_template(tiny_gpt_oss: Path) -> None:
    hi = [Message("user", "hi")]
    assert "Reasoning: medium" in prompt(tiny_gpt_oss, hi)
    assert "Reasoning: high" in prompt(tiny_gpt_oss, hi, reasoning_effort="high", thinking=True)
    assert "Reasoning: low" in prompt(tiny_gpt_oss, hi, reasoning_effort="none", thinking=False)


def test_tool_calls_and_results_are_rendered_back_as_harmony_messages(tiny_gpt_oss: Path) -> None:
    history = [
        Message("user", "Weather in Paris and Rome?"),
        Message("assistant", "", extra=(("reasoning_content", "Two cities."), ("tool_calls", [
            {"id": "call_a", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}},
            {"id": "call_b", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Rome"}}},
        ]))),
        Message("tool", "Sunny", extra=(("tool_call_id", "call_a"),)),
        Message("tool", "Rainy", extra=(("tool_call_id", "call_b"),)),
    ]
    text = prompt(tiny_gpt_oss, history, tools=tuple(TOOLS))
    # One call per assistant message (the template's rule), each followed by its result.
    paris = text.index('<|start|>assistant to=functions.get_weather<|channel|>commentary json<|message|>'
                       '{"city": "Paris"}<|call|>')
    sunny = text.index('<|start|>functions.get_weather to=assistant<|channel|>commentary<|message|>"Sunny"<|end|>')
    rome = text.index('{"city": "Rome"}<|call|>')
    assert paris < sunny < rome < text.index('"Rainy"')
    assert "<|start|>assistant<|channel|>analysis<|message|>Two cities.<|end|>" in text  # reasoning kept for the call
    assert "type get_weather = (_: {" in text and text.endswith("<|start|>assistant")


def test_stop_tokens_are_the_vocabularys_own(tiny_gpt_oss: Path) -> None:
    """<|return|> and <|call|> end generation (chat.prepare adds the family's stop tokens to the model's)."""
    tokenizer = load_tokenizer(tiny_gpt_oss)
    stops = builtin_families()["gpt-oss"].stop_tokens
    assert stops == ["<|return|>", "<|call|>"]
    assert [tokenizer.decode([tokenizer.convert_tokens_to_ids(t)]) for t in stops] == stops


def test_openai_chat(echo: RunningServer) -> None:
    c = openai.OpenAI(base_url=echo.url, api_key="x", max_retries=0)
    out = c.chat.completions.create(model="tiny", messages=[{"role": "user", "content": SCRIPT}], tools=TOOLS,
                                    max_tokens=300)
    message = out.choices[0].message
    assert out.choices[0].finish_reason == "tool_calls" and not message.content
    assert message.model_extra and message.model_extra["reasoning_content"] == "The user wants the weather in Paris."
    assert message.tool_calls and message.tool_calls[0].function.name == "get_weather"
    assert json.loads(message.tool_calls[0].function.arguments) == {"city": "Paris"}
    with c.chat.completions.stream(model="tiny", messages=[{"role": "user", "content": ANSWER}], max_tokens=300,
                                   reasoning_effort="high") as stream:
        contents = [e.delta for e in stream if e.type == "content.delta"]
        final = stream.get_final_completion()
    assert "".join(contents) == "It is sunny in Paris." and not any("<|" in piece for piece in contents)
    assert final.choices[0].finish_reason == "stop"


def test_anthropic_messages(echo: RunningServer) -> None:
    c = anthropic.Anthropic(base_url=echo.base_url, api_key="x", max_retries=0, _strict_response_validation=True)
    tools: Any = [{"name": "get_weather", "description": "Weather", "input_schema": TOOLS[0]["function"]["parameters"]}]
    with c.messages.stream(model="tiny", max_tokens=300, messages=[{"role": "user", "content": SCRIPT}],
                           tools=tools) as stream:
        final = stream.get_final_message()
    assert [b.type for b in final.content] == ["thinking", "tool_use"] and final.stop_reason == "tool_use"
    assert final.content[1].type == "tool_use" and final.content[1].input == {"city": "Paris"}
    answer = c.messages.create(model="tiny", max_tokens=300, messages=[{"role": "user", "content": ANSWER}])
    assert [b.type for b in answer.content] == ["thinking", "text"]
    assert answer.content[1].type == "text" and answer.content[1].text == "It is sunny in Paris."


def test_responses_call_and_its_result_in_the_next_turn(echo: RunningServer) -> None:
    c = openai.OpenAI(base_url=echo.url, api_key="x", max_retries=0)
    tools: Any = [{"type": "function", "name": "get_weather", "parameters": TOOLS[0]["function"]["parameters"]}]
    response = c.responses.create(model="tiny", input=SCRIPT, tools=tools, max_output_tokens=300,
                                  reasoning={"effort": "low"})
    assert [o.type for o in response.output] == ["reasoning", "function_call"]
    call = response.output[1]
    assert call.type == "function_call" and json.loads(call.arguments) == {"city": "Paris"}
    follow = c.responses.create(model="tiny", previous_response_id=response.id, tools=tools, max_output_tokens=300,
                                input=[{"type": "function_call_output", "call_id": call.call_id, "output": "Sunny"}])
    assert follow.status == "completed"


def test_real_generation_in_every_protocol(tiny_gpt_oss: Path) -> None:
    """Random weights: the answers mean nothing; the harmony template, real MLX generation of the gpt_oss
    architecture, the harmony parser and every protocol's shape are what is tested."""
    with running_server(graph_with_model(tiny_gpt_oss, name="m")) as server:
        assert server.health()["models"][0]["family"] == "gpt-oss"
        chat = openai.OpenAI(base_url=server.url, api_key="x", max_retries=0)
        out = chat.chat.completions.create(model="m", messages=[{"role": "user", "content": "Weather in Paris?"}],
                                           tools=TOOLS, max_tokens=6, reasoning_effort="low")
        assert out.usage is not None and out.usage.prompt_tokens > 60  # the tools' namespace reached the prompt
        assert out.choices[0].finish_reason in ("stop", "length", "tool_calls")
        claude = anthropic.Anthropic(base_url=server.base_url, api_key="x", max_retries=0)
        message = claude.messages.create(model="m", max_tokens=6, messages=[{"role": "user", "content": "Hi"}])
        assert message.stop_reason in ("end_turn", "max_tokens", "tool_use")
        responses = chat.responses.create(model="m", input="Hi", max_output_tokens=6)
        assert responses.status in ("completed", "incomplete")
