"""The graphs and model families that ship with flow, and graph names on the command line.

They live in the repository's top-level ``graphs/`` folder (``default.toml``, ``demo.toml``,
``families/*.toml``). So that an ordinary ``pip install`` has them too, the wheel carries that
folder as the data-only package ``graphs`` (see ``[tool.setuptools.*]`` in pyproject.toml).
The import system then finds it the same way everywhere: in a wheel install (``site-packages/
graphs``), an editable install (setuptools' editable finder points at the checkout) and a source
checkout (the repository root on ``sys.path``). Everything that needs a bundled file asks here
instead of building a path to ``graphs`` from its own file itself.

``graphs`` has no ``__init__.py``, so it is a namespace package: another directory called
``graphs`` on ``sys.path`` (a user's own project, the current directory under ``python -m``)
adds itself to it. The portion that sits beside the ``flow`` package is the one that ships with
this copy of flow, so it wins; any portion holding ``default.toml`` comes next.
"""

from __future__ import annotations

import importlib.util
from functools import lru_cache
from pathlib import Path

__all__ = ["bundled_graphs", "family_dir", "graphs_dir", "resolve_graph_path"]

_PACKAGE = "graphs"
# Where the package sits next to flow/: the repository root, or site-packages for a wheel.
_BESIDE_FLOW = Path(__file__).resolve().parents[2] / _PACKAGE


def _import_locations() -> list[Path]:
    """The directories the import system gives the ``graphs`` package (none when it has none)."""
    try:
        spec = importlib.util.find_spec(_PACKAGE)
    except (ImportError, ValueError):
        return []
    if spec is None or not spec.submodule_search_locations:
        return []
    return [Path(p).resolve() for p in spec.submodule_search_locations if Path(p).is_dir()]


@lru_cache(maxsize=1)
def graphs_dir() -> Path:
    """The directory of the bundled graph files (``default.toml``, ``demo.toml``, ``families/``)."""
    found = [p for p in _import_locations() if (p / "default.toml").is_file()]
    if _BESIDE_FLOW in found or not found:
        # Beside flow/ is this copy's own; also the answer when the import system finds none
        # (shadowed by an unrelated regular package called ``graphs``): files then stay missing
        # and their users report them by path.
        return _BESIDE_FLOW
    return found[0]


def family_dir() -> Path:
    """The directory of the bundled model family files (``graphs/families``)."""
    return graphs_dir() / "families"


def bundled_graphs() -> dict[str, Path]:
    """Every bundled graph by name (the file's stem): ``{"default": …/default.toml, "demo": …}``."""
    return {path.stem: path for path in sorted(graphs_dir().glob("*.toml"))}


def resolve_graph_path(arg: str) -> Path:
    """The graph file a command-line argument means.

    An existing file is itself; otherwise a bare name (``demo`` or ``demo.toml``) names a bundled
    graph; otherwise the path is returned unchanged, for the caller to report as missing.
    """
    path = Path(arg)
    if path.is_file():
        return path
    if path.name == arg:  # no directory part: may be a bundled graph's name
        bundled = bundled_graphs()
        name = path.stem if path.suffix == ".toml" else arg
        if name in bundled:
            return bundled[name]
    return path
