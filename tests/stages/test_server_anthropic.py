"""Anthropic Messages end to end: real server, real MLX, the official ``anthropic`` SDK in strict mode."""

from __future__ import annotations

import json
from typing import Any

import anthropic
import httpx
import openai
import pytest

from tests.harness import RunningServer

# This SDK version no longer has sampling arguments; the API (and this server) still take them.
GREEDY = {"temperature": 0}
MESSAGES: list[Any] = [{"role": "user", "content": "Tell me a story about a lighthouse."}]

# What Claude Code sends: a billing block first, cache_control everywhere, client and server
# tools, a history with thinking, tool_use and tool_result blocks, and fields a local server
# has no use for.
CLAUDE_CODE_TOOLS: list[Any] = [
    {"name": "Read", "description": "Read a file", "cache_control": {"type": "ephemeral"},
     "input_schema": {"type": "object", "properties": {"file_path": {"type": "string"}},
                      "required": ["file_path"]}},
    {"type": "web_search_20250305", "name": "web_search", "max_uses": 5},
]


def claude_code_body(billing: str = "cc_version=2.0.1; cch=abc", **extra: Any) -> dict[str, Any]:
    return {
        "model": "tiny",
        "max_tokens": 16,
        "system": [
            {"type": "text", "text": f"x-anthropic-billing-header: {billing}"},
            {"type": "text", "text": "You are Claude Code, a CLI for coding.", "cache_control": {"type": "ephemeral"}},
        ],
        "messages": [
            {"role": "user", "content": [{"type": "text", "text": "What is in README.md?",
                                          "cache_control": {"type": "ephemeral"}}]},
            {"role": "assistant", "content": [
                {"type": "thinking", "thinking": "I should read the file.", "signature": "sig-from-before"},
                {"type": "redacted_thinking", "data": "opaque"},
                {"type": "text", "text": "Let me read it."},
                {"type": "tool_use", "id": "toolu_01", "name": "Read", "input": {"file_path": "README.md"}},
            ]},
            {"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": "toolu_01", "content": [{"type": "text", "text": "# flow"}]},
                {"type": "tool_result", "tool_use_id": "toolu_01", "content": "again", "is_error": True},
                {"type": "text", "text": "Summarize it."},
            ]},
        ],
        "tools": CLAUDE_CODE_TOOLS,
        "tool_choice": {"type": "auto"},
        "thinking": {"type": "enabled", "budget_tokens": 1024},
        "metadata": {"user_id": "user_abc"},
        "output_config": {"effort": "high"},
        "context_management": {"edits": []},
        "temperature": 1,
        **extra,
    }


def client(server: RunningServer, **kwargs: Any) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=server.base_url, api_key="unused", max_retries=0, timeout=120,
                               _strict_response_validation=True, **kwargs)


def greedy_openai_text(server: RunningServer, max_tokens: int) -> str:
    c = openai.OpenAI(base_url=server.url, api_key="unused", max_retries=0)
    out = c.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=max_tokens, temperature=0)
    return out.choices[0].message.content or ""


def test_create_and_stream_share_the_inference_path(qwen3_server: RunningServer) -> None:
    c = client(qwen3_server)
    expected = greedy_openai_text(qwen3_server, 24)
    message = c.messages.create(model="tiny", max_tokens=24, messages=MESSAGES, extra_body=GREEDY)
    assert message.content and message.content[0].type == "text"
    assert message.content[0].text == expected
    assert message.stop_reason == "max_tokens" and message.usage.output_tokens == 24
    # The OpenAI request above cached the same prompt: this one reads all of it but the last token.
    u = message.usage
    assert u.cache_read_input_tokens and u.input_tokens == 1 and u.cache_creation_input_tokens == 0
    with c.messages.stream(model="tiny", max_tokens=24, messages=MESSAGES, extra_body=GREEDY) as stream:
        streamed = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert streamed == expected
    assert final.content[0].type == "text" and final.content[0].text == expected
    assert final.usage.output_tokens == 24 and final.usage.input_tokens == message.usage.input_tokens
    assert final.stop_reason == "max_tokens"


def test_stop_sequence_reported(qwen3_server: RunningServer) -> None:
    c = client(qwen3_server)
    text = greedy_openai_text(qwen3_server, 20)
    stop = text[8:11]
    assert stop.strip()
    message = c.messages.create(model="tiny", max_tokens=20, messages=MESSAGES, extra_body=GREEDY, stop_sequences=[stop])
    assert message.stop_reason == "stop_sequence" and message.stop_sequence == stop
    assert message.content[0].type == "text" and message.content[0].text == text[: text.find(stop)]
    with c.messages.stream(model="tiny", max_tokens=20, messages=MESSAGES, extra_body=GREEDY,
                           stop_sequences=[stop]) as stream:
        assert "".join(stream.text_stream) == text[: text.find(stop)]
        final = stream.get_final_message()
    assert final.stop_reason == "stop_sequence" and final.stop_sequence == stop


@pytest.mark.parametrize("stream", [False, True])
def test_claude_code_shaped_request(qwen3_server: RunningServer, stream: bool) -> None:
    headers = {"anthropic-version": "2023-06-01", "anthropic-beta": "claude-code-20250219,interleaved-thinking-2025-05-14",
               "x-app": "cli", "user-agent": "claude-cli/2.0.1 (external, cli)"}
    body = claude_code_body(stream=stream)
    r = httpx.post(qwen3_server.base_url + "/v1/messages?beta=true", json=body, headers=headers, timeout=120)
    assert r.status_code == 200, r.text
    if stream:
        events = parse_sse(r.text)
        assert events[0][0] == "message_start" and events[-1][0] == "message_stop"
    else:
        message = r.json()
        assert message["type"] == "message" and message["stop_reason"] in ("max_tokens", "end_turn")
        anthropic.types.Message.model_validate(message)


def test_billing_header_does_not_change_the_prompt(qwen3_server: RunningServer) -> None:
    def count(body: dict[str, Any]) -> int:
        body = {k: v for k, v in body.items() if k not in ("max_tokens",)}
        r = httpx.post(qwen3_server.base_url + "/v1/messages/count_tokens?beta=true", json=body, timeout=60)
        assert r.status_code == 200, r.text
        return int(r.json()["input_tokens"])

    first = count(claude_code_body("cc_version=2.0.1; cch=aaaa"))
    second = count(claude_code_body("cc_version=2.0.9; cch=bbbbbbbbbbbbbbbbbbbb"))
    without = claude_code_body()
    without["system"] = without["system"][1:]
    assert first == second == count(without)


def test_count_tokens_counts_what_would_be_prefilled(qwen3_server: RunningServer) -> None:
    c = client(qwen3_server)
    short = c.messages.count_tokens(model="tiny", messages=MESSAGES).input_tokens
    longer = c.messages.count_tokens(model="tiny", messages=[*MESSAGES, {"role": "assistant", "content": "Once"},
                                                             {"role": "user", "content": "Go on, please."}])
    with_tools = c.messages.count_tokens(model="tiny", messages=MESSAGES, tools=CLAUDE_CODE_TOOLS[:1])
    assert 0 < short < longer.input_tokens and short < with_tools.input_tokens
    created = c.messages.create(model="tiny", max_tokens=1, messages=MESSAGES)
    u = created.usage  # Anthropic counts cache reads and writes apart from input_tokens
    assert u.input_tokens + (u.cache_read_input_tokens or 0) + (u.cache_creation_input_tokens or 0) == short


def parse_sse(text: str) -> list[tuple[str, dict[str, Any]]]:
    events = []
    for block in text.strip().split("\n\n"):
        lines = block.split("\n")
        assert lines[0].startswith("event: "), f"event without an event: line: {block!r}"
        assert lines[1].startswith("data: ") and len(lines) == 2
        name, data = lines[0][7:], json.loads(lines[1][6:])
        assert data["type"] == name
        events.append((name, data))
    return events


def check_grammar(events: list[tuple[str, dict[str, Any]]]) -> None:
    """Anthropic's event grammar, independently of any SDK."""
    names = [n for n, _ in events]
    assert names[0] == "message_start" and names.count("message_start") == 1
    assert names[-2:] == ["message_delta", "message_stop"]
    assert "ping" in names
    message = events[0][1]["message"]
    for key in ("id", "type", "role", "content", "model", "stop_reason", "usage"):
        assert key in message
    assert message["content"] == [] and message["stop_reason"] is None
    assert {"input_tokens", "output_tokens"} <= set(message["usage"])
    open_index: int | None = None
    next_index = 0
    for name, data in events[1:-2]:
        if name == "content_block_start":
            assert open_index is None and data["index"] == next_index
            open_index, next_index = data["index"], next_index + 1
            assert data["content_block"]["type"] in ("text", "thinking", "tool_use")
        elif name == "content_block_delta":
            assert data["index"] == open_index
            assert data["delta"]["type"] in ("text_delta", "thinking_delta", "signature_delta", "input_json_delta")
        elif name == "content_block_stop":
            assert data["index"] == open_index
            open_index = None
        else:
            assert name == "ping", name
    assert open_index is None
    delta = events[-2][1]
    assert delta["delta"]["stop_reason"] in ("end_turn", "max_tokens", "stop_sequence", "tool_use")
    assert isinstance(delta["usage"]["output_tokens"], int)


def test_raw_sse_event_grammar(qwen3_server: RunningServer) -> None:
    # Greedy: sampled at Anthropic's default temperature, a random-weight model may end early on a stop token.
    body = {"model": "tiny", "max_tokens": 12, "messages": MESSAGES, "stream": True, "temperature": 0}
    with httpx.stream("POST", qwen3_server.base_url + "/v1/messages", json=body, timeout=60) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        text = r.read().decode()
    events = parse_sse(text)
    check_grammar(events)
    # A random-weight model may open a thinking block or a tool call: every kind of delta carries content.
    texts = [value for n, d in events if n == "content_block_delta"
             for key, value in d["delta"].items() if key in ("text", "thinking", "partial_json")]
    assert events[-2][1]["usage"]["output_tokens"] == 12 and "".join(texts)


@pytest.mark.parametrize(
    ("body", "status", "error_type", "needle"),
    [
        (b"{not json", 400, "invalid_request_error", "not valid JSON"),
        (json.dumps({"model": "tiny", "messages": MESSAGES}).encode(), 400, "invalid_request_error", "max_tokens"),
        (json.dumps({"model": "tiny", "max_tokens": 5, "messages": []}).encode(), 400, "invalid_request_error",
         "messages"),
        (json.dumps({"model": "tiny", "max_tokens": 5, "messages": [{"role": "tool", "content": "x"}]}).encode(),
         400, "invalid_request_error", "messages[0].role"),
        (json.dumps({"model": "tiny", "max_tokens": 5, "temperature": 3, "messages": MESSAGES}).encode(), 400,
         "invalid_request_error", "temperature"),
        (json.dumps({"model": "tiny", "max_tokens": 5, "messages": [
            {"role": "user", "content": [{"type": "tool_use", "id": 1}]}]}).encode(), 400,
         "invalid_request_error", "messages[0].content[0]"),
        (json.dumps({"model": "nope", "max_tokens": 5, "messages": MESSAGES}).encode(), 404, "not_found_error",
         "nope"),
        (json.dumps({"model": "tiny", "max_tokens": 10_000_000, "messages": MESSAGES}).encode(), 400,
         "invalid_request_error", "context length"),
    ],
)
def test_bad_requests_get_anthropic_error_shape(qwen3_server: RunningServer, body: bytes, status: int,
                                                error_type: str, needle: str) -> None:
    r = httpx.post(qwen3_server.base_url + "/v1/messages", content=body,
                   headers={"content-type": "application/json"}, timeout=30)
    assert r.status_code == status, r.text
    payload = r.json()
    assert payload["type"] == "error" and payload["error"]["type"] == error_type
    assert needle in payload["error"]["message"]
    assert r.headers["x-should-retry"] == "false"
    assert qwen3_server.health()["status"] == "ok"


def test_sdk_raises_typed_errors(qwen3_server: RunningServer) -> None:
    c = client(qwen3_server)
    with pytest.raises(anthropic.NotFoundError):
        c.messages.create(model="nope", max_tokens=5, messages=MESSAGES)
    with pytest.raises(anthropic.BadRequestError):
        c.messages.create(model="tiny", max_tokens=5, messages=MESSAGES, stop_sequences=[""])


def test_models_list_serves_both_sdks(qwen3_server: RunningServer) -> None:
    page = client(qwen3_server).models.list()
    ids = [m.id for m in page.data]
    assert ids == ["tiny", "default"] and all(m.type == "model" for m in page.data)
    assert [m.id for m in openai.OpenAI(base_url=qwen3_server.url, api_key="x").models.list().data] == ids
