"""The ``response_store`` resource: stored Responses for ``previous_response_id`` and GET, in SQLite.

Theory of operation
-------------------
Each stored response is one row of ``responses.sqlite`` (default
``DATA_DIR/responses.sqlite``): the response object as sent (for
``GET /v1/responses/{id}``), the conversation a follow-up continues (messages
in template shape), its size (the two JSON encodings), when it expires and when
it was last used. Agents chain turns through it, and a client that got a
response id back may follow up after a restart, so entries persist:
:meth:`ResponseStore.put` commits the row (``synchronous=FULL``: on disk)
before the response's last bytes go out, so an acknowledged response survives
a ``kill -9``. From the event loop, :meth:`ResponseStore.keep` commits the
responses that finish together in one transaction (a group commit): one worker
thread and one sync to disk for every response that finished while the commit
before was under way, not one each.

Bounds: an entry can be continued for ``ttl_seconds`` after it was stored;
past ``max_bytes`` the least recently used entries go. The index (id → size,
expiry) is kept in memory in LRU order, so a lookup is one primary-key read and
no write: a use moves the entry in memory, and its ``last_used`` reaches the
file with the next write (after a crash only the LRU order of the last uses is
older). Expired rows are deleted at start and now and then by ``put``. Two
processes may share the file (WAL): a lookup reads the row, so each sees what
the other stored; each bounds the bytes it knows of.

A damaged file is left untouched (see :mod:`flow.catalog.data_files`): the routes that
need the store answer 503 ``unavailable`` naming the file; requests with
``store: false`` and no ``previous_response_id`` still work.
"""

from __future__ import annotations

import copy
import json
import logging
import sqlite3
import threading
import time
from collections import OrderedDict
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import trio
from pydantic import Field

from flow.catalog.capabilities import data_dir
from flow.catalog.data_files import DamagedStore, StoreState, open_store
from flow.graph.resource import Links, Resource, ResourceConfig
from protocols.errors import ApiError
from protocols.ir import Message
from runtime.device import DeviceThread

log = logging.getLogger("flow.resources.response_store")

_SCHEMA = """
CREATE TABLE IF NOT EXISTS responses (
    id TEXT PRIMARY KEY,
    body TEXT NOT NULL,
    conversation TEXT NOT NULL,
    size INTEGER NOT NULL,
    expires REAL NOT NULL,
    last_used REAL NOT NULL
);
"""
_TABLES = {"responses": frozenset({"id", "body", "conversation", "size", "expires", "last_used"})}
SWEEP_SECONDS = 60.0  # how often put() looks for expired entries
WHAT = "stored Responses API (store=true, previous_response_id, GET/DELETE /v1/responses/{id})"


class ResponseStoreConfig(ResourceConfig):
    path: str | None = Field(default=None, description="SQLite file of stored responses (default: "
                                                       "DATA_DIR/responses.sqlite)")
    ttl_seconds: float = Field(default=3600.0, gt=0, description="how long a stored response can be continued")
    max_bytes: int = Field(default=64 * 1024 * 1024, ge=1024, description="LRU cap on the stored bytes")


@dataclass(frozen=True)
class StoredResponse:
    id: str
    body: dict[str, Any]
    conversation: tuple[Message, ...]
    size: int
    expires_at: float  # time.time()


@dataclass
class _Entry:
    size: int
    expires: float


# One response to store: its id, body and the conversation a follow-up continues.
_Put = tuple[str, dict[str, Any], tuple[Message, ...]]


class _Commit:
    """The responses that go to disk in one transaction, and whether they are there."""

    def __init__(self) -> None:
        self.puts: list[_Put] = []
        self.done = trio.Event()
        self.error: BaseException | None = None


class ResponseStore(Resource):
    type_name: ClassVar[str] = "response_store"
    Config: ClassVar[type[ResourceConfig]] = ResponseStoreConfig
    description: ClassVar[str] = "stored Responses API responses in SQLite (TTL + byte-capped LRU); survive restarts"
    config: ResponseStoreConfig

    def __init__(self, resource_id: str, config: ResourceConfig, links: Links) -> None:
        super().__init__(resource_id, config, links)
        assert isinstance(config, ResponseStoreConfig)
        self.path = Path(config.path).expanduser() if config.path else data_dir() / "responses.sqlite"
        self._db: sqlite3.Connection | None = None
        self._index: OrderedDict[str, _Entry] = OrderedDict()  # least recently used first
        self._used: dict[str, float] = {}  # id → last use not yet in the file
        self._bytes = 0
        self._next_sweep = 0.0
        self._lock = threading.Lock()  # stages call in from trio and from worker threads
        self._gathering: _Commit | None = None  # keep(): the responses waiting for the next commit
        self._last_commit: trio.Event | None = None  # keep(): set once the latest commit is on disk
        # Damaged: its routes answer 503.
        self.state = StoreState(WHAT, self.path, "response_store",
                                "Requests with store=false and no previous_response_id still work.")
        self.counters = {"stored": 0, "hits": 0, "misses": 0, "evicted": 0, "expired": 0}

    # ------------------------------------------------------------------ resource protocol
    async def start(self, device: DeviceThread) -> None:
        await trio.to_thread.run_sync(self._open)  # quick_check reads the whole file

    def _open(self) -> None:
        try:
            db = open_store(self.path, _SCHEMA, _TABLES)
        except DamagedStore as exc:  # the server serves on; only what needs the store answers 503
            self.state.set_damaged(exc.reason)
            return
        with self._lock:
            self._db = db
            self.state.open = True
            try:
                with self.state.guard():
                    for rid, size, expires in db.execute(
                            "SELECT id, size, expires FROM responses ORDER BY last_used"):
                        self._index[rid] = _Entry(size, expires)
                        self._bytes += size
                with self.state.guard(), self._write(db):
                    self._sweep(db, time.time())
                    self._evict(db, self._victims())  # the cap may have been lowered since
            except ApiError:  # logged by _guard; the server starts all the same
                return
        log.info("response store: %d stored responses in %s", len(self._index), self.path)

    def close(self) -> None:
        with self._lock:
            if self._db is None:
                return
            try:
                with self._write(self._db) as db:
                    self._flush_uses(db)
            except sqlite3.Error as exc:
                log.warning("response store %s: last uses not saved (%s)", self.path, exc)
            self._db.close()
            self._db = None
            self.state.open = False

    def stats(self) -> dict[str, Any] | None:
        if self.damaged is not None or self._db is None:
            return {"type": self.type_name, "state": "damaged" if self.damaged is not None else "closed",
                    "reason": self.damaged, "path": str(self.path)}
        with self._lock:
            return {"type": self.type_name, "state": "ok", "entries": len(self._index), "bytes": self._bytes,
                    "max_bytes": self.config.max_bytes, "ttl_seconds": self.config.ttl_seconds,
                    "path": str(self.path), **self.counters}

    @property
    def damaged(self) -> str | None:
        return self.state.damaged

    def unavailable(self) -> ApiError:
        return self.state.unavailable()

    # ------------------------------------------------------------------ entries
    async def keep(self, response_id: str, body: dict[str, Any], conversation: tuple[Message, ...]) -> None:
        """:meth:`put` from the event loop, on disk when this returns; committed with the responses that finish
        beside it (see the module's text). The first response of a commit leads it: it waits for the commit before
        (one transaction at a time), meanwhile the responses that finish join it, and it commits them all. Each
        task commits only its own commit (under steady load no request is kept committing others' for long), and
        finishes it even if its own request is cancelled meanwhile."""
        commit = self._gathering
        if commit is not None:
            commit.puts.append((response_id, body, conversation))
            await commit.done.wait()
        else:
            commit = self._gathering = _Commit()
            commit.puts.append((response_id, body, conversation))
            before, self._last_commit = self._last_commit, commit.done
            with trio.CancelScope(shield=True):
                if before is not None:
                    await before.wait()
                self._gathering = None  # from here on, responses that finish gather for the next commit
                try:
                    await trio.to_thread.run_sync(self.put_many, commit.puts)
                except Exception as exc:  # every response of the commit is told
                    commit.error = exc
                finally:
                    commit.done.set()
        if commit.error is not None:
            raise copy.copy(commit.error)  # each request raises its own

    def put(self, response_id: str, body: dict[str, Any], conversation: tuple[Message, ...]) -> None:
        """Store (or replace) a response; on disk when this returns."""
        self.put_many([(response_id, body, conversation)])

    def put_many(self, puts: list[_Put]) -> None:
        """Store (or replace) responses in one transaction; on disk when this returns."""
        rows = []
        for response_id, body, conversation in puts:
            body_json = json.dumps(body, default=str)
            conversation_json = json.dumps([m.to_template() for m in conversation], default=str)
            rows.append((response_id, body_json, conversation_json, len(body_json) + len(conversation_json)))
        now = time.time()
        expires = now + self.config.ttl_seconds
        with self._lock, self.state.guard():
            assert self._db is not None
            with self._write(self._db) as db:
                if now >= self._next_sweep:
                    self._sweep(db, now)
                db.executemany("INSERT OR REPLACE INTO responses VALUES (?, ?, ?, ?, ?, ?)",
                               [(rid, body, conversation, size, expires, now)
                                for rid, body, conversation, size in rows])
                for response_id, _, _, size in rows:
                    old = self._index.pop(response_id, None)
                    self._bytes += size - (old.size if old is not None else 0)
                    self._index[response_id] = _Entry(size, expires)
                    self._used.pop(response_id, None)
                self._evict(db, self._victims(frozenset(rid for rid, *_ in rows)))
                self._flush_uses(db)
            self.counters["stored"] += len(rows)

    def get(self, response_id: str) -> StoredResponse | None:
        with self._lock, self.state.guard():
            assert self._db is not None
            # The row, not just the index: another flow process on the same file may have stored it.
            row = self._db.execute("SELECT body, conversation, size, expires FROM responses WHERE id = ?",
                                   (response_id,)).fetchone()
            known = response_id in self._index
            if row is not None and row[3] <= time.time():
                row = None  # expired: its row goes with the next sweep
                self.counters["expired"] += int(known)
            if row is None:
                self._forget(response_id)
                self.counters["misses"] += 1
                return None
            entry = _Entry(int(row[2]), float(row[3]))
            self._forget(response_id)
            self._index[response_id] = entry  # the most recently used
            self._bytes += entry.size
            self._used[response_id] = time.time()
            self.counters["hits"] += 1
        try:
            conversation = tuple(Message.from_template(m) for m in json.loads(row[1]))
            return StoredResponse(response_id, json.loads(row[0]), conversation, entry.size, entry.expires)
        except (ValueError, TypeError, KeyError) as exc:  # a row edited by hand: say so, do not 500
            raise ApiError("unavailable", f"Stored response '{response_id}' in {self.path} cannot be read "
                           f"({type(exc).__name__}: {exc}).", param="response_id", code="store_error") from exc

    def delete(self, response_id: str) -> bool:
        with self._lock, self.state.guard():
            assert self._db is not None
            with self._write(self._db) as db:
                gone = db.execute("DELETE FROM responses WHERE id = ?", (response_id,)).rowcount > 0
            self._forget(response_id)
            return gone

    # ------------------------------------------------------------------ internals (lock held)
    @staticmethod
    @contextmanager
    def _write(db: sqlite3.Connection) -> Iterator[sqlite3.Connection]:
        """One transaction: committed (on disk) when the block ends, rolled back if it raises."""
        db.execute("BEGIN IMMEDIATE")
        try:
            yield db
        except BaseException:
            try:
                db.execute("ROLLBACK")
            except sqlite3.Error:  # the first error is the one to report
                pass
            raise
        db.execute("COMMIT")

    def _forget(self, response_id: str) -> None:
        entry = self._index.pop(response_id, None)
        if entry is not None:
            self._bytes -= entry.size
        self._used.pop(response_id, None)

    def _victims(self, keep: frozenset[str] = frozenset()) -> list[str]:
        """Least recently used ids to drop to get under ``max_bytes`` (never those in ``keep``, the entries just
        put)."""
        total = self._bytes
        victims: list[str] = []
        for rid, entry in self._index.items():
            if total <= self.config.max_bytes:
                break
            if rid not in keep:
                victims.append(rid)
                total -= entry.size
        return victims

    def _evict(self, db: sqlite3.Connection, victims: list[str]) -> None:
        db.executemany("DELETE FROM responses WHERE id = ?", [(v,) for v in victims])
        for victim in victims:
            self._forget(victim)
        self.counters["evicted"] += len(victims)

    def _sweep(self, db: sqlite3.Connection, now: float) -> None:
        """Delete expired rows (and their index entries)."""
        self._next_sweep = now + SWEEP_SECONDS
        gone = db.execute("DELETE FROM responses WHERE expires <= ?", (now,)).rowcount
        for rid in [rid for rid, entry in self._index.items() if entry.expires <= now]:
            self._forget(rid)
        self.counters["expired"] += max(gone, 0)

    def _flush_uses(self, db: sqlite3.Connection) -> None:
        db.executemany("UPDATE responses SET last_used = ? WHERE id = ?",
                       [(when, rid) for rid, when in self._used.items()])
        self._used.clear()
