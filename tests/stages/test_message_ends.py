"""``chat.prepare``'s message ends, read off each family's own chat template: where the system prompt ends is as
deep as two conversations under it agree, whatever the template does with a system message."""

from __future__ import annotations

from typing import Any

import pytest
from mlx_lm.utils import load_tokenizer

from flow.catalog.families import resolve_family
from protocols.ir import ChatRequest, Message
from runtime.tiny import ensure_tiny_model
from stages.chat import render_prompt, system_end, turn_point

SYSTEM = "You are the harbour master. Keep a log of every ship, every lamp and every tide, and answer briefly."


def prompt(tokenizer: Any, family: Any, messages: tuple[Message, ...]) -> tuple[ChatRequest, str, tuple[int, ...]]:
    request = ChatRequest(model="tiny", messages=messages, request_id="t")
    text = render_prompt(tokenizer, request, family)
    return request, text, tuple(tokenizer.encode(text, add_special_tokens=False))


# ChatML with a tool-aware template that refuses a conversation without a user message (Qwen3.5), Granite's,
# Gemma's (the system prompt folded into the first user turn), Llama 3's, gpt-oss's harmony
@pytest.mark.parametrize("preset", ["tiny-qwen3.5", "tiny-granite4", "tiny-gemma3", "tiny-llama", "tiny-gpt-oss"])
def test_the_system_prompt_ends_where_conversations_under_it_part(preset: str) -> None:
    path = ensure_tiny_model(preset)
    tokenizer = load_tokenizer(path)
    family = resolve_family("auto", path, "tiny", tokenizer.chat_template)
    system = Message(role="system", content=SYSTEM)
    ends = []
    for question in ("Where is the lamp?", "Count the ships tonight, please."):
        request, text, ids = prompt(tokenizer, family, (system, Message(role="user", content=question)))
        end = system_end(tokenizer, request, family, text, ids)
        assert end is not None, preset
        ends.append((end, ids))
        # asked again: the same (the system prompt's ids are kept, not tokenized again)
        assert system_end(tokenizer, request, family, text, ids) == end
    (end_a, ids_a), (end_b, ids_b) = ends
    assert end_a == end_b
    assert ids_a[:end_a] == ids_b[:end_b]  # both conversations agree up to it ...
    assert ids_a[end_a] != ids_b[end_b] or ids_a[end_a + 1] != ids_b[end_b + 1]  # ... and part within a token of it
    assert end_a > len(tokenizer.encode(SYSTEM, add_special_tokens=False))  # past the whole system prompt


def test_without_a_system_prompt_or_a_message_after_it_there_is_no_end() -> None:
    path = ensure_tiny_model("tiny-qwen3.5")
    tokenizer = load_tokenizer(path)
    family = resolve_family("auto", path, "tiny", tokenizer.chat_template)
    request, text, ids = prompt(tokenizer, family, (Message(role="user", content="Where is the lamp?"),))
    assert system_end(tokenizer, request, family, text, ids) is None
    # a system prompt alone: nothing to part from it (the template would refuse it without a user message)
    alone = ChatRequest(model="tiny", messages=(Message(role="system", content=SYSTEM),), request_id="t")
    assert system_end(tokenizer, alone, family, text, ids) is None


@pytest.mark.parametrize(("preset", "repeated"), [("tiny-qwen3.5", False), ("tiny-nemotron-h", False),
                                                  ("tiny-granite4", True), ("tiny-lfm2", True), ("tiny-falcon-h1", True)])
def test_the_last_message_ends_before_the_generation_prompt_unless_the_next_turn_repeats_it(preset: str,
                                                                                           repeated: bool) -> None:
    """Qwen3.5 opens a thinking block the history never shows, Nemotron-H one it drops: their next turn parts from
    the prompt where its messages end. Granite's, LFM2's and Falcon-H1's next turn repeats the generation prompt:
    the prompt's end is where it goes on (no prefill pass is cut before it)."""
    path = ensure_tiny_model(preset)
    tokenizer = load_tokenizer(path)
    family = resolve_family("auto", path, "tiny", tokenizer.chat_template)
    asked = Message(role="user", content="Where is the lamp?")
    request, text, ids = prompt(tokenizer, family, (Message(role="system", content=SYSTEM), asked))
    end = turn_point(tokenizer, request, family, text, ids)
    assert end is not None
    answered = (Message(role="system", content=SYSTEM), asked, Message(role="assistant", content="By the door."),
                Message(role="user", content="And the ships?"))
    _, _, following = prompt(tokenizer, family, answered)
    assert following[:end] == ids[:end]  # the next turn repeats the prompt up to it
    if repeated:
        assert end == len(ids)
    else:
        assert len(ids) - 12 < end < len(ids) and following[: len(ids)] != ids  # parts within the generation prompt
