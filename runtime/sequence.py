"""A sequence as the engine holds it, the rows of a batch cache, and the trio side's handle.

A :class:`Sequence` is one choice of one request: its prompt, sampler and progress (prefilled, fed,
generated), its own cache while it waits, and what the prefix cache and a vision model attach to it. The
sequences that decode together are the rows of :class:`Rows` — one left-padded batch cache per layer — and the
decode batch (:class:`DecodeBatch`) adds each row's next input. Which phase moves a sequence from where to where
is ``runtime/engine.py``'s; this module only holds the state and its small verbs.

Never imports the engine, the prefix cache or the device thread: the engine and its collaborators
(``runtime/prefill.py``, ``runtime/decode.py``, ``runtime/speculative_step.py``) import these types.
"""

from __future__ import annotations

import concurrent.futures
import time
from collections import deque
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

import mlx.core as mx
import trio

from protocols.ir import CachePolicy, FinishReason, MessageEnds, PromptImages, TokenChunk
from runtime import quantized_kv
from runtime.adapters import Adapter
from runtime.cache_surgery import merge_caches
from runtime.cross_attention import CrossStates
from runtime.handle import SequenceHandle
from runtime.image_spans import key_tokens
from runtime.prefix_cache import BlockKeys, PrefixHit
from runtime.sampling import LogprobReport, SequenceSampler
from runtime.speculative import DraftState


@dataclass(frozen=True)
class RopePositions:
    """A row's 3-D (M-RoPE) positions, for a vision model whose language model takes them (Qwen2-VL, Qwen2.5-VL,
    Qwen3-VL): computed once from its prompt and images, its own whatever the batch around it.

    A text token at index ``i`` sits at ``i + delta`` in all three dimensions; an image's tokens sit at their
    (t, row, column) in its grid, and the text after the image goes on from the largest of those, so a prompt with
    images ends ``-delta`` positions below its length (mlx-vlm's ``rope_deltas``, which it keeps on the model for
    the one sequence it runs). Generated tokens are text: each at its index plus ``delta``."""

    prompt: mx.array | None  # [3, len(prompt)] int32: the prompt's positions where an image sits in it; else None
    delta: int

    def window(self, start: int, length: int) -> mx.array:
        """The positions of the ``length`` tokens from index ``start`` on: [3, length]."""
        text = mx.arange(start + self.delta, start + self.delta + length, dtype=mx.int32)
        prompt = self.prompt
        if prompt is None or start >= prompt.shape[1]:
            return mx.broadcast_to(text[None], (3, length))
        known = prompt[:, start : start + length]
        tail = length - known.shape[1]
        if tail <= 0:
            return known
        return mx.concatenate([known, mx.broadcast_to(text[None, -tail:], (3, tail))], axis=1)


@dataclass(eq=False)
class Sequence:
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
    followers: list[Sequence] = field(default_factory=list)
    draft: DraftState | None = None  # speculative decoding: its history and draft length (made on first use)
    submitted_at: float = field(default_factory=time.perf_counter)
    images: PromptImages | None = None  # a vision model's prompt with images (their arrays and token spans)
    embeds: mx.array | None = None  # its prompt's input embeddings while an image span is left to prefill
    tower: concurrent.futures.Future[mx.array] | None = None  # its images' vision-tower job, while it runs
    rope: RopePositions | None = None  # its 3-D positions (an M-RoPE vision model), made at its first pass
    # Its images' cross-attention keys, values and prompt mask (a cross-attention vision model), made before its
    # first pass and dropped when it leaves.
    cross: CrossStates | None = None
    label: str = ""  # the request it serves, as logs name it
    message_ends: MessageEnds = MessageEnds()  # where its template's messages end (a hybrid model's snapshots)
    audit: bool = False  # its prefix hit's first logits are recomputed cold and compared (runtime/prefix_audit.py)

    @cached_property
    def keyed(self) -> list[int]:
        """Its prompt as the prefix cache keys it: image positions by their images' digests."""
        return self.prompt if self.images is None else key_tokens(self.prompt, self.images.spans)

    @property
    def to_prefill(self) -> int:
        """Prompt tokens still to prefill: all but the last (which runs in the pass that samples the first token)."""
        return len(self.prompt) - 1 - self.prefilled

    @property
    def startable(self) -> bool:
        """Nothing left to prefill (its whole prompt cached, or its last chunk done), and it starts as one row."""
        return not self.followers and self.images is None and self.to_prefill < 1

    def emit(self, candidates: list[int]) -> tuple[tuple[int, ...], FinishReason | None]:
        """The tokens it hands out of ``candidates`` (sampled, or a draft's accepted ones), in order, up to a stop
        token (not handed out) or its ``max_tokens``; and why it finished, if it did."""
        tokens: list[int] = []
        for token in candidates:
            if token in self.stop_ids:
                return tuple(tokens), "stop"
            tokens.append(token)
            self.generated += 1
            if self.generated >= self.max_tokens:
                return tuple(tokens), "length"
        return tuple(tokens), None

    def emit_one(self, token: int) -> tuple[tuple[int, ...], FinishReason | None]:
        """:meth:`emit` of one sampled token (a decode step's, for every row: no list, no loop)."""
        if token in self.stop_ids:
            return (), "stop"
        self.generated += 1
        return (token,), "length" if self.generated >= self.max_tokens else None


class Rows:
    """Sequences whose KV caches are the rows of one batch cache per layer (left-padded)."""

    def __init__(self, seqs: list[Sequence] | None = None, cache: list[Any] | None = None) -> None:
        self.seqs: list[Sequence] = seqs or []
        self.cache: list[Any] = cache or []
        self.first: list[int] = []  # started rows: each one's first token, its next input
        self.layout = 0  # bumped whenever rows join or leave (what was read of the caches' padding is stale)

    @classmethod
    def merge(cls, seqs: list[Sequence]) -> Rows:
        """Rows made from the sequences' own single-sequence caches, which they give up."""
        rows = cls(list(seqs), merge_caches([s.cache or [] for s in seqs]))
        for seq in seqs:
            seq.cache = None
        return rows

    def __len__(self) -> int:
        return len(self.seqs)

    def extend(self, other: Rows) -> None:
        self.layout += 1
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
        self.layout += 1
        if not keep:
            for seq in self.seqs:
                seq.cross = None
            self.seqs, self.cache, self.first = [], [], []
            return
        for c in self.cache:
            c.filter(keep)
        kept = set(keep)
        for i, seq in enumerate(self.seqs):
            if i not in kept:
                seq.cross = None  # its cross-attention states go with its KV
        self.seqs = [self.seqs[i] for i in keep]
        if self.first:
            self.first = [self.first[i] for i in keep]

    def drop(self, cancelled: set[int]) -> int:
        """Drop the rows of cancelled sequences; how many went."""
        keep = [i for i, s in enumerate(self.seqs) if s.handle.id not in cancelled]
        gone = len(self.seqs) - len(keep)
        self.keep(keep)
        return gone

    @property
    def nbytes(self) -> int:
        """The rows' KV memory, with their cross-attention states (shared by a request's choices: counted once)."""
        cross = {id(s.cross): s.cross.nbytes for s in self.seqs if s.cross is not None}
        return sum(int(c.nbytes) for c in self.cache) + sum(cross.values())


class DecodeBatch(Rows):
    """The rows decoding together, with each row's next input token."""

    def __init__(self) -> None:
        super().__init__()
        self.inputs: mx.array | None = None  # [B] each row's next input token
        # Logprob figures for ``inputs``, for the sequences (as they were then) that asked.
        self.report: tuple[list[Sequence], LogprobReport] | None = None
        self.staying: list[int] | None = None  # the rows that go on, filtered in by settle() (see keep_later)

    def add(self, rows: Rows) -> None:
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
        assert self.staying is None or not keep, "the step's finished rows leave (settle) before the batch changes"
        self.staying = None
        if len(keep) == len(self.seqs):
            return
        super().keep(keep)
        if not keep:
            self.inputs, self.report = None, None
        else:
            assert self.inputs is not None
            self.inputs = self.inputs[mx.array(keep)]

    def keep_later(self, keep: list[int]) -> None:
        """Keep only these rows — at once when none or all go on; else at :meth:`settle`, after the step delivered
        its tokens: filtering a batch cache reads its left padding (mlx-lm's ``filter`` shifts it), which waits for
        the pass the device has in flight, and the step's tokens would wait with it."""
        if keep and len(keep) < len(self.seqs):
            self.staying = keep
        else:
            self.keep(keep)

    def settle(self) -> bool:
        """Filter in the rows :meth:`keep_later` left for after the delivery (whether it did)."""
        staying, self.staying = self.staying, None
        if staying is None:
            return False
        self.keep(staying)
        return True

    def clear(self) -> list[Sequence]:
        """Empty the batch (its rows failed or the group is gone); the sequences it held that go on — not the
        rows of a step that finished and wait for :meth:`settle` to leave: their last chunks are out."""
        seqs = self.seqs if self.staying is None else [self.seqs[i] for i in self.staying]
        self.staying = None
        self.keep([])
        return seqs


@dataclass
class Decoded:
    """What one decode step decided for the batch's rows: the chunks they hand out, which rows go on and which
    finished (indices into the batch as it was), each row's next input, and the pass left to compute (CPU)."""

    chunks: list[tuple[Sequence, TokenChunk]]
    keep: list[int]
    finished: list[int]
    inputs: mx.array
    report: LogprobReport | None = None  # logprob figures for ``inputs``, for the rows that asked
    emitted: int = 0  # tokens handed out
    started: bool = False  # a row's first tokens are among the chunks (they go out at once: runtime.outbox)
    launch: list[mx.array] = field(default_factory=list)


def without(queue: deque[Sequence], cancelled: set[int]) -> tuple[deque[Sequence], list[Sequence]]:
    """A queue of waiting sequences without the cancelled ones (and the list of those). A cancelled sequence
    whose choices live on hands its place — cache, prefix hit, prefill progress — to the first of them."""
    if not any(s.handle.id in cancelled or any(f.handle.id in cancelled for f in s.followers) for s in queue):
        return queue, []
    kept: deque[Sequence] = deque()
    dropped: list[Sequence] = []
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
            # A vision prompt's images go on with it: their spans still to prefill, their positions.
            heir.images, heir.embeds, heir.tower, heir.rope = seq.images, seq.embeds, seq.tower, seq.rope
            heir.cross, heir.followers = seq.cross, alive[1:]
            seq.cache, seq.hit, seq.followers, seq.embeds, seq.tower, seq.cross = None, None, [], None, None, None
            kept.append(heir)
    return kept, dropped
