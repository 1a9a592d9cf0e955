"""``n`` choices through the real server and real MLX: the choices decode as rows of one batch after one prefill
of the prompt, each with its own seed stream (and grammar state); whole and streamed responses list every choice,
and usage counts the prompt once and every choice's tokens."""

from __future__ import annotations

import json
from typing import Any

import httpx
import jsonschema
import openai
import pytest

from tests.harness import RunningServer

NO_THINKING: Any = {"reasoning_effort": "none"}


def client(server: RunningServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url, api_key="x", max_retries=0, timeout=120)


def ask(server: RunningServer, text: str, max_tokens: int = 12, **extra: Any) -> Any:
    return client(server).chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": text}], max_tokens=max_tokens, extra_body=NO_THINKING,
        **extra)


def test_greedy_choices_are_the_single_answer_and_usage_counts_each(qwen3_server: RunningServer) -> None:
    one = ask(qwen3_server, "Name a colour.", temperature=0)
    three = ask(qwen3_server, "Name a colour.", temperature=0, n=3)
    assert [c.index for c in three.choices] == [0, 1, 2]
    assert {c.message.content for c in three.choices} == {one.choices[0].message.content}
    assert three.usage.prompt_tokens == one.usage.prompt_tokens
    assert three.usage.completion_tokens == 3 * one.usage.completion_tokens


def test_the_prompt_is_prefilled_once(qwen3_server: RunningServer) -> None:
    before = qwen3_server.engine_stats()["prompt_tokens"]
    answer = ask(qwen3_server, "Seventeen quiet harbours guard the northern coast tonight.", temperature=0, n=4)
    computed = qwen3_server.engine_stats()["prompt_tokens"] - before
    cached = answer.usage.prompt_tokens_details.cached_tokens
    # Every prompt token the cache did not supply, once; then each choice's own pass over the last token.
    assert computed == answer.usage.prompt_tokens - cached - 1 + 4


def test_seeded_choices_differ_and_repeat(qwen3_server: RunningServer) -> None:
    sampled = {"temperature": 1.0, "seed": 11, "n": 3}
    first = [c.message.content for c in ask(qwen3_server, "Say something.", **sampled).choices]
    again = [c.message.content for c in ask(qwen3_server, "Say something.", **sampled).choices]
    assert first == again  # each choice's seed stream is the request's seed and its index
    assert len(set(first)) == 3  # and the streams differ
    alone = ask(qwen3_server, "Say something.", temperature=1.0, seed=11).choices[0].message.content
    assert first[0] == alone


def test_streamed_choices(qwen3_server: RunningServer) -> None:
    whole = ask(qwen3_server, "Count to three.", temperature=1.0, seed=5, n=2)
    texts = {0: "", 1: ""}
    finishes: dict[int, str] = {}
    usage = None
    for chunk in client(qwen3_server).chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "Count to three."}], max_tokens=12, temperature=1.0,
            seed=5, n=2, stream=True, stream_options={"include_usage": True}, extra_body=NO_THINKING):
        for choice in chunk.choices:
            texts[choice.index] += choice.delta.content or ""
            if choice.finish_reason:
                finishes[choice.index] = choice.finish_reason
        usage = chunk.usage or usage
    assert [texts[0], texts[1]] == [c.message.content for c in whole.choices]
    assert set(finishes) == {0, 1}
    assert usage is not None and usage.completion_tokens == whole.usage.completion_tokens


def test_legacy_completions_choices(qwen3_server: RunningServer) -> None:
    answer = client(qwen3_server).completions.create(model="tiny", prompt="Once upon a time", max_tokens=8,
                                                     temperature=1.0, seed=3, n=2)
    assert [c.index for c in answer.choices] == [0, 1] and answer.choices[0].text != answer.choices[1].text
    streamed = {0: "", 1: ""}
    for chunk in client(qwen3_server).completions.create(model="tiny", prompt="Once upon a time", max_tokens=8,
                                                         temperature=1.0, seed=3, n=2, stream=True):
        for choice in chunk.choices:
            streamed[choice.index] += choice.text
    assert [streamed[0], streamed[1]] == [c.text for c in answer.choices]


def test_each_choice_has_its_own_grammar_state(qwen3_server: RunningServer) -> None:
    schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 99}},
              "required": ["n"], "additionalProperties": False}
    answer = ask(qwen3_server, "A number in JSON.", temperature=1.0, seed=2, n=3, max_tokens=30,
                 response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": schema}})
    for choice in answer.choices:
        jsonschema.validate(json.loads(choice.message.content or ""), schema)


@pytest.mark.parametrize("n", [0, 9, 129])
def test_n_out_of_range_is_a_400(qwen3_server: RunningServer, n: int) -> None:
    answer = httpx.post(qwen3_server.url + "/chat/completions", timeout=60, json={
        "model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "n": n})
    assert answer.status_code == 400 and answer.json()["error"]["param"] == "n", answer.text
