"""User-data SQLite files (the agent store, the response store): private, checked, never harmed.

Theory of operation
-------------------
A cache that is damaged is set aside and rebuilt (see :mod:`runtime.kv_disk`);
a store of user data is not: nothing in flow may delete or rewrite what a user
might still recover. So a store file is checked *read-only* before anything
writes to it: it must open, pass ``PRAGMA quick_check``, and the tables the
store uses must have the columns it reads. A file that fails is left exactly as
it is (not even its mode changes) and :class:`DamagedStore` says why; the store
then answers its routes with a 503 ``unavailable`` error
(:func:`unavailable_error`) that names the file and how to recover it, while the
rest of the server goes on serving.

A file that passes is made private (0600, its directory 0700) and opened in WAL
mode with ``synchronous=FULL``: a committed write is on disk before the client
is answered, so an acknowledged agent turn or stored response survives a
``kill -9`` or a power cut.

At run time, :func:`classify` tells the errors that mean the file is damaged
(corrupt, not a database) from those that do not (a full disk, a lock).
"""

from __future__ import annotations

import logging
import sqlite3
from collections.abc import Iterator, Mapping, Set
from contextlib import contextmanager
from pathlib import Path

from flow.catalog.capabilities import private_data_file
from protocols.errors import ApiError

log = logging.getLogger("flow.catalog.data_files")

DAMAGE = frozenset({"SQLITE_CORRUPT", "SQLITE_NOTADB"})  # the file itself is bad: it stays bad until repaired


class DamagedStore(Exception):
    """A store file that must not be used: ``reason`` says why."""

    def __init__(self, path: Path, reason: str) -> None:
        super().__init__(f"{path}: {reason}")
        self.path = path
        self.reason = reason


def _reason(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"


def check_readonly(path: Path, columns: Mapping[str, Set[str]]) -> None:
    """Raise :class:`DamagedStore` unless ``path`` is a sound SQLite database whose tables among ``columns``
    (table → the columns the store reads) have those columns. Opens read-only: the file is not changed."""
    try:
        db = sqlite3.connect(f"{path.absolute().as_uri()}?mode=ro", uri=True)
    except sqlite3.Error as exc:
        raise DamagedStore(path, _reason(exc)) from exc
    try:
        check = [str(row[0]) for row in db.execute("PRAGMA quick_check").fetchall()]
        if check != ["ok"]:
            raise DamagedStore(path, "PRAGMA quick_check: " + "; ".join(check[:5]))
        for table, wanted in columns.items():
            have = {str(row[1]) for row in db.execute(f"PRAGMA table_info({table})")}
            if have and not wanted <= have:  # no table at all is fine: the schema creates it
                raise DamagedStore(path, f"table {table!r} lacks the columns {sorted(wanted - have)} (is this "
                                         "file from another program?)")
    except sqlite3.Error as exc:
        raise DamagedStore(path, _reason(exc)) from exc
    finally:
        db.close()


def open_store(path: Path, schema: str, columns: Mapping[str, Set[str]]) -> sqlite3.Connection:
    """Check ``path`` (:func:`check_readonly`, if it exists), make it private and open it for the store
    (autocommit; callers BEGIN their transactions). Raises :class:`DamagedStore`."""
    if path.exists():
        check_readonly(path, columns)
    try:
        db = sqlite3.connect(private_data_file(path), check_same_thread=False, isolation_level=None)
    except (sqlite3.Error, OSError) as exc:
        raise DamagedStore(path, _reason(exc)) from exc
    try:
        db.execute("PRAGMA journal_mode=WAL")
        db.execute("PRAGMA synchronous=FULL")  # user data: a commit is on disk before the client hears of it
        db.executescript(schema)
    except sqlite3.Error as exc:
        db.close()
        raise DamagedStore(path, _reason(exc)) from exc
    return db


def classify(exc: sqlite3.Error) -> str | None:
    """The damage an error reveals (a reason to remember), or None if it says nothing about the file
    (a full disk, a lock, a bug)."""
    if getattr(exc, "sqlite_errorname", None) in DAMAGE:
        return _reason(exc)
    return None


def unavailable_error(what: str, path: Path, reason: str, resource: str, works: str = "") -> ApiError:
    """The 503 a damaged store's routes answer: which file, why, and how to get going again."""
    return ApiError(
        "unavailable",
        f"The {what} is unavailable: its file {path} cannot be used ({reason}). flow has left the file "
        f"untouched.{(' ' + works) if works else ''} To recover: stop flow; then move the file (with its -wal "
        f"and -shm files, if any) aside: a new, empty store is created at the next start; or salvage what it holds with "
        f"`sqlite3 {path} \".recover\" | sqlite3 {path}.recovered` and put the recovered file in its place, "
        f"or point the {resource} resource's `path` at another file; then start flow again.",
        code="store_unavailable")


def store_error(what: str, path: Path, exc: sqlite3.Error) -> ApiError:
    """The 503 for an SQLite error that does not mean the file is damaged (a full disk, a lock)."""
    return ApiError("unavailable", f"The {what} could not use its file {path} ({type(exc).__name__}: {exc}); "
                    "the request changed nothing. Check the disk it is on.", code="store_error")


class StoreState:
    """Whether a store's file can be used, and the errors its routes get when it cannot.

    ``what`` names what the file serves (for messages), ``resource`` the resource type (for the recovery
    hint), ``works`` what still works without it."""

    def __init__(self, what: str, path: Path, resource: str, works: str = "") -> None:
        self.what, self.path, self.resource, self.works = what, path, resource, works
        self.damaged: str | None = None  # why the file cannot be used
        self.open = False

    def set_damaged(self, reason: str) -> None:
        self.damaged = reason
        log.error("%s: %s cannot be used (%s); it answers 503 until the file is repaired, and the file is left "
                  "untouched. Stop flow and move it aside (a new store is created) or recover it with "
                  "`sqlite3 FILE .recover`.", self.path, self.what, reason)

    def unavailable(self) -> ApiError:
        return unavailable_error(self.what, self.path, self.damaged or "not started", self.resource, self.works)

    @contextmanager
    def guard(self) -> Iterator[None]:
        """503 while the file is damaged or not open; an SQLite error becomes a 503 too (and marks the file
        damaged if the error says it is)."""
        if self.damaged is not None or not self.open:
            raise self.unavailable()
        try:
            yield
        except sqlite3.Error as exc:
            damage = classify(exc)
            if damage is None:
                log.warning("%s: %s: %s: %s", self.path, self.what, type(exc).__name__, exc)
                raise store_error(self.what, self.path, exc) from exc
            self.set_damaged(damage)
            raise self.unavailable() from exc
