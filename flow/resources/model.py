"""The ``model`` resource: a loaded model, its tokenizer and its engine.

A resource outlives requests (see :mod:`flow.graph.resource`). A model is served by
at most one prefix cache and one model pool, each of which names it in its own
``models`` reference; they take it in through :meth:`Resource.serve` when it is
built, before it loads. The MLX side (:mod:`runtime.models`) is imported when a
model loads, so compiling, checking and drawing graphs never imports MLX.
"""

from __future__ import annotations

import fnmatch
import logging
import os
import signal
import time
from collections.abc import Callable, Iterable, Mapping
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, Literal, Protocol

import trio
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from flow.catalog.capabilities import CapabilityStore, family_from_capabilities
from flow.catalog.families import Family, builtin_families, resolve_family
from flow.graph.resource import Links, Reference, Resource, ResourceConfig
from flow.resources import heap
from flow.resources.adapters import AdapterRegistry
from flow.resources.cluster import Cluster, ClusterError, Placement
from protocols.errors import ApiError
from runtime.device import DeviceThread
from runtime.engine_config import EngineConfig, KVQuantization, SpeculativeConfig, Strategy
from runtime.model_kinds import ModelKind, detect_kind_of
from runtime.model_memory import default_kv_budget_bytes

CHAT_KINDS: tuple[ModelKind, ...] = ("text", "vision")  # the kinds that serve chat: vision models read text too

if TYPE_CHECKING:
    from runtime.audio import LoadedAudio
    from runtime.distributed import Broadcast
    from runtime.embeddings import LoadedEmbedder
    from runtime.models import LoadedModel
    from runtime.prefix_cache import PrefixCache

log = logging.getLogger("flow.resources.model")


# The reference stages and resources use to name the models they serve.
MODEL_REFERENCES = {"models": Reference("model", many=True)}


class LoadGate(Protocol):
    """What a model asks of the pool that serves it before it loads."""

    async def make_room(self, incoming: ModelResource) -> None: ...

    def load_finished(self, model: ModelResource) -> None: ...


class SpeculativeSettings(BaseModel):
    """The ``speculative`` table of a model resource (see runtime.engine_config.SpeculativeConfig)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    kind: Literal["off", "ngram", "draft", "mtp"] = Field(
        default="off", description="off; ngram: prompt-lookup drafts; draft: a draft model's (see draft); mtp: the "
                                   "model's own multi-token-prediction layers (Qwen3.5 checkpoints' mtp.* weights)")
    draft: str | None = Field(default=None, description="kind draft: the model resource that proposes (a small "
                                                         "model with this one's tokenizer)")
    max_draft: int = Field(default=8, ge=1, le=64, description="tokens a row may propose per step")
    min_ngram: int = Field(default=2, ge=1, le=16, description="shortest suffix looked up in the row's history")
    max_ngram: int = Field(default=4, ge=1, le=16, description="longest suffix looked up (tried first)")
    max_batch: int = Field(default=4, ge=1, description="steps with more rows than this decode without drafts")

    @model_validator(mode="after")
    def _ngram_range(self) -> SpeculativeSettings:
        if self.min_ngram > self.max_ngram:
            raise ValueError(f"min_ngram ({self.min_ngram}) is above max_ngram ({self.max_ngram})")
        if (self.kind == "draft") != (self.draft is not None):
            raise ValueError("kind = \"draft\" and draft = \"<model resource>\" go together")
        return self


class DistributedSettings(BaseModel):
    """The ``distributed`` table of a model resource: one model served by a group of processes (mlx.distributed;
    rank 0 is the server itself, ``flow serve`` starts the others)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    ranks: int | None = Field(default=None, ge=2, description="processes on this machine (loopback ring); or hostfile")
    hostfile: str | None = Field(default=None, description="an mlx.launch hostfile (JSON hosts with ips); or ranks")
    backend: Literal["ring", "jaccl", "mpi", "nccl", "any"] = Field(
        default="ring", description="mx.distributed backend: ring (TCP), jaccl (Thunderbolt RDMA), mpi, nccl, any")
    parallel: Literal["tensor", "pipeline"] = Field(
        default="tensor", description="tensor: every rank holds a slice of every layer (model.shard); pipeline: "
                                      "each rank holds some of the layers")
    watchdog_seconds: float = Field(default=60.0, gt=0, description="a step or collective waiting longer than "
                                                                      "this stops the group")
    heartbeat_seconds: float = Field(default=1.0, gt=0, description="an idle rank 0 shows it is alive this often")
    ssh: str = Field(default="ssh", description="the command that starts ranks on the hostfile's other hosts")
    python: str | None = Field(default=None, description="the Python on the other hosts, with flow, mlx and mlx-lm "
                                                         "(default: this one's path)")
    restart: bool = Field(default=False, description="when the group is lost: the server drains and executes itself "
                                                     "again (MLX forms one group per process), which starts the ranks "
                                                     "anew; off: it stays down (503) until restarted")

    @model_validator(mode="after")
    def _one_placement(self) -> DistributedSettings:
        if (self.ranks is None) == (self.hostfile is None):
            raise ValueError("give either ranks (processes on this machine) or hostfile (an mlx.launch hostfile)")
        return self


class ModelConfig(ResourceConfig):
    path: str = Field(description="local directory, Hugging Face repo id, or tiny:PRESET ($VARS and ~ expand)")
    fallbacks: list[str] = Field(
        default_factory=list, description="other sources, tried in order when the ones before are not on this "
                                          "machine (nothing is downloaded but for the last): a demo serves a real "
                                          "model where one is present, a smoke-test model otherwise")
    name: str | None = Field(default=None, description="the model id clients use (default: the resource id)")
    aliases: list[str] = Field(default_factory=list, description="other ids that select this model; glob patterns "
                                                                   "(claude-*, *) answer ids no model names exactly")
    max_batch: int = Field(default=32, ge=1, description="sequences decoding at once")
    prefill_chunk: int = Field(default=512, ge=16,
                               description="prompt tokens a prefill pass holds; an engine step prefills one chunk, "
                                           "up to prefill_burst while more prompts wait than rows decode")
    prefill_burst: int = Field(default=4, ge=1, le=64,
                               description="chunks a step may prefill while more prompts wait than rows decode "
                                           "(a burst starts together; 1: one chunk a step, the shortest stall a step)")
    stream_interval_ms: float = Field(default=10.0, ge=0, le=1000,
                                      description="steps quicker than this hand their tokens out together, one "
                                                  "chunk a stream (first and last tokens never wait; 0: every "
                                                  "step's tokens at once)")
    strategy: Strategy = Field(
        default="decode_first",
        description="engine step order: decode_first (streams first), prefill_first (new requests first), "
                    "balanced (decode first; prefill every other step once the batch is half full)")
    max_queue: int = Field(default=256, ge=1, description="requests waiting for a batch slot beyond which "
                                                          "new ones get 429 with Retry-After")
    default_max_tokens: int = Field(default=2048, ge=1, description="max_tokens when a request gives none")
    family: str = Field(default="auto", description="model family (graphs/families/*.toml), or auto-detect")
    kind: Literal["auto", "text", "vision", "embeddings", "audio"] = Field(
        default="auto", description="what the model does, which decides its loader: auto-detected from its "
                                    "config.json, or text (mlx-lm), vision, embeddings, audio")
    load: Literal["eager", "lazy"] = Field(
        default="eager", description="eager: load when the server starts; lazy: on the first request for it")
    pin: bool = Field(default=False, description="never evicted from the model pool")
    embed_pass_tokens: int = Field(
        default=8192, ge=64, description="embedding models: padded tokens per forward pass (inputs of concurrent "
                                         "requests share passes up to this)")
    embed_pass_seconds: float = Field(
        default=0.1, gt=0, description="embedding models: while others ask, a large job's pass holds no more "
                                       "padded tokens than the device computes in this time (measured); a small "
                                       "request arriving during it is served between two of its layers")
    dimensions: list[int] = Field(
        default_factory=list, description="embedding models: the Matryoshka sizes the model was trained to be cut "
                                          "to (default: from its config.json, model card or series)")
    audio_share: float = Field(
        default=0.2, gt=0, le=1, description="audio models: the most of the device's time audio jobs take while "
                                             "other models' requests wait (a long transcription does not freeze "
                                             "chat streams); alone, they take all of it")
    vision_share: float = Field(
        default=0.15, gt=0, le=1, description="vision models: the most of the device's time the vision tower takes "
                                             "while streams decode (a new image does not freeze them; its layers "
                                             "run between their steps); with nothing decoding, all of it")
    speech_max_tokens: int | None = Field(
        default=None, ge=1, description="text-to-speech models that generate audio tokens: the most tokens one "
                                        "sentence may take (default: the model's own cap)")
    speech_batch_size: int = Field(
        default=8, ge=1, description="text-to-speech models that batch requests (mlx-audio's continuous batching, "
                                     "e.g. Qwen3-TTS): the most requests one pass speaks (1: each on its own)")
    kv_budget_bytes: int | None = Field(
        default=None, ge=1, description="KV cache memory one request may claim (default: half the machine's memory)")
    kv_bits: Literal[4, 8] | None = Field(
        default=None, description="keep the live batch's KV cache quantized to this many bits once a row's context "
                                  "reaches quantized_kv_start tokens (long contexts: 8 bits is about half the "
                                  "memory of bfloat16); checked per layer at load, refused where the model's "
                                  "attention cannot (sliding windows, recurrent layers, MLA)")
    kv_group_size: Literal[32, 64, 128] | None = Field(
        default=None, description="kv_bits: values per quantization group along the head dimension, which it must "
                                  "divide (default: the largest of 64 and 32 that does)")
    quantized_kv_start: int = Field(
        default=2048, ge=0, description="kv_bits: the context length (tokens) from which a batch's KV is quantized")
    speculative: SpeculativeSettings = Field(
        default_factory=SpeculativeSettings, description="speculative decoding: kind (off | ngram | draft | mtp), "
                                                         "max_draft, min_ngram, max_ngram, max_batch; greedy output "
                                                         "unchanged")
    adapters: dict[str, str] = Field(
        default_factory=dict, description="LoRA adapters mounted when the model loads: {id = directory} (mlx-lm or "
                                          "PEFT layout); clients add more with POST /v1/adapters")
    adapter_aliases: dict[str, str] = Field(
        default_factory=dict, description="model ids that mean this model with adapters: {\"my-tune\" = \"id\"} "
                                          "(or \"a+b\"); a request's own adapter field still wins")
    distributed: DistributedSettings | None = Field(
        default=None, description="serve the model across processes with mlx.distributed: {ranks = 2} or "
                                  "{hostfile = \"hosts.json\"}, backend, parallel (tensor | pipeline)")

    @model_validator(mode="after")
    def _distributed_alone(self) -> ModelConfig:
        if self.distributed is not None and (self.adapters or self.adapter_aliases or self.speculative.kind != "off"):
            raise ValueError("a distributed model cannot have adapters or speculative decoding yet "
                             "(they are not rank-consistent); remove them or the distributed table")
        if self.distributed is not None and self.kv_bits is not None:
            raise ValueError("a distributed model cannot keep a quantized live KV cache yet; remove kv_bits or the "
                             "distributed table")
        return self

    @field_validator("adapters")
    @classmethod
    def _adapter_ids(cls, value: dict[str, str]) -> dict[str, str]:
        from protocols.adapter_spec import check_adapter_id

        for adapter_id in value:
            check_adapter_id(adapter_id)
        return value

    @field_validator("adapter_aliases")
    @classmethod
    def _adapter_specs(cls, value: dict[str, str]) -> dict[str, str]:
        from protocols.adapter_spec import parse_adapter_spec

        for spec in value.values():
            parse_adapter_spec(spec)
        return value

    @field_validator("family")
    @classmethod
    def _known_family(cls, value: str) -> str:
        known = builtin_families()
        if value != "auto" and value not in known:
            raise ValueError(f"unknown family {value!r}; valid: auto, {', '.join(sorted(known))}")
        return value


class ModelResource(Resource):
    type_name: ClassVar[str] = "model"
    Config: ClassVar[type[ResourceConfig]] = ModelConfig
    description: ClassVar[str] = "an MLX language model with its tokenizer and generation engine"
    # Speculation's draft model: another model resource, built (and loaded) first, linked only when named.
    references = {"speculative.draft": Reference("model", required=False, implicit=False)}
    config: ModelConfig

    def __init__(self, resource_id: str, config: ResourceConfig, links: Links) -> None:
        super().__init__(resource_id, config, links)
        assert isinstance(config, ModelConfig)
        self.name = config.name or resource_id
        self.source = config.path  # the source in use: path, or the fallback found (see resolve_source)
        self.path: Path | None = None  # its directory, once resolved (/library marks it as serving)
        self.loading_since = 0.0  # when the current (or last) load began: /stats shows a load's time so far
        self.load_progress: tuple[int, int] | None = None  # weight bytes read and in all, while a load reads them
        self.loaded: LoadedModel | None = None  # a text model's
        self.embedding: LoadedEmbedder | None = None  # an embedding model's
        self.audio: LoadedAudio | None = None  # an audio model's
        self.family: Family = builtin_families()["default"]
        self.pool: LoadGate | None = None  # the model_pool serving it, if any (set by its serve())
        self.prefix_cache: PrefixCache | None = None  # the prefix cache serving it, if any (set by its serve())
        # Known now if configured or the path is a local directory; else once the path is resolved (a download).
        self.kind: ModelKind | None = None if config.kind == "auto" else config.kind
        local = Path(os.path.expandvars(config.path)).expanduser()
        if self.kind is None and local.is_dir():
            self.kind = detect_kind_of(local)
        self.adapters = AdapterRegistry(self.name, config.adapters, config.adapter_aliases)
        self.created = time.time()  # "created" in the model listing: kept across reloads with the resource
        self.last_used = 0.0
        self.loads = 0
        self._device: DeviceThread | None = None
        self.cluster: Cluster | None = None  # a distributed model's other ranks
        self._broadcast: Broadcast | None = None
        self._loading: trio.Event | None = None
        self._load_error: BaseException | None = None
        self.keep_seconds: float | None = None  # a client's keep_alive (see keep_for); None: the pool decides
        self.drafts_for: set[str] = set()  # the models that draft with this one (it stays loaded for them)
        self._keep_changed: trio.Event | None = None

    @property
    def ids(self) -> list[str]:
        """The exact ids that select this model: its name and plain aliases."""
        return [self.name, *(a for a in self.config.aliases if not is_pattern(a)), *self.config.adapter_aliases]

    @property
    def patterns(self) -> list[str]:
        """Glob aliases (``claude-*``): ids no model names exactly that this one answers."""
        return [a for a in self.config.aliases if is_pattern(a)]

    @property
    def ready(self) -> bool:
        """Loaded, whatever its kind."""
        return self.loaded is not None or self.embedding is not None or self.audio is not None

    @property
    def weight_bytes(self) -> int:
        loaded = self.loaded or self.embedding or self.audio
        return loaded.weight_bytes if loaded is not None else 0

    @property
    def state(self) -> str:
        if self.down is not None:
            return "down"
        return "ready" if self.ready else "loading" if self._loading is not None else "unloaded"

    @property
    def pinned(self) -> bool:
        """Never evicted by the pool: configured so, or distributed (its group forms once per server process)."""
        return self.config.pin or self.config.distributed is not None or bool(self.drafts_for)

    @property
    def down(self) -> str | None:
        """Why a distributed model's group of ranks is gone, or why the device thread it runs on is lost to such a
        group (None: up)."""
        if self.cluster is not None and self.cluster.down is not None:
            return self.cluster.down
        if self._device is not None and self._device.lost is not None:
            return self._device.lost
        if self.loaded is not None and self.loaded.engine.lost is not None:
            return str(self.loaded.engine.lost)
        return None

    async def start(self, device: DeviceThread) -> None:
        self._device = device
        if self.config.load == "eager":
            await self.load()

    async def load(self) -> None:
        """Load the model (once, however many requests ask at the same time)."""
        if self.ready:
            return
        if self._loading is not None:
            await self._loading.wait()
            if not self.ready:
                raise ApiError("internal", f"Model {self.name!r} failed to load: {self._load_error}")
            return
        assert self._device is not None, "the server starts resources before requests arrive"
        self._loading = trio.Event()
        self.loading_since = time.monotonic()
        self.load_progress = None
        try:
            if self.pool is not None:
                await self.pool.make_room(self)
            await self._load(self._device)
            heap.settle()  # the model is long-lived: out of the cycle collector's full scans
        except BaseException as exc:
            self._load_error = exc
            raise
        finally:
            if self.pool is not None:
                self.pool.load_finished(self)
            self._loading.set()
            self._loading = None
            self.load_progress = None

    async def _load(self, device: DeviceThread) -> None:
        from runtime.errors import ModelNotAvailable
        from runtime.models import load_model  # MLX: once a model loads

        path: Path = await trio.to_thread.run_sync(self.resolve_source)
        self.path = path
        if self.kind is None:
            self.kind = await trio.to_thread.run_sync(detect_kind_of, path)
        if self.kind == "embeddings":
            await self._load_embedder(path, device)
            return
        if self.kind == "audio":
            await self._load_audio(path, device)
            return
        assert self.kind in ("text", "vision"), self.kind
        if self.config.distributed is not None:
            if self.kind != "text":
                raise ModelNotAvailable(f"{self.name}: a {self.kind} model is not served across processes yet; "
                                        "distributed serving takes text models (remove its distributed table).")
            await self._load_distributed(path, device, self.config.distributed)
            return
        spec = self.config.speculative
        engine_config = EngineConfig(max_batch=self.config.max_batch, prefill_chunk=self.config.prefill_chunk,
                                     strategy=self.config.strategy, max_queue=self.config.max_queue,
                                     prefill_burst=self.config.prefill_burst,
                                     stream_interval=self.config.stream_interval_ms / 1000,
                                     speculative=SpeculativeConfig(spec.kind, spec.max_draft, spec.min_ngram,
                                                                   spec.max_ngram, spec.max_batch),
                                     kv_quantization=KVQuantization(self.config.kv_bits, self.config.kv_group_size,
                                                                    self.config.quantized_kv_start))
        started = time.perf_counter()
        draft = await self._draft_model()
        loaded = await trio.to_thread.run_sync(partial(load_model, self.name, path, device, engine_config,
                                                       self.prefix_cache, vision=self.kind == "vision",
                                                       vision_share=self.config.vision_share, draft_model=draft,
                                                       progress=self._progress))
        try:
            await self.adapters.mount_all(loaded, self.served_names(path, loaded.config))
        except ValueError as exc:
            from runtime.models import unload_model

            await trio.to_thread.run_sync(unload_model, loaded, device)
            raise ModelNotAvailable(f"{self.name}: {exc}") from None
        self._serve_loaded(path, loaded)
        log.info("model %s ready (%.1f s, family %s)%s", self.name, time.perf_counter() - started, self.family.name,
                 " — SMOKE-TEST MODEL: random weights, output is gibberish" if loaded.smoke_test else "")

    async def _load_distributed(self, path: Path, device: DeviceThread, settings: DistributedSettings) -> None:
        """Start the other ranks, join them as rank 0 and load this rank's shard (see flow.resources.cluster)."""
        from runtime.distributed import RankSpec, load_leader
        from runtime.errors import ModelNotAvailable

        if self.cluster is not None:
            raise ModelNotAvailable(f"{self.name}: its group of ranks is down ({self.cluster.down}); restart the "
                                    "server to start it again")
        try:
            placement = (Placement.local(settings.ranks) if settings.ranks is not None else
                         Placement.from_hostfile(Path(os.path.expanduser(settings.hostfile or ""))))
        except ClusterError as exc:
            raise ModelNotAvailable(f"{self.name}: {exc}") from None
        prefix = self.prefix_cache
        assert prefix is None or prefix.disk is None, "a distributed model's prefix cache is in memory only"
        engine_config = EngineConfig(max_batch=self.config.max_batch, prefill_chunk=self.config.prefill_chunk,
                                     strategy=self.config.strategy, max_queue=self.config.max_queue,
                                     prefill_burst=self.config.prefill_burst,
                                     stream_interval=self.config.stream_interval_ms / 1000)
        spec = RankSpec(path=str(path), parallel=settings.parallel, backend=settings.backend,
                        max_batch=engine_config.max_batch, prefill_chunk=engine_config.prefill_chunk,
                        strategy=engine_config.strategy, max_queue=engine_config.max_queue,
                        prefill_burst=engine_config.prefill_burst,
                        prefix_block_tokens=prefix.config.block_tokens if prefix is not None else None,
                        prefix_hot_bytes=prefix.config.hot_bytes if prefix is not None else 2 << 30,
                        watchdog_seconds=settings.watchdog_seconds)
        cluster = Cluster(self.name, placement, settings.heartbeat_seconds, settings.ssh, settings.python)
        started = time.perf_counter()
        try:
            cluster.start(spec)
        except ClusterError as exc:
            raise ModelNotAvailable(f"{self.name}: {exc}") from None
        self.cluster = cluster
        try:
            loaded, broadcast = await trio.to_thread.run_sync(load_leader, self.name, spec, device, prefix,
                                                              engine_config)
        except BaseException as exc:
            cluster.down = f"the group did not start: {exc}"
            cluster.kill()
            raise ModelNotAvailable(f"{self.name}: its group of {placement.ranks} ranks did not start: {exc}") from None
        self._broadcast = broadcast
        self._serve_loaded(path, loaded)
        log.info("model %s ready across %d ranks (%s parallel, %s; %.1f s, family %s)%s", self.name, placement.ranks,
                 settings.parallel, settings.backend, time.perf_counter() - started, self.family.name,
                 " — SMOKE-TEST MODEL: random weights, output is gibberish" if loaded.smoke_test else "")

    def distributed_stats(self) -> dict[str, Any]:
        """A distributed model's group: its state and each rank's step time, collective time and bytes."""
        if self.cluster is None:
            return {}
        out: dict[str, Any] = {**self.cluster.stats(), **(self.config.distributed.model_dump(
            include={"backend", "parallel"}) if self.config.distributed else {})}
        if self.down is not None:
            out.update(state="down", down_reason=self.down)
        if self._broadcast is not None:
            out["per_rank"] = self._broadcast.stats_json()
        return out

    def keep_for(self, seconds: float | None) -> None:
        """A client's wish for how long the model stays loaded once idle (Ollama's keep_alive): negative, as long
        as the server keeps it; else unloaded after ``seconds`` without use (at least the pool's grace of 2 s, so
        a request between its stages is never cut off). The latest request's wish counts, and a request that
        states none (None) wants the server's policy back, as Ollama's default keep_alive does."""
        keep = None if seconds is None or seconds < 0 else seconds
        if keep == self.keep_seconds:
            return
        self.keep_seconds = keep
        if self._keep_changed is not None:
            self._keep_changed.set()

    async def _expire(self) -> None:
        """Unload the model once it has been idle as long as a client asked (see :meth:`keep_for`)."""
        while True:
            self._keep_changed = trio.Event()
            keep = self.keep_seconds
            if keep is None or not self.ready or self.pinned:
                await self._keep_changed.wait()
                continue
            idle_after = max(keep, 2.0)
            if self.busy(0.0):
                self.last_used = time.monotonic()  # idle time counts from the end of the last request
            if self.busy(idle_after):
                with trio.move_on_after(min(idle_after, 1.0)):
                    await self._keep_changed.wait()
                continue
            log.info("model %s: unloading (idle %.0f s; a client's keep_alive was %g s)", self.name,
                     time.monotonic() - self.last_used, keep)
            self.keep_seconds = None
            await self.unload()

    async def run(self) -> None:
        """A client's keep_alive, and a distributed model's supervision (flow.resources.cluster), for as long as it serves."""
        if self.config.distributed is None:
            await self._expire()
            return
        while self.cluster is None or self._broadcast is None or self.loaded is None:
            if self.cluster is not None and self.cluster.down is not None:
                return
            await trio.sleep(0.1)  # a lazy model: once it has loaded
        assert self._device is not None
        await self.cluster.supervise(self.loaded.engine, self._broadcast, self._device)
        # The group is down: its other ranks are stopped; rank 0's shard goes too (it serves nothing alone).
        await self.unload()
        if self.config.distributed.restart:
            log.warning("model %s: its group is down (%s); restarting the server to form it again", self.name,
                        self.cluster.down)
            os.kill(os.getpid(), signal.SIGUSR1)  # the server drains and executes itself again (flow.serve.server)

    def _serve_loaded(self, path: Path, loaded: LoadedModel) -> None:
        """Serve a loaded text or vision model: a probed model as the probe showed works, others by family
        detection."""
        probed = CapabilityStore().get(path) if self.config.family == "auto" else None
        self.family = (family_from_capabilities(probed, builtin_families()) if probed is not None else
                       resolve_family(self.config.family, path, f"{self.name} {self.source}",
                                      getattr(loaded.tokenizer, "chat_template", None)))
        self.loaded, self.last_used = loaded, time.monotonic()
        self.loads += 1

    def _progress(self, done: int, total: int) -> None:
        self.load_progress = (done, total)  # from the device thread: one tuple, swapped whole

    async def _draft_model(self) -> Any:
        """Speculation's draft model (loaded now if it is not), checked to share this model's tokenizer."""
        from runtime.errors import ModelNotAvailable
        from runtime.models import tokenizer_mismatch

        drafter = self.links.optional("speculative.draft", ModelResource)
        if drafter is None:
            return None
        loaded = await drafter.ensure_loaded()
        assert self.path is not None
        problem = await trio.to_thread.run_sync(tokenizer_mismatch, self.path, loaded.path)
        if problem:
            raise ModelNotAvailable(f"{self.name}: its draft model {drafter.name!r} {problem}; a draft model must "
                                    "share the target's tokenizer.")
        drafter.drafts_for.add(self.name)  # pinned: the pool must not unload a draft model a target decodes with
        return loaded.model

    @classmethod
    def link_problems(cls, config: ResourceConfig, linked: Mapping[str, tuple[ResourceConfig, ...]]
                      ) -> list[tuple[str, str, str]]:
        """A draft model with another tokenizer than its target's, or ``kind = "mtp"`` for a model without MTP
        layers, when the models are on this machine already (else the load checks it)."""
        from runtime.models import local_model_dir, tokenizer_mismatch
        from runtime.mtp_checkpoint import mtp_problem

        assert isinstance(config, ModelConfig)
        problems = []
        mine = local_model_dir(config.path)
        if config.speculative.kind == "mtp" and mine is not None:
            problem = mtp_problem(mine)
            if problem is None and (config.kind if config.kind != "auto" else detect_kind_of(mine)) == "vision":
                problem = "loads as a vision model (MTP drafting is for text models: set kind = \"text\")"
            if problem:
                problems.append(("speculative.kind", f"kind \"mtp\" drafts with the model's MTP layers, but the "
                                 f"model ({config.path}) {problem}", "kind = \"ngram\", or \"draft\" with a draft "
                                 "model"))
        for draft in linked.get("speculative.draft", ()):
            assert isinstance(draft, ModelConfig)
            theirs = local_model_dir(draft.path)
            problem = tokenizer_mismatch(mine, theirs) if mine is not None and theirs is not None else None
            if problem:
                problems.append(("speculative.draft", f"the draft model ({draft.path}) {problem}",
                                 "a draft model must share the target's tokenizer (a smaller model of its series)"))
        return problems

    def served_names(self, path: Path, config: dict[str, Any]) -> list[str]:
        """The names this model goes by, which an adapter's base-model name is checked against."""
        names = [self.name, self.source, path.name, *self.config.aliases]
        named = config.get("_name_or_path")
        return [n for n in dict.fromkeys([*names, *([named] if isinstance(named, str) else [])]) if n]

    def resolve_source(self) -> Path:
        """The model's directory: ``path``, else the first of ``fallbacks`` on this machine (the last may be
        downloaded or built). Blocking: run it on a worker thread."""
        from runtime.errors import ModelNotAvailable
        from runtime.models import resolve_model_path

        sources = [self.config.path, *self.config.fallbacks]
        missing: list[str] = []
        for i, source in enumerate(sources):
            last = i == len(sources) - 1
            try:
                path = resolve_model_path(os.path.expanduser(os.path.expandvars(source)),
                                          offline=None if last else True)
            except ModelNotAvailable as exc:
                if "$" in os.path.expandvars(source) and not last:
                    continue  # names an unset variable: nothing to report
                if last:
                    raise ModelNotAvailable(f"{exc} (also not on this machine: {'; '.join(missing)})" if missing
                                            else str(exc)) from None
                missing.append(source)
                continue
            if missing and source != self.source:
                log.info("model %s: serving %s (not on this machine: %s)", self.name, source, ", ".join(missing))
            self.source = source
            return path
        raise AssertionError("unreachable: the last source raises or returns")

    async def _load_embedder(self, path: Path, device: DeviceThread) -> None:
        from runtime.embeddings import load_embedder

        started = time.perf_counter()
        self.embedding = await trio.to_thread.run_sync(load_embedder, self.name, path, device,
                                                       self.config.embed_pass_tokens, self.config.embed_pass_seconds,
                                                       tuple(self.config.dimensions))
        self.last_used = time.monotonic()
        self.loads += 1
        log.info("embedding model %s ready (%.1f s, %d dims)%s", self.name, time.perf_counter() - started,
                 self.embedding.dims, " — SMOKE-TEST MODEL: random weights" if self.embedding.smoke_test else "")

    async def _load_audio(self, path: Path, device: DeviceThread) -> None:
        from runtime.audio import load_audio_model

        started = time.perf_counter()
        self.audio = await trio.to_thread.run_sync(load_audio_model, self.name, path, device, self.config.audio_share,
                                                   self.config.speech_batch_size)
        self.last_used = time.monotonic()
        self.loads += 1
        log.info("audio model %s ready (%.1f s)%s", self.name, time.perf_counter() - started,
                 " — SMOKE-TEST MODEL: random weights" if self.audio.smoke_test else "")

    async def ensure_audio(self) -> LoadedAudio:
        """The loaded audio model, loading it first if needed (lazy, or unloaded by the pool)."""
        await self._ensure()
        assert self.audio is not None
        return self.audio

    async def ensure_embedder(self) -> LoadedEmbedder:
        """The loaded embedding model, loading it first if needed (lazy, or unloaded by the pool)."""
        await self._ensure()
        assert self.embedding is not None
        return self.embedding

    async def _ensure(self) -> None:
        from runtime.errors import ModelNotAvailable

        self.last_used = time.monotonic()
        if not self.ready:
            try:
                await self.load()
            except ModelNotAvailable as exc:  # a request's load: the client learns why, the server goes on
                raise ApiError("unavailable", f"Model {self.name!r} cannot be loaded: {exc}") from None

    async def ensure_loaded(self) -> LoadedModel:
        """The loaded model, loading it first if the pool unloaded it (or it is lazy)."""
        await self._ensure()
        assert self.loaded is not None
        return self.loaded

    def busy(self, grace: float) -> bool:
        """In use: sequences in its engine, or a request that touched it in the last ``grace`` seconds
        (one that is between prepare and generate)."""
        recent = time.monotonic() - self.last_used < grace
        if self.embedding is not None:
            return self.embedding.embedder.has_work() or recent
        if self.audio is not None:
            return self.audio.worker.has_work() or recent
        if self.loaded is None:
            return False
        engine = self.loaded.engine
        return bool(engine.active or engine.waiting) or recent

    async def unload(self) -> None:
        embedding, self.embedding = self.embedding, None
        if embedding is not None:
            import mlx.core as mx

            embedding.embedder.close()
            embedding.embedder.model = None
            await embedding.embedder.device.run(mx.clear_cache)
            log.info("embedding model %s unloaded (%.0f MiB freed)", self.name, embedding.weight_bytes / 2**20)
        audio, self.audio = self.audio, None
        if audio is not None:
            import mlx.core as mx

            audio.worker.close()
            audio.model = None
            await audio.worker.device.run(mx.clear_cache)
            log.info("audio model %s unloaded (%.0f MiB freed)", self.name, audio.weight_bytes / 2**20)
        cluster = self.cluster
        if cluster is not None and self.loaded is not None and self._device is not None:
            if cluster.down is None:  # its ranks hold the rest of it
                await trio.to_thread.run_sync(cluster.stop, self.loaded.engine, self._broadcast, self._device)
            if cluster.stuck is None:  # a bounded wait for the device thread, which a collective may hold
                await cluster.wind_down(self.loaded.engine, self._device)
        loaded, self.loaded = self.loaded, None
        if loaded is not None and cluster is not None and cluster.stuck is not None:
            # Freeing it takes the device thread, which a collective of the lost group holds for good.
            loaded.engine.close()
            log.error("model %s: not unloaded: its %.0f MiB stay in memory until the server process restarts",
                      self.name, loaded.weight_bytes / 2**20)
            return
        if loaded is not None:
            from runtime.models import unload_model

            self.adapters.live = {}  # remembered, mounted again with the next load

            await trio.to_thread.run_sync(unload_model, loaded, loaded.engine.device)
            log.info("model %s unloaded (%.0f MiB freed)", self.name, loaded.weight_bytes / 2**20)
        heap.release()  # the unloaded model's cycles were frozen with it

    def close(self) -> None:
        if self.cluster is not None:
            self.cluster.stop(self.loaded.engine if self.loaded is not None else None, self._broadcast, self._device)
        if self.loaded is not None:
            self.loaded.engine.close()
        if self.embedding is not None:
            self.embedding.embedder.close()
        if self.audio is not None:
            self.audio.worker.close()

    async def retire(self) -> None:
        """Replaced by a reload: free its weights and KV memory too."""
        await self.unload()

    @property
    def kv_budget_bytes(self) -> int:
        return self.config.kv_budget_bytes or default_kv_budget_bytes()

    def require(self) -> LoadedModel:
        self.last_used = time.monotonic()
        down = self.down
        if down is not None:
            raise ApiError("unavailable", f"Model {self.name!r} is down: {down}.")
        if self.loaded is None:
            raise ApiError("overloaded", f"Model {self.name!r} is still loading; retry shortly.", retry_after=2)
        return self.loaded


class ModelSet:
    """The models a stage serves, looked up by the id or alias a request names."""

    def __init__(self, models: Iterable[ModelResource]) -> None:
        self._by_id: dict[str, ModelResource] = {}
        self._patterns: list[tuple[str, ModelResource]] = []  # in graph order: the first match answers
        for model in models:
            for model_id in model.ids:
                self._by_id.setdefault(model_id, model)
            self._patterns.extend((pattern, model) for pattern in model.patterns)

    def all(self) -> list[ModelResource]:
        """Every model of the set, once."""
        return list({id(m): m for m in [*self._by_id.values(), *(m for _, m in self._patterns)]}.values())

    def find(self, model_id: str) -> ModelResource | None:
        """The model an exact id names, else the first whose glob alias matches it."""
        found = self._by_id.get(model_id)
        if found is None:
            found = next((m for pattern, m in self._patterns if fnmatch.fnmatchcase(model_id, pattern)), None)
        return found

    def lookup(self, model_id: str, kind: ModelKind | tuple[ModelKind, ...] = CHAT_KINDS, *,
               serves: Callable[[ModelResource], bool] | None = None, what: str | None = None) -> ModelResource:
        """The model ``model_id`` names, which must be of ``kind`` (one of them; chat: text or vision models; a
        model whose kind is not known yet — a lazy one from the hub — is checked when it loads). A model of
        another kind is a 400 naming the request (``what``, else the kind) and the models that can serve it:
        those of ``kind`` for which ``serves`` holds (an audio model speaks or transcribes)."""
        kinds = kind if isinstance(kind, tuple) else (kind,)
        found = self.find(model_id)
        if found is None:
            raise ApiError(
                "not_found",
                f"The model {model_id!r} does not exist on this server. Available models: "
                f"{', '.join(sorted(self._by_id)) or '(none)'}.",
                param="model",
                code="model_not_found",
            )
        if found.kind is not None and found.kind not in kinds:
            able = sorted({i for k in kinds for i in self.able(k) if serves is None or serves(self._by_id[i])})
            what = what or ("chat" if kinds == CHAT_KINDS else kinds[0])
            raise ApiError("invalid_request", f"The model {model_id!r} is {_article(found.kind)} {found.kind} model "
                           f"and cannot serve this {what} request. Models that can: "
                           f"{', '.join(able) or '(none on this server)'}.", param="model", code="wrong_model_kind")
        return found


    def able(self, kind: ModelKind, *, known: bool = False) -> list[str]:
        """The ids of the models that are of ``kind`` (unless ``known``, also those whose kind is not known yet:
        a lazy model from the hub)."""
        return sorted(i for i, m in self._by_id.items() if m.kind == kind or (m.kind is None and not known))


def is_pattern(alias: str) -> bool:
    return any(c in alias for c in "*?[")


def _article(word: str) -> str:
    return "an" if word[:1] in "aeiou" else "a"
