"""One rule for base URLs, whichever way a client writes them: every route answers with and without ``/v1``
(and a doubled ``/v1/v1``), through the official SDKs; errors on such paths keep the route's protocol shape."""

from __future__ import annotations

import anthropic
import httpx
import openai

from tests.harness import RunningServer


def test_the_sdks_reach_every_route_with_or_without_v1(qwen3_server: RunningServer) -> None:
    root = qwen3_server.base_url
    for base in (root, root + "/v1"):
        client = openai.OpenAI(base_url=base, api_key="none")
        assert [m.id for m in client.models.list().data][:1] == ["tiny"]
        answer = client.responses.create(model="tiny", input="hi", max_output_tokens=2)
        assert answer.status in ("completed", "incomplete")
        chat = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}],
                                              max_tokens=2)
        assert chat.choices[0].finish_reason in ("stop", "length")
    for base in (root, root + "/v1"):  # the Anthropic SDK adds /v1 itself: /v1/messages and /v1/v1/messages
        message = anthropic.Anthropic(base_url=base, api_key="none").messages.create(
            model="tiny", max_tokens=2, messages=[{"role": "user", "content": "hi"}])
        assert message.type == "message"


def test_errors_on_a_path_without_v1_keep_the_routes_shape(qwen3_server: RunningServer) -> None:
    bad = httpx.post(qwen3_server.base_url + "/messages", json={"model": "tiny"}, timeout=30)
    assert bad.status_code == 400 and bad.json()["type"] == "error"  # Anthropic's shape
    unknown = httpx.post(qwen3_server.base_url + "/v1/nothing/here", json={}, timeout=30)
    assert unknown.status_code == 404 and "No route POST /v1/nothing/here" in unknown.json()["error"]["message"]
    wrong_method = httpx.delete(qwen3_server.base_url + "/models", timeout=30)
    assert wrong_method.status_code == 405
