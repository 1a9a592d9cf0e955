"""Families end to end: detection, template adaptation, and parsed tool calls and reasoning in every protocol.

The tool-call tests swap ``generate`` for ``generate.echo`` (one graph line): the
client's last message comes back as the "model output" through the real
tokenizer, detokenizer, family parsers and protocol formatters, so tool-call
markup is reproducible on random-weight models.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anthropic
import httpx
import openai
import pytest
from mlx_lm.utils import load_tokenizer

from flow.builtins import compile_tables
from flow.catalog.families import builtin_families, load_families, resolve_family
from flow.graph.spec import load_tables
from protocols.ir import ChatRequest, Message
from runtime.tiny import ensure_tiny_model
from stages.chat import render_prompt
from tests.harness import GRAPHS, WEATHER_TOOLS, RunningServer, graph_with_model, running_server

TOOLS = WEATHER_TOOLS
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
SCRIPT = f"<think>The user wants weather.</think>Let me check. {CALL}"


@pytest.fixture(scope="module")
def echo_server(tiny_qwen3: Path) -> Iterator[RunningServer]:
    tables = load_tables(GRAPHS / "default.toml")
    tables["resources"]["model"].update(path=str(tiny_qwen3), name="tiny", aliases=[])
    tables["stages"]["generate"]["type"] = "generate.echo"
    with running_server(compile_tables(tables, "echo")) as server:
        yield server


# --------------------------------------------------------------------------- detection and templates


@pytest.mark.parametrize(("preset", "family"), [("tiny-qwen3", "qwen3"), ("tiny-llama", "llama3"),
                                               ("tiny-gemma3", "gemma3")])
def test_auto_detection(preset: str, family: str) -> None:
    path = ensure_tiny_model(preset)
    tokenizer = load_tokenizer(path)
    assert resolve_family("auto", path, preset, tokenizer.chat_template).name == family


def test_every_family_file_validates_and_names_known_parsers() -> None:
    families = load_families()
    assert {"default", "qwen3", "qwen3-coder", "llama3", "glm4", "gemma3", "mistral", "lfm2"} <= set(families)
    assert families["qwen3-coder"].reasoning.parser == "null" and families["qwen3-coder"].stop_tokens == ["<|im_end|>", "<|im_start|>"]


def prompt_for(preset: str, family: str, messages: list[Message], **kwargs: Any) -> str:
    tokenizer = load_tokenizer(ensure_tiny_model(preset))
    request = ChatRequest(model="m", messages=tuple(messages), **kwargs)
    return render_prompt(tokenizer, request, builtin_families()[family])


HISTORY = [
    Message("user", "Weather in Paris and Rome?"),
    Message("assistant", "", extra=(("tool_calls", [
        {"id": "call_a", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}},
        {"id": "call_b", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Rome"}}},
    ]),)),
    Message("tool", "Sunny", extra=(("tool_call_id", "call_a"),)),
    Message("tool", "Rainy", extra=(("tool_call_id", "call_b"),)),
    Message("user", "Thanks. And Oslo?"),
]


def test_gemma3_gets_injected_tools_and_tool_results_as_user_turns() -> None:
    text = prompt_for("tiny-gemma3", "gemma3", HISTORY, tools=tuple(TOOLS))
    assert '"name": "get_weather"' in text and "[function_name(parameter=value" in text
    assert "[get_weather(city='Paris'), get_weather(city='Rome')]" in text
    assert "<tool_response>\nSunny\n</tool_response>" in text and "Thanks. And Oslo?" in text


def test_llama3_splits_multi_call_turns() -> None:
    text = prompt_for("tiny-llama", "llama3", HISTORY, tools=tuple(TOOLS))
    paris, rome = text.index('"city": "Paris"'), text.index('"city": "Rome"')
    assert paris < text.index("Sunny") < rome < text.index("Rainy")


def test_qwen3_thinking_toggle_and_tool_choice() -> None:
    off = prompt_for("tiny-qwen3", "qwen3", [Message("user", "hi")], thinking=False)
    assert off.rstrip().endswith("</think>")
    required = prompt_for("tiny-qwen3", "qwen3", [Message("user", "hi")], tools=tuple(TOOLS), tool_choice="required")
    assert "You must answer with at least one function call." in required and "get_weather" in required
    hidden = prompt_for("tiny-qwen3", "qwen3", [Message("user", "hi")], tools=tuple(TOOLS), tool_choice="none")
    assert "get_weather" not in hidden


MID_SYSTEM = [Message("system", "You are terse."), Message("user", "Hi"), Message("assistant", "Hello."),
              Message("system", "The date is 2026-11-22."), Message("user", "What day is it?")]


@pytest.mark.parametrize(("preset", "family"), [("tiny-qwen3", "qwen3"), ("tiny-llama", "llama3"),
                                               ("tiny-gemma3", "gemma3")])
def test_mid_conversation_system_turns_render_in_every_family(preset: str, family: str) -> None:
    """Claude Code sends system turns inside ``messages``: kept where the template renders them, else
    folded into the next user turn (Gemma 3's template rejects any non-alternating role)."""
    text = prompt_for(preset, family, MID_SYSTEM)
    assert text.index("Hello.") < text.index("The date is 2026-11-22.") < text.index("What day is it?")
    mode = builtin_families()[family].mid_system
    assert mode == ("keep" if family == "qwen3" else "user")
    if mode == "keep":
        assert "<|im_start|>system\nThe date is 2026-11-22." in text


def test_mistral_ids_are_rewritten_to_nine_alphanumerics() -> None:
    from stages.templating import template_inputs

    request = ChatRequest(model="m", messages=tuple(HISTORY))
    messages, _, _ = template_inputs(request, builtin_families()["mistral"], "{{ tools }}")
    ids = [c["id"] for m in messages for c in m.get("tool_calls", [])]
    results = [m["tool_call_id"] for m in messages if m["role"] == "tool"]
    assert ids == results and all(len(i) == 9 and i.isalnum() for i in ids)


def test_a_new_family_is_one_toml_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, tiny_llama: Path) -> None:
    (tmp_path / "my-llama.toml").write_text(
        'name = "my-llama"\ndescription = "a fine-tune that writes pythonic calls"\n\n'
        '[detect]\nmodel_types = ["llama"]\nname_patterns = ["tiny-llama"]\npriority = 50\n\n'
        '[tools]\nparser = "pythonic"\ndelivery = "injected"\n')
    monkeypatch.setenv("FLOW_FAMILY_PATH", str(tmp_path))
    builtin_families.cache_clear()
    try:
        tables = load_tables(GRAPHS / "default.toml")
        tables["resources"]["model"].update(path=str(tiny_llama), name="tiny-llama", aliases=[])
        with running_server(compile_tables(tables, "new family")) as server:
            assert server.health()["models"][0]["family"] == "my-llama"
    finally:
        monkeypatch.delenv("FLOW_FAMILY_PATH")
        builtin_families.cache_clear()


# --------------------------------------------------------------------------- parsed output in every protocol


def test_openai_chat_tool_calls_and_reasoning(echo_server: RunningServer) -> None:
    c = openai.OpenAI(base_url=echo_server.url, api_key="x", max_retries=0)
    messages: Any = [{"role": "user", "content": SCRIPT}]
    out = c.chat.completions.create(model="tiny", messages=messages, tools=TOOLS, max_tokens=200)
    message = out.choices[0].message
    assert out.choices[0].finish_reason == "tool_calls"
    assert message.content == "Let me check."
    assert message.model_extra and message.model_extra["reasoning_content"] == "The user wants weather."
    assert message.tool_calls and message.tool_calls[0].function.name == "get_weather"
    assert json.loads(message.tool_calls[0].function.arguments) == {"city": "Paris"}
    assert message.tool_calls[0].id.startswith("call_")
    with c.chat.completions.stream(model="tiny", messages=messages, tools=TOOLS, max_tokens=200) as stream:
        contents = [e.delta for e in stream if e.type == "content.delta"]
        final = stream.get_final_completion()
    assert "".join(contents) == "Let me check." and not any("<" in piece for piece in contents)
    call = final.choices[0].message.tool_calls[0]  # type: ignore[index]
    assert call.function.name == "get_weather" and json.loads(call.function.arguments) == {"city": "Paris"}
    assert final.choices[0].finish_reason == "tool_calls"


def test_without_tools_markup_is_plain_content(echo_server: RunningServer) -> None:
    c = openai.OpenAI(base_url=echo_server.url, api_key="x", max_retries=0)
    out = c.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Hi " + CALL}], max_tokens=200)
    assert out.choices[0].finish_reason == "stop" and out.choices[0].message.content == "Hi " + CALL


def test_anthropic_tool_use_and_thinking_blocks(echo_server: RunningServer) -> None:
    c = anthropic.Anthropic(base_url=echo_server.base_url, api_key="x", max_retries=0,
                            _strict_response_validation=True)
    tools: Any = [{"name": "get_weather", "description": "Weather", "input_schema": TOOLS[0]["function"]["parameters"]}]
    messages: Any = [{"role": "user", "content": SCRIPT}]
    message = c.messages.create(model="tiny", max_tokens=200, messages=messages, tools=tools)
    assert [b.type for b in message.content] == ["thinking", "text", "tool_use"]
    assert message.stop_reason == "tool_use"
    tool_use = message.content[2]
    assert tool_use.type == "tool_use" and tool_use.input == {"city": "Paris"} and tool_use.id.startswith("toolu_")
    with c.messages.stream(model="tiny", max_tokens=200, messages=messages, tools=tools) as stream:
        final = stream.get_final_message()
    assert [b.type for b in final.content] == ["thinking", "text", "tool_use"]
    assert final.content[2].type == "tool_use" and final.content[2].input == {"city": "Paris"}
    assert final.content[0].type == "thinking" and final.content[0].thinking == "The user wants weather."
    r = httpx.post(echo_server.base_url + "/v1/messages", json={
        "model": "tiny", "max_tokens": 200, "messages": messages, "tools": tools, "stream": True})
    from tests.stages.test_server_anthropic import check_grammar, parse_sse

    events = parse_sse(r.text)
    check_grammar(events)
    assert any(d["delta"]["type"] == "input_json_delta" for n, d in events if n == "content_block_delta")


def test_responses_function_call_and_reasoning_items(echo_server: RunningServer) -> None:
    c = openai.OpenAI(base_url=echo_server.url, api_key="x", max_retries=0)
    tools: Any = [{"type": "function", "name": "get_weather", "parameters": TOOLS[0]["function"]["parameters"]}]
    response = c.responses.create(model="tiny", input=SCRIPT, tools=tools, max_output_tokens=200)
    assert [o.type for o in response.output] == ["reasoning", "message", "function_call"]
    call = response.output[2]
    assert call.type == "function_call" and call.name == "get_weather" and json.loads(call.arguments) == {"city": "Paris"}
    with c.responses.stream(model="tiny", input=SCRIPT, tools=tools, max_output_tokens=200) as stream:
        events = list(stream)
        final = stream.get_final_response()
    types = [e.type for e in events]
    assert "response.function_call_arguments.delta" in types and "response.reasoning_text.delta" in types
    assert [o.type for o in final.output] == ["reasoning", "message", "function_call"]
    # The call can be answered in the next turn through previous_response_id.
    follow = c.responses.create(model="tiny", previous_response_id=final.id, tools=tools, max_output_tokens=50,
                                input=[{"type": "function_call_output", "call_id": call.call_id, "output": "Sunny"}])
    assert follow.output_text


def test_openai_tool_choice_parallel_calls_and_reasoning_effort(echo_server: RunningServer) -> None:
    c = openai.OpenAI(base_url=echo_server.url, api_key="x", max_retries=0)
    two = f"{CALL}\n{CALL.replace('Paris', 'Rome')}"
    both = c.chat.completions.create(model="tiny", messages=[{"role": "user", "content": two}], tools=TOOLS,
                                     max_tokens=200)
    calls = both.choices[0].message.tool_calls or []
    assert [json.loads(t.function.arguments)["city"] for t in calls] == ["Paris", "Rome"]
    assert len({t.id for t in calls}) == 2
    one = c.chat.completions.create(model="tiny", messages=[{"role": "user", "content": two}], tools=TOOLS,
                                    parallel_tool_calls=False, max_tokens=200)
    assert len(one.choices[0].message.tool_calls or []) == 1
    none = c.chat.completions.create(model="tiny", messages=[{"role": "user", "content": two}], tools=TOOLS,
                                     tool_choice="none", max_tokens=200)
    assert not none.choices[0].message.tool_calls and none.choices[0].message.content == two
    named = c.chat.completions.create(model="tiny", messages=[{"role": "user", "content": CALL}], tools=TOOLS,
                                      tool_choice={"type": "function", "function": {"name": "get_weather"}},
                                      reasoning_effort="none", max_tokens=200)
    assert named.choices[0].finish_reason == "tool_calls"
    bad = httpx.post(echo_server.url + "/chat/completions", json={
        "model": "tiny", "messages": [{"role": "user", "content": "x"}], "tool_choice": "sometimes"})
    assert bad.status_code == 400 and "tool_choice" in bad.json()["error"]["message"]


def test_history_with_tool_calls_reaches_every_template(echo_server: RunningServer) -> None:
    c = openai.OpenAI(base_url=echo_server.url, api_key="x", max_retries=0)
    messages: Any = [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function", "function": {
            "name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "Sunny"},
        {"role": "user", "content": "Thanks!"},
    ]
    out = c.chat.completions.create(model="tiny", messages=messages, tools=TOOLS, max_tokens=50)
    assert out.choices[0].message.content == "Thanks!"
    assert out.usage is not None and out.usage.prompt_tokens > 40


# --------------------------------------------------------------------------- real MLX, three architectures


@pytest.mark.parametrize(("preset", "family"), [("tiny-qwen3", "qwen3"), ("tiny-llama", "llama3"),
                                               ("tiny-gemma3", "gemma3")])
def test_real_models_serve_tool_requests_in_every_protocol(preset: str, family: str) -> None:
    """Random weights, so the answers mean nothing: the path is what is tested — the family's tool
    delivery through the real template, real generation, the family's parser, every protocol's shape."""
    with running_server(graph_with_model(ensure_tiny_model(preset), name="m")) as server:
        assert server.health()["models"][0]["family"] == family
        chat = openai.OpenAI(base_url=server.url, api_key="x", max_retries=0)
        plain = chat.chat.completions.create(model="m", messages=[{"role": "user", "content": "Weather in Paris?"}],
                                             max_tokens=4)
        with_tools = chat.chat.completions.create(model="m", messages=[{"role": "user", "content": "Weather in Paris?"}],
                                                  tools=TOOLS, max_tokens=4)
        assert plain.usage is not None and with_tools.usage is not None
        assert with_tools.usage.prompt_tokens > plain.usage.prompt_tokens + 20  # the tool schema reached the prompt
        assert with_tools.choices[0].finish_reason in ("stop", "length", "tool_calls")
        stream = chat.chat.completions.create(model="m", messages=[{"role": "user", "content": "Weather in Paris?"}],
                                              tools=TOOLS, max_tokens=6, stream=True)
        assert [c.choices[0].finish_reason for c in stream if c.choices][-1] in ("stop", "length", "tool_calls")

        claude = anthropic.Anthropic(base_url=server.base_url, api_key="x", max_retries=0)
        tools: Any = [{"name": "get_weather", "description": "Weather for a city",
                       "input_schema": TOOLS[0]["function"]["parameters"]}]
        with claude.messages.stream(model="m", max_tokens=6, tools=tools,
                                    messages=[{"role": "user", "content": "Weather in Paris?"}]) as s:
            final = s.get_final_message()
        u = final.usage
        prompt = u.input_tokens + (u.cache_read_input_tokens or 0) + (u.cache_creation_input_tokens or 0)
        assert final.stop_reason in ("end_turn", "max_tokens", "tool_use") and prompt > 20

        responses = chat.responses.create(model="m", input="Weather in Paris?", max_output_tokens=6, tools=[
            {"type": "function", "name": "get_weather", "parameters": TOOLS[0]["function"]["parameters"]}])
        assert responses.status in ("completed", "incomplete") and responses.usage is not None
