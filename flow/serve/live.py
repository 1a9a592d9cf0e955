"""The live graph: compiled graphs made live, one generation at a time, and the switch between them.

Theory of operation
-------------------
A :class:`Generation` is one compiled graph made live: its resources, one
instance per stage, one :class:`RouteRunner` per route and the routing table.
A request enters the current generation and runs on it to its end, whatever
happens meanwhile.

:meth:`LiveGraph.reload` compiles nothing itself: it takes a graph that
compiled whole, plans which resources to keep (Vector's diff-based reload): a
resource is kept when its type and config are unchanged and everything it
depends on is kept, so a loaded model, its engine and a warm cache carry over.
Changed and new resources are built and started *before* the switch; if one
fails to start, nothing changes. Then new requests enter the new generation,
and the old one retires: once its last request ends, the resources no live
generation holds are closed (a model unloads, a store closes its file).

Resources' background duties (a pool's idle unloading, a cache's sweeps) run
in the live graph's nursery, each in its own cancel scope, ended when the
resource closes.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field, fields, replace
from typing import Any, TypeVar

import trio

from flow.graph.compiled import CompiledGraph, CompiledResource, GraphAware, Route
from flow.graph.resource import Links, Resource
from flow.graph.runner import RouteRunner
from flow.graph.stage import EdgeStats, EntryStage, ExitStage, Stage, StageStats
from flow.resources import heap
from flow.serve.guard import JSON_BODIES
from runtime.device import DeviceThread

log = logging.getLogger("flow.serve.live")


class NoRoute(Exception):
    """No route has the path (404), or none with the method: ``allowed`` lists those that have it (405)."""

    def __init__(self, allowed: list[str]) -> None:
        super().__init__(", ".join(allowed))
        self.allowed = allowed


class RouteTable:
    """The graph's routes by path pattern: ``/v1/agents/{agent_id}`` has one fixed and one parameter
    segment; a parameter matches one non-empty segment. Built per generation (cheap: no regex compiling on
    the event loop at each reload); a trailing slash is ignored; GET routes answer HEAD too."""

    def __init__(self, routes: tuple[Route, ...]) -> None:
        # By segment count: a request compares itself with the few patterns as long as its path, not all.
        self._patterns: dict[int, list[tuple[tuple[str, ...], str, Route]]] = {}
        for route in routes:
            segments = self._segments(route.path)
            self._patterns.setdefault(len(segments), []).append((segments, route.method, route))

    @staticmethod
    def _segments(path: str) -> tuple[str, ...]:
        return tuple(path.rstrip("/").split("/")) if path != "/" else ("",)

    def match(self, method: str, path: str) -> tuple[Route, dict[str, str]]:
        """The route for ``method path``. Clients disagree on whether a base URL carries ``/v1``, so one rule
        for every route: a path no route has is tried once more with a ``/v1`` prefix added, or with one
        removed (``/messages`` finds ``/v1/messages``, ``/v1/v1/messages`` too)."""
        try:
            return self._match(method, path)
        except NoRoute as exact:
            if exact.allowed:
                raise  # the path exists, with other methods: a 405
            other = path[3:] if path.startswith("/v1/") else "/v1" + path
            try:
                return self._match(method, other)
            except NoRoute as retried:
                raise retried if retried.allowed else exact from None

    def _match(self, method: str, path: str) -> tuple[Route, dict[str, str]]:
        segments = self._segments(path)
        allowed: set[str] = set()
        for pattern, route_method, route in self._patterns.get(len(segments), ()):
            params: dict[str, str] = {}
            for want, got in zip(pattern, segments):
                if want.startswith("{") and want.endswith("}"):
                    if not got:
                        break
                    params[want[1:-1]] = got
                elif want != got:
                    break
            else:
                if route_method == method or (method == "HEAD" and route_method == "GET"):
                    return route, params
                allowed.update([route_method, "HEAD"] if route_method == "GET" else [route_method])
        raise NoRoute(sorted(allowed))


@dataclass
class RouteMatch:
    runner: RouteRunner
    params: dict[str, str]


class Generation:
    """One compiled graph made live over (partly shared) resources."""

    def __init__(self, version: int, graph: CompiledGraph, resources: dict[str, Resource]) -> None:
        self.version = version
        self.graph = graph
        self.loaded_at = time.time()
        self.resources = resources
        self.stages: dict[str, Stage[Any, Any]] = {
            sid: st.cls(sid, st.config, _links(st.refs, resources)) for sid, st in graph.stages.items()
        }
        for stage in self.stages.values():
            if isinstance(stage, GraphAware):
                stage.bind_graph(graph)
        self.runners = {(r.method, r.path): RouteRunner(graph, r, self.stages) for r in graph.routes}
        self._table = RouteTable(graph.routes)
        self.active = 0  # requests running on it
        self.retired = False
        self.idle = trio.Event()  # set once retired with no request left

    def match(self, method: str, path: str) -> RouteMatch:
        """The route for ``method path``; raises :class:`NoRoute` (with the methods the path has, if any)."""
        route, params = self._table.match(method, path)
        return RouteMatch(self.runners[(route.method, route.path)], params)

    def is_public(self, method: str, path: str) -> bool:
        """``method path`` is a route whose entry stage answers without the API key (see ``EntryStage.public``)."""
        try:
            route, _ = self._table.match(method, path)
        except NoRoute:
            return False
        entry = self.stages[route.entry]
        return isinstance(entry, EntryStage) and entry.public

    def body_types(self, method: str, path: str) -> frozenset[str]:
        """The content types the route of ``method path`` takes (JSON where no route has the path)."""
        try:
            route, _ = self._table.match(method, path)
        except NoRoute:
            return JSON_BODIES
        stage = self.stages[route.entry]
        return stage.body_types if isinstance(stage, EntryStage) else JSON_BODIES

    def exit_stage(self, stage_id: str) -> ExitStage[Any, Any]:
        stage = self.stages[stage_id]
        assert isinstance(stage, ExitStage)
        return stage

    def exit_for_path(self, path: str) -> ExitStage[Any, Any]:
        """The exit stage whose protocol an error on ``path`` is written in: the route whose fixed part is the
        longest prefix of the path (``/v1/messages/batches`` → Anthropic's), else the graph's default exit."""
        for candidate in (path, path[3:] if path.startswith("/v1/") else "/v1" + path):  # the /v1 rule of match
            best: tuple[int, Route] | None = None
            for route in self.graph.routes:
                fixed = route.path.split("{", 1)[0].rstrip("/")
                if candidate == fixed or (fixed and candidate.startswith(fixed + "/")):  # "/" is itself only
                    if best is None or len(fixed) > best[0]:
                        best = (len(fixed), route)
            if best is not None:
                return self.exit_stage(best[1].exit)
        return self.exit_stage(self.graph.default_exit)

    def routes_text(self) -> str:
        return ", ".join(f"{m} {p}" for m, p in sorted(self.runners))

    def edge_stats(self) -> dict[tuple[str, str], EdgeStats]:
        """Per graph edge, summed over the routes that share it."""
        return _summed(EdgeStats, (runner.edge_stats for runner in self.runners.values()))

    def inline_edges(self) -> set[tuple[str, str]]:
        """Edges whose consumer runs in its producer's task on every route that has them: a call per item, no
        channel (flow.graph.inline)."""
        routes = [runner.route for runner in self.runners.values()]
        edges = {edge for route in routes for edge in route.edges}
        return {edge for edge in edges
                if all(edge[1] in route.inline for route in routes if edge in route.edges)}

    def stage_stats(self) -> dict[str, StageStats]:
        """Per stage, summed over the routes that run it; ``queued``: items waiting in its inboxes now."""
        per_route = ({sid: replace(stats, queued=runner.queued(sid)) for sid, stats in runner.stage_stats.items()}
                     for runner in self.runners.values())
        return _summed(StageStats, per_route)

    def info(self) -> dict[str, Any]:
        return {"name": self.graph.name, "version": self.version,
                "loaded_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(self.loaded_at))}


Counters = TypeVar("Counters", EdgeStats, StageStats)
Key = TypeVar("Key")


def _summed(cls: type[Counters], parts: Iterable[Mapping[Key, Counters]]) -> dict[Key, Counters]:
    """Counter dataclasses added field by field, per key."""
    total: dict[Key, Counters] = {}
    for part in parts:
        for key, numbers in part.items():
            acc = total.setdefault(key, cls())
            for f in fields(cls):
                setattr(acc, f.name, getattr(acc, f.name) + getattr(numbers, f.name))
    return total


def _links(refs: Mapping[str, tuple[str, ...]], resources: dict[str, Resource],
           served_by: tuple[str, ...] = ()) -> Links:
    return Links({name: tuple(resources[rid] for rid in ids) for name, ids in refs.items()},
                 (resources[rid] for rid in served_by))


@dataclass
class ReloadReport:
    """What a reload did, by resource id."""

    version: int
    kept: list[str] = field(default_factory=list)
    built: list[str] = field(default_factory=list)
    retiring: list[str] = field(default_factory=list)  # closed once the old generation's requests end
    in_flight: int = 0  # requests the old generation was still running at the switch (they finish on it)
    seconds: float = 0.0

    def json(self) -> dict[str, Any]:
        return {"version": self.version, "kept": self.kept, "built": self.built, "retiring": self.retiring,
                "in_flight": self.in_flight, "seconds": round(self.seconds, 3)}


class ReloadRefused(Exception):
    """The new graph cannot replace the running one (e.g. a resource failed to start); nothing changed."""


def _same(old: CompiledResource, new: CompiledResource) -> bool:
    """Same type and config, ignoring the ids its ``serves`` references name (the served side records those
    links in its own ``served_by``, so a model added to a cache's list is rebuilt, not the cache)."""
    if old.type_name != new.type_name or old.cls is not new.cls:
        return False
    served = {name for name, ref in new.cls.references.items() if ref.serves}
    return bool(old.config.model_dump(exclude=served) == new.config.model_dump(exclude=served)
                and old.uses == new.uses and old.served_by == new.served_by)


class LiveGraph:
    """The current generation, the retired ones still finishing requests, and their resources' lifetimes."""

    def __init__(self, graph: CompiledGraph, device: DeviceThread) -> None:
        self.device = device
        self._first = graph
        self.current: Generation | None = None
        self._retired: list[Generation] = []
        self._duties: dict[int, trio.CancelScope] = {}  # id(resource) → the scope of its background duty
        self._nursery: trio.Nursery | None = None
        self._lock = trio.Lock()  # one reload at a time
        self.reloads = 0

    @property
    def gen(self) -> Generation:
        assert self.current is not None, "the live graph is started before requests arrive"
        return self.current

    async def start(self, nursery: trio.Nursery) -> None:
        """Build and start the first graph's resources (models load on the device thread)."""
        self._nursery = nursery
        resources = await self._build(self._first, {})
        self.current = Generation(1, self._first, resources)

    @contextmanager
    def entered(self, gen: Generation | None = None) -> Iterator[Generation]:
        """A request's hold on a generation (the current one unless given): its resources stay open."""
        gen = gen or self.gen
        gen.active += 1
        try:
            yield gen
        finally:
            gen.active -= 1
            if gen.retired and gen.active == 0:
                gen.idle.set()
                self._close_unheld()

    async def reload(self, graph: CompiledGraph) -> ReloadReport:
        """Switch new requests to ``graph``; raises :class:`ReloadRefused` (nothing changed) if its new
        resources cannot start."""
        async with self._lock:
            started = time.perf_counter()
            old = self.gen
            kept: dict[str, Resource] = {}
            for rid, res in graph.resources.items():  # build order: dependencies first
                before = old.graph.resources.get(rid)
                if (before is not None and rid in old.resources and _same(before, res)
                        and all(dep in kept for dep in res.depends_on)):
                    kept[rid] = old.resources[rid]
            try:
                resources = await self._build(graph, kept)
            except Exception as exc:
                raise ReloadRefused(f"{type(exc).__name__}: {exc}") from exc
            gen = Generation(old.version + 1, graph, resources)
            self.current = gen
            old.retired = True
            self._retired.append(old)
            if old.active == 0:
                old.idle.set()
            self.reloads += 1
            held = {id(r) for r in resources.values()}
            report = ReloadReport(gen.version, kept=sorted(kept), built=sorted(set(resources) - set(kept)),
                                  retiring=sorted(rid for rid, r in old.resources.items() if id(r) not in held),
                                  in_flight=old.active, seconds=time.perf_counter() - started)
            self._close_unheld()
            log.info("graph %s v%d live (%.2f s): kept %s; built %s; retiring %s", graph.name, gen.version,
                     report.seconds, report.kept or "nothing", report.built or "nothing",
                     report.retiring or "nothing")
            return report

    async def _build(self, graph: CompiledGraph, kept: dict[str, Resource]) -> dict[str, Resource]:
        """Construct the resources not kept (in build order), let their servers take them in, start them
        all at once; on failure close what was built and re-raise."""
        resources = dict(kept)
        built: list[Resource] = []
        try:
            for rid, res in graph.resources.items():
                if rid in resources:
                    continue
                used = {name: ids for name, ids in res.refs.items() if not res.cls.references[name].serves}
                resource = res.cls(rid, res.config, _links(used, resources, res.served_by))
                resources[rid] = resource
                built.append(resource)
                for server_id in res.served_by:
                    resources[server_id].serve(resource)
            async with trio.open_nursery() as nursery:
                for resource in built:
                    nursery.start_soon(resource.start, self.device)
        except BaseException:
            for resource in built:  # the servers that took it in let it go
                self._close(resource, graph, resources)
            raise
        for resource in built:
            self._start_duty(resource)
        return resources

    def _start_duty(self, resource: Resource) -> None:
        if self._nursery is None:
            return
        scope = trio.CancelScope()
        self._duties[id(resource)] = scope

        async def duty() -> None:
            with scope:
                await resource.run()

        self._nursery.start_soon(duty, name=f"duty:{resource.id}")

    def _close_unheld(self) -> None:
        """Close the resources of idle retired generations that no live generation holds."""
        idle = [g for g in self._retired if g.idle.is_set()]
        if not idle:
            return
        self._retired = [g for g in self._retired if not g.idle.is_set()]
        live = [self.gen, *self._retired]
        held = {id(r) for g in live for r in g.resources.values()}
        for gen in idle:
            for resource in gen.resources.values():
                if id(resource) not in held:
                    held.add(id(resource))  # closed once even if several idle generations hold it
                    self._close(resource, gen.graph, gen.resources)

    def _end_duty(self, resource: Resource) -> None:
        scope = self._duties.pop(id(resource), None)
        if scope is not None:
            scope.cancel()

    def _close(self, resource: Resource, graph: CompiledGraph, resources: dict[str, Resource]) -> None:
        """Retire ``resource`` of ``graph`` (whose live resources are ``resources``): its duty ends, its servers
        let it go, and it gives back what it holds."""
        self._end_duty(resource)
        for server_id in graph.resources[resource.id].served_by:
            resources[server_id].release(resource)
        if self._nursery is not None:
            self._nursery.start_soon(self._retire, resource, name=f"retire:{resource.id}")

    @staticmethod
    async def _retire(resource: Resource) -> None:
        try:
            await resource.retire()
        except Exception:  # one failing close must not keep the others open
            log.exception("closing resource %s failed", resource.id)
        else:
            log.info("resource %s (%s) closed", resource.id, resource.type_name)

    def close(self) -> None:
        """The server is stopping: close every resource of every generation, once."""
        seen: set[int] = set()
        for gen in [*self._retired, *([self.current] if self.current else [])]:
            for resource in gen.resources.values():
                if id(resource) not in seen:
                    seen.add(id(resource))
                    self._end_duty(resource)
                    try:
                        resource.close()
                    except Exception:
                        log.exception("closing resource %s failed", resource.id)
        heap.thaw()
