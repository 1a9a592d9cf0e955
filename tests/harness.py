"""Test helpers: graphs pointed at tiny local models, and the embedded server."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from flow.compiler import CompiledGraph, compile_tables
from flow.embedded import RunningServer, running_server
from flow.spec import load_tables

GRAPHS = Path(__file__).resolve().parent.parent / "graphs"

__all__ = ["GRAPHS", "RunningServer", "graph_with_model", "running_server"]


def graph_with_model(model_path: Path | str, *, graph: str = "default.toml", name: str = "tiny",
                     **overrides: Any) -> CompiledGraph:
    """The named graph file with its model resource pointed at ``model_path``."""
    tables = load_tables(GRAPHS / graph)
    table = tables["resources"]["model"]
    table.update(path=str(model_path), name=name, aliases=["default"], **overrides)
    return compile_tables(tables, f"{graph} (test)")
