"""The model library, fit and downloads as graph routes: ``GET /library``, ``GET /fit``, ``/downloads``.

* ``library.list``: every local model (``flow models``' scan: hub cache, model directories, smoke-test
  builds) with its kind, family, size, quantization, whether flow can serve it, whether this server is
  serving it now, and its fit on this machine — from files only, cached for ``cache_seconds``.
* ``fit.check``: the whole :class:`~flow.fit.Fit` for ``?model=ID`` (a library id or a served model's
  name), or for every served model.
* ``downloads.manage``: ``GET`` lists the ``downloads`` resource's recent downloads, ``POST {"repo"}``
  queues one. Offline, a POST is a 503 that says so.

Each answer says whether the hub is offline.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any, ClassVar
from urllib.parse import parse_qs

import trio
from pydantic import Field

from flow.downloads import DownloadsResource, hub_offline, valid_repo_id
from flow.fit import Fit, assess
from flow.local_models import LocalModel, find_local_models
from flow.resource import Reference
from flow.resources import MODEL_REFERENCES, ModelResource
from flow.stage import StageConfig
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

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.models = self.links.many("models", ModelResource)


class LibraryList(_ServedModelsEndpoint):
    type_name: ClassVar[str] = "library.list"
    monitoring_methods: ClassVar[frozenset[str]] = frozenset({"GET"})
    description = "every local model with kind, family, size, quantization, served now, and its fit (cached)"
    Config = LibraryConfig
    references = {**MODEL_REFERENCES, "downloads": Reference("downloads", required=False)}

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
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
                "smoke_test": model.smoke_test, "supported": model.kind in SERVABLE_KINDS,
                "serving": _serving(model, self.models),
                "assessment": fit.assessment() if fit is not None else None,
            })
        return {"object": "list", "offline": hub_offline(), "data": data}


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

        def run() -> list[dict[str, Any]]:
            out = []
            for name, path, served in targets:
                kwargs: dict[str, Any] = {}
                if served is not None:  # the served model's own engine settings and admission ceiling
                    c = served.config
                    kwargs = {"max_batch": c.max_batch, "prefill_chunk": c.prefill_chunk,
                              "kv_budget_bytes": served.kv_budget_bytes}
                try:
                    out.append(assess(name, path, **kwargs).json())
                except ValueError as exc:
                    raise ApiError("invalid_request", f"{name}: {exc}", param="model") from None
            return out

        return {"object": "list", "offline": hub_offline(), "data": await trio.to_thread.run_sync(run)}


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

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.resource = self.links.one("downloads", DownloadsResource)

    async def answer(self, http: HttpRequest) -> dict[str, Any]:
        if http.method == "POST":
            return self.queue(http)
        return {"object": "list", "offline": hub_offline(),
                "data": [d.json() for d in reversed(self.resource.downloads)]}

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
