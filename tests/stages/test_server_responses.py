"""OpenAI Responses and legacy completions end to end: real server, real MLX, the official SDK."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from mlx_lm import stream_generate

from flow.builtins import compile_tables
from flow.graph.spec import load_tables
from flow.resources.response_store import ResponseStore
from stages.openai_responses import OpenAIResponsesDecode, OpenAIResponsesFormat
from tests.harness import GRAPHS, RunningServer, running_server

MESSAGES = [{"role": "user", "content": "Tell me a story about a lighthouse."}]
PROMPT = "Once upon a time, a lighthouse keeper"


@pytest.fixture(scope="module")
def stopping_server(tiny_qwen3: Path) -> Iterator[RunningServer]:
    """A server whose generation ends on a token the greedy answer to MESSAGES contains, so that
    Responses streams end in ``response.completed`` (random weights almost never sample EOS)."""
    tables = load_tables(GRAPHS / "default.toml")
    tables["resources"]["model"].update(path=str(tiny_qwen3), name="tiny", aliases=[])
    with running_server(compile_tables(tables, "probe")) as probe:
        loaded = probe.server.models[0].require()
        ids = loaded.tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True)
        generated = probe.server.device.call(lambda: [r.token for r in stream_generate(
            loaded.model, loaded.tokenizer, prompt=ids, max_tokens=8)])
        stop_token = loaded.tokenizer.convert_ids_to_tokens(generated[5])
    tables["stages"]["prepare"]["stop_tokens"] = [stop_token]
    with running_server(compile_tables(tables, "stop-token")) as server:
        yield server


def client(server: RunningServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url, api_key="unused", max_retries=0, timeout=120)


def chat_text(server: RunningServer, messages: list[Any], max_tokens: int) -> str:
    out = client(server).chat.completions.create(model="tiny", messages=messages, max_tokens=max_tokens,
                                                 temperature=0)
    return out.choices[0].message.content or ""


# --------------------------------------------------------------------------- Responses


def test_responses_create_matches_chat(qwen3_server: RunningServer) -> None:
    c = client(qwen3_server)
    expected = chat_text(qwen3_server, [{"role": "system", "content": "Be brief."}, *MESSAGES], 16)
    response = c.responses.create(model="tiny", instructions="Be brief.", input=MESSAGES[0]["content"],
                                  max_output_tokens=16, temperature=0)
    assert response.output_text == expected
    assert response.status == "incomplete" and response.incomplete_details is not None
    assert response.incomplete_details.reason == "max_output_tokens"
    assert response.usage is not None and response.usage.output_tokens == 16
    assert response.id.startswith("resp_") and response.object == "response"
    assert [item.type for item in response.output] == ["message"]


def test_responses_stream_event_chain(stopping_server: RunningServer) -> None:
    c = client(stopping_server)
    expected = c.responses.create(model="tiny", input=MESSAGES, max_output_tokens=12, temperature=0)
    assert expected.status == "completed" and expected.usage is not None and expected.usage.output_tokens <= 5
    with c.responses.stream(model="tiny", input=MESSAGES, max_output_tokens=12, temperature=0) as stream:
        events = list(stream)
        final = stream.get_final_response()
    types = [e.type for e in events]
    assert types[:2] == ["response.created", "response.in_progress"]
    assert types[-1] == "response.completed"
    for needed in ("response.output_item.added", "response.content_part.added", "response.output_text.delta",
                   "response.output_text.done", "response.content_part.done", "response.output_item.done"):
        assert needed in types
    numbers = [e.sequence_number for e in events]
    assert numbers == list(range(len(events)))
    assert final.output_text == expected.output_text
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == expected.output_text
    done = [e for e in events if e.type == "response.output_item.done"]
    assert [(d.item.id, d.item.type) for d in done] == [(o.id, o.type) for o in final.output]
    assert done[0].item.type == "message" and done[0].item.content[0].type == "output_text"
    assert done[0].item.content[0].text == final.output_text


def test_previous_response_id_chain_of_three_turns(qwen3_server: RunningServer) -> None:
    c = client(qwen3_server)
    first = c.responses.create(model="tiny", input="Name a color.", max_output_tokens=6, temperature=0)
    second = c.responses.create(model="tiny", input="Another one.", previous_response_id=first.id,
                                max_output_tokens=6, temperature=0)
    third = c.responses.create(model="tiny", input="And a third.", previous_response_id=second.id,
                               max_output_tokens=6, temperature=0)
    # The chained conversation is exactly the explicit one.
    history = [
        {"role": "user", "content": "Name a color."}, {"role": "assistant", "content": first.output_text},
        {"role": "user", "content": "Another one."}, {"role": "assistant", "content": second.output_text},
        {"role": "user", "content": "And a third."},
    ]
    assert third.output_text == chat_text(qwen3_server, history, 6)
    assert third.usage is not None and second.usage is not None and first.usage is not None
    assert first.usage.input_tokens < second.usage.input_tokens < third.usage.input_tokens
    fetched = c.responses.retrieve(third.id)
    assert fetched.output_text == third.output_text and fetched.id == third.id
    assert fetched.previous_response_id == second.id


def test_a_request_is_decoded_on_the_loop_unless_it_reads_the_store(qwen3_server: RunningServer,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """A plain request's decode takes no worker thread; one with previous_response_id reads the store's file on a
    worker, never on the event loop; the stored first turn is what the second continues."""
    decoded: list[str] = []
    reads: list[str] = []
    on_loop: list[str] = []  # the event loop's thread, as the format stage (a trio task) sees it
    decode, get, finished = OpenAIResponsesDecode.decode, ResponseStore.get, OpenAIResponsesFormat.finished

    async def finished_seen(self: OpenAIResponsesFormat, result: Any, body: Any) -> None:
        on_loop.append(threading.current_thread().name)
        await finished(self, result, body)

    def decode_seen(self: OpenAIResponsesDecode, http: Any, created: int) -> Any:
        decoded.append(threading.current_thread().name)
        return decode(self, http, created)

    def get_seen(self: ResponseStore, response_id: str) -> Any:
        reads.append(threading.current_thread().name)
        return get(self, response_id)

    monkeypatch.setattr(OpenAIResponsesDecode, "decode", decode_seen)
    monkeypatch.setattr(ResponseStore, "get", get_seen)
    monkeypatch.setattr(OpenAIResponsesFormat, "finished", finished_seen)
    c = client(qwen3_server)
    first = c.responses.create(model="tiny", input="Name a color.", max_output_tokens=3)
    assert len(decoded) == 1 and decoded == on_loop and reads == []
    loop = on_loop[0]
    second = c.responses.create(model="tiny", input="Another.", previous_response_id=first.id, max_output_tokens=3)
    # Tried on the loop, stopped before the read, decoded again on a worker.
    assert decoded[1:] == [loop, reads[0]] and len(reads) == 1 and reads[0] != loop, decoded
    assert second.usage is not None and first.usage is not None
    assert second.usage.input_tokens > first.usage.input_tokens  # the first turn is in it


def test_length_stop_ends_in_response_incomplete(qwen3_server: RunningServer) -> None:
    stream = client(qwen3_server).responses.create(model="tiny", input=MESSAGES, max_output_tokens=4, stream=True,
                                                   temperature=0)  # sampling may pick EOS
    events = list(stream)
    assert events[-1].type == "response.incomplete"
    assert events[-1].response.incomplete_details is not None
    assert events[-1].response.incomplete_details.reason == "max_output_tokens"


def test_streamed_responses_are_stored_too(stopping_server: RunningServer) -> None:
    c = client(stopping_server)
    with c.responses.stream(model="tiny", input=MESSAGES, max_output_tokens=12, temperature=0) as stream:
        final = stream.get_final_response()
    assert c.responses.retrieve(final.id).output_text == final.output_text
    follow = c.responses.create(model="tiny", input="More", previous_response_id=final.id, max_output_tokens=3)
    assert follow.status in ("completed", "incomplete")


def test_store_false_and_unknown_ids_are_404(qwen3_server: RunningServer) -> None:
    c = client(qwen3_server)
    unstored = c.responses.create(model="tiny", input="Hi", max_output_tokens=3, store=False)
    with pytest.raises(openai.NotFoundError):
        c.responses.retrieve(unstored.id)
    with pytest.raises(openai.NotFoundError):
        c.responses.create(model="tiny", input="Hi", previous_response_id="resp_nope", max_output_tokens=3)
    with pytest.raises(openai.NotFoundError):
        c.responses.retrieve("resp_nope")
    kept = c.responses.create(model="tiny", input="Hi", max_output_tokens=3)
    c.responses.delete(kept.id)
    with pytest.raises(openai.NotFoundError):
        c.responses.retrieve(kept.id)
    stats = httpx.get(qwen3_server.base_url + "/stats").json()
    store = stats["resources"]["response_store"]
    assert store["entries"] >= 1 and store["misses"] >= 3 and store["bytes"] > 0


def test_function_items_and_tools_are_accepted(qwen3_server: RunningServer) -> None:
    c = client(qwen3_server)
    tools: Any = [
        {"type": "function", "name": "get_weather", "description": "Weather for a city",
         "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}},
        {"type": "web_search"},
    ]
    items: Any = [
        {"type": "message", "role": "developer", "content": [{"type": "input_text", "text": "Use tools."}]},
        {"role": "user", "content": "Weather in Paris?"},
        {"type": "reasoning", "id": "rs_1", "summary": [{"type": "summary_text", "text": "Call the tool."}]},
        {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": '{"city": "Paris"}'},
        {"type": "function_call_output", "call_id": "call_1", "output": "Sunny, 21 C"},
    ]
    response = c.responses.create(model="tiny", input=items, tools=tools, tool_choice="auto", max_output_tokens=8)
    assert response.status in ("completed", "incomplete") and response.output
    assert [t.type for t in response.tools] == ["function"]


@pytest.mark.parametrize(
    ("body", "status", "needle"),
    [
        (b"[]", 400, "JSON object"),
        (json.dumps({"model": "tiny", "input": []}).encode(), 400, "input"),
        (json.dumps({"model": "tiny", "input": [{"type": "message", "content": "x"}]}).encode(), 400, "role"),
        (json.dumps({"model": "tiny", "input": "x", "max_output_tokens": 0}).encode(), 400, "max_output_tokens"),
        (json.dumps({"model": "tiny", "input": [{"type": "function_call", "call_id": "c", "name": "f",
                                                 "arguments": "{bad"}]}).encode(), 400, "arguments"),
        (json.dumps({"model": "nope", "input": "x"}).encode(), 404, "nope"),
    ],
)
def test_responses_bad_requests(qwen3_server: RunningServer, body: bytes, status: int, needle: str) -> None:
    r = httpx.post(qwen3_server.url + "/responses", content=body, headers={"content-type": "application/json"})
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert needle in error["message"] and {"message", "type", "param", "code"} <= set(error)
    assert qwen3_server.health()["status"] == "ok"


# --------------------------------------------------------------------------- legacy completions


def raw_reference(server: RunningServer, prompt: str | list[int], max_tokens: int) -> str:
    from mlx_lm import generate

    loaded = server.server.models[0].require()
    return str(server.server.device.call(
        lambda: generate(loaded.model, loaded.tokenizer, prompt=prompt, max_tokens=max_tokens)))


def test_completions_greedy_matches_mlx_lm(qwen3_server: RunningServer) -> None:
    c = client(qwen3_server)
    expected = raw_reference(qwen3_server, PROMPT, 20)
    out = c.completions.create(model="tiny", prompt=PROMPT, max_tokens=20, temperature=0)
    assert out.choices[0].text == expected and out.object == "text_completion"
    assert out.usage is not None and out.usage.completion_tokens == 20
    streamed = "".join(ch.choices[0].text for ch in c.completions.create(
        model="tiny", prompt=PROMPT, max_tokens=20, temperature=0, stream=True) if ch.choices)
    assert streamed == expected


def test_completions_token_prompt_echo_and_logprobs(qwen3_server: RunningServer) -> None:
    c = client(qwen3_server)
    tokenizer = qwen3_server.server.models[0].require().tokenizer
    ids = tokenizer.encode(PROMPT)
    by_ids = c.completions.create(model="tiny", prompt=ids, max_tokens=8, temperature=0)
    by_text = c.completions.create(model="tiny", prompt=PROMPT, max_tokens=8, temperature=0)
    assert by_ids.choices[0].text == by_text.choices[0].text
    echoed = c.completions.create(model="tiny", prompt=PROMPT, max_tokens=8, temperature=0, echo=True)
    assert echoed.choices[0].text == PROMPT + by_text.choices[0].text
    echoed_ids = c.completions.create(model="tiny", prompt=[ids], max_tokens=8, temperature=0, echo=True)
    assert echoed_ids.choices[0].text.endswith(by_text.choices[0].text)
    with_lp = c.completions.create(model="tiny", prompt=PROMPT, max_tokens=8, temperature=0, logprobs=3)
    lp = with_lp.choices[0].logprobs
    assert lp is not None and lp.tokens is not None and lp.token_logprobs is not None and lp.top_logprobs is not None
    assert "".join(lp.tokens) == with_lp.choices[0].text and len(lp.tokens) == 8
    assert all(v <= 0 for v in lp.token_logprobs) and all(len(t) == 3 for t in lp.top_logprobs)
    # greedy: the sampled token is the most likely one
    assert all(max(top.values()) == pytest.approx(v) for top, v in zip(lp.top_logprobs, lp.token_logprobs))
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(lp.tokens))]


def test_completions_stream_usage_and_stop(qwen3_server: RunningServer) -> None:
    c = client(qwen3_server)
    text = c.completions.create(model="tiny", prompt=PROMPT, max_tokens=20, temperature=0).choices[0].text
    stop = text[6:9]
    chunks = list(c.completions.create(model="tiny", prompt=PROMPT, max_tokens=20, temperature=0, stop=stop,
                                       stream=True, stream_options={"include_usage": True}))
    assert "".join(ch.choices[0].text for ch in chunks if ch.choices) == text[: text.find(stop)]
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices and ch.choices[0].finish_reason] == ["stop"]


def test_chat_logprobs(qwen3_server: RunningServer) -> None:
    c = client(qwen3_server)
    out = c.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=6, temperature=0, logprobs=True,
                                    top_logprobs=2)
    content = out.choices[0].logprobs.content if out.choices[0].logprobs else None
    assert content is not None and len(content) == 6
    assert "".join(t.token for t in content) == out.choices[0].message.content
    assert all(len(t.top_logprobs) == 2 and t.top_logprobs[0].logprob == pytest.approx(t.logprob) for t in content)
    streamed = [ch for ch in c.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=6, temperature=0,
                                                       logprobs=True, stream=True)]
    tokens = [t.token for ch in streamed if ch.choices and ch.choices[0].logprobs
              for t in ch.choices[0].logprobs.content or []]
    assert tokens == [t.token for t in content]


@pytest.mark.parametrize(
    ("body", "needle"),
    [
        ({"model": "tiny", "prompt": ["a", "b"]}, "separate requests"),
        ({"model": "tiny", "prompt": ""}, "empty"),
        ({"model": "tiny", "prompt": [1, 10**9]}, "Token ids"),
        ({"model": "tiny", "prompt": "x", "echo": True, "logprobs": 1}, "echo"),
        ({"model": "tiny", "prompt": "x", "suffix": "y"}, "suffix"),
        ({"model": "tiny"}, "prompt"),
    ],
)
def test_completions_bad_requests(qwen3_server: RunningServer, body: dict[str, Any], needle: str) -> None:
    r = httpx.post(qwen3_server.url + "/completions", json=body)
    assert r.status_code == 400, r.text
    assert needle in r.json()["error"]["message"]


def test_an_empty_input_is_answered_as_the_hosted_api_does(qwen3_server: RunningServer) -> None:
    client = openai.OpenAI(base_url=qwen3_server.url, api_key="none")
    warm_up = client.responses.create(model="tiny", input="", max_output_tokens=2)  # Codex's LM Studio warm-up
    assert warm_up.status in ("completed", "incomplete") and warm_up.usage is not None
    missing = httpx.post(qwen3_server.url + "/responses", json={"model": "tiny"}, timeout=30)
    assert missing.status_code == 400 and missing.json()["error"]["param"] == "input"
