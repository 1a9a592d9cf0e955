"""Test helpers: graphs pointed at tiny local models, and the embedded server."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from flow.compiler import CompiledGraph, compile_tables
from flow.embedded import RunningServer, running_server
from flow.spec import load_tables

GRAPHS = Path(__file__).resolve().parent.parent / "graphs"

__all__ = ["GRAPHS", "RunningServer", "graph_with_model", "running_server", "tables_with_model",
           "tables_with_prefix_cache"]


def tables_with_model(model_path: Path | str, *, graph: str = "default.toml", name: str = "tiny",
                      **overrides: Any) -> dict[str, Any]:
    """The named graph file's tables with its model resource pointed at ``model_path`` (to adjust further)."""
    tables = load_tables(GRAPHS / graph)
    tables["resources"]["model"].update(path=str(model_path), name=name, aliases=["default"], **overrides)
    return tables


def tables_with_prefix_cache(model_path: Path | str, directory: Path, block_tokens: int,
                             **cache: Any) -> dict[str, Any]:
    """The default graph's tables with a test model, its prefix cache's disk tier in ``directory``."""
    tables = tables_with_model(model_path)
    tables["resources"]["prefix_cache"].update(directory=str(directory), block_tokens=block_tokens, **cache)
    return tables


def graph_with_model(model_path: Path | str, *, graph: str = "default.toml", name: str = "tiny",
                     **overrides: Any) -> CompiledGraph:
    """The named graph file with its model resource pointed at ``model_path``."""
    return compile_tables(tables_with_model(model_path, graph=graph, name=name, **overrides), f"{graph} (test)")
