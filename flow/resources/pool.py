"""The ``model_pool`` resource: several models per graph, loaded on demand, within limits.

Without a pool every model loads when the server starts and stays. With one,
the graph's models share its limits: at most ``max_loaded`` models and
``max_bytes`` of weights at once. A request for an unloaded model loads it
(requests for a model that is loading wait for that one load); making room
evicts the least recently used model that is neither pinned nor busy.
``idle_unload_seconds`` unloads models nobody has used for that long.

"Busy" protects in-flight requests: a model with sequences in its engine, or
one a request touched within ``grace_seconds`` (a request between prepare and
generate has no sequence yet), is never evicted. When nothing can be evicted,
a load waits up to ``wait_seconds`` for room, then the request is answered
429/529 with a retry-after.
"""

from __future__ import annotations

import logging
import time
from typing import Any, ClassVar

import trio
from pydantic import Field

from flow.graph.resource import Links, Reference, Resource, ResourceConfig
from flow.resources.model import ModelResource
from protocols.errors import ApiError
from runtime.models import weight_bytes_on_disk

log = logging.getLogger("flow.resources.pool")


class PoolConfig(ResourceConfig):
    max_loaded: int | None = Field(default=None, ge=1, description="models loaded at once (default: no limit)")
    max_bytes: int | None = Field(default=None, ge=1, description="weight bytes loaded at once (default: no limit)")
    idle_unload_seconds: float | None = Field(default=None, gt=0, description="unload unpinned models idle this long")
    grace_seconds: float = Field(default=2.0, ge=0, description="a model used this recently counts as busy")
    wait_seconds: float = Field(default=120.0, gt=0, description="how long a load waits for room before 429/529")
    models: list[str] = Field(default_factory=list, description="model resources it manages (default: all)")


class ModelPool(Resource):
    type_name: ClassVar[str] = "model_pool"
    Config: ClassVar[type[ResourceConfig]] = PoolConfig
    references = {"models": Reference("model", many=True, serves=True, exclusive=True)}
    description: ClassVar[str] = "shares load limits (count, bytes, idle time) among the graph's models"
    config: PoolConfig

    def __init__(self, resource_id: str, config: ResourceConfig, links: Links) -> None:
        super().__init__(resource_id, config, links)
        self.models: list[ModelResource] = []
        self.evictions = 0
        self.idle_unloads = 0
        self._room: trio.Lock | None = None  # made inside the trio run, on first use
        self._admitted: set[ModelResource] = set()  # given room, still loading: they count as loaded

    def serve(self, target: Resource) -> None:
        """Take charge of a model before it loads."""
        assert isinstance(target, ModelResource)
        self.models.append(target)
        target.pool = self

    def release(self, target: Resource) -> None:
        if target in self.models:
            self.models.remove(target)

    def _loaded(self, besides: ModelResource | None = None) -> list[ModelResource]:
        return [m for m in self.models if m.ready and m is not besides]

    def _claimed(self, besides: ModelResource) -> list[ModelResource]:
        """Loaded models and the ones given room that are still loading (two eager models starting together
        must not both fit a one-model pool)."""
        return [m for m in self.models if (m.ready or m in self._admitted) and m is not besides]

    def load_finished(self, model: ModelResource) -> None:
        """The load :meth:`make_room` made room for is over (loaded or failed)."""
        self._admitted.discard(model)

    def _over(self, incoming: ModelResource, incoming_bytes: int) -> bool:
        loaded = self._claimed(incoming)
        if self.config.max_loaded is not None and len(loaded) + 1 > self.config.max_loaded:
            return True
        used = sum(m.weight_bytes for m in loaded)
        return self.config.max_bytes is not None and used + incoming_bytes > self.config.max_bytes

    async def make_room(self, incoming: ModelResource) -> None:
        """Evict least recently used idle models until ``incoming`` fits; wait for room if none is idle."""
        if self._room is None:
            self._room = trio.Lock()
        path = await trio.to_thread.run_sync(incoming.resolve_source)
        incoming_bytes = await trio.to_thread.run_sync(weight_bytes_on_disk, path)
        if self.config.max_bytes is not None and incoming_bytes > self.config.max_bytes:
            raise ApiError("invalid_request", f"Model {incoming.name!r} needs about {incoming_bytes / 2**20:.0f} "
                           f"MiB, more than the pool's max_bytes ({self.config.max_bytes / 2**20:.0f} MiB).",
                           param="model")
        deadline = trio.current_time() + self.config.wait_seconds
        async with self._room:  # one eviction decision at a time
            while self._over(incoming, incoming_bytes):
                idle = [m for m in self._loaded(incoming) if not m.pinned and not m.busy(self.config.grace_seconds)]
                if idle:
                    victim = min(idle, key=lambda m: m.last_used)
                    log.info("pool %s: evicting %s to load %s", self.id, victim.name, incoming.name)
                    self.evictions += 1
                    await victim.unload()
                    continue
                if trio.current_time() >= deadline:
                    raise ApiError("overloaded", f"Every loaded model is busy or pinned; {incoming.name!r} cannot "
                                   "be loaded now.", retry_after=5)
                await trio.sleep(0.05)
            self._admitted.add(incoming)

    async def run(self) -> None:
        """Background duty while serving: unload models idle for ``idle_unload_seconds``."""
        idle_after = self.config.idle_unload_seconds
        if idle_after is None:
            return
        while True:
            # A quarter of the idle time, between a quarter second (a tiny setting must not spin the loop) and 5 s.
            await trio.sleep(min(max(idle_after / 4, 0.25), 5.0))
            for model in self._loaded():
                if not model.pinned and not model.busy(idle_after):
                    log.info("pool %s: unloading %s (idle %.0f s)", self.id, model.name,
                             time.monotonic() - model.last_used)
                    self.idle_unloads += 1
                    await model.unload()

    def stats(self) -> dict[str, Any] | None:
        loaded = self._loaded()
        return {
            "type": self.type_name,
            "loaded": [m.name for m in loaded],
            "loaded_bytes": sum(m.weight_bytes for m in loaded),
            "pinned": [m.name for m in self.models if m.pinned],
            "models": {m.name: {"state": m.state, "loads": m.loads} for m in self.models},
            "max_loaded": self.config.max_loaded, "max_bytes": self.config.max_bytes,
            "evictions": self.evictions, "idle_unloads": self.idle_unloads,
        }
