"""The model library, fit and downloads as graph routes: ``GET /library``, ``GET /fit``, ``/downloads``.

* ``library.list``: every local model (``flow models``' scan: hub cache, model directories, smoke-test
  builds) with its kind, family, size, quantization, whether flow can serve it, whether this server is
  serving it now, and its fit on this machine — from files only, cached for ``cache_seconds``.
* ``fit.check``: the whole :class:`~flow.catalog.fit.Fit` for ``?model=ID`` (a library id or a served model's
  name), or for every served model.
* ``downloads.manage``: ``GET`` lists the ``downloads`` resource's recent downloads, ``POST {"repo"}``
  queues one. Offline, a POST is a 503 that says so.

Each answer says whether the hub is offline, and carries the reference server's shape beside flow's own list
(``{object: "list", data: [...]}``, which the console reads): ``GET /library`` → ``models`` (the same entries, with
the reference's ``model_type``); ``GET /downloads`` → ``downloads`` (the reference's records:
:meth:`~flow.resources.downloads.Download.reference_json`); ``GET /fit`` → ``machine``, ``context_tokens``,
``typical_context_tokens``, ``typical_decode_tps``, ``measured_decode_tps``, ``measured_at``, ``report``,
``sku_matrix_ctx`` and ``sku_matrix`` for the first model assessed (:func:`reference_fit`).
"""

from __future__ import annotations

import calendar
import json
import os
import platform
import subprocess
import sys
import time
from functools import cache
from pathlib import Path
from typing import Any, ClassVar
from urllib.parse import parse_qs

import trio
from pydantic import Field

from flow.catalog.capabilities import data_dir
from flow.catalog.fit import BENCH_FILE, Fit, assess
from flow.catalog.local_models import LocalModel, find_local_models
from flow.graph.resource import Reference
from flow.graph.stage import StageConfig
from flow.resources.downloads import DownloadsResource, hub_offline, valid_repo_id
from flow.resources.model import MODEL_REFERENCES, ModelResource
from protocols import openai_chat
from protocols.errors import ApiError
from protocols.ir import HttpRequest
from stages.protocol import EndpointStage

SERVABLE_KINDS = ("text", "embeddings")  # what this version loads (vision and audio are detected, not served)


class LibraryConfig(StageConfig):
    models: list[str] = Field(default_factory=list, description="served model resources marked as serving")
    downloads: str | None = Field(default=None, description="the downloads resource whose finished downloads "
                                                            "refresh the list at once (default: the graph's one)")
    cache_seconds: float = Field(default=30.0, ge=0, description="how long a scan of the local models is reused")


class _LocalModels:
    """The local models with their fit, scanned on a worker thread at most every ``seconds``."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds
        self._at = -float("inf")
        self._version = 0
        self._entries: list[tuple[LocalModel, Fit | None]] = []
        self._lock = trio.Lock()

    async def get(self, version: int = 0) -> list[tuple[LocalModel, Fit | None]]:
        """The scan, again if older than ``seconds`` or ``version`` changed (a download finished)."""
        async with self._lock:  # concurrent requests share one scan
            if time.monotonic() - self._at > self.seconds or version != self._version:
                self._entries = await trio.to_thread.run_sync(self._scan)
                self._at, self._version = time.monotonic(), version
            return self._entries

    @staticmethod
    def _scan() -> list[tuple[LocalModel, Fit | None]]:
        out: list[tuple[LocalModel, Fit | None]] = []
        for model in find_local_models():
            try:
                fit: Fit | None = assess(model.id, model.path) if model.kind == "text" else None
            except ValueError:
                fit = None
            out.append((model, fit))
        return out


def _serving(model: LocalModel, served: tuple[ModelResource, ...]) -> bool:
    return any(m.ready and (m.source == model.id or (m.path is not None and m.path.resolve() == model.path.resolve()))
               for m in served)


class _ServedModelsEndpoint(EndpointStage):
    """An endpoint that knows the graph's model resources (its ``models`` config, default: all)."""

    references = MODEL_REFERENCES
    codec = openai_chat.ChatCodec

    def setup(self) -> None:
        super().setup()
        self.models = self.links.many("models", ModelResource)


class LibraryList(_ServedModelsEndpoint):
    type_name: ClassVar[str] = "library.list"
    monitoring_methods: ClassVar[frozenset[str]] = frozenset({"GET"})
    description = "every local model with kind, family, size, quantization, served now, and its fit (cached)"
    Config = LibraryConfig
    references = {**MODEL_REFERENCES, "downloads": Reference("downloads", required=False)}

    def setup(self) -> None:
        super().setup()
        config = self.config
        assert isinstance(config, LibraryConfig)
        self.local = _LocalModels(config.cache_seconds)
        self.downloads = self.links.optional("downloads", DownloadsResource)

    async def answer(self, http: HttpRequest) -> dict[str, Any]:
        data = []
        for model, fit in await self.local.get(self.downloads.completed if self.downloads is not None else 0):
            data.append({
                "repo_id": model.id, "source": model.source, "kind": model.kind, "family": model.family,
                "size_bytes": model.size_bytes, "quant_bits": model.quantization_bits,
                "vision": model.kind == "vision", "audio": model.kind == "audio",
                "model_type": model.model_type,
                "smoke_test": model.smoke_test, "supported": model.kind in SERVABLE_KINDS,
                "serving": _serving(model, self.models),
                "assessment": fit.assessment() if fit is not None else None,
            })
        return {"models": data, "object": "list", "offline": hub_offline(), "data": data}


class FitConfig(StageConfig):
    models: list[str] = Field(default_factory=list, description="served model resources (default: all)")


class FitCheck(_ServedModelsEndpoint):
    type_name: ClassVar[str] = "fit.check"
    monitoring_methods: ClassVar[frozenset[str]] = frozenset({"GET"})
    description = "weights, KV per token, usable memory, max safe context, predicted and measured decode tok/s"
    Config = FitConfig

    async def answer(self, http: HttpRequest) -> dict[str, Any]:
        query = parse_qs(http.query)
        wanted = query.get("model", [None])[0]
        targets: list[tuple[str, Path, ModelResource | None]] = []
        if wanted is None:
            targets = [(m.name, m.path, m) for m in self.models if m.path is not None and m.kind == "text"]
        else:
            served = next((m for m in self.models if wanted in m.ids and m.path is not None), None)
            if served is not None:
                targets = [(wanted, served.path, served)] if served.path is not None else []
            else:
                local = await trio.to_thread.run_sync(find_local_models)
                found = next((m for m in local if m.id == wanted), None)
                if found is None:
                    raise ApiError("not_found", f"No local model {wanted!r}: name a served model or an id from "
                                   f"GET /library ({', '.join(m.id for m in local[:20]) or 'none here'}).",
                                   param="model", code="model_not_found")
                targets = [(found.id, found.path, None)]

        def run() -> tuple[list[Fit], dict[str, Any]]:
            out = []
            for name, path, served in targets:
                kwargs: dict[str, Any] = {}
                if served is not None:  # the served model's own engine settings and admission ceiling
                    c = served.config
                    kwargs = {"max_batch": c.max_batch, "prefill_chunk": c.prefill_chunk,
                              "kv_budget_bytes": served.kv_budget_bytes}
                try:
                    out.append(assess(name, path, **kwargs))
                except ValueError as exc:
                    raise ApiError("invalid_request", f"{name}: {exc}", param="model") from None
            return out, reference_fit(out[0] if out else None)

        fits, reference = await trio.to_thread.run_sync(run)
        return {**reference, "object": "list", "offline": hub_offline(), "data": [f.json() for f in fits]}


# ------------------------------------------------------------------------------ /fit in the reference's shape

GB = 1 << 30
TYPICAL_CONTEXT = 8192  # the reference's typical context: min(8192, context_tokens)
SKU_MATRIX_CONTEXT = 32768  # the context each SKU's row is judged at (the model's own, if shorter)
# Apple silicon as sold: (chip, unified memory in GB, memory bandwidth in GB/s, Apple's published figures).
APPLE_SKUS: tuple[tuple[str, int, float], ...] = (
    ("M1", 8, 68.25), ("M1", 16, 68.25), ("M1 Pro", 16, 200), ("M1 Pro", 32, 200), ("M1 Max", 32, 400),
    ("M1 Max", 64, 400), ("M1 Ultra", 64, 800), ("M1 Ultra", 128, 800),
    ("M2", 8, 100), ("M2", 16, 100), ("M2", 24, 100), ("M2 Pro", 16, 200), ("M2 Pro", 32, 200),
    ("M2 Max", 32, 400), ("M2 Max", 64, 400), ("M2 Max", 96, 400), ("M2 Ultra", 64, 800),
    ("M2 Ultra", 128, 800), ("M2 Ultra", 192, 800),
    ("M3", 8, 100), ("M3", 16, 100), ("M3", 24, 100), ("M3 Pro", 18, 150), ("M3 Pro", 36, 150),
    ("M3 Max", 36, 300), ("M3 Max", 48, 400), ("M3 Max", 64, 400), ("M3 Max", 96, 300), ("M3 Max", 128, 400),
    ("M3 Ultra", 96, 819), ("M3 Ultra", 256, 819), ("M3 Ultra", 512, 819),
    ("M4", 16, 120), ("M4", 24, 120), ("M4", 32, 120), ("M4 Pro", 24, 273), ("M4 Pro", 48, 273),
    ("M4 Pro", 64, 273), ("M4 Max", 36, 410), ("M4 Max", 48, 546), ("M4 Max", 64, 546), ("M4 Max", 128, 546),
)


@cache
def _chip() -> str:
    """This machine's processor as the system names it (``Apple M4 Pro``; on Linux the CPU's model name)."""
    try:
        if sys.platform == "darwin":
            return subprocess.run(["sysctl", "-n", "machdep.cpu.brand_string"], capture_output=True, text=True,
                                  timeout=5, check=True).stdout.strip() or platform.machine()
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("model name", "Model")):  # x86's model name; an Arm board's Model
                return line.split(":", 1)[1].strip()
    except (OSError, subprocess.SubprocessError):
        pass
    return platform.processor() or platform.machine()


def _ram_bytes() -> int:
    try:
        return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    except (ValueError, OSError, AttributeError):
        return 0


def _measured_at(model_id: str) -> int | None:
    """When ``flow bench`` recorded the model's decode figure (unix ms), if it did (flow.catalog.fit's BENCH_FILE)."""
    try:
        entry = json.loads((data_dir() / BENCH_FILE).read_text()).get(model_id)
        return calendar.timegm(time.strptime(entry["at"], "%Y-%m-%dT%H:%M:%SZ")) * 1000
    except (OSError, ValueError, AttributeError, KeyError, TypeError):
        return None


def _decode_tps(bandwidth_bytes: float, fit: Fit, context: int) -> float:
    """Decode tok/s with ``context`` tokens in the KV: a step reads the active weights and the KV once each (the
    report's predicted_decode_tps, flow's figure, counts the weights only)."""
    read = fit.active_weight_bytes + fit.kv_bytes_per_token * context
    return round(bandwidth_bytes / read, 1) if read else 0.0


def _safe_context(fit: Fit, usable: int, budget: int) -> int:
    """flow.catalog.fit's maximum safe context on a machine with ``usable`` memory and a KV ``budget``."""
    room = usable - fit.weight_bytes - fit.transient_bytes
    if fit.kv_bytes_per_token <= 0:
        return fit.context_length if room > 0 else 0
    return max(0, min(fit.context_length, budget // fit.kv_bytes_per_token, room // fit.kv_bytes_per_token))


def _sku_row(fit: Fit, chip: str, ram_gb: int, bandwidth_gbs: float, context: int) -> dict[str, Any]:
    """One SKU, judged as flow.catalog.fit judges this machine: Metal's recommended working set as usable memory
    (about two thirds of the memory up to 36 GB, three quarters above: macOS's own split, approximated), a KV
    budget of half the memory (flow's default admission ceiling), at most ``context`` tokens."""
    ram = ram_gb * GB
    usable = ram * 3 // 4 if ram_gb > 36 else ram * 2 // 3
    safe = min(context, _safe_context(fit, usable, ram // 2))
    fits = usable > fit.weight_bytes + fit.transient_bytes and safe > 0
    return {"sku": f"{chip} {ram_gb} GB", "ram_gb": ram_gb, "fits": fits, "max_context": safe,
            "decode_tps": _decode_tps(bandwidth_gbs * 1e9, fit, safe) if fits else 0.0,
            "bandwidth_gbs": bandwidth_gbs}


def reference_fit(fit: Fit | None) -> dict[str, Any]:
    """``GET /fit`` in the reference's shape, for ``fit`` (None: nothing to assess, only the machine), every field
    from flow.catalog.fit's figures: ``context_tokens`` is the admission ceiling (the maximum safe context),
    ``report.kv_bytes`` the KV at that context, ``total_bytes`` weights + KV + transients. Blocking (a worker
    thread): it may read the system's chip name once."""
    machine = {"chip": _chip(), "ram_bytes": _ram_bytes(),
               "bandwidth_gbs": fit.bandwidth_gbps if fit is not None else None,
               "usable_bytes": fit.usable_bytes if fit is not None else None,
               "bandwidth_source": fit.bandwidth_source if fit is not None else None}
    if fit is None:
        return {"model": None, "machine": machine, "context_tokens": None, "typical_context_tokens": None,
                "typical_decode_tps": None, "measured_decode_tps": None, "measured_at": None, "report": None,
                "sku_matrix_ctx": None, "sku_matrix": []}
    context = fit.max_safe_context
    typical = min(TYPICAL_CONTEXT, context)
    kv = fit.kv_bytes_per_token * context
    matrix_context = min(SKU_MATRIX_CONTEXT, fit.context_length)
    measured = fit.measured_decode_tps
    return {
        "model": fit.model, "machine": machine, "context_tokens": context, "typical_context_tokens": typical,
        "typical_decode_tps": _decode_tps(fit.bandwidth_gbps * 1e9, fit, typical),
        "measured_decode_tps": measured, "measured_at": _measured_at(fit.model) if measured is not None else None,
        "report": {"fits": fit.fits, "weights_bytes": fit.weight_bytes, "kv_bytes": kv,
                   "transient_bytes": fit.transient_bytes, "total_bytes": fit.weight_bytes + kv + fit.transient_bytes,
                   "usable_bytes": fit.usable_bytes, "max_safe_context": fit.max_safe_context,
                   "predicted_decode_tps": fit.predicted_decode_tps, "kv_bytes_per_token": fit.kv_bytes_per_token,
                   "kv_budget_bytes": fit.kv_budget_bytes},
        "sku_matrix_ctx": matrix_context,
        "sku_matrix": [_sku_row(fit, chip, ram, bandwidth, matrix_context) for chip, ram, bandwidth in APPLE_SKUS],
    }


# ---------------------------------------------------------------------------------------------- downloads


class DownloadsStageConfig(StageConfig):
    downloads: str | None = None  # the downloads resource (default: the graph's only one)


class DownloadsManage(EndpointStage):
    type_name: ClassVar[str] = "downloads.manage"
    monitoring_methods: ClassVar[frozenset[str]] = frozenset({"GET"})
    description = "GET: recent downloads with progress; POST {\"repo\": \"owner/name\", \"revision\"}: queue one"
    Config = DownloadsStageConfig
    references = {"downloads": Reference("downloads")}
    codec = openai_chat.ChatCodec

    def setup(self) -> None:
        super().setup()
        self.resource = self.links.one("downloads", DownloadsResource)

    async def answer(self, http: HttpRequest) -> dict[str, Any]:
        if http.method == "POST":
            return self.queue(http)
        recent = list(reversed(self.resource.downloads))
        return {"downloads": [d.reference_json() for d in recent], "object": "list", "offline": hub_offline(),
                "data": [d.json() for d in recent]}

    def queue(self, http: HttpRequest) -> dict[str, Any]:
        try:
            body = json.loads(http.body)
        except ValueError:
            raise ApiError("invalid_request", "The body must be JSON: {\"repo\": \"owner/name\"}.") from None
        repo = body.get("repo") if isinstance(body, dict) else None
        revision = body.get("revision", "main") if isinstance(body, dict) else "main"
        if not valid_repo_id(repo):
            raise ApiError("invalid_request", f"'repo' must be a Hugging Face repository id (owner/name); got "
                           f"{repo!r}.", param="repo")
        if not isinstance(revision, str) or not revision or len(revision) > 200:
            raise ApiError("invalid_request", "'revision' must be a branch, tag or commit.", param="revision")
        if hub_offline():
            raise ApiError("unavailable", "The hub is offline here (HF_HUB_OFFLINE is set): nothing can be "
                           "downloaded. GET /library lists the models already in the cache.")
        return {**self.resource.queue(repo, revision).json(), "object": "download"}
