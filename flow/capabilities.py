"""The capability store: what ``flow probe`` found out about a model, in SQLite.

One row per model (keyed by its resolved directory): the family, the parsers
and tool delivery that worked, whether thinking can be switched, the context
length, and the probe's evidence as JSON. Serving reads it before falling back
to family detection, so a probed model is served the way that was shown to work.

The database lives in the user's data directory (``$FLOW_DATA_DIR``, else
``$XDG_DATA_HOME/flow``, ``~/Library/Application Support/flow`` on macOS,
``~/.local/share/flow`` elsewhere).
"""

from __future__ import annotations

import json
import os
import sqlite3
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from flow.families import Family


def data_dir() -> Path:
    if os.environ.get("FLOW_DATA_DIR"):
        return Path(os.environ["FLOW_DATA_DIR"])
    if sys.platform == "darwin":
        return Path.home() / "Library" / "Application Support" / "flow"
    return Path(os.environ.get("XDG_DATA_HOME") or Path.home() / ".local" / "share") / "flow"


def default_db() -> Path:
    return data_dir() / "capabilities.sqlite"


@dataclass(frozen=True)
class Capabilities:
    model: str  # the resolved model directory
    family: str
    tool_parser: str
    reasoning_parser: str
    tool_delivery: str  # "template" | "injected"
    thinking: bool  # the template switches thinking on and off
    context_length: int
    tool_calls_verified: bool = False  # a generated call parsed with tool_parser
    probed_at: float = field(default_factory=time.time)
    evidence: dict[str, Any] = field(default_factory=dict)


_SCHEMA = """
CREATE TABLE IF NOT EXISTS capabilities (
    model TEXT PRIMARY KEY,
    family TEXT NOT NULL,
    tool_parser TEXT NOT NULL,
    reasoning_parser TEXT NOT NULL,
    tool_delivery TEXT NOT NULL,
    thinking INTEGER NOT NULL,
    context_length INTEGER NOT NULL,
    tool_calls_verified INTEGER NOT NULL,
    probed_at REAL NOT NULL,
    evidence TEXT NOT NULL
)
"""


class CapabilityStore:
    def __init__(self, path: Path | None = None) -> None:
        self.path = path or default_db()

    def _connect(self) -> sqlite3.Connection:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        conn = sqlite3.connect(self.path)
        conn.execute(_SCHEMA)
        return conn

    def put(self, caps: Capabilities) -> None:
        row = asdict(caps)
        row["evidence"] = json.dumps(caps.evidence)
        with self._connect() as conn:
            conn.execute(f"INSERT OR REPLACE INTO capabilities ({', '.join(row)}) VALUES "
                         f"({', '.join('?' for _ in row)})", [row[k] for k in row])

    def get(self, model: Path | str) -> Capabilities | None:
        if not self.path.exists():
            return None
        try:
            with self._connect() as conn:
                conn.row_factory = sqlite3.Row
                found = conn.execute("SELECT * FROM capabilities WHERE model = ?", (str(model),)).fetchone()
        except sqlite3.DatabaseError:
            return None  # an unreadable store is as good as none: detection still works
        if found is None:
            return None
        row = dict(found)
        return Capabilities(**{**row, "thinking": bool(row["thinking"]),
                               "tool_calls_verified": bool(row["tool_calls_verified"]),
                               "evidence": json.loads(row["evidence"])})

    def all(self) -> list[Capabilities]:
        if not self.path.exists():
            return []
        with self._connect() as conn:
            models = [r[0] for r in conn.execute("SELECT model FROM capabilities ORDER BY model")]
        return [c for m in models if (c := self.get(m)) is not None]


def family_from_capabilities(caps: Capabilities, families: dict[str, Family]) -> Family:
    """The family serving uses for a probed model: its family with what the probe found."""
    base = families.get(caps.family, families["default"])
    return base.model_copy(update={
        "tools": base.tools.model_copy(update={"parser": caps.tool_parser, "delivery": caps.tool_delivery}),
        "reasoning": base.reasoning.model_copy(update={"parser": caps.reasoning_parser}),
    })
