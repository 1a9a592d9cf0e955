"""Surgery on mlx-lm's layer caches: reading a sequence's positions and recurrent states out of them, merging
single-sequence caches into a batch's, trimming rejected draft positions per row.

mlx-lm keeps a layer's cache as one of a few classes — ``KVCache``/``BatchKVCache`` (every position),
``RotatingKVCache``/``BatchRotatingKVCache`` (a sliding window, possibly wrapped around its ring), a quantized
KV (``runtime.quantized_kv``), ``ArraysCache`` and its subclasses (a recurrent layer's state: a convolution
window and a recurrent matrix, no positions). This module is the one place that knows their insides; the engine
and the prefix cache read caches through its slicers and state readers.

Never imports the engine; of the prefix cache only the reader types it hands them (``Slicer``, ``StateReader``).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import mlx.core as mx
from mlx_lm.models.cache import ArraysCache, BatchKVCache, CacheList, KVCache

from runtime import quantized_kv
from runtime.prefix_cache import Slicer, StateReader


def recurrent_layer(layer: Any) -> bool:
    """A layer cache that holds a recurrent state, not positions (mlx-lm's ArraysCache and its subclasses)."""
    return isinstance(layer, ArraysCache)


def recurrent_part(layer: Any) -> Any | None:
    """A layer cache's recurrent state: an ArraysCache (or a subclass), or the one a CacheList keeps beside a KV
    cache (Falcon-H1's attention and Mamba-2 side by side); None for a layer of positions only."""
    if isinstance(layer, ArraysCache):
        return layer
    if isinstance(layer, CacheList):
        return next((c for c in layer.caches if isinstance(c, ArraysCache)), None)
    return None


def positions_part(layer: Any) -> Any | None:
    """A layer cache's positions: the cache itself, the KV cache of a CacheList, None for a recurrent state alone."""
    if isinstance(layer, ArraysCache):
        return None
    if isinstance(layer, CacheList):
        return next((c for c in layer.caches if not isinstance(c, ArraysCache)), None)
    return layer


class _PaddedRow(NamedTuple):
    """A row of a plain batch KV cache held without reading its left padding (reading it would wait for the
    passes the device has in flight): read at the first slice, every layer's at once (:func:`_unpadded`)."""

    keys: mx.array
    values: mx.array
    pad: mx.array

    def positions(self, pad: int) -> tuple[mx.array, mx.array, int]:
        return self.keys[..., pad:, :], self.values[..., pad:, :], 0


def _unpadded(held: list[Any]) -> None:
    """Replace the held padded rows by their positions, their paddings read in one wait for the device (a wait
    a layer cost a 24-layer model ~1.5 ms a row stored)."""
    rows = [i for i, layer in enumerate(held) if isinstance(layer, _PaddedRow)]
    if rows:
        pads: list[int] = mx.stack([held[i].pad for i in rows]).tolist()  # type: ignore[assignment]
        for i, pad in zip(rows, pads):
            held[i] = held[i].positions(pad)


def positions_of(layer: Any, row: int | None) -> tuple[Any, Any, int] | _PaddedRow:
    """A layer's keys and values for one sequence in position order, and the position of the first.

    A full cache holds every position (a batch row after its left padding, which is read at the row's first slice:
    :class:`_PaddedRow`); a sliding-window (rotating) cache only the last ones, possibly wrapped around its ring
    buffer. A quantized cache's positions come packed (runtime.quantized_kv), so blocks keep their codes.
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
        end = layer._idx
        return _PaddedRow(keys[row : row + 1, :, :end], values[row : row + 1, :, :end], layer.left_padding[row])
    if row is not None:
        layer = layer.extract(row)  # a rotating row, unrolled into position order
        keys, values = layer.keys, layer.values
    else:
        keys, values = layer._temporal_order(layer.keys), layer._temporal_order(layer.values)
    held = min(keys.shape[2], layer.offset)
    return keys[..., keys.shape[2] - held :, :], values[..., keys.shape[2] - held :, :], layer.offset - held


def slicer(cache: list[Any], row: int | None, now: bool = False) -> Slicer:
    # Built on the first read (without a prefix cache nothing reads it), or ``now``: the layers' arrays of this
    # moment. A recurrent layer (Qwen3.5's linear attention, a Mamba layer) holds no positions: its part is None
    # (its state goes as a snapshot, state_reader).
    held: list[tuple[Any, Any, int] | _PaddedRow | None] = []

    def hold() -> None:
        held.extend(None if (kv := positions_part(c)) is None else positions_of(kv, row) for c in cache)

    if now:
        hold()

    def read(start: int, end: int) -> list[mx.array | None]:
        if not held:
            hold()
        _unpadded(held)  # at the first read (no-op after)
        out: list[mx.array | None] = []
        for layer in held:
            if layer is None:
                out += [None, None]
                continue
            assert not isinstance(layer, _PaddedRow)
            keys, values, first = layer
            if start < first:
                out += [None, None]  # a sliding window that has moved past these positions
            else:
                out += [keys[..., start - first : end - first, :], values[..., start - first : end - first, :]]
        return out
    return read


def state_reader(cache: list[Any], row: int | None) -> StateReader:
    """The recurrent layers' states of one sequence (its own cache, or a row of a batch cache), read when called:
    every ``ArraysCache`` array in layer order."""

    def read() -> list[mx.array]:
        out: list[mx.array] = []
        for layer in cache:
            state = recurrent_part(layer)
            if state is not None:
                for a in state.cache:
                    if a is None:
                        raise ValueError("a recurrent layer holds no state yet")
                    out.append(a if row is None else a[row : row + 1])
        return out
    return read


def own_state(cache: list[Any]) -> StateReader:
    return state_reader(cache, None)


def row_state(cache: list[Any], row: int) -> StateReader:
    return state_reader(cache, row)


def own_slicer(cache: list[Any]) -> Slicer:
    """Positions of a single-sequence cache (one KVCache or RotatingKVCache per layer)."""
    return slicer(cache, None)


def row_slicer(cache: list[Any], row: int) -> Slicer:
    """Positions of one row of a left-padded batch cache (BatchKVCache or BatchRotatingKVCache per layer)."""
    return slicer(cache, row)


def held_row(cache: list[Any], row: int, states: bool) -> tuple[Slicer, StateReader | None]:
    """One row of a batch cache as it is now — its positions and (``states``) its recurrent states, slices of the
    layers' arrays of this moment — for a store made after the row has left the batch (the batch's ``filter``
    replaces the layers' arrays; the slices keep the old ones alive until the store drops them)."""
    held = state_reader(cache, row)() if states else None
    return slicer(cache, row, now=True), (lambda: held) if held is not None else None


def trim_rows(cache: list[Any], trims: list[int]) -> None:
    """Drop each row's last ``trims[i]`` positions from a batch cache (the draft tokens it rejected): the
    amount all rows share is trimmed, the rest of each row is rolled into its left padding (mlx-lm's own
    right-padding mechanism), so every row's positions stay contiguous and end together."""
    common = min(trims)
    rest = [t - common for t in trims]
    for layer in cache:
        if recurrent_layer(layer):
            continue  # a recurrent state: runtime/recurrent_rollback.py cuts it back
        if common:
            layer.trim(common)
        if any(rest):
            layer.prepare(right_padding=rest)
            layer.finalize()


def merge_caches(caches: list[list[Any]]) -> list[Any]:
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


class LoneRowViews:
    """A decode batch of one row runs its pass on mlx-lm's single-sequence ``KVCache`` views of its attention
    layers: an integer offset (RoPE's scalar path) and no mask, where a ``BatchKVCache`` brings an offset array
    and a causal mask even for one row — 7 % of a small model's decode step on the CPU, for the same logits to
    the bit. A view shares its layer's buffers (and grows them as the layer would); :meth:`done` hands what the
    pass wrote back to the layer. Only an unpadded row qualifies (one left after its batch's rows left is:
    ``BatchKVCache.filter`` drops the common padding), checked once per change of the batch's rows; every other
    layer kind (sliding window, quantized, recurrent) runs as it is."""

    def __init__(self) -> None:
        self._checked: tuple[int, bool] | None = None  # (the rows' layout, whether the row is unpadded)

    def views(self, cache: list[Any], rows: int, layout: int) -> list[Any] | None:
        """The layer list the pass runs on, or None (not one unpadded row: run on ``cache`` itself)."""
        if rows != 1:
            return None
        views: list[Any] = []
        viewed = False
        for layer in cache:
            if type(layer) is not BatchKVCache or layer.keys is None:
                views.append(layer)
                continue
            if not viewed:
                viewed = True
                if self._checked is None or self._checked[0] != layout:
                    self._checked = (layout, layer.left_padding.tolist() == [0])
                if not self._checked[1]:
                    return None
            view = KVCache()
            view.keys, view.values, view.offset = layer.keys, layer.values, layer._idx
            views.append(view)
        return views if viewed else None

    @staticmethod
    def done(cache: list[Any], views: list[Any]) -> None:
        """Hand the views' buffers and positions back to the batch's layers after the pass."""
        offset = None
        for layer, view in zip(cache, views):
            if view is layer:
                continue
            layer.keys, layer.values, layer._idx = view.keys, view.values, view.offset
            if offset is None:
                offset = mx.array([view.offset])  # unpadded: the row's offset is its length; shared (never edited)
            layer.offset = offset
