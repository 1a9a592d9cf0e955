"""LoRA adapters mounted on a served model, applied per row inside the shared batch.

An adapter is a low-rank update ``y = W x + scale · B(A x)`` of some of a model's linear layers, read from
the two layouts people train with:

* **mlx-lm** (``mlx_lm.lora``): ``adapter_config.json`` (``fine_tune_type``, ``lora_parameters.scale``, ``model``)
  and ``adapters.safetensors`` with ``<module>.lora_a`` ``[in, r]`` and ``<module>.lora_b`` ``[r, out]``;
* **PEFT** (Hugging Face): ``adapter_config.json`` (``r``, ``lora_alpha``, ``use_rslora``,
  ``base_model_name_or_path``) and ``adapter_model.safetensors`` with
  ``base_model.model.<module>.lora_A.weight`` ``[r, in]`` and ``…lora_B.weight`` ``[out, r]``.

Mounting never copies or reloads the base model: the first adapter that touches a linear layer wraps it in an
:class:`AdapterLinear` (the base layer stays inside, unchanged), and every wrapped layer keeps one stack of the
mounted adapters' factors (slot 0 is all zeros: "no adapter"), padded to the largest rank among them. Before each
forward pass the engine says which adapters each row uses (:meth:`AdapterSet.route`); a wrapped layer then adds
``scale · B(A x)`` per row with two ``mx.gather_mm`` calls over the stacks, so rows with different adapters, and
rows with none, run in the same pass. A pass whose rows all use one adapter takes mlx-lm's own dense path; a pass
with no adapter at all costs nothing. Stacked adapters (``"a+b"``) add one such term per adapter.

Everything here runs on the device thread (mount, unmount, route, the forward pass), between engine steps.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import mlx.core as mx
from mlx.nn.layers.base import Module
from mlx.nn.layers.linear import Linear
from mlx.nn.layers.quantized import QuantizedLinear
from mlx.utils import tree_unflatten

MLX_LM_WEIGHTS = "adapters.safetensors"
PEFT_WEIGHTS = "adapter_model.safetensors"
CONFIG_FILE = "adapter_config.json"
PEFT_PREFIX = "base_model.model."
_QUANT_SUFFIX = re.compile(r"[-_](?:\d+bit|bf16|fp16|f16|f32|float16|float32|bfloat16|mlx|q\d\w*)$", re.IGNORECASE)


class AdapterError(ValueError):
    """An adapter that cannot be mounted on this model; the message says why and what is accepted."""


@dataclass(frozen=True)
class AdapterFiles:
    """An adapter directory's files, read on a worker thread (hashing them may take a moment)."""

    path: Path
    layout: str  # "mlx-lm" or "peft"
    config: dict[str, Any]
    weights_file: Path
    digest: bytes  # of the config and weights: what the prefix cache keys its KV by

    @property
    def size_bytes(self) -> int:
        return self.weights_file.stat().st_size


def read_adapter_files(path: Path) -> AdapterFiles:
    """The adapter in directory ``path`` (either layout), hashed. Blocking: run it on a worker thread."""
    if not path.is_dir():
        raise AdapterError(f"{path} is not a directory; an adapter is a directory with {CONFIG_FILE} and "
                           f"{MLX_LM_WEIGHTS} (mlx-lm) or {PEFT_WEIGHTS} (PEFT).")
    config_file = path / CONFIG_FILE
    if not config_file.is_file():
        raise AdapterError(f"{path} has no {CONFIG_FILE}; an adapter directory from mlx_lm.lora or PEFT has one.")
    config_bytes = config_file.read_bytes()
    try:
        config = json.loads(config_bytes)
    except ValueError as exc:
        raise AdapterError(f"{config_file} is not valid JSON: {exc}") from None
    if not isinstance(config, dict):
        raise AdapterError(f"{config_file} must hold a JSON object.")
    if (path / MLX_LM_WEIGHTS).is_file():
        layout, weights = "mlx-lm", path / MLX_LM_WEIGHTS
    elif (path / PEFT_WEIGHTS).is_file():
        layout, weights = "peft", path / PEFT_WEIGHTS
    else:
        raise AdapterError(f"{path} has neither {MLX_LM_WEIGHTS} (mlx-lm) nor {PEFT_WEIGHTS} (PEFT).")
    digest = hashlib.sha256(config_bytes)
    with weights.open("rb") as stream:
        while block := stream.read(1 << 20):
            digest.update(block)
    return AdapterFiles(path, layout, config, weights, digest.digest()[:16])


@dataclass(eq=False)
class Adapter:
    """A mounted adapter: its low-rank factors by module path (``model.layers.3.self_attn.q_proj``)."""

    id: str
    files: AdapterFiles
    scale: float
    factors: dict[str, tuple[mx.array, mx.array]]  # module path → (A [in, r], B [r, out])
    retiring: bool = False  # unmounted while sequences still use it: removed once they finish

    @property
    def rank(self) -> int:
        return max(a.shape[1] for a, _ in self.factors.values())

    @property
    def digest(self) -> bytes:
        return self.files.digest

    def describe(self) -> dict[str, Any]:
        return {"id": self.id, "path": str(self.files.path), "format": self.files.layout, "rank": self.rank,
                "scale": self.scale, "size_bytes": self.files.size_bytes, "mounted_layers": len(self.factors),
                "digest": self.digest.hex()}


def _linear_dims(layer: Module) -> tuple[int, int] | None:
    """A linear layer's (input, output) sizes; None for anything else."""
    if isinstance(layer, QuantizedLinear):
        out_dims, packed = layer.weight.shape
        return packed * 32 // layer.bits, out_dims
    if isinstance(layer, Linear):
        out_dims, in_dims = layer.weight.shape
        return in_dims, out_dims
    return None


def base_model_name(config: dict[str, Any]) -> str | None:
    """The base model an adapter's config says it was trained on, if it says."""
    name = config.get("model") or config.get("base_model_name_or_path")
    return name if isinstance(name, str) and name else None


def same_base(trained_on: str, served: Iterable[str]) -> bool:
    """Whether the model an adapter names is one of the names the served model goes by: the last path part,
    compared without case and a quantization suffix (``mlx-community/Qwen3-0.6B-4bit`` ≈ ``~/m/qwen3-0.6b``)."""
    def stem(name: str) -> str:
        tail = name.rstrip("/").rsplit("/", 1)[-1].lower()
        while (cut := _QUANT_SUFFIX.sub("", tail)) != tail:
            tail = cut
        return tail
    want = stem(trained_on)
    return any(stem(name) == want for name in served)


def load_adapter(adapter_id: str, files: AdapterFiles, model: Module) -> Adapter:
    """Read an adapter's weights and check every one against ``model``: all of it fits, or an
    :class:`AdapterError` names what does not (device thread)."""
    config = files.config
    if files.layout == "mlx-lm":
        kind = config.get("fine_tune_type", "lora")
        if kind != "lora":
            raise AdapterError(f"Adapter {adapter_id!r} is fine_tune_type {kind!r}; flow mounts LoRA adapters "
                               "(fine_tune_type 'lora'). Fuse a DoRA or full fine-tune into the model with "
                               "mlx_lm.fuse and serve the result as a model.")
        params = config.get("lora_parameters") or {}
        scale = params.get("scale")
        if not isinstance(scale, (int, float)) or isinstance(scale, bool):
            raise AdapterError(f"Adapter {adapter_id!r}: adapter_config.json has no numeric "
                               "lora_parameters.scale (mlx-lm's LoRA scale).")
        scale = float(scale)
    else:
        if str(config.get("peft_type", "LORA")).upper() != "LORA" or config.get("use_dora"):
            raise AdapterError(f"Adapter {adapter_id!r} is a PEFT {config.get('peft_type')!r}"
                               f"{' (DoRA)' if config.get('use_dora') else ''} adapter; flow mounts plain LoRA.")
        rank, alpha = config.get("r"), config.get("lora_alpha")
        if not isinstance(rank, int) or rank < 1 or not isinstance(alpha, (int, float)):
            raise AdapterError(f"Adapter {adapter_id!r}: adapter_config.json needs integer 'r' and numeric "
                               "'lora_alpha' (PEFT LoRA).")
        scale = float(alpha) / (math.sqrt(rank) if config.get("use_rslora") else rank)
    try:
        weights: dict[str, mx.array] = mx.load(str(files.weights_file))  # type: ignore[assignment]
    except Exception as exc:  # a truncated or foreign file: mlx says what it could not read
        raise AdapterError(f"Adapter {adapter_id!r}: cannot read {files.weights_file.name}: {exc}") from None
    pairs = _pairs(adapter_id, weights, files.layout)
    modules = dict(model.named_modules())  # type: ignore[no-untyped-call]
    factors: dict[str, tuple[mx.array, mx.array]] = {}
    problems: list[str] = []
    for module, (a, b) in sorted(pairs.items()):
        layer = modules.get(module)
        if isinstance(layer, AdapterLinear):
            layer = layer.base
        dims = _linear_dims(layer) if layer is not None else None
        if layer is None:
            problems.append(f"{module}: no such layer in the model")
            continue
        if dims is None:
            problems.append(f"{module}: a {type(layer).__name__}, not a linear layer")
            continue
        in_dims, out_dims = dims
        if a.ndim != 2 or b.ndim != 2 or a.shape[0] != in_dims or b.shape[1] != out_dims or a.shape[1] != b.shape[0]:
            problems.append(f"{module}: factors {tuple(a.shape)} × {tuple(b.shape)} do not fit a {in_dims} → "
                            f"{out_dims} layer (expected ({in_dims}, r) × (r, {out_dims}))")
            continue
        factors[module] = (a, b)
    if problems:
        shown = "; ".join(problems[:5]) + (f"; and {len(problems) - 5} more" if len(problems) > 5 else "")
        raise AdapterError(f"Adapter {adapter_id!r} does not fit this model ({shown}). Was it trained on another "
                           "base model?")
    if not factors:
        raise AdapterError(f"Adapter {adapter_id!r} holds no LoRA factors.")
    mx.eval([t for pair in factors.values() for t in pair])
    return Adapter(adapter_id, files, scale, factors)


def _pairs(adapter_id: str, weights: dict[str, mx.array], layout: str) -> dict[str, tuple[mx.array, mx.array]]:
    """(A [in, r], B [r, out]) by module path, from either layout's tensor names."""
    if layout == "mlx-lm":
        ends = {".lora_a": "a", ".lora_b": "b"}
    else:
        ends = {".lora_A.weight": "a", ".lora_B.weight": "b"}
    found: dict[str, dict[str, mx.array]] = {}
    others: list[str] = []
    for name, tensor in weights.items():
        end = next((e for e in ends if name.endswith(e)), None)
        if end is None:
            others.append(name)
            continue
        module = name[: -len(end)]
        if layout == "peft":
            module = module.removeprefix(PEFT_PREFIX)
            tensor = tensor.T  # PEFT stores A as [r, in] and B as [out, r]
        found.setdefault(module, {})[ends[end]] = tensor
    if others:
        raise AdapterError(f"Adapter {adapter_id!r} has tensors that are not LoRA factors of linear layers "
                           f"({', '.join(sorted(others)[:3])}{', …' if len(others) > 3 else ''}); flow mounts LoRA "
                           "adapters of linear layers only.")
    incomplete = sorted(m for m, ab in found.items() if len(ab) != 2)
    if incomplete:
        raise AdapterError(f"Adapter {adapter_id!r}: {incomplete[0]} has only one of its two LoRA factors.")
    return {m: (ab["a"], ab["b"]) for m, ab in found.items()}


@dataclass
class _Route:
    """One pass's adapters: per stacking level, each row's slot and scale; or one adapter for all rows."""

    rows: int
    levels: list[tuple[mx.array, mx.array]] = field(default_factory=list)  # ([rows] uint32 slots, [rows] scales)
    uniform: tuple[Adapter, ...] = ()  # every row uses exactly these


class AdapterSet:
    """The adapters mounted on one model, and the routing of its next forward pass (device thread)."""

    def __init__(self, model: Module) -> None:
        self.model = model
        self.adapters: list[Adapter] = []  # mounted (retiring ones too), in slot order from 1
        self.layers: dict[str, AdapterLinear] = {}
        self.route_now: _Route | None = None

    def __bool__(self) -> bool:
        return bool(self.adapters)

    def mount(self, adapter: Adapter) -> None:
        """Add an adapter (checked by :func:`load_adapter`): wrap the layers it touches, restack."""
        fresh = [m for m in adapter.factors if m not in self.layers]
        if fresh:
            modules: dict[str, Module] = dict(self.model.named_modules())  # type: ignore[no-untyped-call]
            wraps = [(m, AdapterLinear(modules[m], m, self)) for m in fresh]
            self.model.update_modules(tree_unflatten(wraps))
            self.layers.update(wraps)
        self.adapters.append(adapter)
        self._restack()

    def unmount(self, adapter: Adapter) -> None:
        """Remove an adapter no sequence uses any more. Its layers stay wrapped (cheap: a pass without
        adapters skips them) so the base model's module tree changes only once."""
        if adapter in self.adapters:
            self.adapters.remove(adapter)
            self._restack()

    def _restack(self) -> None:
        slots = {a: i + 1 for i, a in enumerate(self.adapters)}
        for name, layer in self.layers.items():
            users = [a for a in self.adapters if name in a.factors]
            layer.restack(slots, users, len(self.adapters) + 1)
        self.route_now = None

    def route(self, rows: Sequence[tuple[Adapter, ...]]) -> None:
        """Say which adapters each row of the next forward pass uses (``()``: none)."""
        if not self.adapters or not any(rows):
            self.route_now = None
            return
        first = rows[0]
        if all(r == first for r in rows):
            self.route_now = _Route(len(rows), uniform=first)
            return
        slots = {a: i + 1 for i, a in enumerate(self.adapters)}
        depth = max(len(r) for r in rows)
        levels = []
        for level in range(depth):
            used = [r[level] if level < len(r) else None for r in rows]
            levels.append((mx.array([slots[a] if a is not None else 0 for a in used], dtype=mx.uint32),
                           mx.array([a.scale if a is not None else 0.0 for a in used], dtype=mx.float32)))
        self.route_now = _Route(len(rows), levels)


class AdapterLinear(Module):
    """A linear layer with the mounted adapters' low-rank terms, chosen per row by the set's route."""

    def __init__(self, base: Module, name: str, owner: AdapterSet) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.base = base
        self._name = name
        self._owner = owner
        self._a_stack: mx.array | None = None  # [slots, in, r_max], slot 0 zeros
        self._b_stack: mx.array | None = None  # [slots, r_max, out]
        self._slot_map: mx.array | None = None  # the set's slot → this layer's stack slot

    def restack(self, slots: dict[Adapter, int], users: list[Adapter], count: int) -> None:
        """Stack the factors of the adapters that touch this layer (local slot 0: zeros), padded to their
        largest rank, with the map from the set's slots to these; other adapters map to the zeros."""
        if not users:
            self._a_stack = self._b_stack = self._slot_map = None
            return
        in_dims, out_dims = _linear_dims(self.base) or (0, 0)
        rank = max(a.factors[self._name][0].shape[1] for a in users)
        dtypes = {a.factors[self._name][i].dtype for a in users for i in (0, 1)}
        dtype = dtypes.pop() if len(dtypes) == 1 else mx.float32  # mixed precisions: compute in float32
        a_stack = [mx.zeros((in_dims, rank), dtype=dtype)]
        b_stack = [mx.zeros((rank, out_dims), dtype=dtype)]
        slot_map = [0] * count
        for adapter in users:
            a, b = adapter.factors[self._name]
            r = a.shape[1]
            slot_map[slots[adapter]] = len(a_stack)
            a_stack.append(mx.pad(a.astype(dtype), [(0, 0), (0, rank - r)]))
            b_stack.append(mx.pad(b.astype(dtype), [(0, rank - r), (0, 0)]))
        self._a_stack, self._b_stack = mx.stack(a_stack), mx.stack(b_stack)
        self._slot_map = mx.array(slot_map, dtype=mx.uint32)
        mx.eval(self._a_stack, self._b_stack, self._slot_map)

    @property
    def weight(self) -> mx.array:  # some model code reads a projection's weight (shapes, tied heads)
        return self.base.weight  # type: ignore[no-any-return]

    def __call__(self, x: mx.array) -> mx.array:
        y: mx.array = self.base(x)
        route = self._owner.route_now
        if route is None or self._a_stack is None:
            return y
        if route.uniform:
            for adapter in route.uniform:  # one adapter for every row: mlx-lm's own computation
                factors = adapter.factors.get(self._name)
                if factors is not None:
                    z = (x @ factors[0]) @ factors[1]
                    y = y + (adapter.scale * z).astype(x.dtype)
            return y
        if x.ndim < 3 or x.shape[0] != route.rows:
            raise ValueError(f"{self._name} sees inputs of shape {tuple(x.shape)}, not one row per sequence: this "
                             "architecture cannot mix adapters in one batch")
        assert self._b_stack is not None and self._slot_map is not None
        for level, scales in route.levels:
            slots = self._slot_map[level]
            z = mx.gather_mm(mx.gather_mm(x, self._a_stack, rhs_indices=slots), self._b_stack, rhs_indices=slots)
            y = y + (scales.reshape(-1, *([1] * (x.ndim - 1))) * z).astype(x.dtype)
        return y
