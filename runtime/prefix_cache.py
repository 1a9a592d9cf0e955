"""The prefix cache: KV blocks keyed by chained token hashes, shared by every sequence.

Theory of operation
-------------------
A token sequence is cut into blocks of ``block_tokens`` tokens. Block *i*'s key
is a hash over block *i-1*'s key and block *i*'s token ids, and block 0's over
the model's *namespace* (its weights' identity), so a key names the whole prefix
up to the end of its block: equal keys, equal prefixes. The blocks of all
conversations thereby form a prefix trie. :meth:`PrefixCache.match` walks a
prompt's keys from the start and stops at the first block the cache lacks; the
engine prefills the prompt from there. An exact repeat, the next turn of a
conversation and a system prompt shared by several sessions are all the same
case: a longest cached prefix.

A sequence rarely ends on a block boundary. Its *tail* — the tokens after its
last full block, fewer than a block — is kept too, in memory only, keyed by a
hash over that last block's key and the tail's tokens. A match that has walked
the full blocks tries the tails that would continue it, longest first, so the
next turn of a conversation (whose prompt repeats the previous answer, then
adds to it) reuses every token of the previous turn, not just its full blocks;
an exact repeat of a prompt longer than a block reuses all of it but the last
token. Tails are stored where a later request may continue: at a prompt's end
and when a sequence finishes (not after every prefill chunk). Sliding-window
models keep whole blocks only (their layers need blocks aligned to positions).

A block holds every layer's keys and values for its tokens, copied out of a
sequence's cache on the device thread: after the prompt's prefill (so a
concurrent session with the same system prompt can reuse it at once), and when
the sequence finishes (prompt and answer, for the conversation's next turn;
``cache_mode = "prefix"`` skips that). The engine's attention wants one
contiguous cache per sequence, so :meth:`build` concatenates the matched blocks
into a private cache for the sequence; the cache itself holds each block once,
however many conversations share it, and the memory a new session adds to it is
that of its own blocks. A block cut from a row whose live KV is quantized (the model's
``kv_bits``, :mod:`runtime.quantized_kv`) holds its codes as they are, packed in one
``uint32`` array per layer's keys and values (the disk tier stores those as they are),
and :meth:`build` rebuilds a quantized cache from such blocks; the engine folds the
setting into the namespace, so those blocks never meet a full-precision model's.

Reference counts: :meth:`match` takes a reference on every block it matched;
:meth:`build` (or :meth:`release`, for a sequence that left before) drops them.
A referenced block is never evicted.

Tiers: *hot* blocks are in memory, within ``hot_bytes``; the least recently
used unreferenced blocks leave first (a match touches its blocks deepest first,
so a leaf leaves before its parent). With a :class:`DiskTier`, every full block
with a non-zero TTL is also written to disk in the background; a block evicted from
memory stays *warm* there, and a match reads it back. A block lives until its
expiry (its requests' TTL after their last use: Anthropic ``cache_control``,
OpenAI ``ttl``, else ``default_ttl``); then it is deleted (*cold*).

Sliding-window layers (Gemma 3's rotating caches) only ever hold the last
``window`` positions, so their part of a block is kept only when the block is
copied out while those positions are still held: blocks are stored after every
prefill chunk (a chunk's positions are all there then), and at the finish for
answers no longer than the window. A block whose sliding-window part is missing
still serves the global layers of longer prefixes; a prefix is reused only up
to a depth whose last ``window`` positions all have their sliding-window part,
and the rebuilt rotating cache holds exactly those, as mlx-lm's own would.
Recurrent layers (hybrid models: Qwen3.5's and Qwen3-Next's gated-delta layers, Granite 4.0-H's, Nemotron-H's
and Mamba-2's Mamba-2 layers, LFM2's short convolutions; mlx-lm's ``ArraysCache``) hold no positions: a layer's
state after position *d*
(its convolution window and its recurrent matrix) is a fixed-size array set that depends on every token before
*d*. Their part of a block is empty; they are kept as *state snapshots* instead — every recurrent layer's state
at one position, as one more entry of the cache (a :class:`Block` of no tokens), keyed by
:func:`state_key` over the key of the prefix that ends there (so keyed like blocks: model, adapters, images,
dtype, all in the namespace), counted in ``hot_bytes`` and evicted by the same LRU. The engine stores one at
every prefill-chunk end (chunks end on block boundaries on such models, a bounded number per sequence), at the
prompt's end and at the finish. A hit needs both parts at one depth *d*: the attention layers' blocks up to *d*
(a block cut at *d* when *d* falls inside it, or a tail ending at *d*) and a snapshot at exactly *d*; the match
takes the deepest such *d* and the rest of the prompt is prefilled from there. Snapshots at block boundaries go
to the disk tier too (with the blocks' checksums), and so do those inside a block where a prompt's messages end
(the engine asks): after a restart such a snapshot serves once a later prompt has filled its block. The others
need a tail, which lives in memory only.
A layer may keep both (Falcon-H1's attention and Mamba-2 mixer side by side: mlx-lm's ``CacheList`` of an
``ArraysCache`` and a ``KVCache``): its keys and values go into the blocks like any full layer's, its state into
the snapshots. A model without attention layers (Mamba-2) keeps blocks that hold no arrays: their keys still
mark the prefixes the snapshots continue. Layer caches that are none of these (caches that keep leading tokens —
no mlx-lm family makes one, only ``make_prompt_cache``'s ``max_kv_size`` — or other cache pairs in one layer)
cannot be cut into position blocks: for them :func:`layer_windows` says why, the engine does not use the cache,
and the model's stats say so.

Segments: the blocks one :meth:`store` adds are copied out of the sequence's cache together, one contiguous
array per layer's keys and values (a :class:`Segment`), and each block's arrays are views into it, made when first
read. A store's copies (and the disk tier's forms of its blocks, cut from the segment's host arrays) are evaluated
in one wait for the device; a prefilled group's rows and a step's finished answers are stored inside
:meth:`PrefixCache.storing` and settle together, one wait for all of them. A match that
spans blocks stored together is then built from one slice per layer instead of one piece per block: MLX's
concatenate costs 10–20 µs per input, and a 16k-token prefix of a 30-layer model is 60,000 block pieces (over
a second before its first token). The bytes of a segment's blocks that left memory still count as hot while the
others hold its buffer; once those hold less than half of it, they get copies of their own and the buffer goes.

Threads: :meth:`match` runs on worker threads (it may read files); everything
that touches MLX arrays (:meth:`build`, :meth:`store`, eviction) runs on the
device thread. Metadata is guarded by one lock.
"""

from __future__ import annotations

import hashlib
import itertools
import logging
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, TypeVar, overload

import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import ArraysCache, CacheList, KVCache, RotatingKVCache

from runtime.kv_disk import DiskTier, HostBlock
from runtime.quantized_kv import is_packed, joined_layer

log = logging.getLogger("flow.prefix_cache")

# ``slicer(start, end)`` → the keys and values of every layer (layer order: k0, v0, k1, v1, …)
# for token positions [start, end) of one sequence, each shaped [1, heads, end - start, dim];
# None for a sliding-window layer that no longer holds those positions.
Slicer = Callable[[int, int], list[mx.array | None]]
T = TypeVar("T")
# How long a reader waits for finished answers' stores (they come within the engine's step).
SETTLE_SECONDS = 10.0
MAX_SESSIONS = 4096  # named sessions whose state is remembered
SESSIONS_SHOWN = 32  # the most recently used ones in ``stats_json``
# A recurrent layer's state (mlx-lm's ``ArraysCache``) at the sequence's current position: its arrays, in
# layer order, concatenated over the recurrent layers (see the module's recurrent layers).
StateReader = Callable[[], list[mx.array]]
MAX_CHUNK_STATES = 8  # state snapshots one sequence stores at its prefill-chunk ends (its prompt's end aside)


@dataclass(frozen=True)
class Recurrent:
    """A recurrent layer (mlx-lm's ``ArraysCache`` of ``arrays`` arrays): kept as state snapshots, not blocks.

    ``kv``: the layer keeps a full KV cache beside its state (a ``CacheList`` of the two, in that order: Falcon-H1),
    whose positions go into the blocks as a full layer's.
    """

    arrays: int
    kv: bool = False


# Per layer: None for a full KV cache, the window for a sliding-window (rotating) one, Recurrent for a
# recurrent state.
Windows = tuple[int | Recurrent | None, ...]


@dataclass(frozen=True)
class PrefixConfig:
    block_tokens: int = 16
    hot_bytes: int = 2 << 30
    disk_kv_bits: int | None = None  # blocks on disk quantized to this many bits (8), else as in memory
    default_ttl: float = 86400.0  # seconds a block lives after its last use unless a request says otherwise
    memory_only_ttl: float = 300.0  # blocks of ``ttl = 0`` requests: memory only, and this long at most
    audit_rate: float = 0.0  # the share of hits recomputed cold on idle device time (runtime/prefix_audit.py)


@dataclass(eq=False)
class Segment:
    """Positions stored together: one contiguous array per layer's keys and values (see the module's Segments)."""

    arrays: list[mx.array | None]  # None: a recurrent layer's (no positions)
    nbytes: int
    members: list[Block] = field(default_factory=list)
    live: int = 0  # its blocks in the hot tier
    stranded: int = 0  # bytes of its blocks that left the hot tier while others still hold the buffer


@dataclass(eq=False)
class Block:
    key: bytes
    parent: bytes | None
    namespace: bytes
    nbytes: int
    expires: float
    persist: bool  # written to the disk tier
    length: int  # tokens: ``block_tokens``, fewer for a tail, 0 for a state snapshot
    arrays: Sequence[mx.array | None] | None = None  # on the device: hot (None entries: see Slicer)
    host: HostBlock | None = None  # read back from disk, not yet on the device
    refs: int = 0
    segment: Segment | None = None  # ``arrays`` are views into it, from position ``offset`` on
    offset: int = 0
    anchor: tuple[bytes, int] | None = None  # a snapshot inside a block: the key before it and its offset


@dataclass
class PrefixHit:
    """The blocks a match found (referenced until built or released)."""

    namespace: bytes
    windows: Windows
    blocks: list[Block] = field(default_factory=list)
    block_tokens: int = 0
    keys: BlockKeys | None = None  # the prompt's block keys, for the sequence's own stores
    state: Block | None = None  # recurrent layers: their snapshot at ``depth``
    depth: int | None = None  # the positions reused, where the blocks cover more (a snapshot inside a block)

    @property
    def tokens(self) -> int:
        covered = sum(block.length for block in self.blocks)
        return covered if self.depth is None else min(self.depth, covered)


@dataclass
class SessionState:
    namespace: bytes
    last_key: bytes | None
    tokens: int
    last_access: float
    turns: int = 0


@dataclass
class PrefixStats:
    lookups: int = 0
    hits: int = 0  # lookups that reused at least one block
    lookup_tokens: int = 0  # tokens of the prompts looked up that could be reused (all but the last)
    reused_tokens: int = 0
    disk_reads: int = 0  # blocks brought back from disk
    stored_blocks: int = 0
    stored_tails: int = 0  # partial blocks: the ends of sequences, memory only
    stored_states: int = 0  # recurrent layers' state snapshots
    stored_state_bytes: int = 0  # their bytes
    state_hits: int = 0  # hits restored from a state snapshot
    evictions: int = 0  # hot blocks pushed out of memory (to disk, or gone)
    expired: int = 0


@dataclass
class AuditStats:
    """What the audit found (runtime/prefix_audit.py): hits recomputed cold and compared, for every model the
    cache serves."""

    audits: int = 0  # hits recomputed cold and compared
    agreements: int = 0  # of those, the ones whose next token (argmax) was the same
    max_difference: float = 0.0  # the largest |hit - cold| next-token logit seen
    dropped: int = 0  # sampled hits not audited: the queue was full (a busy device has no idle time)
    last_disagreement: dict[str, Any] | None = None  # the latest audit whose argmax differed
    recent: deque[dict[str, Any]] = field(default_factory=lambda: deque(maxlen=32))  # the latest audits

    def json(self) -> dict[str, Any]:
        return {"audits": self.audits, "agreements": self.agreements, "disagreements": self.audits - self.agreements,
                "max_difference": round(self.max_difference, 6), "dropped": self.dropped,
                "last_disagreement": self.last_disagreement, "recent": list(self.recent)}


def layer_windows(cache: Sequence[Any]) -> Windows | str:
    """Each layer's window (None: a full KV cache), or why the model's cache cannot be cut into blocks."""
    windows: list[int | Recurrent | None] = []
    odd: set[str] = set()
    for c in cache:
        if type(c) is KVCache:
            windows.append(None)
        elif type(c) is RotatingKVCache and c.keep == 0:
            windows.append(int(c.max_size))
        elif isinstance(c, ArraysCache):  # and its subclasses: the arrays are all a snapshot needs
            windows.append(Recurrent(len(c.cache)))
        elif (type(c) is CacheList and len(c.caches) == 2 and isinstance(c.caches[0], ArraysCache)
              and type(c.caches[1]) is KVCache):
            windows.append(Recurrent(len(c.caches[0].cache), kv=True))
        else:
            odd.add(type(c).__name__ + (" with kept tokens" if isinstance(c, RotatingKVCache) else ""))
    if odd:
        return f"its layer caches include {', '.join(sorted(odd))} (not position blocks); prompts are prefilled in full"
    return tuple(windows)


def usable_depth(blocks: Sequence[Block], windows: Windows, block_tokens: int) -> int:
    """How many leading blocks can be reused: every sliding-window layer needs its part of the blocks
    that cover the last ``window`` positions of the prefix."""
    sliding = [(i, w) for i, w in enumerate(windows) if isinstance(w, int)]
    n = len(blocks)
    while n and sliding:
        first = max(0, n * block_tokens - max(w for _, w in sliding)) // block_tokens
        missing = [k for k in range(first, n) for i, _ in sliding if not _has_layer(blocks[k], i)]
        if not missing:
            break
        n = min(missing)  # reuse stops before the first block without its sliding-window part
    return n


def _has_layer(block: Block, layer: int) -> bool:
    if block.arrays is not None:
        return block.arrays[2 * layer] is not None
    return block.host is not None and block.host.has(2 * layer)


def namespace_of(identity: str) -> bytes:
    return hashlib.sha256(identity.encode()).digest()[:16]


def tail_key(parent: bytes, tokens: Sequence[int]) -> bytes:
    """A tail's key: the tokens after the last full block (fewer than a block), under that block's key."""
    return hashlib.sha256(b"tail" + parent + np.asarray(tokens, dtype=np.uint32).tobytes()).digest()[:20]


def tail_keys(parent: bytes, tokens: Sequence[int]) -> list[bytes]:
    """``tail_key(parent, tokens[:n])`` for n = 1 … len(tokens), hashing each token once."""
    running = hashlib.sha256(b"tail" + parent)
    keys: list[bytes] = []
    for token in np.asarray(tokens, dtype=np.uint32):
        running.update(token.tobytes())
        keys.append(running.copy().digest()[:20])
    return keys


def _full_layers_only(windows: Windows) -> bool:
    """Tails need every attention layer to hold every position (a sliding-window layer keeps whole blocks only;
    a recurrent one holds no positions)."""
    return bool(windows) and all(not isinstance(w, int) for w in windows)


def recurrent(windows: Windows) -> bool:
    """Whether some layer keeps a recurrent state (a hit needs a snapshot at its depth)."""
    return any(isinstance(w, Recurrent) for w in windows)


def state_key(position_key: bytes) -> bytes:
    """A state snapshot's key: over the key of the prefix that ends where it was taken (a block's or a tail's)."""
    return hashlib.sha256(b"state" + position_key).digest()[:20]


def chain_keys(namespace: bytes, tokens: Sequence[int], blocks: int, block_tokens: int) -> list[bytes]:
    """The keys of the first ``blocks`` full blocks of ``tokens``."""
    return BlockKeys(namespace, block_tokens).upto(tokens, blocks)


class BlockKeys:
    """The chained keys of one growing token sequence (a prompt, then prompt and answer), each block
    hashed once however often the sequence is stored (after every prefill chunk, at its finish)."""

    def __init__(self, namespace: bytes, block_tokens: int) -> None:
        self.namespace = namespace
        self.block_tokens = block_tokens
        self.keys: list[bytes] = []

    def upto(self, tokens: Sequence[int], blocks: int) -> list[bytes]:
        """The keys of the first ``blocks`` blocks of ``tokens``, which extend the tokens seen before."""
        b = self.block_tokens
        previous = self.keys[-1] if self.keys else self.namespace
        for i in range(len(self.keys), blocks):
            chunk = np.asarray(tokens[i * b : (i + 1) * b], dtype=np.uint32).tobytes()
            previous = hashlib.sha256(previous + chunk).digest()[:20]
            self.keys.append(previous)
        return self.keys[:blocks]


def _device(a: np.ndarray, dtype: str) -> mx.array:
    """A host array back on the device: bfloat16 ones were stored as uint16 (a snapshot may mix dtypes: a
    bfloat16 convolution window beside a float32 recurrent state)."""
    return mx.array(a).view(mx.bfloat16) if dtype == "bfloat16" and a.dtype == np.uint16 else mx.array(a)


def quantization_group(head_dim: int) -> int | None:
    """The group size for quantizing KV rows of ``head_dim`` (one that divides it), or None (none fits)."""
    return next((g for g in (128, 64, 32) if head_dim % g == 0), None)  # larger groups: fewer scales


class _HostForm:
    """Arrays on their way to the disk tier (a segment's, or a block's own): as they are, or ``kv_bits``-quantized
    in groups along the head dimension (when a group size divides it) — built lazily, so they are evaluated with
    the blocks' copies in one wait (:meth:`PrefixCache._settle`), then copied to the host once. A segment's blocks
    are cut from its host arrays (views: a 24-layer model's 5-block row was 240 copies on the device thread):
    quantization groups run along the head dimension, so a block's codes are the segment's at its positions."""

    def __init__(self, arrays: Sequence[mx.array | None], kv_bits: int | None) -> None:
        present = [a for a in arrays if a is not None]
        self.dtype = str(present[0].dtype).removeprefix("mlx.core.") if present else "none"
        group = quantization_group(present[0].shape[-1]) if kv_bits and present else None
        self.parts: list[mx.array | None] = []
        self._host: list[np.ndarray | None] | None = None
        if kv_bits is None or group is None or is_packed(present[0]):  # live-quantized rows' codes: as they are
            self.parts = [None if a is None else _hostable(a) for a in arrays]
            self.stride = 1
            return
        self.stride = 3
        self.dtype = f"q{kv_bits}g{group}:{self.dtype}"
        for a in arrays:
            if a is None:
                self.parts += [None, None, None]
                continue
            quantized = mx.quantize(a.reshape(-1, a.shape[-1]), group_size=group, bits=kv_bits)
            self.parts += [_hostable(q.reshape(*a.shape[:-1], -1)) for q in quantized]

    @property
    def lazy(self) -> list[mx.array]:
        return [p for p in self.parts if p is not None]

    def _arrays(self) -> list[np.ndarray | None]:
        # Without a copy: numpy's arrays hold the evaluated MLX arrays (never updated in place: nothing runs a pass
        # on them) and the disk writer copies their bytes on its own thread.
        if self._host is None:
            self._host = [None if p is None else np.asarray(p) for p in self.parts]
        return self._host

    def whole(self) -> HostBlock:
        """All of it: a block's own arrays (a tail, a state snapshot's arrays of any shape)."""
        return self._block(self._arrays())

    def cut(self, offset: int, length: int) -> HostBlock:
        """Positions ``[offset, offset + length)``: a block of the segment (views; the writer copies them)."""
        return self._block([None if a is None else a[..., offset : offset + length, :] for a in self._arrays()])

    def _block(self, arrays: list[np.ndarray | None]) -> HostBlock:
        if self.stride == 3:  # scales and biases as mx.quantize gives them for the block's rows: one row a vector
            arrays = [a if a is None or i % 3 == 0 else a.reshape(-1, a.shape[-1]) for i, a in enumerate(arrays)]
        return HostBlock(tuple(arrays), self.dtype)


def _hostable(a: mx.array) -> mx.array:
    return a.view(mx.uint16) if a.dtype == mx.bfloat16 else a  # numpy has no bfloat16


def _to_host(arrays: list[mx.array | None], kv_bits: int | None = None) -> HostBlock:
    """One block's arrays for the host and the disk (see :class:`_HostForm`)."""
    form = _HostForm(arrays, kv_bits)
    mx.eval(form.lazy)
    return form.whole()


def _to_device(host: HostBlock) -> list[mx.array | None]:
    if host.stride == 1:
        return [None if a is None else _device(a, host.dtype) for a in host.arrays]
    quantization, dtype = host.dtype[1:].split(":")
    bits, group = (int(n) for n in quantization.split("g"))
    out: list[mx.array | None] = []
    for i in range(0, len(host.arrays), 3):
        packed, scales, biases = host.arrays[i : i + 3]
        if packed is None or scales is None or biases is None:
            out.append(None)
            continue
        rows = mx.array(packed)
        flat = mx.dequantize(rows.reshape(-1, rows.shape[-1]), _device(scales, dtype), _device(biases, dtype),
                             group_size=group, bits=bits)
        out.append(flat.reshape(*packed.shape[:-1], -1))
    return out


class _Views(Sequence["mx.array | None"]):
    """A segment block's arrays: views into its segment's, each made when first read. A store of a 512-token
    chunk of a 28-layer model made 1,800 views at ~3 µs each; a match reads a run of a segment's blocks as one
    slice of the segment (:func:`_pieces`), so most are never made."""

    __slots__ = ("_arrays", "_start", "_end", "_made")

    def __init__(self, arrays: list[mx.array | None], start: int, end: int) -> None:
        self._arrays, self._start, self._end = arrays, start, end
        self._made: dict[int, mx.array] = {}

    def __len__(self) -> int:
        return len(self._arrays)

    @overload
    def __getitem__(self, index: int) -> mx.array | None: ...

    @overload
    def __getitem__(self, index: slice) -> list[mx.array | None]: ...

    def __getitem__(self, index: int | slice) -> mx.array | None | list[mx.array | None]:
        if isinstance(index, slice):
            return [self[i] for i in range(*index.indices(len(self)))]
        array = self._arrays[index]  # IndexError past the end: the end of an iteration
        if array is None:
            return None
        index %= len(self._arrays)
        view = self._made.get(index)
        if view is None:
            view = self._made[index] = array[..., self._start : self._end, :]
        return view


def _share(blocks: list[Block], arrays: list[mx.array | None], live: int = 0) -> None:
    """Make ``blocks`` (consecutive, together exactly the positions of ``arrays``: arrays of their own, nothing
    else's views) views into ``arrays``, a new segment (``live``: how many of the blocks are hot already)."""
    segment = Segment(arrays, _nbytes(arrays), members=list(blocks), live=live)
    per_position = sum(int(a.nbytes) // a.shape[-2] for a in arrays if a is not None)
    start = 0
    for block in blocks:
        block.arrays, block.segment, block.offset = _Views(arrays, start, start + block.length), segment, start
        block.nbytes = per_position * block.length
        start += block.length


def _runs(items: list[T], follows: Callable[[T, T], bool]) -> list[list[T]]:
    """``items`` split into runs, each item of a run following the one before it."""
    runs: list[list[T]] = []
    for item in items:
        if runs and follows(runs[-1][-1], item):
            runs[-1].append(item)
        else:
            runs.append([item])
    return runs


def _joined_hosts(blocks: list[Block]) -> list[mx.array | None] | None:
    """Blocks read back from disk as one array per layer's keys and values (None unless there are several, all
    stored unquantized with every layer)."""
    hosts = [block.host for block in blocks if block.host is not None]
    if len(hosts) < 2 or len(hosts) != len(blocks):
        return None
    columns = [[a for a in h.arrays if a is not None] for h in hosts]
    count = len(hosts[0].arrays)
    if any(h.stride != 1 or h.dtype != hosts[0].dtype or len(c) != count for h, c in zip(hosts, columns)):
        return None
    return [_device(np.concatenate([c[i] for c in columns], axis=2), hosts[0].dtype) for i in range(count)]


def _segment_piece(segment: Segment, index: int, start: int, end: int) -> mx.array:
    array = segment.arrays[index]
    if array is None:
        raise ValueError("a block of the match lacks this layer")
    return array[..., start:end, :]


def _pieces(blocks: Sequence[Block], index: int) -> list[mx.array]:
    """Array ``index`` (a layer's keys or values) across ``blocks`` in position order: one slice of a segment per
    run of blocks stored together, a block's own array otherwise. Every block must hold it (a match starts where
    they do)."""
    pieces: list[mx.array] = []
    run: tuple[Segment, int, int] | None = None  # segment, first position, end
    for block in blocks:
        if run is not None and block.segment is run[0] and block.offset == run[2]:
            run = (run[0], run[1], run[2] + block.length)
            continue
        if run is not None:
            pieces.append(_segment_piece(run[0], index, run[1], run[2]))
            run = None
        if block.segment is not None:
            run = (block.segment, block.offset, block.offset + block.length)
            continue
        own = block.arrays[index] if block.arrays is not None else None
        if own is None:
            raise ValueError("a block of the match lacks this layer")
        pieces.append(own)
    if run is not None:
        pieces.append(_segment_piece(run[0], index, run[1], run[2]))
    if not pieces:
        raise ValueError("a block of the match lacks this layer")
    return pieces


def _joined(pieces: list[mx.array]) -> mx.array:
    return pieces[0] if len(pieces) == 1 else mx.concatenate(pieces, axis=2)


def _spanned(pieces: list[mx.array], excess: int, pad: int) -> mx.array:
    """Blocks' pieces joined into one buffer: less the last block's ``excess`` positions (a snapshot inside it),
    with ``pad`` empty positions after them for what the sequence writes next (one concatenation)."""
    if excess > 0:
        last = pieces[-1]
        assert excess < last.shape[2], "a hit's blocks end within its last block"
        pieces = [*pieces[:-1], last[..., : last.shape[2] - excess, :]]
    if pad > 0:
        first = pieces[0]
        pieces = [*pieces, mx.zeros((*first.shape[:2], pad, first.shape[3]), dtype=first.dtype)]
    return _joined(pieces)


def _arrays_of(layer: Any) -> list[mx.array]:
    """The arrays of a layer cache :meth:`PrefixCache.build` made (to evaluate them at once)."""
    if isinstance(layer, CacheList):
        return [a for part in layer.caches for a in _arrays_of(part)]
    return [a for a in (layer.cache if isinstance(layer, ArraysCache) else layer.state) if a is not None]


def _nbytes(arrays: Sequence[Any]) -> int:
    return sum(int(a.nbytes) for a in arrays if a is not None)


class PrefixCache:
    def __init__(self, config: PrefixConfig = PrefixConfig(), disk: DiskTier | None = None) -> None:
        self.config = config
        self.disk = disk
        self.stats = PrefixStats()
        self.audit = AuditStats()  # written by the engines' auditors on the device thread
        self.hot_bytes = 0
        self.sessions: dict[str, SessionState] = {}
        self._blocks: dict[bytes, Block] = {}  # every block in memory (hot, or read back and waiting)
        self._lru: OrderedDict[bytes, None] = OrderedDict()  # hot blocks, least recently used first
        # State snapshots in memory inside a block: the key before them → their offsets into the block.
        self._state_offsets: dict[bytes, set[int]] = {}
        self._lock = threading.Lock()
        # Finished answers an engine holds for their store, made once their last tokens went out (runtime/
        # prefix_keeper.py): a reader that must see them (a next turn's match, an agent's turn record) waits.
        self._pending = 0
        self._settled = threading.Condition(self._lock)
        self._unsettled: list[Block] | None = None  # inside storing(): the blocks added, not yet evaluated

    # ------------------------------------------------------------------ stores made after a stream's end
    def pending(self) -> None:
        """An engine holds finished answers whose store comes later in its step (the device thread)."""
        with self._lock:
            self._pending += 1

    def stored(self) -> None:
        """Those answers are stored (or dropped): readers waiting for them go on."""
        with self._lock:
            self._pending -= 1
            if not self._pending:
                self._settled.notify_all()

    def settled(self, timeout: float = SETTLE_SECONDS) -> bool:
        """Wait (a worker thread, never the device thread) until the finished answers held so far are stored: a
        conversation's next turn, sent as soon as its answer ended, finds that answer's blocks. Past ``timeout``
        the reader goes on without them (a miss, not an error): False."""
        with self._lock:
            return self._settled.wait_for(lambda: not self._pending, timeout)

    # ------------------------------------------------------------------ worker threads
    def match(self, namespace: bytes, tokens: Sequence[int], windows: Windows, ttl: float | None = None
              ) -> PrefixHit:
        """The longest cached prefix of ``tokens`` that leaves at least the last token to compute."""
        b = self.config.block_tokens
        chain = BlockKeys(namespace, b)
        keys = chain.upto(tokens, (len(tokens) - 1) // b)
        hit = PrefixHit(namespace, windows, block_tokens=b, keys=chain)
        expires = self._expiry(ttl)
        with self._lock:
            self.stats.lookups += 1
            self.stats.lookup_tokens += len(tokens) - 1
        i = 0
        while i < len(keys):
            with self._lock:
                block = self._blocks.get(keys[i])
                if block is not None:
                    block.refs += 1
                    hit.blocks.append(block)
                    i += 1
                    continue
            # Warm: the run of blocks from here that the disk holds, read at once (outside the lock).
            run = self._on_disk(keys, i)
            hosts = self.disk.read_many(run) if self.disk is not None else []
            found = list(itertools.takewhile(lambda host: host is not None, hosts))
            with self._lock:
                for key, host in zip(run, found):
                    assert host is not None
                    hit.blocks.append(self._read_back(key, hit.blocks[-1].key if hit.blocks else None, namespace,
                                                      host, expires, b))
            if not run or len(found) < len(run):
                break
            i += len(run)
        depth = usable_depth(hit.blocks, windows, b)
        if depth < len(hit.blocks):
            unused = PrefixHit(namespace, windows, hit.blocks[depth:], b)
            hit.blocks = hit.blocks[:depth]
            self.release(unused)
        if recurrent(windows):
            self._match_state(namespace, tokens, hit, expires)
        elif _full_layers_only(windows):
            self._match_tail(namespace, tokens, hit)
        with self._lock:
            for block in reversed(hit.blocks):  # deepest first: parents end up the most recently used
                block.expires = max(block.expires, expires)
                if block.key in self._lru:
                    self._lru.move_to_end(block.key)
            if hit.blocks:
                self.stats.hits += 1
                self.stats.reused_tokens += hit.tokens
                self.stats.state_hits += hit.state is not None
                if hit.state is not None and hit.state.key in self._lru:
                    hit.state.expires = max(hit.state.expires, expires)
                    self._lru.move_to_end(hit.state.key)
        if self.disk is not None:
            for block in [*hit.blocks, *([hit.state] if hit.state is not None else [])]:
                if block.persist:
                    self.disk.touch(block.key, block.expires)
        return hit

    def _match_state(self, namespace: bytes, tokens: Sequence[int], hit: PrefixHit, expires: float) -> None:
        """Cut a hybrid model's hit back to the deepest depth where a state snapshot continues it: after a tail
        that continues the full blocks, at a block boundary, or inside a block. Without one, no hit."""
        b = hit.block_tokens
        full = len(hit.blocks)
        limit = len(tokens) - 1  # leave the last token to compute
        keys = [block.key for block in hit.blocks]

        def before(k: int) -> bytes:  # the key of the prefix that ends where block k (0-based) starts
            return keys[k - 1] if k else namespace

        def offsets(k: int, room: int) -> list[int]:
            with self._lock:
                return sorted((r for r in self._state_offsets.get(before(k), ()) if r <= room), reverse=True)

        def take(depth: int, blocks: int, state: Block, tail: Block | None = None) -> None:
            """Keep what reaches ``depth`` (references taken on ``state`` and ``tail``, lock held)."""
            unused = PrefixHit(namespace, hit.windows, hit.blocks[blocks:], b)
            hit.blocks = hit.blocks[:blocks] + ([tail] if tail is not None else [])
            hit.state, hit.depth = state, depth
            self._release_locked(unused)

        # A tail after the full blocks, with a snapshot where it ends (the previous turn's prompt or answer, in
        # memory; where a prompt's messages ended, on disk).
        start = full * b
        rs = offsets(full, min(b - 1, limit - start))
        if rs:
            tails = tail_keys(before(full), tokens[start : start + rs[0]])
            with self._lock:
                for r in rs:
                    tail, state = self._blocks.get(tails[r - 1]), self._blocks.get(state_key(tails[r - 1]))
                    if tail is not None and state is not None and tail.arrays is not None:
                        tail.refs += 1
                        state.refs += 1
                        take(start + r, full, state, tail)
                        return
        if self.disk is not None and start < limit:
            tails = tail_keys(before(full), tokens[start : start + min(b - 1, limit - start)])
            for r in range(len(tails), 0, -1):
                tail_host = self._disk_read(tails[r - 1]) if self.disk.has(state_key(tails[r - 1])) else None
                state_host = self._disk_read(state_key(tails[r - 1])) if tail_host is not None else None
                if tail_host is None or state_host is None:
                    continue
                with self._lock:
                    tail = self._read_back(tails[r - 1], keys[full - 1] if full else None, namespace, tail_host,
                                           expires, r)
                    state = self._read_back(state_key(tails[r - 1]), tails[r - 1], namespace, state_host, expires, 0,
                                            (before(full), r))
                    take(start + r, full, state, tail)
                    return
        for k in range(full, 0, -1):
            # At the end of block k - 1 (0-based): in memory, or on disk.
            key = state_key(keys[k - 1])
            with self._lock:
                state = self._blocks.get(key)
                if state is not None:
                    state.refs += 1
                    take(k * b, k, state)
                    return
            host = self._disk_read(key)
            if host is not None:
                with self._lock:
                    take(k * b, k, self._read_back(key, keys[k - 1], namespace, host, expires, 0))
                    return
            # Inside block k - 1: a snapshot at a prompt's or an answer's end that later blocks went past (in
            # memory), or where a prompt's messages ended (on disk, after a restart).
            rs = offsets(k - 1, b - 1)
            if rs:
                inside = tail_keys(before(k - 1), tokens[(k - 1) * b : (k - 1) * b + rs[0]])
                with self._lock:
                    for r in rs:
                        state = self._blocks.get(state_key(inside[r - 1]))
                        if state is not None:
                            state.refs += 1
                            take((k - 1) * b + r, k, state)
                            return
            if self.disk is not None:
                inside = tail_keys(before(k - 1), tokens[(k - 1) * b : k * b - 1])
                for r in range(len(inside), 0, -1):
                    host = self._disk_read(state_key(inside[r - 1]))
                    if host is not None:
                        with self._lock:
                            take((k - 1) * b + r, k, self._read_back(state_key(inside[r - 1]), inside[r - 1],
                                                                     namespace, host, expires, 0, (before(k - 1), r)))
                            return
        with self._lock:
            self._release_locked(PrefixHit(namespace, hit.windows, hit.blocks, b))
        hit.blocks = []

    def _on_disk(self, keys: list[bytes], start: int) -> list[bytes]:
        """``keys`` from ``start`` on while memory lacks them and the disk tier holds them."""
        run: list[bytes] = []
        if self.disk is None:
            return run
        for key in keys[start:]:
            with self._lock:
                if key in self._blocks:
                    break
            if not self.disk.has(key):
                break
            run.append(key)
        return run

    def _disk_read(self, key: bytes) -> HostBlock | None:
        """A block or snapshot from the disk tier, if it holds a sound one."""
        return self.disk.read(key) if self.disk is not None and self.disk.has(key) else None

    def _read_back(self, key: bytes, parent: bytes | None, namespace: bytes, host: HostBlock, expires: float,
                   length: int, anchor: tuple[bytes, int] | None = None) -> Block:
        """The entry for what a match read from disk (the one read meanwhile by another match, if any), with a
        reference taken (lock held)."""
        block = self._blocks.get(key)
        if block is None:
            block = Block(key, parent, namespace, _nbytes(host.arrays), expires, persist=True, length=length,
                          host=host, anchor=anchor)
            self._blocks[key] = block
            self.stats.disk_reads += 1
        block.refs += 1
        return block

    def _match_tail(self, namespace: bytes, tokens: Sequence[int], hit: PrefixHit) -> None:
        """Extend a hit by the longest tail (in memory) that continues it: the end of an earlier sequence
        that did not fill a block, e.g. the previous turn's answer, which the next turn's prompt repeats."""
        b = hit.block_tokens
        start = len(hit.blocks) * b
        parent = hit.blocks[-1].key if hit.blocks else namespace
        longest = min(b - 1, len(tokens) - 1 - start)  # leave the last token to compute
        keys = tail_keys(parent, tokens[start : start + longest])
        with self._lock:
            for key in reversed(keys):  # the longest first
                tail = self._blocks.get(key)
                if tail is not None:
                    tail.refs += 1
                    hit.blocks.append(tail)
                    return

    def release(self, hit: PrefixHit) -> None:
        """Drop a hit's references (its sequence left, or its cache is built)."""
        with self._lock:
            self._release_locked(hit)

    def _release_locked(self, hit: PrefixHit) -> None:
        for block in [*hit.blocks, *([hit.state] if hit.state is not None else [])]:
            block.refs -= 1
            if block.refs == 0 and block.arrays is None:
                self._forget(block)  # read back from disk for a sequence that left: not worth memory
        hit.blocks, hit.state = [], None

    # ------------------------------------------------------------------ device thread
    def build(self, hit: PrefixHit, room: int = 0) -> list[Any]:
        """A fresh single-sequence cache holding the hit's tokens; the hit's references are dropped.

        Full layers get every position; a sliding-window layer gets the last ``window`` positions,
        in order, as mlx-lm's rotating cache holds them after reading the prefix itself. A full layer's buffer has
        room for ``room`` more positions (rounded up to mlx-lm's step) in the same concatenation: without it the
        prefill's first write grows the buffer by copying the whole prefix once more.
        """
        cold = [i for i, block in enumerate(hit.blocks) if block.arrays is None]  # read back from disk
        for run in _runs(cold, lambda a, b: a + 1 == b):
            blocks = [hit.blocks[i] for i in run]
            joined = _joined_hosts(blocks)
            if joined is not None:  # one segment, joined on the host: numpy concatenates cheaply per block
                _share(blocks, joined)
            for block in blocks:
                assert block.host is not None
                if joined is None:
                    block.arrays = _to_device(block.host)
                block.host = None
                self._make_hot(block)
        state = hit.state
        if state is not None and state.arrays is None:
            assert state.host is not None
            state.arrays, state.host = _to_device(state.host), None
            self._make_hot(state)
        states = list(state.arrays or []) if state is not None else []
        n = hit.tokens
        covered = sum(block.length for block in hit.blocks)
        cache: list[Any] = []
        for layer, window in enumerate(hit.windows):
            layer_state: Any = None
            if isinstance(window, Recurrent):
                layer_state = ArraysCache(window.arrays)
                layer_state.cache, states = states[: window.arrays], states[window.arrays :]
                if len(layer_state.cache) != window.arrays or any(a is None for a in layer_state.cache):
                    raise ValueError("the hit's state snapshot does not fit the model's recurrent layers")
                if not window.kv:
                    cache.append(layer_state)
                    continue
            first = 0 if not isinstance(window, int) else max(0, n - window) // hit.block_tokens
            blocks = hit.blocks[first:]
            key_parts, value_parts = _pieces(blocks, 2 * layer), _pieces(blocks, 2 * layer + 1)
            if window is None and any(is_packed(k) for k in key_parts):  # cut from live-quantized rows
                cache.append(joined_layer(key_parts, value_parts, n))
                continue
            if not isinstance(window, int):
                c: Any = KVCache()  # type: ignore[no-untyped-call]  # (mlx-lm is untyped)
                pad = -(-(n + room) // c.step) * c.step - n if room > 0 else 0
                c.keys, c.values = _spanned(key_parts, covered - n, pad), _spanned(value_parts, covered - n, pad)
                c.offset = n
            else:
                keys, values = _spanned(key_parts, covered - n, 0), _spanned(value_parts, covered - n, 0)
                held = min(n, window)
                c = RotatingKVCache(max_size=window, keep=0)  # type: ignore[no-untyped-call]
                c.keys, c.values = keys[..., -held:, :], values[..., -held:, :]
                c.offset, c._idx = n, held
            cache.append(c if layer_state is None else CacheList(layer_state, c))  # type: ignore[no-untyped-call]
        mx.eval([a for c in cache for a in _arrays_of(c)])
        self.release(hit)
        self._evict()
        return cache

    def store(self, namespace: bytes, tokens: Sequence[int], slicer: Slicer, *, tail: bool = False,
              windows: Windows = (), ttl: float | None = None, session_id: str | None = None,
              keys: BlockKeys | None = None, state: StateReader | None = None, lasting: bool = False) -> int:
        """Keep the full blocks of ``tokens`` (whose KV ``slicer`` reads) that the cache lacks; how many it added.

        ``tail``: ``tokens`` end where a later request may continue (a prompt's end, a finished sequence),
        so keep the tokens after the last full block too, in memory, if the model's ``windows`` are all
        full layers. ``keys``: the sequence's key chain from its earlier stores (or its match), extended here.
        ``state`` (a model with recurrent layers): reads their state after ``tokens``, kept as a snapshot there
        (with the tail it needs, when ``tokens`` do not end on a block boundary). ``lasting``: such a snapshot inside
        a block goes to the disk tier too (where a prompt's messages end: later conversations come back to it).
        """
        b = self.config.block_tokens
        chain = keys if keys is not None and keys.namespace == namespace else BlockKeys(namespace, b)
        block_keys = chain.upto(tokens, len(tokens) // b)
        expires = self._expiry(ttl)
        persist = self.disk is not None and ttl != 0
        fresh: list[tuple[int, bytes, bytes | None]] = []  # (index, key, parent) of the blocks the cache lacks
        parent: bytes | None = None
        for i, key in enumerate(block_keys):
            with self._lock:
                known = self._blocks.get(key)
                if known is not None:
                    known.expires = max(known.expires, expires)
            if known is None and not (self.disk is not None and self.disk.has(key)):
                fresh.append((i, key, parent))
            parent = key
        added: list[Block] = []
        skip = frozenset(j for i, w in enumerate(windows) if isinstance(w, Recurrent) and not w.kv
                         for j in (2 * i, 2 * i + 1))
        for run in _runs(fresh, lambda a, b: a[0] + 1 == b[0]):
            added += self._copied(run, slicer, namespace, expires, persist, skip)
        start = len(block_keys) * b
        position = block_keys[-1] if block_keys and start == len(tokens) else None  # the key ending at the end
        if (tail or state is not None) and start < len(tokens) and _full_layers_only(windows):
            # In memory: a tail is worth keeping for the next turn, not across a restart — unless a snapshot where a
            # prompt's messages end needs it (other conversations part from this one inside the block).
            key = position = tail_key(parent or namespace, tokens[start:])
            with self._lock:
                known = self._blocks.get(key)
                if known is not None:
                    known.expires = max(known.expires, expires)
            if known is None:
                arrays = [None if a is None else mx.contiguous(a) for a in slicer(start, len(tokens))]
                on_disk = self.disk is not None and self.disk.has(key)
                lasting_tail = persist and lasting and state is not None and not on_disk
                added.append(Block(key, parent, namespace, _nbytes(arrays), expires, lasting_tail, len(tokens) - start,
                                   arrays))
        if state is not None and position is not None and recurrent(windows):
            lasting_state = persist and (lasting or start == len(tokens))
            snapshot = self._snapshot(namespace, position, state, expires, lasting_state,
                                      (parent or namespace, len(tokens) - start) if start < len(tokens) else None)
            if snapshot is not None:
                added.append(snapshot)
        if added:
            for block in added:  # hot now (their copies still lazy): a row stored after this one shares them
                self._make_hot(block)
            with self._lock:
                self.stats.stored_blocks += sum(1 for block in added if block.length == b)
                self.stats.stored_tails += sum(1 for block in added if 0 < block.length < b)
                self.stats.stored_states += sum(1 for block in added if block.length == 0)
                self.stats.stored_state_bytes += sum(block.nbytes for block in added if block.length == 0)
        if session_id is not None:
            with self._lock:
                session = self.sessions.get(session_id)
                turns = session.turns + 1 if session is not None else 1
                last = block_keys[-1] if block_keys else None
                self.sessions[session_id] = SessionState(namespace, last, len(tokens), time.time(), turns)
                if len(self.sessions) > MAX_SESSIONS:  # forget the longest idle ones (their blocks stay)
                    for old in sorted(self.sessions, key=lambda k: self.sessions[k].last_access)[: MAX_SESSIONS // 8]:
                        del self.sessions[old]
        if self._unsettled is not None:
            self._unsettled += added  # settled with the rest of the batch (storing)
        else:
            self._settle(added)
        return len(added)

    @contextmanager
    def storing(self) -> Iterator[None]:
        """Stores made inside (on the device thread: a prefilled group's rows, a step's finished answers) are
        settled together at the end, in one wait for the device: their copies and disk forms evaluated at once, a
        row at a time cost a wait each. Nothing may run a pass on the caches they were cut from meanwhile (a lazy
        copy would keep the cache's buffer from being updated in place)."""
        if self._unsettled is not None:
            yield  # inside another: that one settles
            return
        self._unsettled = []
        try:
            yield
        finally:
            added, self._unsettled = self._unsettled, None
            try:
                self._settle(added)
            except Exception:  # the cache is an optimisation: its failure must not fail the sequences
                log.exception("prefix cache: could not store blocks")

    def _settle(self, added: list[Block]) -> None:
        """Evaluate new blocks' copies and their disk forms in one wait, queue their disk writes, then evict (not
        before: an evicted block must be on its way to disk). Should the evaluation fail, the blocks leave."""
        if added:
            writes = [block for block in added if block.persist] if self.disk is not None else []
            forms: dict[int, _HostForm] = {}
            for block in writes:
                source = block.segment if block.segment is not None else block
                if id(source) not in forms:  # a state snapshot is kept as it is
                    bits = self.config.disk_kv_bits if block.length else None
                    forms[id(source)] = _HostForm(source.arrays or [], bits)
            try:
                sources = {id(s): s for s in (b.segment or b for b in added)}.values()  # a segment's blocks: views
                mx.eval([a for s in sources for a in s.arrays or [] if a is not None],
                        [a for form in forms.values() for a in form.lazy])
            except BaseException:
                with self._lock:
                    for block in added:  # every member of their segments is here: no survivor to copy out
                        block.segment = None
                        self._forget(block)
                raise
            for block in writes:
                assert self.disk is not None
                if block.segment is not None:
                    host = forms[id(block.segment)].cut(block.offset, block.length)
                else:
                    host = forms[id(block)].whole()
                self.disk.write(block.key, block.parent, block.namespace, host, block.expires)
        self._evict()

    def _snapshot(self, namespace: bytes, position: bytes, state: StateReader, expires: float, persist: bool,
                  anchor: tuple[bytes, int] | None) -> Block | None:
        """A new state snapshot at the prefix keyed ``position`` (None: the cache has it already)."""
        key = state_key(position)
        with self._lock:
            known = self._blocks.get(key)
            if known is not None:
                known.expires = max(known.expires, expires)
                return None
        on_disk = self.disk is not None and self.disk.has(key)
        if anchor is None and on_disk:
            return None
        arrays: list[mx.array | None] = [mx.contiguous(a) for a in state()]
        persist = persist and not on_disk  # one inside a block is kept in memory too, where a match looks first
        return Block(key, position, namespace, _nbytes(arrays), expires, persist, 0, arrays, anchor=anchor)

    def _copied(self, run: list[tuple[int, bytes, bytes | None]], slicer: Slicer, namespace: bytes, expires: float,
                persist: bool, skip: frozenset[int] = frozenset()) -> list[Block]:
        """New blocks for consecutive block positions: views into one segment, or each its own copy where a
        layer lacks some of the positions (a sliding window moved past them) or keeps them quantized."""
        b = self.config.block_tokens
        first = run[0][0]
        whole = slicer(first * b, (run[-1][0] + 1) * b) if len(run) > 1 else []
        if whole and all((a is None) == (i in skip) and (a is None or not is_packed(a)) for i, a in enumerate(whole)):
            blocks = [Block(key, parent, namespace, 0, expires, persist, b) for _, key, parent in run]
            _share(blocks, [None if a is None else mx.contiguous(a) for a in whole])
            return blocks
        out = []
        for i, key, parent in run:
            arrays: list[mx.array | None] = [None if a is None else mx.contiguous(a) for a in slicer(i * b, (i + 1) * b)]
            out.append(Block(key, parent, namespace, _nbytes(arrays), expires, persist, b, arrays))
        return out

    def sweep(self) -> int:
        """Forget expired blocks (memory and disk); how many left memory."""
        now = time.time()
        with self._lock:
            gone = [blk for blk in self._blocks.values() if blk.expires <= now and blk.refs == 0]
            for block in gone:
                self._forget(block)
            self.stats.expired += len(gone)
        if self.disk is not None:
            self.disk.sweep()
        return len(gone)

    def forget_state(self, key: bytes) -> None:
        """Drop a state snapshot, from memory and disk, unless a match holds it (a sequence's previous deepest
        chunk-end snapshot, superseded by its next one)."""
        with self._lock:
            state = self._blocks.get(key)
            if state is None or state.refs or state.length:
                return
            self._forget(state)
        if self.disk is not None:
            self.disk.delete(key)

    def clear(self) -> None:
        """Drop every unreferenced block from memory (the disk tier keeps its copies)."""
        with self._lock:
            for block in [b for b in self._blocks.values() if b.refs == 0]:
                self._forget(block)

    # ------------------------------------------------------------------ reports
    def tier_of(self, key: bytes | None) -> str:
        """Where the prefix ending in block ``key`` is: hot (memory), warm (disk) or cold (gone)."""
        if key is None:
            return "cold"
        with self._lock:
            block = self._blocks.get(key)
            if block is not None and block.arrays is not None:
                return "hot"
        return "warm" if self.disk is not None and self.disk.has(key) else "cold"

    def session(self, session_id: str) -> dict[str, Any] | None:
        """A session's cache state: where its latest turn's last block is, its size, turns, last use."""
        with self._lock:
            state = self.sessions.get(session_id)
        if state is None:
            return None
        return {"tier": self.tier_of(state.last_key), "tokens": state.tokens, "turns": state.turns,
                "last_access": state.last_access, "last_block": state.last_key.hex() if state.last_key else None}

    def referenced(self) -> int:
        """Blocks some sequence still holds (zero when nothing is in flight)."""
        with self._lock:
            return sum(1 for b in self._blocks.values() if b.refs)

    def stats_json(self) -> dict[str, Any]:
        with self._lock:
            s = self.stats
            out: dict[str, Any] = {
                "block_tokens": self.config.block_tokens,
                "lookups": s.lookups, "hits": s.hits,
                "hit_rate": round(s.reused_tokens / s.lookup_tokens, 4) if s.lookup_tokens else 0.0,
                "reused_tokens": s.reused_tokens, "stored_blocks": s.stored_blocks, "stored_tails": s.stored_tails,
                "stored_states": s.stored_states, "stored_state_bytes": s.stored_state_bytes,
                "state_hits": s.state_hits,
                "disk_reads": s.disk_reads,
                "evictions": s.evictions, "expired": s.expired,
                "blocks": {"hot": len(self._lru), "warm": 0},
                "hot_bytes": self.hot_bytes, "hot_max_bytes": self.config.hot_bytes,
                "referenced_blocks": sum(1 for b in self._blocks.values() if b.refs),
                "sessions": len(self.sessions),
            }
            recent = sorted(self.sessions, key=lambda k: self.sessions[k].last_access)[-SESSIONS_SHOWN:]
        out["recent_sessions"] = {sid: self.session(sid) for sid in reversed(recent)}
        out["audit"] = {"rate": self.config.audit_rate, **self.audit.json()}
        if self.disk is not None:
            disk = self.disk.stats()
            out["blocks"]["warm"] = disk["blocks"]
            out["disk"] = disk
        return out

    # ------------------------------------------------------------------ internals
    def _expiry(self, ttl: float | None) -> float:
        if ttl == 0:
            return time.time() + self.config.memory_only_ttl
        return time.time() + (self.config.default_ttl if ttl is None else ttl)

    def _make_hot(self, block: Block) -> None:
        with self._lock:
            self._blocks[block.key] = block
            if block.key not in self._lru:
                self._lru[block.key] = None
                self.hot_bytes += block.nbytes
                if block.segment is not None:
                    block.segment.live += 1
                if block.anchor is not None:
                    self._state_offsets.setdefault(block.anchor[0], set()).add(block.anchor[1])

    def _forget(self, block: Block) -> None:
        """Drop a block from memory (lock held)."""
        self._blocks.pop(block.key, None)
        if block.anchor is not None:
            offsets = self._state_offsets.get(block.anchor[0])
            if offsets is not None:
                offsets.discard(block.anchor[1])
                if not offsets:
                    del self._state_offsets[block.anchor[0]]
        if block.key in self._lru:
            del self._lru[block.key]
            self.hot_bytes -= self._released(block)
        block.arrays = block.host = block.segment = None

    @staticmethod
    def _released(block: Block) -> int:
        """The bytes a hot block frees as it leaves memory: its own; in a segment, none while the other blocks
        hold half of the buffer or more, else what they do not hold: each run of them is copied into a segment
        of its own, and the old buffer goes (device thread)."""
        segment = block.segment
        if segment is None:
            return block.nbytes
        segment.live -= 1
        segment.stranded += block.nbytes
        if segment.live > 0 and 2 * segment.stranded <= segment.nbytes:
            return 0
        survivors = sorted((o for o in segment.members if o is not block and o.segment is segment),
                           key=lambda o: o.offset)
        for run in _runs(survivors, lambda a, b: a.offset + a.length == b.offset):
            if len(run) == 1:
                run[0].arrays = [None if a is None else mx.contiguous(a) for a in run[0].arrays or []]
                run[0].segment = None
            else:
                start, end = run[0].offset, run[-1].offset + run[-1].length
                _share(run, [None if a is None else mx.contiguous(a[..., start:end, :]) for a in segment.arrays],
                       live=len(run))
        mx.eval([a for o in survivors for a in o.arrays or [] if a is not None])
        freed, segment.stranded, segment.live, segment.members = segment.stranded, 0, 0, []
        return freed

    def _evict(self) -> None:
        """Push least recently used unreferenced blocks out of memory until the hot tier fits."""
        with self._lock:
            if self.hot_bytes <= self.config.hot_bytes:
                return
            for key in list(self._lru):
                if self.hot_bytes <= self.config.hot_bytes:
                    break
                block = self._blocks[key]
                if block.refs:
                    continue
                self._forget(block)  # a persisted block stays reachable on disk
                self.stats.evictions += 1
