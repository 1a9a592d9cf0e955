"""Ollama's native API through the real server and real MLX, driven by the official ``ollama`` Python client:
chat and generate, streaming NDJSON and whole, options as sampling, format as structured output, tools, model
listing and details, embeddings, and errors in Ollama's shape."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import ollama
import openai
import pytest

from flow.builtins import compile_tables
from runtime.tiny import ensure_tiny_model
from tests.harness import WEATHER_TOOLS, RunningServer, running_server, tables_with_model

MESSAGES = [{"role": "user", "content": "Tell me about lighthouses."}]
SCRIPT = ('<think>The user wants weather.</think>Let me check.<tool_call>{"name": "get_weather", '
          '"arguments": {"city": "Paris"}}</tool_call>')
GREEDY = {"temperature": 0, "num_predict": 16}


@pytest.fixture(scope="module")
def server(tiny_qwen3: Path) -> Iterator[RunningServer]:
    tables = tables_with_model(tiny_qwen3)
    tables["resources"]["embedder"] = {"type": "model", "path": str(ensure_tiny_model("tiny-bert")),
                                       "name": "tiny-embedder"}
    with running_server(compile_tables(tables, "ollama (test)")) as running:
        yield running


def client(server: RunningServer) -> ollama.Client:
    return ollama.Client(host=server.base_url, timeout=120)


def openai_text(server: RunningServer, max_tokens: int = 16, **extra: Any) -> str:
    answer = openai.OpenAI(base_url=server.url, api_key="x").chat.completions.create(
        model="tiny", messages=MESSAGES, max_tokens=max_tokens, temperature=0, **extra)  # type: ignore[arg-type]
    return answer.choices[0].message.content or ""


def test_chat_whole_and_streamed_equal_the_openai_answer(server: RunningServer) -> None:
    expected = openai_text(server, extra_body={"reasoning_effort": "none"})
    whole = client(server).chat(model="tiny", messages=MESSAGES, options=GREEDY, think=False)
    assert whole.message.role == "assistant" and whole.message.content == expected
    assert whole.done and whole.done_reason == "length" and whole.eval_count == 16
    assert whole.prompt_eval_count and whole.prompt_eval_count > 5 and whole.total_duration
    parts = list(client(server).chat(model="tiny", messages=MESSAGES, options=GREEDY, think=False, stream=True))
    assert "".join(p.message.content or "" for p in parts) == expected
    assert [p.done for p in parts].count(True) == 1 and parts[-1].done
    assert parts[-1].eval_count == 16 and parts[-1].eval_duration and parts[-1].prompt_eval_duration


def test_the_stream_is_ndjson(server: RunningServer) -> None:
    with httpx.stream("POST", server.base_url + "/api/chat", timeout=60, json={
            "model": "tiny", "messages": MESSAGES, "options": GREEDY}) as answer:  # stream: Ollama's default
        assert answer.headers["content-type"].startswith("application/x-ndjson")
        lines = [json.loads(line) for line in answer.iter_lines() if line]
    assert all("created_at" in line and line["model"] == "tiny" for line in lines)
    assert lines[-1]["done"] is True and not any(line["done"] for line in lines[:-1])


def test_generate_uses_the_chat_template_unless_raw(server: RunningServer) -> None:
    expected = openai_text(server, extra_body={"reasoning_effort": "none"})
    answer = client(server).generate(model="tiny", prompt=MESSAGES[0]["content"], options=GREEDY, think=False)
    assert answer.response == expected and answer.done_reason == "length"
    streamed = "".join(p.response for p in client(server).generate(
        model="tiny", prompt=MESSAGES[0]["content"], options=GREEDY, think=False, stream=True))
    assert streamed == expected
    completion = openai.OpenAI(base_url=server.url, api_key="x").completions.create(
        model="tiny", prompt="Once upon a time", max_tokens=12, temperature=0)
    raw = client(server).generate(model="tiny", prompt="Once upon a time", raw=True,
                                  options={"temperature": 0, "num_predict": 12})
    assert raw.response == completion.choices[0].text  # no template: the prompt as it is


def test_options_are_sampling(server: RunningServer) -> None:
    seeded = {"temperature": 1.0, "top_k": 50, "seed": 7, "num_predict": 12}
    first = client(server).chat(model="tiny", messages=MESSAGES, options=seeded, think=False).message.content
    again = client(server).chat(model="tiny", messages=MESSAGES, options=seeded, think=False).message.content
    assert first == again  # the seed makes sampling repeatable
    greedy = {**GREEDY, "num_predict": 40}
    full = client(server).chat(model="tiny", messages=MESSAGES, think=False, options=greedy).message.content or ""
    stop = full[20:24]
    stopped = client(server).chat(model="tiny", messages=MESSAGES, think=False, options={**greedy, "stop": stop})
    assert stopped.message.content == full[: full.index(stop)] and stopped.done_reason == "stop"


def test_format_is_structured_output(server: RunningServer) -> None:
    schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9}},
              "required": ["n"], "additionalProperties": False}
    answer = client(server).chat(model="tiny", messages=MESSAGES, format=schema, think=False,
                                 options={"temperature": 0, "num_predict": 40})
    jsonschema.validate(json.loads(answer.message.content or ""), schema)


@pytest.fixture(scope="module")
def echo_server(tiny_qwen3: Path) -> Iterator[RunningServer]:
    tables = tables_with_model(tiny_qwen3)
    tables["stages"]["generate"]["type"] = "generate.echo"  # the user's text comes back as the model's output
    with running_server(compile_tables(tables, "ollama echo (test)")) as running:
        yield running


def test_tools_and_thinking_come_back_in_ollamas_fields(echo_server: RunningServer) -> None:
    messages = [{"role": "user", "content": SCRIPT}]
    whole = client(echo_server).chat(model="tiny", messages=messages, tools=WEATHER_TOOLS)
    assert whole.message.content == "Let me check." and whole.message.thinking == "The user wants weather."
    assert whole.message.tool_calls and whole.message.tool_calls[0].function.name == "get_weather"
    assert whole.message.tool_calls[0].function.arguments == {"city": "Paris"}  # an object, not a string
    parts = list(client(echo_server).chat(model="tiny", messages=messages, tools=WEATHER_TOOLS, stream=True))
    assert "".join(p.message.content or "" for p in parts) == "Let me check."
    assert "".join(p.message.thinking or "" for p in parts) == "The user wants weather."
    calls = [c for p in parts for c in p.message.tool_calls or ()]
    assert [(c.function.name, c.function.arguments) for c in calls] == [("get_weather", {"city": "Paris"})]
    # The call and its result go back in the next turn, as Ollama clients send them.
    history = [*messages, {"role": "assistant", "content": "", "tool_calls": [
        {"function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
               {"role": "tool", "content": "sunny, 21 C", "tool_name": "get_weather"},
               {"role": "user", "content": "Thanks."}]
    assert client(echo_server).chat(model="tiny", messages=history, tools=WEATHER_TOOLS).message.content == "Thanks."


def test_models_endpoints(server: RunningServer) -> None:
    tags = client(server).list()
    names = {m.model for m in tags.models}
    assert {"tiny", "default", "tiny-embedder"} <= names
    tiny = next(m for m in tags.models if m.model == "tiny")
    assert tiny.size and tiny.size > 0 and tiny.details and tiny.details.family == "qwen3"
    shown = client(server).show("tiny")
    assert shown.capabilities and "completion" in shown.capabilities and "tools" in shown.capabilities
    assert shown.modelinfo and shown.modelinfo["general.architecture"] == "qwen3"
    assert "embedding" in (client(server).show("tiny-embedder").capabilities or [])
    assert {m.model for m in client(server).ps().models} >= {"tiny", "tiny-embedder"}
    assert httpx.get(server.base_url + "/api/version", timeout=10).json()["version"]


def test_embed(server: RunningServer) -> None:
    answer = client(server).embed(model="tiny-embedder", input=["a lighthouse", "a harbour"])
    assert len(answer.embeddings) == 2 and len(answer.embeddings[0]) > 8
    via_openai = openai.OpenAI(base_url=server.url, api_key="x").embeddings.create(
        model="tiny-embedder", input=["a lighthouse"], encoding_format="float")
    assert answer.embeddings[0] == pytest.approx(via_openai.data[0].embedding, abs=1e-6)


def test_errors_take_ollamas_shape(server: RunningServer) -> None:
    with pytest.raises(ollama.ResponseError) as missing:
        client(server).chat(model="nope", messages=MESSAGES)
    assert missing.value.status_code == 404 and "nope" in missing.value.error
    bad = httpx.post(server.base_url + "/api/chat", timeout=30, json={"model": "tiny", "messages": "hello"})
    assert bad.status_code == 400 and set(bad.json()) == {"error"}
    image = httpx.post(server.base_url + "/api/chat", timeout=30, json={
        "model": "tiny", "messages": [{"role": "user", "content": "what is this?", "images": ["aGk="]}]})
    assert image.status_code == 400 and "images" in image.json()["error"]
    with pytest.raises(ollama.ResponseError) as wrong_kind:
        client(server).embed(model="tiny", input="x")
    assert wrong_kind.value.status_code == 400
    unknown = httpx.post(server.base_url + "/api/show", timeout=30, json={"model": "nope"})
    assert unknown.status_code == 404 and "error" in unknown.json()


def test_think_levels_grade_the_reasoning() -> None:
    from protocols.ollama import decode_chat_request

    def decoded(think: Any) -> Any:
        return decode_chat_request(json.dumps({"model": "m", "messages": MESSAGES, "think": think}).encode(), "r", 0)

    high = decoded("high")
    assert (high.thinking, high.reasoning_effort) == (True, "high")  # gpt-oss's template reads the effort
    off = decoded(False)
    assert (off.thinking, off.reasoning_effort) == (False, None)


def test_keep_alive_durations() -> None:
    from protocols.errors import ApiError
    from protocols.ollama import keep_alive_seconds

    assert keep_alive_seconds("5m") == 300 and keep_alive_seconds("1h30m") == 5400
    assert keep_alive_seconds("-1") == -1 and keep_alive_seconds(0) == 0 and keep_alive_seconds("250ms") == 0.25
    assert keep_alive_seconds(None) is None
    with pytest.raises(ApiError, match="not a duration"):
        keep_alive_seconds("five minutes")


def test_keep_alive_zero_unloads_the_model_once_idle(tiny_qwen3: Path) -> None:
    import time

    with running_server(compile_tables(tables_with_model(tiny_qwen3), "keep_alive (test)")) as running:
        ollama_client = client(running)
        assert [m.model for m in ollama_client.ps().models] == ["tiny"]
        ollama_client.chat(model="tiny", messages=MESSAGES, options=GREEDY, keep_alive=0)
        deadline = time.monotonic() + 20
        while ollama_client.ps().models and time.monotonic() < deadline:
            time.sleep(0.2)
        assert ollama_client.ps().models == []  # unloaded once idle (after the 2 s grace)
        # `ollama run` first sends an empty generate: it loads the model and answers "load" with no text.
        loaded = ollama_client.generate(model="tiny")
        assert (loaded.done, loaded.done_reason, loaded.response) == (True, "load", "")
        assert [m.model for m in ollama_client.ps().models] == ["tiny"]
        again = ollama_client.chat(model="tiny", messages=MESSAGES, options=GREEDY, keep_alive="5m")
        assert again.message.content and [m.model for m in ollama_client.ps().models] == ["tiny"]
        # An empty chat with keep_alive 0 lets the model go, streamed or not.
        unloading = list(ollama_client.chat(model="tiny", messages=[], keep_alive=0, stream=True))
        assert [(part.done, part.done_reason, part.message.content) for part in unloading] == [(True, "unload", "")]
        deadline = time.monotonic() + 20
        while ollama_client.ps().models and time.monotonic() < deadline:
            time.sleep(0.2)
        assert ollama_client.ps().models == []
        # Letting go of a model that is not loaded loads nothing.
        assert ollama_client.generate(model="tiny", keep_alive=0).done_reason == "unload"
        assert ollama_client.ps().models == []
        loaded = ollama_client.chat(model="tiny", messages=[])
        assert (loaded.done_reason, loaded.message.role) == ("load", "assistant")
        assert [m.model for m in ollama_client.ps().models] == ["tiny"]
        # A request that states no keep_alive wants the server's policy back, as Ollama's default does.
        ollama_client.chat(model="tiny", messages=MESSAGES, options=GREEDY, keep_alive=0)
        ollama_client.chat(model="tiny", messages=MESSAGES, options=GREEDY)
        time.sleep(3)  # past the 2 s grace the first request's keep_alive would have allowed
        assert [m.model for m in ollama_client.ps().models] == ["tiny"]
        bad = httpx.post(running.base_url + "/api/chat", timeout=30, json={
            "model": "tiny", "messages": MESSAGES, "keep_alive": "forever"})
        assert bad.status_code == 400 and "keep_alive" in bad.json()["error"]
