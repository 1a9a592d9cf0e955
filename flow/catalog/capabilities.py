"""The capability store: what ``flow probe`` found out about a model, in SQLite.

One row per model (keyed by its resolved directory): the family, the parsers
and tool delivery that worked, whether thinking can be switched, the context
length, and the probe's evidence as JSON. Serving reads it before falling back
to family detection, so a probed model is served the way that was shown to work.

The database lives in the user's data directory (``$FLOW_DATA_DIR``, else
``$XDG_DATA_HOME/flow``, ``~/Library/Application Support/flow`` on macOS,
``~/.local/share/flow`` elsewhere). Data files are private: the directory is
0700 and the files 0600 (:mod:`runtime.private_files`).

The store only refines serving: a damaged file is logged and serving goes on
with family detection; it is never deleted or rewritten (``flow probe`` again,
after moving it aside, rebuilds it).
"""

from __future__ import annotations

import json
import logging
import os
import sqlite3
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from flow.catalog.families import Family
from runtime.private_files import private_db, private_dir

log = logging.getLogger("flow.catalog.capabilities")


def data_dir() -> Path:
    if os.environ.get("FLOW_DATA_DIR"):
        return Path(os.environ["FLOW_DATA_DIR"])
    if sys.platform == "darwin":
        return Path.home() / "Library" / "Application Support" / "flow"
    return Path(os.environ.get("XDG_DATA_HOME") or Path.home() / ".local" / "share") / "flow"


def private_data_dir() -> Path:
    """The data directory, created (or tightened) to 0700."""
    return private_dir(data_dir(), ours=True)


def private_data_file(path: Path) -> Path:
    """Prepare an SQLite data file before connecting: its directory private (tightened if it is the data
    directory), the file and its existing -wal/-shm 0600 (SQLite gives new ones the file's mode)."""
    parent = path.parent
    private_dir(parent, ours=parent.absolute() == data_dir().absolute())
    return private_db(path)


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
    kind: str = "text"  # text, vision, embeddings, audio
    profile: dict[str, Any] = field(default_factory=dict)  # kind-specific: an embedding model's dims, pooling, …


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
    evidence TEXT NOT NULL,
    kind TEXT NOT NULL DEFAULT 'text',
    profile TEXT NOT NULL DEFAULT '{}'
)
"""
# Columns added after the first release: (name, declaration), added to older stores in place.
_ADDED_COLUMNS = (("kind", "TEXT NOT NULL DEFAULT 'text'"), ("profile", "TEXT NOT NULL DEFAULT '{}'"))
_JSON_COLUMNS = ("evidence", "profile")


_warned: set[Path] = set()  # damaged stores already logged (a model load asks once per load)


class CapabilityStore:
    def __init__(self, path: Path | None = None) -> None:
        self.path = path or default_db()

    def _connect(self) -> sqlite3.Connection:
        conn = sqlite3.connect(private_data_file(self.path))
        try:
            conn.execute(_SCHEMA)
            have = {row[1] for row in conn.execute("PRAGMA table_info(capabilities)")}
            for name, declaration in _ADDED_COLUMNS:
                if name not in have:  # an older store: keep its rows, add the column
                    conn.execute(f"ALTER TABLE capabilities ADD COLUMN {name} {declaration}")
        except BaseException:
            conn.close()
            raise
        return conn

    def _unreadable(self, exc: Exception) -> None:
        if self.path not in _warned:
            _warned.add(self.path)
            log.warning("capability store %s cannot be read (%s: %s); serving models by family detection. It is "
                        "left as it is: move it aside and run `flow probe` again to rebuild it.", self.path,
                        type(exc).__name__, exc)

    def put(self, caps: Capabilities) -> None:
        row = asdict(caps)
        for name in _JSON_COLUMNS:
            row[name] = json.dumps(row[name])
        conn = self._connect()
        try:
            with conn:  # one transaction
                conn.execute(f"INSERT OR REPLACE INTO capabilities ({', '.join(row)}) VALUES "
                             f"({', '.join('?' for _ in row)})", [row[k] for k in row])
        finally:
            conn.close()

    def get(self, model: Path | str) -> Capabilities | None:
        """What was probed about ``model``; None if nothing, or if the store cannot be read (an unreadable
        store is as good as none: detection still works)."""
        if not self.path.exists():
            return None
        try:
            conn = self._connect()
            try:
                conn.row_factory = sqlite3.Row
                found = conn.execute("SELECT * FROM capabilities WHERE model = ?", (str(model),)).fetchone()
            finally:
                conn.close()
            if found is None:
                return None
            row = dict(found)
            return Capabilities(**{**row, "thinking": bool(row["thinking"]),
                                   "tool_calls_verified": bool(row["tool_calls_verified"]),
                                   **{name: json.loads(row[name]) for name in _JSON_COLUMNS}})
        except (sqlite3.Error, OSError, TypeError, ValueError, IndexError, KeyError) as exc:  # damaged, or odd rows
            self._unreadable(exc)
            return None

    def all(self) -> list[Capabilities]:
        if not self.path.exists():
            return []
        try:
            conn = self._connect()
            try:
                models = [r[0] for r in conn.execute("SELECT model FROM capabilities ORDER BY model")]
            finally:
                conn.close()
        except (sqlite3.Error, OSError) as exc:
            self._unreadable(exc)
            return []
        return [c for m in models if (c := self.get(m)) is not None]


def family_from_capabilities(caps: Capabilities, families: dict[str, Family]) -> Family:
    """The family serving uses for a probed model: its family with what the probe found."""
    base = families.get(caps.family, families["default"])
    # A family's parser options belong to its own parser: another one the probe found takes its defaults.
    tools: dict[str, Any] = {"parser": caps.tool_parser, "delivery": caps.tool_delivery}
    if caps.tool_parser != base.tools.parser:
        tools["options"] = {}
    reasoning: dict[str, Any] = {"parser": caps.reasoning_parser}
    if caps.reasoning_parser != base.reasoning.parser:
        reasoning["options"] = {}
    return base.model_copy(update={
        "tools": base.tools.model_copy(update=tools),
        "reasoning": base.reasoning.model_copy(update=reasoning),
    })
