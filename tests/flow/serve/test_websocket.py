"""The Responses API's WebSocket mode through the real server and real MLX: the official SDK's
``client.responses.connect()``, responses in order on one connection (``previous_response_id`` across them),
lanes (``stream_id``) side by side, error events that leave the connection open; and WebSockets to paths
without a WebSocket route refused before the upgrade, in the path's protocol shape, never a 500."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
from websockets.exceptions import InvalidStatus
from websockets.sync.client import ClientConnection, connect

from flow.builtins import compile_tables
from tests.harness import RunningServer, running_server, tables_with_model

TERMINAL = ("response.completed", "response.incomplete", "response.failed", "error")


def ws_url(server: RunningServer, path: str = "/v1/responses") -> str:
    return server.base_url.replace("http://", "ws://") + path


def events_until_done(connection: ClientConnection, count: int = 1) -> list[dict[str, Any]]:
    """Messages until ``count`` responses (or errors) have ended."""
    out: list[dict[str, Any]] = []
    while count:
        event = json.loads(connection.recv(timeout=60))
        out.append(event)
        count -= event["type"] in TERMINAL
    return out


def test_the_sdk_runs_responses_over_one_connection(qwen3_server: RunningServer) -> None:
    client = openai.OpenAI(base_url=qwen3_server.url, api_key="x", max_retries=0)
    over_http = client.responses.create(model="tiny", input="Hello there", max_output_tokens=10, temperature=0)
    with client.responses.connect() as connection:
        connection.response.create(model="tiny", input="Hello there", max_output_tokens=10, temperature=0)
        first = None
        text = ""
        for event in connection:
            if event.type == "response.output_text.delta":
                text += event.delta
            if event.type in TERMINAL:
                first = event
                break
        assert first is not None and first.type == "response.incomplete"  # max_output_tokens reached
        assert text == over_http.output_text
        # The next turn on the same connection continues the stored first one.
        connection.response.create(model="tiny", input="And then?", max_output_tokens=6, temperature=0,
                                   previous_response_id=first.response.id)
        kinds = []
        for event in connection:
            kinds.append(event.type)
            if event.type in TERMINAL:
                break
        assert kinds[0] == "response.created" and kinds[-1] == "response.incomplete"


def test_errors_are_events_and_the_connection_stays_open(qwen3_server: RunningServer) -> None:
    with connect(ws_url(qwen3_server)) as connection:
        connection.send(json.dumps({"type": "response.create", "model": "nope", "input": "hi"}))
        error = events_until_done(connection)[-1]
        assert error["type"] == "error" and error["status"] == 404 and "nope" in error["error"]["message"]
        connection.send(json.dumps({"type": "session.update"}))
        assert "response.create" in json.loads(connection.recv(timeout=30))["error"]["message"]
        connection.send("not json")
        assert json.loads(connection.recv(timeout=30))["status"] == 400
        connection.send(json.dumps({"type": "response.create", "model": "tiny", "input": "hi",
                                    "max_output_tokens": 3, "temperature": 0}))
        assert events_until_done(connection)[-1]["type"] == "response.incomplete"


def test_lanes_run_side_by_side_and_echo_their_stream_id(qwen3_server: RunningServer) -> None:
    with connect(ws_url(qwen3_server)) as connection:
        for lane in ("a", "b"):
            connection.send(json.dumps({"type": "response.create", "stream_id": lane, "model": "tiny",
                                        "input": f"lane {lane}", "max_output_tokens": 6, "temperature": 0}))
        events = events_until_done(connection, 2)
    by_lane = {lane: [e["type"] for e in events if e.get("stream_id") == lane] for lane in ("a", "b")}
    for kinds in by_lane.values():
        assert kinds[0] == "response.created" and kinds[-1] == "response.incomplete"
    assert len(events) == len(by_lane["a"]) + len(by_lane["b"])  # every event names its lane


@pytest.mark.parametrize(("path", "shape"), [("/nope", "openai"), ("/v1/chat/completions", "openai"),
                                             ("/v1/messages", "anthropic")])
def test_other_paths_refuse_the_upgrade_in_their_shape(qwen3_server: RunningServer, path: str, shape: str) -> None:
    with pytest.raises(InvalidStatus) as refused:
        with connect(ws_url(qwen3_server, path)):
            pass
    response = refused.value.response
    assert response.status_code == 404
    body = json.loads(bytes(response.body or b""))
    assert "WebSocket routes: /v1/responses" in (body["error"]["message"])
    assert (body.get("type") == "error") == (shape == "anthropic")
    assert qwen3_server.health()["status"] == "ok"


@pytest.fixture(scope="module")
def keyed_server(tiny_qwen3: Path) -> Iterator[RunningServer]:
    tables = tables_with_model(tiny_qwen3)
    tables.setdefault("server", {})["api_key"] = "sesame"
    with running_server(compile_tables(tables, "websocket with a key (test)")) as running:
        yield running


def test_the_api_key_guards_the_upgrade(keyed_server: RunningServer) -> None:
    with pytest.raises(InvalidStatus) as refused:
        with connect(ws_url(keyed_server)):
            pass
    assert refused.value.response.status_code == 401
    with connect(ws_url(keyed_server), additional_headers={"Authorization": "Bearer sesame"}) as connection:
        connection.send(json.dumps({"type": "response.create", "model": "tiny", "input": "hi", "max_output_tokens": 2,
                                    "temperature": 0}))
        assert events_until_done(connection)[-1]["type"] == "response.incomplete"
