"""Embedding models on the device thread: loading (mlx-embeddings) and the batching embedder.

Theory of operation
-------------------
An :class:`Embedder` is a stepper of the device thread (like a text engine).
Requests hand it their inputs as token-id lists (:meth:`Embedder.submit`, from
any thread) and wait on a future for their vectors. Each step builds one
forward pass from the inputs waiting:

* when nobody else waits or has asked in the last second, what waits goes in
  *solo* passes — at most ``pass_tokens`` padded tokens (inputs × longest
  input) and at most ``SOLO_PASS_SECONDS`` of device time (measured on the
  passes so far): efficient, and nobody is behind them;
* when many small requests wait and none is large (more than one short pass),
  solo passes too: short passes would only slow them all;
* otherwise (a large job and others) a pass holds what the device computes in
  ``pass_seconds``, and the requests such a pass can finish — the one-sentence requests behind a
  2,000-input job — get a pass of their own before the large job goes on (never
  two such passes in a row, so a stream of small requests cannot starve the
  large one). Other passes take inputs **round-robin across requests**, one from
  each in turn, the request served longest ago first — across the large jobs
  only where the model can be preempted: the requests a short pass can finish
  are then served between the large pass's pieces (below), not at its end.

A pass holding a large job's inputs is computed piece by piece (its repeated blocks and their parts — a BERT
layer's attention and feed-forward — checkpointed, as a sliced job's are: :mod:`runtime.sliced_jobs`), and between
two pieces the waiting requests a short pass can finish get that pass at once (*preemption*): a one-sentence query
waits for a part of one layer of a 2,000-input job's pass, not for the whole pass. What such passes take is paced
by the large pass's own time so far (``PREEMPTION_SHARE``), so the large job still gets a third of the device or
more. (The model holds the
embedder through its checkpoints: unloading drops ``model``.)

A request's inputs are queued shortest first, so its passes waste little padding; and a pass's inputs are
split into forward passes of similar lengths where one more pass's fixed cost (measured at load on the idle
device) is less than the padding it saves (:func:`length_groups`): a one-sentence query that shares a pass
with 200-token documents is computed as its own few tokens.

Inputs are padded on the right with an attention mask: BERT-style encoders
mean-pool over the mask and decoder-style embedders take the last unmasked
token, so an input's vector is the same alone or packed with longer ones
(left padding would shift a decoder's positions). mlx-embeddings' models pool
and L2-normalise inside (``text_embeds``).
"""

from __future__ import annotations

import concurrent.futures
import json
import logging
import math
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any


import numpy as np

from runtime.device import DeviceThread, JobQueue
from runtime.embedding_profile import EmbeddingProfile, Pooling, ProfileError, read_profile
from runtime.errors import ModelNotAvailable
from runtime.pass_cost import PassCost, idle_pass_cost
from runtime.sliced_jobs import checkpoint_children, repeated_blocks, with_checkpoint

log = logging.getLogger("flow.embeddings")

# A large job alone gets full passes, unless another request arrived behind work this recently: an interactive
# client sends its next request soon after its last answer, and should not wait for a full pass then.
CONTENTION_SECONDS = 1.0
# A pass nobody waits behind may last this long: long enough to batch efficiently (on a CPU a pass's fixed cost
# is tens of milliseconds), short enough that a request arriving during it is not kept long. It does not follow
# pass_seconds, which bounds the passes a waiting request sits behind.
SOLO_PASS_SECONDS = 1.0
# Gathering: while requests stream in, a pass waits for more up to one pass's fixed cost (at most this long),
# polling the queue this often; enough waiting requests end the wait at once.
GATHER_MAX_SECONDS = 0.05
GATHER_POLL_SECONDS = 0.002
GATHER_MAX_REQUESTS = 64
# The passes run between a large pass's pieces may take up to this many times what the large pass itself computed.
# On a CPU a one-input pass costs 10-14 ms (skinny matrix products), and a client asking back to back wants one
# every 17 ms or so: at 1 (half the device each) a tenth of its requests waited for the large pass to end, and its
# p95 beside a 2,048-input job was 45-97 ms against 20 ms idle; at 2 it was 36 ms, the job going on at a third of
# the device. A client that asks every so often leaves the job most of the device either way.
PREEMPTION_SHARE = 2.0


@dataclass
class _Job:
    """One request's inputs: ``order`` is the queue (indices, shortest input first), ``out`` its rows."""

    inputs: list[list[int]]
    future: concurrent.futures.Future[np.ndarray]
    order: deque[int]
    out: np.ndarray
    left: int
    submitted: float = 0.0  # monotonic seconds
    longest: int = 0  # its longest input's tokens
    served: int = -1  # the last pass it had inputs in (round-robin starts with the longest unserved)


Readout = Callable[[Any, Any], Any]  # (model output, attention mask) → (n, dims) mx.array


def _large(job: _Job, budget: int) -> bool:
    """Whether all of a request's inputs take more than ``budget`` padded tokens (more than one short pass)."""
    return job.longest * len(job.inputs) > budget


def _padded(job: _Job) -> int:
    """The padded tokens a request's remaining inputs take in one pass."""
    return max(len(job.inputs[i]) for i in job.order) * len(job.order)


def length_groups(lengths: list[int], overhead: float, per_token: float) -> list[slice]:
    """Split a pass's inputs (``lengths`` sorted ascending) into forward passes of similar lengths where that
    costs less: each pass pads to its longest input, and costs ``overhead + per_token × padded tokens`` (the
    fitted :class:`PassCost`). A one-sentence query packed with a 200-token document would otherwise be computed
    as 200 tokens. Optimal over the cut points between distinct lengths (dynamic programming); one pass while
    the overhead is unknown."""
    if overhead <= 0 or len(lengths) < 2 or lengths[0] == lengths[-1]:
        return [slice(0, len(lengths))]
    ends = [i + 1 for i in range(len(lengths)) if i + 1 == len(lengths) or lengths[i + 1] != lengths[i]]
    best = [0.0] + [math.inf] * len(ends)  # best[j]: cost of the inputs before ends[j - 1]
    cut = [0] * (len(ends) + 1)
    for j, end in enumerate(ends, start=1):
        for k in range(j):
            start = ends[k - 1] if k else 0
            cost = best[k] + overhead + per_token * (end - start) * lengths[end - 1]
            if cost < best[j]:
                best[j], cut[j] = cost, k
    groups: list[slice] = []
    j = len(ends)
    while j:
        k = cut[j]
        groups.append(slice(ends[k - 1] if k else 0, ends[j - 1]))
        j = k
    return groups[::-1]


class EmbedderClosed(Exception):
    """The model was unloaded while the request waited."""


class Embedder(JobQueue[_Job]):
    """Packs waiting inputs of all requests into shared forward passes (see the module docstring)."""

    def __init__(self, model: Any, device: DeviceThread, pad_id: int, dims: int, pass_tokens: int,
                 pass_seconds: float = 0.1, readout: Readout | None = None,
                 idle_cost: tuple[float, float] | None = None) -> None:
        self.model = model
        self.readout = readout or builtin_vectors
        super().__init__(device)
        self.pad_id = pad_id
        self.dims = dims
        self.pass_tokens = pass_tokens
        self.pass_seconds = pass_seconds
        self.cost = PassCost(idle=idle_cost)  # measured at load (idle_cost) and on the passes so far
        self._arrivals: deque[tuple[float, int]] = deque(maxlen=8)  # (monotonic time, id of the job) of recent ones
        self._last_pass_finishing = False  # the last pass served only newcomers: the next one is round-robin
        # preemption: the pass under way serves newcomers between its blocks, for at most this many seconds more
        self._preempting = False
        self._preemption_allowance = 0.0
        self._pass_started = 0.0  # perf_counter when the preemptible pass under way began
        self._pass_preempted = 0.0  # device time of the passes run between its pieces so far
        self._preemption_seconds = 0.0  # device time of the passes run between blocks, all told
        self.preemptions = 0
        self.passes = 0
        self.inputs = 0
        self.tokens = 0
        self.padded_tokens = 0
        blocks = repeated_blocks(model)
        for block in blocks:
            with_checkpoint(block, self._between_blocks, evaluate=lambda: self._preempting)
            # and its parts (a BERT layer's attention, feed-forward in and out): a newcomer waits for a part of a
            # layer, not a whole one
            checkpoint_children(block, self._between_blocks, depth=1, evaluate=lambda: self._preempting)
        self.blocks = len(blocks)
        device.add_stepper(self)

    def submit(self, inputs: list[list[int]]) -> concurrent.futures.Future[np.ndarray]:
        """Queue one request's inputs (non-empty token-id lists); the future gets a (len, dims) float32 array."""
        future: concurrent.futures.Future[np.ndarray] = concurrent.futures.Future()
        job = _Job(inputs, future, deque(sorted(range(len(inputs)), key=lambda i: len(inputs[i]))),
                   np.empty((len(inputs), self.dims), dtype=np.float32), len(inputs))
        job.submitted = time.monotonic()
        job.longest = max(len(tokens) for tokens in inputs)
        with self._lock:
            self._arrivals.append((job.submitted, id(job)))
            self._jobs.append(job)
        self.device.wake()
        return future

    def _next_pass(self) -> list[tuple[_Job, int]]:
        """Inputs for one pass (see the module docstring): a solo pass when nobody waits behind it, or when no
        waiting request is large; else a short pass, given to the requests it can finish — newcomers behind a
        large job — before the large job goes on."""
        with self._lock:
            ring = [job for job in self._jobs if not job.future.cancelled()]
            self._jobs = deque(ring)
            waiting = [len(job.inputs[i]) for job in ring for i in job.order]
            if not waiting:
                return []
            solo = self.budget(SOLO_PASS_SECONDS)
            if not self._contended(ring):
                return self._take(ring, solo)  # nobody waits behind this pass: make it efficient
            budget = self.budget(self.pass_seconds)
            # a pass that holds a large job is preemptible: the requests a short pass can finish stay out of it and
            # are served between its pieces, not at its end
            apart = [job for job in ring if _large(job, budget)] if self.blocks > 1 else []
            if not 0 < len(apart) < len(ring):
                apart = ring
            # not one solo pass because all that waits fits in one: a large job's last inputs would make a pass
            # of up to SOLO_PASS_SECONDS, and a newcomer would wait for one of its (long) blocks
            if not any(_padded(job) > budget for job in ring):
                return self._take(apart, solo)  # many small requests and no large job: short passes would only slow all
            if not self._last_pass_finishing:
                finishing = self._finishing(ring, budget)
                if finishing and len(finishing) < len(ring):
                    self._last_pass_finishing = True
                    return self._take(finishing, budget)
            self._last_pass_finishing = False
            return self._take(apart, budget)

    def _gathering(self) -> bool:
        """Wait before a pass while requests stream in (another arrived just before the newest waiting one) and
        the newest has waited less than one pass's fixed cost: on a CPU a pass of one input costs nearly what
        a pass of ten does, and 64 clients' requests reach the device one by one through the HTTP server. A
        lone request never waits."""
        with self._lock:
            fresh = [job for job in self._jobs if job.served < 0 and not job.future.cancelled()]
            if len(fresh) < 2 or len(fresh) == len(self._jobs) and len(fresh) >= GATHER_MAX_REQUESTS:
                return False
            waited = time.monotonic() - min(job.submitted for job in fresh)
            waiting = sum(_padded(job) for job in self._jobs)
        window = min(GATHER_MAX_SECONDS, self.cost.fit()[0]) if self.cost.passes else 0.0
        return waited < window and waiting < self.budget(SOLO_PASS_SECONDS)

    def _contended(self, ring: list[_Job]) -> bool:
        """Other requests wait, or arrived lately (an interactive client sends its next one soon after its last
        answer)."""
        if len(ring) > 1:
            return True
        alone, now = id(ring[0]), time.monotonic()
        return any(now - at < CONTENTION_SECONDS for at, job in self._arrivals if job != alone)

    @staticmethod
    def _finishing(ring: list[_Job], budget: int) -> list[_Job]:
        """The requests that one pass within ``budget`` padded tokens can finish, fewest inputs first."""
        chosen: list[_Job] = []
        count, longest = 0, 0
        for job in sorted(ring, key=lambda j: len(j.order)):
            job_longest = max(len(job.inputs[i]) for i in job.order)
            if max(longest, job_longest) * (count + len(job.order)) > budget:
                break
            chosen.append(job)
            count, longest = count + len(job.order), max(longest, job_longest)
        return chosen

    def _take(self, ring: list[_Job], budget: int) -> list[tuple[_Job, int]]:
        """Inputs round-robin over ``ring`` — the requests served longest ago first, one input each in turn
        (each request's shortest first) — until the padded size would pass ``budget``; finished requests leave
        the queue. Called with the lock held."""
        chosen: list[tuple[_Job, int]] = []
        longest = 0
        ring = sorted(ring, key=lambda job: job.served)
        while ring:
            for job in list(ring):
                index = job.order[0]
                length = max(longest, len(job.inputs[index]))
                if chosen and length * (len(chosen) + 1) > budget:
                    return chosen
                job.order.popleft()
                job.served = self.passes
                chosen.append((job, index))
                longest = length
                if not job.order:
                    ring.remove(job)
                    self._jobs.remove(job)
        return chosen

    def budget(self, seconds: float) -> int:
        """Padded tokens the device computes in ``seconds`` (measured on the passes so far), at most
        ``pass_tokens``; and at least what a pass of twice the fixed cost holds: a shorter pass would spend most
        of its time on that cost (a large model on a CPU: a one-input pass may take longer than ``pass_seconds``)."""
        if not self.cost.passes:
            return self.pass_tokens
        tokens = self.cost.tokens_within(max(seconds, 2 * self.cost.fit()[0])) or 1
        return max(1, min(self.pass_tokens, tokens))

    def step(self) -> None:
        if self._gathering():
            time.sleep(GATHER_POLL_SECONDS)  # requests are streaming in: let a few more join this pass
            return
        chosen = self._next_pass()
        if not chosen:
            return
        budget = self.budget(self.pass_seconds)
        if self.blocks > 1 and any(_large(job, budget) for job, _ in chosen):
            overhead, per_token = self.cost.fit()
            padded = max(len(job.inputs[i]) for job, i in chosen) * len(chosen)
            self._preemption_allowance = PREEMPTION_SHARE * max(self.pass_seconds, overhead + per_token * padded)
            self._pass_started, self._pass_preempted = time.perf_counter(), 0.0
            self._preempting = True
        try:
            self._run(chosen)
        finally:
            self._preempting = False

    def _run(self, chosen: list[tuple[_Job, int]]) -> None:
        """``chosen``'s forward passes: split by length where that pays (:func:`length_groups`)."""
        chosen.sort(key=lambda pick: len(pick[0].inputs[pick[1]]))
        for group in length_groups([len(job.inputs[i]) for job, i in chosen], *self.cost.fit()):
            self._forward(chosen[group])

    def _between_blocks(self) -> None:
        """Before each block of a pass (the blocks before it computed already, see :func:`with_checkpoint`): while
        a large job's pass is under way, give the waiting requests a short pass can finish — the one-sentence
        requests that arrived during it — that pass now."""
        if not self._preempting or self._preemption_allowance <= 0:
            return
        # Paced: what the passes between pieces took stays within PREEMPTION_SHARE times what the large pass
        # itself has computed so far, plus one short pass's fixed cost. A client asking back to back then gets a
        # pass at nearly every piece, the large job going on in between, instead of every piece until the
        # allowance is spent and then nothing until the large pass ends.
        own = time.perf_counter() - self._pass_started - self._pass_preempted
        if self._pass_preempted > PREEMPTION_SHARE * own + self.cost.fit()[0]:
            return
        with self._lock:
            budget = self.budget(self.pass_seconds)
            ring = [job for job in self._jobs if job.order and not job.future.cancelled() and not _large(job, budget)]
            chosen = self._take(self._finishing(ring, budget), budget) if ring else []
        if not chosen:
            return
        self._preempting = False  # no preemption inside the preempting pass
        started = time.perf_counter()
        try:
            self._run(chosen)
        finally:
            seconds = time.perf_counter() - started
            self._preemption_seconds += seconds
            self._preemption_allowance -= seconds
            self._pass_preempted += seconds
            self._preempting = True
        self.preemptions += 1

    def _forward(self, chosen: list[tuple[_Job, int]]) -> None:
        """One forward pass over ``chosen`` (right-padded to the longest), its vectors delivered."""
        import mlx.core as mx

        longest = max(len(job.inputs[i]) for job, i in chosen)
        ids = np.full((len(chosen), longest), self.pad_id, dtype=np.int32)
        mask = np.zeros((len(chosen), longest), dtype=np.int32)
        for row, (job, i) in enumerate(chosen):
            ids[row, : len(job.inputs[i])] = job.inputs[i]
            mask[row, : len(job.inputs[i])] = 1
        started, preempted = time.perf_counter(), self._preemption_seconds
        try:
            attention = mx.array(mask)
            output = self.model(mx.array(ids), attention_mask=attention)
            vectors = np.array(self.readout(output, attention).astype(mx.float32))
        except Exception as exc:  # a failed pass fails its requests, not the device thread
            log.exception("embedding pass failed")
            for job, _ in chosen:
                if not job.future.done():
                    job.future.set_exception(exc)
            return
        # the pass's own time: less the passes run between its blocks
        self.cost.add(ids.size, time.perf_counter() - started - (self._preemption_seconds - preempted))
        self.passes += 1
        self.inputs += len(chosen)
        self.tokens += int(mask.sum())
        self.padded_tokens += ids.size
        for row, (job, i) in enumerate(chosen):
            if job.future.done():
                continue
            job.out[i] = vectors[row]
            job.left -= 1
            if job.left == 0:
                job.future.set_result(job.out)

    def closed_error(self) -> Exception:
        return EmbedderClosed("the embedding model was unloaded")

    def stats_json(self) -> dict[str, Any]:
        return {"passes": self.passes, "inputs": self.inputs, "tokens": self.tokens,
                "padding": round(1 - self.tokens / self.padded_tokens, 3) if self.padded_tokens else 0.0,
                "preemptions": self.preemptions, "waiting_requests": len(self._jobs), "pass_tokens": self.pass_tokens,
                "pass_budget": self.budget(self.pass_seconds)}


@dataclass
class LoadedEmbedder:
    """An embedding model (or a cross-encoder) loaded on the device thread, with its tokenizer and embedder."""

    name: str
    path: Path
    tokenizer: Any  # a transformers tokenizer (mlx-embeddings' wrapper unwrapped)
    embedder: Embedder
    dims: int  # vector size (1 for a cross-encoder: a score)
    profile: EmbeddingProfile
    special_head: tuple[int, ...]  # the special tokens the tokenizer puts before a text ([CLS])
    special_tail: tuple[int, ...]  # … and after it ([SEP]; an end token)
    vocab_size: int
    weight_bytes: int
    smoke_test: bool

    @property
    def max_length(self) -> int:
        """Tokens per input, special tokens included."""
        return self.profile.max_length


def builtin_vectors(output: Any, mask: Any) -> Any:
    """mlx-embeddings' own pooled, L2-normalised vectors."""
    return output.text_embeds


def pooled_vectors(pooling: Pooling) -> Readout:
    """Vectors pooled by flow from the token states — when the checkpoint's sentence-transformers config pools
    differently from mlx-embeddings' model (BGE pools [CLS]; mlx-embeddings' BERT pools the mean) — then
    L2-normalised. Inputs are padded on the right."""

    def readout(output: Any, mask: Any) -> Any:
        import mlx.core as mx

        states = output.last_hidden_state.astype(mx.float32)
        weights = mask.astype(mx.float32)[..., None]
        if pooling == "cls":
            pooled = states[:, 0]
        elif pooling == "last_token":
            last = mask.astype(mx.int32).sum(axis=1) - 1
            pooled = mx.take_along_axis(states, last[:, None, None], axis=1)[:, 0]
        elif pooling == "max":
            pooled = mx.where(weights > 0, states, mx.array(-mx.inf, dtype=mx.float32)).max(axis=1)
        else:
            pooled = (states * weights).sum(axis=1) / mx.maximum(weights.sum(axis=1), 1.0)
        return pooled / mx.maximum(mx.linalg.norm(pooled, axis=-1, keepdims=True), 1e-12)

    return readout


def relevance_scores(output: Any, mask: Any) -> Any:
    """A cross-encoder's relevance per pair, shaped (n, 1): its one output (mlx-embeddings applies the sigmoid),
    or the probability of the last label ("relevant") of a multi-label head."""
    scores = output.pooler_output
    return scores[:, -1:]


def load_embedder(name: str, path: Path, device: DeviceThread, pass_tokens: int,
                  pass_seconds: float = 0.1, dimensions: tuple[int, ...] = ()) -> LoadedEmbedder:
    """Load an mlx-embeddings model and its tokenizer on the device thread (blocking the caller).
    ``dimensions``: Matryoshka sizes the graph declares for it."""
    try:
        profile = read_profile(path, dimensions)
    except ProfileError as exc:
        raise ModelNotAvailable(f"{path}: {exc}") from None
    if profile.pooling != profile.builtin_pooling:
        readout = pooled_vectors(profile.pooling)
    else:
        readout = relevance_scores if profile.task == "score" else builtin_vectors

    def _load() -> tuple[Any, Any, int, int, tuple[float, float] | None]:
        import mlx.core as mx
        from mlx.utils import tree_flatten
        from mlx_embeddings.utils import load

        from runtime.cpu_activations import use_fast_gelu

        model, wrapper = load(str(path))
        use_fast_gelu(model)  # on the CPU, GELU's erf cost more than an encoder's matrix products
        tokenizer = getattr(wrapper, "_tokenizer", wrapper)
        ones = mx.array([[1]])
        probe = readout(model(mx.array([[tokenizer.pad_token_id or 0]]), attention_mask=ones), ones)
        leaves: Any = tree_flatten(model.parameters())

        def run(rows: int, tokens: int) -> None:
            mask = mx.ones((rows, tokens), dtype=mx.int32)
            mx.eval(readout(model(mx.full((rows, tokens), tokenizer.pad_token_id or 0), attention_mask=mask), mask))

        return model, tokenizer, int(probe.shape[-1]), sum(v.nbytes for _, v in leaves), idle_pass_cost(run)

    try:
        model, tokenizer, dims, weight_bytes, idle_cost = device.call(_load)
    except (ValueError, KeyError, AttributeError, TypeError) as exc:  # a checkpoint mlx-embeddings cannot read
        raise ModelNotAvailable(f"mlx-embeddings cannot load {path} ({type(exc).__name__}: {exc})") from None
    config = json.loads((path / "config.json").read_text())
    limit = getattr(tokenizer, "model_max_length", None)
    profile = replace(read_profile(path, dimensions, limit if isinstance(limit, int) else None), dims=dims)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    embedder = Embedder(model, device, int(pad_id), dims, pass_tokens, pass_seconds, readout, idle_cost)
    log.info("embedding model %s loaded (%s, %d %s, %s pooling)", name, profile.task, dims,
             "scores" if profile.task == "score" else "dims", profile.pooling)
    head, tail = special_tokens(tokenizer)
    return LoadedEmbedder(name, path, tokenizer, embedder, dims, profile, head, tail, len(tokenizer), weight_bytes,
                          bool(config.get("flow_smoke_test")))


def special_tokens(tokenizer: Any) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The special tokens the tokenizer puts before and after a text ([CLS] … [SEP] for BERT; none, or an end
    token, for decoder-style embedders), found by tokenizing a probe text with and without them."""
    plain = list(tokenizer("a", add_special_tokens=False)["input_ids"])
    full = list(tokenizer("a", add_special_tokens=True)["input_ids"])
    for start in range(len(full) - len(plain) + 1):
        if full[start:start + len(plain)] == plain:
            return tuple(full[:start]), tuple(full[start + len(plain):])
    return (), ()
