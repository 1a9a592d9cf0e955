"""The decode batch's step: one forward pass for every row, and the tokens each row hands out.

Each step runs **one** pass with one input token per row — or, when drafts are worth verifying, the speculator's
verify pass (``runtime/speculative_step.py``) — samples every row (:func:`runtime.sampling.sample_batch`,
per-sequence parameters and keys), and reads the *previous* step's tokens (one ``tolist()`` for the batch): the
inputs of this pass are the tokens sampled last step. On a GPU the pass is launched before the read, so the
device computes step *n+1* while Python hands out step *n* (the pipelining of ``mlx_lm.generate_step``, for the
whole batch). On the CPU ``async_eval`` computes most of the pass before returning: while a prompt waits, the
pass is left in :attr:`Decoded.launch` for the engine's launch phase, after the step's prefill (the new
arrival's first token does not wait for the batch's pass); otherwise (``early``) it is launched before the read
too, as mlx-lm does — reading first left the device idle between the end of one pass and the start of the next
(5 % of a step on an 80M model). A row whose input is its first token ("fresh") hands nothing out: that token
went out when it was sampled. A finished row's extra token is dropped with its row.

:meth:`Decoder.step` returns what the step decided (:class:`runtime.sequence.Decoded`); the engine's deliver
phase hands the chunks out. Never imports the engine or trio.
"""

from __future__ import annotations

import time

import mlx.core as mx

from protocols.ir import TokenChunk, TokenLogprob
from runtime.cache_surgery import LoneRowViews
from runtime.engine_stats import Tally
from runtime.mtp import MTPDraftState
from runtime.outbox import UNHELD_TOKENS
from runtime.pass_cost import PassCost
from runtime.passes import ModelPasses
from runtime.prefix_keeper import PrefixKeeper
from runtime.sampling import sample_batch
from runtime.sequence import DecodeBatch, Decoded, Sequence
from runtime.speculative_step import Speculator


class Decoder:
    def __init__(self, passes: ModelPasses, speculator: Speculator, keeper: PrefixKeeper, tally: Tally,
                 step_cost: PassCost, pipelined: bool) -> None:
        self._passes = passes
        self._speculator = speculator
        self._keeper = keeper
        self._tally = tally
        self._step_cost = step_cost  # decode passes' seconds by the tokens they hold (speculation's cost fit)
        self._speculating = speculator.config.kind != "off"
        self._pipelined = pipelined  # a GPU: launch the pass before reading the last step's tokens
        self._lone = LoneRowViews()  # a batch of one row runs on single-sequence cache views

    def step(self, batch: DecodeBatch, early: bool = False) -> Decoded:
        """Decode one step of the batch; the rows that finished leave it (their extra token with them). ``early``:
        on the CPU too, launch the pass before reading the last step's tokens (no prompt waits for the device)."""
        start = time.perf_counter()
        drafts = self._speculator.drafts(batch) if self._speculating else None
        decoded = self._speculator.verify(batch, *drafts) if drafts is not None else self._plain(batch, early)
        now = time.perf_counter()
        self._tally.finished(len(decoded.finished), now)
        self._keeper.keep_finished(batch, decoded.finished)  # read from their rows before the rows go
        batch.inputs = decoded.inputs
        batch.report = (list(batch.seqs), decoded.report) if decoded.report else None
        batch.keep_later(decoded.keep)  # the finished rows leave once the step's tokens went out (settle)
        stats = self._tally.stats
        stats.generated_tokens += decoded.emitted
        stats.decode_steps += 1
        stats.decode_seconds += time.perf_counter() - start
        return decoded

    def launch(self, arrays: list[mx.array]) -> None:
        """Compute a pass :meth:`step` left to launch (CPU), counted as decode time."""
        if arrays:
            self._tally.stats.decode_seconds += self._compute(arrays)

    def _compute(self, arrays: list[mx.array]) -> float:
        """The CPU: compute a decode pass (most of it, before ``async_eval`` returns); its seconds."""
        start = time.perf_counter()
        mx.async_eval(*arrays)  # type: ignore[no-untyped-call]
        seconds = time.perf_counter() - start
        if self._speculating:  # the fit only speculation reads
            self._step_cost.add(int(arrays[0].shape[0]), seconds)
        return seconds

    def _plain(self, batch: DecodeBatch, early: bool) -> Decoded:
        inputs = batch.inputs
        assert inputs is not None
        # An input's index is its row's prompt and the tokens fed back before it (M-RoPE models' positions).
        positions = self._passes.decode_positions(batch.seqs, 1)
        lone = self._lone.views(batch.cache, len(batch.seqs), batch.layout)
        logits, hidden = self._passes.run(inputs[:, None], lone or batch.cache, (s.adapters for s in batch.seqs),
                                          positions=positions)
        if lone is not None:
            self._lone.done(batch.cache, lone)
        logits = logits[:, -1, :]
        self._passes.quantize(batch.cache)
        contexts: list[mx.array | None] = []
        for i, seq in enumerate(batch.seqs):
            if not seq.sampler.processors:
                contexts.append(None)
                continue
            recent = seq.history[-(seq.sampler.history_window - 1):] if seq.sampler.history_window > 1 else []
            current = inputs[i : i + 1]
            contexts.append(mx.concatenate([mx.array(recent, dtype=mx.uint32), current]) if recent else current)
        values: list[int] | None = None
        if any(s.sampler.constraint is not None for s in batch.seqs):
            # A grammar's mask for this step depends on the token sampled last step: read it first (the
            # device waits for Python here; batches without constrained rows keep the overlap).
            values = inputs.tolist()  # type: ignore[assignment]
            assert values is not None
            for i, seq in enumerate(batch.seqs):
                if seq.sampler.constraint is not None and not seq.fresh:  # fresh: consumed when sampled
                    seq.sampler.constraint.consume(values[i])
        sample = sample_batch(logits, [s.sampler for s in batch.seqs], contexts)
        launch = [sample.tokens, *(sample.report.arrays() if sample.report else ())]
        if hidden is not None:
            launch.append(hidden)  # the MTP layers draft from it: computed with the step
        if self._pipelined:
            # The device computes this step while Python reads and hands out the last one.
            mx.async_eval(*launch)  # type: ignore[no-untyped-call]
        elif early:
            self._compute(launch)  # the CPU: this pass now, the last one's tokens after it
        if values is None:
            values = inputs.tolist()  # type: ignore[assignment]
            assert values is not None
        logprobs = _read_report(batch, values)
        decoded = Decoded([], [], [], sample.tokens, sample.report,
                          launch=[] if self._pipelined or early else launch)
        now = time.perf_counter()
        # Every row, every step: what is looked up once is bound once (a few microseconds a row add up at 64).
        chunks, keep, finished = decoded.chunks, decoded.keep, decoded.finished
        emitted = 0
        for i, (seq, token) in enumerate(zip(batch.seqs, values)):
            if hidden is not None and isinstance(seq.draft, MTPDraftState):
                seq.draft.observe(len(seq.prompt) + len(seq.fed), hidden[i])
            seq.fed.append(token)
            sampler = seq.sampler
            if sampler.processors:
                seq.history.append(token)
                if len(seq.history) > 4 * sampler.history_window:
                    del seq.history[: -sampler.history_window]
            if seq.fresh:
                seq.fresh = False  # its input was its first token, handed out when it was sampled
                keep.append(i)
                continue
            first = seq.generated == 0
            tokens, finish = seq.emit_one(token)
            if tokens:
                emitted += 1
                if seq.generated <= UNHELD_TOKENS:
                    decoded.started = True  # they go out at once (runtime/outbox.py)
                    if first:
                        self._tally.first_token(seq.submitted_at, now)
                report = logprobs.get(seq) if logprobs else None
                chunks.append((seq, TokenChunk(tokens, finish, (report,) if report is not None else ())))
            else:
                chunks.append((seq, TokenChunk(tokens, finish)))
            (keep if finish is None else finished).append(i)
        decoded.emitted += emitted
        return decoded


def _read_report(batch: DecodeBatch, values: list[int]) -> dict[Sequence, TokenLogprob]:
    """Logprob figures for this step's inputs, by sequence."""
    if batch.report is None:
        return {}
    seqs, report = batch.report
    row_of = {s: i for i, s in enumerate(batch.seqs)}
    wanted = [seqs[r] for r in report.rows]  # rows of the batch as it was when it sampled
    tokens = [values[row_of[s]] if s in row_of else 0 for s in wanted]
    read = report.read(tokens, [s.sampler.top_logprobs or 0 for s in wanted])
    return {s: lp for s, lp in zip(wanted, read) if s in row_of}
