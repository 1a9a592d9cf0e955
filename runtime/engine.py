"""The generation engine of one model: continuous batching on the device thread.

Theory of operation
-------------------
Trio code calls :meth:`Engine.submit`, which queues a sequence and returns a
:class:`runtime.sequence.SequenceHandle` whose ``chunks`` channel yields :class:`TokenChunk`
items; past ``max_queue`` waiting sequences it raises :class:`EngineOverloaded`
instead. Everything else happens on the device thread, in :meth:`Engine.step`.

A step is its phases in the order of ``runtime/step_phases.py``'s table for the
engine's strategy and device — decide (``intake``: new sequences and
cancellations; ``admit``: started rows join the batch), execute (``decode``,
``prefill``, ``launch``) and deliver — and nothing else. Each phase is a
collaborator's small verb:

* **prefill** (``runtime/prefill.py``): waiting prompts, oldest first, within the
  step's budget — short ones together in one right-padded pass, others alone in
  chunks that may span steps, every pass at most ``prefill_chunk`` tokens — and
  each started group's **first tokens**, handed out at once; the started rows
  wait as *ready*. The budget is one chunk; while more prompts wait than rows
  decode (a burst), up to ``prefill_burst``: a decode pass reads the whole model
  for 6 rows as for 32, so a burst's first group does not decode alone while the
  rest wait one chunk a step.
* **the decode batch** (``runtime/sequence.py`` ``DecodeBatch``): one
  left-padded batch KV cache per layer (mlx-lm's ``BatchKVCache`` /
  ``BatchRotatingKVCache``); ready rows are merged in by ``admit``, with their
  first token as their next input. ``runtime/decode.py`` runs its step — one
  pass for every row, or the speculator's verify pass
  (``runtime/speculative_step.py``) — and returns what each row hands out;
  finished and cancelled rows are removed with the caches' ``filter``.
* **delivery** (``runtime/outbox.py``): every chunk a phase decided goes to
  trio through the outbox, in **one** ``run_sync_soon`` crossing per trio run
  per flush.
* **the prefix cache** (``runtime/prefix_keeper.py``): hits build a sequence's
  own cache; prompt blocks (and a hybrid model's recurrent-state snapshots) are
  stored after every prefill chunk, a finished answer's with
  ``cache_mode = "full"``.
* **replication** (``runtime/replication.py``): a distributed model's rank 0
  sends each step's intake to the other ranks, which replay it.

A cancelled sequence (its client left) leaves at its next chunk boundary,
wherever it is: cancellations are applied at the start of every step *and*
before every prefill pass within one (a step may prefill parts of several
prompts), so it costs at most the pass that was running when it was
cancelled — never the rest of its prompt, nor someone else's chunk — and its
own cache is dropped then. The blocks of the chunks it did finish stay in the
prefix cache (a client that gave up on a long prompt often retries it).

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

import hashlib
import itertools
import logging
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable
from dataclasses import asdict, replace
from functools import cached_property
from typing import Any

import mlx.core as mx
import trio
from mlx.utils import tree_flatten
from mlx_lm.models.cache import make_prompt_cache

from protocols.ir import CachePolicy, MessageEnds, PromptImages, SamplingParams, TokenChunk
from runtime import arrivals, quantized_kv
from runtime.adapters import Adapter, AdapterSet
from runtime.constrained import Constraint
from runtime.decode import Decoder
from runtime.device import DeviceThread
from runtime.engine_config import EngineConfig, EngineOverloaded, SpeculativeConfig
from runtime.engine_stats import Tally
from runtime.model_memory import kv_bytes_per_token
from runtime.mtp import MTPDrafter
from runtime.outbox import Outbox
from runtime.pass_cost import PassCost
from runtime.passes import ModelPasses
from runtime.prefill import Prefill
from runtime.prefix_audit import PrefixAuditor
from runtime.prefix_cache import PrefixCache, PrefixHit, layer_windows
from runtime.prefix_keeper import PrefixKeeper
from runtime.replication import (
    GroupLost,
    NewSequence,
    ReplicaDiverged,
    Replicator,
    StepMessage,
)
from runtime.sampling import SequenceSampler
from runtime.handle import SequenceHandle
from runtime.sequence import DecodeBatch, Rows, Sequence, without
from runtime.speculative_step import Speculator
from runtime.step_phases import Phase, phases

log = logging.getLogger("flow.engine")

# How often a decode step reads the KV bytes it holds (a gauge) while its rows stay the same.
KV_GAUGE_SECONDS = 0.25


class Engine:
    """Runs sequences of one model on the device thread, batched."""

    def __init__(self, model: Any, device: DeviceThread, config: EngineConfig = EngineConfig(),
                 prefix: PrefixCache | None = None, namespace: bytes = b"",
                 replicator: Replicator | None = None, draft_model: Any = None) -> None:
        self.device = device
        if (config.speculative.kind in ("draft", "mtp")) != (draft_model is not None) or \
                (config.speculative.kind == "mtp") != isinstance(draft_model, MTPDrafter):
            raise ValueError("speculative kind 'draft' needs a draft model, kind 'mtp' the model's MTP drafter, "
                             "and a drafter needs its kind")
        if replicator is not None and config.speculative.kind != "off":
            # Whether a step verifies drafts depends on timings measured on each rank: not rank-consistent.
            log.warning("speculative decoding is off for a distributed model")
            config = replace(config, speculative=SpeculativeConfig())
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
        self._tally = Tally()
        self.stats = self._tally.stats
        self._ids = itertools.count(1)
        self._lock = threading.Lock()
        self._inbox: deque[Sequence] = deque()
        # The trio side's open streams, so they can be ended without the device thread (see end_streams).
        self._streams: weakref.WeakSet[SequenceHandle] = weakref.WeakSet()
        self._cancelled: set[int] = set()
        self._kv_per_token: int | None = None
        self._gauged_rows: tuple[int, int, int, type | None] = (-1, -1, -1, None)  # rows, cache kind when last read
        self._gauged_at = 0.0
        # Device-thread state: the collaborators each phase calls, and the decode batch.
        # On a GPU, async_eval returns at once: launch step n+1, then read step n (pipelined, like
        # mlx_lm.generate_step). On the CPU it computes most of the step before returning (runtime/step_phases.py).
        pipelined = mx.default_device().type != mx.DeviceType.cpu
        self._phases = phases(config.strategy, pipelined)
        self._batch = DecodeBatch()
        self._outbox = Outbox(config.stream_interval)
        self._passes = passes = ModelPasses(model, self.adapters, draft_model, self.kv_quantizer)
        self._keeper = PrefixKeeper(self.prefix, self.windows, passes)
        step_cost = PassCost(weight=0.05)  # decode passes' seconds by the tokens they hold
        self.speculator = Speculator(config.speculative, draft_model, model, passes, self._tally, step_cost,
                                     pipelined)
        self._decoder = Decoder(passes, self.speculator, self._keeper, self._tally, step_cost, pipelined)
        self._auditor = PrefixAuditor(self.prefix, passes, config.prefill_chunk)
        self.prefill = Prefill(passes, self._keeper, self.speculator, self._tally, self._outbox, self._auditor,
                               room=self._room, batch_rows=lambda: len(self._batch),
                               between_passes=self._drop_cancelled, fail=self._fail, wake=device.wake)
        self._launch: list[mx.array] = []  # CPU: the batch's pass decode left for the launch phase
        self._skip_prefill = False  # balanced: this step is a pure decode step
        self._run: dict[Phase, Callable[[], bool]] = {
            Phase.INTAKE: self._intake, Phase.DECODE: self._decode, Phase.PREFILL: self._prefill,
            Phase.LAUNCH: self._launch_pass, Phase.ADMIT: self._admit, Phase.DELIVER: self._deliver,
            Phase.KEEP: self._keep, Phase.AUDIT: self._audit, Phase.CLOSE: self._close_step,
        }
        self._steps = self._bound_steps()
        device.add_stepper(self)

    @property
    def model(self) -> Any:
        """The model every pass runs (one holder: runtime/passes.py's; tests wrap it to act during a pass)."""
        return self._passes.model

    @model.setter
    def model(self, model: Any) -> None:
        self._passes.model = model

    # ------------------------------------------------------------------ trio side
    async def match_prefix(self, prompt: list[int], policy: CachePolicy = CachePolicy(),
                           adapters: tuple[Adapter, ...] = (), images: PromptImages | None = None) -> PrefixHit | None:
        """The prefix cache's longest match for ``prompt`` (None without a cache); pass it to :meth:`submit`, with
        the same ``adapters`` and ``images`` (a cross-attention model keys an image row's blocks by all its images).

        Runs on a worker thread: a warm match reads its blocks from disk. The thread cannot be abandoned, so
        a caller cancelled meanwhile (its client left) gets :class:`trio.Cancelled` once the match is done,
        with the hit released: it must not go on to submit a sequence nobody waits for.
        """
        if self.prefix is None or len(prompt) <= self.prefix.config.block_tokens:
            return None
        prefix, namespace = self.prefix, self.namespace_for(adapters, images)

        def match() -> PrefixHit:
            prefix.settled()  # an answer that just ended is stored after its stream's end: this turn waits for it
            return prefix.match(namespace, prompt, self.windows, policy.ttl_seconds)
        hit = await trio.to_thread.run_sync(match)
        try:
            await trio.lowlevel.checkpoint_if_cancelled()
        except BaseException:
            prefix.release(hit)
            raise
        return hit if hit.blocks else None

    def submit(self, prompt: list[int], *, max_tokens: int, stop_ids: frozenset[int], sampling: SamplingParams,
               prefix: PrefixHit | None = None, policy: CachePolicy = CachePolicy(),
               constraint: Constraint | None = None, adapters: tuple[Adapter, ...] = (),
               images: PromptImages | None = None, label: str = "",
               message_ends: MessageEnds = MessageEnds()) -> SequenceHandle:
        """Queue a sequence; raises :class:`EngineOverloaded` when ``max_queue`` sequences wait.

        ``prefix`` is a hit of :meth:`match_prefix` for this prompt; the engine
        takes over its references (also when it refuses the sequence).
        ``policy`` says what of the sequence the prefix cache keeps; ``constraint`` (structured output) masks
        the tokens its grammar does not allow at each step; ``adapters`` (mounted on this engine) apply to its
        rows, and ``prefix`` must come from a match with the same adapters. ``images`` (a vision model's prompt)
        are embedded by the model where their tokens sit; ``prefix`` must come from a match of the prompt's
        :func:`runtime.vision.key_tokens`. ``label`` names the request in logs (a prefix audit's disagreement);
        ``message_ends``: where the prompt's system messages and all its messages end (a hybrid model keeps state
        snapshots there).
        """
        return self.submit_choices(prompt, [(sampling, constraint)], max_tokens=max_tokens, stop_ids=stop_ids,
                                   prefix=prefix, policy=policy, adapters=adapters, images=images, label=label,
                                   message_ends=message_ends)[0]

    def submit_choices(self, prompt: list[int], choices: list[tuple[SamplingParams, Constraint | None]], *,
                       max_tokens: int, stop_ids: frozenset[int], prefix: PrefixHit | None = None,
                       policy: CachePolicy = CachePolicy(), adapters: tuple[Adapter, ...] = (),
                       images: PromptImages | None = None, label: str = "",
                       message_ends: MessageEnds = MessageEnds()) -> list[SequenceHandle]:
        """Queue one sequence per choice (its sampling and constraint) for one prompt, prefilled **once**: the
        choices become rows of the batch from copies of the first one's cache, each sampling its own tokens."""
        try:
            samplers = [SequenceSampler(sampling, constraint) for sampling, constraint in choices]
            if images is not None and not hasattr(self.model, "embed_prompt"):
                raise ValueError("this model does not read images")
            return self._submit(prompt, max_tokens, stop_ids, samplers, prefix, policy, adapters, images, label,
                                message_ends)
        except BaseException:
            if prefix is not None and self.prefix is not None:
                self.prefix.release(prefix)
            raise

    def _submit(self, prompt: list[int], max_tokens: int, stop_ids: frozenset[int], samplers: list[SequenceSampler],
                prefix: PrefixHit | None, policy: CachePolicy, adapters: tuple[Adapter, ...],
                images: PromptImages | None = None, label: str = "",
                message_ends: MessageEnds = MessageEnds()) -> list[SequenceHandle]:
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
            retry = self._tally.retry_after(waiting - self.config.max_queue + 1)
            raise EngineOverloaded(f"{waiting} requests are already waiting for this model "
                                   f"(max_queue {self.config.max_queue})", retry)
        seqs = []
        for i, sampler in enumerate(samplers):
            send, receive = trio.open_memory_channel[TokenChunk](float("inf"))
            handle = SequenceHandle(next(self._ids), send, receive, self._cancel)
            seqs.append(Sequence(handle=handle, token=trio.lowlevel.current_trio_token(), prompt=list(prompt),
                                 max_tokens=max_tokens, stop_ids=stop_ids, sampler=sampler,
                                 policy=policy, adapters=adapters, namespace=self.namespace_for(adapters, images),
                                 hit=prefix if i == 0 else None, prefilled=cached_tokens,
                                 keys=prefix.keys if prefix is not None and i == 0 else None,
                                 images=images if i == 0 else None, label=label, message_ends=message_ends))
            handle.cached_tokens = cached_tokens
            if self.prefix is not None and i == 0:  # the choices after the first share its prefill
                b = self.prefix.config.block_tokens
                handle.cache_write_tokens = max(0, (len(prompt) - 1) // b * b - cached_tokens)
        leader = seqs[0]
        leader.followers = seqs[1:]
        # A sampled share of hits is audited: its first logits against a cold run's (runtime/prefix_audit.py). Not
        # on a distributed model: a cold rerun on rank 0 alone would issue collectives the other ranks never join.
        leader.audit = (prefix is not None and images is None and self._replicator is None
                        and (policy.audit or self._auditor.wants()))
        self._streams.update(s.handle for s in seqs)
        with self._lock:
            self._inbox.append(leader)
            self.stats.submitted += len(seqs)
            self.stats.cached_tokens += cached_tokens
        arrivals.submitted()  # in the inbox: an idle engine no longer waits for this request
        self.device.wake()
        return [s.handle for s in seqs]

    def namespace_for(self, adapters: tuple[Adapter, ...], images: PromptImages | None = None) -> bytes:
        """The prefix-cache namespace of sequences run with ``adapters``: the model's, or one derived from it
        and the adapters' digests (their weights and config, never their names), in stacking order.

        A cross-attention model's image row (runtime/cross_attention.py) has one of its own images too, from their
        digests in prompt order: every token's KV depends on all of them (a token before the first image attends to
        every image), so its blocks serve only a prompt with the same images in the same order — the next turn of
        a conversation with the same pictures, never a text row or a row with other images."""
        namespace = self.namespace
        if adapters:
            namespace = hashlib.sha256(namespace + b"".join(a.digest for a in adapters)).digest()[:16]
        if images is not None and self._passes.cross:
            digests = b"".join(span.digest for span in images.spans)
            namespace = hashlib.sha256(namespace + b"cross-attention images" + digests).digest()[:16]
        return namespace

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
        seqs = [*queued, *self.prefill.sequences(), *self._batch.seqs]
        return sum(adapter in s.adapters for s in seqs)

    def _sweep_adapters(self) -> None:
        for adapter in [a for a in self.adapters.adapters if a.retiring]:
            if not self._users_of(adapter):
                self.adapters.unmount(adapter)

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
    def keeps_snapshots(self) -> bool:
        """Its prefix cache keeps recurrent-state snapshots (a hybrid model): a prompt's turn point is worth knowing."""
        return self._keeper.snapshots

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
        return len(self._inbox) + self.prefill.held

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
        out = self._tally.json()
        out.update(
            active=self.active,
            waiting=self.waiting,
            strategy=self.config.strategy,
            max_batch=self.config.max_batch,
            prefill_chunk=self.config.prefill_chunk,
            prefill_burst=self.config.prefill_burst,
            stream_interval_ms=round(self.config.stream_interval * 1000, 3),
            max_queue=self.config.max_queue,
            kv_bytes_per_token=self.kv_bytes_per_token(),
            prefix_cache="on" if self.prefix is not None else
                         f"off: {self.prefix_unsupported}" if self.prefix_unsupported else "off",
        )
        if self.kv_quantizer is not None:  # the live batch's quantized KV
            out["kv_quantization"] = asdict(self.kv_quantizer)
        features = getattr(self.model, "features", None)
        if features is not None:  # a vision model: its tower passes and the feature cache's use
            out["vision"] = {"tower_passes": self.model.tower_passes, "feature_hits": features.hits,
                             "feature_misses": features.misses, "cached_images": len(features)}
        return out

    # ------------------------------------------------------------------ device side: the step
    def has_work(self) -> bool:
        return bool(self._inbox or self._batch.seqs or self._cancelled or self.prefill.has_work()
                    or self._auditor.pending)

    def step(self) -> None:
        """One engine step: intake, the work phases in the order ``runtime/step_phases.py`` gives for the
        strategy and the device, close. A work phase that fails fails the decode batch; the step still closes."""
        intake, work, close = self._steps
        if not intake():
            return
        try:
            for phase in work:
                phase()
        except Exception as exc:
            if not self._step_failed(exc):
                return
        close()

    def _bound_steps(self) -> tuple[Callable[[], bool], tuple[Callable[[], bool], ...], Callable[[], bool]]:
        """The step's phases as the methods that run them, looked up once (a step's own Python is tens of
        microseconds): intake, the work phases, close."""
        intake, *work, close = (self._run[p] for p in self._phases)
        return intake, tuple(work), close

    def _intake(self) -> bool:
        """The sequences that arrived and the cancellations (distributed: as rank 0's step message says). False:
        the distributed group is gone, the step ends here."""
        if self._replicator is not None:
            return self._replicate()
        self._take_inbox()
        self._drop_cancelled()
        return True

    def _take_inbox(self) -> None:
        """The sequences submitted so far join the prefill queue."""
        if not self._inbox:
            return  # read without the lock: one submitted meanwhile is taken at the next step
        with self._lock:
            taken = list(self._inbox)
            self._inbox.clear()
        self.prefill.queue(taken)

    def _decode(self) -> bool:
        if self._batch.seqs:
            # No prompt waits: on the CPU too, this step's pass runs before the last step's tokens are read.
            decoded = self._decoder.step(self._batch, early=not self.prefill.has_work())
            self._outbox.put_all(decoded.chunks, urgent=decoded.started or bool(decoded.finished))
            self._launch = decoded.launch
            if decoded.finished:
                # before the chunks are delivered: a client that got its last token sees them (a row that finished
                # beside others leaves the batch at keep, which reads them again)
                self._update_gauges()
        return True

    def _prefill(self) -> bool:
        if not self.prefill.waiting and not self.prefill.towers:
            return True  # nothing to prefill: most steps of a decoding batch
        self._gather()
        self.prefill.run(self._prefill_budget(), self.config.prefill_chunk)
        return True

    def _gather(self) -> None:
        """An idle engine's new prompts wait for the rest of their burst (``runtime/arrivals.py``), so it is
        prefilled in full groups and its rows join the batch together rather than a pass apart. Not while rows
        decode (new prompts join them at the next step anyway), while another model has work on the device (it
        would wait too), nor on a distributed model (every rank must take the same prompts in the same step)."""
        if (self._batch.seqs or self.prefill.ready or not self.prefill.waiting or self._replicator is not None
                or not arrivals.ARRIVING.count or self.device.contended(self)):
            return
        arrivals.ARRIVING.wait(min(s.submitted_at for s in self.prefill.waiting))
        self._take_inbox()  # the prompts that came meanwhile (cancellations: before the first pass, as always)

    def _launch_pass(self) -> bool:
        launch, self._launch = self._launch, []
        self._decoder.launch(launch)
        return True

    def _admit(self) -> bool:
        """Merge the ready rows into the decode batch."""
        ready = self.prefill.take_ready()
        if not ready:
            return True
        start = time.perf_counter()
        joining = ready[0]
        try:
            for rows in ready[1:]:
                joining.extend(rows)
            self._batch.add(joining)
        except Exception as exc:
            log.exception("could not merge sequences into the batch; failing them")
            self._fail([s for r in ready for s in r.seqs], exc)
            return True
        self.stats.prefill_seconds += time.perf_counter() - start
        return True

    def _deliver(self) -> bool:
        self._outbox.flush()
        return True

    def _keep(self) -> bool:
        """After the step's tokens went out: the finished rows leave the batch, and go to the prefix cache."""
        if self._batch.settle():
            self._update_gauges()
        self._keeper.store_finished()
        return True

    def _audit(self) -> bool:
        """Idle device time (nothing decodes, nothing waits): one chunk of a prefix-cache hit's cold rerun."""
        if self._auditor.pending and not self._batch.seqs and not self.prefill.held and not self._inbox:
            self._auditor.run_chunk()
        return True

    def _close_step(self) -> bool:
        self._tally.step_done()
        self._update_gauges()
        if self.stats.steps % 256 == 0:  # a long run's buffers; an idle device releases the rest (DeviceThread)
            mx.clear_cache()
        if self.adapters:
            self._sweep_adapters()
        self._outbox.flush(force=not self._batch.seqs)  # no row decodes on: none of its tokens may wait
        if self._replicator is not None:
            self._replicator.step_done()
        return True

    def _step_failed(self, exc: Exception) -> bool:
        """A work phase raised: fail the decode batch (whether to close the step)."""
        log.exception("engine step failed; failing its batch")
        self._launch = []
        self._keeper.drop_finished()
        if self._replicator is not None:
            # The ranks may no longer hold the same batch: the group cannot go on.
            if not self._replicator.leader:
                raise exc
            self._outbox.flush()
            self.group_lost(exc)
            return False
        self._fail(self._batch.clear(), exc)
        return True

    def _prefill_budget(self) -> int:
        """The step's prompt tokens: one chunk; while more prompts wait than rows decode, up to
        ``prefill_burst`` chunks (a burst's later groups start before the first ones decode alone: every decode
        pass reads the whole model, for 6 rows as for 32)."""
        chunk = self.config.prefill_chunk
        rows = len(self._batch)
        if self.config.strategy == "balanced" and rows >= max(1, self.config.max_batch // 2):
            self._skip_prefill = not self._skip_prefill
            return 0 if self._skip_prefill else chunk
        waiting = len(self.prefill.waiting)
        if waiting > rows:
            return chunk * min(self.config.prefill_burst, -(-waiting // max(rows, 1)))
        return chunk

    def _room(self) -> int:
        return self.config.max_batch - len(self._batch) - self.prefill.ready_rows

    def _update_gauges(self) -> None:
        s = self.stats
        s.batch_size = len(self._batch)
        s.peak_batch = max(s.peak_batch, s.batch_size)
        # The KV bytes are a sum over every layer's arrays: read when the rows or the cache's kind change (a batch
        # turning quantized), else a few times a second, not on every step (on a small model that sum cost a tenth
        # of a step).
        cache = self._batch.cache
        rows = (s.batch_size, len(self.prefill.ready), len(self.prefill.waiting), type(cache[0]) if cache else None)
        now = time.monotonic()
        if rows != self._gauged_rows or now - self._gauged_at >= KV_GAUGE_SECONDS:
            self._gauged_rows, self._gauged_at = rows, now
            s.kv_bytes = self._batch.nbytes + self.prefill.kv_bytes

    # ------------------------------------------------------------------ cancellations and failures
    def _drop_cancelled(self, started: Rows | None = None) -> None:
        """Drop the sequences cancelled so far, wherever they are (also from ``started``: rows just prefilled
        together, about to run their first tokens); their KV memory goes with them.

        Runs at the start of every step and before every pass of prefill work within one, so a cancelled
        sequence costs at most the pass that was running when it was cancelled. Distributed, cancels apply at
        a step's start only, from its message (:meth:`_replicate`): every rank must drop the same rows."""
        if self._replicator is not None or not self._cancelled:
            return  # (read without the lock: a cancel that comes meanwhile is applied at the next check)
        with self._lock:
            if not self._cancelled:
                return
            cancelled, self._cancelled = self._cancelled, set()
            # Within a step, sequences submitted since its start are still in the inbox: they leave from there.
            self._inbox, dropped = without(self._inbox, cancelled)
        self._apply_cancels(cancelled, dropped, started)

    def _apply_cancels(self, cancelled: set[int], dropped: list[Sequence], started: Rows | None = None) -> None:
        waiting, gone = self.prefill.drop(cancelled, started)
        dropped = [*dropped, *waiting]
        for seq in dropped:
            self._release(seq)  # its own cache (a prefill in progress) is freed now, not with the step
        self.stats.cancelled += gone + len(dropped) + self._batch.drop(cancelled)

    def _release(self, seq: Sequence) -> None:
        self._keeper.drop_hit(seq)
        seq.cache = seq.embeds = seq.cross = None

    def _fail(self, seqs: list[Sequence], exc: BaseException) -> None:
        seqs = [*seqs, *(f for s in seqs for f in s.followers)]  # a queued sequence's choices fail with it
        self.stats.failed += len(seqs)
        for seq in seqs:
            seq.handle.error = exc
            self._release(seq)
            self._outbox.put(seq, None)

    # ------------------------------------------------------------------ distributed (runtime.replication)
    def _replicate(self) -> bool:
        """The distributed intake: rank 0 takes its inbox and cancels and sends them as the step's message; a
        follower receives it and builds the same sequences. False on rank 0 when the group is gone (every
        sequence failed); a follower's errors end its loop."""
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
        self.prefill.queue(taken)
        if message.cancelled:
            self._apply_cancels(set(message.cancelled), [])
        return True

    def _replica(self, new: NewSequence) -> Sequence:
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
            seqs.append(Sequence(handle=SequenceHandle(seq_id, send, receive, self._cancel), token=None,
                                 prompt=list(new.prompt), max_tokens=new.max_tokens, stop_ids=frozenset(new.stop_ids),
                                 sampler=SequenceSampler(sampling), policy=new.policy, namespace=self.namespace,
                                 hit=hit if i == 0 else None, prefilled=new.cached,
                                 keys=hit.keys if hit is not None and i == 0 else None))
        seqs[0].followers = seqs[1:]
        self.stats.submitted += len(seqs)
        self.stats.cached_tokens += new.cached
        return seqs[0]

    def group_lost(self, exc: BaseException, taken: list[Sequence] | None = None) -> None:
        """Rank 0 lost its group: fail every sequence, run nothing more (the server reports the model down)."""
        lost = exc if isinstance(exc, GroupLost) else GroupLost(f"the model's group of ranks is gone: {exc}")
        said = self.lost is not None  # by the supervisor (flow.resources.cluster), or an earlier call
        self.lost = lost = self.lost or lost  # the first reason
        taken = list(taken or ())
        with self._lock:
            taken += list(self._inbox)
            self._inbox.clear()
            self._cancelled.clear()
        seqs = [*taken, *self.prefill.clear(), *self._batch.clear()]
        if seqs:
            log.error("%s; failing the model's %d sequences", lost, len(seqs))
        elif not said:
            log.info("%s", lost)
        self._fail(seqs, lost)
        self._outbox.flush()
        self.device.remove_stepper(self)


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


def _describe(seq: Sequence) -> NewSequence:
    """A sequence (and its choices) as rank 0 sends it: each choice's sampling with the seed it drew."""
    choices = [seq, *seq.followers]
    return NewSequence(tuple(s.handle.id for s in choices), tuple(seq.prompt), seq.max_tokens,
                       tuple(sorted(seq.stop_ids)), tuple(replace(s.sampler.params, seed=s.sampler.seed)
                                                          for s in choices),
                       seq.prefilled, seq.policy)
