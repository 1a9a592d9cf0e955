"""The warm tier of the prefix cache: KV blocks as safetensors files, indexed in SQLite.

Theory of operation
-------------------
Every full block the prefix cache keeps with a non-zero TTL (not its tails) is also written here:
one ``.safetensors`` file per block (written to a temporary name, then renamed,
so a file either is whole or is not there) and one row in ``index.sqlite``
(key, parent key, model namespace, file size, SHA-256 of the file, expiry, last
access). Writing happens on a background thread fed by a queue; the device
thread only hands over host copies of the arrays. The directory is 0700, the
index and the block files 0600 (:mod:`runtime.private_files`): KV blocks are
conversations.

Reading is the opposite path and runs on worker threads: :meth:`DiskTier.read`
checks the file's size and SHA-256 against the index before parsing it, so a
truncated or corrupted file is detected, deleted and never served (counted in
``corrupt``). On start the index is reconciled with the directory: rows whose
file is missing or has the wrong size, and expired rows, are dropped, and block
files no row names (a crash between a file's rename and its row's commit) are
deleted.

The tier is a cache, so damage never stops the server: an index SQLite cannot
read (not a database, malformed, failing ``PRAGMA quick_check``) is set aside
as ``index.sqlite.damaged-<UTC time>`` (with its ``-wal``/``-shm``), logged and
counted in ``stats()``; the tier starts cold with a fresh index and deletes the
block files the old one described.

The tier is byte-capped: past ``max_bytes`` the least recently used blocks are
deleted (cold). ``sweep`` deletes expired ones.

bfloat16 has no NumPy type: such arrays are stored as uint16 with the real
dtype in the file's metadata, and viewed back on load. A block may lack some
layers (a sliding-window layer that no longer held its positions): tensors are
named by their index, and the metadata gives the count.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import struct
import sys
import queue
import sqlite3
import threading
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from safetensors.numpy import save as save_safetensors

from runtime.private_files import DIR_MODE, FILE_MODE, SQLITE_SIDE_FILES, private_db, private_dir, write_private

log = logging.getLogger("flow.kv_disk")

_SCHEMA = """
CREATE TABLE IF NOT EXISTS blocks (
    key TEXT PRIMARY KEY,
    parent TEXT,
    namespace TEXT NOT NULL,
    file_bytes INTEGER NOT NULL,
    sha256 TEXT NOT NULL,
    dtype TEXT NOT NULL,
    expires REAL NOT NULL,
    last_access REAL NOT NULL
)
"""


@dataclass
class DiskEntry:
    key: bytes
    parent: bytes | None
    namespace: bytes
    file_bytes: int
    sha256: str
    dtype: str
    expires: float
    last_access: float


# The safetensors dtypes a block file may hold (bfloat16 goes in as uint16); safetensors is little-endian.
_DTYPES: dict[str, np.dtype[Any]] = {"F32": np.dtype("<f4"), "F16": np.dtype("<f2"), "U16": np.dtype("<u2"),
                                     "U32": np.dtype("<u4")}  # U32: quantized KV, packed


def _parse_block(data: bytes) -> tuple[np.ndarray | None, ...]:
    """A block file's arrays as read-only views into ``data`` (safetensors layout: an 8-byte header size,
    a JSON header of dtype, shape and byte range per tensor, the raw bytes). ``safetensors.numpy.load``
    copies every tensor; the device copy follows anyway, so views halve a restart's read time."""
    (size,) = struct.unpack("<Q", data[:8])
    base = 8 + size
    if base > len(data):
        raise ValueError(f"header of {size} bytes in a {len(data)}-byte file")
    header = json.loads(data[8:base])
    arrays: list[np.ndarray | None] = []
    for i in range(int(header["__metadata__"]["count"])):
        spec = header.get(f"{i}")
        if spec is None:
            arrays.append(None)
            continue
        dtype = _DTYPES[spec["dtype"]]
        start, end = (int(n) for n in spec["data_offsets"])
        shape = tuple(int(n) for n in spec["shape"])
        count = math.prod(shape)
        fits = 0 <= start <= end <= len(data) - base and end - start == dtype.itemsize * count
        if not fits or min(shape, default=0) < 0:
            raise ValueError(f"tensor {i}: byte range {start}..{end} does not fit shape {shape}")
        arrays.append(np.frombuffer(data, dtype, count, base + start).reshape(shape))
    return tuple(arrays)


@dataclass(frozen=True)
class HostBlock:
    """A block's arrays on the host: keys and values of every layer, in layer order — each as one array, or,
    quantized (``dtype`` ``"q8g64:bfloat16"``: bits, group size, device dtype), as three (packed, scales,
    biases: ``mx.quantize``'s)."""

    arrays: tuple[np.ndarray | None, ...]
    dtype: str  # the device dtype ("bfloat16" arrays are stored as uint16), or "q{bits}g{group}:{dtype}"

    @property
    def stride(self) -> int:
        """Host arrays per device array."""
        return 3 if self.dtype.startswith("q") else 1

    def has(self, index: int) -> bool:
        """Whether device array ``index`` (layer × 2 + keys/values) is in the block."""
        return self.arrays[index * self.stride] is not None


INDEX = "index.sqlite"
BLOCK_SUFFIX = ".safetensors"
ERROR_LOG_SECONDS = 60.0  # a failing disk logs once a minute, not once per block
READ_THREADS = min(4, os.cpu_count() or 1)  # blocks read and checked at once by read_many


class DiskTier:
    def __init__(self, directory: Path, max_bytes: int, *, own_directory: bool = False) -> None:
        """``own_directory``: the directory is flow's own (the default one in the data directory), so an
        existing one is made private too; a directory the user named keeps its mode if it exists."""
        self.directory = directory
        self.max_bytes = max_bytes
        self.index: dict[bytes, DiskEntry] = {}
        self.bytes = 0
        self.written = 0
        self.read_hits = 0
        self.corrupt = 0
        self.expired = 0
        self.evicted = 0
        self.orphans_removed = 0  # block files no index row named
        self.damaged_index_set_aside = 0
        self.damaged_index: str | None = None  # where the last damaged index was put
        self.errors = 0  # failed disk operations of the writer thread
        self._last_error_log = 0.0
        self._lock = threading.Lock()
        self._queue: queue.Queue[tuple[str, Any] | None] = queue.Queue()
        self._readers: ThreadPoolExecutor | None = None  # read_many's threads, started at its first use
        private_dir(directory, ours=own_directory)
        private_dir(directory / "blocks", ours=True)
        try:
            self._reconcile()
        except (sqlite3.DatabaseError, ValueError, TypeError) as exc:  # a cache: set it aside, start cold
            if getattr(exc, "sqlite_errorname", None) in ("SQLITE_BUSY", "SQLITE_LOCKED"):
                raise  # in use by another process, not damaged
            self._set_aside(exc)
            self._reconcile()
        self._remove_orphans()
        self._writer = threading.Thread(target=self._write_loop, name="flow-kv-disk", daemon=True)
        self._writer.start()

    # ------------------------------------------------------------------ any thread
    @staticmethod
    def path_in(directory: Path, key: bytes) -> Path:
        """Where a block's file lives in a tier's directory."""
        name = key.hex()
        return directory / "blocks" / name[:2] / f"{name}.safetensors"

    def path(self, key: bytes) -> Path:
        return self.path_in(self.directory, key)

    def has(self, key: bytes) -> bool:
        with self._lock:
            entry = self.index.get(key)
            return entry is not None and entry.expires > time.time()

    def write(self, key: bytes, parent: bytes | None, namespace: bytes, block: HostBlock, expires: float) -> None:
        """Queue a block for writing (the writer thread does the IO)."""
        self._queue.put(("write", (key, parent, namespace, block, expires)))

    def touch(self, key: bytes, expires: float) -> None:
        """A use: later expiry, and last in the LRU order."""
        with self._lock:
            entry = self.index.get(key)
            if entry is None:
                return
            entry.expires = max(entry.expires, expires)
            entry.last_access = time.time()
        self._queue.put(("touch", (key, entry.expires, entry.last_access)))

    def read(self, key: bytes) -> HostBlock | None:
        """The block's arrays, or None if it is not here, expired, or its file does not check out."""
        with self._lock:
            entry = self.index.get(key)
        if entry is None or entry.expires <= time.time():
            return None
        path = self.path(key)
        try:
            data = path.read_bytes()
        except OSError:
            data = b""
        if len(data) != entry.file_bytes or hashlib.sha256(data).hexdigest() != entry.sha256:
            self._corrupt(key, f"size {len(data)} / checksum mismatch")
            return None
        try:
            arrays = _parse_block(data)
        except Exception as exc:  # a file that passed the checksum but does not parse: still never serve it
            self._corrupt(key, f"{type(exc).__name__}: {exc}")
            return None
        with self._lock:
            self.read_hits += 1
        return HostBlock(arrays, entry.dtype)

    def read_many(self, keys: Sequence[bytes]) -> list[HostBlock | None]:
        """:meth:`read` of several blocks at once, on a few threads: a hit from this tier reads hundreds of blocks
        (a restart's first turn), and the file reads and SHA-256 checks let other threads run meanwhile."""
        if len(keys) < 2:
            return [self.read(key) for key in keys]
        with self._lock:
            if self._readers is None:
                self._readers = ThreadPoolExecutor(READ_THREADS, thread_name_prefix="flow-kv-read")
            readers = self._readers
        return list(readers.map(self.read, keys))

    def delete(self, key: bytes) -> None:
        """Delete a block (one the cache no longer wants: a snapshot superseded by a deeper one)."""
        with self._lock:
            self._forget(key)
        self._queue.put(("delete", key))

    def sweep(self) -> int:
        """Delete expired blocks; how many."""
        now = time.time()
        with self._lock:
            gone = [k for k, e in self.index.items() if e.expires <= now]
            for key in gone:
                self._forget(key)
            self.expired += len(gone)
        for key in gone:
            self._queue.put(("delete", key))
        return len(gone)

    def flush(self) -> None:
        """Wait until every queued write is on disk (tests, shutdown)."""
        done = threading.Event()
        self._queue.put(("flush", done))
        done.wait()

    def close(self) -> None:
        self.flush()
        self._queue.put(None)
        self._writer.join(10)
        with self._lock:
            readers, self._readers = self._readers, None
        if readers is not None:
            readers.shutdown()

    def stats(self) -> dict[str, Any]:
        with self._lock:
            return {"blocks": len(self.index), "bytes": self.bytes, "max_bytes": self.max_bytes,
                    "written": self.written, "read_hits": self.read_hits, "corrupt": self.corrupt,
                    "expired": self.expired, "evicted": self.evicted, "orphans_removed": self.orphans_removed,
                    "errors": self.errors, "damaged_index_set_aside": self.damaged_index_set_aside,
                    "damaged_index": self.damaged_index, "directory": str(self.directory)}

    # ------------------------------------------------------------------ internals
    def _forget(self, key: bytes) -> None:
        """Drop an index entry (lock held)."""
        entry = self.index.pop(key, None)
        if entry is not None:
            self.bytes -= entry.file_bytes

    def _corrupt(self, key: bytes, why: str) -> None:
        log.warning("prefix cache: block %s on disk is damaged (%s); deleted, not served", key.hex()[:16], why)
        with self._lock:
            self._forget(key)
            self.corrupt += 1
        self._queue.put(("delete", key))

    def _connect(self) -> sqlite3.Connection:
        path = private_db(self.directory / INDEX)  # before connect: SQLite's -wal and -shm copy its mode
        db = sqlite3.connect(path)
        try:
            db.execute("PRAGMA journal_mode=WAL")
            db.execute("PRAGMA synchronous=NORMAL")  # a cache: no fsync per commit; checksums catch torn files
            db.execute(_SCHEMA)
        except BaseException:
            db.close()
            raise
        return db

    def _set_aside(self, exc: Exception) -> None:
        """Move a damaged index (and its -wal/-shm) out of the way; forget what it said. Raises OSError if
        it cannot be moved (the prefix cache then runs without its disk tier)."""
        stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
        index = self.directory / INDEX
        aside = index.with_name(f"{INDEX}.damaged-{stamp}")
        n = 1
        while aside.exists():  # two in one second: keep both
            aside, n = index.with_name(f"{INDEX}.damaged-{stamp}-{n}"), n + 1
        for suffix in ("", *SQLITE_SIDE_FILES):
            source = index.with_name(INDEX + suffix)
            if source.exists():
                os.replace(source, aside.with_name(aside.name + suffix))
        log.warning("prefix cache: the disk tier's index %s is damaged (%s: %s); set aside as %s, starting "
                    "cold (its block files are deleted: they are cache)", index, type(exc).__name__, exc, aside)
        self.index.clear()
        self.bytes = 0
        self.damaged_index_set_aside += 1
        self.damaged_index = str(aside)

    def _remove_orphans(self) -> None:
        """Delete block files (and unfinished temporary ones) the index does not name."""
        removed = 0
        for sub in (self.directory / "blocks").iterdir():
            if not sub.is_dir():
                continue
            for path in sub.iterdir():
                name = path.name
                if name.endswith(BLOCK_SUFFIX):
                    try:
                        if bytes.fromhex(name.removesuffix(BLOCK_SUFFIX)) in self.index:
                            continue
                    except ValueError:
                        pass  # not a block name: not ours either way, but it sits where only blocks go
                elif not name.endswith(".tmp"):
                    continue
                path.unlink(missing_ok=True)
                removed += 1
        self.orphans_removed += removed
        if removed:
            log.info("prefix cache: deleted %d block files no index row named in %s", removed, self.directory)

    def _reconcile(self) -> None:
        """Load the index, keeping only rows whose file is there with the recorded size and not expired
        (sqlite3.DatabaseError, or ValueError/TypeError from a row that is not what was written: the index
        is damaged)."""
        now = time.time()
        db = self._connect()
        try:
            check = db.execute("PRAGMA quick_check").fetchall()
            if check != [("ok",)]:
                raise sqlite3.DatabaseError(f"quick_check: {'; '.join(str(r[0]) for r in check[:3])}")
            dropped: list[str] = []
            for key, parent, namespace, size, sha, dtype, expires, last in db.execute("SELECT * FROM blocks"):
                path = self.path(bytes.fromhex(key))
                try:
                    st = path.stat()
                    ok = st.st_size == size
                    if ok and st.st_mode & 0o077:  # written by a version that did not make blocks private
                        os.chmod(path, FILE_MODE)
                except OSError:
                    ok = False
                if not ok or expires <= now:
                    dropped.append(key)
                    path.unlink(missing_ok=True)
                    if not ok:
                        self.corrupt += 1
                    else:
                        self.expired += 1
                    continue
                entry = DiskEntry(bytes.fromhex(key), bytes.fromhex(parent) if parent else None,
                                  bytes.fromhex(namespace), size, sha, dtype, expires, last)
                self.index[entry.key] = entry
                self.bytes += size
            db.executemany("DELETE FROM blocks WHERE key = ?", [(k,) for k in dropped])
            db.commit()
        finally:
            db.close()
        if dropped:
            log.info("prefix cache: dropped %d missing, damaged or expired blocks from %s", len(dropped),
                     self.directory)

    def _write_loop(self) -> None:
        if hasattr(os, "setpriority") and sys.platform == "linux":  # Linux threads have their own nice value
            try:
                os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 10)  # serving comes first
            except OSError:
                pass
        try:
            db = self._connect()
        except Exception:  # the index went away since the start: no disk writes, but flushes still return
            log.exception("prefix cache: cannot open the disk tier's index; blocks stay in memory only")
            while (item := self._queue.get()) is not None:
                if item[0] == "flush":
                    item[1].set()
            return
        try:
            while (item := self._queue.get()) is not None:
                kind, payload = item
                try:
                    if kind == "flush":
                        try:
                            db.commit()
                        finally:  # a waiter must never hang on a failed commit
                            payload.set()
                        continue
                    if kind == "write":
                        self._write(db, *payload)
                    elif kind == "touch":
                        key, expires, last = payload
                        db.execute("UPDATE blocks SET expires = ?, last_access = ? WHERE key = ?",
                                   (expires, last, key.hex()))
                    elif kind == "delete":
                        self.path(payload).unlink(missing_ok=True)
                        db.execute("DELETE FROM blocks WHERE key = ?", (payload.hex(),))
                        with self._lock:  # a write queued before the delete put its entry back meanwhile
                            self._forget(payload)
                    if self._queue.empty():
                        db.commit()
                except Exception:  # a full disk, a bad block or an index damaged meanwhile must not stop the tier
                    self._error(kind)
        finally:
            try:
                db.commit()
            except sqlite3.Error:
                self._error("commit")
            db.close()

    def _error(self, kind: str) -> None:
        """Count a failed disk operation; log it with its traceback at most once a minute."""
        self.errors += 1
        now = time.monotonic()
        if now - self._last_error_log >= ERROR_LOG_SECONDS:
            self._last_error_log = now
            log.exception("prefix cache: disk %s failed (%d failures so far)", kind, self.errors)

    def _write(self, db: sqlite3.Connection, key: bytes, parent: bytes | None, namespace: bytes,
               block: HostBlock, expires: float) -> None:
        with self._lock:
            if key in self.index:
                return
        # a block cut from a segment's host arrays is a view: copied here, off the device thread
        tensors = {f"{i}": np.ascontiguousarray(a) for i, a in enumerate(block.arrays) if a is not None}
        data = save_safetensors(tensors, metadata={"dtype": block.dtype, "count": str(len(block.arrays))})
        path = self.path(key)
        try:
            os.mkdir(path.parent, DIR_MODE)
        except FileExistsError:
            pass
        tmp = path.with_suffix(".tmp")
        write_private(tmp, data)
        os.replace(tmp, path)  # readers see the whole file or none; the checksum catches the rest
        now = time.time()
        entry = DiskEntry(key, parent, namespace, len(data), hashlib.sha256(data).hexdigest(), block.dtype,
                          expires, now)
        db.execute("INSERT OR REPLACE INTO blocks VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
                   (key.hex(), parent.hex() if parent else None, namespace.hex(), entry.file_bytes, entry.sha256,
                    entry.dtype, expires, now))
        with self._lock:
            self.index[key] = entry
            self.bytes += entry.file_bytes
            self.written += 1
            victims = self._over_cap()
        for victim in victims:
            self.path(victim).unlink(missing_ok=True)
            db.execute("DELETE FROM blocks WHERE key = ?", (victim.hex(),))

    def _over_cap(self) -> list[bytes]:
        """Least recently used entries to delete once the tier is over ``max_bytes`` (lock held): down to
        nine tenths of it, so that a full tier sorts its index now and then, not on every write."""
        if self.bytes <= self.max_bytes:
            return []
        victims: list[bytes] = []
        for entry in sorted(self.index.values(), key=lambda e: e.last_access):
            if self.bytes <= self.max_bytes * 0.9:
                break
            victims.append(entry.key)
            self._forget(entry.key)
            self.evicted += 1
        return victims
