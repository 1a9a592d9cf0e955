"""Speculative decoding's step in the engine: each row's draft, one verify pass, and what each row keeps.

A decode step whose rows have drafts worth verifying (:meth:`Speculator.drafts`: speculation on, a batch small
enough, every row plain — no penalties, grammar or logprobs — and the measured costs say it pays) runs **one**
pass over each row's input and draft instead of the plain pass (:meth:`Speculator.verify`). Each row keeps its
input's KV and its accepted draft tokens' — the rest is trimmed from its cache row (uniformly where rows agree,
by rolling the remainder into left padding where they differ; a gated-delta layer's state is rolled back by
``runtime/recurrent_rollback.py``) — hands out its input (unless fresh) and accepted tokens, and takes the
model's own next token as its next input. Drafting and acceptance themselves are ``runtime/speculative.py``'s
(and ``runtime/mtp.py``'s for the model's own MTP layers).

Never imports the engine or trio.
"""

from __future__ import annotations

import time
from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import BatchKVCache

from protocols.ir import TokenChunk
from runtime import quantized_kv
from runtime.cache_surgery import trim_rows
from runtime.engine_config import SpeculativeConfig
from runtime.engine_stats import Tally
from runtime.mtp import MTPDrafter, MTPDraftState
from runtime.outbox import UNHELD_TOKENS
from runtime.pass_cost import PassCost
from runtime.passes import ModelPasses
from runtime.recurrent_rollback import RecurrentRollback
from runtime.sequence import DecodeBatch, Decoded, Sequence
from runtime.speculative import (
    DraftState,
    ModelDraftState,
    greedy_accepts,
    sampled_verify,
    worth_verifying,
)


class Speculator:
    """One engine's speculative decoding (``config.kind == "off"``: no drafts; a prompt's hidden states still
    reach the MTP layers' context when they draft)."""

    def __init__(self, config: SpeculativeConfig, drafter: Any, model: Any, passes: ModelPasses, tally: Tally,
                 step_cost: PassCost, pipelined: bool) -> None:
        self.config = config
        # A draft model (same tokenizer) for kind "draft", the model's MTP layers for kind "mtp", else None.
        self.drafter = drafter
        self._passes = passes
        self._tally = tally
        # Decode forward passes' seconds by the tokens they hold: whether verifying drafts pays (CPU).
        self._step_cost = step_cost
        # A drafter's seconds by the tokens it drafted in a step: what drafting adds to a verifying step's cost.
        self._draft_cost = PassCost(weight=0.1)
        self._pipelined = pipelined  # a GPU: a wider pass costs about what a plain one does
        # Hybrid models: their gated-delta layers' states are cut back to the accepted tokens by running again.
        self._recurrent = RecurrentRollback.of(model) if config.kind != "off" else None

    # ------------------------------------------------------------------ prefill's part
    def draft_state(self, seq: Sequence) -> DraftState:
        """The sequence's draft state, made (with its prompt) on first use."""
        if seq.draft is None:
            seq.draft = self._new_draft_state()
            seq.draft.extend(seq.prompt)
        return seq.draft

    def prompt_hidden(self, seq: Sequence, start: int, hidden: mx.array | None) -> None:
        """Prefill's hidden states of the prompt from position ``start``: the MTP layers' context."""
        if hidden is not None:
            state = self.draft_state(seq)
            assert isinstance(state, MTPDraftState)
            mx.eval(hidden)  # with its chunk: the pass's graph is not kept for it
            state.observe(start, hidden)

    # ------------------------------------------------------------------ the decode step's part
    def drafts(self, batch: DecodeBatch) -> tuple[list[int], list[list[int]]] | None:
        """This step's inputs and each row's draft, when the step should verify drafts: speculation on, a
        batch small enough, every row plain (no penalties, grammar or logprobs) and some row with a draft."""
        spec = self.config
        if spec.kind == "off" or len(batch) > spec.max_batch or batch.report is not None:
            return None
        if not all(s.sampler.plain for s in batch.seqs) or not self._verifiable(batch.cache):
            return None
        assert batch.inputs is not None
        values: list[int] = batch.inputs.tolist()  # type: ignore[assignment]
        states: list[DraftState] = []
        rooms: list[int] = []
        for seq, value in zip(batch.seqs, values):
            state = self.draft_state(seq)
            known = state.count - len(seq.prompt)
            if known < len(seq.fed):
                state.extend(seq.fed[known:])
            state.extend([value])  # the input: its KV is kept whatever the verification says
            states.append(state)
            rooms.append(max(0, seq.max_tokens - seq.generated - (0 if seq.fresh else 1)))
        cost = None if self._pipelined else self._step_cost
        limit = max(rooms)
        if self.drafter is not None:
            # A drafter's passes cost time too: how far drafting pays is decided before paying for it.
            wants = [0 if s.cool_down else min(r, s.length) for s, r in zip(states, rooms)]
            limit = worth_verifying(wants, states, cost, self._draft_cost)
        started = time.perf_counter()
        drafts = [s.propose(min(r, limit)) for s, r in zip(states, rooms)]  # limit 0: only counts cool-downs
        drafted = sum(len(d) for d in drafts)
        if self.drafter is not None and drafted:
            self._draft_cost.add(drafted, time.perf_counter() - started)
        width = worth_verifying([len(d) for d in drafts], states, cost)  # drafting is paid for now: verify?
        if width == 0:
            for seq in batch.seqs:  # this step decodes as usual: its inputs join the histories then
                assert seq.draft is not None
                seq.draft.count -= 1
            return None
        return values, [d[:width] for d in drafts]

    def verify(self, batch: DecodeBatch, values: list[int], drafts: list[list[int]]) -> Decoded:
        """One forward pass over each row's input and draft; what each row keeps and hands out."""
        width = max(len(d) for d in drafts)
        window = mx.array([[v, *d, *([v] * (width - len(d)))] for v, d in zip(values, drafts)], dtype=mx.uint32)
        if self._recurrent is not None:
            self._recurrent.begin(batch.cache)
        positions = self._passes.decode_positions(batch.seqs, width + 1)
        logits, hidden = self._passes.run(window, batch.cache, (s.adapters for s in batch.seqs),
                                          positions=positions)
        if self._recurrent is not None:
            self._recurrent.end()
        launched = time.perf_counter()
        # Timed as a plain step's launch is, for the cost fit.
        mx.async_eval(logits, *([] if hidden is None else [hidden]))  # type: ignore[no-untyped-call]
        self._step_cost.add(len(values) * (width + 1), time.perf_counter() - launched)
        greedy = [s.sampler.greedy for s in batch.seqs]
        targets: list[list[int]] = mx.argmax(logits, axis=-1).tolist() if any(greedy) else []  # type: ignore[assignment]
        logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True) if not all(greedy) else logits
        now = time.perf_counter()
        stats = self._tally.stats
        decoded = Decoded([], [], [], batch.inputs if batch.inputs is not None else mx.array([]))
        next_inputs: list[int] = []
        trims: list[int] = []
        for i, seq in enumerate(batch.seqs):
            draft = drafts[i]
            if greedy[i]:
                accepted = greedy_accepts(targets[i], draft)
                following = targets[i][accepted]
            else:
                accepted, following = sampled_verify(seq.sampler, logprobs[i, : len(draft) + 1], draft)
            assert seq.draft is not None
            seq.draft.extend(draft[:accepted])
            seq.draft.record(len(draft), accepted)
            stats.draft_tokens += len(draft)
            stats.accepted_tokens += accepted
            if hidden is not None and isinstance(seq.draft, MTPDraftState):
                seq.draft.observe(len(seq.prompt) + len(seq.fed), hidden[i, : accepted + 1])
            seq.fed.extend([values[i], *draft[:accepted]])
            trims.append(width - accepted)
            next_inputs.append(following)
            handed = draft[:accepted] if seq.fresh else [values[i], *draft[:accepted]]
            seq.fresh = False
            first = seq.generated == 0
            tokens, finish = seq.emit(handed)
            if first and tokens:
                self._tally.first_token(seq.submitted_at, now)
            if tokens and seq.generated - len(tokens) < UNHELD_TOKENS:
                decoded.started = True  # a sequence's first tokens go out at once (runtime/outbox.py)
            decoded.emitted += len(tokens)
            if tokens or finish is not None:
                decoded.chunks.append((seq, TokenChunk(tokens, finish)))
            (decoded.keep if finish is None else decoded.finished).append(i)
        trim_rows(batch.cache, trims)
        if self._recurrent is not None:
            self._recurrent.keep(batch.cache, [width + 1 - t for t in trims], width + 1)
        self._passes.quantize(batch.cache)
        decoded.inputs = mx.array(next_inputs, dtype=mx.uint32)
        stats.speculative_steps += 1
        return decoded

    def _verifiable(self, cache: list[Any]) -> bool:
        """Whether a verify pass can be cut back per row: plain KV layers, and gated-delta ones rolled back."""
        rollback = self._recurrent
        if rollback is not None and not rollback.covers(cache):
            return False
        rolled = rollback.mixers if rollback is not None else {}
        return all(type(c) in (BatchKVCache, quantized_kv.BatchQuantizedKVCache)
                   for i, c in enumerate(cache) if i not in rolled)

    def _new_draft_state(self) -> DraftState:
        if isinstance(self.drafter, MTPDrafter):
            return self.drafter.new_state(self.config)
        return DraftState(self.config) if self.drafter is None else ModelDraftState(self.config, self.drafter)
