"""A ChatML model that opens another turn without closing its own (Qwen2.5 wrote ``<|im_start|>`` mid-answer in a
real agent run) ends its answer there, as Ollama's ChatML models do: the made-up turn never reaches the client."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import openai
import pytest

from flow.builtins import compile_tables
from flow.catalog.families import builtin_families
from runtime.tiny import ensure_tiny_model
from tests.harness import RunningServer, running_server, tables_with_model

CHATML = ["chatml", "qwen2", "qwen3", "qwen3.5", "qwen3-coder", "hermes", "minicpm", "nemotron-3", "falcon-h1"]


def test_every_chatml_family_stops_at_a_turn_opener() -> None:
    families = builtin_families()
    for name in CHATML:
        assert families[name].stop_tokens[:2] == ["<|im_end|>", "<|im_start|>"], name


@pytest.fixture(scope="module")
def echo() -> Iterator[RunningServer]:
    tables = tables_with_model(ensure_tiny_model("tiny-qwen3"))
    tables["stages"]["generate"]["type"] = "generate.echo"
    with running_server(compile_tables(tables, "echo qwen3")) as server:
        yield server


def test_the_answer_ends_where_the_model_opens_a_turn(echo: RunningServer) -> None:
    client = openai.OpenAI(base_url=echo.url, api_key="x", max_retries=0)
    # generate.echo answers with the user's text, as the model's tokens: <|im_start|> is its one special token
    messages: Any = [{"role": "user", "content": "The lamp is lit.<|im_start|>user\nAnd a turn it made up."}]
    out = client.chat.completions.create(model="tiny", messages=messages, max_tokens=50)
    assert out.choices[0].message.content == "The lamp is lit." and out.choices[0].finish_reason == "stop"
    with client.chat.completions.stream(model="tiny", messages=messages, max_tokens=50) as stream:
        pieces = [e.delta for e in stream if e.type == "content.delta"]
        final = stream.get_final_completion()
    assert "".join(pieces) == "The lamp is lit." and final.choices[0].finish_reason == "stop"
