"""A chat prompt's token ids, tokenizing only what an earlier prompt did not already cover.

An agent resends its whole conversation every turn: 10–60K tokens of text, of which the previous turn's prompt
is a prefix up to where its last message ended. Tokenizing it all again costs about 2 µs a token (a 60K-token
conversation: over 100 ms before a cached turn's prefill even starts). A tokenizer matches its special tokens
(``<|im_start|>``, ``<start_of_turn>``: added tokens, no whitespace stripped) before anything else and tokenizes
the text between them on its own, so the ids of a text are the ids of its part before a special token followed by
those of the rest. :class:`PromptTokens` keeps recent prompts' ids with where their special tokens sit; a new
prompt takes the ids of the longest such part it shares with one of them and tokenizes only the rest.

A tokenizer that normalizes or splits across special tokens would break that: each tokenizer's first
``VERIFIED`` reuses are checked against a full tokenization, and one mismatch turns reuse off for it (logged).

A Hugging Face fast tokenizer's text is tokenized by its Rust ``tokenizers.Tokenizer`` directly: the same ids
without transformers' Python around the call (~80 against ~170 µs for a short chat prompt, on every request's
way to the engine). Each tokenizer's first ``VERIFIED`` texts are checked against ``tokenizer.encode``; one
mismatch sends it back there for good (logged).
"""

from __future__ import annotations

import logging
import threading
import weakref
from array import array
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

log = logging.getLogger("flow.stages.prompt_tokens")

KEPT = 16  # recent prompts per tokenizer (several conversations interleave)
VERIFIED = 4  # each tokenizer's first reuses are checked against tokenizing the whole text
MIN_REUSE = 256  # characters: below this, tokenizing anew costs less than looking


@dataclass(frozen=True)
class _Tokenized:
    text: str
    ids: array[int]  # 4 bytes a token, not a tuple's 36: a kept 60K-token prompt is 240 KB
    cuts: tuple[tuple[int, int], ...]  # (character offset, token index) of each special token, in order


class _Check:
    """A shortcut's first :data:`VERIFIED` texts checked against ``tokenizer.encode``'s ids of the whole text."""

    def __init__(self, meaning: str) -> None:
        self.meaning = meaning  # what a difference means for the tokenizer (logged)
        self.passed = 0

    def differs(self, tokenizer: Any, text: str, ids: tuple[int, ...]) -> tuple[int, ...] | None:
        """``encode``'s ids of ``text`` where they differ from ``ids`` (logged), else None; no check once
        :data:`VERIFIED` texts agreed."""
        if self.passed >= VERIFIED:
            return None
        whole = tuple(tokenizer.encode(text, add_special_tokens=False))
        if whole == ids:
            self.passed += 1
            return None
        log.warning("tokenizer %s: %s", type(tokenizer).__name__, self.meaning)
        return whole


class _State:
    def __init__(self, specials: dict[int, str], rust: Any) -> None:
        self.specials = specials  # id → text of the special tokens that split the text (none: no reuse)
        self.recent: OrderedDict[str, _Tokenized] = OrderedDict()
        self.off = not specials
        self.reuse_check = _Check("a prompt tokenized in two parts differs from it tokenized whole; prompts are "
                                  "tokenized whole from now on")
        self.rust = rust  # the fast tokenizer's tokenizers.Tokenizer (None: tokenizer.encode)
        self.rust_check = _Check("its Rust tokenizer's ids differ from encode()'s; prompts go through encode() "
                                 "from now on")

    @property
    def verified(self) -> int:
        return self.reuse_check.passed

    @property
    def rust_verified(self) -> int:
        return self.rust_check.passed


def _ids(state: _State | None, tokenizer: Any, text: str) -> tuple[int, ...]:
    """``tokenizer.encode(text, add_special_tokens=False)``, from its Rust tokenizer where it has one."""
    if state is None or state.rust is None:
        return tuple(tokenizer.encode(text, add_special_tokens=False))
    ids = tuple(state.rust.encode(text, add_special_tokens=False).ids)
    whole = state.rust_check.differs(tokenizer, text, ids)
    if whole is not None:
        state.rust = None
        return whole
    return ids


def _rust_tokenizer(tokenizer: Any) -> Any:
    """The ``tokenizers.Tokenizer`` under one of transformers' own fast tokenizer classes (mlx-lm's wrapper around
    it), or None: a model's own tokenizer code (``trust_remote_code``) may do more in ``encode``."""
    try:
        from tokenizers import Tokenizer
    except ImportError:
        return None
    hf = getattr(tokenizer, "_tokenizer", tokenizer)
    rust = getattr(hf, "_tokenizer", None)
    if not isinstance(rust, Tokenizer) or not type(hf).__module__.startswith("transformers."):
        return None
    return rust


class PromptTokens:
    """Token ids of chat prompts, per tokenizer, reusing recent prompts' (thread-safe: chat.prepare renders on
    worker threads)."""

    def __init__(self) -> None:
        self._states: weakref.WeakKeyDictionary[Any, _State] = weakref.WeakKeyDictionary()
        self._lock = threading.Lock()
        self.reused_tokens = 0  # counters for tests and stats
        self.tokenized_chars = 0

    def encode(self, tokenizer: Any, text: str) -> tuple[int, ...]:
        """``tokenizer.encode(text, add_special_tokens=False)``, as ids."""
        state = self._state(tokenizer)
        if state is None or state.off or len(text) < MIN_REUSE:
            return _ids(state, tokenizer, text)
        with self._lock:
            known = state.recent.get(text)
            if known is not None:  # asked again (a retry; the same probe render each request)
                state.recent.move_to_end(text)
                return tuple(known.ids)
            base, cut = self._best_cut(state, text)
        if base is None:
            ids = _ids(state, tokenizer, text)
            cuts = _cuts(text, ids, state.specials)
            self.tokenized_chars += len(text)
        else:
            offset, index = cut
            rest = _ids(state, tokenizer, text[offset:])
            ids = tuple(base.ids[:index]) + rest
            self.tokenized_chars += len(text) - offset
            whole = state.reuse_check.differs(tokenizer, text, ids)
            if whole is not None:
                state.off = True
                return whole
            self.reused_tokens += index
            later = _cuts(text[offset:], rest, state.specials)  # the shared part's are known
            cuts = None if later is None else (*(c for c in base.cuts if c[1] < index),
                                               *((o + offset, i + index) for o, i in later))
        if cuts is not None:
            with self._lock:
                state.recent[text] = _Tokenized(text, array("I", ids), cuts)
                state.recent.move_to_end(text)
                while len(state.recent) > KEPT:
                    state.recent.popitem(last=False)
        return ids

    def _state(self, tokenizer: Any) -> _State | None:
        with self._lock:
            try:
                state = self._states.get(tokenizer)
                if state is None:
                    state = self._states[tokenizer] = _State(_splitting_specials(tokenizer), _rust_tokenizer(tokenizer))
            except TypeError:  # not weakly referable
                return None
            return state

    @staticmethod
    def _best_cut(state: _State, text: str) -> tuple[_Tokenized | None, tuple[int, int]]:
        """The recent prompt, and the cut in it (character offset, token index) before its last special token
        inside what it shares with ``text``, that leaves the least to tokenize."""
        best: tuple[_Tokenized | None, tuple[int, int]] = (None, (0, 0))
        for known in reversed(state.recent.values()):
            if not known.cuts or known.text[:MIN_REUSE] != text[:MIN_REUSE]:
                continue  # another conversation (the usual case: a look at its start settles it)
            shared = _shared_prefix(known.text, text)
            usable = [c for c in known.cuts if c[0] <= shared]
            if usable and usable[-1][0] > best[1][0]:
                best = (known, usable[-1])
        return best if best[1][0] >= MIN_REUSE else (None, (0, 0))


def _splitting_specials(tokenizer: Any) -> dict[int, str]:
    """The tokenizer's special added tokens that keep no whitespace beside them: the text is cut at them."""
    hf = getattr(tokenizer, "_tokenizer", tokenizer)
    decoder = getattr(hf, "added_tokens_decoder", None)
    if not isinstance(decoder, dict):
        return {}
    return {int(i): str(t.content) for i, t in decoder.items()
            if getattr(t, "special", False) and not getattr(t, "lstrip", True) and not getattr(t, "single_word", True)
            and str(getattr(t, "content", ""))}


def _cuts(text: str, ids: tuple[int, ...], specials: dict[int, str]) -> tuple[tuple[int, int], ...] | None:
    """Where each special token of ``ids`` sits in ``text`` (found in order), or None when one cannot be found."""
    cuts = []
    at = 0
    for index, token in enumerate(ids):
        content = specials.get(token)
        if content is None:
            continue
        found = text.find(content, at)
        if found < 0:
            return None
        cuts.append((found, index))
        at = found + len(content)
    return tuple(cuts)


def _shared_prefix(a: str, b: str) -> int:
    """The length of the longest common prefix of ``a`` and ``b`` (a binary search over slice comparisons)."""
    lo, hi = 0, min(len(a), len(b))
    if a[:hi] == b[:hi]:
        return hi
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid - 1
    return lo


PROMPT_TOKENS = PromptTokens()  # the server's one cache
