"""An API key, when configured, guards every protocol's routes, each answering in its own error shape."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import anthropic
import httpx
import openai
import pytest

from tests.harness import RunningServer, graph_with_model, running_server

KEY = "sk-test-123"
CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
MESSAGES = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
ROUTES = [
    ("/v1/chat/completions", CHAT, "openai"),
    ("/v1/completions", {"model": "tiny", "prompt": "hi", "max_tokens": 2}, "openai"),
    ("/v1/responses", {"model": "tiny", "input": "hi", "max_output_tokens": 2}, "openai"),
    ("/v1/messages", MESSAGES, "anthropic"),
    ("/v1/messages/count_tokens", {"model": "tiny", "messages": MESSAGES["messages"]}, "anthropic"),
]


@pytest.fixture(scope="module")
def keyed_server(tiny_qwen3: Path) -> Iterator[RunningServer]:
    graph = graph_with_model(tiny_qwen3)
    graph.spec.server.api_key = KEY
    with running_server(graph) as server:
        yield server


@pytest.mark.parametrize(("path", "body", "shape"), ROUTES)
def test_wrong_or_missing_key_is_401_in_the_protocols_shape(keyed_server: RunningServer, path: str,
                                                            body: dict[str, object], shape: str) -> None:
    for headers in ({}, {"x-api-key": "wrong"}, {"authorization": "Bearer wrong"}):
        r = httpx.post(keyed_server.base_url + path, json=body, headers=headers)
        assert r.status_code == 401, r.text
        payload = r.json()
        if shape == "anthropic":
            assert payload["type"] == "error" and payload["error"]["type"] == "authentication_error"
        else:
            assert payload["error"]["type"] == "authentication_error"
    for headers in ({"x-api-key": KEY}, {"authorization": f"Bearer {KEY}"}):
        assert httpx.post(keyed_server.base_url + path, json=body, headers=headers).status_code == 200


def test_sdks_authenticate_with_the_key(keyed_server: RunningServer) -> None:
    assert openai.OpenAI(base_url=keyed_server.url, api_key=KEY).chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=2).choices
    assert anthropic.Anthropic(base_url=keyed_server.base_url, api_key=KEY).messages.create(
        model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=2).content is not None
    with pytest.raises(anthropic.AuthenticationError):
        anthropic.Anthropic(base_url=keyed_server.base_url, api_key="nope", max_retries=0).messages.create(
            model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=2)


def test_without_a_configured_key_any_key_is_accepted(qwen3_server: RunningServer) -> None:
    r = httpx.post(qwen3_server.url + "/chat/completions", json=CHAT, headers={"authorization": "Bearer anything"})
    assert r.status_code == 200
