"""A compiled graph: what the compiler hands the runner, the live graph and the renderers.

Frozen values only — the stages and resources it names are classes and validated configs, not instances —
so anything may read it from any thread, and a reload swaps one for another whole.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

import networkx as nx

from flow.graph.resource import Resource, ResourceConfig
from flow.graph.spec import GraphSpec
from flow.graph.stage import Stage, StageConfig


@dataclass(frozen=True)
class GraphError:
    path: str
    message: str
    hint: str | None = None

    def __str__(self) -> str:
        return f"{self.path}: {self.message}" + (f"\n    hint: {self.hint}" if self.hint else "")


class CompileError(Exception):
    def __init__(self, errors: list[GraphError], source: str = "") -> None:
        self.errors = errors
        self.source = source
        lines = [f"{len(errors)} error(s) in {source or 'graph'}:"] + [f"  {e}" for e in errors]
        super().__init__("\n".join(lines))


# A stage's or resource's resolved references: config field → the resource ids it names.
Refs = Mapping[str, tuple[str, ...]]


@dataclass(frozen=True)
class CompiledStage:
    id: str
    type_name: str
    cls: type[Stage[Any, Any]]
    config: StageConfig
    inputs: tuple[str, ...]
    buffer: int
    refs: Refs

    @property
    def resources(self) -> tuple[str, ...]:
        return tuple(rid for ids in self.refs.values() for rid in ids)


@dataclass(frozen=True)
class CompiledResource:
    id: str
    type_name: str
    cls: type[Resource]
    config: ResourceConfig
    refs: Refs  # every reference, used or served
    uses: tuple[str, ...]  # resources built before it and handed to it
    served_by: tuple[str, ...]  # resources whose ``serves`` reference names it (built before it)

    @property
    def depends_on(self) -> tuple[str, ...]:
        """What must be built (and kept) for it to be kept."""
        return (*self.uses, *self.served_by)


@dataclass(frozen=True)
class Route:
    method: str
    path: str
    entry: str
    exit: str
    stages: tuple[str, ...]  # topological order
    edges: tuple[tuple[str, str], ...]
    inline: frozenset[str] = frozenset()  # stages that run in their producer's task (flow.graph.inline)


@dataclass(frozen=True)
class CompiledGraph:
    name: str
    source: str
    spec: GraphSpec
    stages: Mapping[str, CompiledStage]
    resources: Mapping[str, CompiledResource]  # in build order: every resource after what it depends on
    routes: tuple[Route, ...]
    default_exit: str  # the exit stage whose protocol shapes errors on paths no route matches
    graph: nx.DiGraph = field(repr=False)


@runtime_checkable
class GraphAware(Protocol):
    """A stage that describes the graph it belongs to (the console draws it): the live graph hands it the
    compiled graph once that graph is live."""

    def bind_graph(self, graph: CompiledGraph) -> None: ...
