"""The prefix cache on hybrid models (recurrent layers as state snapshots) through the real server.

For each tiny hybrid family: a hit gives the answer a cold prefill gives, token for token, for one request and
for several at once, on the conversation's next turn, and after a restart from the disk tier. The other hybrid
layouts (Nemotron-H's, LFM2's, Mamba-2's) go through one protocol each: tests/runtime/test_prefix_hybrid.py
compares their every hit with a cold run in all the engine's configurations.
"""

from __future__ import annotations

import concurrent.futures
from pathlib import Path
from typing import Any

import anthropic
import openai
import pytest

from runtime.prefix_keeper import TURN_MARGIN
from runtime.tiny import ensure_tiny_model
from tests.flow.resources.test_prefix_server import BLOCK, SYSTEM, cached_server, prefix_stats, reusable

HYBRIDS = ["tiny-qwen3.5", "tiny-qwen3-next", "tiny-granite4"]


def ask(url: str, messages: list[Any], max_tokens: int = 12) -> tuple[dict[str, Any], str, int, int]:
    """(the answer's message, its text, prompt tokens, cached prompt tokens)."""
    client = openai.OpenAI(base_url=url, api_key="unused", max_retries=0)
    r = client.chat.completions.create(model="tiny", messages=messages, max_tokens=max_tokens, temperature=0)
    assert r.usage is not None and r.usage.prompt_tokens_details is not None
    cached = r.usage.prompt_tokens_details.cached_tokens or 0
    message = r.choices[0].message.model_dump()
    assert r.usage.completion_tokens > 0
    return message, str(message), r.usage.prompt_tokens, cached


def rendered(server: Any, model: Path, messages: list[Any]) -> tuple[Any, Any, Any, str, tuple[int, ...]]:
    """(tokenizer, request, family, text, ids) of ``messages`` as chat.prepare renders them for the served model."""
    from flow.catalog.families import resolve_family
    from protocols.ir import ChatRequest, Message
    from stages.chat import render_prompt

    tokenizer = server.server.models[0].require().tokenizer
    request = ChatRequest(model="tiny", messages=tuple(Message(role=m["role"], content=m["content"]) for m in messages),
                          request_id="t")
    family = resolve_family("auto", model, "tiny", tokenizer.chat_template)
    text = render_prompt(tokenizer, request, family)
    return tokenizer, request, family, text, tuple(tokenizer.encode(text, add_special_tokens=False))


@pytest.mark.parametrize("preset", HYBRIDS)
def test_hybrid_hits_answer_as_cold_runs(preset: str, tmp_path: Path) -> None:
    model = ensure_tiny_model(preset)
    turn1: list[Any] = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Where is the lamp?"}]
    with cached_server(model, tmp_path / "a") as server:
        _, cold1, prompt1, cached = ask(server.url, turn1)
        assert cached == 0
        _, warm1, _, cached = ask(server.url, turn1)  # an exact repeat: the prompt end's snapshot
        assert warm1 == cold1 and cached == reusable(prompt1)
        turn2 = [*turn1, {"role": "assistant", "content": f"The lamp. {prompt1}"}, {"role": "user", "content": "And the ships?"}]
        _, warm2, _, cached = ask(server.url, turn2)  # the next turn: from the turn point or deeper
        assert cached >= (prompt1 - 1 - TURN_MARGIN) // BLOCK * BLOCK > 0
        # Batched: several hits decoding together.
        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            runs = list(pool.map(lambda m: ask(server.url, m), [turn1, turn2, turn1, turn2]))
        assert [r[1] for r in runs] == [cold1, warm2, cold1, warm2] and all(r[3] > 0 for r in runs)
        # The other protocols, with a session: the same cache, the same exactness.
        claude = anthropic.Anthropic(base_url=server.base_url, api_key="unused", max_retries=0)
        asked: Any = {"model": "tiny", "max_tokens": 8, "system": SYSTEM, "extra_body": {"temperature": 0},
                      "messages": [{"role": "user", "content": "How are the ships tonight?"}]}
        a1, a2 = claude.messages.create(**asked), claude.messages.create(**asked)
        assert [b.model_dump() for b in a1.content] == [b.model_dump() for b in a2.content]
        assert a2.usage.cache_read_input_tokens == reusable(a2.usage.input_tokens + a2.usage.cache_read_input_tokens)
        client = openai.OpenAI(base_url=server.url, api_key="unused", max_retries=0)
        kwargs: Any = {"model": "tiny", "instructions": SYSTEM, "input": "Is the weather turning?", "temperature": 0,
                       "max_output_tokens": 8, "extra_body": {"session_id": "hybrid-session"}}
        r1, r2 = client.responses.create(**kwargs), client.responses.create(**kwargs)
        assert r2.usage is not None and r2.output_text == r1.output_text
        assert r2.usage.input_tokens_details.cached_tokens == reusable(r2.usage.input_tokens)
        stats = prefix_stats(server)
        assert stats["recent_sessions"]["hybrid-session"]["turns"] == 2
        assert stats["state_hits"] >= 6 and stats["stored_states"] > 0 and stats["referenced_blocks"] == 0
    with cached_server(model, tmp_path / "b") as fresh:  # the next turn cold, on a server that never saw turn 1
        _, cold2, _, cached = ask(fresh.url, turn2)
        assert cached == 0 and cold2 == warm2
    with cached_server(model, tmp_path / "a") as restarted:  # the disk tier: the snapshot where turn 1's messages
        _, again, _, cached = ask(restarted.url, turn1)  # ended, its block filled by turn 2's prompt
        assert again == cold1 and (prompt1 - 1 - TURN_MARGIN) // BLOCK * BLOCK <= cached <= prompt1 - 1


def exchange(server: Any, protocol: str, messages: list[dict[str, str]]) -> tuple[str, int, int]:
    """One greedy answer to ``messages`` (a system prompt, then turns) in ``protocol``: (its text, prompt tokens,
    cached prompt tokens)."""
    system, turns = messages[0]["content"], messages[1:]
    if protocol == "anthropic":
        claude = anthropic.Anthropic(base_url=server.base_url, api_key="unused", max_retries=0)
        reply: Any = claude.messages.create(model="tiny", max_tokens=12, system=system, messages=turns,  # type: ignore[arg-type]
                                            extra_body={"temperature": 0})
        u = reply.usage
        read = u.cache_read_input_tokens or 0
        return str([b.model_dump() for b in reply.content]), u.input_tokens + read + (u.cache_creation_input_tokens or 0), read
    client = openai.OpenAI(base_url=server.url, api_key="unused", max_retries=0)
    if protocol == "responses":
        response = client.responses.create(model="tiny", instructions=system, input=turns,  # type: ignore[arg-type]
                                           temperature=0, max_output_tokens=12,
                                           extra_body={"session_id": "more-hybrids"})
        assert response.usage is not None
        return response.output_text, response.usage.input_tokens, response.usage.input_tokens_details.cached_tokens
    _, text, prompt, cached = ask(server.url, messages)
    return text, prompt, cached


@pytest.mark.parametrize(("preset", "protocol"), [("tiny-nemotron-h", "openai"), ("tiny-lfm2", "anthropic"),
                                                  ("tiny-mamba2", "responses"), ("tiny-falcon-h1", "openai")])
def test_more_hybrid_layouts_answer_as_cold_runs(preset: str, protocol: str, tmp_path: Path) -> None:
    model = ensure_tiny_model(preset)
    turn1 = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Where is the lamp?"}]
    with cached_server(model, tmp_path) as server:
        cold1, prompt1, cached = exchange(server, protocol, turn1)
        assert cached == 0
        warm1, _, cached = exchange(server, protocol, turn1)  # an exact repeat: the prompt end's snapshot
        assert warm1 == cold1 and cached == reusable(prompt1)
        turn2 = [*turn1, {"role": "assistant", "content": "The lamp is lit."}, {"role": "user", "content": "And the ships?"}]
        warm2, _, cached = exchange(server, protocol, turn2)  # the next turn: from the turn point or deeper
        assert cached >= (prompt1 - 1 - TURN_MARGIN) // BLOCK * BLOCK > 0
        with concurrent.futures.ThreadPoolExecutor(4) as pool:  # hits decoding together
            runs = list(pool.map(lambda m: exchange(server, protocol, m), [turn1, turn2, turn1, turn2]))
        assert [r[0] for r in runs] == [cold1, warm2, cold1, warm2] and all(r[2] > 0 for r in runs)
        stats = prefix_stats(server)
        assert stats["state_hits"] >= 6 and stats["referenced_blocks"] == 0
    with cached_server(model, tmp_path / "fresh") as fresh:  # the next turn cold, on a server that never saw turn 1
        cold2, _, cached = exchange(fresh, protocol, turn2)
        assert cached == 0 and cold2 == warm2
    with cached_server(model, tmp_path) as restarted:  # the disk tier: from where turn 1's messages ended (or the
        again, _, cached = exchange(restarted, protocol, turn1)  # block boundary before, when the template is mute)
        assert again == cold1 and (prompt1 - 1 - TURN_MARGIN) // BLOCK * BLOCK <= cached <= prompt1 - 1


def test_the_next_turn_resumes_where_the_messages_ended(tmp_path: Path) -> None:
    """chat.prepare finds where the rendered messages end and the template's generation prompt begins (Qwen3.5's
    opens an empty thinking block the history never shows); the hybrid model keeps a state snapshot exactly there,
    so the next turn — with only the prompt cached (``cache_mode: prefix``) — resumes past the block-aligned turn
    point, and answers as a cold run does."""
    from stages.chat import turn_point

    model = ensure_tiny_model("tiny-qwen3.5")
    turn1: list[Any] = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Where is the lamp?"}]
    prefix_only = {"cache_mode": "prefix"}
    client_kwargs: Any = {"model": "tiny", "max_tokens": 6, "temperature": 0, "extra_body": prefix_only}
    with cached_server(model, tmp_path / "a") as server:
        client = openai.OpenAI(base_url=server.url, api_key="unused", max_retries=0)
        first = client.chat.completions.create(messages=turn1, **client_kwargs)
        assert first.usage is not None
        turn2 = [*turn1, {"role": "assistant", "content": first.choices[0].message.content or "The lamp."},
                 {"role": "user", "content": "And the ships?"}]
        second = client.chat.completions.create(messages=turn2, **client_kwargs)
        assert second.usage is not None and second.usage.prompt_tokens_details is not None
        cached = second.usage.prompt_tokens_details.cached_tokens or 0
        # Where turn 1's messages ended, as chat.prepare computes it from the model's own template and tokenizer.
        prompt = rendered(server, model, turn1)
        ids = prompt[-1]
        boundary = turn_point(*prompt)
        assert boundary is not None and len(ids) - 8 < boundary < len(ids)  # before the generation prompt
        assert boundary > (len(ids) - 1 - TURN_MARGIN) // BLOCK * BLOCK  # deeper than the aligned turn point
        assert cached == boundary
    with cached_server(model, tmp_path / "b") as fresh:
        cold = openai.OpenAI(base_url=fresh.url, api_key="unused", max_retries=0).chat.completions.create(
            messages=turn2, **client_kwargs)
        assert cold.choices[0].message.content == second.choices[0].message.content


def test_another_conversation_under_the_same_system_prompt_resumes_where_it_ends(tmp_path: Path) -> None:
    """chat.prepare finds where the system prompt ends (the next message's opening with it); the hybrid model keeps
    a state snapshot there, in memory and on disk, so another conversation under the same system prompt reuses all
    of it — after a restart too — and answers as a cold run does (the template side, for other families:
    tests/stages/test_message_ends.py)."""
    from stages.chat import system_end

    model = ensure_tiny_model("tiny-qwen3.5")
    first: list[Any] = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Where is the lamp?"}]
    other: list[Any] = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Count the ships."}]
    with cached_server(model, tmp_path / "a") as server:
        _, _, _, cached = ask(server.url, first)
        assert cached == 0
        _, warm, prompt, cached = ask(server.url, other)
        tokenizer, *rest = rendered(server, model, other)
        end = system_end(tokenizer, *rest)
        assert end is not None and len(tokenizer.encode(SYSTEM)) < end < prompt - 4
        assert cached == end  # the whole system prompt, not the last chunk end before it
    with cached_server(model, tmp_path / "b") as fresh:
        _, cold, _, cached = ask(fresh.url, other)
        assert cached == 0 and cold == warm
    with cached_server(model, tmp_path / "a") as restarted:  # the disk tier: the same snapshot, its block filled
        third: list[Any] = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Name the tower."}]
        _, _, _, cached = ask(restarted.url, third)  # by the conversations' prompts
        assert cached == end
