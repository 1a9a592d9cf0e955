"""The graph as SVG: positions for :func:`viz.render.layout`'s nodes and edges, drawn by hand.

Theory of operation
-------------------
Columns follow the data: routes on the left, then each stage one column right of
its furthest producer (longest path), so every protocol's decode stage lines up
and the shared path (prepare → generate → process) runs through the middle.
Within a column a node sits at the mean height of what feeds it, pushed down
just enough not to overlap its neighbour; routes are stacked in the order of the
stages they enter. Resources go in a band underneath, each below the stages
that use it, with dotted links.

The SVG carries the ids the live console needs: ``data-stage``,
``data-edge`` (``"src -> dst"``, as ``/stats`` keys edges) and
``data-resource``, each with an empty ``<text class="live">`` that the page's
script fills from ``/stats``. ``flow viz --format svg`` writes the same SVG,
``--format html`` the same SVG in a standalone page.
"""

from __future__ import annotations

from dataclasses import dataclass
from html import escape
from importlib.resources import files
from typing import TYPE_CHECKING

from viz.render import Edge, Node, layout

if TYPE_CHECKING:
    from flow.graph.compiled import CompiledGraph

CHAR_WIDTH = 6.6  # px per character of the 11px monospace-ish label font
PAD = 10  # inside a box, left and right
ROW_GAP = 10  # between boxes in a column
COLUMN_GAP = 120  # between columns: room for an edge's item-type label
HEIGHTS = {"route": 22, "stage": 46, "resource": 46}  # a stage's third line is its live figures
MARGIN = 16


@dataclass
class Box:
    node: Node
    lines: list[str]
    x: float = 0.0
    y: float = 0.0
    width: float = 0.0
    height: float = 0.0

    @property
    def cy(self) -> float:
        return self.y + self.height / 2


def _columns(nodes: list[Node], edges: list[Edge]) -> dict[str, int]:
    """Each route and stage's column: one right of its furthest producer (the graph's edges form a DAG)."""
    solid = [e for e in edges if not e.dotted]
    column = {n.key: 0 for n in nodes if n.kind in ("route", "stage")}
    for _ in range(len(column)):  # longest path by relaxation: at most one pass per node
        changed = False
        for e in solid:
            if e.src in column and e.dst in column and column[e.dst] < column[e.src] + 1:
                column[e.dst] = column[e.src] + 1
                changed = True
        if not changed:
            break
    for n in nodes:  # a stage nothing feeds (not on any route) still sits right of the routes
        if n.kind == "stage" and column[n.key] == 0:
            column[n.key] = 1
    return column


def _place(graph: CompiledGraph) -> tuple[dict[str, Box], list[Edge], float, float]:
    nodes, edges = layout(graph)
    boxes = {n.key: Box(n, n.label.split("\\n")) for n in nodes}
    for box in boxes.values():
        box.width = max(len(line) for line in box.lines) * CHAR_WIDTH + 2 * PAD
        box.height = HEIGHTS[box.node.kind]
    column = _columns(nodes, edges)
    count = max(column.values(), default=0) + 1
    by_column: list[list[Box]] = [[] for _ in range(count)]
    for n in nodes:
        if n.key in column:
            by_column[column[n.key]].append(boxes[n.key])
    feeders: dict[str, list[str]] = {}
    for e in edges:
        if not e.dotted:
            feeders.setdefault(e.dst, []).append(e.src)

    # Routes stacked in the order of the stages they enter (declaration order of the entries).
    entry_rank = {b.node.key: i for i, b in enumerate(by_column[1] if count > 1 else [])}
    targets = {e.src: e.dst for e in edges if not e.dotted and boxes[e.src].node.kind == "route"}
    by_column[0].sort(key=lambda b: entry_rank.get(targets.get(b.node.key, ""), 0))
    x = float(MARGIN)
    for index, col in enumerate(by_column):
        width = max((b.width for b in col), default=0)
        for b in col:
            b.x = x
        bottom = float(MARGIN)
        if index == 0:
            for b in col:
                b.y, bottom = bottom, bottom + b.height + ROW_GAP / 2
        else:
            def wanted(b: Box) -> float:
                fed = [boxes[k].cy for k in feeders.get(b.node.key, []) if k in boxes]
                return sum(fed) / len(fed) - b.height / 2 if fed else 0.0
            for b in sorted(col, key=wanted):
                b.y = max(wanted(b), bottom)
                bottom = b.y + b.height + ROW_GAP
        x += width + COLUMN_GAP
    height = max((b.y + b.height for col in by_column for b in col), default=float(MARGIN))

    # Resources: a band below, each under the mean of the stages it is linked to.
    band = height + 40
    users: dict[str, list[float]] = {}
    for e in edges:
        if e.dotted and boxes[e.dst].node.kind == "stage":
            users.setdefault(e.src, []).append(boxes[e.dst].x)
    right = float(MARGIN)
    for b in sorted((b for b in boxes.values() if b.node.kind == "resource"),
                    key=lambda b: sum(users.get(b.node.key, [0])) / len(users.get(b.node.key, [0]))):
        linked = users.get(b.node.key)
        b.x = max(sum(linked) / len(linked) if linked else right, right)
        b.y = band
        right = b.x + b.width + COLUMN_GAP  # room for a resource-to-resource link's label
    width = max((b.x + b.width for b in boxes.values()), default=MARGIN) + MARGIN
    height = max((b.y + b.height for b in boxes.values()), default=MARGIN) + MARGIN
    return boxes, edges, width, height


def _edge_path(a: Box, b: Box, dotted: bool) -> tuple[str, float, float]:
    """A cubic curve from ``a``'s right side to ``b``'s left (resource links: top to bottom), and its midpoint."""
    if dotted and b.node.kind == "stage":  # a resource below links up to the stage's bottom
        x1, y1, x2, y2 = a.x + a.width / 2, a.y, b.x + b.width / 2, b.y + b.height
        bend = (y1 - y2) / 2
        d = f"M{x1:.1f},{y1:.1f} C{x1:.1f},{y1 - bend:.1f} {x2:.1f},{y2 + bend:.1f} {x2:.1f},{y2:.1f}"
        return d, (x1 + x2) / 2, (y1 + y2) / 2
    if dotted:  # resource to resource, side by side in the band
        left, right = (a, b) if a.x <= b.x else (b, a)
        x1, y1, x2, y2 = left.x + left.width, left.cy, right.x, right.cy
    else:
        x1, y1, x2, y2 = a.x + a.width, a.cy, b.x, b.cy
    bend = max((x2 - x1) / 2, 30)
    d = f"M{x1:.1f},{y1:.1f} C{x1 + bend:.1f},{y1:.1f} {x2 - bend:.1f},{y2:.1f} {x2:.1f},{y2:.1f}"
    return d, (x1 + x2) / 2, (y1 + y2) / 2


def render_svg(graph: CompiledGraph) -> str:
    """The graph as a standalone SVG element (its look comes from :func:`graph_css`)."""
    boxes, edges, width, height = _place(graph)
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" class="flow-graph" width="{width:.0f}" '
           f'height="{height:.0f}" viewBox="0 0 {width:.0f} {height:.0f}" role="img" '
           f'aria-label="graph {escape(graph.name)}">',
           '<defs><marker id="arrow" viewBox="0 0 10 10" refX="9" refY="5" markerWidth="7" markerHeight="7" '
           'orient="auto-start-reverse"><path d="M0,0 L10,5 L0,10 z" class="arrowhead"/></marker></defs>']
    out.append('<g class="edges">')
    for e in edges:
        a, b = boxes[e.src], boxes[e.dst]
        d, mx, my = _edge_path(a, b, e.dotted)
        kind = "link" if e.dotted else ("route-edge" if a.node.kind == "route" else "edge")
        attrs = f' data-edge="{escape(e.name)}"' if e.name else ""
        out.append(f'<g class="{kind}"{attrs}><title>{escape(e.label or "uses")}</title>'
                   f'<path d="{d}" marker-end="url(#arrow)"/>')
        if kind == "edge":
            out.append(f'<text class="item" x="{mx:.1f}" y="{my - 4:.1f}">{escape(e.label)}</text>'
                       f'<text class="live" x="{mx:.1f}" y="{my + 9:.1f}"></text>')
        elif kind == "link" and e.label:
            out.append(f'<text class="item" x="{mx:.1f}" y="{my - 4:.1f}">{escape(e.label)}</text>')
        out.append("</g>")
    out.append("</g>")
    out.append('<g class="nodes">')
    for box in boxes.values():
        node = box.node
        data = {"stage": "data-stage", "resource": "data-resource", "route": "data-route"}[node.kind]
        out.append(f'<g class="node {node.kind}" {data}="{escape(node.name)}">'
                   f'<title>{escape(" ".join(box.lines))}</title>'
                   f'<rect x="{box.x:.1f}" y="{box.y:.1f}" width="{box.width:.1f}" height="{box.height:.1f}" '
                   f'rx="{11 if node.kind == "route" else 4}"/>')
        first = box.y + (15 if node.kind == "route" else 14)
        for i, line in enumerate(box.lines):
            cls = "name" if i == 0 else "type"
            out.append(f'<text class="{cls}" x="{box.x + PAD:.1f}" y="{first + 13 * i:.1f}">{escape(line)}</text>')
        if node.kind != "route":
            out.append(f'<text class="live" x="{box.x + PAD:.1f}" y="{first + 13 * len(box.lines):.1f}"></text>')
        out.append("</g>")
    out.append("</g></svg>")
    return "\n".join(out) + "\n"


def graph_css() -> str:
    """The drawing's style sheet, shared by the console and the standalone files."""
    return files("viz").joinpath("static/graph.css").read_text(encoding="utf-8")


def render_html(graph: CompiledGraph) -> str:
    """A standalone page with the drawing (no script, no network): ``flow viz --format html``."""
    title = escape(f"flow graph {graph.name}")
    return (f'<!doctype html>\n<html lang="en"><head><meta charset="utf-8"><title>{title}</title>\n'
            f"<style>\n{graph_css()}body{{margin:0;font-family:system-ui,sans-serif}}"
            f"h1{{font-size:15px;margin:12px 16px}}</style></head>\n"
            f"<body><h1>{title}</h1>\n<div class=\"graph-view\">{render_svg(graph)}</div></body></html>\n")


def render_svg_file(graph: CompiledGraph) -> str:
    """The SVG with its style sheet inside, for viewing on its own: ``flow viz --format svg``."""
    svg = render_svg(graph)
    head, rest = svg.split("<defs>", 1)
    return f"{head}<style>{escape(graph_css(), quote=False)}</style><defs>{rest}"
