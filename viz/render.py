"""Draw a compiled graph: HTTP routes → entry stages → shared path → exits, plus resources.

Both renderers walk the same :func:`layout` description, so mermaid and DOT
always show the same nodes and edges: every stage (id and type), every edge
labelled with the item type it carries, every route, and every resource with
dotted links to the stages that use it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # at run time viz is imported while the compiler is (flow.builtins registers the console)
    from flow.graph.compiled import CompiledGraph


@dataclass(frozen=True)
class Node:
    key: str
    label: str
    kind: str  # "route" | "stage" | "resource"
    name: str = ""  # the id as the graph and /stats write it: stage or resource id, "METHOD /path"


@dataclass(frozen=True)
class Edge:
    src: str
    dst: str
    label: str
    dotted: bool = False
    name: str = ""  # a stage edge as /stats keys it ("src -> dst"); empty for route and resource links


def _key(kind: str, name: str) -> str:
    return f"{kind}_" + re.sub(r"[^A-Za-z0-9_]", "_", name)


def layout(graph: CompiledGraph) -> tuple[list[Node], list[Edge]]:
    nodes: list[Node] = []
    edges: list[Edge] = []
    for route in graph.routes:
        rkey = _key("route", f"{route.method}_{route.path}")
        nodes.append(Node(rkey, f"{route.method} {route.path}", "route", f"{route.method} {route.path}"))
        edges.append(Edge(rkey, _key("stage", route.entry), "HttpRequest"))
    for sid, stage in graph.stages.items():
        nodes.append(Node(_key("stage", sid), f"{sid}\\n[{stage.type_name}]", "stage", sid))
    for src, dst, data in graph.graph.edges(data=True):
        edges.append(Edge(_key("stage", src), _key("stage", dst), str(data.get("item", "")),
                          name=f"{src} -> {dst}"))
    for rid, res in graph.resources.items():
        nodes.append(Node(_key("resource", rid), f"{rid}\\n({res.type_name})", "resource", rid))
        for sid, stage in graph.stages.items():
            if rid in stage.resources:
                edges.append(Edge(_key("resource", rid), _key("stage", sid), "", dotted=True))
        # Resource → resource: the provider points at what it is handed to (a cache at the models it
        # serves, a cache at the store that reads it), labelled with the referring config key.
        for field_name, ids in res.refs.items():
            serves = res.cls.references[field_name].serves
            for target in ids:
                src, dst = (rid, target) if serves else (target, rid)
                edges.append(Edge(_key("resource", src), _key("resource", dst), f"{rid}.{field_name}", dotted=True))
    return nodes, edges


def render_mermaid(graph: CompiledGraph) -> str:
    nodes, edges = layout(graph)
    shapes = {"route": ('(["', '"])'), "stage": ('["', '"]'), "resource": ('[("', '")]')}
    lines = ["flowchart LR"]
    for node in nodes:
        left, right = shapes[node.kind]
        lines.append(f"    {node.key}{left}{node.label.replace(chr(92) + 'n', '<br/>')}{right}")
    for edge in edges:
        arrow = "-.->" if edge.dotted else "-->"
        label = f"|{edge.label.replace('|', '/')}|" if edge.label else ""
        lines.append(f"    {edge.src} {arrow}{label} {edge.dst}")
    lines.append("    classDef route fill:#eef,stroke:#66a")
    lines.append("    classDef resource fill:#efe,stroke:#6a6")
    for kind in ("route", "resource"):
        keys = [n.key for n in nodes if n.kind == kind]
        if keys:
            lines.append(f"    class {','.join(keys)} {kind}")
    return "\n".join(lines) + "\n"


def _dot_str(text: str) -> str:
    return '"' + text.replace('"', '\\"') + '"'


def render_dot(graph: CompiledGraph) -> str:
    nodes, edges = layout(graph)
    shapes = {"route": "ellipse", "stage": "box", "resource": "cylinder"}
    lines = [f"digraph {_dot_str(graph.name)} {{", "    rankdir=LR;", '    node [fontname="Helvetica"];']
    for node in nodes:
        lines.append(f"    {node.key} [label={_dot_str(node.label)}, shape={shapes[node.kind]}];")
    for edge in edges:
        attrs = [f"label={_dot_str(edge.label)}"] if edge.label else []
        if edge.dotted:
            attrs.append("style=dotted")
        lines.append(f"    {edge.src} -> {edge.dst}" + (f" [{', '.join(attrs)}]" if attrs else "") + ";")
    lines.append("}")
    return "\n".join(lines) + "\n"
