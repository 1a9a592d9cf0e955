"""Model downloads from the Hugging Face Hub: ``flow pull`` and ``/downloads``, with progress.

Theory of operation
-------------------
A download is planned file by file: the repository's file list with sizes
(``HfApi.model_info(files_metadata=True)``) at one commit, then each file
through ``hf_hub_download`` into the ordinary hub cache, so what is pulled is
found by ``flow models``, ``/library`` and ``--model REPO`` like anything
``huggingface_hub`` fetched. A pull run again after an interruption fetches
only what it lacks:

* a file already complete in the cache costs nothing;
* a file cut off mid-way goes on from the bytes on disk. ``huggingface_hub``
  2.x resumes only within one call (its retries after a dropped connection):
  each call downloads to a temporary file of its own and deletes it on
  failure, so a stopped process or hub starts the file again. So
  :func:`fetch_blob` keeps the part in the cache's ``blobs/<etag>.incomplete``
  (the name ``huggingface_hub`` 0.x resumed from) and continues it with
  ``huggingface_hub``'s own ``http_get(resume_size=…)`` (a ``Range``
  request; a hub that ignores it answers the whole file, and ``http_get``
  starts the part again), under the lock ``hf_hub_download`` takes for that
  blob; ``hf_hub_download`` then finds the blob and links it into the
  snapshot. Files served through Xet (``hf_xet`` installed) are left to
  ``hf_hub_download``: Xet keeps its own chunk cache.

Progress is one :class:`Download` record, updated from the worker thread by
:class:`Progress` (fed by the tqdm-shaped bar ``huggingface_hub`` drives) and
read by the CLI's progress line and ``GET /downloads``: state, current file,
bytes received of the total, files done of the total, rate over the last
seconds, error.

Offline (``HF_HUB_OFFLINE``), nothing is attempted: :func:`pull` raises
:class:`Offline`, and the endpoints say so.
"""

from __future__ import annotations

import os
import re
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, Literal, TypeGuard

import trio
from pydantic import Field

from flow.catalog.fit import human_bytes
from flow.catalog.local_models import hub_cache_dir
from flow.graph.resource import Links, Resource, ResourceConfig
from protocols.errors import ApiError

if TYPE_CHECKING:
    from runtime.device import DeviceThread

State = Literal["queued", "running", "done", "failed"]
RATE_WINDOW = 5.0  # seconds over which bytes_per_sec is measured
REFERENCE_STATES: dict[State, str] = {"queued": "active", "running": "active", "done": "done", "failed": "error"}
# A Hugging Face model repository id, the whole string (fullmatch: ``$`` would let a trailing newline through).
REPO_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,95}/[A-Za-z0-9][A-Za-z0-9._-]{0,95}")


def valid_repo_id(repo: object) -> TypeGuard[str]:
    """Whether ``repo`` is an ``owner/name`` id the hub accepts (no ``..``, no control characters)."""
    return isinstance(repo, str) and REPO_ID.fullmatch(repo) is not None and ".." not in repo


class Offline(Exception):
    """The hub is switched off here (``HF_HUB_OFFLINE``)."""


def hub_offline() -> bool:
    """``HF_HUB_OFFLINE`` as the environment says now (huggingface_hub reads it once, at import)."""
    return os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on")


def hub_endpoint() -> str | None:
    """The hub to use: ``HF_ENDPOINT`` read now (a mirror, or a local hub in tests), else the default."""
    return os.environ.get("HF_ENDPOINT") or None


@dataclass
class Download:
    """One download's state, as ``GET /downloads`` and the CLI show it."""

    repo: str
    revision: str = "main"
    state: State = "queued"
    current_file: str | None = None
    received_bytes: int = 0
    total_bytes: int = 0
    files_done: int = 0
    files_total: int = 0
    bytes_per_sec: float = 0.0
    error: str | None = None
    path: str | None = None
    started: float = field(default_factory=time.time)
    finished: float | None = None

    def json(self) -> dict[str, Any]:
        return {"repo": self.repo, "revision": self.revision, "state": self.state,
                "current_file": self.current_file, "received_bytes": self.received_bytes,
                "total_bytes": self.total_bytes, "files_done": self.files_done, "files_total": self.files_total,
                "bytes_per_sec": round(self.bytes_per_sec, 1), "error": self.error, "path": self.path,
                "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(self.started)),
                "finished": None if self.finished is None else
                time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(self.finished))}

    def reference_json(self) -> dict[str, Any]:
        """The reference API's download record (``GET /downloads``' ``downloads``): its states are ``active``
        (flow's queued and running; ``queued`` says which), ``done`` and ``error``; times are unix seconds; ``error``
        only on an error. flow's ``revision`` and ``path`` beside them."""
        entry: dict[str, Any] = {
            "repo_id": self.repo, "state": REFERENCE_STATES[self.state], "current_file": self.current_file,
            "received_bytes": self.received_bytes, "total_bytes": self.total_bytes, "files_done": self.files_done,
            "files_total": self.files_total, "bytes_per_sec": round(self.bytes_per_sec, 1),
            "started_at": int(self.started), "finished_at": None if self.finished is None else int(self.finished),
            "queued": self.state == "queued", "revision": self.revision, "path": self.path}
        if self.state == "failed":
            entry["error"] = self.error
        return entry

    @property
    def eta_seconds(self) -> float | None:
        left = self.total_bytes - self.received_bytes
        return left / self.bytes_per_sec if self.bytes_per_sec > 0 and left >= 0 else None


class Progress:
    """Feeds a :class:`Download` from the worker thread: files begin and end, bytes arrive."""

    def __init__(self, download: Download, clock: Any = time.monotonic) -> None:
        self.download = download
        self.clock = clock
        self._samples: deque[tuple[float, int]] = deque()  # (time, bytes transferred so far)
        self._skipped = 0
        self._lock = threading.Lock()

    def planned(self, files: list[tuple[str, int]]) -> None:
        d = self.download
        d.files_total, d.total_bytes, d.state = len(files), sum(size for _, size in files), "running"
        self._sample()

    def file_started(self, name: str) -> None:
        self.download.current_file = name

    def received(self, n: int) -> None:
        with self._lock:
            self.download.received_bytes += n
            self._sample()

    def resumed(self, n: int) -> None:
        """A file goes on from ``n`` bytes already on disk: they count as received, not in the rate."""
        with self._lock:
            self.download.received_bytes += n
            self._skipped += n
            self._sample()

    def file_done(self, size: int, counted: int) -> None:
        """A file is complete: bytes the bar did not report (found in the cache, resumed) count now."""
        with self._lock:
            self.download.received_bytes += max(0, size - counted)
            self._skipped += max(0, size - counted)  # not transferred now: left out of the rate
            self.download.files_done += 1
            self._sample()

    def _sample(self) -> None:
        now = self.clock()
        self._samples.append((now, self.download.received_bytes - self._skipped))
        while len(self._samples) > 2 and now - self._samples[0][0] > RATE_WINDOW:
            self._samples.popleft()
        (t0, b0), (t1, b1) = self._samples[0], self._samples[-1]
        self.download.bytes_per_sec = (b1 - b0) / (t1 - t0) if t1 > t0 else 0.0

    def finished(self, path: Path | None, error: str | None) -> None:
        d = self.download
        d.path, d.error = (str(path) if path else None), error
        d.state = "failed" if error else "done"
        d.current_file = None
        d.finished = time.time()


def progress_line(d: Download) -> str:
    """One line for a terminal: a bar, bytes, rate, ETA, files and the current file."""
    done = d.received_bytes / d.total_bytes if d.total_bytes else 0.0
    bar = "#" * int(done * 24)
    eta = d.eta_seconds
    eta_text = f"{int(eta // 60)}:{int(eta % 60):02d}" if eta is not None else "--:--"
    return (f"[{bar:<24}] {done:4.0%} {human_bytes(d.received_bytes)}/{human_bytes(d.total_bytes)} "
            f"{human_bytes(d.bytes_per_sec)}/s ETA {eta_text} files {d.files_done}/{d.files_total} "
            f"{d.current_file or ''}")[:160]


def _bar_class(progress: Progress, counted: list[int]) -> type:
    """A tqdm-shaped class ``hf_hub_download`` drives for one file: its updates go to ``progress``."""

    class Bar:
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            initial = int(kwargs.get("initial") or 0)  # a resumed file's part already on disk
            if initial:
                progress.resumed(initial)
                counted[0] += initial

        def update(self, n: float | None = 1) -> None:
            progress.received(int(n or 0))
            counted[0] += int(n or 0)

        def __enter__(self) -> Bar:
            return self

        def __exit__(self, *exc: object) -> None:
            return None

        def __getattr__(self, name: str) -> Any:  # refresh, close, set_postfix_str, update_transfer…: not ours
            return lambda *args, **kwargs: None

    return Bar


def plan(repo: str, revision: str = "main") -> tuple[str, list[tuple[str, int]]]:
    """The commit ``revision`` names and its files with their sizes."""
    from huggingface_hub import HfApi

    info = HfApi(endpoint=hub_endpoint()).model_info(repo, revision=revision, files_metadata=True)
    files = [(s.rfilename, int(s.size or 0)) for s in info.siblings or []]
    return str(info.sha or revision), files


def fetch_blob(repo: str, name: str, commit: str, cache: Path, bar: type) -> None:
    """Bring ``name``'s blob into the hub cache, going on from a part an earlier pull left (see the module's
    notes); afterwards ``hf_hub_download`` only links it. Xet-served files are left to ``hf_hub_download``."""
    from huggingface_hub import get_hf_file_metadata, hf_hub_url
    from huggingface_hub.file_download import http_get, repo_folder_name
    from huggingface_hub.utils._fixes import WeakFileLock
    from huggingface_hub.utils._headers import build_hf_headers
    from huggingface_hub.utils._runtime import is_xet_available

    headers = build_hf_headers()
    meta = get_hf_file_metadata(hf_hub_url(repo, name, revision=commit, endpoint=hub_endpoint()), headers=headers)
    if meta.etag is None or (meta.xet_file_data is not None and is_xet_available()):
        return
    folder = repo_folder_name(repo_id=repo, repo_type="model")
    blob = cache / folder / "blobs" / meta.etag
    lock = cache / ".locks" / folder / f"{meta.etag}.lock"  # the lock hf_hub_download takes for this blob
    lock.parent.mkdir(parents=True, exist_ok=True)
    blob.parent.mkdir(parents=True, exist_ok=True)
    with WeakFileLock(lock):
        if blob.exists():
            return
        part = blob.with_name(blob.name + ".incomplete")
        if part.exists() and meta.size is not None and part.stat().st_size > meta.size:
            part.unlink()  # not a part of this file
        # Read-write at the end rather than append: http_get rewinds and truncates if the hub ignores Range.
        with part.open("r+b" if part.exists() else "w+b") as out:
            on_disk = out.seek(0, os.SEEK_END)
            http_get(meta.location, out, resume_size=on_disk, headers=headers, expected_size=meta.size,
                     displayed_filename=name, tqdm_class=bar)
        os.replace(part, blob)


def pull(download: Download, progress: Progress | None = None) -> Path:
    """Download ``download.repo`` into the hub cache (blocking: a worker thread); returns the snapshot."""
    from huggingface_hub import constants, hf_hub_download, try_to_load_from_cache

    progress = progress or Progress(download)
    # huggingface_hub read HF_HUB_OFFLINE once, at import; flow follows the environment as it is now.
    constants.HF_HUB_OFFLINE = hub_offline()
    if hub_offline():
        error = "offline: HF_HUB_OFFLINE is set, so nothing is downloaded; models already in the cache still serve"
        progress.finished(None, error)
        raise Offline(error)
    cache = hub_cache_dir()  # as the environment says now: where /library and --model look
    try:
        commit, files = plan(download.repo, download.revision)
        progress.planned(files)
        snapshot: Path | None = None
        for name, size in files:
            progress.file_started(name)
            counted = [0]
            bar = _bar_class(progress, counted)
            if not isinstance(try_to_load_from_cache(download.repo, name, cache_dir=cache, revision=commit), str):
                fetch_blob(download.repo, name, commit, cache, bar)
            local = hf_hub_download(download.repo, name, revision=commit, endpoint=hub_endpoint(),
                                    cache_dir=cache, tqdm_class=bar)
            progress.file_done(size, counted[0])
            snapshot = Path(local).parent if "/" not in name else Path(local).parents[name.count("/")]
    except Exception as exc:
        progress.finished(None, f"{type(exc).__name__}: {exc}")
        raise
    progress.finished(snapshot, None)
    assert snapshot is not None or not files
    return snapshot or Path()


class DownloadsConfig(ResourceConfig):
    keep: int = Field(default=20, ge=1, description="finished downloads listed by GET /downloads")


class DownloadsResource(Resource):
    """Downloads queued by ``POST /downloads``, run one at a time on a worker thread (the resource's duty)."""

    type_name: ClassVar[str] = "downloads"
    description = "model downloads from the Hugging Face Hub into its cache, one at a time, with progress"
    Config = DownloadsConfig

    def __init__(self, resource_id: str, config: ResourceConfig, links: Links) -> None:
        super().__init__(resource_id, config, links)
        self.downloads: list[Download] = []
        self.completed = 0  # downloads finished well: the library rescans when this changes
        self._send, self._receive = trio.open_memory_channel[Download](64)

    async def start(self, device: DeviceThread) -> None:
        return None

    async def run(self) -> None:
        async for download in self._receive:
            try:
                await trio.to_thread.run_sync(pull, download, Progress(download), abandon_on_cancel=True)
            except Exception:  # recorded on the download (state failed, error); the duty goes on
                continue
            self.completed += 1

    def queue(self, repo: str, revision: str) -> Download:
        active = next((d for d in self.downloads if d.repo == repo and d.state in ("queued", "running")), None)
        if active is not None:
            return active  # one download of a repository at a time
        download = Download(repo, revision)
        try:
            self._send.send_nowait(download)
        except trio.WouldBlock:
            raise ApiError("rate_limit", "Too many downloads are queued; retry when some have finished.",
                           retry_after=30) from None
        self.downloads.append(download)
        keep = self.config.keep  # type: ignore[attr-defined]
        finished = [d for d in self.downloads if d.state in ("done", "failed")]
        for old in finished[:-keep] if len(finished) > keep else []:
            self.downloads.remove(old)
        return download

    def stats(self) -> dict[str, Any] | None:
        return {"type": self.type_name, "queued": sum(d.state == "queued" for d in self.downloads),
                "running": sum(d.state == "running" for d in self.downloads), "offline": hub_offline()}
