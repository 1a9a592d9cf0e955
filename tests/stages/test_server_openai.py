"""OpenAI Chat Completions end to end: real hypercorn on loopback, real MLX, the official SDK."""

from __future__ import annotations

import concurrent.futures
import json
import time
from typing import Any

import httpx
import openai
import pytest

from tests.harness import RunningServer

MESSAGES = [{"role": "user", "content": "Tell me a story about a lighthouse."}]


def client(server: RunningServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url, api_key="unused", max_retries=0, timeout=120)


def reference_text(server: RunningServer, messages: list[dict[str, Any]], max_tokens: int) -> str:
    """What mlx_lm.generate produces, greedy, for the same chat, computed on the device thread."""
    from mlx_lm import generate

    loaded = server.server.models[0].require()
    ids = loaded.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    return str(server.server.device.call(
        lambda: generate(loaded.model, loaded.tokenizer, prompt=ids, max_tokens=max_tokens)))


def stream_text(c: openai.OpenAI, **kwargs: Any) -> tuple[str, list[Any]]:
    chunks = list(c.chat.completions.create(model="tiny", stream=True, **kwargs))
    return "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices), chunks


def test_greedy_matches_mlx_lm_generate(qwen3_server: RunningServer) -> None:
    c = client(qwen3_server)
    expected = reference_text(qwen3_server, MESSAGES, 40)
    assert len(expected) > 10
    full = c.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=40, temperature=0)
    assert full.choices[0].message.content == expected
    streamed, _ = stream_text(c, messages=MESSAGES, max_tokens=40, temperature=0)
    assert streamed == expected


def test_llama_greedy_matches_mlx_lm_generate(llama_server: RunningServer) -> None:
    c = openai.OpenAI(base_url=llama_server.url, api_key="x", max_retries=0)
    expected = reference_text(llama_server, MESSAGES, 30)
    full = c.chat.completions.create(model="tiny-llama", messages=MESSAGES, max_tokens=30, temperature=0)
    assert full.choices[0].message.content == expected


def test_stream_wire_format_and_usage(qwen3_server: RunningServer) -> None:
    c = client(qwen3_server)
    # asked twice: the prefix cache then holds the prompt for both answers compared below (their usage reports
    # the same cached tokens, whichever test of the module ran before)
    c.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=24, temperature=0)
    full = c.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=24, temperature=0)
    text, chunks = stream_text(c, messages=MESSAGES, max_tokens=24, temperature=0,
                               stream_options={"include_usage": True})
    assert text == full.choices[0].message.content
    assert len({ch.id for ch in chunks}) == 1
    roles = [ch.choices[0].delta.role for ch in chunks if ch.choices and ch.choices[0].delta.role]
    assert roles == ["assistant"]
    assert all(ch.object == "chat.completion.chunk" for ch in chunks)
    usage_chunk = chunks[-1]
    assert usage_chunk.choices == [] and usage_chunk.usage is not None
    assert all(ch.usage is None for ch in chunks[:-1])
    assert usage_chunk.usage.model_dump() == full.usage.model_dump() if full.usage else False
    assert full.usage is not None
    assert full.usage.completion_tokens == 24 and full.choices[0].finish_reason == "length"
    assert full.usage.total_tokens == full.usage.prompt_tokens + 24
    finishes = [ch.choices[0].finish_reason for ch in chunks if ch.choices and ch.choices[0].finish_reason]
    assert finishes == ["length"]


def test_raw_sse_ends_with_done(qwen3_server: RunningServer) -> None:
    body = {"model": "tiny", "messages": MESSAGES, "max_tokens": 5, "stream": True}
    with httpx.stream("POST", qwen3_server.url + "/chat/completions", json=body, timeout=60) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in r.iter_lines() if line]
    assert lines[-1] == "data: [DONE]"
    assert all(line.startswith("data: ") for line in lines)
    payloads = [json.loads(line[6:]) for line in lines[:-1]]
    assert payloads[0]["choices"][0]["delta"]["role"] == "assistant"


def test_sdk_stream_helper_accumulates(qwen3_server: RunningServer) -> None:
    c = client(qwen3_server)
    # The helper refuses to build a final message after a length stop, so end on a stop string.
    text = c.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=20, temperature=0)
    stop = (text.choices[0].message.content or "")[8:11]
    assert stop.strip()
    expected = c.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=20, temperature=0, stop=stop)
    assert expected.choices[0].finish_reason == "stop"
    with c.chat.completions.stream(model="tiny", messages=MESSAGES, max_tokens=20, temperature=0,
                                   stop=stop) as stream:
        for _ in stream:
            pass
        final = stream.get_final_completion()
    assert final.choices[0].message.content == expected.choices[0].message.content
    assert final.choices[0].message.role == "assistant"
    assert final.choices[0].finish_reason == expected.choices[0].finish_reason


def test_stop_string_split_across_tokens_is_never_streamed(qwen3_server: RunningServer) -> None:
    c = client(qwen3_server)
    loaded = qwen3_server.server.models[0].require()
    full = c.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=40, temperature=0)
    text = full.choices[0].message.content or ""
    # Find a spot where two consecutive tokens both produce visible text, and stop on a string
    # that straddles their boundary.
    ids = loaded.tokenizer.encode(text, add_special_tokens=False)
    stop = None
    for k in range(3, len(ids) - 2):
        head = loaded.tokenizer.decode(ids[:k])
        if text.startswith(head) and len(head) >= 2 and len(text) > len(head) + 2:
            candidate = text[len(head) - 2 : len(head) + 2]
            if candidate.strip() and text.find(candidate) == len(head) - 2:
                stop = candidate
                break
    assert stop is not None, f"no boundary-spanning stop string found in {text!r}"
    expected = text[: text.find(stop)]
    non_stream = c.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=40, temperature=0, stop=stop)
    assert non_stream.choices[0].message.content == expected
    assert non_stream.choices[0].finish_reason == "stop"
    streamed, chunks = stream_text(c, messages=MESSAGES, max_tokens=40, temperature=0, stop=[stop, "never-seen"])
    assert streamed == expected
    for ch in chunks:
        piece = ch.choices[0].delta.content if ch.choices else None
        assert not piece or stop not in piece
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices[0].finish_reason] == ["stop"]


def test_seed_makes_sampling_reproducible(qwen3_server: RunningServer) -> None:
    c = client(qwen3_server)
    kwargs: dict[str, Any] = dict(model="tiny", messages=MESSAGES, max_tokens=24, temperature=1.0, top_p=0.95)
    a = c.chat.completions.create(seed=1234, **kwargs).choices[0].message.content
    b = c.chat.completions.create(seed=1234, **kwargs).choices[0].message.content
    d = c.chat.completions.create(seed=99, **kwargs).choices[0].message.content
    assert a == b
    assert a != d
    streamed, _ = stream_text(c, seed=1234, **{k: v for k, v in kwargs.items() if k != "model"})
    assert streamed == a


def test_a_short_prompt_is_prepared_on_the_loop_and_a_long_one_on_a_worker(
        qwen3_server: RunningServer, monkeypatch: pytest.MonkeyPatch) -> None:
    """chat.prepare templates and tokenizes a short text prompt on the event loop (a worker thread's round trip
    costs more than the work) and anything larger on a worker; the answers are mlx-lm's either way."""
    import trio

    from stages.chat import INLINE_PROMPT_CHARS, ChatPrepare

    on_loop: list[bool] = []
    prepare = ChatPrepare.prepare

    def recording(self: ChatPrepare, *args: Any, **kwargs: Any) -> Any:
        on_loop.append(trio.lowlevel.in_trio_run())
        return prepare(self, *args, **kwargs)

    monkeypatch.setattr(ChatPrepare, "prepare", recording)
    c = client(qwen3_server)
    short = [{"role": "user", "content": "Tell me a story about a lighthouse."}]
    long = [{"role": "user", "content": "a lighthouse keeper " * (INLINE_PROMPT_CHARS // 20 + 1)}]
    for messages in (short, long):
        time.sleep(0.1)  # the loop's share (stages/loop_share.py) spent by earlier requests is paid back
        answer = c.chat.completions.create(model="tiny", messages=messages, max_tokens=8, temperature=0)
        assert answer.choices[0].message.content == reference_text(qwen3_server, messages, 8)
    assert on_loop == [True, False]


def test_sixteen_concurrent_streams_complete_correctly(qwen3_server: RunningServer) -> None:
    c = client(qwen3_server)
    prompts = [[{"role": "user", "content": f"Count to {i} and then say why."}] for i in range(16)]
    expected = [c.chat.completions.create(model="tiny", messages=p, max_tokens=16, temperature=0)
                .choices[0].message.content for p in prompts]
    with concurrent.futures.ThreadPoolExecutor(16) as pool:
        got = list(pool.map(lambda p: stream_text(c, messages=p, max_tokens=16, temperature=0)[0], prompts))
    assert got == expected
    assert qwen3_server.engine_stats()["active"] == 0


def test_disconnect_frees_the_sequence_and_others_continue(qwen3_server: RunningServer) -> None:
    before = qwen3_server.engine_stats()
    c = client(qwen3_server)
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        other = pool.submit(lambda: stream_text(c, messages=MESSAGES, max_tokens=60, temperature=0)[0])
        body = {"model": "tiny", "messages": MESSAGES, "max_tokens": 2000, "stream": True}
        with httpx.stream("POST", qwen3_server.url + "/chat/completions", json=body, timeout=60) as r:
            seen = 0
            for line in r.iter_lines():
                if line.startswith("data: "):
                    seen += 1
                if seen >= 5:
                    break  # leaving the block closes the connection mid-stream
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            stats = qwen3_server.engine_stats()
            if stats["cancelled"] > before["cancelled"]:
                break
            time.sleep(0.05)
        assert stats["cancelled"] == before["cancelled"] + 1
        assert stats["generated_tokens"] - before["generated_tokens"] < 2000
        assert len(other.result(timeout=60)) > 0
    assert qwen3_server.engine_stats()["active"] == 0


BAD_BODIES = [
    (b"{not json", 400, None, "not valid JSON"),
    (b"[1, 2]", 400, None, "JSON object"),
    (json.dumps({"model": "tiny"}).encode(), 400, "messages", "required"),
    (json.dumps({"model": "tiny", "messages": []}).encode(), 400, "messages", "at least 1"),
    (json.dumps({"model": "tiny", "messages": [{"role": "robot", "content": "x"}]}).encode(), 400,
     "messages[0].role", "robot"),
    (json.dumps({"model": "tiny", "messages": "hello"}).encode(), 400, "messages", "list"),
    (json.dumps({"model": "tiny", "messages": MESSAGES, "temperature": 7}).encode(), 400, "temperature", "2"),
    (json.dumps({"model": "tiny", "messages": MESSAGES, "top_p": 0}).encode(), 400, "top_p", "greater than 0"),
    (json.dumps({"model": "tiny", "messages": MESSAGES, "max_tokens": 0}).encode(), 400, "max_tokens", "1"),
    (json.dumps({"model": "tiny", "messages": MESSAGES, "max_tokens": "ten"}).encode(), 400, "max_tokens", "integer"),
    (json.dumps({"model": "tiny", "messages": MESSAGES, "n": 9}).encode(), 400, "n", "at most 8 choices"),
    (json.dumps({"model": "tiny", "messages": MESSAGES, "max_tokens": 10**7}).encode(), 400, "max_tokens",
     "context length"),
    (json.dumps({"model": "nope", "messages": MESSAGES}).encode(), 404, "model", "Available models"),
]


@pytest.mark.parametrize(("body", "status", "param", "fragment"), BAD_BODIES)
def test_bad_requests_get_openai_error_shape(qwen3_server: RunningServer, body: bytes, status: int,
                                             param: str | None, fragment: str) -> None:
    r = httpx.post(qwen3_server.url + "/chat/completions", content=body,
                   headers={"content-type": "application/json"}, timeout=30)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["param"] == param
    assert fragment in error["message"]
    assert qwen3_server.health()["status"] == "ok"


def test_sdk_raises_typed_errors(qwen3_server: RunningServer) -> None:
    c = client(qwen3_server)
    with pytest.raises(openai.NotFoundError):
        c.chat.completions.create(model="missing", messages=MESSAGES)
    with pytest.raises(openai.BadRequestError):
        c.chat.completions.create(model="tiny", messages=[], max_tokens=3)
    ok = c.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=3)
    assert ok.choices[0].message.content is not None


def test_info_endpoints(qwen3_server: RunningServer) -> None:
    assert httpx.head(qwen3_server.base_url + "/", timeout=10).status_code == 200
    health = qwen3_server.health()
    assert health["status"] == "ok" and health["models"][0]["ready"]
    c = client(qwen3_server)
    ids = [m.id for m in c.models.list()]
    assert ids == ["tiny", "default"]
    r = httpx.get(qwen3_server.base_url + "/v1/nowhere", timeout=10)
    assert r.status_code == 404 and "Routes" in r.json()["error"]["message"]
    r = httpx.get(qwen3_server.url + "/chat/completions", timeout=10)
    assert r.status_code == 405 and r.json()["error"]["type"] == "invalid_request_error"
