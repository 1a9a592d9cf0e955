"""Images sent to a text model, one rule in every protocol through the real server: an image in the message the
request asks about now is a 400 in the protocol's own shape naming the models that read images; an image
earlier in the conversation, or inside a tool result (Claude Code's screenshots), becomes a marker and the
conversation goes on."""

from __future__ import annotations

import base64
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from flow.builtins import compile_tables
from protocols.anthropic_messages import decode_messages_request
from protocols.documents import media_marker
from protocols.openai_chat import decode_chat_request
from tests.harness import RunningServer, running_server, tables_with_model

PNG = "iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR42mP8z8BQDwAEhQGAhKmMIQAAAABJRU5ErkJggg=="
CHAT_IMAGE = {"type": "image_url", "image_url": {"url": f"data:image/png;base64,{PNG}"}}
ANTHROPIC_IMAGE = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": PNG}}


@pytest.fixture(scope="module")
def server(tiny_qwen3: Path) -> Iterator[RunningServer]:
    tables = tables_with_model(tiny_qwen3)
    tables["stages"]["generate"]["type"] = "generate.echo"
    with running_server(compile_tables(tables, "images (test)")) as running:
        yield running


def post(server: RunningServer, path: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(server.base_url + path, timeout=60, json={"model": "tiny", **body})


def refused(answer: httpx.Response) -> str:
    assert answer.status_code == 400, answer.text
    body = answer.json()
    message = body["error"]["message"] if isinstance(body["error"], dict) else body["error"]
    assert "reads text only" in message and "read images: (none)" in message, message
    return str(message)


def test_an_image_in_the_last_message_is_refused_in_every_protocol(server: RunningServer) -> None:
    refused(post(server, "/v1/chat/completions", {"max_tokens": 5, "messages": [
        {"role": "user", "content": [{"type": "text", "text": "What is this?"}, CHAT_IMAGE]}]}))
    anthropic = post(server, "/v1/messages", {"max_tokens": 5, "messages": [
        {"role": "user", "content": [ANTHROPIC_IMAGE, {"type": "text", "text": "What is this?"}]}]})
    assert anthropic.json()["type"] == "error" and "1 image" in refused(anthropic)
    refused(post(server, "/v1/responses", {"max_output_tokens": 5, "input": [
        {"role": "user", "content": [{"type": "input_text", "text": "What is this?"},
                                     {"type": "input_image", "image_url": f"data:image/png;base64,{PNG}"}]}]}))
    ollama = post(server, "/api/chat", {"stream": False, "messages": [
        {"role": "user", "content": "What is this?", "images": [PNG, PNG]}]})
    assert set(ollama.json()) == {"error"} and "2 images" in refused(ollama)


def test_earlier_images_and_tool_result_screenshots_are_markers(server: RunningServer) -> None:
    history = post(server, "/v1/chat/completions", {"max_tokens": 20, "messages": [
        {"role": "user", "content": [CHAT_IMAGE]}, {"role": "assistant", "content": "A picture."},
        {"role": "user", "content": "Thanks."}]})
    assert history.status_code == 200 and history.json()["choices"][0]["message"]["content"] == "Thanks."
    screenshot = post(server, "/v1/messages", {"max_tokens": 20, "messages": [
        {"role": "user", "content": "Take a screenshot."},
        {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_1", "name": "screenshot", "input": {}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": [ANTHROPIC_IMAGE]},
                                     {"type": "text", "text": "Go on."}]}],
        "tools": [{"name": "screenshot", "input_schema": {"type": "object"}}]})
    assert screenshot.status_code == 200, screenshot.text


def test_every_protocol_writes_the_same_marker() -> None:
    chat = decode_chat_request(json.dumps({"model": "m", "messages": [
        {"role": "user", "content": [{"type": "text", "text": "See: "}, CHAT_IMAGE]}]}).encode(), "r", 0)
    messages = decode_messages_request(json.dumps({"model": "m", "max_tokens": 1, "messages": [
        {"role": "user", "content": [{"type": "text", "text": "See: "}, ANTHROPIC_IMAGE]}]}).encode(), "r", 0)
    for request in (chat, messages):
        assert request.messages[-1].to_template()["content"] == "See: " + media_marker("image")
        assert [image.data for image in request.messages[-1].images] == [base64.b64decode(PNG)]
