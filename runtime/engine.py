"""The generation engine of one model: continuous batching on the device thread.

Theory of operation
-------------------
Trio code calls :meth:`Engine.submit`, which queues a sequence and returns a
:class:`SequenceHandle` whose ``chunks`` channel yields :class:`TokenChunk`
items; past ``max_queue`` waiting sequences it raises :class:`EngineOverloaded`
instead. Everything else happens on the device thread, in :meth:`Engine.step`.

A sequence moves through three places:

* **waiting** (FIFO): prompts are prefilled oldest first, spending at most
  ``prefill_chunk`` tokens per step across sequences; every prompt token but
  the last goes through prefill. Several short prompts at the head of the
  queue that fit the budget together (counting their right padding) are
  prefilled in **one** right-padded forward pass into a batch cache of their
  own (``prepare``/``finalize`` turn the right padding into left padding).
  Any other prompt is prefilled alone, into a cache of its *own* (a plain
  single-sequence mlx-lm prompt cache), in chunks that may span steps — so a
  long prompt never stalls the running streams for more than one chunk. A
  sequence may arrive with a prefix-cache hit (``submit(prefix=...)``, from
  :meth:`Engine.match_prefix`): its cache is built from the hit's blocks when
  its prefill begins, and the prefill starts after them.
* **started**: once every prompt token but the last is in its cache, a
  sequence's last prompt token runs in a forward pass of its own (one pass for
  the sequences prefilled together), whose logits give its **first token**,
  handed out at once: the time to first token is its prefill plus one small
  pass, never a step of the whole batch.
* **ready**: started rows, joining the batch at the end of the step with their
  first token as their next input.
* **the decode batch**: one left-padded batch KV cache per layer (mlx-lm's
  ``BatchKVCache`` / ``BatchRotatingKVCache``). Ready sequences are *merged*
  in (their own caches become rows, left-padded to the batch's length), with
  their first token as the row's next input. Each step runs **one**
  forward pass with one input token per row, samples every row
  (:func:`runtime.sampling.sample_batch`, per-sequence parameters and keys)
  and evaluates it with ``mx.async_eval``, while Python reads the *previous*
  step's tokens (one ``tolist()`` for the batch) and hands them out. On a GPU
  the launch comes first and returns at once, so the device computes step
  *n+1* while Python hands out step *n* — the pipelining of
  ``mlx_lm.generate_step``, for the whole batch. The CPU backend computes most
  of a step inside ``async_eval`` itself, so there the engine reads and hands
  out step *n* first, then runs the step's prefill work (handing out the new
  sequences' first tokens), and only then launches *n+1*: trio streams the
  tokens on the other core while the step computes, no token is held back a
  step, and a new arrival's first token does not wait for a step of the batch. A row
  whose input is its first token ("fresh") hands nothing out that step: that
  token went out when it was sampled. Finished and cancelled rows
  are removed with the caches' ``filter`` (their KV memory goes with them);
  the one extra token computed for a finished row is dropped.

With a prefix cache (:mod:`runtime.prefix_cache`) the engine hands it the
prompt's blocks after every prefill chunk (so a concurrent request can reuse a
prompt still being read, and sliding-window layers still hold the positions)
and, for ``cache_mode = "full"``, the prompt's and answer's blocks when a
sequence finishes (read from its batch row before the row is dropped).
On a hybrid model it also hands over the recurrent layers' states as snapshots
(:mod:`runtime.prefix_cache`): at the prompt's end and the finish, at its
*turn point* (the last block boundary ``TURN_MARGIN`` tokens or more before the
prompt's end, where the conversation's next turn still agrees with it) and at up
to ``MAX_CHUNK_STATES`` chunk ends; its prefill chunks end on block boundaries
and at the turn point so that the states exist there.

The decoded tokens of a step go to trio in **one** ``run_sync_soon`` crossing
per trio run, before any prefill work of the step (a sequence that fails in
prefill is told at the end of the step).

A cancelled sequence (its client left) leaves at its next chunk boundary,
wherever it is: cancellations are applied at the start of every step *and*
before every prefill pass within one (a step may prefill parts of several
prompts), so it costs at most the pass that was running when it was
cancelled — never the rest of its prompt, nor someone else's chunk — and its
own cache is dropped then. The blocks of the chunks it did finish stay in the
prefix cache (a client that gave up on a long prompt often retries it).

Scheduling (``EngineConfig.strategy``), per step:

* ``decode_first`` (default): decode the batch (on the CPU: hand out its
  tokens; its next pass is launched after the prefill), then prefill with the
  full ``prefill_chunk`` budget. Streams never wait for more than one chunk of
  someone else's prompt per token.
* ``prefill_first``: prefill (full budget) and merge ready sequences *before*
  decoding, so they take part in this step's forward pass: lowest time to first
  token, at the cost of the running streams' inter-token latency.
* ``balanced``: like ``decode_first`` while fewer than ``max_batch // 2``
  sequences decode; from there on prefill runs only on every other step (the
  steps between are pure decode steps), halving the prefill share of a busy
  batch's time.

In every strategy new sequences are only prefilled while the batch (plus the
ready ones) has fewer than ``max_batch`` rows.

Greedy output does not depend on the batch: the masks hide every padded
position, each row is sampled from its own logits with its own key, and
batched matmuls differ from single-row ones only in the last bit or so of
float32 rounding. The tests compare batched greedy output with
``mlx_lm.generate`` token for token; only a near-exact tie between the two
best tokens (within ~1 ulp) could still go the other way.
"""

from __future__ import annotations

import concurrent.futures
import hashlib
import itertools
import logging
import statistics
import threading
import time
import weakref
from collections import deque
from dataclasses import asdict, dataclass, field, replace
from functools import cached_property
from typing import Any

import mlx.core as mx
import trio
from mlx.utils import tree_flatten
from mlx_lm.models.cache import ArraysCache, BatchKVCache, KVCache, make_prompt_cache

from protocols.ir import CachePolicy, FinishReason, PromptImages, SamplingParams, TokenChunk, TokenLogprob
from runtime import quantized_kv
from runtime.adapters import Adapter, AdapterSet
from runtime.constrained import Constraint
from runtime.device import DeviceThread
from runtime.engine_config import EngineConfig, EngineOverloaded, SpeculativeConfig
from runtime.image_spans import key_tokens
from runtime.model_memory import kv_bytes_per_token
from runtime.mtp import MTPDrafter, MTPDraftState
from runtime.pass_cost import PassCost
from runtime.prefix_cache import (MAX_CHUNK_STATES, BlockKeys, PrefixCache, PrefixHit, Slicer, StateReader,
                                  layer_windows, recurrent, state_key)
from runtime.recurrent_rollback import RecurrentRollback
from runtime.replication import GroupLost, NewSequence, ReplicaDiverged, Replicator, StepMessage
from runtime.sampling import LogprobReport, SequenceSampler, sample_batch
from runtime.speculative import DraftState, ModelDraftState, greedy_accepts, sampled_verify, worth_verifying

log = logging.getLogger("flow.engine")

# A hybrid model's prompt also gets a state snapshot at the last block boundary this many tokens or more before
# its end: a conversation's next turn repeats the prompt but its last tokens (the generation prompt, an empty
# thinking block) are rendered otherwise once the answer follows them.
TURN_MARGIN = 16

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
        self.cached_tokens = 0  # prompt tokens the prefix cache supplied
        self.cache_write_tokens = 0  # prompt tokens this sequence adds to the prefix cache's (full) blocks

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
    token: trio.lowlevel.TrioToken | None  # the trio run to deliver to (None: a follower rank's replica)
    prompt: list[int]
    max_tokens: int
    stop_ids: frozenset[int]
    sampler: SequenceSampler
    policy: CachePolicy = CachePolicy()
    adapters: tuple[Adapter, ...] = ()  # LoRA adapters applied to its rows (stacked in this order)
    namespace: bytes = b""  # its prefix-cache namespace: the model's, or the model's with its adapters'
    hit: PrefixHit | None = None  # prefix-cache blocks to build ``cache`` from, until it is built
    keys: BlockKeys | None = None  # its block keys, extended by each store
    cache: list[Any] | None = None  # its own cache while waiting; None once merged into the batch
    prefilled: int = 0  # prompt tokens in ``cache`` (or in ``hit``)
    chunk_states: int = 0  # recurrent-state snapshots it stored at prefill-chunk ends
    rolling_state: bytes | None = None  # past that bound: the key of its deepest chunk-end snapshot
    fed: list[int] = field(default_factory=list)  # generated tokens that went back in as inputs
    fresh: bool = False  # in the batch, and its input this step is its first token (already handed out)
    generated: int = 0
    history: list[int] = field(default_factory=list)  # recent tokens before the current input (penalties)
    # More choices of the same request: they wait with this sequence, and join the batch with copies of its cache.
    followers: list[_Sequence] = field(default_factory=list)
    draft: DraftState | None = None  # speculative decoding: its history and draft length (made on first use)
    submitted_at: float = field(default_factory=time.perf_counter)
    images: PromptImages | None = None  # a vision model's prompt with images (their arrays and token spans)
    embeds: mx.array | None = None  # its prompt's input embeddings while an image span is left to prefill
    tower: concurrent.futures.Future[mx.array] | None = None  # its images' vision-tower job, while it runs

    @cached_property
    def keyed(self) -> list[int]:
        """Its prompt as the prefix cache keys it: image positions by their images' digests."""
        return self.prompt if self.images is None else key_tokens(self.prompt, self.images.spans)


class _Rows:
    """Sequences whose KV caches are the rows of one batch cache per layer (left-padded)."""

    def __init__(self, seqs: list[_Sequence] | None = None, cache: list[Any] | None = None) -> None:
        self.seqs: list[_Sequence] = seqs or []
        self.cache: list[Any] = cache or []
        self.first: list[int] = []  # started rows: each one's first token, its next input

    @classmethod
    def merge(cls, seqs: list[_Sequence]) -> _Rows:
        """Rows made from the sequences' own single-sequence caches, which they give up."""
        rows = cls(list(seqs), _merge_caches([s.cache or [] for s in seqs]))
        for seq in seqs:
            seq.cache = None
        return rows

    def __len__(self) -> int:
        return len(self.seqs)

    def extend(self, other: _Rows) -> None:
        if not self.seqs:
            self.seqs, self.cache, self.first = list(other.seqs), other.cache, list(other.first)
            return
        self.cache = [quantized_kv.extend_layer(mine, theirs) for mine, theirs in zip(self.cache, other.cache)]
        self.seqs.extend(other.seqs)
        self.first.extend(other.first)

    def keep(self, keep: list[int]) -> None:
        """Keep only these rows (in order); the others' KV memory is released."""
        if len(keep) == len(self.seqs):
            return
        if not keep:
            self.seqs, self.cache, self.first = [], [], []
            return
        for c in self.cache:
            c.filter(keep)
        self.seqs = [self.seqs[i] for i in keep]
        if self.first:
            self.first = [self.first[i] for i in keep]

    @property
    def nbytes(self) -> int:
        return sum(int(c.nbytes) for c in self.cache)


class _DecodeBatch(_Rows):
    """The rows decoding together, with each row's next input token."""

    def __init__(self) -> None:
        super().__init__()
        self.inputs: mx.array | None = None  # [B] each row's next input token
        # Logprob figures for ``inputs``, for the sequences (as they were then) that asked.
        self.report: tuple[list[_Sequence], LogprobReport] | None = None

    def add(self, rows: _Rows) -> None:
        """Started rows join; each one's first token is its next input."""
        first = mx.array(rows.first, dtype=mx.uint32)
        self.inputs = first if self.inputs is None or not self.seqs else mx.concatenate([self.inputs, first])
        for seq in rows.seqs:
            seq.fresh = True
            if seq.sampler.processors:
                seq.history = seq.prompt[-seq.sampler.history_window :]
        self.extend(rows)
        self.first = []

    def keep(self, keep: list[int]) -> None:
        if len(keep) == len(self.seqs):
            return
        super().keep(keep)
        if not keep:
            self.inputs, self.report = None, None
        else:
            assert self.inputs is not None
            self.inputs = self.inputs[mx.array(keep)]


@dataclass
class EngineStats:
    submitted: int = 0
    finished: int = 0
    cancelled: int = 0
    failed: int = 0
    rejected: int = 0  # refused by submit: the queue was full
    prompt_tokens: int = 0  # prompt tokens computed (cached ones excluded)
    cached_tokens: int = 0  # prompt tokens handed in already in a cache
    generated_tokens: int = 0
    steps: int = 0
    decode_steps: int = 0
    prefill_chunks: int = 0  # prefill forward passes
    grouped_prefills: int = 0  # of those, the ones that prefilled several prompts together
    batch_size: int = 0  # rows in the decode batch after the last step
    peak_batch: int = 0
    kv_bytes: int = 0  # KV cache bytes held by all sequences after the last step
    decode_seconds: float = 0.0
    prefill_seconds: float = 0.0
    speculative_steps: int = 0  # decode steps that verified drafts
    draft_tokens: int = 0  # tokens proposed by speculative decoding
    accepted_tokens: int = 0  # of those, the ones the model accepted


class Engine:
    """Runs sequences of one model on the device thread, batched."""

    def __init__(self, model: Any, device: DeviceThread, config: EngineConfig = EngineConfig(),
                 prefix: PrefixCache | None = None, namespace: bytes = b"",
                 replicator: Replicator | None = None, draft_model: Any = None) -> None:
        self.model = model
        self.device = device
        if (config.speculative.kind in ("draft", "mtp")) != (draft_model is not None) or \
                (config.speculative.kind == "mtp") != isinstance(draft_model, MTPDrafter):
            raise ValueError("speculative kind 'draft' needs a draft model, kind 'mtp' the model's MTP drafter, "
                             "and a drafter needs its kind")
        # Speculation's drafter: a draft model (same tokenizer) for kind "draft", the MTP layers for kind "mtp".
        self.draft_model = draft_model
        if replicator is not None and config.speculative.kind != "off":
            # Whether a step verifies drafts depends on timings measured on each rank: not rank-consistent.
            log.warning("speculative decoding is off for a distributed model")
            config = EngineConfig(config.max_batch, config.prefill_chunk, config.strategy, config.max_queue,
                                  SpeculativeConfig())
        self.config = config
        # Distributed (runtime.distributed): rank 0 sends each step's decisions, the other ranks replay them.
        self._replicator = replicator
        self.lost: GroupLost | None = None  # the group of ranks is gone: nothing runs any more
        # The prefix cache, when the model's layer caches can be cut into blocks.
        windows = layer_windows(make_prompt_cache(model))
        self.prefix_unsupported = windows if isinstance(windows, str) and prefix is not None else None
        self.windows = windows if not isinstance(windows, str) else ()
        self.prefix = prefix if self.prefix_unsupported is None else None
        if self.prefix is not None and self.prefix.config.disk_kv_bits:
            # Quantized blocks on disk and full ones never share keys (nor a restart with another setting).
            namespace = hashlib.sha256(namespace + f"kv-q{self.prefix.config.disk_kv_bits}".encode()).digest()[:16]
        # The live batch's quantized KV (runtime.quantized_kv), refused at load where the model's layers cannot.
        kv = config.kv_quantization
        self.kv_quantizer = device.call(lambda: quantized_kv.check_support(model, kv)) if kv.on else None
        if self.kv_quantizer is not None:  # its blocks hold quantized rows: apart from full-precision ones
            q = self.kv_quantizer
            namespace = hashlib.sha256(namespace + f"live-q{q.bits}g{q.group_size}s{q.start}".encode()).digest()[:16]
        self.namespace = namespace
        self.adapters = AdapterSet(model)  # mounted LoRA adapters, applied per row
        self.stats = EngineStats()
        self._ids = itertools.count(1)
        self._lock = threading.Lock()
        self._inbox: deque[_Sequence] = deque()
        # The trio side's open streams, so they can be ended without the device thread (see end_streams).
        self._streams: weakref.WeakSet[SequenceHandle] = weakref.WeakSet()
        self._cancelled: set[int] = set()
        self._kv_per_token: int | None = None
        # Device-thread state:
        self._waiting: deque[_Sequence] = deque()
        self._ready: list[_Rows] = []  # prefilled, joining the batch at the end of this step
        self._batch = _DecodeBatch()
        self._towers: list[_Sequence] = []  # image prompts whose vision-tower jobs run beside the steps
        self._skip_prefill = False  # balanced: this step is a pure decode step
        # On a GPU, async_eval returns at once: launch step n+1, then read step n (pipelined,
        # like mlx_lm.generate_step). On the CPU it computes most of the step before returning,
        # so read and hand out step n first, then launch n+1.
        self._launch_first = mx.default_device().type != mx.DeviceType.cpu
        # Decode forward passes' seconds by the tokens they hold: whether verifying drafts pays (CPU).
        self._step_cost = PassCost(weight=0.05)
        # A drafter's seconds by the tokens it drafted in a step: what drafting adds to a verifying step's cost.
        self._draft_cost = PassCost(weight=0.1)
        # Hybrid models: their gated-delta layers' states are cut back to the accepted tokens by running again.
        self._recurrent = RecurrentRollback.of(model) if self.config.speculative.kind != "off" else None
        # Recent history for rates, TTFT and retry-after estimates (device thread writes).
        self._rates: deque[tuple[float, int, int]] = deque(maxlen=64)
        self._ttfts: deque[float] = deque(maxlen=64)
        self._finish_times: deque[float] = deque(maxlen=64)
        device.add_stepper(self)

    # ------------------------------------------------------------------ trio side
    async def match_prefix(self, prompt: list[int], policy: CachePolicy = CachePolicy(),
                           adapters: tuple[Adapter, ...] = ()) -> PrefixHit | None:
        """The prefix cache's longest match for ``prompt`` (None without a cache); pass it to :meth:`submit`.

        Runs on a worker thread: a warm match reads its blocks from disk. The thread cannot be abandoned, so
        a caller cancelled meanwhile (its client left) gets :class:`trio.Cancelled` once the match is done,
        with the hit released: it must not go on to submit a sequence nobody waits for.
        """
        if self.prefix is None or len(prompt) <= self.prefix.config.block_tokens:
            return None
        prefix = self.prefix
        hit = await trio.to_thread.run_sync(prefix.match, self.namespace_for(adapters), prompt, self.windows,
                                            policy.ttl_seconds)
        try:
            await trio.lowlevel.checkpoint_if_cancelled()
        except BaseException:
            prefix.release(hit)
            raise
        return hit if hit.blocks else None

    def submit(self, prompt: list[int], *, max_tokens: int, stop_ids: frozenset[int], sampling: SamplingParams,
               prefix: PrefixHit | None = None, policy: CachePolicy = CachePolicy(),
               constraint: Constraint | None = None, adapters: tuple[Adapter, ...] = (),
               images: PromptImages | None = None) -> SequenceHandle:
        """Queue a sequence; raises :class:`EngineOverloaded` when ``max_queue`` sequences wait.

        ``prefix`` is a hit of :meth:`match_prefix` for this prompt; the engine
        takes over its references (also when it refuses the sequence).
        ``policy`` says what of the sequence the prefix cache keeps; ``constraint`` (structured output) masks
        the tokens its grammar does not allow at each step; ``adapters`` (mounted on this engine) apply to its
        rows, and ``prefix`` must come from a match with the same adapters. ``images`` (a vision model's prompt)
        are embedded by the model where their tokens sit; ``prefix`` must come from a match of the prompt's
        :func:`runtime.vision.key_tokens`.
        """
        return self.submit_choices(prompt, [(sampling, constraint)], max_tokens=max_tokens, stop_ids=stop_ids,
                                   prefix=prefix, policy=policy, adapters=adapters, images=images)[0]

    def submit_choices(self, prompt: list[int], choices: list[tuple[SamplingParams, Constraint | None]], *,
                       max_tokens: int, stop_ids: frozenset[int], prefix: PrefixHit | None = None,
                       policy: CachePolicy = CachePolicy(), adapters: tuple[Adapter, ...] = (),
                       images: PromptImages | None = None) -> list[SequenceHandle]:
        """Queue one sequence per choice (its sampling and constraint) for one prompt, prefilled **once**: the
        choices become rows of the batch from copies of the first one's cache, each sampling its own tokens."""
        try:
            samplers = [SequenceSampler(sampling, constraint) for sampling, constraint in choices]
            if images is not None and not hasattr(self.model, "embed_prompt"):
                raise ValueError("this model does not read images")
            return self._submit(prompt, max_tokens, stop_ids, samplers, prefix, policy, adapters, images)
        except BaseException:
            if prefix is not None and self.prefix is not None:
                self.prefix.release(prefix)
            raise

    def _submit(self, prompt: list[int], max_tokens: int, stop_ids: frozenset[int], samplers: list[SequenceSampler],
                prefix: PrefixHit | None, policy: CachePolicy, adapters: tuple[Adapter, ...],
                images: PromptImages | None = None) -> list[SequenceHandle]:
        if self.lost is not None:
            raise self.lost
        if not prompt:
            raise ValueError("a sequence needs at least one prompt token")
        if max_tokens < 1:
            raise ValueError("max_tokens must be at least 1")
        cached_tokens = prefix.tokens if prefix is not None else 0
        if not 0 <= cached_tokens < len(prompt):
            raise ValueError(f"a prefix hit must leave at least the last of the {len(prompt)} prompt tokens")
        waiting = self.waiting
        if waiting >= self.config.max_queue:
            with self._lock:
                self.stats.rejected += 1
            retry = self._retry_after(waiting - self.config.max_queue + 1)
            raise EngineOverloaded(f"{waiting} requests are already waiting for this model "
                                   f"(max_queue {self.config.max_queue})", retry)
        seqs = []
        for i, sampler in enumerate(samplers):
            send, receive = trio.open_memory_channel[TokenChunk](float("inf"))
            handle = SequenceHandle(self, next(self._ids), send, receive)
            seqs.append(_Sequence(handle=handle, token=trio.lowlevel.current_trio_token(), prompt=list(prompt),
                                  max_tokens=max_tokens, stop_ids=stop_ids, sampler=sampler,
                                  policy=policy, adapters=adapters, namespace=self.namespace_for(adapters),
                                  hit=prefix if i == 0 else None, prefilled=cached_tokens,
                                  keys=prefix.keys if prefix is not None and i == 0 else None,
                                  images=images if i == 0 else None))
            handle.cached_tokens = cached_tokens
            if self.prefix is not None and i == 0:  # the choices after the first share its prefill
                b = self.prefix.config.block_tokens
                handle.cache_write_tokens = max(0, (len(prompt) - 1) // b * b - cached_tokens)
        leader = seqs[0]
        leader.followers = seqs[1:]
        self._streams.update(s.handle for s in seqs)
        with self._lock:
            self._inbox.append(leader)
            self.stats.submitted += len(seqs)
            self.stats.cached_tokens += cached_tokens
        self.device.wake()
        return [s.handle for s in seqs]

    def namespace_for(self, adapters: tuple[Adapter, ...]) -> bytes:
        """The prefix-cache namespace of sequences run with ``adapters``: the model's, or one derived from it
        and the adapters' digests (their weights and config, never their names), in stacking order."""
        if not adapters:
            return self.namespace
        return hashlib.sha256(self.namespace + b"".join(a.digest for a in adapters)).digest()[:16]

    # ------------------------------------------------------------------ adapters (device thread, between steps)
    def mount_adapter(self, adapter: Adapter) -> None:
        """Mount an adapter :func:`runtime.adapters.load_adapter` checked (a device-thread job)."""
        if self._replicator is not None:
            raise ValueError("adapters cannot be mounted on a model served across processes (distributed) yet")
        self.adapters.mount(adapter)

    def unmount_adapter(self, adapter: Adapter) -> int:
        """Unmount an adapter (a device-thread job): at once when no sequence uses it, else once the last
        one that does has left. Returns how many sequences still use it."""
        adapter.retiring = True
        users = self._users_of(adapter)
        if not users:
            self.adapters.unmount(adapter)
        return users

    def _users_of(self, adapter: Adapter) -> int:
        with self._lock:
            queued = list(self._inbox)
        seqs = [*queued, *self._waiting, *self._towers, *(s for r in self._ready for s in r.seqs), *self._batch.seqs]
        return sum(adapter in s.adapters for s in seqs)

    def _sweep_adapters(self) -> None:
        for adapter in [a for a in self.adapters.adapters if a.retiring]:
            if not self._users_of(adapter):
                self.adapters.unmount(adapter)

    def _forward(self, inputs: mx.array, cache: list[Any], seqs: list[_Sequence],
                 embeddings: mx.array | None = None) -> mx.array:
        """The model on ``inputs`` (one row per sequence), each row with its sequence's adapters; a vision
        model's prompt chunk comes with its input ``embeddings`` (its images' features where they sit)."""
        if self.adapters:
            self.adapters.route([s.adapters for s in seqs])
        if embeddings is not None:
            with_images: mx.array = self.model(inputs, cache=cache, input_embeddings=embeddings)
            return with_images
        logits: mx.array = self.model(inputs, cache=cache)
        return logits

    @staticmethod
    def _tower_due(seq: _Sequence) -> bool:
        """A prompt with an image span left to prefill (not covered by a prefix hit) and no embeddings yet."""
        return (seq.images is not None and seq.embeds is None
                and any(span.end > seq.prefilled for span in seq.images.spans))

    def _embed_images(self, seq: _Sequence) -> int:
        """Start the prompt's input embeddings — its images' features where they sit — kept until its image spans
        are prefilled. From the feature cache at once (charged as its image tokens' prefill); else the vision
        tower runs as a job of the model's sliced worker, beside the steps (the streams keep decoding; the prompt
        waits aside and comes back to the head of the queue when its features are ready)."""
        images = seq.images
        assert images is not None
        if self.model.features_cached(images):
            seq.embeds = self.model.embed_prompt(seq.prompt, images)
            mx.eval(seq.embeds)
            return sum(span.end - span.start for span in images.spans)
        prompt = seq.prompt
        seq.tower = self.model.worker.submit(lambda: self.model.embed_prompt(prompt, images))
        seq.tower.add_done_callback(lambda _: self.device.wake())
        self._waiting.popleft()
        self._towers.append(seq)
        return 0

    def _take_towers(self, out: list[tuple[_Sequence, TokenChunk | None]]) -> None:
        """Image prompts whose tower jobs ended go back to the head of the queue (or fail)."""
        done = [s for s in self._towers if s.tower is not None and s.tower.done()]
        for seq in reversed(done):
            self._towers.remove(seq)
            tower, seq.tower = seq.tower, None
            assert tower is not None
            try:
                seq.embeds = tower.result()
            except Exception as exc:
                log.exception("vision tower failed; failing its sequence")
                self._fail([seq], exc, out)
                continue
            self._waiting.appendleft(seq)

    def end_streams(self, lost: GroupLost) -> None:
        """Trio side, a distributed model whose group is lost: end every open stream now with ``lost`` and refuse
        new sequences, without waiting for the device thread — it may be blocked for good in a collective over
        the lost peer (MLX's ring backend never completes a collective issued after a peer's socket failed).
        What the device side still holds is freed by :meth:`group_lost`, if that thread ever runs again."""
        self.lost = self.lost or lost
        for handle in list(self._streams):
            if not handle.finished:
                handle.error = self.lost
                handle.finished = True
                handle._send.close()

    def abandon(self, error: Exception) -> None:
        """The device thread is held for good (runtime.device): this model's streams end too, as a lost group's."""
        self.end_streams(error if isinstance(error, GroupLost) else GroupLost(str(error)))

    def _cancel(self, seq_id: int) -> None:
        with self._lock:
            self._cancelled.add(seq_id)
        self.device.wake()

    @property
    def distributed(self) -> bool:
        """Run by a group of ranks (runtime.distributed), rank 0's decisions replayed by the others."""
        return self._replicator is not None

    @property
    def active(self) -> int:
        """Sequences in the decode batch."""
        return len(self._batch)

    @property
    def waiting(self) -> int:
        """Sequences accepted but not decoding yet (queued, prefilling or about to join)."""
        return len(self._inbox) + len(self._waiting) + len(self._towers) + sum(len(r) for r in self._ready)

    def close(self) -> None:
        self.device.remove_stepper(self)

    def kv_bytes_per_token(self) -> int:
        """Estimated KV cache bytes one token of context costs (all layers, keys and values).

        From the model's config: layers × KV heads × head dim × 2 × activation
        dtype bytes. An upper bound for models with sliding-window layers (their
        caches stop growing at the window). For admission control: a request
        needs about ``(prompt + max_tokens) × this`` bytes, plus batch padding.
        """
        if self._kv_per_token is None:
            self._kv_per_token = _kv_bytes_per_token(self.model)
        return self._kv_per_token

    def kv_bytes_for(self, tokens: int) -> int:
        """Estimated KV bytes ``tokens`` of context cost: at full precision, or with the live quantized KV
        (runtime.quantized_kv) past its start, each element ``bits`` wide plus a scale and a bias per group."""
        per_token = self.kv_bytes_per_token()
        q = self.kv_quantizer
        if q is None or tokens <= q.start:
            return per_token * tokens
        return per_token * q.start + int(per_token * self._quantized_kv_ratio * (tokens - q.start))

    @cached_property
    def _quantized_kv_ratio(self) -> float:
        """A quantized KV element's bytes (its code, and a scale and a bias per group) over a full one's: read
        once, not on each request's admission (finding the dtype walks the model's parameters)."""
        q = self.kv_quantizer
        assert q is not None
        itemsize = _activation_itemsize(self.model)
        return (q.bits / 8 + 2 * itemsize / q.group_size) / itemsize

    def stats_json(self) -> dict[str, Any]:
        """A JSON-ready snapshot for ``/stats`` (safe to call from any thread)."""
        s = self.stats
        out: dict[str, Any] = asdict(s)
        rates = list(self._rates)
        recent_decode = recent_prefill = 0.0
        if len(rates) >= 2 and rates[-1][0] > rates[0][0]:
            span = rates[-1][0] - rates[0][0]
            recent_decode = (rates[-1][1] - rates[0][1]) / span
            recent_prefill = (rates[-1][2] - rates[0][2]) / span
        ttfts = list(self._ttfts)
        out.update(
            active=self.active,
            waiting=self.waiting,
            strategy=self.config.strategy,
            max_batch=self.config.max_batch,
            prefill_chunk=self.config.prefill_chunk,
            max_queue=self.config.max_queue,
            decode_tokens_per_second=round(s.generated_tokens / s.decode_seconds, 1) if s.decode_seconds else 0.0,
            prefill_tokens_per_second=round(s.prompt_tokens / s.prefill_seconds, 1) if s.prefill_seconds else 0.0,
            recent_decode_tokens_per_second=round(recent_decode, 1),
            recent_prefill_tokens_per_second=round(recent_prefill, 1),
            ttft_ms_median_recent=round(statistics.median(ttfts) * 1000, 1) if ttfts else None,
            kv_bytes_per_token=self.kv_bytes_per_token(),
            prefix_cache="on" if self.prefix is not None else
                         f"off: {self.prefix_unsupported}" if self.prefix_unsupported else "off",
        )
        if self.kv_quantizer is not None:  # the live batch's quantized KV
            out["kv_quantization"] = asdict(self.kv_quantizer)
        for key in ("decode_seconds", "prefill_seconds"):
            out[key] = round(out[key], 3)
        features = getattr(self.model, "features", None)
        if features is not None:  # a vision model: its tower passes and the feature cache's use
            out["vision"] = {"tower_passes": self.model.tower_passes, "feature_hits": features.hits,
                             "feature_misses": features.misses, "cached_images": len(features)}
        return out

    def _retry_after(self, excess: int) -> float:
        """Seconds until about ``excess`` queue places free up, from the recent finish rate."""
        times = list(self._finish_times)
        if len(times) >= 2 and times[-1] > times[0]:
            rate = (len(times) - 1) / (times[-1] - times[0])
            return float(min(60, max(1, round(excess / rate))))
        return 1.0

    # ------------------------------------------------------------------ device side
    def has_work(self) -> bool:
        # A tower job that still runs is the vision worker's work, not this engine's (else that worker would
        # yield to an engine with nothing to do): its end wakes the device thread.
        return bool(self._inbox or self._waiting or self._ready or self._batch.seqs or self._cancelled
                    or any(s.tower is not None and s.tower.done() for s in self._towers))

    def step(self) -> None:
        if self._replicator is None:
            self._take_inbox()
        elif not self._replicate():
            return
        out: list[tuple[_Sequence, TokenChunk | None]] = []
        try:
            if self.config.strategy == "prefill_first":
                self._prefill(self.config.prefill_chunk, out)
                self._admit(out)
                if self._batch.seqs:
                    self._launch(self._decode(out))
            else:
                launch: list[mx.array] = []
                if self._batch.seqs:
                    launch = self._decode(out)
                    self._update_gauges()
                    self._deliver(out)  # the streams get their tokens before any prefill work
                    out = []
                self._prefill(self._prefill_budget(), out)
                if launch:
                    # CPU: the batch's next forward pass runs after the prefill, whose first tokens go out
                    # first: a new arrival does not wait for a batch step (the streams' gaps are the same).
                    self._deliver(out)
                    out = []
                    self._launch(launch)
                self._admit(out)
        except Exception as exc:
            log.exception("engine step failed; failing its batch")
            if self._replicator is not None:
                # The ranks may no longer hold the same batch: the group cannot go on.
                if not self._replicator.leader:
                    raise
                self._deliver(out)
                self.group_lost(exc)
                return
            self._fail(self._batch.seqs, exc, out)
            self._batch = _DecodeBatch()
        s = self.stats
        s.steps += 1
        self._update_gauges()
        now = time.perf_counter()
        if not self._rates or now - self._rates[-1][0] > 0.1:
            self._rates.append((now, s.generated_tokens, s.prompt_tokens))
        if s.steps % 256 == 0:  # a long run's buffers; an idle device releases the rest (DeviceThread)
            mx.clear_cache()
        if self.adapters:
            self._sweep_adapters()
        self._deliver(out)
        if self._replicator is not None:
            self._replicator.step_done()

    def _update_gauges(self) -> None:
        s = self.stats
        s.batch_size = len(self._batch)
        s.peak_batch = max(s.peak_batch, s.batch_size)
        s.kv_bytes = self._batch.nbytes + sum(r.nbytes for r in self._ready) + sum(
            int(c.nbytes) for seq in self._waiting if seq.cache for c in seq.cache)

    def _take_inbox(self) -> None:
        with self._lock:
            self._waiting.extend(self._inbox)
            self._inbox.clear()
        self._drop_cancelled()

    # ------------------------------------------------------------------ distributed (runtime.replication)
    def _replicate(self) -> bool:
        """The distributed ``_take_inbox``: rank 0 takes its inbox and cancels and sends them as the step's
        message; a follower receives it and builds the same sequences. False on rank 0 when the group is gone
        (every sequence failed); a follower's errors end its loop."""
        replicator = self._replicator
        assert replicator is not None
        if not replicator.leader:
            message = replicator.exchange(None)
            taken = [self._replica(new) for new in message.new]
        else:
            with self._lock:
                taken = list(self._inbox)
                self._inbox.clear()
                cancels, self._cancelled = self._cancelled, set()
            if self.lost is not None:  # the supervisor saw the group go: a collective now could block for good
                self.group_lost(self.lost, taken)
                return False
            sent = StepMessage("step", tuple(_describe(s) for s in taken), tuple(sorted(cancels)))
            try:
                message = replicator.exchange(sent)
            except Exception as exc:
                self.group_lost(exc, taken)
                return False
        self._waiting.extend(taken)
        if message.cancelled:
            cancelled = set(message.cancelled)
            self._waiting, dropped = _without(self._waiting, cancelled)
            self._apply_cancels(cancelled, dropped)
        return True

    def _replica(self, new: NewSequence) -> _Sequence:
        """A follower's copy of a sequence rank 0 accepted (its tokens are computed, never handed out)."""
        hit: PrefixHit | None = None
        if new.cached:
            if self.prefix is None:
                raise ReplicaDiverged("rank 0 reused prefix-cache blocks, this rank has no prefix cache")
            hit = self.prefix.match(self.namespace, new.prompt, self.windows)
            kept = 0
            for i, block in enumerate(hit.blocks if hit.state is None else ()):  # a snapshot's depth is exact
                if kept + block.length > new.cached:
                    self.prefix.release(PrefixHit(hit.namespace, hit.windows, hit.blocks[i:], hit.block_tokens))
                    hit.blocks = hit.blocks[:i]
                    break
                kept += block.length
            kept = hit.tokens
            if hit.tokens != new.cached:
                self.prefix.release(hit)
                raise ReplicaDiverged(f"rank 0 reused {new.cached} cached prompt tokens, this rank's prefix cache "
                                      f"holds {kept} of them")
        seqs = []
        for i, (seq_id, sampling) in enumerate(zip(new.ids, new.sampling)):
            send, receive = trio.open_memory_channel[TokenChunk](0)
            seqs.append(_Sequence(handle=SequenceHandle(self, seq_id, send, receive), token=None,
                                  prompt=list(new.prompt), max_tokens=new.max_tokens, stop_ids=frozenset(new.stop_ids),
                                  sampler=SequenceSampler(sampling), policy=new.policy, namespace=self.namespace,
                                  hit=hit if i == 0 else None, prefilled=new.cached,
                                  keys=hit.keys if hit is not None and i == 0 else None))
        seqs[0].followers = seqs[1:]
        self.stats.submitted += len(seqs)
        self.stats.cached_tokens += new.cached
        return seqs[0]

    def group_lost(self, exc: BaseException, taken: list[_Sequence] | None = None) -> None:
        """Rank 0 lost its group: fail every sequence, run nothing more (the server reports the model down)."""
        lost = exc if isinstance(exc, GroupLost) else GroupLost(f"the model's group of ranks is gone: {exc}")
        said = self.lost is not None  # by the supervisor (flow.resources.cluster), or an earlier call
        self.lost = lost = self.lost or lost  # the first reason
        taken = list(taken or ())
        with self._lock:
            taken += list(self._inbox)
            self._inbox.clear()
            self._cancelled.clear()
        out: list[tuple[_Sequence, TokenChunk | None]] = []
        seqs = [*taken, *self._waiting, *(s for r in self._ready for s in r.seqs), *self._batch.seqs]
        if seqs:
            log.error("%s; failing the model's %d sequences", lost, len(seqs))
        elif not said:
            log.info("%s", lost)
        self._waiting, self._ready, self._batch = deque(), [], _DecodeBatch()
        self._fail(seqs, lost, out)
        self._deliver(out)
        self.device.remove_stepper(self)

    def _drop_cancelled(self, started: _Rows | None = None) -> None:
        """Drop the sequences cancelled so far, wherever they are (also from ``started``: rows just prefilled
        together, about to run their first tokens); their KV memory goes with them.

        Runs at the start of every step and before every pass of prefill work within one, so a cancelled
        sequence costs at most the pass that was running when it was cancelled. Distributed, cancels apply at
        a step's start only, from its message (:meth:`_replicate`): every rank must drop the same rows."""
        if self._replicator is not None:
            return
        with self._lock:
            if not self._cancelled:
                return
            cancelled, self._cancelled = self._cancelled, set()
            # Within a step, sequences submitted since its start are still in the inbox: they leave from there.
            self._inbox, dropped = _without(self._inbox, cancelled)
        self._apply_cancels(cancelled, dropped, started)

    def _apply_cancels(self, cancelled: set[int], dropped: list[_Sequence], started: _Rows | None = None) -> None:
        self._waiting, more = _without(self._waiting, cancelled)
        dropped += more
        towers = deque(self._towers)
        towers, stopped = _without(towers, cancelled)
        self._towers = list(towers)
        for seq in stopped:
            if seq.tower is not None:
                self.model.worker.cancel(seq.tower)  # ends at the tower's next layer
                seq.tower = None
        dropped += stopped
        for seq in dropped:
            self._drop_hit(seq)
            seq.cache = seq.embeds = None  # its own cache (a prefill in progress) is freed now, not with the step
        gone = len(dropped)
        for rows in [*self._ready, self._batch, *([started] if started is not None else [])]:
            keep = [i for i, s in enumerate(rows.seqs) if s.handle.id not in cancelled]
            gone += len(rows) - len(keep)
            rows.keep(keep)
        self._ready = [r for r in self._ready if r.seqs]
        self.stats.cancelled += gone

    def _prefill_budget(self) -> int:
        if self.config.strategy == "balanced" and len(self._batch) >= max(1, self.config.max_batch // 2):
            self._skip_prefill = not self._skip_prefill
            return 0 if self._skip_prefill else self.config.prefill_chunk
        return self.config.prefill_chunk

    def _room(self) -> int:
        return self.config.max_batch - len(self._batch) - sum(len(r) for r in self._ready)

    def _prefill(self, budget: int, out: list[tuple[_Sequence, TokenChunk | None]]) -> None:
        """Spend up to ``budget`` prompt tokens on waiting sequences, oldest first.

        Short prompts that start from scratch and fit the budget together are
        prefilled *together*, right-padded into one batch cache (one forward pass
        instead of one per prompt); anything else is prefilled on its own cache,
        in chunks that may span steps.
        """
        start = time.perf_counter()
        if self._towers:
            self._take_towers(out)
        while True:
            # A sequence cancelled during the last pass (of any sequence) leaves before the next one: its
            # prefill stops at its next chunk boundary, also within a step that prefills several.
            self._drop_cancelled()
            if not self._waiting or self._room() <= 0:
                break
            group = self._group(budget)
            if len(group) > 1:
                grouped = set(map(id, group))
                self._waiting = deque(s for s in self._waiting if id(s) not in grouped)
                lengths = [len(s.prompt) - 1 - s.prefilled for s in group]
                try:
                    rows = self._prefill_together(group)
                    self._drop_cancelled(rows)  # a prompt whose client left during the pass gets no first token
                    if rows.seqs:
                        self._start(rows, out)
                        self._deliver_now(out)
                except Exception as exc:
                    log.exception("prefill failed; failing its sequences")
                    self._fail(group, exc, out)
                    continue
                budget -= len(group) * max(lengths)
                self.stats.prompt_tokens += sum(lengths)
                self.stats.prefill_chunks += 1
                self.stats.grouped_prefills += 1
                continue
            seq = self._waiting[0]
            if seq.followers and self._room() < 1 + len(seq.followers) and (self._batch.seqs or self._ready):
                break  # its choices start together, when the batch has a row for each
            remaining = len(seq.prompt) - 1 - seq.prefilled
            if remaining > 0:
                if budget <= 0:
                    break
                n = min(budget, remaining)
                if self._snapshots:
                    n = self._snapshot_chunk(seq, n)
                try:
                    if seq.cache is None:
                        seq.cache = self._new_cache(seq)
                    if self._tower_due(seq):
                        budget -= self._embed_images(seq)
                        continue
                    chunk = mx.array(seq.prompt[seq.prefilled : seq.prefilled + n])
                    embeds = None if seq.embeds is None else seq.embeds[:, seq.prefilled : seq.prefilled + n]
                    if embeds is None:
                        hidden = self._decode_pass(chunk[None], [seq], seq.cache)[1]
                        self._prompt_hidden(seq, seq.prefilled, None if hidden is None else hidden[0])
                    else:
                        self._forward(chunk[None], seq.cache, [seq], embeds)
                    self._quantize_kv(seq.cache)
                    mx.eval([c.state for c in seq.cache])
                except Exception as exc:
                    log.exception("prefill failed; failing its sequence")
                    self._waiting.popleft()
                    self._fail([seq], exc, out)
                    continue
                seq.prefilled += n
                if seq.images is not None and all(span.end <= seq.prefilled for span in seq.images.spans):
                    seq.embeds = None  # the rest are text tokens, embedded as tokens (the same embeddings)
                budget -= n
                self.stats.prompt_tokens += n
                self.stats.prefill_chunks += 1
                self._keep_prefix(seq, _own_slicer(seq.cache), state=_own_state(seq.cache))
                continue  # next: more of this prompt (budget permitting) or its first token, unless cancelled
            self._waiting.popleft()
            choices, seq.followers = [seq, *seq.followers], []
            others = self._take_prefilled(self._room() - len(choices))
            starting = [*choices, *others]
            try:
                for other in (seq, *others):
                    if other.cache is None:
                        other.cache = self._new_cache(other)  # nothing (more) to prefill
                for follower in choices[1:]:
                    follower.cache, follower.prefilled = seq.cache, seq.prefilled  # merged into copies below
                self._start(_Rows.merge(starting), out)
                self._deliver_now(out)
            except Exception as exc:
                log.exception("could not batch the sequence's cache; failing it")
                self._fail(starting, exc, out)
        self.stats.prefill_seconds += time.perf_counter() - start

    def _take_prefilled(self, limit: int) -> list[_Sequence]:
        """Up to ``limit`` more sequences from the head of the queue with nothing left to prefill (their whole
        prompt was cached, or its last chunk is done): they start in one pass with the one before them,
        not in a pass of one row each."""
        taken: list[_Sequence] = []
        while self._waiting and len(taken) < limit:
            seq = self._waiting[0]
            if not _startable(seq):
                break
            taken.append(self._waiting.popleft())
        return taken

    def _group(self, budget: int) -> list[_Sequence]:
        """Waiting sequences, from the head, to prefill together within ``budget`` padded tokens.

        A sequence with a prefix hit joins with the rest of its prompt (its cached positions are merged
        into the group's cache, left-padded as the decode batch is) where every layer's cache is a plain
        KV cache: requests that share a system prompt, the common case, are prefilled in one pass. A sequence with
        nothing left to prefill is passed over, not a reason to stop (it starts just after the group)."""
        group: list[_Sequence] = []
        longest = 0
        room = self._room()
        for seq in self._waiting:
            n = len(seq.prompt) - 1 - seq.prefilled
            if _startable(seq):
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
        return self.kv_quantizer is None and all(type(c) is KVCache for c in make_prompt_cache(self.model))

    def _prefill_together(self, group: list[_Sequence]) -> _Rows:
        """Prefill all but the last prompt token of each sequence in one right-padded forward pass (each from
        its prefix hit, if it has one)."""
        rows = _Rows(list(group), _merge_caches([self._new_cache(s) for s in group]))
        starts = [s.prefilled for s in group]
        lengths = [len(s.prompt) - 1 - start for s, start in zip(group, starts)]
        longest = max(lengths)
        padding = [longest - n for n in lengths]
        tokens = mx.array([s.prompt[start:-1] + [0] * p for s, start, p in zip(group, starts, padding)])
        if any(padding):
            for c in rows.cache:
                c.prepare(lengths=lengths, right_padding=padding)
        hidden = self._decode_pass(tokens, group, rows.cache)[1]
        if hidden is not None:
            for row, (seq, start, n) in enumerate(zip(group, starts, lengths)):
                self._prompt_hidden(seq, start, hidden[row, :n])
        if any(padding):
            for c in rows.cache:
                c.finalize()  # the padding moves to the left, where the batch expects it
        self._quantize_kv(rows.cache)
        mx.eval([c.state for c in rows.cache])
        for row, seq in enumerate(group):
            seq.prefilled = len(seq.prompt) - 1
            self._keep_prefix(seq, _row_slicer(rows.cache, row), state=_row_state(rows.cache, row))
        return rows

    def _start(self, rows: _Rows, out: list[tuple[_Sequence, TokenChunk | None]]) -> None:
        """Run the rows' last prompt tokens, sample and hand out their first tokens; the rows that go on
        wait in ready for the batch."""
        seqs = rows.seqs
        last = mx.array([s.prompt[-1] for s in seqs], dtype=mx.uint32)
        logits, hidden = self._decode_pass(last[:, None], seqs, rows.cache)
        logits = logits[:, -1, :]
        self._quantize_kv(rows.cache)
        for i, seq in enumerate(seqs if hidden is not None else ()):
            self._prompt_hidden(seq, len(seq.prompt) - 1, hidden[i])  # type: ignore[index]
        contexts = [mx.array(s.prompt[-s.sampler.history_window :], dtype=mx.uint32) if s.sampler.processors
                    else None for s in seqs]
        sample = sample_batch(logits, [s.sampler for s in seqs], contexts)
        mx.eval(sample.tokens, *(sample.report.arrays() if sample.report else ()), [c.state for c in rows.cache])
        tokens: list[int] = sample.tokens.tolist()  # type: ignore[assignment]
        for seq, token in zip(seqs, tokens):
            if seq.sampler.constraint is not None:
                seq.sampler.constraint.consume(token)
        logprobs: dict[_Sequence, TokenLogprob] = {}
        if sample.report is not None:
            wanted = [seqs[r] for r in sample.report.rows]
            read = sample.report.read([tokens[r] for r in sample.report.rows],
                                      [s.sampler.top_logprobs or 0 for s in wanted])
            logprobs = dict(zip(wanted, read))
        now = time.perf_counter()
        keep: list[int] = []
        for i, (seq, token) in enumerate(zip(seqs, tokens)):
            finish: FinishReason | None = None
            if token in seq.stop_ids:
                chunk = TokenChunk((), "stop")
                finish = "stop"
            else:
                seq.generated = 1
                self._ttfts.append(now - seq.submitted_at)
                self.stats.generated_tokens += 1
                finish = "length" if seq.max_tokens <= 1 else None
                report = logprobs.get(seq)
                chunk = TokenChunk((token,), finish, (report,) if report is not None else ())
            out.append((seq, chunk))
            if finish is None:
                keep.append(i)
            else:
                self.stats.finished += 1
                self._finish_times.append(now)
        self.stats.prompt_tokens += len(seqs)  # their last prompt tokens
        rows.first = tokens
        rows.keep(keep)
        if rows.seqs:
            self._ready.append(rows)

    def _admit(self, out: list[tuple[_Sequence, TokenChunk | None]]) -> None:
        """Merge the ready rows into the decode batch."""
        if not self._ready:
            return
        ready, self._ready = self._ready, []
        start = time.perf_counter()
        joining = ready[0]
        try:
            for rows in ready[1:]:
                joining.extend(rows)
            self._batch.add(joining)
        except Exception as exc:
            log.exception("could not merge sequences into the batch; failing them")
            self._fail([s for r in ready for s in r.seqs], exc, out)
            return
        self.stats.prefill_seconds += time.perf_counter() - start

    def _decode(self, out: list[tuple[_Sequence, TokenChunk | None]]) -> list[mx.array]:
        """One forward pass for every row; hand out the tokens sampled last step.

        On a GPU the pass is launched here; on the CPU it is returned, for :meth:`_launch` once the
        step's other work is done (there ``async_eval`` computes it before returning). With speculative
        decoding, a step whose rows have drafts verifies them instead (:meth:`_decode_speculative`)."""
        start = time.perf_counter()
        batch = self._batch
        inputs = batch.inputs
        assert inputs is not None
        drafts = self._drafts(inputs)
        if drafts is not None:
            self._decode_speculative(out, drafts[0], drafts[1], start)
            return []
        logits, hidden = self._decode_pass(inputs[:, None], batch.seqs)
        logits = logits[:, -1, :]
        self._quantize_kv(batch.cache)
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
        if self._launch_first:
            # The device computes this step while Python reads and hands out the last one.
            mx.async_eval(*launch)  # type: ignore[no-untyped-call]
        if values is None:
            values = inputs.tolist()  # type: ignore[assignment]
            assert values is not None
        logprobs = self._read_report(batch, values)
        keep: list[int] = []
        emitted = 0
        now = time.perf_counter()
        finished_rows: list[int] = []
        for i, seq in enumerate(batch.seqs):
            token = values[i]
            if hidden is not None and isinstance(seq.draft, MTPDraftState):
                seq.draft.observe(len(seq.prompt) + len(seq.fed), hidden[i])
            seq.fed.append(token)
            if seq.sampler.processors:
                seq.history.append(token)
                if len(seq.history) > 4 * seq.sampler.history_window:
                    del seq.history[: -seq.sampler.history_window]
            if seq.fresh:
                seq.fresh = False  # its input was its first token, handed out when it was sampled
                keep.append(i)
                continue
            finish: FinishReason | None = None
            tokens: tuple[int, ...] = ()
            lps: tuple[TokenLogprob, ...] = ()
            if token in seq.stop_ids:
                finish = "stop"
            else:
                tokens = (token,)
                report = logprobs.get(seq)
                if report is not None:
                    lps = (report,)
                if seq.generated == 0:
                    self._ttfts.append(now - seq.submitted_at)
                seq.generated += 1
                emitted += 1
                if seq.generated >= seq.max_tokens:
                    finish = "length"
            out.append((seq, TokenChunk(tokens, finish, lps)))
            (keep if finish is None else finished_rows).append(i)
        self._retire(batch, finished_rows, now)
        batch.inputs = sample.tokens
        batch.report = (list(batch.seqs), sample.report) if sample.report else None
        batch.keep(keep)
        self.stats.generated_tokens += emitted
        self.stats.decode_steps += 1
        self.stats.decode_seconds += time.perf_counter() - start
        if self._launch_first:
            return []
        # The CPU backend runs most of a step inside async_eval: hand out the tokens
        # first, so trio streams them while the device computes the next ones.
        self._update_gauges()
        self._deliver(out)
        out.clear()
        return launch

    def _retire(self, batch: _DecodeBatch, finished_rows: list[int], now: float) -> None:
        """Count the rows that finished this step; with ``cache_mode = "full"``, give the prefix cache their
        prompt and answer, read from their batch rows before the rows are dropped."""
        self.stats.finished += len(finished_rows)
        self._finish_times.extend([now] * len(finished_rows))
        if self.prefix is not None:
            for i in finished_rows:
                seq = batch.seqs[i]
                if seq.policy.mode == "full":
                    self._keep_prefix(seq, _row_slicer(batch.cache, i), seq.keyed + seq.fed,
                                      state=_row_state(batch.cache, i))

    # ------------------------------------------------------------------ speculative decoding
    def _drafts(self, inputs: mx.array) -> tuple[list[int], list[list[int]]] | None:
        """This step's inputs and each row's draft, when the step should verify drafts: speculation on, a
        batch small enough, every row plain (no penalties, grammar or logprobs) and some row with a draft."""
        spec = self.config.speculative
        batch = self._batch
        if spec.kind == "off" or len(batch) > spec.max_batch or batch.report is not None:
            return None
        if not all(s.sampler.plain for s in batch.seqs) or not self._verifiable(batch.cache):
            return None
        values: list[int] = inputs.tolist()  # type: ignore[assignment]
        states: list[DraftState] = []
        rooms: list[int] = []
        for seq, value in zip(batch.seqs, values):
            state = self._draft_state(seq)
            known = state.count - len(seq.prompt)
            if known < len(seq.fed):
                state.extend(seq.fed[known:])
            state.extend([value])  # the input: its KV is kept whatever the verification says
            states.append(state)
            rooms.append(max(0, seq.max_tokens - seq.generated - (0 if seq.fresh else 1)))
        cost = None if self._launch_first else self._step_cost
        limit = max(rooms)
        if self.draft_model is not None:
            # A drafter's passes cost time too: how far drafting pays is decided before paying for it.
            wants = [0 if s.cool_down else min(r, s.length) for s, r in zip(states, rooms)]
            limit = worth_verifying(wants, states, cost, self._draft_cost)
        started = time.perf_counter()
        drafts = [s.propose(min(r, limit)) for s, r in zip(states, rooms)]  # limit 0: only counts cool-downs
        drafted = sum(len(d) for d in drafts)
        if self.draft_model is not None and drafted:
            self._draft_cost.add(drafted, time.perf_counter() - started)
        width = worth_verifying([len(d) for d in drafts], states, cost)  # drafting is paid for now: verify?
        if width == 0:
            for seq in batch.seqs:  # this step decodes as usual: its inputs join the histories then
                assert seq.draft is not None
                seq.draft.count -= 1
            return None
        return values, [d[:width] for d in drafts]

    def _verifiable(self, cache: list[Any]) -> bool:
        """Whether a verify pass can be cut back per row: plain KV layers, and gated-delta ones rolled back."""
        recurrent = self._recurrent
        if recurrent is not None and not recurrent.covers(cache):
            return False
        recurrent_layers = recurrent.mixers if recurrent is not None else {}
        return all(type(c) in (BatchKVCache, quantized_kv.BatchQuantizedKVCache)
                   for i, c in enumerate(cache) if i not in recurrent_layers)

    def _new_draft_state(self) -> DraftState:
        spec = self.config.speculative
        if isinstance(self.draft_model, MTPDrafter):
            return self.draft_model.new_state(spec)
        return DraftState(spec) if self.draft_model is None else ModelDraftState(spec, self.draft_model)

    def _decode_pass(self, window: mx.array, seqs: list[_Sequence],
                     cache: list[Any] | None = None) -> tuple[mx.array, mx.array | None]:
        """A pass of the model (on the batch's cache unless given): its logits and, when the MTP layers draft,
        the model's final hidden states they draft from (the same pass: no second one)."""
        cache = self._batch.cache if cache is None else cache
        if not isinstance(self.draft_model, MTPDrafter):
            return self._forward(window, cache, seqs), None
        if self.adapters:
            self.adapters.route([s.adapters for s in seqs])
        return self.draft_model.forward(window, cache)

    def _draft_state(self, seq: _Sequence) -> DraftState:
        """The sequence's draft state, made (with its prompt) on first use."""
        if seq.draft is None:
            seq.draft = self._new_draft_state()
            seq.draft.extend(seq.prompt)
        return seq.draft

    def _prompt_hidden(self, seq: _Sequence, start: int, hidden: mx.array | None) -> None:
        """Prefill's hidden states of the prompt from position ``start``: the MTP layers' context."""
        if hidden is not None:
            state = self._draft_state(seq)
            assert isinstance(state, MTPDraftState)
            mx.eval(hidden)  # with its chunk: the pass's graph is not kept for it
            state.observe(start, hidden)

    def _decode_speculative(self, out: list[tuple[_Sequence, TokenChunk | None]], values: list[int],
                            drafts: list[list[int]], start: float) -> None:
        """One forward pass over each row's input and draft; keep what the model accepts.

        Each row keeps its input's KV and its accepted draft tokens' (the rest is trimmed from its cache row:
        uniformly where rows agree, by rolling the remainder into left padding where they differ), hands out
        its input (unless fresh) and accepted tokens, and takes the model's own next token as its next input."""
        batch = self._batch
        width = max(len(d) for d in drafts)
        window = mx.array([[v, *d, *([v] * (width - len(d)))] for v, d in zip(values, drafts)], dtype=mx.uint32)
        if self._recurrent is not None:
            self._recurrent.begin(batch.cache)
        logits, hidden = self._decode_pass(window, batch.seqs)
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
        keep: list[int] = []
        finished_rows: list[int] = []
        next_inputs: list[int] = []
        trims: list[int] = []
        emitted = 0
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
            self.stats.draft_tokens += len(draft)
            self.stats.accepted_tokens += accepted
            if hidden is not None and isinstance(seq.draft, MTPDraftState):
                seq.draft.observe(len(seq.prompt) + len(seq.fed), hidden[i, : accepted + 1])
            seq.fed.extend([values[i], *draft[:accepted]])
            trims.append(width - accepted)
            next_inputs.append(following)
            handed = draft[:accepted] if seq.fresh else [values[i], *draft[:accepted]]
            seq.fresh = False
            tokens: list[int] = []
            finish: FinishReason | None = None
            for token in handed:
                if token in seq.stop_ids:
                    finish = "stop"
                    break
                if seq.generated == 0:
                    self._ttfts.append(now - seq.submitted_at)
                tokens.append(token)
                seq.generated += 1
                if seq.generated >= seq.max_tokens:
                    finish = "length"
                    break
            emitted += len(tokens)
            if tokens or finish is not None:
                out.append((seq, TokenChunk(tuple(tokens), finish)))
            (keep if finish is None else finished_rows).append(i)
        _trim_rows(batch.cache, trims)
        if self._recurrent is not None:
            self._recurrent.keep(batch.cache, [width + 1 - t for t in trims], width + 1)
        self._quantize_kv(batch.cache)
        self._retire(batch, finished_rows, now)
        batch.inputs = mx.array(next_inputs, dtype=mx.uint32)
        batch.report = None
        batch.keep(keep)
        self.stats.generated_tokens += emitted
        self.stats.decode_steps += 1
        self.stats.speculative_steps += 1
        self.stats.decode_seconds += time.perf_counter() - start
        if not self._launch_first:
            self._update_gauges()
            self._deliver(out)
            out.clear()

    def _launch(self, launch: list[mx.array]) -> None:
        """Compute a decode pass :meth:`_decode` left to launch (CPU), counted as decode time."""
        if launch:
            start = time.perf_counter()
            mx.async_eval(*launch)  # type: ignore[no-untyped-call]
            seconds = time.perf_counter() - start
            self.stats.decode_seconds += seconds
            self._step_cost.add(int(launch[0].shape[0]), seconds)

    @staticmethod
    def _read_report(batch: _DecodeBatch, values: list[int]) -> dict[_Sequence, TokenLogprob]:
        """Logprob figures for this step's inputs, by sequence."""
        if batch.report is None:
            return {}
        seqs, report = batch.report
        row_of = {s: i for i, s in enumerate(batch.seqs)}
        wanted = [seqs[r] for r in report.rows]  # rows of the batch as it was when it sampled
        tokens = [values[row_of[s]] if s in row_of else 0 for s in wanted]
        read = report.read(tokens, [s.sampler.top_logprobs or 0 for s in wanted])
        return {s: lp for s, lp in zip(wanted, read) if s in row_of}

    def _fail(self, seqs: list[_Sequence], exc: BaseException,
              out: list[tuple[_Sequence, TokenChunk | None]]) -> None:
        seqs = [*seqs, *(f for s in seqs for f in s.followers)]  # a queued sequence's choices fail with it
        self.stats.failed += len(seqs)
        for seq in seqs:
            seq.handle.error = exc
            seq.cache = seq.embeds = None
            self._drop_hit(seq)
            out.append((seq, None))

    # ------------------------------------------------------------------ prefix cache
    def _new_cache(self, seq: _Sequence) -> list[Any]:
        """A sequence's own cache: built from its prefix hit, or empty."""
        if seq.hit is None or self.prefix is None:
            return make_prompt_cache(self.model)
        hit, seq.hit = seq.hit, None
        cache = self.prefix.build(hit)
        self._quantize_kv(cache)  # a prefix past the start is quantized, as its first sequence's was
        return cache

    def _quantize_kv(self, cache: list[Any]) -> None:
        """After a forward pass (as mlx-lm does): quantize the cache once it is long enough (when set)."""
        if self.kv_quantizer is not None:
            self.kv_quantizer.apply(cache)

    def _drop_hit(self, seq: _Sequence) -> None:
        if seq.hit is not None and self.prefix is not None:
            self.prefix.release(seq.hit)
        seq.hit = None

    @cached_property
    def _snapshots(self) -> bool:
        """Whether the prefix cache keeps this model's recurrent states as snapshots (a hybrid model)."""
        return self.prefix is not None and recurrent(self.windows)

    def _turn_point(self, seq: _Sequence) -> int:
        """Where a hybrid model's prompt gets a snapshot before its end: the last block boundary at least
        ``TURN_MARGIN`` tokens before it (the next turn renders the prompt's last tokens differently)."""
        b = self.prefix.config.block_tokens if self.prefix is not None else 1
        return max(0, len(seq.prompt) - 1 - TURN_MARGIN) // b * b

    def _snapshot_chunk(self, seq: _Sequence, n: int) -> int:
        """A hybrid model's prefill chunk, cut to end on a block boundary (its snapshot then also goes to disk)
        and at the prompt's turn point (its snapshot serves the conversation's next turn)."""
        b = self.prefix.config.block_tokens if self.prefix is not None else 1
        end = seq.prefilled + n
        turn = self._turn_point(seq)
        if seq.prefilled < turn < end:
            return turn - seq.prefilled
        if end < len(seq.prompt) - 1 and end // b * b > seq.prefilled:
            return end // b * b - seq.prefilled
        return n

    def _keep_prefix(self, seq: _Sequence, slicer: Slicer, tokens: list[int] | None = None,
                     state: StateReader | None = None) -> None:
        """Give the prefix cache the blocks it lacks of ``tokens``: prompt and answer when the sequence has
        finished, else its prefilled prompt. A session's turn is its last store (its finish, or its prompt in
        ``prefix`` mode). ``state`` reads a hybrid model's recurrent states there: a snapshot at the prompt's
        end, its turn point and the finish, at its first ``MAX_CHUNK_STATES - 1`` prefill-chunk ends, and at its
        deepest one (each later chunk end's snapshot replaces the one before: a retry resumes from it)."""
        if self.prefix is None:
            return
        last = tokens is not None or seq.policy.mode == "prefix"
        ends = tokens is not None or seq.prefilled >= len(seq.prompt) - 1  # the prompt's end, or the finish
        if not self._snapshots:
            state = None
        rolling = False
        if state is not None and not ends and seq.prefilled != self._turn_point(seq):
            seq.chunk_states += 1
            rolling = seq.chunk_states >= MAX_CHUNK_STATES
        if seq.keys is None:
            seq.keys = BlockKeys(seq.namespace, self.prefix.config.block_tokens)
        try:
            self.prefix.store(seq.namespace, tokens if tokens is not None else seq.keyed[: seq.prefilled], slicer,
                              tail=ends, windows=self.windows, ttl=seq.policy.ttl_seconds,
                              session_id=seq.policy.session_id if last else None, keys=seq.keys, state=state)
            b = self.prefix.config.block_tokens
            if rolling and seq.prefilled % b == 0 and len(seq.keys.keys) >= seq.prefilled // b > 0:
                if seq.rolling_state is not None:
                    self.prefix.forget_state(seq.rolling_state)
                seq.rolling_state = state_key(seq.keys.keys[seq.prefilled // b - 1])
        except Exception:  # the cache is an optimisation: a failure there must not fail the sequence
            log.exception("prefix cache: could not store a sequence's blocks")

    def _deliver_now(self, out: list[tuple[_Sequence, TokenChunk | None]]) -> None:
        """Hand out first tokens as soon as their prompts are done, not at the end of a step that prefills
        more prompts after them (8 short prompts in one step: the first one's client waited for all 8)."""
        self._deliver(out)
        out.clear()

    def _deliver(self, out: list[tuple[_Sequence, TokenChunk | None]]) -> None:
        if not out:
            return
        by_token: dict[trio.lowlevel.TrioToken | None, list[tuple[SequenceHandle, TokenChunk | None]]] = {}
        for seq, chunk in out:
            by_token.setdefault(seq.token, []).append((seq.handle, chunk))
        for token, items in by_token.items():
            if token is None:
                continue  # a follower rank's replicas: rank 0 hands out the tokens
            try:
                token.run_sync_soon(_send_all, items)
            except trio.RunFinishedError:
                pass  # the server's trio run is gone; nobody is listening


def _without(queue: deque[_Sequence], cancelled: set[int]) -> tuple[deque[_Sequence], list[_Sequence]]:
    """A queue of waiting sequences without the cancelled ones (and the list of those). A cancelled sequence
    whose choices live on hands its place — cache, prefix hit, prefill progress — to the first of them."""
    if not any(s.handle.id in cancelled or any(f.handle.id in cancelled for f in s.followers) for s in queue):
        return queue, []
    kept: deque[_Sequence] = deque()
    dropped: list[_Sequence] = []
    for seq in queue:
        alive = [f for f in seq.followers if f.handle.id not in cancelled]
        dropped += [f for f in seq.followers if f.handle.id in cancelled]
        seq.followers = alive
        if seq.handle.id not in cancelled:
            kept.append(seq)
            continue
        dropped.append(seq)
        if alive:
            heir = alive[0]
            heir.cache, heir.hit, heir.prefilled, heir.keys = seq.cache, seq.hit, seq.prefilled, seq.keys
            heir.followers = alive[1:]
            seq.cache, seq.hit, seq.followers = None, None, []
            kept.append(heir)
    return kept, dropped


def _startable(seq: _Sequence) -> bool:
    """Nothing left to prefill (its whole prompt cached, or its last chunk done), and it starts as one row."""
    return not seq.followers and seq.images is None and len(seq.prompt) - 1 - seq.prefilled < 1


def _send_all(items: list[tuple[SequenceHandle, TokenChunk | None]]) -> None:
    """Runs in trio: one call per engine step delivers every sequence's chunk (None: it failed)."""
    for handle, chunk in items:
        if chunk is None:
            handle.finished = True
            handle._send.close()
            continue
        try:
            handle._send.send_nowait(chunk)
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            handle.cancel()  # the reader went away: drop the sequence
            continue
        if chunk.finish_reason is not None:
            handle.finished = True
            handle._send.close()


def _held(layer: Any, row: int | None) -> tuple[Any, Any, int]:
    """A layer's keys and values for one sequence in position order, and the position of the first.

    A full cache holds every position (a batch row after its left padding); a sliding-window
    (rotating) cache only the last ones, possibly wrapped around its ring buffer. A quantized cache's positions
    come packed (runtime.quantized_kv), so blocks keep their codes.
    """
    packed = quantized_kv.held(layer, row)
    if packed is not None:
        return packed[0], packed[1], 0
    if isinstance(layer, (BatchKVCache, KVCache)):
        keys, values = layer.keys, layer.values  # None only before the first token: never read then
        assert keys is not None and values is not None, "a cache is read once it holds positions"
        if isinstance(layer, KVCache):
            return keys, values, 0
        assert row is not None, "a batch cache is read one row at a time"
        pad = int(layer.left_padding[row].item())  # type: ignore[arg-type]  # (an integer array)
        return keys[row : row + 1, :, pad:], values[row : row + 1, :, pad:], 0
    if row is not None:
        layer = layer.extract(row)  # a rotating row, unrolled into position order
        keys, values = layer.keys, layer.values
    else:
        keys, values = layer._temporal_order(layer.keys), layer._temporal_order(layer.values)
    held = min(keys.shape[2], layer.offset)
    return keys[..., keys.shape[2] - held :, :], values[..., keys.shape[2] - held :, :], layer.offset - held


def _slicer(cache: list[Any], row: int | None) -> Slicer:
    # Built on the first read: without a prefix cache nothing reads it. A recurrent layer (Qwen3.5's linear
    # attention, a Mamba layer) holds no positions: its part is None (its state goes as a snapshot, _state).
    held: list[tuple[Any, Any, int] | None] = []

    def read(start: int, end: int) -> list[mx.array | None]:
        if not held:
            held.extend(None if type(c) is ArraysCache else _held(c, row) for c in cache)
        out: list[mx.array | None] = []
        for layer in held:
            if layer is None:
                out += [None, None]
                continue
            keys, values, first = layer
            if start < first:
                out += [None, None]  # a sliding window that has moved past these positions
            else:
                out += [keys[..., start - first : end - first, :], values[..., start - first : end - first, :]]
        return out
    return read


def _state(cache: list[Any], row: int | None) -> StateReader:
    """The recurrent layers' states of one sequence (its own cache, or a row of a batch cache), read when called:
    every ``ArraysCache`` array in layer order."""

    def read() -> list[mx.array]:
        out: list[mx.array] = []
        for layer in cache:
            if type(layer) is ArraysCache:
                for a in layer.cache:
                    if a is None:
                        raise ValueError("a recurrent layer holds no state yet")
                    out.append(a if row is None else a[row : row + 1])
        return out
    return read


def _own_state(cache: list[Any]) -> StateReader:
    return _state(cache, None)


def _row_state(cache: list[Any], row: int) -> StateReader:
    return _state(cache, row)


def _own_slicer(cache: list[Any]) -> Slicer:
    """Positions of a single-sequence cache (one KVCache or RotatingKVCache per layer)."""
    return _slicer(cache, None)


def _row_slicer(cache: list[Any], row: int) -> Slicer:
    """Positions of one row of a left-padded batch cache (BatchKVCache or BatchRotatingKVCache per layer)."""
    return _slicer(cache, row)


def _trim_rows(cache: list[Any], trims: list[int]) -> None:
    """Drop each row's last ``trims[i]`` positions from a batch cache (the draft tokens it rejected): the
    amount all rows share is trimmed, the rest of each row is rolled into its left padding (mlx-lm's own
    right-padding mechanism), so every row's positions stay contiguous and end together."""
    common = min(trims)
    rest = [t - common for t in trims]
    for layer in cache:
        if type(layer) is ArraysCache:
            continue  # a recurrent state: runtime/recurrent_rollback.py cuts it back
        if common:
            layer.trim(common)
        if any(rest):
            layer.prepare(right_padding=rest)
            layer.finalize()


def _merge_caches(caches: list[list[Any]]) -> list[Any]:
    """Single-sequence caches (one list per sequence) → one left-padded batch cache per layer."""
    merged = []
    for layer in zip(*caches):
        quantized = quantized_kv.merge_layer(layer)
        if quantized is not None:
            merged.append(quantized)
            continue
        if not hasattr(layer[0], "merge"):
            raise ValueError(f"{type(layer[0]).__name__} caches cannot be batched")
        merged.append(layer[0].merge(list(layer)))
    return merged


def _kv_bytes_per_token(model: Any) -> int:
    args = getattr(model, "args", None)
    text = getattr(args, "text_config", None)

    def get(key: str) -> Any:
        return text.get(key) if isinstance(text, dict) else getattr(args, key, None)

    return kv_bytes_per_token(get, len(getattr(model, "layers", ())), _activation_itemsize(model))


def _activation_itemsize(model: Any) -> int:
    """Bytes of one activation (and KV) element: the first floating parameter's dtype."""
    for item in tree_flatten(model.parameters()):
        value = item[1] if isinstance(item, tuple) else None
        if isinstance(value, mx.array) and mx.issubdtype(value.dtype, mx.floating):
            return int(value.dtype.size)
    return 2


def _describe(seq: _Sequence) -> NewSequence:
    """A sequence (and its choices) as rank 0 sends it: each choice's sampling with the seed it drew."""
    choices = [seq, *seq.followers]
    return NewSequence(tuple(s.handle.id for s in choices), tuple(seq.prompt), seq.max_tokens,
                       tuple(sorted(seq.stop_ids)), tuple(replace(s.sampler.params, seed=s.sampler.seed)
                                                          for s in choices),
                       seq.prefilled, seq.policy)
