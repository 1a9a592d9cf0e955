"""A conversation's next turn is tokenized only past what its previous prompt shared with it, and its ids are
exactly those of tokenizing it whole — for every family's tokenizer and template."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
from mlx_lm.utils import load_tokenizer

from flow.catalog.families import resolve_family
from protocols.ir import ChatRequest, Message
from runtime.tiny import ensure_tiny_model
from stages.chat import render_prompt
from stages.prompt_tokens import MIN_REUSE, VERIFIED, PromptTokens

SYSTEM = ("You are the harbour master. Keep a log of every ship, every lamp and every tide; answer briefly, "
          "in plain words, and say when you do not know. ") * 6


def conversation(turns: int) -> list[tuple[Message, ...]]:
    """The prompts' messages of an agent's ``turns`` turns, each resending the whole history."""
    messages: list[Message] = [Message(role="system", content=SYSTEM)]
    prompts = []
    for turn in range(turns):
        messages.append(Message(role="user", content=f"Turn {turn}: where is ship number {turn * 7}? ünïcödé ✓"))
        prompts.append(tuple(messages))
        messages.append(Message(role="assistant", content=f"Ship {turn * 7} is at berth {turn}.  Two  spaces."))
    return prompts


@pytest.mark.parametrize("preset", ["bench-80m", "tiny-qwen3.5", "tiny-llama", "tiny-gemma3", "tiny-granite4",
                                    "tiny-gpt-oss", "tiny-deepseek-v3", "tiny-phi4-mini"])
def test_each_turn_reuses_the_last_and_equals_tokenizing_whole(preset: str) -> None:
    path = ensure_tiny_model(preset)
    tokenizer = load_tokenizer(path)
    family = resolve_family("auto", path, "tiny", tokenizer.chat_template)
    tokens = PromptTokens()
    for i, messages in enumerate(conversation(VERIFIED + 4)):
        text = render_prompt(tokenizer, ChatRequest(model="tiny", messages=messages, request_id="t"), family)
        whole = tuple(tokenizer.encode(text, add_special_tokens=False))
        assert tokens.encode(tokenizer, text) == whole, (preset, i)
    # past the first turn, each reused its predecessor's ids up to where the new messages began
    assert tokens.reused_tokens > 0
    state: Any = tokens._states[tokenizer]
    assert not state.off and state.verified == VERIFIED
    # every family's fast tokenizer is read from its Rust tokenizer, checked against encode() first
    assert state.rust is not None and state.rust_verified == VERIFIED
    assert tokens.tokenized_chars < len(text) * 3  # not every turn tokenized whole (that is ~len(text) * 8 / 2)
    before = tokens.tokenized_chars
    assert tokens.encode(tokenizer, text) == whole and tokens.tokenized_chars == before  # asked again: kept


def test_a_tokenizer_that_would_tokenize_otherwise_is_left_whole() -> None:
    """A mismatch in the checked reuses turns reuse off for that tokenizer, and its answer is the whole text's."""

    class PrefixSpace:
        """Marks the first plain segment of a text (as a tokenizer that prepends a space to a text can): the part
        after a special token tokenizes otherwise alone than inside the whole."""

        class _Hf:
            added_tokens_decoder = {1: SimpleNamespace(content="<s>", special=True, lstrip=False, single_word=False)}

        _tokenizer = _Hf()

        def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
            out: list[int] = []
            for n, part in enumerate(text.split("<s>")):
                out += [1] if n else []
                out += ([100] if part and 100 not in out else []) + [ord(c) for c in part]
            return out

    tokenizer = PrefixSpace()
    tokens = PromptTokens()
    first = "x" * MIN_REUSE + "<s>" + "y" * MIN_REUSE
    second = first + "<s>" + "z" * 10
    assert tokens.encode(tokenizer, first) == tuple(tokenizer.encode(first))
    assert tokens.encode(tokenizer, second) == tuple(tokenizer.encode(second))  # checked: differs, so whole
    assert tokens._states[tokenizer].off
    assert tokens.encode(tokenizer, second + "w") == tuple(tokenizer.encode(second + "w"))


def test_a_rust_tokenizer_that_disagrees_with_encode_is_left_for_encode() -> None:
    """A fast tokenizer whose ``encode`` does more than its Rust tokenizer (here: appends an id) is asked through
    ``encode`` once a checked text differs: every answer is ``encode``'s."""
    real = load_tokenizer(ensure_tiny_model("tiny-qwen3"))

    class Appending:
        _tokenizer = real._tokenizer  # the Hugging Face tokenizer, whose own _tokenizer is the Rust one

        def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
            return [*real.encode(text, add_special_tokens=add_special_tokens), 7]

    tokenizer = Appending()
    tokens = PromptTokens()
    for text in ("short", "a little longer text", "x" * (MIN_REUSE + 10)):
        assert tokens.encode(tokenizer, text) == tuple(tokenizer.encode(text, add_special_tokens=False))
    assert tokens._states[tokenizer].rust is None
