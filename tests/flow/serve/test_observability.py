"""``/stats`` and ``/metrics`` after real traffic."""

from __future__ import annotations

import httpx
import openai

from tests.harness import RunningServer


def test_stats_and_metrics_reflect_traffic(qwen3_server: RunningServer) -> None:
    c = openai.OpenAI(base_url=qwen3_server.url, api_key="x", max_retries=0)
    c.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=4)
    list(c.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=4,
                                   stream=True))
    httpx.post(qwen3_server.url + "/chat/completions", json={"model": "nope", "messages": []})
    stats = httpx.get(qwen3_server.base_url + "/stats").json()
    model = stats["models"]["tiny"]
    assert model["ready"] and model["family"] == "qwen3" and model["engine"]["generated_tokens"] >= 4
    edges = stats["edges"]
    assert edges["generate -> process"]["items"] >= 2 and edges["prepare -> generate"]["streams"] >= 2
    assert "openai_chat -> prepare" in edges and "response_store" in stats["resources"]
    # The chat chain runs in one task: its edges are calls (no queue), and still counted.
    assert edges["generate -> process"]["inline"] and edges["openai_chat -> prepare"]["inline"]
    text = httpx.get(qwen3_server.base_url + "/metrics").text
    lines = text.splitlines()
    assert "# TYPE flow_requests_total counter" in lines
    assert any(line.startswith('flow_requests_total{route="POST /v1/chat/completions",status="200"}')
               for line in lines)
    assert any(line.startswith('flow_requests_total{route="POST /v1/chat/completions",status="400"}')
               for line in lines)
    assert any(line.startswith('flow_generated_tokens_total{model="tiny"}') for line in lines)
    assert any(line.startswith("flow_request_duration_seconds_bucket{") and 'le="+Inf"' in line for line in lines)
    assert any(line.startswith('flow_edge_items_total{edge="generate->process"}') for line in lines)
    for line in lines:
        if line and not line.startswith("#"):
            name_and_labels, value = line.rsplit(" ", 1)
            float(value.replace("+Inf", "inf"))
