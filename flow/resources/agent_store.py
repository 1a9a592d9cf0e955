"""The ``agent_store`` resource: stateful agents (the agents API), kept in SQLite.

Theory of operation
-------------------
An agent is a conversation the server keeps for its client: an id, a model, a
system prompt, an optional context cap (``max_context``), what to do when the
conversation outgrows the context (``context_overflow``), and the history:
template-shaped messages, exactly what a client would otherwise resend each
turn. The client sends only a turn's new messages; the ``agents.generate``
stages put the system prompt and the history in front of them and, once the
answer is complete, append the turn (the new messages and the assistant's
answer) here. A turn that fails or is cancelled leaves the history as it was.

Storage: agents created with ``persist = true`` live in an SQLite file
(default ``DATA_DIR/agents.sqlite``) and survive restarts; ``persist = false``
ones live in an in-memory SQLite database with the same schema and vanish with
the process. One row per agent, one row per history message: a turn appends
rows, nothing is rewritten however long the conversation grows.

KV state: a turn's KV blocks go to the graph's prefix cache (session
``agent:ID``). Block keys start from the model's weights, so each model has its
own chain for the same conversation; the store remembers, per model, the key of
the last block of the agent's latest turn, and asks the prefix cache where that
block is now: ``hot`` (in memory), ``warm`` (on disk, e.g. after a restart) or
``cold`` (nowhere: the next turn is prefilled in full). Changing an agent's
model keeps its history and starts (or resumes) that model's chain.

Safety: the file is private (0600) and written with ``synchronous=FULL``, so a
turn is on disk before its answer's last bytes go out. A file that is damaged
(at start, or found so later) is never written, renamed or deleted: the store
becomes unavailable, every agents route answers 503 naming the file and how to
recover it, ``/stats`` shows ``state: "damaged"`` with the reason, and the rest
of the server serves on (see :mod:`flow.catalog.data_files`).
"""

from __future__ import annotations

import json
import logging
import re
import sqlite3
import threading
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

import trio
from pydantic import Field

from flow.catalog.capabilities import data_dir
from flow.catalog.data_files import DamagedStore, StoreState, open_store
from flow.graph.resource import Links, Reference, Resource, ResourceConfig
from flow.resources.model import ModelResource, ModelSet
from flow.resources.prefix_cache import PrefixCacheResource
from protocols.errors import ApiError
from protocols.ir import ContextOverflow
from runtime.device import DeviceThread

if TYPE_CHECKING:
    from runtime.prefix_cache import PrefixCache

log = logging.getLogger("flow.resources.agent_store")

_TURNS: dict[Path, dict[str, str]] = {}
_TURNS_LOCK = threading.Lock()

AGENT_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
AGENT_ID_RULE = "1 to 128 letters, digits, '.', '_' or '-', starting with a letter or digit"

_SCHEMA = """
CREATE TABLE IF NOT EXISTS agents (
    id TEXT PRIMARY KEY,
    model TEXT NOT NULL,
    system_prompt TEXT NOT NULL,
    max_context INTEGER,
    context_overflow TEXT,
    context_tokens INTEGER NOT NULL DEFAULT 0,
    created REAL NOT NULL,
    last_access REAL NOT NULL,
    kv TEXT NOT NULL DEFAULT '{}'
);
CREATE TABLE IF NOT EXISTS messages (
    agent_id TEXT NOT NULL,
    seq INTEGER NOT NULL,
    message TEXT NOT NULL,
    PRIMARY KEY (agent_id, seq)
);
"""
_COLUMNS = "id, model, system_prompt, max_context, context_overflow, context_tokens, created, last_access, kv"
_TABLES = {"agents": frozenset(_COLUMNS.split(", ")), "messages": frozenset({"agent_id", "seq", "message"})}


class AgentStoreConfig(ResourceConfig):
    cache: str | None = Field(default=None, description="the prefix_cache resource agents' KV status is read from "
                                                        "(default: the graph's only one, if any)")
    models: list[str] = Field(default_factory=list, description="model resources agents may use (default: all)")
    path: str | None = Field(default=None, description="SQLite file of persisted agents (default: "
                                                       "DATA_DIR/agents.sqlite)")
    context_overflow: ContextOverflow = Field(
        default="error", description="for agents that do not choose: a conversation longer than the context is "
                                     "an error (context_length_exceeded), or drop_oldest leaves out its oldest "
                                     "turns after the system prompt")


@dataclass(frozen=True)
class Agent:
    id: str
    model: str  # the model resource's canonical name
    system_prompt: str
    max_context: int | None
    context_overflow: ContextOverflow | None  # None: the store's default
    persist: bool
    context_tokens: int  # prompt + completion tokens of the latest turn
    created: float
    last_access: float
    kv: tuple[tuple[str, str], ...]  # model → hex key of the last KV block of the latest turn on that model
    messages: int  # history length
    history: tuple[dict[str, Any], ...] | None = None  # loaded when asked for


class AgentStore(Resource):
    type_name: ClassVar[str] = "agent_store"
    Config: ClassVar[type[ResourceConfig]] = AgentStoreConfig
    references = {"cache": Reference("prefix_cache", required=False),  # agents' KV status
                  "models": Reference("model", many=True)}  # the models agents may name
    description: ClassVar[str] = "stateful agents (id, model, system prompt, history) in SQLite; survive restarts"
    config: AgentStoreConfig

    def __init__(self, resource_id: str, config: ResourceConfig, links: Links) -> None:
        super().__init__(resource_id, config, links)
        assert isinstance(config, AgentStoreConfig)
        self.path = Path(config.path).expanduser() if config.path else data_dir() / "agents.sqlite"
        cache = links.optional("cache", PrefixCacheResource)
        self.prefix: PrefixCache | None = cache.cache if cache is not None else None
        self.models = ModelSet(links.many("models", ModelResource))
        self._lock = threading.Lock()  # stages call in from worker threads
        self._dbs: dict[bool, sqlite3.Connection] = {}  # persist → its database
        # agent id → the request answering its current turn. Shared by every store on the same file: a reload
        # that rebuilds the store must not let a new turn start while the old store's turn is still running.
        self._turns = _TURNS.setdefault(self.path.resolve(), {})
        self._turns_lock = _TURNS_LOCK  # not ``_lock``: releasing a turn must not wait for SQLite
        self.state = StoreState("agents API", self.path, "agent_store")  # damaged: every agents route is a 503

    # ------------------------------------------------------------------ resource protocol

    async def start(self, device: DeviceThread) -> None:
        await trio.to_thread.run_sync(self._open)  # quick_check reads the whole file

    def _open(self) -> None:
        try:
            disk = open_store(self.path, _SCHEMA, _TABLES)
        except DamagedStore as exc:  # the server serves on; only the agents routes answer 503
            self.state.set_damaged(exc.reason)
            return
        memory = sqlite3.connect(":memory:", check_same_thread=False, isolation_level=None)
        memory.executescript(_SCHEMA)
        self._dbs = {True: disk, False: memory}
        self.state.open = True

    @property
    def damaged(self) -> str | None:
        return self.state.damaged

    def unavailable(self) -> ApiError:
        return self.state.unavailable()

    def close(self) -> None:
        with self._lock:
            for db in self._dbs.values():
                db.close()
            self._dbs = {}
            self.state.open = False

    def stats(self) -> dict[str, Any] | None:
        try:
            with self._lock, self.state.guard():
                counts = {persist: db.execute("SELECT COUNT(*) FROM agents").fetchone()[0]
                          for persist, db in self._dbs.items()}
        except ApiError as exc:  # /stats itself must answer
            state = "damaged" if self.damaged is not None else "closed" if not self._dbs else "error"
            return {"type": self.type_name, "state": state, "reason": self.damaged or exc.message,
                    "path": str(self.path)}
        return {"type": self.type_name, "state": "ok", "agents": sum(counts.values()),
                "persisted": counts.get(True, 0), "in_memory": counts.get(False, 0), "path": str(self.path)}

    # ------------------------------------------------------------------ agents
    def model_name(self, model: str) -> str:
        """The canonical name of the model ``model`` names (404 ``model_not_found`` if none)."""
        return self.models.lookup(model).name

    def overflow(self, agent: Agent) -> ContextOverflow:
        return agent.context_overflow or self.config.context_overflow

    def create(self, agent_id: str, model: str, system_prompt: str = "", max_context: int | None = None,
               context_overflow: ContextOverflow | None = None, persist: bool = True) -> Agent:
        now = time.time()
        with self._transaction() as dbs:
            if any(self._row(db, agent_id) is not None for db in dbs.values()):
                raise ApiError("conflict", f"An agent with id '{agent_id}' already exists; PATCH "
                               f"/v1/agents/{agent_id} to change it, or DELETE it first.", param="id",
                               code="agent_exists")
            dbs[persist].execute(f"INSERT INTO agents ({_COLUMNS}) VALUES (?, ?, ?, ?, ?, 0, ?, ?, '{{}}')",
                                 (agent_id, model, system_prompt, max_context, context_overflow, now, now))
        found = self.get(agent_id)
        assert found is not None
        return found

    def get(self, agent_id: str, *, history: bool = False) -> Agent | None:
        with self._lock, self.state.guard():
            for persist, db in self._dbs.items():
                row = self._row(db, agent_id)
                if row is not None:
                    return self._agent(db, row, persist, history)
        return None

    def agents(self) -> list[Agent]:
        with self._lock, self.state.guard():
            agents = [self._agent(db, row, persist, False) for persist, db in self._dbs.items()
                      for row in db.execute(f"SELECT {_COLUMNS} FROM agents")]
        return sorted(agents, key=lambda a: (a.created, a.id))

    def update(self, agent_id: str, changes: Mapping[str, Any]) -> Agent | None:
        """Change ``model``, ``system_prompt``, ``max_context``, ``context_overflow`` or ``persist``;
        the history stays (a persist change moves the agent between the file and memory)."""
        fields = {k: v for k, v in changes.items() if k != "persist"}
        unknown = set(fields) - {"model", "system_prompt", "max_context", "context_overflow"}
        if unknown:
            raise ValueError(f"not agent fields: {sorted(unknown)}")
        with self._transaction() as dbs:
            persist = next((p for p, db in dbs.items() if self._row(db, agent_id) is not None), None)
            if persist is None:
                return None
            if fields:
                assignments = ", ".join(f"{name} = ?" for name in fields)
                dbs[persist].execute(f"UPDATE agents SET {assignments} WHERE id = ?", (*fields.values(), agent_id))
            wanted = changes.get("persist")
            if wanted is not None and wanted != persist:
                source, target = dbs[persist], dbs[wanted]
                row = self._row(source, agent_id)
                assert row is not None
                target.execute(f"INSERT INTO agents ({_COLUMNS}) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)", row)
                target.executemany("INSERT INTO messages VALUES (?, ?, ?)", source.execute(
                    "SELECT agent_id, seq, message FROM messages WHERE agent_id = ?", (agent_id,)).fetchall())
                self._delete(source, agent_id)
        return self.get(agent_id)

    def delete(self, agent_id: str) -> bool:
        with self._transaction() as dbs:
            return any([self._delete(db, agent_id) for db in dbs.values()])

    def append_turn(self, agent_id: str, messages: list[dict[str, Any]], *, context_tokens: int,
                    model: str) -> bool:
        """Append a finished turn to the history; remember where the turn's KV blocks are (False: the
        agent was deleted meanwhile)."""
        state = None
        if self.prefix is not None:
            self.prefix.settled()  # the turn's answer is stored just after its stream ended
            state = self.prefix.session(session_id(agent_id))
        with self._transaction() as dbs:
            for db in dbs.values():
                row = self._row(db, agent_id)
                if row is None:
                    continue
                kv = json.loads(row[8])
                if state is not None and state["last_block"] is not None:
                    kv[model] = state["last_block"]
                (start,) = db.execute("SELECT COALESCE(MAX(seq) + 1, 0) FROM messages WHERE agent_id = ?",
                                      (agent_id,)).fetchone()
                db.executemany("INSERT INTO messages VALUES (?, ?, ?)",
                               [(agent_id, start + i, json.dumps(m)) for i, m in enumerate(messages)])
                db.execute("UPDATE agents SET context_tokens = ?, last_access = ?, kv = ? WHERE id = ?",
                           (context_tokens, time.time(), json.dumps(kv, sort_keys=True), agent_id))
                return True
        return False

    def begin_turn(self, agent_id: str, request_id: str) -> None:
        """Mark the agent as answering a turn: a turn builds on the history the one before it leaves, so a
        second one while the first runs is a 409 (as a thread with an active run is in the Assistants API)."""
        if self.damaged is not None:
            raise self.unavailable()
        with self._turns_lock:
            running = self._turns.get(agent_id)
            if running is not None:
                raise ApiError("conflict", f"Agent '{agent_id}' is still answering a turn (request {running}); "
                               "send the next turn when that one has finished.", param="agent_id",
                               code="agent_busy")
            self._turns[agent_id] = request_id

    def end_turn(self, agent_id: str, request_id: str) -> None:
        """Release the agent's turn if ``request_id`` holds it (a later turn's claim stays)."""
        with self._turns_lock:
            if self._turns.get(agent_id) == request_id:
                del self._turns[agent_id]

    def busy(self, agent_id: str) -> bool:
        with self._turns_lock:
            return agent_id in self._turns

    def status(self, agent: Agent) -> str:
        """Where the KV of the agent's conversation on its current model is: hot, warm or cold."""
        key = dict(agent.kv).get(agent.model)
        if self.prefix is None or key is None:
            return "cold"
        return self.prefix.tier_of(bytes.fromhex(key))

    # ------------------------------------------------------------------ internals
    @contextmanager
    def _transaction(self) -> Iterator[dict[bool, sqlite3.Connection]]:
        with self._lock, self.state.guard():
            for db in self._dbs.values():
                db.execute("BEGIN")
            try:
                yield self._dbs
            except BaseException:
                for db in self._dbs.values():
                    if db.in_transaction:
                        try:
                            db.execute("ROLLBACK")
                        except sqlite3.Error:  # the first error is the one to report
                            pass
                raise
            for db in self._dbs.values():
                db.execute("COMMIT")

    @staticmethod
    def _row(db: sqlite3.Connection, agent_id: str) -> tuple[Any, ...] | None:
        row: tuple[Any, ...] | None = db.execute(f"SELECT {_COLUMNS} FROM agents WHERE id = ?",
                                                 (agent_id,)).fetchone()
        return row

    @staticmethod
    def _delete(db: sqlite3.Connection, agent_id: str) -> bool:
        db.execute("DELETE FROM messages WHERE agent_id = ?", (agent_id,))
        return db.execute("DELETE FROM agents WHERE id = ?", (agent_id,)).rowcount > 0

    @staticmethod
    def _agent(db: sqlite3.Connection, row: tuple[Any, ...], persist: bool, history: bool) -> Agent:
        agent_id = row[0]
        if history:
            rows: list[tuple[str]] = db.execute(
                "SELECT message FROM messages WHERE agent_id = ? ORDER BY seq", (agent_id,)).fetchall()
            messages = tuple(json.loads(m) for (m,) in rows)
            count = len(messages)
        else:
            (count,) = db.execute("SELECT COUNT(*) FROM messages WHERE agent_id = ?", (agent_id,)).fetchone()
        return Agent(id=agent_id, model=row[1], system_prompt=row[2], max_context=row[3], context_overflow=row[4],
                     persist=persist, context_tokens=row[5], created=row[6], last_access=row[7],
                     kv=tuple(sorted(json.loads(row[8]).items())), messages=count,
                     history=messages if history else None)


def session_id(agent_id: str) -> str:
    """The prefix-cache session of an agent's turns."""
    return f"agent:{agent_id}"
