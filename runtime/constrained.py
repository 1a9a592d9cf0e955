"""Constrained decoding: a grammar per sequence, a token mask per constrained row per step (llguidance).

Why llguidance: it is what the MLX servers that enforce schemas use (mlx-vlm, vllm-mlx), computes a mask
in tens of microseconds for a 128k vocabulary with no per-schema precompilation over the vocabulary (a new
schema costs about a millisecond, so per-request schemas are cheap), and implements JSON Schema broadly
(anyOf, $ref, bounds, patterns), refusing what it cannot do with a message naming it. xgrammar compiles
each grammar against the whole vocabulary first (tens to hundreds of ms per new schema); outlines-core
builds a regex automaton per schema, slow for nested schemas.

* :class:`GrammarCompiler` — one per loaded model: the tokenizer's grammar data, built once (it reads the
  whole vocabulary), and compiled grammars cached by their source.
* :class:`Constraint` — one per sequence: a matcher fed every token the sequence samples, which gives the
  mask of tokens allowed next. For a reasoning model (:class:`Reasoning`), the grammar starts only once the
  model has closed its thinking block.

JSON is compiled with bounded whitespace (``{"a": 1, "b": [2, 3]}``, the separators models write), so a
weak model cannot loop on spaces.
"""

from __future__ import annotations

import json
import re
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from protocols.parsers.base import JSON_ITEM_SEPARATOR, JSON_KEY_SEPARATOR

if TYPE_CHECKING:
    from llguidance._lib import JsonCompileOptions

ANY_JSON_OBJECT: dict[str, Any] = {"type": "object"}


class GrammarError(ValueError):
    """The schema or grammar cannot be compiled: the message names what is wrong."""


@dataclass(frozen=True)
class Grammar:
    """A grammar source: a JSON schema (``strict``: unsupported keywords are errors) or a Lark grammar."""

    kind: str  # "json_schema" | "lark"
    source: str  # the schema as canonical JSON, or the Lark text
    strict: bool = False

    @classmethod
    def json_schema(cls, schema: dict[str, Any], strict: bool = False) -> Grammar:
        return cls("json_schema", json.dumps(schema, sort_keys=True, separators=(",", ":")), strict)

    @classmethod
    def lark(cls, text: str) -> Grammar:
        return cls("lark", text)


class GrammarCompiler:
    """A model's grammar compiler: its tokenizer data (built on first use) and a cache of compiled grammars."""

    def __init__(self, tokenizer: Any, vocab_size: int, end_ids: tuple[int, ...], cache_size: int = 256) -> None:
        self._hf = getattr(tokenizer, "_tokenizer", tokenizer)  # mlx-lm's wrapper → the transformers tokenizer
        self.vocab_size = vocab_size  # the model's logits width (may exceed the tokenizer's vocabulary)
        self.end_ids = end_ids  # the model's end-of-sequence tokens: what a complete grammar allows
        self._ll: Any = None
        self._compiled: OrderedDict[Grammar, str] = OrderedDict()
        self._cache_size = cache_size
        self._lock = threading.Lock()
        self.compiles = 0

    def tokenizer_data(self) -> Any:
        """llguidance's view of the vocabulary: built once per model (it reads every token)."""
        with self._lock:
            if self._ll is None:
                import llguidance.hf

                self._ll = llguidance.hf.from_tokenizer(self._hf, eos_token=list(self.end_ids) or None)
            return self._ll

    def constraint(self, grammar: Grammar, reasoning: Reasoning | None = None) -> Constraint:
        """A fresh matcher for ``grammar`` (compiled once per distinct source); GrammarError if it cannot be."""
        import llguidance

        tokenizer = self.tokenizer_data()
        with self._lock:
            compiled = self._compiled.get(grammar)
            if compiled is not None:
                self._compiled.move_to_end(grammar)
        if compiled is None:
            compiled = _compile(grammar)
            matcher = llguidance.LLMatcher(tokenizer, compiled, log_level=0)
            if matcher.is_error():
                raise GrammarError(_explain(matcher.get_error()))
            with self._lock:
                self.compiles += 1
                self._compiled[grammar] = compiled
                while len(self._compiled) > self._cache_size:
                    self._compiled.popitem(last=False)
        else:
            matcher = llguidance.LLMatcher(tokenizer, compiled, log_level=0)
        return Constraint(matcher, self.vocab_size, self.end_ids, reasoning)

    def stats_json(self) -> dict[str, Any]:
        return {"grammars_cached": len(self._compiled), "grammars_compiled": self.compiles,
                "tokenizer_ready": self._ll is not None}


def _compile(grammar: Grammar) -> str:
    import llguidance

    if grammar.kind == "lark":
        return str(llguidance.LLMatcher.grammar_from_lark(grammar.source))
    try:
        options: JsonCompileOptions = {"whitespace_flexible": False, "lenient": not grammar.strict,
                                       "item_separator": JSON_ITEM_SEPARATOR, "key_separator": JSON_KEY_SEPARATOR}
        return str(llguidance.LLMatcher.grammar_from_json_schema(grammar.source, defaults=options))
    except ValueError as exc:
        raise GrammarError(f"the schema is not valid JSON: {exc}") from None


def _explain(error: str) -> str:
    """llguidance's first line, without its position in the grammar text ("at 2(7): "): flow wrote that text,
    the client did not."""
    first = error.strip().splitlines()[0] if error.strip() else "the grammar cannot be compiled"
    return re.sub(r"^at \d+\(\d+\): ", "", first)


@dataclass(frozen=True)
class Reasoning:
    """A reasoning model's thinking markers as token ids: the grammar starts after the block closes."""

    open_ids: tuple[int, ...]
    close_ids: tuple[int, ...]
    inside: bool = False  # the prompt already opened the block (the template ends with ``<think>``)


class Constraint:
    """One sequence's matcher: the tokens allowed next, advanced by each token the sequence samples.

    With ``reasoning``, the first tokens may also open a thinking block (or the prompt opened it): inside it
    nothing is constrained, and the grammar starts once the block's closing tokens have been sampled. A marker of
    several tokens (a vocabulary without a ``<think>`` token) is allowed only token by token, in order, beside
    what the grammar allows: its first piece (``<``) opens no loophole, and one the grammar allows too (a
    ``<tool_call>`` grammar's ``<``) is fed to both until one of them is left behind."""

    def __init__(self, matcher: Any, vocab_size: int, end_ids: tuple[int, ...],
                 reasoning: Reasoning | None = None) -> None:
        self._matcher = matcher
        self._vocab_size = vocab_size
        self._end_ids = end_ids  # allowed when nothing else is (the grammar is complete, or failed)
        self._reasoning = reasoning
        self._phase = "grammar" if reasoning is None else "thinking" if reasoning.inside else "start"
        self._opened = 0  # in the start phase: the opening marker's tokens sampled so far
        self._fed = 0  # of those, how many the grammar took too (all of them, or it was left behind)
        self._recent: list[int] = []

    def consume(self, token: int) -> None:
        if self._phase == "start":
            assert self._reasoning is not None
            opening = self._reasoning.open_ids
            if token == opening[self._opened]:
                self._opened += 1
                if self._fed == self._opened - 1 and self._matcher.validate_tokens([token]) == 1:
                    self._matcher.consume_token(token)
                    self._fed += 1
                if self._opened == len(opening):  # a thinking block: the grammar starts after it, afresh
                    self._matcher.rollback(self._fed)
                    self._phase = "thinking"
                return
            self._phase = "grammar"  # the marker was left behind (its tokens so far, the grammar's too)
        if self._phase == "thinking":
            assert self._reasoning is not None
            close = self._reasoning.close_ids
            self._recent = (self._recent + [token])[-len(close):]
            if tuple(self._recent) == close:
                self._phase = "grammar"
            return
        if not self._matcher.is_stopped():
            self._matcher.consume_token(token)

    @property
    def finished(self) -> bool:
        """The grammar is complete: nothing but the end of the sequence may follow."""
        return self._phase == "grammar" and bool(self._matcher.is_stopped())

    def allowed(self) -> np.ndarray | None:
        """The ``[vocab]`` boolean mask of tokens allowed next; None while unconstrained (inside thinking)."""
        if self._phase == "thinking":
            return None
        mask = np.zeros(self._vocab_size, dtype=bool)
        if self._phase != "start" or self._fed == self._opened:  # the grammar is still a way on
            bits = np.unpackbits(np.frombuffer(self._matcher.compute_bitmask(), dtype=np.uint8), bitorder="little")
            n = min(bits.size, self._vocab_size)
            mask[:n] = bits[:n].astype(bool)
        if self._phase == "start":
            assert self._reasoning is not None
            mask[self._reasoning.open_ids[self._opened]] = True  # the model may think first: the marker goes on
        if not mask.any():  # the matcher failed (it never should with its own mask): end the sequence
            mask[[t for t in self._end_ids if t < self._vocab_size]] = True
        return mask
