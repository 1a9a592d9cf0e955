"""Renderers of a compiled graph: mermaid and Graphviz DOT."""

from viz.render import render_dot, render_mermaid

__all__ = ["render_dot", "render_mermaid"]
