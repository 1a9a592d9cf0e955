"""The grammar matcher a constrained sequence carries: masks, the reasoning block before the grammar, the
compiled-grammar cache, and what cannot be compiled."""

from __future__ import annotations

import json
from typing import Any

import numpy as np
import pytest
from mlx_lm.utils import load

from runtime.constrained import Constraint, Grammar, GrammarCompiler, GrammarError, Reasoning
from runtime.tiny import ensure_tiny_model

SCHEMA = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9}}, "required": ["n"],
          "additionalProperties": False}


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    return load(str(ensure_tiny_model("tiny-qwen3")))[1]


@pytest.fixture(scope="module")
def compiler(tokenizer: Any) -> GrammarCompiler:
    return GrammarCompiler(tokenizer, len(tokenizer._tokenizer), (tokenizer.eos_token_id,))


def first_allowed(constraint: Constraint) -> int:
    mask = constraint.allowed()
    assert mask is not None
    return int(np.flatnonzero(mask)[0])


def complete(constraint: Constraint, limit: int = 50) -> list[int]:
    """Take the lowest allowed token until the grammar is complete."""
    out: list[int] = []
    while not constraint.finished and len(out) < limit:
        token = first_allowed(constraint)
        constraint.consume(token)
        out.append(token)
    return out


def test_the_mask_leads_to_a_valid_answer_then_only_the_end(tokenizer: Any, compiler: GrammarCompiler) -> None:
    constraint = compiler.constraint(Grammar.json_schema(SCHEMA, strict=True))
    text = tokenizer.decode(complete(constraint))
    assert json.loads(text)["n"] in range(10)
    mask = constraint.allowed()
    assert mask is not None and list(np.flatnonzero(mask)) == [tokenizer.eos_token_id]


def test_the_grammar_starts_after_the_thinking_block(tokenizer: Any, compiler: GrammarCompiler) -> None:
    encode = tokenizer._tokenizer.encode
    reasoning = Reasoning(tuple(encode("<think>", add_special_tokens=False)),
                          tuple(encode("</think>", add_special_tokens=False)))
    constraint = compiler.constraint(Grammar.json_schema(SCHEMA), reasoning)
    opening = constraint.allowed()
    assert opening is not None and opening[reasoning.open_ids[0]]  # may think first …
    plain = compiler.constraint(Grammar.json_schema(SCHEMA)).allowed()
    assert plain is not None and (opening & plain).sum() == plain.sum() > 0  # … or answer at once
    constraint.consume(reasoning.open_ids[0])
    for token in encode("free thoughts, no JSON", add_special_tokens=False):
        assert constraint.allowed() is None  # inside thinking: unconstrained
        constraint.consume(token)
    for token in reasoning.close_ids:
        constraint.consume(token)
    assert json.loads(tokenizer.decode(complete(constraint)))["n"] in range(10)
    inside = compiler.constraint(Grammar.json_schema(SCHEMA), Reasoning(reasoning.open_ids, reasoning.close_ids,
                                                                          inside=True))
    assert inside.allowed() is None  # the prompt opened the block


def test_a_marker_of_several_tokens_opens_the_block_only_in_order(tokenizer: Any, compiler: GrammarCompiler) -> None:
    """A vocabulary without a thinking token writes the marker in pieces: its first piece alone opens no way
    around the grammar; after it only the marker goes on (or the grammar, where it takes the same pieces)."""
    encode = tokenizer._tokenizer.encode
    reasoning = Reasoning(tuple(encode("<reason>", add_special_tokens=False)),
                          tuple(encode("</reason>", add_special_tokens=False)))
    assert len(reasoning.open_ids) > 2
    constraint = compiler.constraint(Grammar.json_schema(SCHEMA), reasoning)
    plain = compiler.constraint(Grammar.json_schema(SCHEMA)).allowed()
    opening = constraint.allowed()
    assert opening is not None and plain is not None and opening[reasoning.open_ids[0]]
    assert (opening & plain).sum() == plain.sum()  # or the answer at once
    for i, token in enumerate(reasoning.open_ids):
        mask = constraint.allowed()
        assert mask is not None and mask[token]
        if i:  # JSON takes no "<": the marker, and nothing else, goes on
            assert list(np.flatnonzero(mask)) == [token]
        constraint.consume(token)
    for token in encode("free thoughts", add_special_tokens=False):
        assert constraint.allowed() is None
        constraint.consume(token)
    for token in reasoning.close_ids:
        constraint.consume(token)
    assert json.loads(tokenizer.decode(complete(constraint)))["n"] in range(10)
    # A grammar that starts with the same piece: both go on until one is left behind, here the marker.
    tagged = compiler.constraint(Grammar.lark('start: "<answer>" /[0-9]/ "</answer>"'), reasoning)
    tagged.consume(reasoning.open_ids[0])  # "<": the marker's and the grammar's
    mask = tagged.allowed()
    assert mask is not None and mask[reasoning.open_ids[1]] and mask.sum() > 1
    answer = encode("<answer>", add_special_tokens=False)
    assert answer[0] == reasoning.open_ids[0] and answer[1] != reasoning.open_ids[1]
    tagged.consume(answer[1])
    text = tokenizer.decode([reasoning.open_ids[0], answer[1], *complete(tagged)])
    assert text.startswith("<answer>") and text.endswith("</answer>") and text[8].isdigit()


def test_grammars_are_compiled_once_per_schema(compiler: GrammarCompiler) -> None:
    before = compiler.compiles
    for _ in range(3):
        compiler.constraint(Grammar.json_schema({"type": "array", "items": {"type": "boolean"}, "maxItems": 2}))
    assert compiler.compiles == before + 1
    assert compiler.stats_json()["tokenizer_ready"]


def test_what_cannot_be_compiled_is_named(compiler: GrammarCompiler) -> None:
    with pytest.raises(GrammarError, match="bogus"):
        compiler.constraint(Grammar.json_schema({"type": "string", "format": "bogus"}, strict=True))
