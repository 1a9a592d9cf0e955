"""The stream interval through the server: steps quicker than ``stream_interval_ms`` hand their tokens out together
(``runtime/outbox.py``). Every protocol's stream then carries several tokens in a frame and says the same: the
same text, the same logprobs token by token, the same usage and finish as a server that sends every step's token
at once; the first tokens are never held back with the rest."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import anthropic
import httpx
import openai
import pytest

from tests.harness import RunningServer, graph_with_model, running_server

MESSAGES = [{"role": "user", "content": "Tell me a long story about a lighthouse keeper."}]
TOKENS = 48


@pytest.fixture(scope="module")
def servers(tiny_qwen3: Path) -> Iterator[tuple[RunningServer, RunningServer]]:
    with running_server(graph_with_model(tiny_qwen3, stream_interval_ms=0)) as every, \
            running_server(graph_with_model(tiny_qwen3, stream_interval_ms=1000)) as grouped:
        assert every.engine_stats()["stream_interval_ms"] == 0  # the graph's setting reaches the engine
        assert grouped.engine_stats()["stream_interval_ms"] == 1000
        yield every, grouped


def openai_stream(server: RunningServer) -> tuple[list[list[str]], str | None, int]:
    """Each content chunk's logprob tokens, the finish reason and the completion tokens of a streamed chat."""
    client = openai.OpenAI(base_url=server.url, api_key="none")
    chunks = list(client.chat.completions.create(
        model="tiny", messages=MESSAGES, max_tokens=TOKENS, temperature=0, logprobs=True, top_logprobs=2,
        stream=True, stream_options={"include_usage": True}, extra_body={"ignore_eos": True}))
    frames = [[t.token for t in ch.choices[0].logprobs.content or []] for ch in chunks
              if ch.choices and ch.choices[0].logprobs and ch.choices[0].logprobs.content]
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    assert "".join(t for frame in frames for t in frame) == text
    finish = next(ch.choices[0].finish_reason for ch in chunks if ch.choices and ch.choices[0].finish_reason)
    usage = chunks[-1].usage
    assert usage is not None
    return frames, finish, usage.completion_tokens


def test_openai_chunks_carry_several_tokens_and_say_the_same(servers: tuple[RunningServer, RunningServer]) -> None:
    every, grouped = servers
    one_by_one, finish, used = openai_stream(every)
    together, grouped_finish, grouped_used = openai_stream(grouped)
    assert [t for f in together for t in f] == [t for f in one_by_one for t in f]
    assert (grouped_finish, grouped_used) == (finish, used) == ("length", TOKENS)
    assert all(len(frame) == 1 for frame in one_by_one)
    # the first tokens one by one, at once; the ~1 ms steps after them share frames
    assert len(together[0]) == 1 and len(together) < len(one_by_one)


def test_anthropic_and_ollama_streams_say_the_same(servers: tuple[RunningServer, RunningServer]) -> None:
    answers: list[tuple[str, int, str, int]] = []
    for server in servers:
        client = anthropic.Anthropic(base_url=server.base_url, api_key="none")
        with client.messages.stream(model="tiny", max_tokens=TOKENS, messages=MESSAGES,  # type: ignore[arg-type]
                                    extra_body={"temperature": 0}) as stream:
            deltas = [e.delta.text for e in stream if e.type == "content_block_delta" and e.delta.type == "text_delta"]
            final = stream.get_final_message()
        assert "".join(deltas) == "".join(b.text for b in final.content if b.type == "text")
        ollama: list[dict[str, object]] = []
        with httpx.stream("POST", server.base_url + "/api/chat", timeout=60, json={
                "model": "tiny", "messages": MESSAGES, "stream": True,
                "options": {"temperature": 0, "num_predict": TOKENS}}) as response:
            ollama = [json.loads(line) for line in response.iter_lines() if line]
        assert ollama[-1]["done"] is True
        answers.append(("".join(deltas), final.usage.output_tokens,
                        "".join(str(m["message"]["content"]) for m in ollama if "message" in m),  # type: ignore[index]
                        int(ollama[-1]["eval_count"])))  # type: ignore[call-overload]
    assert answers[0] == answers[1]
