"""Prefill: from a waiting prompt to a started row with its first token handed out.

Theory of operation
-------------------
Prompts wait in a FIFO (:attr:`Prefill.waiting`) and are prefilled oldest first, spending at most a step's
budget of prompt tokens across sequences (:meth:`Prefill.run`); every prompt token but the last goes through
prefill. Several short prompts at the head of the queue that fit the budget together (counting their right
padding) are prefilled in **one** right-padded forward pass into a batch cache of their own
(``prepare``/``finalize`` turn the right padding into left padding); a prompt with a prefix-cache hit joins such
a group where every layer keeps a plain KV cache. Any other prompt is prefilled alone, into a cache of its *own*
(a plain single-sequence mlx-lm prompt cache, built from its hit if it has one), in chunks that may span steps —
so a long prompt never stalls the running streams for more than one chunk. A prompt that fits a step's budget
whole is not split to use up the rest of one: it waits for the next step, where it is prefilled in one pass
(with the prompts behind it) rather than in two passes of one row. A vision prompt's image spans need
their input embeddings first: from the feature cache at once, or from a vision-tower job that runs beside the
steps (the prompt waits aside, in :attr:`Prefill.towers`, and returns to the head of the queue).

Once every prompt token but the last is in its cache, a sequence's last prompt token runs in a forward pass of
its own (one pass for the sequences started together), whose logits give its **first token**, handed out at
once (:meth:`Prefill.start`): the time to first token is its prefill plus one small pass, never a step of the
whole batch. The rows that go on wait in :attr:`Prefill.ready` until the engine's admit phase merges them into
the decode batch. A request's further choices (``n``) start with it, from copies of its cache.

Before every pass the engine's cancellations are applied (the ``between_passes`` hook), so a cancelled prompt
costs at most the pass that was running when its client left.

Never imports the engine: what it needs of it comes as the collaborators and hooks its constructor takes.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable
from functools import cached_property
from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import KVCache, make_prompt_cache

from protocols.ir import TokenChunk, TokenLogprob
from runtime.cache_surgery import (
    merge_caches,
    own_slicer,
    own_state,
    row_slicer,
    row_state,
)
from runtime.cross_attention import CrossStates
from runtime.engine_stats import Tally
from runtime.outbox import Outbox
from runtime.passes import ModelPasses
from runtime.prefix_audit import PrefixAuditor
from runtime.prefix_keeper import PrefixKeeper
from runtime.sampling import sample_batch
from runtime.sequence import Rows, Sequence, without
from runtime.speculative_step import Speculator

log = logging.getLogger("flow.engine")


class Prefill:
    def __init__(self, passes: ModelPasses, keeper: PrefixKeeper, speculator: Speculator, tally: Tally,
                 outbox: Outbox, auditor: PrefixAuditor, *, room: Callable[[], int], batch_rows: Callable[[], int],
                 between_passes: Callable[[Rows | None], None], fail: Callable[[list[Sequence], BaseException], None],
                 wake: Callable[[], None]) -> None:
        self._passes = passes
        self._keeper = keeper
        self._speculator = speculator
        self._tally = tally
        self._outbox = outbox
        self._auditor = auditor
        self._room = room  # rows the decode batch can still take (counting the ready ones)
        self._batch_rows = batch_rows  # rows decoding now
        self._between_passes = between_passes  # the engine applies the cancellations so far
        self._fail = fail
        self._wake = wake  # a tower job's end wakes the device thread
        self.waiting: deque[Sequence] = deque()
        self.towers: list[Sequence] = []  # image prompts whose vision-tower jobs run beside the steps
        self.ready: list[Rows] = []  # started, joining the batch at the end of this step

    @property
    def model(self) -> Any:
        return self._passes.model

    # ------------------------------------------------------------------ the small verbs
    def queue(self, seqs: list[Sequence]) -> None:
        self.waiting.extend(seqs)

    def take_ready(self) -> list[Rows]:
        ready, self.ready = self.ready, []
        return ready

    @property
    def ready_rows(self) -> int:
        return sum(len(r) for r in self.ready)

    @property
    def held(self) -> int:
        """Sequences accepted here but not decoding yet (waiting, at the tower, or ready to join)."""
        return len(self.waiting) + len(self.towers) + self.ready_rows

    def sequences(self) -> list[Sequence]:
        return [*self.waiting, *self.towers, *(s for r in self.ready for s in r.seqs)]

    @property
    def kv_bytes(self) -> int:
        return sum(r.nbytes for r in self.ready) + sum(
            int(c.nbytes) for seq in self.waiting if seq.cache for c in seq.cache)

    def has_work(self) -> bool:
        # A tower job that still runs is the vision worker's work, not this engine's (else that worker would
        # yield to an engine with nothing to do): its end wakes the device thread.
        return bool(self.waiting or self.ready or any(s.tower is not None and s.tower.done() for s in self.towers))

    def drop(self, cancelled: set[int], started: Rows | None = None) -> tuple[list[Sequence], int]:
        """Drop the cancelled sequences held here (also from ``started``: rows just prefilled together, about to
        run their first tokens): the waiting ones that left (their caches and hits are the caller's to free) and
        how many rows of ready and started rows went."""
        self.waiting, dropped = without(self.waiting, cancelled)
        towers, stopped = without(deque(self.towers), cancelled)
        self.towers = list(towers)
        for seq in stopped:
            if seq.tower is not None:
                self.model.worker.cancel(seq.tower)  # ends at the tower's next layer
                seq.tower = None
        gone = sum(rows.drop(cancelled) for rows in [*self.ready, *([started] if started is not None else [])])
        self.ready = [r for r in self.ready if r.seqs]
        return [*dropped, *stopped], gone

    def clear(self) -> list[Sequence]:
        """Give up everything held here (the model's group is gone); the sequences."""
        seqs = self.sequences()
        self.waiting, self.towers, self.ready = deque(), [], []
        return seqs

    # ------------------------------------------------------------------ a step's prefill
    def run(self, budget: int, pass_tokens: int) -> None:
        """Spend up to ``budget`` prompt tokens on waiting sequences, oldest first, in passes of at most
        ``pass_tokens`` (padded) tokens each; start those that are done."""
        if not self.waiting and not self.towers:
            return  # nothing to prefill: most steps of a decoding batch
        start = time.perf_counter()
        whole, spent = min(budget, pass_tokens), False
        if self.towers:
            self._take_towers()
        while True:
            # A sequence cancelled during the last pass (of any sequence) leaves before the next one: its
            # prefill stops at its next chunk boundary, also within a step that prefills several.
            self._between_passes(None)
            if not self.waiting or self._room() <= 0:
                break
            group = self._group(min(budget, pass_tokens))
            if len(group) > 1:
                budget -= self._run_group(group)
                spent = True
                continue
            seq = self.waiting[0]
            if seq.followers and self._room() < 1 + len(seq.followers) and (self._batch_rows() or self.ready):
                break  # its choices start together, when the batch has a row for each
            if self._cross_due(seq):  # its images' cross-attention states, before its first pass (even a hit's)
                budget -= self._embed_images(seq)
                continue
            if seq.to_prefill > 0:
                if budget <= 0 or (spent and seq.cache is None and budget < seq.to_prefill <= whole):
                    # A prompt that fits a step's budget whole is not split to use up this one's rest: its two
                    # chunks would be two passes of one row (each with the whole model's fixed cost), and next
                    # step it is prefilled in one, with the prompts behind it.
                    break
                n = min(budget, pass_tokens, seq.to_prefill)
                budget -= self._run_chunk(seq, self._keeper.snapshot_chunk(seq, n))
                spent = True
                continue  # next: more of this prompt (budget permitting) or its first token, unless cancelled
            self._start_head()
        self._tally.stats.prefill_seconds += time.perf_counter() - start

    def _run_group(self, group: list[Sequence]) -> int:
        """Prefill a group together and start it; the budget it took."""
        grouped = set(map(id, group))
        self.waiting = deque(s for s in self.waiting if id(s) not in grouped)
        lengths = [s.to_prefill for s in group]
        try:
            rows = self._prefill_together(group)
            self._between_passes(rows)  # a prompt whose client left during the pass gets no first token
            if rows.seqs:
                self.start(rows)
        except Exception as exc:
            log.exception("prefill failed; failing its sequences")
            self._fail(group, exc)
            return 0
        stats = self._tally.stats
        stats.prompt_tokens += sum(lengths)
        stats.prefill_chunks += 1
        stats.grouped_prefills += 1
        return len(group) * max(lengths)

    def _run_chunk(self, seq: Sequence, n: int) -> int:
        """Prefill the next ``n`` tokens of the prompt at the head of the queue on its own cache; the budget it
        took (a vision prompt whose images' features come from the cache: their tokens; from a tower job: 0)."""
        try:
            if seq.cache is None:
                seq.cache = self._keeper.new_cache(seq)
            if _tower_due(seq):
                return self._embed_images(seq)
            chunk = mx.array(seq.prompt[seq.prefilled : seq.prefilled + n])
            embeds = None if seq.embeds is None else seq.embeds[:, seq.prefilled : seq.prefilled + n]
            positions = self._passes.positions([seq], [seq.prefilled], n)
            _, hidden = self._passes.run(chunk[None], seq.cache, [seq.adapters], embeds, positions)
            self._speculator.prompt_hidden(seq, seq.prefilled, None if hidden is None else hidden[0])
            self._passes.quantize(seq.cache)
            mx.eval([c.state for c in seq.cache])
        except Exception as exc:
            log.exception("prefill failed; failing its sequence")
            self.waiting.popleft()
            self._fail([seq], exc)
            return 0
        seq.prefilled += n
        if seq.images is not None and all(span.end <= seq.prefilled for span in seq.images.spans):
            seq.embeds = None  # the rest are text tokens, embedded as tokens (the same embeddings)
        stats = self._tally.stats
        stats.prompt_tokens += n
        stats.prefill_chunks += 1
        self._keeper.keep(seq, own_slicer(seq.cache), state=own_state(seq.cache))
        return n

    def _start_head(self) -> None:
        """The head of the queue has nothing left to prefill: start it, its choices, and the prefilled ones
        right behind it, in one pass."""
        seq = self.waiting.popleft()
        choices, seq.followers = [seq, *seq.followers], []
        others = self._take_prefilled(self._room() - len(choices))
        starting = [*choices, *others]
        try:
            for other in (seq, *others):
                if other.cache is None:
                    other.cache = self._keeper.new_cache(other)  # nothing (more) to prefill
            for follower in choices[1:]:
                follower.cache, follower.prefilled = seq.cache, seq.prefilled  # merged into copies below
                if self._passes.mrope:
                    follower.rope = self._passes.rope(seq)  # the prompt's positions: its images are the leader's
                follower.cross = seq.cross  # its images' cross-attention states, shared (never written)
            self.start(Rows.merge(starting))
        except Exception as exc:
            log.exception("could not batch the sequence's cache; failing it")
            self._fail(starting, exc)

    def _take_prefilled(self, limit: int) -> list[Sequence]:
        """Up to ``limit`` more sequences from the head of the queue with nothing left to prefill (their whole
        prompt was cached, or its last chunk is done): they start in one pass with the one before them,
        not in a pass of one row each."""
        taken: list[Sequence] = []
        while self.waiting and len(taken) < limit and self.waiting[0].startable:
            taken.append(self.waiting.popleft())
        return taken

    def _group(self, budget: int) -> list[Sequence]:
        """Waiting sequences, from the head, to prefill together within ``budget`` padded tokens.

        A sequence with a prefix hit joins with the rest of its prompt (its cached positions are merged
        into the group's cache, left-padded as the decode batch is) where every layer's cache is a plain
        KV cache: requests that share a system prompt, the common case, are prefilled in one pass. A sequence with
        nothing left to prefill is passed over, not a reason to stop (it starts just after the group)."""
        group: list[Sequence] = []
        longest = 0
        room = self._room()
        for seq in self.waiting:
            n = seq.to_prefill
            if seq.startable:
                continue  # nothing to prefill (a repeat): it starts right after, and need not split the group
            if (seq.cache is not None or (seq.hit is not None and not self._hits_group) or seq.followers
                    or seq.images is not None or n < 1 or len(group) >= room):
                break
            if max(longest, n) * (len(group) + 1) > budget:
                break
            group.append(seq)
            longest = max(longest, n)
        return group

    @cached_property
    def _hits_group(self) -> bool:
        """Whether sequences with prefix hits can join a group: every layer keeps a plain KV cache (no sliding
        window, recurrent state or quantized KV, whose merge with a prefix would need more than left padding)."""
        return self._passes.quantizer is None and all(type(c) is KVCache for c in make_prompt_cache(self.model))

    def _prefill_together(self, group: list[Sequence]) -> Rows:
        """Prefill all but the last prompt token of each sequence in one right-padded forward pass (each from
        its prefix hit, if it has one)."""
        rows = Rows(list(group), merge_caches([self._keeper.new_cache(s) for s in group]))
        starts = [s.prefilled for s in group]
        lengths = [len(s.prompt) - 1 - start for s, start in zip(group, starts)]
        longest = max(lengths)
        padding = [longest - n for n in lengths]
        tokens = mx.array([s.prompt[start:-1] + [0] * p for s, start, p in zip(group, starts, padding)])
        if any(padding):
            for c in rows.cache:
                c.prepare(lengths=lengths, right_padding=padding)
        positions = self._passes.positions(group, starts, longest)
        _, hidden = self._passes.run(tokens, rows.cache, [s.adapters for s in group], positions=positions)
        if hidden is not None:
            for row, (seq, start, n) in enumerate(zip(group, starts, lengths)):
                self._speculator.prompt_hidden(seq, start, hidden[row, :n])
        if any(padding):
            for c in rows.cache:
                c.finalize()  # the padding moves to the left, where the batch expects it
        self._passes.quantize(rows.cache)
        mx.eval([c.state for c in rows.cache])
        with self._keeper.storing():  # the rows' blocks in one wait, before the pass of their last tokens
            for row, seq in enumerate(group):
                seq.prefilled = len(seq.prompt) - 1
                self._keeper.keep(seq, row_slicer(rows.cache, row), state=row_state(rows.cache, row))
        return rows

    def start(self, rows: Rows) -> None:
        """Run the rows' last prompt tokens, sample and hand out their first tokens (at once: the next group's
        prefill does not hold them); the rows that go on wait in ready for the batch."""
        seqs = rows.seqs
        last = mx.array([s.prompt[-1] for s in seqs], dtype=mx.uint32)
        positions = self._passes.positions(seqs, [len(s.prompt) - 1 for s in seqs], 1)
        logits, hidden = self._passes.run(last[:, None], rows.cache, [s.adapters for s in seqs], positions=positions)
        logits = logits[:, -1, :]
        self._passes.quantize(rows.cache)
        for i, seq in enumerate(seqs if hidden is not None else ()):
            self._speculator.prompt_hidden(seq, len(seq.prompt) - 1, hidden[i])  # type: ignore[index]
        contexts = [mx.array(s.prompt[-s.sampler.history_window :], dtype=mx.uint32) if s.sampler.processors
                    else None for s in seqs]
        sample = sample_batch(logits, [s.sampler for s in seqs], contexts)
        mx.eval(sample.tokens, *(sample.report.arrays() if sample.report else ()), [c.state for c in rows.cache])
        tokens: list[int] = sample.tokens.tolist()  # type: ignore[assignment]
        for i, (seq, token) in enumerate(zip(seqs, tokens)):
            if seq.sampler.constraint is not None:
                seq.sampler.constraint.consume(token)
            if seq.audit:  # the logits its prefix hit gave, to compare with a cold run's
                self._auditor.queue(seq.label or f"sequence {seq.handle.id}", seq.prompt, seq.handle.cached_tokens,
                                    logits[i], seq.adapters, asked=seq.policy.audit)
        logprobs: dict[Sequence, TokenLogprob] = {}
        if sample.report is not None:
            wanted = [seqs[r] for r in sample.report.rows]
            read = sample.report.read([tokens[r] for r in sample.report.rows],
                                      [s.sampler.top_logprobs or 0 for s in wanted])
            logprobs = dict(zip(wanted, read))
        now = time.perf_counter()
        stats = self._tally.stats
        keep: list[int] = []
        finished = 0
        for i, (seq, token) in enumerate(zip(seqs, tokens)):
            handed, finish = seq.emit([token])
            if handed:
                self._tally.first_token(seq.submitted_at, now)
                stats.generated_tokens += 1
            report = logprobs.get(seq) if handed else None
            self._outbox.put(seq, TokenChunk(handed, finish, (report,) if report is not None else ()))
            if finish is None:
                keep.append(i)
            else:
                finished += 1
        self._tally.finished(finished, now)
        stats.prompt_tokens += len(seqs)  # their last prompt tokens
        self._outbox.flush()  # now: the filter below reads the cache's padding (it waits for a pass in flight)
        rows.first = tokens
        rows.keep(keep)
        if rows.seqs:
            self.ready.append(rows)

    # ------------------------------------------------------------------ vision prompts
    def _embed_images(self, seq: Sequence) -> int:
        """Start the prompt's input embeddings — its images' features where they sit — kept until its image spans
        are prefilled. From the feature cache at once (charged as its image tokens' prefill); else the vision
        tower runs as a job of the model's sliced worker, beside the steps (the streams keep decoding; the prompt
        waits aside and comes back to the head of the queue when its features are ready)."""
        images = seq.images
        assert images is not None
        if self.model.features_cached(images):
            self._embedded(seq, self.model.embed_prompt(seq.prompt, images))
            if seq.embeds is not None:
                mx.eval(seq.embeds)
            return sum(span.end - span.start for span in images.spans)
        prompt = seq.prompt
        seq.tower = self.model.worker.submit(lambda: self.model.embed_prompt(prompt, images))
        seq.tower.add_done_callback(lambda _: self._wake())
        self.waiting.popleft()
        self.towers.append(seq)
        return 0

    def _take_towers(self) -> None:
        """Image prompts whose tower jobs ended go back to the head of the queue (or fail)."""
        done = [s for s in self.towers if s.tower is not None and s.tower.done()]
        for seq in reversed(done):
            self.towers.remove(seq)
            tower, seq.tower = seq.tower, None
            assert tower is not None
            try:
                self._embedded(seq, tower.result())
            except Exception as exc:
                log.exception("vision tower failed; failing its sequence")
                self._fail([seq], exc)
                continue
            self.waiting.appendleft(seq)


    @staticmethod
    def _embedded(seq: Sequence, made: mx.array | CrossStates) -> None:
        """What the model made of a prompt's images: its input embeddings, or its row's cross-attention states."""
        if isinstance(made, CrossStates):
            seq.cross = made
        else:
            seq.embeds = made

    def _cross_due(self, seq: Sequence) -> bool:
        """A cross-attention model's image prompt whose row has no cross-attention states yet (a prefix hit or not:
        every pass of the row reads them)."""
        return seq.images is not None and seq.cross is None and self._passes.cross


def _tower_due(seq: Sequence) -> bool:
    """A prompt with an image span left to prefill (not covered by a prefix hit) and no embeddings yet."""
    return (seq.images is not None and seq.embeds is None and seq.cross is None
            and any(span.end > seq.prefilled for span in seq.images.spans))
