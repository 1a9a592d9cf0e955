"""Structured output through the real server and real MLX on tiny random-weight models: answers constrained
by a grammar (llguidance) parse and validate against their schema in every protocol, streaming or not, alone or
in a batch whose unconstrained rows decode as they would alone.

Random weights never close an unbounded string or array by themselves, so the schemas here bound their strings
(enum, maxLength, pattern) and arrays (maxItems): the grammar then forces the answer to complete. Nor do they
close a thinking block: the Qwen3-style model is asked with thinking off (a reasoning model's grammar starting
after its thinking is tested on the matcher in tests/runtime/test_constrained.py)."""

from __future__ import annotations

import concurrent.futures
import json
import re
from typing import Any, Literal

import anthropic
import httpx
import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field

from tests.harness import RunningServer

WORD = {"type": "string", "maxLength": 6}
SMALL = {"type": "integer", "minimum": -9, "maximum": 99}


def obj(required: dict[str, Any], optional: dict[str, Any] | None = None) -> dict[str, Any]:
    """A closed object (no other keys: random weights would write keys forever)."""
    return {"type": "object", "properties": {**required, **(optional or {})}, "required": list(required),
            "additionalProperties": False}


SCHEMAS: list[dict[str, Any]] = [
    obj({"a": SMALL}),
    obj({"ok": {"type": "boolean"}}),
    obj({"color": {"enum": ["red", "green", "blue"]}}),
    obj({"n": {"type": "integer", "minimum": 3, "maximum": 7}}),
    obj({"x": {"type": "number", "minimum": -1, "maximum": 1, "multipleOf": 0.25}}),
    obj({"name": WORD}),
    obj({"code": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{2}$"}}),
    obj({"tags": {"type": "array", "items": WORD, "maxItems": 3}}),
    obj({"ids": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 99},
                 "minItems": 1, "maxItems": 4}}),
    obj({"inner": obj({"deep": {"type": "boolean"}})}),
    obj({"a": SMALL}, {"b": WORD}),  # b optional
    obj({"v": {"anyOf": [{"type": "integer", "minimum": 0, "maximum": 5}, {"type": "boolean"}]}}),
    obj({"v": {"anyOf": [{"type": "null"}, {"enum": ["yes", "no"]}]}}),
    {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 50}, "minItems": 2, "maxItems": 3},
    {"enum": ["alpha", "beta", "gamma"]},
    {"type": "integer", "minimum": 10, "maximum": 20},
    obj({"points": {"type": "array", "maxItems": 2, "items": obj({"x": SMALL, "y": SMALL})}}),
    {"$defs": {"leaf": obj({"v": {"type": "integer", "minimum": 0, "maximum": 3}})},
     **obj({"left": {"$ref": "#/$defs/leaf"}, "right": {"$ref": "#/$defs/leaf"}})},
    obj({"kind": {"const": "point"}, "at": SMALL}),
    obj({"matrix": {"type": "array", "maxItems": 2, "items": {"type": "array", "maxItems": 2,
                                                              "items": {"type": "boolean"}}}}),
]
MESSAGES = [{"role": "user", "content": "Answer in JSON."}]
NO_THINKING = {"reasoning_effort": "none", "temperature": 0}  # greedy, no thinking block


def json_schema_format(schema: dict[str, Any], strict: bool = False) -> dict[str, Any]:
    return {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema, "strict": strict}}


def chat(server: RunningServer, max_tokens: int = 200, **extra: Any) -> dict[str, Any]:
    answer = httpx.post(server.url + "/chat/completions", timeout=120, json={
        "model": model_of(server), "messages": MESSAGES, "max_tokens": max_tokens, **NO_THINKING, **extra})
    assert answer.status_code == 200, answer.text
    body: dict[str, Any] = answer.json()
    return body


def model_of(server: RunningServer) -> str:
    return server.server.models[0].name


def streamed(server: RunningServer, **extra: Any) -> tuple[str, str]:
    client = openai.OpenAI(base_url=server.url, api_key="none")
    text, finish = "", ""
    for chunk in client.chat.completions.create(model=model_of(server), messages=MESSAGES, max_tokens=200, stream=True,
                                                **NO_THINKING, **extra):  # type: ignore[call-overload]
        if chunk.choices:
            text += chunk.choices[0].delta.content or ""
            finish = chunk.choices[0].finish_reason or finish
    return text, finish


@pytest.mark.parametrize("index", range(len(SCHEMAS)))
@pytest.mark.parametrize("family", ["qwen3", "llama"])
def test_every_answer_parses_and_validates(qwen3_server: RunningServer, llama_server: RunningServer,
                                           family: str, index: int) -> None:
    server, schema = (qwen3_server if family == "qwen3" else llama_server), SCHEMAS[index]
    for _ in range(2):  # the second time from the prefix cache, as the streamed request below
        choice = chat(server, response_format=json_schema_format(schema))["choices"][0]
        assert choice["finish_reason"] == "stop", choice
        jsonschema.validate(json.loads(choice["message"]["content"]), schema)
    text, finish = streamed(server, response_format=json_schema_format(schema))
    assert (text, finish) == (choice["message"]["content"], "stop")  # streamed and whole answers are the same


def test_a_json_object_is_a_json_object(llama_server: RunningServer) -> None:
    choice = chat(llama_server, max_tokens=400, response_format={"type": "json_object"})["choices"][0]
    if choice["finish_reason"] == "stop":  # random weights may fill a string until max_tokens
        assert isinstance(json.loads(choice["message"]["content"]), dict)
    else:
        assert choice["message"]["content"].startswith("{")


def test_constrained_and_free_rows_share_a_batch(qwen3_server: RunningServer) -> None:
    alone = chat(qwen3_server, max_tokens=24)["choices"][0]["message"]["content"]

    def one(i: int) -> dict[str, Any]:
        if i % 2:
            return chat(qwen3_server, max_tokens=24)
        return chat(qwen3_server, response_format=json_schema_format(SCHEMAS[i % len(SCHEMAS)]))

    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        answers = list(pool.map(one, range(8)))
    for i, body in enumerate(answers):
        content = body["choices"][0]["message"]["content"]
        if i % 2:
            assert content == alone  # greedy, unconstrained: unchanged by its constrained neighbours
        else:
            jsonschema.validate(json.loads(content), SCHEMAS[i % len(SCHEMAS)])


def test_max_tokens_before_the_json_closes_is_length(qwen3_server: RunningServer) -> None:
    schema = SCHEMAS[16]  # nested: needs more than three tokens
    choice = chat(qwen3_server, max_tokens=3, response_format=json_schema_format(schema))["choices"][0]
    assert choice["finish_reason"] == "length"
    with pytest.raises(json.JSONDecodeError):
        json.loads(choice["message"]["content"])


def test_responses_text_format_and_anthropic_output_config(qwen3_server: RunningServer) -> None:
    schema = SCHEMAS[3]
    client = openai.OpenAI(base_url=qwen3_server.url, api_key="none")
    response = client.responses.create(model="tiny", input="Answer in JSON.", max_output_tokens=100,
                                       reasoning={"effort": "none"}, temperature=0, text={
        "format": {"type": "json_schema", "name": "answer", "schema": schema, "strict": True}})
    jsonschema.validate(json.loads(response.output_text), schema)
    assert response.text.format.type == "json_schema"  # echoed
    message = anthropic.Anthropic(base_url=qwen3_server.base_url, api_key="none").messages.create(
        model="tiny", max_tokens=100, messages=MESSAGES, thinking={"type": "disabled"},  # type: ignore[arg-type]
        extra_body={"temperature": 0, "output_config": {"format": {"type": "json_schema", "schema": schema}}})
    text = "".join(block.text for block in message.content if block.type == "text")
    jsonschema.validate(json.loads(text), schema)


class City(BaseModel):
    name: Literal["Paris", "Rome", "Oslo"]
    population_millions: int = Field(ge=0, le=20)
    capital: bool


def test_the_sdks_parse_helper_with_a_pydantic_model(qwen3_server: RunningServer) -> None:
    client = openai.OpenAI(base_url=qwen3_server.url, api_key="none")
    completion = client.chat.completions.parse(model="tiny", messages=MESSAGES,  # type: ignore[arg-type]
                                               response_format=City, max_tokens=100, **NO_THINKING)
    parsed = completion.choices[0].message.parsed
    assert isinstance(parsed, City)


def test_schemas_that_cannot_be_enforced_are_a_400(qwen3_server: RunningServer) -> None:
    def error(fmt: Any) -> dict[str, Any]:
        answer = httpx.post(qwen3_server.url + "/chat/completions", timeout=30, json={
            "model": "tiny", "messages": MESSAGES, "max_tokens": 4, "response_format": fmt, **NO_THINKING})
        assert answer.status_code == 400, answer.text
        body: dict[str, Any] = answer.json()["error"]
        return body

    assert "bogus" in error(json_schema_format({"type": "string", "format": "bogus"}, strict=True))["message"]
    assert error({"type": "json_schema", "json_schema": {"name": "x"}})["param"] == "response_format.json_schema.schema"
    assert error({"type": "yaml"})["param"] == "response_format.type"
    assert error("json")["param"] == "response_format"
    bogus_tool = {"type": "function", "function": {"name": "f", "parameters": obj({"d": {"type": "string",
                                                                                          "format": "bogus"}})}}
    answer = httpx.post(qwen3_server.url + "/chat/completions", timeout=30, json={
        "model": "tiny", "messages": MESSAGES, "max_tokens": 4, "tools": [bogus_tool], "tool_choice": "required",
        **NO_THINKING})
    assert answer.status_code == 400 and answer.json()["error"]["param"] == "tool_choice"
    assert "bogus" in answer.json()["error"]["message"]
    # a property whose schema is a list (found by the fuzzer): the message names the tool's parameters, not a
    # position in the call grammar flow wrote
    listed = {"type": "function", "function": {"name": "g", "parameters": obj({"d": [{"type": "string"}]})}}
    answer = httpx.post(qwen3_server.url + "/chat/completions", timeout=30, json={
        "model": "tiny", "messages": MESSAGES, "max_tokens": 4, "tools": [listed],
        "tool_choice": {"type": "function", "function": {"name": "g"}}, **NO_THINKING})
    assert answer.status_code == 400, answer.text
    message = answer.json()["error"]["message"]
    assert "'parameters' is not a JSON Schema" in message and "schema must be an object or boolean" in message
    assert not re.search(r"at \d+\(\d+\)", message), message


WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city.",
                                            "parameters": obj({"city": WORD, "days": {"type": "integer", "minimum": 1,
                                                                                       "maximum": 7}})}}
TIME = {"type": "function", "function": {"name": "get_time", "description": "The time in a zone.",
                                         "parameters": obj({"zone": {"enum": ["UTC", "CET"]}})}}


@pytest.mark.parametrize("family", ["qwen3", "llama"])  # hermes <tool_call> markup; Llama 3 bare JSON
def test_a_forced_tool_call_is_well_formed_with_valid_arguments(qwen3_server: RunningServer,
                                                                llama_server: RunningServer, family: str) -> None:
    server = qwen3_server if family == "qwen3" else llama_server
    params = {"get_weather": WEATHER["function"]["parameters"], "get_time": TIME["function"]["parameters"]}
    for choice, names in (({"type": "function", "function": {"name": "get_time"}}, {"get_time"}),
                          ("required", {"get_weather", "get_time"})):
        answer = chat(server, tools=[WEATHER, TIME], tool_choice=choice)["choices"][0]
        assert answer["finish_reason"] == "tool_calls", answer
        (call,) = answer["message"]["tool_calls"]
        assert call["function"]["name"] in names
        jsonschema.validate(json.loads(call["function"]["arguments"]), params[call["function"]["name"]])


def test_forced_tool_calls_in_responses_and_messages(qwen3_server: RunningServer) -> None:
    client = openai.OpenAI(base_url=qwen3_server.url, api_key="none")
    response = client.responses.create(
        model="tiny", input="Weather?", max_output_tokens=100, reasoning={"effort": "none"}, temperature=0,
        tools=[{"type": "function", "name": "get_weather", "parameters": WEATHER["function"]["parameters"]}],
        tool_choice={"type": "function", "name": "get_weather"})
    (call,) = [item for item in response.output if item.type == "function_call"]
    jsonschema.validate(json.loads(call.arguments), WEATHER["function"]["parameters"])
    message = anthropic.Anthropic(base_url=qwen3_server.base_url, api_key="none").messages.create(
        model="tiny", max_tokens=100, messages=MESSAGES, thinking={"type": "disabled"},  # type: ignore[arg-type]
        tools=[{"name": "get_weather", "input_schema": WEATHER["function"]["parameters"]}],  # type: ignore[list-item]
        tool_choice={"type": "tool", "name": "get_weather"}, extra_body={"temperature": 0})
    (use,) = [block for block in message.content if block.type == "tool_use"]
    assert message.stop_reason == "tool_use" and use.name == "get_weather"
    jsonschema.validate(use.input, WEATHER["function"]["parameters"])
