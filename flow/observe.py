"""What the server shows about itself: ``/health``, ``/stats`` and ``/metrics``.

Everything is read at request (or scrape) time from the live graph: the current
generation's models and resources, its edges' traffic, the request counters.
``/health`` needs no API key, so it names no file paths.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from flow.metrics import Metric, Registry
from flow.resources import ModelResource
from runtime.device import shared_device

if TYPE_CHECKING:
    from flow.server import FlowServer


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

    def __init__(self, server: FlowServer) -> None:
        self.server = server
        self.metrics = Registry()
        self.requests = self.metrics.counter("flow_requests_total", "Requests by route and response status.")
        self.duration = self.metrics.histogram("flow_request_duration_seconds", "Whole request time by route.")
        self.first_byte = self.metrics.histogram(
            "flow_time_to_first_byte_seconds", "Time until the response head (streams: the first event) by route.")
        self.metrics.collector(self._collect)
        self.recent: deque[RecentRequest] = deque(maxlen=RECENT_REQUESTS)

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
        return {
            "graph": health["graph"],
            "uptime_seconds": health["uptime_seconds"],
            "requests": health["requests"],
            "models": {m["id"]: m for m in health["models"]},
            "resources": {rid: numbers for rid, numbers in stats.items() if numbers is not None},
            "device": shared_device().stats_json(),
            "edges": {f"{src} -> {dst}": {"items": e.items, "full": e.full, "streams": e.streams,
                                          "queued": stages[dst].queued if dst in stages else 0}
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
