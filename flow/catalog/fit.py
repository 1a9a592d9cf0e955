"""Will a model fit, how much context, how fast: ``flow fit``, ``GET /fit`` and ``/library``'s badges.

Theory of operation
-------------------
Everything comes from a model directory's ``config.json``, its files' sizes
and its safetensors headers (names, shapes and dtypes; no tensor is read):

* weights: the safetensors files' bytes;
* KV bytes per token and the model's context: :mod:`runtime.model_memory`, the
  code the engine and admission use;
* transient bytes: what a step needs besides weights and KV — the logits of a
  full batch (``max_batch × vocab × 4``) and a prefill chunk's activations
  (``prefill_chunk × intermediate × 4 × 2``);
* usable memory: Metal's recommended working set on macOS, ``MemAvailable``
  on Linux (the memory another process does not hold now);
* maximum safe context: what the KV budget (the admission ceiling ``/stats``
  shows) and the memory left after weights and transients both allow, capped
  at the model's own context;
* predicted decode tok/s: one decode step reads the active weights once, so
  ``memory bandwidth / active bytes``. Active bytes are all weights for a dense
  model; for a mixture of experts, the experts' share scaled by
  ``experts per token / experts`` (from the header's tensor names). The
  bandwidth is ``FLOW_MEMORY_BANDWIDTH_GBPS`` if set, else measured once per
  process by copying a 64 MiB buffer (a CPU figure: a lower bound on Apple GPUs).
* measured: the decode tok/s ``flow bench`` last recorded for the model, if any.
"""

from __future__ import annotations

import json
import os
import struct
import sys
import time
from dataclasses import asdict, dataclass
from functools import cache
from pathlib import Path
from typing import Any

from flow.catalog.capabilities import private_data_dir
from runtime.model_memory import context_length, default_kv_budget_bytes, kv_bytes_per_token
from runtime.private_files import write_private

DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}
EXPERT_MARKERS = (".experts.", ".switch_mlp.", ".block_sparse_moe.experts")
BENCH_FILE = "bench_measured.json"  # flow bench records its decode figure per model here (data dir)


@dataclass(frozen=True)
class Machine:
    """What this machine offers a model."""

    usable_bytes: int
    usable_source: str  # "metal recommended working set" | "MemAvailable" | "physical memory / 2"
    bandwidth_bytes_per_sec: float
    bandwidth_source: str  # "FLOW_MEMORY_BANDWIDTH_GBPS" | "measured copy"
    kv_budget_bytes: int  # the admission ceiling by default (a graph may set its own)


@dataclass(frozen=True)
class Fit:
    """One model's assessment."""

    model: str
    weight_bytes: int
    active_weight_bytes: int
    moe: bool
    kv_bytes_per_token: int
    transient_bytes: int
    context_length: int
    usable_bytes: int
    usable_source: str
    kv_budget_bytes: int
    fits: bool
    max_safe_context: int
    predicted_decode_tps: float
    bandwidth_gbps: float
    bandwidth_source: str
    measured_decode_tps: float | None

    def json(self) -> dict[str, Any]:
        return asdict(self)

    def assessment(self) -> dict[str, Any]:
        """The three figures ``/library`` shows per model."""
        return {"fits": self.fits, "max_safe_context": self.max_safe_context,
                "predicted_decode_tps": self.predicted_decode_tps}


def _usable_memory() -> tuple[int, str]:
    if sys.platform == "darwin":
        try:
            import mlx.core as mx

            info = mx.metal.device_info()
            return int(info["max_recommended_working_set_size"]), "metal recommended working set"
        except Exception:  # no Metal device: fall through to the generic figure
            pass
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024, "MemAvailable"
    except OSError:
        pass
    return default_kv_budget_bytes(), "physical memory / 2"


@cache
def _measured_bandwidth() -> float:
    """Bytes per second of a large memory copy, best of three (read and write both count)."""
    import numpy as np

    src = np.ones(64 << 20, dtype=np.uint8)
    dst = np.empty_like(src)
    best = float("inf")
    for _ in range(3):
        started = time.perf_counter()
        np.copyto(dst, src)
        best = min(best, time.perf_counter() - started)
    return 2 * src.nbytes / best


def machine() -> Machine:
    usable, usable_source = _usable_memory()
    configured = os.environ.get("FLOW_MEMORY_BANDWIDTH_GBPS")
    if configured:
        bandwidth, source = float(configured) * 1e9, "FLOW_MEMORY_BANDWIDTH_GBPS"
    else:
        bandwidth, source = _measured_bandwidth(), "measured copy"
    return Machine(usable, usable_source, bandwidth, source, default_kv_budget_bytes())


def _safetensors_tensors(path: Path) -> dict[str, Any]:
    """A safetensors file's header: tensor name → dtype, shape, offsets (the header only)."""
    with path.open("rb") as f:
        (length,) = struct.unpack("<Q", f.read(8))
        if length > 100 << 20:
            raise ValueError(f"{path.name}: implausible header length {length}")
        header: dict[str, Any] = json.loads(f.read(length))
    header.pop("__metadata__", None)
    return header


def _expert_bytes(files: list[Path]) -> int:
    total = 0
    for file in files:
        try:
            for name, info in _safetensors_tensors(file).items():
                if any(marker in f".{name}" for marker in EXPERT_MARKERS):
                    start, end = info["data_offsets"]
                    total += int(end) - int(start)
        except (OSError, ValueError, KeyError, struct.error):
            return 0  # unreadable header: count the model as dense
    return total


def measured_decode_tps(model_id: str) -> float | None:
    """What ``flow bench`` recorded for ``model_id`` (its id or path), if it ran."""
    try:
        data = json.loads((private_data_dir() / BENCH_FILE).read_text())
    except (OSError, ValueError):
        return None
    entry = data.get(model_id) if isinstance(data, dict) else None
    value = entry.get("decode_tps") if isinstance(entry, dict) else None
    return float(value) if isinstance(value, (int, float)) else None


def record_measured_decode_tps(model_id: str, tps: float) -> None:
    """Keep ``flow bench``'s figure for ``flow fit`` and ``/library`` (the data dir, private to the user)."""
    path = private_data_dir() / BENCH_FILE
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        data = {}
    if not isinstance(data, dict):
        data = {}
    data[model_id] = {"decode_tps": round(tps, 1), "at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    write_private(path, json.dumps(data, indent=1).encode())


def assess(model_id: str, path: Path, *, max_batch: int = 32, prefill_chunk: int = 512,
           kv_budget_bytes: int | None = None, host: Machine | None = None) -> Fit:
    """The fit of the model directory ``path`` (a config.json and safetensors files) on this machine."""
    try:
        config = json.loads((path / "config.json").read_text())
    except (OSError, ValueError) as exc:
        raise ValueError(f"{path}: no readable config.json ({exc})") from exc
    if not isinstance(config, dict):
        raise ValueError(f"{path}: config.json is not an object")
    nested = config.get("text_config")
    text: dict[str, Any] = nested if isinstance(nested, dict) else {}

    def get(key: str) -> Any:
        return config.get(key) if config.get(key) is not None else text.get(key)

    host = host or machine()
    files = sorted(path.glob("*.safetensors"))
    weights = sum(f.stat().st_size for f in files)
    experts = get("num_local_experts") or get("num_experts") or get("n_routed_experts")
    per_token = get("num_experts_per_tok") or get("moe_top_k")
    expert_bytes = _expert_bytes(files) if experts and per_token else 0
    moe = expert_bytes > 0
    active = weights - expert_bytes + (expert_bytes * int(per_token) // int(experts) if moe else 0)
    itemsize = DTYPE_BYTES.get(str(get("torch_dtype") or get("dtype") or "bfloat16"), 2)
    kv = kv_bytes_per_token(get, 0, itemsize)
    hidden = int(get("hidden_size") or 0)
    transient = (max_batch * int(get("vocab_size") or 0) * 4
                 + prefill_chunk * int(get("intermediate_size") or 4 * hidden) * 4 * 2)
    budget = kv_budget_bytes or host.kv_budget_bytes
    room = host.usable_bytes - weights - transient
    native = context_length(config)
    safe = max(0, min(native, budget // kv, room // kv)) if kv > 0 else (native if room > 0 else 0)
    bandwidth = host.bandwidth_bytes_per_sec
    return Fit(
        model=model_id, weight_bytes=weights, active_weight_bytes=active, moe=moe, kv_bytes_per_token=kv,
        transient_bytes=transient, context_length=native, usable_bytes=host.usable_bytes,
        usable_source=host.usable_source, kv_budget_bytes=budget, fits=room > 0 and safe > 0,
        max_safe_context=safe, predicted_decode_tps=round(bandwidth / active, 1) if active else 0.0,
        bandwidth_gbps=round(bandwidth / 1e9, 1), bandwidth_source=host.bandwidth_source,
        measured_decode_tps=measured_decode_tps(model_id),
    )


def human_bytes(n: float) -> str:
    """1536 → "1.5 KB" (binary units, as memory is counted)."""
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1024 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GB"


def text_report(fit: Fit) -> str:
    """``flow fit``'s output: one line per figure."""
    lines = [
        f"model                 {fit.model}",
        f"weights               {human_bytes(fit.weight_bytes)}" + (
            f" ({human_bytes(fit.active_weight_bytes)} active per token: mixture of experts)" if fit.moe else ""),
        f"KV per token          {fit.kv_bytes_per_token:,} bytes",
        f"transient             {human_bytes(fit.transient_bytes)} (logits of a full batch, a prefill chunk)",
        f"usable memory         {human_bytes(fit.usable_bytes)} ({fit.usable_source})",
        f"KV budget             {human_bytes(fit.kv_budget_bytes)} (admission ceiling per request)",
        f"fits                  {'yes' if fit.fits else 'no'}",
        f"max safe context      {fit.max_safe_context:,} tokens (model's own: {fit.context_length:,})",
        f"predicted decode      {fit.predicted_decode_tps:g} tok/s ({fit.bandwidth_gbps:g} GB/s, "
        f"{fit.bandwidth_source})",
        "measured decode       " + (f"{fit.measured_decode_tps:g} tok/s (flow bench)"
                                     if fit.measured_decode_tps is not None else "none yet (run flow bench)"),
    ]
    return "\n".join(lines) + "\n"
