"""Qwen2.5-Coder-0.5B-Instruct (trained weights) calls a tool in every protocol, then answers from its result.

This model picks the right tool and arguments but writes the call as bare JSON, never inside the
``<tool_call>`` its template asks for: the qwen2 family's loose tool calls turn it into ``tool_calls``,
``tool_use`` and ``function_call``. The result goes back in each protocol's own shape and the model's
answer reports the temperature it was given. Decode here runs ~4 tokens/s, so every turn is short.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import anthropic
import httpx
import openai
import pytest

from tests.real.conftest import RealModel, RealServer, real_server

pytestmark = pytest.mark.real

QUESTION = "What is the weather like in Paris right now?"
WEATHER = {"type": "object", "properties": {"city": {"type": "string", "description": "The city name"}},
           "required": ["city"]}
DESCRIPTION = "Get the current weather in a city"
RESULT = json.dumps({"temperature_c": 21, "conditions": "sunny"})
# The 0.5B model calls the tool again when a tool result is all it gets; asked to use it, it answers.
FOLLOW_UP = "Answer my question in one sentence using that result."
CALL_TOKENS, ANSWER_TOKENS = 40, 40
GREEDY: Any = {"temperature": 0}  # in the body: the installed Anthropic SDK's create() has no temperature argument
PARIS = [("get_weather", {"city": "Paris"})]  # the one call the question asks for


@pytest.fixture(scope="module")
def qwen(real_model: RealModel, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RealServer]:
    with real_server(real_model("qwen2.5-coder-0.5b-instruct"), tmp_path_factory.mktemp("qwen")) as server:
        assert httpx.get(server.base_url + "/health", timeout=30).json()["models"][0]["family"] == "qwen2"
        yield server


def openai_client(server: RealServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url, api_key="unused", max_retries=0, timeout=300)


def test_openai_chat_tool_call_then_answer(qwen: RealServer) -> None:
    c = openai_client(qwen)
    tools: Any = [{"type": "function", "function": {"name": "get_weather", "description": DESCRIPTION,
                                                    "parameters": WEATHER}}]
    messages: list[Any] = [{"role": "user", "content": QUESTION}]
    first = c.chat.completions.create(model=qwen.model, messages=messages, tools=tools, max_tokens=CALL_TOKENS,
                                      temperature=0)
    assert first.choices[0].finish_reason == "tool_calls" and not first.choices[0].message.content
    calls = first.choices[0].message.tool_calls or []
    assert [(t.function.name, json.loads(t.function.arguments)) for t in calls] == PARIS

    with c.chat.completions.stream(model=qwen.model, messages=messages, tools=tools, max_tokens=CALL_TOKENS,
                                   temperature=0) as stream:
        contents = [e.delta for e in stream if e.type == "content.delta"]
        streamed = stream.get_final_completion().choices[0].message.tool_calls or []
    assert "".join(contents) == "", "the bare JSON of the call must not leak as content"
    assert [(t.function.name, json.loads(t.function.arguments)) for t in streamed] == PARIS

    messages += [first.choices[0].message.model_dump(exclude_none=True),
                 {"role": "tool", "tool_call_id": calls[0].id, "content": RESULT},
                 {"role": "user", "content": FOLLOW_UP}]
    answer = c.chat.completions.create(model=qwen.model, messages=messages, tools=tools, max_tokens=ANSWER_TOKENS,
                                       temperature=0)
    assert answer.choices[0].finish_reason == "stop" and not answer.choices[0].message.tool_calls
    assert "21" in (answer.choices[0].message.content or "")


def test_anthropic_tool_use_then_answer(qwen: RealServer) -> None:
    c = anthropic.Anthropic(base_url=qwen.base_url, api_key="unused", max_retries=0, timeout=300)
    tools: Any = [{"name": "get_weather", "description": DESCRIPTION, "input_schema": WEATHER}]
    messages: list[Any] = [{"role": "user", "content": QUESTION}]
    first = c.messages.create(model=qwen.model, max_tokens=CALL_TOKENS, tools=tools, messages=messages,
                              extra_body=GREEDY)
    assert first.stop_reason == "tool_use" and [b.type for b in first.content] == ["tool_use"]
    call = first.content[0]
    assert call.type == "tool_use" and [(call.name, call.input)] == PARIS

    messages += [{"role": "assistant", "content": [b.model_dump() for b in first.content]},
                 {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id, "content": RESULT},
                                              {"type": "text", "text": FOLLOW_UP}]}]
    answer = c.messages.create(model=qwen.model, max_tokens=ANSWER_TOKENS, tools=tools, messages=messages,
                               extra_body=GREEDY)
    assert answer.stop_reason == "end_turn" and [b.type for b in answer.content] == ["text"]
    assert answer.content[0].type == "text" and "21" in answer.content[0].text


def test_responses_function_call_then_answer(qwen: RealServer) -> None:
    c = openai_client(qwen)
    tools: Any = [{"type": "function", "name": "get_weather", "description": DESCRIPTION, "parameters": WEATHER}]
    first = c.responses.create(model=qwen.model, input=QUESTION, tools=tools, max_output_tokens=CALL_TOKENS,
                               temperature=0)
    assert [o.type for o in first.output] == ["function_call"]
    call = first.output[0]
    assert call.type == "function_call" and [(call.name, json.loads(call.arguments))] == PARIS

    follow: Any = [{"type": "function_call_output", "call_id": call.call_id, "output": RESULT},
                   {"type": "message", "role": "user", "content": FOLLOW_UP}]
    answer = c.responses.create(model=qwen.model, previous_response_id=first.id, input=follow, tools=tools,
                                max_output_tokens=ANSWER_TOKENS, temperature=0)
    assert [o.type for o in answer.output] == ["message"] and "21" in answer.output_text
