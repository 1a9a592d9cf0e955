"""Private data files: directories 0700, files 0600, whatever the umask.

Conversations end up in flow's data files (agent histories, stored responses,
KV blocks of prompts), so no other user of the machine may read them. SQLite
creates its ``-wal``, ``-shm`` and ``-journal`` files with the permissions of
the database file, so making the database file 0600 *before*
``sqlite3.connect`` covers those too; :func:`private_db` also tightens such
files left by an older version.

Directories are only tightened when they are flow's own (the data directory,
or one flow created): a directory the user named that already exists keeps its
mode; the files flow puts in it are private anyway.
"""

from __future__ import annotations

import logging
import os
import stat
from pathlib import Path

log = logging.getLogger("flow.private_files")

DIR_MODE = 0o700
FILE_MODE = 0o600
SQLITE_SIDE_FILES = ("-wal", "-shm", "-journal")


def private_dir(path: Path, *, ours: bool = False) -> Path:
    """Make ``path`` a directory: missing components are created 0700 (as the XDG spec asks of data
    directories); an existing ``path`` is chmodded to 0700 only if ``ours`` (flow's data directory, or a
    directory only flow uses). Returns ``path``."""
    missing: list[Path] = []
    probe = path
    while not probe.exists():
        missing.append(probe)
        if probe.parent == probe:
            break
        probe = probe.parent
    for directory in reversed(missing):
        try:
            os.mkdir(directory, DIR_MODE)
        except FileExistsError:  # made meanwhile (another process): check it like an existing one
            continue
        os.chmod(directory, DIR_MODE)  # mkdir's mode went through the umask
    if ours and not missing:
        _chmod(path, DIR_MODE)
    return path


def private_file(path: Path) -> Path:
    """Create ``path`` empty with mode 0600 if it is missing, else chmod it to 0600. Returns ``path``."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, FILE_MODE)
    except FileExistsError:
        _chmod(path, FILE_MODE)
    else:
        os.close(fd)
    return path


def private_db(path: Path) -> Path:
    """:func:`private_file` for an SQLite database, and its side files that already exist."""
    private_file(path)
    for suffix in SQLITE_SIDE_FILES:
        side = path.with_name(path.name + suffix)
        if side.exists():
            _chmod(side, FILE_MODE)
    return path


def write_private(path: Path, data: bytes) -> None:
    """Write ``data`` to a new 0600 file at ``path`` (truncated if there)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, FILE_MODE)
    if stat.S_IMODE(os.fstat(fd).st_mode) != FILE_MODE:  # an old file of that name keeps its mode
        os.fchmod(fd, FILE_MODE)
    with os.fdopen(fd, "wb") as out:
        out.write(data)


def is_private(path: Path) -> bool:
    """No permission bits for group or others."""
    return stat.S_IMODE(path.stat().st_mode) & 0o077 == 0


def _chmod(path: Path, mode: int) -> None:
    if stat.S_IMODE(path.stat().st_mode) == mode:
        return
    try:
        os.chmod(path, mode)
    except OSError as exc:  # another user's file, a read-only file system: say so, but serve on
        log.warning("cannot make %s private (mode %o): %s", path, mode, exc)
