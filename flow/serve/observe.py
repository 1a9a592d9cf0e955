"""What the server shows about itself: ``/health``, ``/stats`` and ``/metrics``.

Everything is read at request (or scrape) time from the live graph: the current
generation's models and resources, its edges' traffic, the request counters.
``/health`` needs no API key, so it names no file paths.

``/stats`` carries flow's own layout (``graph``, ``models``, ``resources``, ``edges``, ``stages``… which the
console reads) and, beside it, the reference server's blocks (``server``, ``prompt_cache``, ``response_store``,
``kv_quant``, ``admission``, ``batch``; see :func:`reference_blocks`), so a status page or script written for that
API reads flow too. The reference serves one model; these blocks describe the server's first generation model
(text or vision), the one ``server.model`` names.
"""

from __future__ import annotations

import time
import weakref
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Protocol

from flow.graph.compiled import CompiledGraph
from flow.graph.metrics import Metric, Registry
from flow.resources.model import ModelResource
from flow.serve.live import LiveGraph
from flow.serve.loop_watch import LoopWatch
from flow.serve.pacing import TurnPacer
from runtime.device import shared_device


class ObservedServer(Protocol):
    """What the observer reads of the server it reports on (:class:`~flow.serve.server.FlowServer`)."""

    live: LiveGraph
    loop_watch: LoopWatch
    pacer: TurnPacer
    started: bool
    started_at: float
    requests_total: int
    requests_active: int
    requests_failed: int
    reload_failures: int

    @property
    def graph(self) -> CompiledGraph: ...

    @property
    def models(self) -> list[ModelResource]: ...


RECENT_REQUESTS = 50  # how many finished or running requests /stats lists


@dataclass
class RecentRequest:
    """One request as the console's list shows it (no body, no path parameters beyond the path)."""

    id: str
    route: str
    started: float  # wall clock
    status: int | None = None  # set with the response head
    ttfb_ms: float | None = None
    duration_ms: float | None = None  # set when the run ends
    notes: dict[str, Any] = field(default_factory=dict)  # what its stages noted: model, prompt/completion tokens

    def first_byte(self, status: int, ms: float) -> None:
        self.status, self.ttfb_ms = status, ms
        if self.duration_ms is not None:  # a whole answer: its run ended before the shell took the answer
            self.duration_ms = max(self.duration_ms, ms)

    def finished(self, ms: float) -> None:
        """The run ended, ``ms`` after the request began; a request is not over before its answer left."""
        self.duration_ms = ms if self.ttfb_ms is None else max(ms, self.ttfb_ms)

    def json(self) -> dict[str, Any]:
        return {"id": self.id, "route": self.route,
                "started": time.strftime("%H:%M:%S", time.localtime(self.started)),
                "status": self.status, "ttfb_ms": self.ttfb_ms, "duration_ms": self.duration_ms,
                "running": self.duration_ms is None, "model": self.notes.get("model"),
                "prompt_tokens": self.notes.get("prompt_tokens"),
                "completion_tokens": self.notes.get("completion_tokens")}


class Observer:
    """The server's metrics registry and its JSON views."""

    def __init__(self, server: ObservedServer) -> None:
        self.server = server
        self.metrics = Registry()
        self.requests = self.metrics.counter("flow_requests_total", "Requests by route and response status.")
        self.duration = self.metrics.histogram("flow_request_duration_seconds", "Whole request time by route.")
        self.first_byte = self.metrics.histogram(
            "flow_time_to_first_byte_seconds", "Time until the response head (streams: the first event) by route.")
        self.metrics.collector(self._collect)
        self.recent: deque[RecentRequest] = deque(maxlen=RECENT_REQUESTS)
        self.owner = "serve"  # who runs the server: `flow serve`, or "embedded" (flow.serve.embedded: tests, flow bench)

    def request_started(self, request_id: str, route: str, *, listed: bool = True) -> RecentRequest:
        """The record of a request that began; ``listed``: shown in the recent requests (see
        ``EntryStage.monitoring_methods``)."""
        record = RecentRequest(request_id, route, time.time())
        if listed:
            self.recent.append(record)
        return record

    def _graph(self) -> dict[str, Any]:
        live = self.server.live
        if live.current is None:
            return {"name": self.server.graph.name, "version": 0, "loaded_at": None}
        return {**live.gen.info(), "reloads": live.reloads, "failed_reloads": self.server.reload_failures}

    def health_json(self) -> dict[str, Any]:
        server = self.server
        down = [m.name for m in server.models if m.down is not None]
        return {
            "status": "unavailable" if down else "ok" if server.started else "loading",
            "graph": self._graph(),
            "uptime_seconds": round(time.time() - server.started_at, 1),
            "requests": {"total": server.requests_total, "active": server.requests_active,
                         "failed": server.requests_failed},
            "models": [self._model_health(m) for m in server.models],
        }

    def stats_json(self) -> dict[str, Any]:
        """Everything observable: requests, models with their engines, and resources that keep stats."""
        health = self.health_json()
        resources = self.server.live.gen.resources if self.server.live.current is not None else {}
        stats = {rid: res.stats() for rid, res in resources.items()}
        stages = self.server.live.gen.stage_stats() if self.server.live.current is not None else {}
        inline = self.server.live.gen.inline_edges() if self.server.live.current is not None else set()
        return {
            **reference_blocks(self.owner, self.server.started_at, self.server.models, resources, stats),
            "graph": health["graph"],
            "uptime_seconds": health["uptime_seconds"],
            "requests": health["requests"],
            "models": {m["id"]: m for m in health["models"]},
            "resources": {rid: numbers for rid, numbers in stats.items() if numbers is not None},
            "device": shared_device().stats_json(),
            "event_loop": {**self.server.loop_watch.json(), "paced_per_turn": self.server.pacer.per_turn,
                           "paced_requests": self.server.pacer.paced},
            "edges": {f"{src} -> {dst}": {"items": e.items, "full": e.full, "streams": e.streams,
                                          "queued": stages[dst].queued if dst in stages else 0,
                                          "inline": (src, dst) in inline}
                      for (src, dst), e in self._edge_stats().items()},
            "stages": {sid: {"active": st.active, "runs": st.runs, "errors": st.errors, "queued": st.queued}
                       for sid, st in stages.items()},
            "recent_requests": [r.json() for r in reversed(self.recent)],
        }

    def _edge_stats(self) -> dict[tuple[str, str], Any]:
        live = self.server.live
        return live.gen.edge_stats() if live.current is not None else {}

    def _collect(self) -> list[Metric]:
        """Metrics read at scrape time from the engines, stores and edges."""
        server = self.server
        active = Metric("flow_requests_active", "Requests in flight.", "gauge")
        active.set(server.requests_active)
        version = Metric("flow_graph_version", "Version of the graph serving new requests (1 + reloads).", "gauge")
        version.set(self._graph()["version"])
        prompt = Metric("flow_prompt_tokens_total", "Prompt tokens prefilled, by model.", "counter")
        generated = Metric("flow_generated_tokens_total", "Tokens generated, by model.", "counter")
        running = Metric("flow_engine_sequences", "Sequences in the engine, by model and state.", "gauge")
        steps = Metric("flow_engine_steps_total", "Engine steps, by model.", "counter")
        finished = Metric("flow_engine_sequences_total", "Sequences that left the engine, by model and outcome.",
                          "counter")
        drafted = Metric("flow_draft_tokens_total", "Speculative decoding: tokens proposed and accepted, by model.",
                         "counter")
        rank_steps = Metric("flow_rank_steps_total", "Distributed models: engine steps, by model and rank.", "counter")
        rank_step_seconds = Metric("flow_rank_step_seconds_total",
                                   "Distributed models: seconds in engine steps, by model and rank.", "counter")
        rank_collective = Metric("flow_rank_collective_seconds_total", "Distributed models: seconds in the step "
                                 "messages' collectives, by model and rank.", "counter")
        rank_bytes = Metric("flow_rank_collective_bytes_total",
                            "Distributed models: bytes the step messages' collectives carried, by model and rank.",
                            "counter")
        up = Metric("flow_distributed_up", "Distributed models: 1 while every rank runs, by model.", "gauge")
        for model in server.models:
            if model.loaded is None:
                continue
            engine = model.loaded.engine
            stats = engine.stats
            prompt.set(stats.prompt_tokens, model=model.name)
            generated.set(stats.generated_tokens, model=model.name)
            running.set(engine.active, model=model.name, state="active")
            running.set(engine.waiting, model=model.name, state="waiting")
            steps.set(stats.steps, model=model.name)
            for outcome in ("finished", "cancelled", "failed"):
                finished.set(getattr(stats, outcome), model=model.name, outcome=outcome)
            drafted.set(stats.draft_tokens, model=model.name, outcome="proposed")
            drafted.set(stats.accepted_tokens, model=model.name, outcome="accepted")
            if model.cluster is not None:
                for rank in model.distributed_stats().get("per_rank", []):
                    labels = {"model": model.name, "rank": str(rank["rank"])}
                    rank_steps.set(rank["steps"], **labels)
                    rank_step_seconds.set(rank["step_seconds"], **labels)
                    rank_collective.set(rank["collective_seconds"], **labels)
                    rank_bytes.set(rank["bytes"], **labels)
                up.set(0 if model.down is not None else 1, model=model.name)
        store_entries = Metric("flow_store_entries", "Entries in stores, by resource.", "gauge")
        store_bytes = Metric("flow_store_bytes", "Bytes held by stores, by resource.", "gauge")
        resources = server.live.gen.resources if server.live.current is not None else {}
        for rid, res in resources.items():
            numbers = res.stats()
            if numbers is not None and "entries" in numbers:
                store_entries.set(numbers["entries"], resource=rid)
                store_bytes.set(numbers.get("bytes", 0), resource=rid)
        items = Metric("flow_edge_items_total", "Items sent along each graph edge.", "counter")
        full = Metric("flow_edge_full_total", "Sends that found the consumer's inbox full (backpressure).", "counter")
        for (src, dst), e in self._edge_stats().items():
            items.set(e.items, edge=f"{src}->{dst}")
            full.set(e.full, edge=f"{src}->{dst}")
        resource_metrics = [m for res in resources.values() for m in res.metrics()]
        return [active, version, prompt, generated, running, steps, finished, drafted, rank_steps, rank_step_seconds,
                rank_collective, rank_bytes, up, store_entries, store_bytes, items, full, *resource_metrics]

    @staticmethod
    def _model_health(model: ModelResource) -> dict[str, Any]:
        out: dict[str, Any] = {"id": model.name, "resource": model.id, "aliases": model.config.aliases,
                               "ready": model.ready,
                               "state": model.state, "kind": model.kind, "family": model.family.name,
                               "loads": model.loads, "pinned": model.pinned}
        if model.ready and model.last_used:
            out["idle_seconds"] = round(time.monotonic() - model.last_used, 1)
        elif model.state == "loading":  # the time the load has taken so far, and the weights read
            out["loading_seconds"] = round(time.monotonic() - model.loading_since, 1)
            if model.load_progress is not None:
                done, total = model.load_progress
                out.update(loading_bytes=done, loading_total_bytes=total,
                           loading_fraction=round(done / total, 3) if total else 0.0)
        if model.embedding is not None:
            out.update(smoke_test=model.embedding.smoke_test, dimensions=model.embedding.dims,
                       max_input_tokens=model.embedding.max_length, profile=model.embedding.profile.as_json(),
                       embedder=model.embedding.embedder.stats_json())
        if model.audio is not None:
            out.update(smoke_test=model.audio.smoke_test, capabilities=model.audio.capabilities,
                       sample_rate=model.audio.sample_rate, worker=model.audio.worker.stats_json())
        if model.loaded is not None:  # no paths: /health needs no key
            out.update(smoke_test=model.loaded.smoke_test,
                       context_length=model.loaded.context_length, kv_budget_bytes=model.kv_budget_bytes,
                       engine=model.loaded.engine.stats_json())
        if model.cluster is not None:
            out["ready"] = model.ready and model.down is None
            out["distributed"] = model.distributed_stats()
        return out


# ---------------------------------------------------------------------------------- the reference's blocks

_DTYPE_NAMES = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32"}
_KV_DTYPES: weakref.WeakKeyDictionary[Any, str] = weakref.WeakKeyDictionary()  # engine → its KV's dtype name
_GLOBAL_LAYERS = ("full_attention", "attention", "global_attention")
_SLIDING_LAYERS = ("sliding_attention", "sliding_window_attention", "local_attention")


def reference_blocks(owner: str, started_at: float, models: list[ModelResource], resources: dict[str, Any],
                     stats: dict[str, dict[str, Any] | None]) -> dict[str, Any]:
    """The reference server's ``/stats`` blocks, every field from flow's own figures: ``stats`` is each
    resource's ``stats()`` as this reading already took it."""
    model = next((m for m in models if m.kind in ("text", "vision")), models[0] if models else None)
    return {
        "server": {"owner": owner, "model": model.name if model is not None else None,
                   "started_at": int(started_at)},  # unix seconds, as /downloads' started_at
        "prompt_cache": _prompt_cache(model, resources, stats),
        "response_store": _response_store(resources, stats),
        "kv_quant": _kv_quant(model),
        "admission": _admission(model),
        "batch": _batch(model),
    }


def _prompt_cache(model: ModelResource | None, resources: dict[str, Any],
                  stats: dict[str, dict[str, Any] | None]) -> dict[str, Any]:
    """The model's prefix cache: entries are its KV blocks in memory and on disk (a block of ``block_tokens``
    positions is flow's unit of reuse), bytes and max_bytes both tiers'; a miss is a lookup that reused nothing."""
    cache = model.prefix_cache if model is not None else None
    rid = next((rid for rid, res in resources.items() if cache is not None and getattr(res, "cache", None) is cache),
               None)
    s = stats.get(rid) if rid is not None else None
    if s is None:  # no prefix cache serves the model: nothing is cached, nothing can be
        return {"enabled": False, "entries": 0, "bytes": 0, "max_bytes": 0, "hits": 0, "misses": 0}
    disk = s.get("disk") or {}
    return {"enabled": True, "resource": rid, "entries": s["blocks"]["hot"] + s["blocks"]["warm"],
            "bytes": s["hot_bytes"] + int(disk.get("bytes", 0)),
            "max_bytes": s["hot_max_bytes"] + int(disk.get("max_bytes", 0)),
            "hits": s["hits"], "misses": s["lookups"] - s["hits"], "block_tokens": s["block_tokens"],
            "reused_tokens": s["reused_tokens"]}


def _response_store(resources: dict[str, Any], stats: dict[str, dict[str, Any] | None]) -> dict[str, Any]:
    """The graph's responses store (``previous_response_id``): flow keeps it on disk, byte-capped, with a TTL."""
    from flow.resources.response_store import ResponseStore

    rid = next((rid for rid, res in resources.items() if isinstance(res, ResponseStore)), None)
    s = stats.get(rid) if rid is not None else None
    if s is None:
        return {"enabled": False, "entries": 0, "bytes": 0, "max_bytes": 0, "ttl_ms": 0}
    if s.get("state") != "ok":  # damaged or closed: its routes answer 503; the reason is in resources
        return {"enabled": True, "resource": rid, "state": s.get("state"), "entries": None, "bytes": None,
                "max_bytes": None, "ttl_ms": None}
    return {"enabled": True, "resource": rid, "state": "ok", "entries": s["entries"], "bytes": s["bytes"],
            "max_bytes": s["max_bytes"], "ttl_ms": int(s["ttl_seconds"] * 1000)}


def _kv_dtype(engine: Any) -> str:
    """The name of the KV cache's element type: the model's activations' (its first floating parameter's), read
    once per engine (walking the parameters is not free)."""
    name = _KV_DTYPES.get(engine)
    if name is None:
        import mlx.core as mx
        from mlx.utils import tree_flatten

        name = "bf16"  # mlx-lm's default activation type, for a model with no floating parameter at all
        for item in tree_flatten(engine.model.parameters()):
            value = item[1] if isinstance(item, tuple) else None
            if isinstance(value, mx.array) and mx.issubdtype(value.dtype, mx.floating):
                text = str(value.dtype).rsplit(".", 1)[-1]
                name = _DTYPE_NAMES.get(text, text)
                break
        _KV_DTYPES[engine] = name
    return name


def _attention_layers(model: ModelResource) -> dict[str, int] | None:
    """How many layers attend globally and how many in a sliding window: from the engine's layer caches (a full
    KV cache or a rotating one per layer), else from the config's ``layer_types`` (a hybrid model's recurrent
    layers are ``other``); None until the model is loaded."""
    loaded = model.loaded
    if loaded is None:
        return None
    windows = loaded.engine.windows
    if windows:
        counts = {"global": sum(w is None for w in windows), "sliding_window": sum(isinstance(w, int) for w in windows)}
        if len(windows) > counts["global"] + counts["sliding_window"]:
            counts["other"] = len(windows) - counts["global"] - counts["sliding_window"]  # recurrent layers
        return counts
    config = loaded.config
    types = config.get("layer_types") or (config.get("text_config") or {}).get("layer_types")
    if isinstance(types, list) and types:
        global_ = sum(t in _GLOBAL_LAYERS for t in types)
        sliding = sum(t in _SLIDING_LAYERS for t in types)
        return {"global": global_, "sliding_window": sliding, "other": len(types) - global_ - sliding}
    return None


def _kv_quant(model: ModelResource | None) -> dict[str, Any] | None:
    """The live KV cache's precision. flow quantizes uniformly (``kv_bits`` on every attention layer, from
    ``quantized_kv_start`` tokens of a row's context on; below it the model's own dtype): mode
    ``uniform-kv4``/``uniform-kv8``, else the dtype's name (``bf16``); ``layers`` counts attention layers by the
    KV they keep once quantized."""
    if model is None:
        return None
    config = model.config
    attention = _attention_layers(model)
    layer_count = None if attention is None else attention["global"] + attention["sliding_window"]
    if config.kv_bits is not None:
        label = f"kv{config.kv_bits}"
        return {"mode": f"uniform-{label}", "layers": None if layer_count is None else {label: layer_count},
                "attention": attention, "bits": config.kv_bits, "group_size": config.kv_group_size,
                "start_tokens": config.quantized_kv_start}
    if model.loaded is None:  # the dtype is the loaded weights'
        return {"mode": None, "layers": None, "attention": None, "bits": None}
    dtype = _kv_dtype(model.loaded.engine)
    return {"mode": dtype, "layers": None if layer_count is None else {dtype: layer_count}, "attention": attention,
            "bits": None}


def _max_safe_context(model: ModelResource) -> int | None:
    """The longest prompt + max_tokens admission lets through: the KV budget (``kv_bytes_for``, quantized past
    its start where ``kv_bits`` is set, as ``chat.prepare`` checks it) and the model's context, whichever is less."""
    loaded = model.loaded
    if loaded is None:
        return None
    engine, budget = loaded.engine, model.kv_budget_bytes
    low, high = 0, loaded.context_length
    while low < high:  # kv_bytes_for grows with the tokens: the largest count within the budget
        middle = (low + high + 1) // 2
        if engine.kv_bytes_for(middle) <= budget:
            low = middle
        else:
            high = middle - 1
    return low


def _admission(model: ModelResource | None) -> dict[str, Any] | None:
    """flow admits on KV memory: a request whose prompt + max_tokens would need more KV than the budget is a 400
    before any work. ``memory_budget_bytes`` is the graph's ``kv_budget_bytes`` (null: the machine's default, half
    its memory); ``usable_bytes`` is the budget in effect (what one request's KV may use)."""
    if model is None:
        return None
    loaded = model.loaded
    return {"max_safe_context": _max_safe_context(model), "memory_budget_bytes": model.config.kv_budget_bytes,
            "usable_bytes": model.kv_budget_bytes, "weights_bytes": loaded.weight_bytes if loaded else None,
            "context_length": loaded.context_length if loaded else None}


def _batch(model: ModelResource | None) -> dict[str, Any] | None:
    """Continuous batching is always on in flow; ``configured`` is the model's ``max_batch`` (rows at once)."""
    if model is None:
        return None
    engine = model.loaded.engine if model.loaded is not None else None
    return {"configured": model.config.max_batch, "batched": model.config.max_batch > 1,
            "active_rows": engine.active if engine is not None else 0,
            "waiting": engine.waiting if engine is not None else 0, "strategy": model.config.strategy}
