"""The generation engine of one model: a step loop over active sequences.

Theory of operation
-------------------
Trio code calls :meth:`Engine.submit`, which queues a sequence and returns a
:class:`SequenceHandle` whose ``chunks`` channel yields :class:`TokenChunk`
items. Everything else happens on the device thread, in :meth:`Engine.step`:

1. take newly submitted and cancelled sequences (a cancelled sequence leaves
   here, within one step, and its KV cache is dropped);
2. **decode**: for every decoding sequence, build the graph for its next token
   from its *pending* token (sampled last step, possibly still computing), start
   evaluating all of them at once (``mx.async_eval``), then read the pending
   tokens — the same pipelining as ``mlx_lm.generate_step``, so the device
   computes step *n+1* while Python handles step *n*;
3. **prefill**: spend up to ``prefill_chunk`` prompt tokens on waiting
   sequences, oldest first; a sequence whose prompt is in cache samples its
   first token and joins the decoders;
4. hand every sequence's new tokens to trio in **one** crossing per step.

The scheduler (which sequences decode, how the prefill budget is spent) is the
part the continuous-batching issue replaces with batched forward passes; the
handle/step/deliver contract stays. A sequence may also start with its first N
prompt tokens already in a KV cache (``Sequence.prefilled``), which is how a
prefix cache plugs in.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx
import trio
from mlx_lm.models.cache import make_prompt_cache

from protocols.ir import FinishReason, SamplingParams, TokenChunk, TokenLogprob
from runtime.device import DeviceThread
from runtime.sampling import SequenceSampler

log = logging.getLogger("flow.engine")


@dataclass(frozen=True)
class EngineConfig:
    max_batch: int = 32
    prefill_chunk: int = 512


class SequenceHandle:
    """The trio side of one sequence."""

    def __init__(self, engine: Engine, seq_id: int, send: trio.MemorySendChannel[TokenChunk],
                 receive: trio.MemoryReceiveChannel[TokenChunk]) -> None:
        self.engine = engine
        self.id = seq_id
        self.chunks = receive
        self._send = send
        self.error: BaseException | None = None
        self.finished = False

    def cancel(self) -> None:
        """Ask the engine to drop this sequence at its next step (idempotent)."""
        if not self.finished:
            self.finished = True
            self.engine._cancel(self.id)

    async def __aenter__(self) -> SequenceHandle:
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.cancel()
        self.chunks.close()


@dataclass(eq=False)
class _Sequence:
    handle: SequenceHandle
    token: trio.lowlevel.TrioToken
    prompt: list[int]
    max_tokens: int
    stop_ids: frozenset[int]
    sampler: SequenceSampler
    prefilled: int = 0
    cache: list[Any] = field(default_factory=list)
    pending: mx.array | None = None
    pending_logprobs: mx.array | None = None
    generated: int = 0
    history: list[int] = field(default_factory=list)
    submitted_at: float = field(default_factory=time.perf_counter)


@dataclass
class EngineStats:
    submitted: int = 0
    finished: int = 0
    cancelled: int = 0
    failed: int = 0
    prompt_tokens: int = 0
    generated_tokens: int = 0
    steps: int = 0
    decode_seconds: float = 0.0
    prefill_seconds: float = 0.0


class Engine:
    """Runs sequences of one model on the device thread."""

    def __init__(self, model: Any, device: DeviceThread, config: EngineConfig = EngineConfig()) -> None:
        self.model = model
        self.device = device
        self.config = config
        self.stats = EngineStats()
        self._ids = itertools.count(1)
        self._lock = threading.Lock()
        self._inbox: deque[_Sequence] = deque()
        self._cancelled: set[int] = set()
        # Device-thread state:
        self._waiting: deque[_Sequence] = deque()
        self._decoding: list[_Sequence] = []
        device.add_stepper(self)

    # ------------------------------------------------------------------ trio side
    def submit(self, prompt: list[int], *, max_tokens: int, stop_ids: frozenset[int],
               sampling: SamplingParams) -> SequenceHandle:
        if not prompt:
            raise ValueError("a sequence needs at least one prompt token")
        send, receive = trio.open_memory_channel[TokenChunk](float("inf"))
        handle = SequenceHandle(self, next(self._ids), send, receive)
        seq = _Sequence(handle=handle, token=trio.lowlevel.current_trio_token(), prompt=list(prompt),
                        max_tokens=max_tokens, stop_ids=stop_ids, sampler=SequenceSampler(sampling))
        with self._lock:
            self._inbox.append(seq)
            self.stats.submitted += 1
        self.device.wake()
        return handle

    def _cancel(self, seq_id: int) -> None:
        with self._lock:
            self._cancelled.add(seq_id)
        self.device.wake()

    @property
    def active(self) -> int:
        return len(self._decoding)

    @property
    def waiting(self) -> int:
        return len(self._waiting) + len(self._inbox)

    def close(self) -> None:
        self.device.remove_stepper(self)

    # ------------------------------------------------------------------ device side
    def has_work(self) -> bool:
        return bool(self._inbox or self._waiting or self._decoding or self._cancelled)

    def step(self) -> None:
        self._take_inbox()
        out: list[tuple[_Sequence, TokenChunk]] = []
        try:
            if self._decoding:
                self._decode(out)
            if self._waiting and len(self._decoding) < self.config.max_batch:
                self._prefill()
        except Exception as exc:
            log.exception("engine step failed; failing its sequences")
            self._fail_all(exc)
        self.stats.steps += 1
        if self.stats.steps % 256 == 0:
            mx.clear_cache()
        self._deliver(out)

    def _take_inbox(self) -> None:
        with self._lock:
            self._waiting.extend(self._inbox)
            self._inbox.clear()
            cancelled, self._cancelled = self._cancelled, set()
        if cancelled:
            before = len(self._waiting) + len(self._decoding)
            self._waiting = deque(s for s in self._waiting if s.handle.id not in cancelled)
            self._decoding = [s for s in self._decoding if s.handle.id not in cancelled]
            self.stats.cancelled += before - len(self._waiting) - len(self._decoding)

    def _forward(self, seq: _Sequence, tokens: mx.array) -> mx.array:
        logits: mx.array = self.model(tokens[None], cache=seq.cache)
        return logits

    def _sample(self, seq: _Sequence, logits: mx.array) -> tuple[mx.array, mx.array]:
        return seq.sampler(logits[:, -1, :], seq.history)

    def _decode(self, out: list[tuple[_Sequence, TokenChunk]]) -> None:
        start = time.perf_counter()
        upcoming: list[tuple[mx.array, mx.array] | None] = []
        for seq in self._decoding:
            assert seq.pending is not None
            if seq.generated + 1 < seq.max_tokens:
                upcoming.append(self._sample(seq, self._forward(seq, seq.pending)))
            else:
                upcoming.append(None)
        mx.async_eval([u[0] for u in upcoming if u is not None])  # type: ignore[no-untyped-call]
        still: list[_Sequence] = []
        for seq, nxt in zip(self._decoding, upcoming):
            assert seq.pending is not None
            token = int(seq.pending.item())  # type: ignore[arg-type]
            finish: FinishReason | None = None
            tokens: tuple[int, ...] = ()
            logprobs: tuple[TokenLogprob, ...] = ()
            if token in seq.stop_ids:
                finish = "stop"
            else:
                tokens = (token,)
                if seq.pending_logprobs is not None:
                    logprobs = (seq.sampler.report(token, seq.pending_logprobs),)
                seq.generated += 1
                if seq.sampler.processors:
                    seq.history.append(token)
                if seq.generated >= seq.max_tokens:
                    finish = "length"
            out.append((seq, TokenChunk(tokens, finish, logprobs)))
            if finish is None:
                assert nxt is not None  # computed above: the sequence had room for another token
                self._set_pending(seq, nxt)
                still.append(seq)
            else:
                self._finish(seq)
        self._decoding = still
        self.stats.generated_tokens += sum(len(c.token_ids) for _, c in out)
        self.stats.decode_seconds += time.perf_counter() - start

    def _prefill(self) -> None:
        start = time.perf_counter()
        budget = self.config.prefill_chunk
        while self._waiting and budget > 0 and len(self._decoding) < self.config.max_batch:
            seq = self._waiting[0]
            if not seq.cache:
                seq.cache = make_prompt_cache(self.model)
                if seq.sampler.processors:
                    seq.history = list(seq.prompt)
            # Everything but the last prompt token goes through plain prefill, in
            # chunks; the last token's forward pass samples the first new token.
            remaining = len(seq.prompt) - 1 - seq.prefilled
            if remaining > 0:
                n = min(budget, remaining)
                chunk = mx.array(seq.prompt[seq.prefilled : seq.prefilled + n])
                self._forward(seq, chunk)
                mx.eval([c.state for c in seq.cache])
                seq.prefilled += n
                budget -= n
                self.stats.prompt_tokens += n
                continue
            last = mx.array(seq.prompt[-1:])
            self._set_pending(seq, self._sample(seq, self._forward(seq, last)))
            mx.async_eval(seq.pending)  # type: ignore[no-untyped-call]
            self.stats.prompt_tokens += 1
            budget -= 1
            self._waiting.popleft()
            self._decoding.append(seq)
        self.stats.prefill_seconds += time.perf_counter() - start

    @staticmethod
    def _set_pending(seq: _Sequence, sampled: tuple[mx.array, mx.array]) -> None:
        seq.pending = sampled[0]
        # Keep the distribution only for requests that asked for logprobs.
        seq.pending_logprobs = sampled[1] if seq.sampler.params.logprobs is not None else None

    def _finish(self, seq: _Sequence) -> None:
        seq.cache = []
        seq.pending = seq.pending_logprobs = None
        self.stats.finished += 1

    def _fail_all(self, exc: BaseException) -> None:
        failed = list(self._waiting) + self._decoding
        self._waiting.clear()
        self._decoding = []
        self.stats.failed += len(failed)
        for seq in failed:
            seq.handle.error = exc
            seq.cache = []
        by_token: dict[trio.lowlevel.TrioToken, list[_Sequence]] = {}
        for seq in failed:
            by_token.setdefault(seq.token, []).append(seq)
        for token, seqs in by_token.items():
            _run_in_trio(token, _close_all, [s.handle for s in seqs])

    def _deliver(self, out: list[tuple[_Sequence, TokenChunk]]) -> None:
        if not out:
            return
        by_token: dict[trio.lowlevel.TrioToken, list[tuple[SequenceHandle, TokenChunk]]] = {}
        for seq, chunk in out:
            by_token.setdefault(seq.token, []).append((seq.handle, chunk))
        for token, items in by_token.items():
            _run_in_trio(token, _send_all, items)


def _run_in_trio(token: trio.lowlevel.TrioToken, fn: Any, arg: Any) -> None:
    try:
        token.run_sync_soon(fn, arg)
    except trio.RunFinishedError:
        pass  # the server's trio run is gone; nobody is listening


def _send_all(items: list[tuple[SequenceHandle, TokenChunk]]) -> None:
    """Runs in trio: one call per engine step delivers every sequence's chunk."""
    for handle, chunk in items:
        try:
            handle._send.send_nowait(chunk)
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            handle.cancel()  # the reader went away: drop the sequence
            continue
        if chunk.finish_reason is not None:
            handle.finished = True
            handle._send.close()


def _close_all(handles: list[SequenceHandle]) -> None:
    for handle in handles:
        handle.finished = True
        handle._send.close()
