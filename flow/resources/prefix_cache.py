"""The ``prefix_cache`` resource: the graph's KV prefix cache, shared by its models.

Declaring it is all it takes::

    [resources.prefix_cache]
    type = "prefix_cache"
    hot_bytes = 2147483648          # memory for cached KV blocks
    disk = true                     # warm tier: survives restarts
    disk_max_bytes = 8589934592
    default_ttl_seconds = 86400

It serves every model resource of the graph (or those named in ``models``; a
model has at most one prefix cache), taken in before they load; each model's engine then reuses cached prefixes
and adds its sequences' blocks (see :mod:`runtime.prefix_cache`). Keys start
from the model's weights, so models never share blocks. While serving, it
deletes expired blocks every ``sweep_seconds``.

The disk tier is a cache: a damaged index is set aside and the tier starts cold
(see :mod:`runtime.kv_disk`); a tier that cannot start at all (a directory it
cannot write) leaves the cache in memory only, with the reason in ``/stats``.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, Literal

import trio
from pydantic import Field

from flow.catalog.capabilities import data_dir, private_data_dir
from flow.graph.metrics import Metric
from flow.graph.resource import Links, Reference, Resource, ResourceConfig
from flow.resources.model import ModelResource
from runtime.device import DeviceThread

if TYPE_CHECKING:
    from runtime.kv_disk import DiskTier

log = logging.getLogger("flow.resources.prefix_cache")


class PrefixCacheConfig(ResourceConfig):
    block_tokens: int = Field(default=16, ge=8, le=4096, description="tokens per KV block (the unit of reuse)")
    hot_bytes: int = Field(default=2 << 30, ge=1 << 20, description="memory for cached KV blocks (LRU beyond)")
    disk: bool = Field(default=True, description="keep blocks on disk too (warm tier, survives restarts)")
    directory: str | None = Field(default=None, description="warm tier directory (default: DATA_DIR/kv-cache)")
    disk_max_bytes: int = Field(default=8 << 30, ge=1 << 20, description="disk for cached KV blocks (LRU beyond)")
    default_ttl_seconds: float = Field(default=86400.0, gt=0,
                                       description="how long blocks live after their last use, unless a request "
                                                   "says otherwise (Anthropic cache_control ttl, OpenAI ttl)")
    sweep_seconds: float = Field(default=60.0, gt=0, description="how often expired blocks are deleted")
    disk_kv_bits: Literal[4, 8] | None = Field(
        default=None, description="quantize blocks on disk to 8 (or 4) bits, in groups along the head dimension: "
                                  "about 2x (4x from float32) the blocks per GiB, read back slightly lossy")
    audit_rate: float = Field(default=0.0, ge=0.0, le=1.0,
                              description="the share of cache hits recomputed cold on idle device time, their "
                                          "next-token logits compared with the hit's (/stats audit; 0: off)")
    models: list[str] = Field(default_factory=list, description="model resources that use it (default: all)")


class PrefixCacheResource(Resource):
    type_name: ClassVar[str] = "prefix_cache"
    Config: ClassVar[type[ResourceConfig]] = PrefixCacheConfig
    references = {"models": Reference("model", many=True, serves=True, exclusive=True)}
    description: ClassVar[str] = "KV prefix cache in token blocks: memory, then disk; shared by sessions"
    config: PrefixCacheConfig

    def __init__(self, resource_id: str, config: ResourceConfig, links: Links) -> None:
        super().__init__(resource_id, config, links)
        from runtime.prefix_cache import PrefixCache, PrefixConfig  # MLX: only when a graph is built

        settings = self.config
        self.cache = PrefixCache(PrefixConfig(block_tokens=settings.block_tokens, hot_bytes=settings.hot_bytes,
                                              default_ttl=settings.default_ttl_seconds,
                                              disk_kv_bits=settings.disk_kv_bits, audit_rate=settings.audit_rate))
        self._device: DeviceThread | None = None
        self.disk_error: str | None = None  # why the disk tier did not start
        self.memory_only = False  # it serves a distributed model: no disk tier

    @property
    def directory(self) -> Path:
        return Path(self.config.directory).expanduser() if self.config.directory else data_dir() / "kv-cache"

    def serve(self, target: Resource) -> None:
        """A model it serves was built: its engine will use this cache once it loads."""
        assert isinstance(target, ModelResource)
        target.prefix_cache = self.cache
        if target.config.distributed is not None and self.config.disk:
            # Every rank's cache must hold the blocks rank 0 reuses; the other ranks' are in memory only.
            log.warning("prefix cache %s: in memory only, as it serves a distributed model (%s)", self.id, target.name)
            self.memory_only = True

    async def start(self, device: DeviceThread) -> None:
        self._device = device
        if self.config.disk and not self.memory_only:
            try:
                self.cache.disk = await trio.to_thread.run_sync(self._open_disk)
            except Exception as exc:  # a cache: serve without it rather than not at all
                self.disk_error = f"{type(exc).__name__}: {exc}"
                log.warning("prefix cache: no disk tier in %s (%s); blocks stay in memory only", self.directory,
                            self.disk_error)
                return
            log.info("prefix cache: warm tier in %s (%d blocks)", self.directory, len(self.cache.disk.index))

    def _open_disk(self) -> DiskTier:
        default = self.config.directory is None
        if default:
            private_data_dir()  # the data directory is flow's: 0700, even if an older version made it
        return open_tier(self.directory, self.config.disk_max_bytes, own_directory=default)

    async def run(self) -> None:
        """Delete expired blocks now and then (on the device thread: they hold MLX arrays)."""
        while True:
            await trio.sleep(self.config.sweep_seconds)
            if self._device is not None:
                await self._device.run(self.cache.sweep)

    def close(self) -> None:
        if self.cache.disk is not None:
            close_tier(self.cache.disk)

    def stats(self) -> dict[str, Any] | None:
        out = {"type": self.type_name, **self.cache.stats_json()}
        if self.disk_error is not None:
            out["disk_error"] = self.disk_error
        return out

    def metrics(self) -> list[Metric]:
        """For ``/metrics``: reuse, blocks and bytes by tier, evictions."""
        s = self.cache.stats_json()
        rid = {"resource": self.id}
        lookups = Metric("flow_prefix_cache_lookups_total", "Prompts looked up in the prefix cache.", "counter")
        lookups.set(s["lookups"], **rid)
        hits = Metric("flow_prefix_cache_hits_total", "Lookups that reused at least one block.", "counter")
        hits.set(s["hits"], **rid)
        reused = Metric("flow_prefix_cache_reused_tokens_total", "Prompt tokens served from the prefix cache.",
                        "counter")
        reused.set(s["reused_tokens"], **rid)
        rate = Metric("flow_prefix_cache_hit_rate", "Reused tokens / looked-up tokens since start.", "gauge")
        rate.set(s["hit_rate"], **rid)
        blocks = Metric("flow_prefix_cache_blocks", "Cached KV blocks by tier.", "gauge")
        size = Metric("flow_prefix_cache_bytes", "Bytes of cached KV blocks by tier.", "gauge")
        for tier in ("hot", "warm"):
            blocks.set(s["blocks"][tier], tier=tier, **rid)
        size.set(s["hot_bytes"], tier="hot", **rid)
        size.set(s.get("disk", {}).get("bytes", 0), tier="warm", **rid)
        evictions = Metric("flow_prefix_cache_evictions_total", "Blocks pushed out of memory.", "counter")
        evictions.set(s["evictions"], **rid)
        audit = s["audit"]
        audits = Metric("flow_prefix_cache_audits_total", "Cache hits recomputed cold and compared (audit_rate).",
                        "counter")
        audits.set(audit["audits"], **rid)
        agreements = Metric("flow_prefix_cache_audit_agreements_total",
                            "Audited hits whose next token (argmax) equals the cold run's.", "counter")
        agreements.set(audit["agreements"], **rid)
        difference = Metric("flow_prefix_cache_audit_max_difference",
                            "The largest |hit - cold| next-token logit an audit found.", "gauge")
        difference.set(audit["max_difference"], **rid)
        return [lookups, hits, reused, rate, blocks, size, evictions, audits, agreements, difference]


# One warm tier per directory in the process: a reload that rebuilds a prefix cache opens the new one while
# the old one still serves its last requests, and two tiers on one directory would each take the other's
# block files for orphans. The tier is shared, counted, and closed with its last user.
_open_tiers: dict[Path, tuple[DiskTier, int]] = {}


def open_tier(directory: Path, max_bytes: int, *, own_directory: bool) -> DiskTier:
    from runtime.kv_disk import DiskTier

    key = directory.resolve()
    found = _open_tiers.get(key)
    if found is not None:
        tier, users = found
        tier.max_bytes = max_bytes  # the newest config's cap
        _open_tiers[key] = (tier, users + 1)
        return tier
    tier = DiskTier(directory, max_bytes, own_directory=own_directory)
    _open_tiers[key] = (tier, 1)
    return tier


def close_tier(tier: DiskTier) -> None:
    for key, (open_one, users) in list(_open_tiers.items()):
        if open_one is tier:
            if users > 1:
                _open_tiers[key] = (tier, users - 1)
                return
            del _open_tiers[key]
    tier.close()
