"""The engine's side of the prefix cache: what a sequence takes from it and what it gives back.

A sequence's own cache starts from its prefix hit (:meth:`PrefixKeeper.new_cache`); its prompt's blocks go to
the cache after every prefill chunk, and with ``cache_mode = "full"`` its prompt's and answer's when it finishes
(:meth:`PrefixKeeper.keep`) — after its last tokens went out (the store copies every block: a stream's end does
not wait for it), while the cache's readers that must see them wait (``PrefixCache.settled``). On a hybrid model
the recurrent layers' states go with them as snapshots: at the prompt's end and the finish, at its *turn
points* — where its template says the system messages and all the messages end (another conversation under the
same system prompt, and this one's next turn, go on from there), or, when it does not say, the last block boundary
``TURN_MARGIN`` tokens or more before the prompt's end — and at up to ``MAX_CHUNK_STATES`` chunk ends, the deepest
of which rolls forward, so a retried prompt resumes from it.
Its prefill chunks end on block boundaries and at the turn points (:meth:`PrefixKeeper.snapshot_chunk`) so that
the states exist there.

Never imports the engine; the prefix cache and the cache surgery are the modules it stands on.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from functools import cached_property
from typing import Any

from mlx_lm.models.cache import make_prompt_cache

from runtime.cache_surgery import held_row
from runtime.passes import ModelPasses
from runtime.prefix_cache import (
    MAX_CHUNK_STATES,
    BlockKeys,
    PrefixCache,
    Slicer,
    StateReader,
    Windows,
    recurrent,
    state_key,
)
from runtime.sequence import DecodeBatch, Sequence

log = logging.getLogger("flow.engine")

# A hybrid model's prompt also gets a state snapshot at the last block boundary this many tokens or more before
# its end: a conversation's next turn repeats the prompt but its last tokens (the generation prompt, an empty
# thinking block) are rendered otherwise once the answer follows them.
TURN_MARGIN = 16


class PrefixKeeper:
    """One engine's use of its prefix cache (``cache`` None: the model has none, and every verb is cheap)."""

    def __init__(self, cache: PrefixCache | None, windows: Windows, passes: ModelPasses) -> None:
        self.cache = cache
        self.windows = windows
        self._passes = passes
        # The finished rows held for their store after delivery: (sequence, tokens, positions, states).
        self._finished: list[tuple[Sequence, list[int], Slicer, StateReader | None]] = []
        self._held = False  # the cache was told of stores to come (PrefixCache.pending), not yet of their end

    @cached_property
    def snapshots(self) -> bool:
        """Whether the prefix cache keeps this model's recurrent states as snapshots (a hybrid model)."""
        return self.cache is not None and recurrent(self.windows)

    @property
    def block_tokens(self) -> int:
        return self.cache.config.block_tokens if self.cache is not None else 1

    def new_cache(self, seq: Sequence) -> list[Any]:
        """A sequence's own cache: built from its prefix hit, or empty."""
        if seq.hit is None or self.cache is None:
            return make_prompt_cache(self._passes.model)
        hit, seq.hit = seq.hit, None
        cache = self.cache.build(hit, room=len(seq.prompt) - hit.tokens)  # the rest of its prompt is written next
        self._passes.quantize(cache)  # a prefix past the start is quantized, as its first sequence's was
        return cache

    def drop_hit(self, seq: Sequence) -> None:
        if seq.hit is not None and self.cache is not None:
            self.cache.release(seq.hit)
        seq.hit = None

    def turn_point(self, seq: Sequence) -> int:
        """Where a hybrid model's prompt gets a snapshot before its end that a restart keeps: the last block
        boundary at least ``TURN_MARGIN`` tokens before it (the next turn renders the prompt's last tokens
        differently), and no deeper than where its messages end, when the template says."""
        b = self.block_tokens
        end = len(seq.prompt) - 1 - TURN_MARGIN
        if seq.message_ends.last is not None:
            end = min(end, seq.message_ends.last)
        return max(0, end) // b * b

    def turn_points(self, seq: Sequence) -> tuple[int, ...]:
        """Every position before the prompt's end that gets a snapshot for a later request, ascending: where the
        system messages end (another conversation under the same system prompt goes on from there) and where all
        of them end (the conversation's next turn does), exactly there when the template says (the snapshot goes
        to disk too, and serves from there once a later prompt has filled its block), else the block-aligned turn
        point. One prefill pass ends at each: as few as serve."""
        ends = seq.message_ends
        points = {ends.last if ends.last is not None else self.turn_point(seq)}
        if ends.system is not None:
            points.add(ends.system)
        return tuple(sorted(p for p in points if 0 < p < len(seq.prompt) - 1))

    def snapshot_chunk(self, seq: Sequence, n: int) -> int:
        """A prefill chunk of ``n`` tokens as a hybrid model runs it: cut to end on a block boundary (its snapshot
        then also goes to disk) and at the prompt's turn points (their snapshots serve later requests). Any
        other model's chunk is ``n``."""
        if not self.snapshots:
            return n
        b = self.block_tokens
        end = seq.prefilled + n
        for turn in self.turn_points(seq):
            if seq.prefilled < turn < end:
                return turn - seq.prefilled
        if end < len(seq.prompt) - 1 and end // b * b > seq.prefilled:
            return end // b * b - seq.prefilled
        return n

    @contextmanager
    def storing(self) -> Iterator[None]:
        """The keeps inside are settled together (``PrefixCache.storing``)."""
        with self.cache.storing() if self.cache is not None else nullcontext():
            yield

    def keep(self, seq: Sequence, slicer: Slicer, tokens: list[int] | None = None,
             state: StateReader | None = None) -> None:
        """Give the prefix cache the blocks it lacks of ``tokens``: prompt and answer when the sequence has
        finished, else its prefilled prompt. A session's turn is its last store (its finish, or its prompt in
        ``prefix`` mode). ``state`` reads a hybrid model's recurrent states there: a snapshot at the prompt's
        end, its turn point and the finish, at its first ``MAX_CHUNK_STATES - 1`` prefill-chunk ends, and at its
        deepest one (each later chunk end's snapshot replaces the one before: a retry resumes from it)."""
        if self.cache is None:
            return
        last = tokens is not None or seq.policy.mode == "prefix"
        ends = tokens is not None or seq.prefilled >= len(seq.prompt) - 1  # the prompt's end, or the finish
        if not self.snapshots:
            state = None
        rolling = False
        if state is not None and not ends and seq.prefilled not in self.turn_points(seq):
            seq.chunk_states += 1
            rolling = seq.chunk_states >= MAX_CHUNK_STATES
        if seq.keys is None:
            seq.keys = BlockKeys(seq.namespace, self.cache.config.block_tokens)
        try:
            self.cache.store(seq.namespace, tokens if tokens is not None else seq.keyed[: seq.prefilled], slicer,
                             tail=ends, windows=self.windows, ttl=seq.policy.ttl_seconds,
                             session_id=seq.policy.session_id if last else None, keys=seq.keys, state=state,
                             lasting=self._lasting(seq, tokens))
            b = self.cache.config.block_tokens
            if rolling and seq.prefilled % b == 0 and len(seq.keys.keys) >= seq.prefilled // b > 0:
                if seq.rolling_state is not None:
                    self.cache.forget_state(seq.rolling_state)
                seq.rolling_state = state_key(seq.keys.keys[seq.prefilled // b - 1])
        except Exception:  # the cache is an optimisation: a failure there must not fail the sequence
            log.exception("prefix cache: could not store a sequence's blocks")

    def _lasting(self, seq: Sequence, tokens: list[int] | None) -> bool:
        """Whether the snapshot stored now goes to disk even inside a block: at a turn point, and at the prompt's
        end when the conversation's next turn repeats all of the prompt (its template's generation prompt too)."""
        if tokens is not None:
            return False
        if seq.prefilled >= len(seq.prompt) - 1:
            return seq.message_ends.last is not None and seq.message_ends.last >= len(seq.prompt) - 1
        return seq.prefilled in self.turn_points(seq)

    def keep_finished(self, batch: DecodeBatch, rows: list[int]) -> None:
        """With ``cache_mode = "full"``: the finished rows' prompts and answers, held from their batch rows before
        the rows are dropped and stored by :meth:`store_finished` once their last tokens went out. Until then the
        cache's readers that must see them wait (``PrefixCache.settled``)."""
        if self.cache is None:
            return
        for i in rows:
            seq = batch.seqs[i]
            if seq.policy.mode == "full":
                if not self._held:  # readers wait from now until store_finished or drop_finished
                    self.cache.pending()
                    self._held = True
                self._finished.append((seq, seq.keyed + seq.fed, *held_row(batch.cache, i, self.snapshots)))

    def store_finished(self) -> None:
        """Store the finished rows :meth:`keep_finished` held (after the step delivered their last tokens)."""
        if not self._held or self.cache is None:
            return
        finished, self._finished, self._held = self._finished, [], False
        try:
            with self.cache.storing():
                for seq, tokens, slicer, state in finished:
                    self.keep(seq, slicer, tokens, state=state)
        finally:
            self.cache.stored()

    def drop_finished(self) -> None:
        """The step failed before its finished rows were stored: they are not (readers stop waiting for them)."""
        if self._held and self.cache is not None:
            self._finished, self._held = [], False
            self.cache.stored()
