"""Structured output on trained weights: SmolLM2-135M-Instruct, asked for JSON by a schema with free strings
(which random weights could never close), gives JSON that parses, validates and says something true."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import jsonschema
import openai
import pytest

from tests.real.conftest import RealModel, RealServer, real_server

pytestmark = pytest.mark.real

CITY = {"type": "object", "additionalProperties": False, "required": ["country", "capital"],
        "properties": {"country": {"type": "string"}, "capital": {"type": "string"}}}


@pytest.fixture(scope="module")
def smollm2(real_model: RealModel, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RealServer]:
    with real_server(real_model("smollm2-135m-instruct"), tmp_path_factory.mktemp("smollm2-json")) as server:
        yield server


def test_a_schema_with_free_strings_gives_true_json(smollm2: RealServer) -> None:
    client = openai.OpenAI(base_url=smollm2.url, api_key="none")
    messages: Any = [{"role": "user", "content": "What is the capital of France? Answer in JSON."}]
    answer = client.chat.completions.create(
        model=smollm2.model, messages=messages, max_tokens=40, temperature=0,
        response_format={"type": "json_schema", "json_schema": {"name": "city", "schema": CITY, "strict": True}})
    choice = answer.choices[0]
    assert choice.finish_reason == "stop", choice
    value = json.loads(choice.message.content or "")
    jsonschema.validate(value, CITY)
    assert "Paris" in value["capital"]
