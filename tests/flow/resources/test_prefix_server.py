"""The prefix cache through the real server: cached-token figures in every protocol, same output, restart.

The default graph has a ``prefix_cache`` resource; these tests point its disk tier at a
temporary directory and use 16-token blocks so that tiny prompts span several blocks.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import anthropic
import httpx
import openai
import pytest

from flow.builtins import compile_tables
from tests.harness import RunningServer, running_server, tables_with_prefix_cache

BLOCK = 16
SYSTEM = ("You are the keeper's assistant at the old lighthouse. Answer briefly, mention the lamp, "
          "the weather and the ships, and keep a friendly tone. ") * 4


@contextmanager
def cached_server(model: Path, directory: Path, **cache: Any) -> Iterator[RunningServer]:
    tables = tables_with_prefix_cache(model, directory, BLOCK, **cache)
    with running_server(compile_tables(tables, "default.toml (prefix test)")) as server:
        yield server


@pytest.fixture(scope="module")
def server(tiny_qwen3: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    with cached_server(tiny_qwen3, tmp_path_factory.mktemp("kv")) as running:
        yield running


def reusable(prompt_tokens: int) -> int:
    """What an exact repeat reuses: every prompt token but the last (its full blocks, then its tail)."""
    return prompt_tokens - 1


def full_blocks(prompt_tokens: int) -> int:
    """What a prompt writes to the cache's blocks (and to disk): its full blocks before the last token."""
    return (prompt_tokens - 1) // BLOCK * BLOCK


def prefix_stats(server: RunningServer) -> dict[str, Any]:
    return httpx.get(server.base_url + "/stats", timeout=10).json()["resources"]["prefix_cache"]  # type: ignore[no-any-return]


def test_openai_chat_reports_cached_tokens_and_output_is_unchanged(server: RunningServer) -> None:
    client = openai.OpenAI(base_url=server.url, api_key="unused", max_retries=0)
    messages: list[Any] = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Where is the lamp?"}]
    first = client.chat.completions.create(model="tiny", messages=messages, max_tokens=8, temperature=0)
    second = client.chat.completions.create(model="tiny", messages=messages, max_tokens=8, temperature=0)
    assert first.usage is not None and second.usage is not None
    assert first.usage.prompt_tokens_details is not None and second.usage.prompt_tokens_details is not None
    assert second.usage.prompt_tokens_details.cached_tokens == reusable(second.usage.prompt_tokens) > 0
    assert second.choices[0].message.content == first.choices[0].message.content

    # Streaming: the usage chunk carries the same figure.
    stream = client.chat.completions.create(model="tiny", messages=messages, max_tokens=8, temperature=0,
                                            stream=True, stream_options={"include_usage": True})
    usage = [c.usage for c in stream if c.usage is not None][-1]
    assert usage.prompt_tokens_details is not None
    assert usage.prompt_tokens_details.cached_tokens == reusable(usage.prompt_tokens)


def test_anthropic_reports_cache_reads_and_writes(server: RunningServer) -> None:
    client = anthropic.Anthropic(base_url=server.base_url, api_key="unused", max_retries=0)
    system: Any = [{"type": "text", "text": SYSTEM, "cache_control": {"type": "ephemeral", "ttl": "1h"}}]
    messages: Any = [{"role": "user", "content": "How are the ships tonight, keeper?"}]
    first = client.messages.create(model="tiny", max_tokens=8, system=system, messages=messages,
                                   extra_body={"temperature": 0})
    u1 = first.usage
    prompt = u1.input_tokens + (u1.cache_read_input_tokens or 0) + (u1.cache_creation_input_tokens or 0)
    # Written: every full block of the prompt that was not read.
    assert (u1.cache_creation_input_tokens or 0) == full_blocks(prompt) - (u1.cache_read_input_tokens or 0)
    with client.messages.stream(model="tiny", max_tokens=8, system=system, messages=messages,
                                extra_body={"temperature": 0}) as stream:
        final = stream.get_final_message()
    u2 = final.usage
    assert u2.cache_read_input_tokens == reusable(prompt) and u2.cache_creation_input_tokens == 0
    assert u2.input_tokens == prompt - reusable(prompt)
    assert [b.model_dump() for b in final.content] == [b.model_dump() for b in first.content]


def test_responses_report_cached_tokens(server: RunningServer) -> None:
    client = openai.OpenAI(base_url=server.url, api_key="unused", max_retries=0)
    kwargs: Any = {"model": "tiny", "instructions": SYSTEM, "input": "Is the weather turning?", "max_output_tokens": 8,
                   "temperature": 0}
    first = client.responses.create(**kwargs)
    second = client.responses.create(**kwargs)
    assert second.usage is not None and first.usage is not None
    assert second.usage.input_tokens_details.cached_tokens == reusable(second.usage.input_tokens) > 0
    assert second.output_text == first.output_text


def test_sessions_share_the_system_prompt_across_protocols(server: RunningServer) -> None:
    """A new conversation (any protocol) reuses the system prompt another one cached."""
    client = openai.OpenAI(base_url=server.url, api_key="unused", max_retries=0)
    before = prefix_stats(server)
    response = client.chat.completions.create(
        model="tiny", max_tokens=4, temperature=0, extra_body={"session_id": "fresh-session"},
        messages=[{"role": "system", "content": SYSTEM}, {"role": "user", "content": "A brand new question."}])
    assert response.usage is not None and response.usage.prompt_tokens_details is not None
    assert response.usage.prompt_tokens_details.cached_tokens >= len(SYSTEM) // 8 // BLOCK * BLOCK > 0
    after = prefix_stats(server)
    assert after["hits"] == before["hits"] + 1 and after["sessions"] >= 1
    session = after["recent_sessions"]["fresh-session"]
    assert session["tier"] == "hot" and session["turns"] == 1 and session["tokens"] > response.usage.prompt_tokens
    assert after["referenced_blocks"] == 0 and after["blocks"]["hot"] > 0 and 0 < after["hit_rate"] <= 1
    metrics = httpx.get(server.base_url + "/metrics", timeout=10).text
    assert 'flow_prefix_cache_blocks{resource="prefix_cache",tier="hot"}' in metrics
    assert "flow_prefix_cache_hit_rate" in metrics and "flow_prefix_cache_reused_tokens_total" in metrics


def test_a_restarted_server_resumes_from_disk(tiny_qwen3: Path, tmp_path: Path) -> None:
    messages: list[Any] = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Tell me of storms."}]

    def ask(server: RunningServer) -> Any:
        client = openai.OpenAI(base_url=server.url, api_key="unused", max_retries=0)
        return client.chat.completions.create(model="tiny", messages=messages, max_tokens=8, temperature=0)

    with cached_server(tiny_qwen3, tmp_path) as first:
        cold = ask(first)
    with cached_server(tiny_qwen3, tmp_path) as second:
        warm = ask(second)
        stats = prefix_stats(second)
    # Tails live in memory only: after a restart the full blocks come back from disk.
    assert warm.usage.prompt_tokens_details.cached_tokens == full_blocks(warm.usage.prompt_tokens) > 0
    assert warm.choices[0].message.content == cold.choices[0].message.content
    assert stats["disk_reads"] == full_blocks(warm.usage.prompt_tokens) // BLOCK and stats["disk"]["corrupt"] == 0



def test_the_next_turn_reuses_the_answer(server: RunningServer, tiny_qwen3: Path) -> None:
    """An agent sends the answer back as text. The text is exactly what the model generated, a leading
    space included, so it tokenizes back to the generated ids and the next turn reads the answer's blocks
    from the cache instead of prefilling them again. (A logit bias makes the random model answer
    " the the …": a word that starts with a space and is one token.)"""
    from mlx_lm.tokenizer_utils import load as load_tokenizer

    [the] = load_tokenizer(tiny_qwen3).encode(" the", add_special_tokens=False)
    client = openai.OpenAI(base_url=server.url, api_key="unused", max_retries=0)
    messages: list[Any] = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "What of the fog?"}]
    held_by_turn = []
    for _ in range(3):
        answer = client.chat.completions.create(model="tiny", messages=messages, max_tokens=20, temperature=0,
                                                logit_bias={str(the): 100})
        assert answer.usage is not None and answer.choices[0].message.content == " the" * 20
        messages += [{"role": "assistant", "content": " the" * 20}, {"role": "user", "content": "And then?"}]
        nxt = client.chat.completions.create(model="tiny", messages=messages, max_tokens=1, temperature=0)
        assert nxt.usage is not None and nxt.usage.prompt_tokens_details is not None
        # Cached: the previous prompt and the whole answer (the engine hands a token out in the step that
        # feeds it to the model): full blocks, then the tail of the answer that does not fill one.
        held = answer.usage.prompt_tokens + answer.usage.completion_tokens
        assert nxt.usage.prompt_tokens_details.cached_tokens == held
        held_by_turn.append(held)
    assert any(held % BLOCK for held in held_by_turn)  # tails made the difference
