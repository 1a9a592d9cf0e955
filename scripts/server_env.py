"""The environment of a flow server a benchmark starts from a checkout (shared by the benchmark scripts)."""

from __future__ import annotations

import os
from pathlib import Path


def checkout_env(checkout: Path, **extra: str) -> dict[str, str]:
    """This process's environment with ``checkout`` first on ``PYTHONPATH`` — ahead of a path already there (a lent
    GPU machine's installed packages), never instead of it — and ``extra`` set."""
    path = os.pathsep.join([str(checkout), *filter(None, [os.environ.get("PYTHONPATH")])])
    return {**os.environ, "PYTHONPATH": path, **extra}
