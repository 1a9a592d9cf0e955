"""The stateful agents API end to end: real server, real MLX, the agent store in a temporary SQLite file.

The default graph's ``agent_store`` and ``prefix_cache`` are pointed into ``tmp_path`` (a restart
reopens both); 16-token KV blocks make the tiny conversations span several blocks.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from flow.builtins import compile_tables
from protocols.ir import Message
from stages.chat import turn_groups
from tests.harness import RunningServer, running_server, tables_with_prefix_cache

BLOCK = 16
SYSTEM = ("You are the keeper's assistant at the old lighthouse. Answer briefly, mention the lamp, "
          "the weather and the ships, and keep a friendly tone. ") * 2


@contextmanager
def agent_server(model: Path, tmp: Path, *, extra_models: dict[str, Path] | None = None,
                 **store: Any) -> Iterator[RunningServer]:
    tables = tables_with_prefix_cache(model, tmp / "kv", BLOCK)
    for name, path in (extra_models or {}).items():
        tables["resources"][name] = {"type": "model", "path": str(path)}
    tables["resources"]["agent_store"].update(path=str(tmp / "agents.sqlite"), **store)
    with running_server(compile_tables(tables, "default.toml (agents test)")) as server:
        yield server


@pytest.fixture(scope="module")
def server(tiny_qwen3: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    with agent_server(tiny_qwen3, tmp_path_factory.mktemp("agents")) as running:
        yield running


def api(server: RunningServer, method: str, path: str, body: Any = None) -> httpx.Response:
    return httpx.request(method, server.url + path, json=body, timeout=120)


def create(server: RunningServer, **body: Any) -> dict[str, Any]:
    response = api(server, "POST", "/agents", {"model": "tiny", **body})
    assert response.status_code == 200, response.text
    return response.json()  # type: ignore[no-any-return]


def get(server: RunningServer, agent_id: str) -> dict[str, Any]:
    response = api(server, "GET", f"/agents/{agent_id}")
    assert response.status_code == 200, response.text
    return response.json()  # type: ignore[no-any-return]


def generate(server: RunningServer, agent_id: str, text: str, **extra: Any) -> dict[str, Any]:
    body = {"messages": [{"role": "user", "content": text}], "max_tokens": 6, "temperature": 0, **extra}
    response = api(server, "POST", f"/agents/{agent_id}/generate", body)
    assert response.status_code == 200, response.text
    return response.json()  # type: ignore[no-any-return]


def generate_stream(server: RunningServer, agent_id: str, text: str) -> tuple[list[dict[str, Any]], str]:
    """The SSE chunks of a streamed turn, and its text."""
    body = {"messages": [{"role": "user", "content": text}], "max_tokens": 6, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    with httpx.stream("POST", f"{server.url}/agents/{agent_id}/generate", json=body, timeout=120) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        data = [line.removeprefix("data: ") for line in response.iter_lines() if line.startswith("data: ")]
    assert data[-1] == "[DONE]"
    chunks = [json.loads(d) for d in data[:-1]]
    text_out = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
    return chunks, text_out


def cached(usage: dict[str, Any]) -> int:
    return usage["prompt_tokens_details"]["cached_tokens"]  # type: ignore[no-any-return]


def assert_openai_error(response: httpx.Response, status: int, param: str | None, *words: str) -> dict[str, Any]:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["param"] == param
    for word in words:
        assert word in error["message"], error["message"]
    return error  # type: ignore[no-any-return]


# --------------------------------------------------------------------------- CRUD


def test_create_list_get_delete_round_trip(server: RunningServer) -> None:
    made = create(server, id="crud-1", system_prompt="Be brief.", max_context=512)
    assert made["id"] == "crud-1" and made["object"] == "agent" and made["model"] == "tiny"
    assert made["system_prompt"] == "Be brief." and made["max_context"] == 512 and made["persist"] is True
    assert made["status"] == "cold" and made["context_tokens"] == 0 and made["messages"] == 0
    assert made["context_overflow"] == "error" and made["created_at"] > 0
    generated = create(server, model="default", persist=False)  # an alias resolves to the model's name
    assert generated["id"].startswith("agent_") and generated["model"] == "tiny" and generated["persist"] is False

    listed = api(server, "GET", "/agents").json()
    assert listed["object"] == "list"
    ids = [a["id"] for a in listed["data"]]
    assert "crud-1" in ids and generated["id"] in ids
    assert all("history" not in a for a in listed["data"])

    one = get(server, "crud-1")
    assert one["history"] == [] and {k: v for k, v in one.items() if k != "history"} == made

    patched = api(server, "PATCH", "/agents/crud-1", {"system_prompt": "Be terse.", "max_context": None}).json()
    assert patched["system_prompt"] == "Be terse." and patched["max_context"] is None and patched["model"] == "tiny"

    deleted = api(server, "DELETE", "/agents/crud-1")
    assert deleted.status_code == 200 and deleted.json() == {"id": "crud-1", "object": "agent.deleted",
                                                             "deleted": True}
    assert_openai_error(api(server, "GET", "/agents/crud-1"), 404, "agent_id", "crud-1")
    assert_openai_error(api(server, "DELETE", "/agents/crud-1"), 404, "agent_id")
    assert "crud-1" not in [a["id"] for a in api(server, "GET", "/agents").json()["data"]]
    assert api(server, "DELETE", f"/agents/{generated['id']}").status_code == 200


def test_errors_come_in_the_openai_shape(server: RunningServer) -> None:
    create(server, id="dup")
    error = assert_openai_error(api(server, "POST", "/agents", {"id": "dup", "model": "tiny"}), 409, "id",
                                "already exists")
    assert error["code"] == "agent_exists" and error["type"] == "invalid_request_error"
    assert_openai_error(api(server, "POST", "/agents", {"id": "x"}), 400, "model", "'model' is required")
    assert_openai_error(api(server, "POST", "/agents", {"model": "tiny", "max_context": "big"}), 400,
                        "max_context")
    assert_openai_error(api(server, "POST", "/agents", {"model": "tiny", "sytem_prompt": "typo"}), 400,
                        "sytem_prompt")
    assert_openai_error(api(server, "POST", "/agents", {"model": "tiny", "id": "no/slash"}), 400, "id")
    assert_openai_error(api(server, "POST", "/agents", {"model": "tiny", "context_overflow": "shrug"}), 400,
                        "context_overflow")
    missing = assert_openai_error(api(server, "POST", "/agents", {"model": "nope"}), 404, "model", "nope")
    assert missing["code"] == "model_not_found"
    bad_json = httpx.post(server.url + "/agents", content=b"{not json", timeout=30,
                          headers={"content-type": "application/json"})
    assert_openai_error(bad_json, 400, None, "not valid JSON")

    unknown = api(server, "POST", "/agents/ghost/generate", {"messages": [{"role": "user", "content": "hi"}]})
    assert assert_openai_error(unknown, 404, "agent_id", "ghost")["code"] == "agent_not_found"
    assert_openai_error(api(server, "POST", "/agents/dup/generate", {"max_tokens": 4}), 400, "messages",
                        "'messages' is required")
    assert_openai_error(api(server, "POST", "/agents/dup/generate",
                            {"messages": [{"role": "wizard", "content": "hi"}]}), 400, "messages[0].role")
    assert_openai_error(api(server, "POST", "/agents/dup/generate",
                            {"messages": [{"role": "user", "content": "hi"}], "model": "nope"}), 404, "model")
    assert_openai_error(api(server, "PATCH", "/agents/dup", {"model": None}), 400, "model", "cannot be null")
    assert_openai_error(api(server, "PATCH", "/agents/ghost", {"model": "tiny"}), 404, "agent_id")
    assert get(server, "dup")["messages"] == 0  # failed turns leave no trace
    assert server.health()["status"] == "ok"


# --------------------------------------------------------------------------- generate


def test_turns_grow_the_history_and_reuse_the_kv_cache(server: RunningServer) -> None:
    create(server, id="keeper", system_prompt=SYSTEM)
    first = generate(server, "keeper", "Where is the lamp?")
    assert first["object"] == "chat.completion" and first["id"].startswith("chatcmpl-")
    assert first["model"] == "tiny" and first["choices"][0]["message"]["role"] == "assistant"
    answer1 = first["choices"][0]["message"]["content"]
    after1 = get(server, "keeper")
    assert after1["history"] == [{"role": "user", "content": "Where is the lamp?"},
                                 {"role": "assistant", "content": answer1}]
    usage1 = first["usage"]
    assert after1["context_tokens"] == usage1["prompt_tokens"] + usage1["completion_tokens"] > 0
    assert after1["status"] == "hot" and after1["last_access"] >= after1["created_at"]

    # Same conversation through plain chat completions: the agent's prompt is system + history + new.
    second = generate(server, "keeper", "And the ships?")
    usage2 = second["usage"]
    # At least the first turn's prompt but its last token (the prompt's tail ends there); that token and the
    # answer are cached after it, reusable as far as the random model's answer tokenizes back to its ids.
    assert cached(usage2) >= usage1["prompt_tokens"] - 1
    assert usage2["prompt_tokens"] > usage1["prompt_tokens"]
    client = openai.OpenAI(base_url=server.url, api_key="unused", max_retries=0)
    plain = client.chat.completions.create(model="tiny", max_tokens=6, temperature=0, messages=[
        {"role": "system", "content": SYSTEM}, *after1["history"], {"role": "user", "content": "And the ships?"}])
    assert plain.usage is not None and plain.usage.prompt_tokens == usage2["prompt_tokens"]
    assert plain.choices[0].message.content == second["choices"][0]["message"]["content"]

    # Streaming turns, twice: chat.completion.chunk SSE, [DONE], and the history grows by both.
    chunks, text3 = generate_stream(server, "keeper", "Is a storm coming?")
    assert all(c["object"] == "chat.completion.chunk" and c["id"] == chunks[0]["id"] for c in chunks)
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    assert [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]][-1] == "length"
    _, text4 = generate_stream(server, "keeper", "What about the fog?")
    agent = get(server, "keeper")
    history = agent["history"]
    assert len(history) == 8 and agent["messages"] == 8
    assert [m["role"] for m in history] == ["user", "assistant"] * 4
    assert history[4:] == [{"role": "user", "content": "Is a storm coming?"},
                           {"role": "assistant", "content": text3},
                           {"role": "user", "content": "What about the fog?"},
                           {"role": "assistant", "content": text4}]
    assert agent["status"] == "hot"


def test_streamed_turns_report_cached_tokens(server: RunningServer) -> None:
    create(server, id="streamer", system_prompt=SYSTEM)
    first, _ = generate_stream(server, "streamer", "Good evening, keeper.")
    second, _ = generate_stream(server, "streamer", "Is the lamp lit?")
    u1, u2 = first[-1]["usage"], second[-1]["usage"]
    assert first[-1]["choices"] == [] and second[-1]["choices"] == []
    assert cached(u2) > cached(u1) and cached(u2) >= u1["prompt_tokens"] - 1
    agent = get(server, "streamer")
    assert agent["context_tokens"] == u2["prompt_tokens"] + u2["completion_tokens"]
    assert agent["messages"] == 4 and agent["status"] == "hot"


def test_tool_calls_and_results_are_kept_in_the_history(server: RunningServer) -> None:
    create(server, id="tools")
    call = {"id": "call_1", "type": "function", "function": {"name": "lamp", "arguments": "{\"on\": true}"}}
    messages = [{"role": "user", "content": "Light it."}, {"role": "assistant", "content": None, "tool_calls": [call]},
                {"role": "tool", "tool_call_id": "call_1", "content": "lit"}]
    response = api(server, "POST", "/agents/tools/generate", {"messages": messages, "max_tokens": 4})
    assert response.status_code == 200, response.text
    history = get(server, "tools")["history"]
    assert history[:3] == [
        {"role": "user", "content": "Light it."},
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "lamp", "arguments": {"on": True}}}]},
        {"role": "tool", "content": "lit", "tool_call_id": "call_1"}]
    assert history[3]["role"] == "assistant" and len(history) == 4


# --------------------------------------------------------------------------- restart


def test_agents_survive_a_restart_with_warm_kv(tiny_qwen3: Path, tmp_path: Path) -> None:
    with agent_server(tiny_qwen3, tmp_path) as first:
        create(first, id="durable", system_prompt=SYSTEM)
        create(first, id="ephemeral", system_prompt=SYSTEM, persist=False)
        turn = generate(first, "durable", "Tell me of storms.")
        generate(first, "ephemeral", "Tell me of storms.")
        create(first, id="promoted", persist=False)
        generate(first, "promoted", "Keep this one.")
        assert api(first, "PATCH", "/agents/promoted", {"persist": True}).json()["persist"] is True
        before = get(first, "durable")
        assert before["status"] == "hot"
    with agent_server(tiny_qwen3, tmp_path) as second:
        after = get(second, "durable")
        assert after["history"] == before["history"] and len(after["history"]) == 2
        assert after["context_tokens"] == before["context_tokens"] > 0
        assert after["status"] == "warm"  # on disk, not in memory
        assert_openai_error(api(second, "GET", "/agents/ephemeral"), 404, "agent_id")
        assert [a["id"] for a in api(second, "GET", "/agents").json()["data"]] == ["durable", "promoted"]
        promoted = get(second, "promoted")
        assert promoted["persist"] is True and promoted["history"][0] == {"role": "user", "content": "Keep this one."}
        assert len(promoted["history"]) == 2

        resumed = generate(second, "durable", "And after the storm?")
        assert cached(resumed["usage"]) >= (turn["usage"]["prompt_tokens"] - 1) // BLOCK * BLOCK > 0
        final = get(second, "durable")
        assert final["messages"] == 4 and final["status"] == "hot"
        stats = httpx.get(second.base_url + "/stats", timeout=10).json()["resources"]
        assert stats["prefix_cache"]["disk_reads"] > 0
        assert stats["agent_store"]["persisted"] == 2 and stats["agent_store"]["in_memory"] == 0


# --------------------------------------------------------------------------- models


def test_changing_the_model_keeps_the_history_and_the_kv_is_per_model(tiny_qwen3: Path, tiny_llama: Path,
                                                                         tmp_path: Path) -> None:
    with agent_server(tiny_qwen3, tmp_path, extra_models={"llama": tiny_llama}) as server:
        create(server, id="switch", system_prompt=SYSTEM)
        generate(server, "switch", "Hello there.")
        generate(server, "switch", "How is the sea?")
        history = get(server, "switch")["history"]

        patched = api(server, "PATCH", "/agents/switch", {"model": "llama"}).json()
        assert patched["model"] == "llama" and patched["messages"] == 4
        assert patched["status"] == "cold"  # no KV for this conversation on the llama model yet
        on_llama = generate(server, "switch", "Any ships?")
        assert on_llama["model"] == "llama" and cached(on_llama["usage"]) == 0
        agent = get(server, "switch")
        assert agent["history"][:4] == history and len(agent["history"]) == 6 and agent["status"] == "hot"

        # A one-turn override back to the first model: its KV chain of this conversation is still there.
        back = generate(server, "switch", "And the lamp?", model="tiny")
        assert back["model"] == "tiny" and cached(back["usage"]) > 0
        agent = get(server, "switch")
        assert agent["model"] == "llama" and len(agent["history"]) == 8


# --------------------------------------------------------------------------- context overflow


def test_turn_groups_keep_tool_results_with_their_calls() -> None:
    system, user, call = Message("system", "s"), Message("user", "u1"), Message("assistant", "", extra=(
        ("tool_calls", [{"id": "1", "type": "function", "function": {"name": "f", "arguments": {}}}]),))
    result, answer, last = Message("tool", "r", extra=(("tool_call_id", "1"),)), Message("assistant", "a"), \
        Message("user", "u2")
    head, turns = turn_groups((system, user, call, result, answer, last))
    assert head == (system,) and turns == [(user, call, result, answer), (last,)]
    assert turn_groups((Message("assistant", "hi"), last)) == ((), [(Message("assistant", "hi"),), (last,)])
    assert turn_groups((system,)) == ((system,), [])


def test_drop_oldest_keeps_a_long_conversation_going(server: RunningServer) -> None:
    limit = 160
    create(server, id="long", system_prompt="Be brief.", max_context=limit, context_overflow="drop_oldest")
    create(server, id="strict", system_prompt="Be brief.", max_context=limit)
    line = "The lamp burns bright over the harbour tonight, keeper."
    prompts = []
    for turn in range(8):
        response = generate(server, "long", f"{turn}: {line}")
        prompts.append(response["usage"]["prompt_tokens"])
        assert response["usage"]["prompt_tokens"] + 6 <= limit
    agent = get(server, "long")
    assert agent["messages"] == 16 and agent["context_overflow"] == "drop_oldest"  # the history keeps every turn
    assert agent["history"][0]["content"] == f"0: {line}"
    assert prompts[1] > prompts[0] and max(prompts) + 6 <= limit

    # The whole conversation is far longer than the cap: the agent's turns left its oldest turns out.
    messages = [{"role": "system", "content": "Be brief."}, *agent["history"], {"role": "user", "content": line}]
    full = api(server, "POST", "/chat/completions", {"model": "tiny", "messages": messages, "max_tokens": 1})
    assert full.json()["usage"]["prompt_tokens"] > 3 * limit

    # The same conversation through plain chat completions, too long for the model: the clear error.
    context = server.server.models[0].require().context_length
    plain = api(server, "POST", "/chat/completions",
                {"model": "tiny", "messages": messages, "max_tokens": context - limit})
    error = assert_openai_error(plain, 400, "max_tokens", "maximum context length")
    assert error["code"] == "context_length_exceeded"

    # An agent that keeps the default policy gets the error once its conversation outgrows max_context.
    for turn in range(8):
        refused = api(server, "POST", "/agents/strict/generate",
                      {"messages": [{"role": "user", "content": f"{turn}: {line}"}], "max_tokens": 6})
        if refused.status_code != 200:
            break
    error = assert_openai_error(refused, 400, "max_tokens", "max_context is 160 tokens")
    assert error["code"] == "context_length_exceeded" and 0 < turn < 8
    assert get(server, "strict")["messages"] == 2 * turn  # the refused turn is not in the history

    # Even dropping every earlier turn cannot make room for a message longer than the cap.
    too_long = api(server, "POST", "/agents/long/generate",
                   {"messages": [{"role": "user", "content": line * 20}], "max_tokens": 6})
    error = assert_openai_error(too_long, 400, "max_tokens", "earlier turns left out")
    assert error["code"] == "context_length_exceeded"
    assert get(server, "long")["messages"] == 16
    assert server.health()["status"] == "ok"


def test_one_turn_at_a_time_and_a_client_that_leaves_frees_the_agent(server: RunningServer,
                                                                      tiny_qwen3: Path) -> None:
    """A turn builds on the history the one before leaves: a second turn while the first streams is a 409
    ``agent_busy``; the agent is free as soon as the first request ends, also when its client just leaves
    (and the cancelled turn is not in the history)."""
    import time

    from mlx_lm.tokenizer_utils import load as load_tokenizer

    [the] = load_tokenizer(tiny_qwen3).encode(" the", add_special_tokens=False)
    create(server, id="busy", system_prompt=SYSTEM)
    endless = {"messages": [{"role": "user", "content": "Talk for a long time."}], "max_tokens": 3000,
               "temperature": 0, "stream": True, "logit_bias": {str(the): 100}}  # never a stop token
    with httpx.stream("POST", f"{server.url}/agents/busy/generate", json=endless, timeout=120) as response:
        assert response.status_code == 200
        lines = response.iter_lines()
        assert next(line for line in lines if line.startswith("data: "))  # the turn is under way
        second = api(server, "POST", "/agents/busy/generate",
                     {"messages": [{"role": "user", "content": "Me too!"}], "max_tokens": 4})
        assert assert_openai_error(second, 409, "agent_id", "busy", "still answering")["code"] == "agent_busy"
        assert get(server, "busy")["busy"] is True
    # The client left mid-stream: the server cancels the turn and frees the agent.
    deadline = time.monotonic() + 30
    while get(server, "busy")["busy"] and time.monotonic() < deadline:
        time.sleep(0.05)
    agent = get(server, "busy")
    assert agent["busy"] is False and agent["messages"] == 0 and agent["history"] == []
    generate(server, "busy", "Now a short one.")
    after = get(server, "busy")
    assert after["busy"] is False and after["messages"] == 2


def test_a_turn_is_released_only_by_the_request_that_holds_it(tmp_path: Path) -> None:
    from flow.graph.resource import Links
    from flow.resources.agent_store import AgentStore, AgentStoreConfig
    from protocols.errors import ApiError

    store = AgentStore("agent_store", AgentStoreConfig(path=str(tmp_path / "agents.sqlite")), Links())
    store.begin_turn("a", "req-1")
    with pytest.raises(ApiError) as busy:
        store.begin_turn("a", "req-2")
    assert busy.value.status == 409 and busy.value.code == "agent_busy"
    store.begin_turn("b", "req-3")  # other agents are not held up
    store.end_turn("a", "req-1")
    store.begin_turn("a", "req-4")
    store.end_turn("a", "req-1")  # a late release of the earlier turn (its request winding down)
    assert store.busy("a") and store.busy("b")
    store.end_turn("a", "req-4")
    assert not store.busy("a")


# --------------------------------------------------------------------------- hybrid models


@pytest.mark.parametrize("preset", ["tiny-qwen3.5", "tiny-nemotron-h"])  # gated-delta layers; Mamba-2 layers
def test_an_agent_on_a_hybrid_model_reuses_its_turns_as_a_cold_run_would_answer(preset: str, tmp_path: Path) -> None:
    """A hybrid model's recurrent layers come back from state snapshots: each turn of an agent resumes from the
    last one's turn point or deeper, answers as a server that never saw the conversation does, and after a restart
    resumes from the disk tier."""
    from runtime.prefix_keeper import TURN_MARGIN
    from runtime.tiny import ensure_tiny_model

    model = ensure_tiny_model(preset)
    with agent_server(model, tmp_path / "served") as first:
        create(first, id="hybrid", system_prompt=SYSTEM)
        turn1 = generate(first, "hybrid", "Where is the lamp?")
        turn2 = generate(first, "hybrid", "And the ships?")
        prompt1 = turn1["usage"]["prompt_tokens"]
        assert cached(turn2["usage"]) >= (prompt1 - 1 - TURN_MARGIN) // BLOCK * BLOCK > 0
        history = get(first, "hybrid")["history"]
    with agent_server(model, tmp_path / "cold") as cold:  # an empty cache: the second turn computed in full
        plain = api(cold, "POST", "/chat/completions", {
            "model": "tiny", "max_tokens": 6, "temperature": 0,
            "messages": [{"role": "system", "content": SYSTEM}, *history[:2],
                         {"role": "user", "content": "And the ships?"}]}).json()
        assert cached(plain["usage"]) == 0
        assert plain["choices"][0]["message"]["content"] == turn2["choices"][0]["message"]["content"]
    with agent_server(model, tmp_path / "served") as again:  # a restart: the snapshots come from disk
        turn3 = generate(again, "hybrid", "Is a storm coming?")
        assert cached(turn3["usage"]) >= (turn2["usage"]["prompt_tokens"] - 1 - TURN_MARGIN) // BLOCK * BLOCK
        assert httpx.get(again.base_url + "/stats", timeout=10).json()["resources"]["prefix_cache"]["disk_reads"] > 0
