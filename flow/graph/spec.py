"""Graph files as written: TOML → merged tables → :class:`GraphSpec`.

A graph file may name parents with ``extends = "other.toml"`` (or a list, paths
relative to the file). Parents are merged first, in order; the child's tables
are merged over them key by key, so a variant only writes what differs — a new
model path, one more stage, a different batch size. ``drop = ["id", …]``
removes inherited stages or resources.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib


class SpecError(Exception):
    """The graph files could not be read or merged; ``path`` says where."""

    def __init__(self, path: str, message: str) -> None:
        super().__init__(f"{path}: {message}")
        self.path = path
        self.message = message


SHUTDOWN_CLOSE_SECONDS = 1.0
"""After a graceful stop's grace, the time the ended requests' error events have to go out; connections still
open then (a body never finished) are closed and the process exits. Default grace + this: inside ``docker stop``'s
10 s."""


class ServerSpec(BaseModel):
    model_config = ConfigDict(extra="forbid")
    host: str = "127.0.0.1"
    port: int = Field(default=8080, ge=0, le=65535)
    api_key: str | None = None
    allowed_hosts: list[str] = Field(
        default_factory=list, description="on a loopback bind, Host names served besides localhost/127.x/[::1]")
    max_body_bytes: int | None = Field(
        default=None, ge=1024, description="largest request body (default: from the models' context, 1-64 MiB)")
    idle_timeout_seconds: float = Field(
        default=30.0, gt=0, description="a connection idle or still sending its headers is closed after this")
    body_timeout_seconds: float = Field(default=60.0, gt=0, description="a request body must arrive within this")
    shutdown_grace_seconds: float = Field(
        default=8.0, ge=0, description="on SIGTERM/SIGINT, time running requests get to finish; then they end with "
                                       "an error in their protocol and the process exits within about a second "
                                       "(8 s: inside docker stop's 10 s; set it ~2 s under a supervisor's grace)")
    default_exit: str | None = Field(
        default=None, description="the exit stage whose protocol shapes errors for paths no route's prefix "
                                  "matches (unknown routes, 413 before routing); default: the first route's exit")


class GraphSpec(BaseModel):
    """The whole graph as written. Stage and resource tables stay raw dicts here:
    their keys depend on their ``type`` and are checked by the compiler."""

    model_config = ConfigDict(extra="forbid")
    name: str = "graph"
    description: str = ""
    server: ServerSpec = ServerSpec()
    resources: dict[str, dict[str, Any]] = Field(default_factory=dict)
    stages: dict[str, dict[str, Any]] = Field(default_factory=dict)


def _merge(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, value in over.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = _merge(out[key], value)
        else:
            out[key] = value
    return out


def load_tables(path: Path, _seen: tuple[Path, ...] = ()) -> dict[str, Any]:
    """Read a graph file with its ``extends`` chain resolved and ``drop`` applied."""
    path = path.resolve()
    if path in _seen:
        chain = " → ".join(p.name for p in (*_seen, path))
        raise SpecError(str(path), f"extends forms a loop: {chain}")
    try:
        data = tomllib.loads(path.read_text())
    except FileNotFoundError:
        raise SpecError(str(path), "file not found") from None
    except tomllib.TOMLDecodeError as exc:
        raise SpecError(str(path), f"invalid TOML: {exc}") from None
    parents = data.pop("extends", [])
    if isinstance(parents, str):
        parents = [parents]
    if not isinstance(parents, list) or not all(isinstance(p, str) for p in parents):
        raise SpecError(f"{path}: extends", "must be a file path or a list of file paths")
    merged: dict[str, Any] = {}
    for parent in parents:
        merged = _merge(merged, load_tables(path.parent / parent, (*_seen, path)))
    drops = data.pop("drop", [])
    if not isinstance(drops, list) or not all(isinstance(d, str) for d in drops):
        raise SpecError(f"{path}: drop", "must be a list of stage or resource ids")
    for dropped in drops:
        found = False
        for table in ("stages", "resources"):
            if dropped in merged.get(table, {}):
                del merged[table][dropped]
                found = True
        if not found:
            raise SpecError(f"{path}: drop", f"nothing named {dropped!r} is inherited")
    return _merge(merged, data)


def graph_files(path: Path) -> list[str]:
    """The files a graph is read from: the file and, recursively, the ones it extends (for ``--watch``).
    An unreadable file is listed and ends its branch (its error is the reload's to report)."""
    out: list[str] = []
    todo = [path.resolve()]
    while todo:
        current = todo.pop()
        if str(current) in out:
            continue
        out.append(str(current))
        try:
            parents = tomllib.loads(current.read_text()).get("extends", [])
        except (OSError, tomllib.TOMLDecodeError):
            continue
        for parent in [parents] if isinstance(parents, str) else parents if isinstance(parents, list) else []:
            if isinstance(parent, str):
                todo.append((current.parent / parent).resolve())
    return out
