"""Renderers of a compiled graph: mermaid, Graphviz DOT, and SVG (alone or in a standalone page, the
drawing the console shows live)."""

from viz.render import render_dot, render_mermaid
from viz.svg import render_html, render_svg, render_svg_file

__all__ = ["render_dot", "render_html", "render_mermaid", "render_svg", "render_svg_file"]
