"""Compile a graph spec into a frozen, checked :class:`CompiledGraph`.

Theory of operation
-------------------
Compilation is a series of checks that each append to one error list instead of
stopping at the first problem, so ``flow check`` shows everything wrong with a
file in one run. Each :class:`GraphError` has the key path it is about
(``stages.format.inputs[0]``), what was found, and what would be valid.

The result (:mod:`flow.graph.compiled`) holds every stage's class and validated config, every resource's
validated config, the networkx DiGraph of the edges, and one :class:`Route` per
``METHOD /path`` that an entry stage serves: the stages between that entry and
its ``exit``, which are the only ones a request on that route runs.
"""

from __future__ import annotations

import difflib
import types
import typing
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import networkx as nx
from pydantic import BaseModel, ValidationError

from flow.graph.compiled import (
    CompiledGraph,
    CompiledResource,
    CompiledStage,
    CompileError,
    GraphError,
    Route,
)
from flow.graph.inline import inline_stages
from flow.graph.registry import Registry
from flow.graph.resource import Reference, Resource, ResourceConfig
from flow.graph.spec import GraphSpec, SpecError, load_tables
from flow.graph.stage import EntryStage, ExitStage, Stage
from protocols.ir import UNION_NAMES

# Keys every stage table may have, beside its type's own config keys.
STAGE_KEYS = ("type", "inputs", "buffer", "routes", "exit")
DEFAULT_BUFFER = 16
# Paths the HTTP shell answers itself (observability, administration); no graph route may take them.
SHELL_PATHS = {"/health": "health", "/metrics": "Prometheus metrics", "/stats": "statistics",
               "/admin/reload": "live reload"}


def closest(word: str, options: Iterable[str]) -> str | None:
    matches = difflib.get_close_matches(word, list(options), n=1, cutoff=0.6)
    return matches[0] if matches else None


def _did_you_mean(word: str, options: Iterable[str]) -> str | None:
    options = sorted(options)
    best = closest(word, options)
    if best:
        return f"did you mean {best!r}?"
    return f"valid values: {', '.join(options)}" if options else None


def type_label(tp: Any) -> str:
    if tp is Any:
        return "Any"
    if tp in UNION_NAMES:
        return UNION_NAMES[tp]
    args = typing.get_args(tp)
    if _is_union(tp):
        return " | ".join(type_label(a) for a in args)
    return getattr(tp, "__name__", repr(tp))


def _is_union(tp: Any) -> bool:
    return typing.get_origin(tp) in (typing.Union, types.UnionType)


def compatible(sent: Any, accepted: Any) -> bool:
    """The one compatibility rule: equal, subclass, union member, or ``Any`` accepted."""
    if accepted is Any or sent == accepted:
        return True
    if _is_union(sent):
        return all(compatible(member, accepted) for member in typing.get_args(sent))
    if _is_union(accepted):
        return any(compatible(sent, member) for member in typing.get_args(accepted))
    return isinstance(sent, type) and isinstance(accepted, type) and issubclass(sent, accepted)


def _pydantic_errors(path: str, exc: ValidationError, valid_keys: Iterable[str]) -> list[GraphError]:
    out = []
    for err in exc.errors():
        loc = ".".join(str(p) for p in err["loc"])
        where = ".".join(p for p in (path, loc) if p)
        if err["type"] == "extra_forbidden":
            key = str(err["loc"][-1])
            out.append(GraphError(where, f"unknown key {key!r}", _did_you_mean(key, valid_keys)))
        elif err["type"] == "missing":
            out.append(GraphError(where, "required key is missing"))
        else:
            out.append(GraphError(where, f"{err['msg']} (found {err.get('input')!r})"))
    return out


def parse_route(text: str) -> tuple[str, str] | None:
    parts = text.split()
    if len(parts) != 2 or not parts[1].startswith("/"):
        return None
    method = parts[0].upper()
    if method not in ("GET", "POST", "PUT", "PATCH", "DELETE", "HEAD", "WEBSOCKET"):  # WEBSOCKET: flow.serve.websocket
        return None
    return method, parts[1]


class _Compiler:
    def __init__(self, spec: GraphSpec, source: str, registry: Registry) -> None:
        self.spec = spec
        self.source = source
        self.errors: list[GraphError] = []
        self.stage_types = registry.stages
        self.resource_types = registry.resources
        self.stages: dict[str, CompiledStage] = {}
        self.resources: dict[str, CompiledResource] = {}
        self.entries: dict[str, tuple[list[str], str | None]] = {}
        # Every stage whose type is known, even if its config is wrong, so edges still get checked.
        self.declared: dict[str, tuple[type[Stage[Any, Any]], tuple[str, ...]]] = {}
        # Every resource's type as written (if known), so references to it are checked even if its config is wrong.
        self.kinds: dict[str, str] = {}

    def error(self, path: str, message: str, hint: str | None = None) -> None:
        self.errors.append(GraphError(path, message, hint))

    # ---------------------------------------------------------------- resources
    def compile_resources(self) -> None:
        validated: dict[str, tuple[type[Resource], ResourceConfig]] = {}
        for rid, table in self.spec.resources.items():
            path = f"resources.{rid}"
            if "." in rid:
                self.error(path, f"id {rid!r} contains '.'", "ids may not contain dots; use '_' or '-'")
            rtype = table.get("type")
            if not isinstance(rtype, str):
                self.error(f"{path}.type", "missing resource type", f"valid types: {', '.join(self.resource_types)}")
                continue
            cls = self.resource_types.get(rtype)
            if cls is None:
                self.error(f"{path}.type", f"unknown resource type {rtype!r}", _did_you_mean(rtype, self.resource_types))
                continue
            self.kinds[rid] = rtype
            body = {k: v for k, v in table.items() if k != "type"}
            try:
                validated[rid] = (cls, cls.Config.model_validate(body))
            except ValidationError as exc:
                self.errors.extend(_pydantic_errors(path, exc, cls.Config.model_fields))
        refs = {rid: self._resolve(f"resources.{rid}", cls.references, config)
                for rid, (cls, config) in validated.items()}
        served_by: dict[str, list[str]] = {rid: [] for rid in validated}
        claimed: dict[tuple[str, str, str], str] = {}  # (referrer type, field, target) → the first referrer
        for rid, (cls, _) in validated.items():
            for name, ref in cls.references.items():
                for target in refs[rid].get(name, ()):
                    if ref.exclusive:
                        first = claimed.setdefault((cls.type_name, name, target), rid)
                        if first != rid:
                            self.error(f"resources.{rid}.{name}",
                                       f"resource conflict: {target!r} is already named by {cls.type_name} {first!r}; "
                                       f"a {self.kinds.get(target, '?')} belongs to one {cls.type_name}",
                                       f"write the {name} each {cls.type_name} serves, e.g. {name} = [...]")
                            continue
                    if ref.serves and target in served_by:
                        served_by[target].append(rid)
        built = nx.DiGraph()  # X → Y: X is built before Y
        built.add_nodes_from(validated)
        for rid, (cls, _) in validated.items():
            for name, ref in cls.references.items():
                for target in refs[rid].get(name, ()):
                    if target in validated:
                        built.add_edge(*((rid, target) if ref.serves else (target, rid)))
        if not nx.is_directed_acyclic_graph(built):
            cycle = nx.find_cycle(built)
            loop = " → ".join([*(src for src, _ in cycle), cycle[0][0]])
            self.error(f"resources.{cycle[0][0]}", f"resources refer to each other in a cycle: {loop}",
                       "references between resources must not loop")
            return
        for rid, (cls, config) in validated.items():
            linked = {name: tuple(validated[t][1] for t in targets if t in validated)
                      for name, targets in refs[rid].items()}
            for name, problem, hint in cls.link_problems(config, linked):
                self.error(f"resources.{rid}.{name}", problem, hint)
        for rid in nx.lexicographical_topological_sort(built):
            cls, config = validated[rid]
            uses = tuple(t for name, ref in cls.references.items() if not ref.serves for t in refs[rid].get(name, ()))
            self.resources[rid] = CompiledResource(rid, cls.type_name, cls, config, types.MappingProxyType(refs[rid]),
                                                   uses, tuple(served_by[rid]))

    def _resolve(self, path: str, references: Mapping[str, Reference], config: BaseModel) -> dict[str, tuple[str, ...]]:
        """Resolve the config fields that name resources: unknown ids, wrong kinds and missing or ambiguous
        defaults are errors (with the valid ids); returns field → the ids it names."""
        out: dict[str, tuple[str, ...]] = {}
        for fname, ref in references.items():
            value: Any = config
            for part in fname.split("."):  # a field inside a table (speculative.draft)
                value = getattr(value, part, None) if value is not None else None
            single = not ref.many
            names = [value] if isinstance(value, str) else list(value or [])
            of_kind = [rid for rid, kind in self.kinds.items() if kind == ref.kind]
            where = f"{path}.{fname}"
            if not names and not ref.implicit:
                out[fname] = ()
                continue
            if not names:  # none named: every resource of the kind (many), or the only one
                if ref.many or len(of_kind) == 1:
                    names = of_kind
                elif len(of_kind) > 1:
                    self.error(where, f"the graph has {len(of_kind)} {ref.kind!r} resources; name the one to use",
                               f"valid values: {', '.join(of_kind)}")
                    continue
                if not names and ref.required:
                    self.error(where, f"needs a resource of type {ref.kind!r} and the graph has none",
                               f"add a [resources.NAME] table with type = {ref.kind!r}")
            good: list[str] = []
            for i, name in enumerate(names):
                at = where if single else f"{where}[{i}]"
                kind = self.kinds.get(name)
                if name not in self.spec.resources:
                    self.error(at, f"no resource named {name!r}",
                               _did_you_mean(name, of_kind) or f"no {ref.kind!r} resource is declared")
                elif kind is not None and kind != ref.kind:
                    self.error(at, f"resource conflict: {name!r} is a {kind!r} resource, this needs a {ref.kind!r} one",
                               _did_you_mean(name, of_kind))
                elif name in good:
                    self.error(at, f"{name!r} is named twice")
                else:
                    good.append(name)
            out[fname] = tuple(good)
        return out

    # ---------------------------------------------------------------- stages
    def compile_stages(self) -> None:
        for sid, table in self.spec.stages.items():
            path = f"stages.{sid}"
            if "." in sid:
                self.error(path, f"id {sid!r} contains '.'", "a '.' separates a stage from its port; use '_' or '-'")
            if sid in self.spec.resources:
                self.error(path, f"duplicate id {sid!r}: a resource has the same id", "give stages and resources distinct ids")
            stype = table.get("type")
            if not isinstance(stype, str):
                self.error(f"{path}.type", "missing stage type", f"known types: {', '.join(self.stage_types)}")
                continue
            cls = self.stage_types.get(stype)
            if cls is None:
                self.error(f"{path}.type", f"unknown stage type {stype!r}", _did_you_mean(stype, self.stage_types))
                continue
            inputs = table.get("inputs", [])
            if not isinstance(inputs, list) or not all(isinstance(i, str) for i in inputs):
                self.error(f"{path}.inputs", f"must be a list of stage ids (found {inputs!r})")
                inputs = []
            buffer = table.get("buffer", DEFAULT_BUFFER)
            if not isinstance(buffer, int) or isinstance(buffer, bool) or buffer < 0:
                self.error(f"{path}.buffer", f"must be a non-negative integer (found {buffer!r})")
                buffer = DEFAULT_BUFFER
            self.declared[sid] = (cls, tuple(inputs))
            self._check_entry_keys(sid, path, cls, table)
            body = {k: v for k, v in table.items() if k not in STAGE_KEYS}
            try:
                config = cls.Config.model_validate(body)
            except ValidationError as exc:
                self.errors.extend(_pydantic_errors(path, exc, [*cls.Config.model_fields, *STAGE_KEYS]))
                continue
            refs = self._resolve(path, cls.references, config)
            self.stages[sid] = CompiledStage(sid, stype, cls, config, tuple(inputs), buffer,
                                             types.MappingProxyType(refs))

    def _check_entry_keys(self, sid: str, path: str, cls: type[Stage[Any, Any]], table: dict[str, Any]) -> None:
        is_entry = issubclass(cls, EntryStage)
        routes, exit_id = table.get("routes"), table.get("exit")
        if not is_entry:
            for key in ("routes", "exit"):
                if key in table:
                    self.error(f"{path}.{key}", f"only entry stages take {key!r} ({cls.type_name} is not one)")
            return
        if table.get("inputs"):
            self.error(f"{path}.inputs", "an entry stage is fed by the HTTP server and takes no inputs")
        if isinstance(routes, str):
            routes = [routes]
        if not routes or not isinstance(routes, list):
            self.error(f"{path}.routes", "missing route for entry stage", 'write e.g. routes = ["POST /v1/chat/completions"]')
            routes = []
        good = []
        for i, route in enumerate(routes):
            if not isinstance(route, str) or parse_route(route) is None:
                self.error(f"{path}.routes[{i}]", f"not a route: {route!r}", 'write "METHOD /path", e.g. "POST /v1/chat/completions"')
            else:
                good.append(route)
        if not isinstance(exit_id, str):
            self.error(f"{path}.exit", "missing exit: the stage whose output answers this entry's requests")
            exit_id = None
        self.entries[sid] = (good, exit_id)

    # ---------------------------------------------------------------- edges
    def build_graph(self) -> nx.DiGraph:
        graph = nx.DiGraph()
        for sid in self.declared:
            graph.add_node(sid)
        for sid, (cls, inputs) in self.declared.items():
            for i, ref in enumerate(inputs):
                path = f"stages.{sid}.inputs[{i}]"
                src, _, port = ref.partition(".")
                if port and port != "out":
                    self.error(path, f"stage {src!r} has no port {port!r}", "stages have one output port, 'out'")
                if src not in self.spec.stages:
                    self.error(path, f"dangling input: no stage named {src!r}", _did_you_mean(src, self.spec.stages))
                    continue
                producer = self.declared.get(src)
                if producer is None:
                    continue  # its own errors were reported
                sent, accepted = producer[0].output_type, cls.input_type
                if not compatible(sent, accepted):
                    self.error(path, f"type mismatch: {src!r} ({producer[0].type_name}) sends {type_label(sent)}, "
                               f"{sid!r} ({cls.type_name}) accepts {type_label(accepted)}")
                graph.add_edge(src, sid, item=type_label(sent))
        for cycle in nx.simple_cycles(graph):
            loop = " → ".join([*cycle, cycle[0]])
            self.error(f"stages.{cycle[0]}.inputs", f"cycle: {loop}", "stages must form a directed acyclic graph")
        return graph

    def compile_routes(self, graph: nx.DiGraph) -> list[Route]:
        routes: list[Route] = []
        seen: dict[tuple[str, str], str] = {}
        acyclic = nx.is_directed_acyclic_graph(graph)
        for sid, (texts, exit_id) in self.entries.items():
            path = f"stages.{sid}"
            if exit_id is not None:
                exit_stage = self.stages.get(exit_id)
                if exit_id not in self.spec.stages:
                    self.error(f"{path}.exit", f"no stage named {exit_id!r}", _did_you_mean(exit_id, self.spec.stages))
                    continue
                if exit_stage is None:
                    continue
                if not issubclass(exit_stage.cls, ExitStage):
                    self.error(f"{path}.exit", f"{exit_id!r} ({exit_stage.type_name}) is not an exit stage",
                               "name a stage that formats responses, e.g. openai.chat.format")
                    continue
                if exit_id != sid and not self._contract_holds(path, sid, exit_id, graph):
                    continue
                if exit_id == sid:  # a stage that answers by itself (e.g. GET /v1/responses/{id})
                    on_path = {sid}
                elif not acyclic or sid not in graph or exit_id not in nx.descendants(graph, sid):
                    self.error(f"{path}.exit", f"exit {exit_id!r} is not reachable from {sid!r} through inputs")
                    continue
                else:
                    on_path = ({sid} | nx.descendants(graph, sid)) & ({exit_id} | nx.ancestors(graph, exit_id))
                sub = graph.subgraph(on_path)
                order = tuple(nx.topological_sort(sub))
                for text in texts:
                    method, url = parse_route(text)  # type: ignore[misc]
                    if url in SHELL_PATHS:
                        self.error(f"{path}.routes", f"{url} is the server's own ({SHELL_PATHS[url]})",
                                   "choose another path")
                        continue
                    if (method, url) in seen:
                        self.error(f"{path}.routes", f"route {method} {url} is already served by {seen[(method, url)]!r}")
                        continue
                    seen[(method, url)] = sid
                    inline = inline_stages(order, sub.edges, sid,
                                           lambda s: s in self.stages and self.stages[s].cls.inline)
                    routes.append(Route(method, url, sid, exit_id, order, tuple(sub.edges), inline))
        named_exits = {exit_id for _, exit_id in self.entries.values()}
        for sid, (cls, _) in self.declared.items():
            if issubclass(cls, ExitStage) and sid not in named_exits:
                self.error(f"stages.{sid}", "missing route: no entry stage names this exit stage",
                           f'add exit = "{sid}" to an entry stage')
        return routes

    def _contract_holds(self, path: str, entry_id: str, exit_id: str, graph: nx.DiGraph) -> bool:
        """The exit reads the context the entry hands on (a subclass of what it reads)."""
        entry_cls, exit_cls = self.declared[entry_id][0], self.declared[exit_id][0]
        assert issubclass(entry_cls, EntryStage) and issubclass(exit_cls, ExitStage)
        handed, read = entry_cls.context_type, exit_cls.reads_context
        if issubclass(handed, read):
            return True
        reachable = nx.descendants(graph, entry_id) if entry_id in graph else set()
        fitting = sorted(sid for sid, (cls, _) in self.declared.items()
                         if sid in reachable and issubclass(cls, ExitStage) and issubclass(handed, cls.reads_context))
        self.error(f"{path}.exit", f"contract mismatch: exit {exit_id!r} ({exit_cls.type_name}) reads "
                   f"{read.__name__}, entry {entry_id!r} ({entry_cls.type_name}) hands on {handed.__name__}",
                   f"exits that can answer {entry_id!r}: {', '.join(fitting)}" if fitting else
                   f"add an exit stage that reads {handed.__name__}")
        return False

    def default_exit(self, routes: list[Route]) -> str:
        named = self.spec.server.default_exit
        if named is None:
            if not routes and not self.errors:
                self.error("stages", "the graph serves no route", "add an entry stage with routes and an exit")
            return routes[0].exit if routes else ""
        cls = self.declared.get(named, (None, ()))[0]
        if named not in self.spec.stages:
            self.error("server.default_exit", f"no stage named {named!r}",
                       _did_you_mean(named, [sid for sid, (c, _) in self.declared.items() if issubclass(c, ExitStage)]))
        elif cls is not None and not issubclass(cls, ExitStage):
            self.error("server.default_exit", f"{named!r} ({cls.type_name}) is not an exit stage")
        return named

    def run(self) -> CompiledGraph:
        self.compile_resources()
        self.compile_stages()
        graph = self.build_graph()
        routes = self.compile_routes(graph)
        default_exit = self.default_exit(routes)
        if self.errors:
            raise CompileError(self.errors, self.source)
        return CompiledGraph(self.spec.name, self.source, self.spec, types.MappingProxyType(self.stages),
                             types.MappingProxyType(self.resources), tuple(routes), default_exit, nx.freeze(graph))


def compile_spec(spec: GraphSpec, source: str, registry: Registry) -> CompiledGraph:
    """``spec`` compiled against the stage and resource types of ``registry`` (``flow.builtins`` has the
    built-in one, and these three functions bound to it)."""
    return _Compiler(spec, source, registry).run()


def compile_tables(tables: dict[str, Any], source: str, registry: Registry) -> CompiledGraph:
    try:
        spec = GraphSpec.model_validate(tables)
    except ValidationError as exc:
        raise CompileError(_pydantic_errors("", exc, GraphSpec.model_fields), source) from None
    return compile_spec(spec, source, registry)


def compile_file(path: str | Path, registry: Registry) -> CompiledGraph:
    """Read, merge and compile a graph file; raises :class:`CompileError` with every problem."""
    try:
        tables = load_tables(Path(path))
    except SpecError as exc:
        raise CompileError([GraphError(exc.path, exc.message)], str(path)) from None
    return compile_tables(tables, str(path), registry)
