"""The event loop's lag, measured all the time, and the name of whatever stalls it.

The event loop only routes (DESIGN, Safe by default): work that holds it — a parser on the loop, a long C call
that keeps the GIL — stops every request at once, ``/health`` included. Two parts watch for that:

- a task on the loop sleeps :data:`INTERVAL` at a time and measures how late it wakes: the lag every request
  sees. ``/metrics`` has its histogram, its largest value and the stalls (a lag over ``stall_seconds``);
  ``/stats`` has the same under ``event_loop``.
- a thread beside it notices when that task has not woken for ``stall_seconds`` and, while the loop is still
  held, takes the loop thread's stack: the innermost frame of flow's own code says where, a stage on the
  stack (``self``) says which stage, an ``http`` request on it says which route. When the stall ends it is
  logged with those names, once.

Both cost a wake-up every 20 ms, nothing per request or per token.
"""

from __future__ import annotations

import gc
import logging
import os
import sys
import threading
import time
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, replace
from pathlib import Path
from types import FrameType
from typing import Any

import trio

from flow.graph.metrics import Metric, Registry
from flow.graph.stage import Stage
from protocols.ir import HttpRequest

log = logging.getLogger("flow.loop")

INTERVAL = 0.02
RECENT_STALLS = 32  # kept for /stats
# Fine below 25 ms, where a server under load should stay: its p99 is read off these buckets.
LAG_BUCKETS = (0.001, 0.0025, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)
_ROOT = str(Path(__file__).resolve().parents[2])  # the checkout (or site-packages) holding flow/
_SCHEDULER = os.path.join("trio", "_core", "_run.py")
_OWN = tuple(os.path.join(_ROOT, package) + os.sep for package in ("flow", "stages", "protocols", "runtime", "viz"))


def _thread_frames() -> dict[int, FrameType]:
    """``sys._current_frames()`` with the garbage collector held off.

    CPython 3.11 builds that dict while it holds the interpreter's thread-list lock; an allocation there may
    start a collection, which runs Python code (a finalizer, a ``gc.callbacks`` hook) that can hand the GIL to
    another thread, still holding the lock. A thread that then needs the lock with the GIL (one starting or
    ending, or another ``_current_frames``) waits for it forever, and every other thread for the GIL: the whole
    process froze that way under the test suite (two servers' watchers, hypothesis's GC hook)."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        return sys._current_frames()
    finally:
        if enabled:
            gc.enable()


@dataclass(frozen=True)
class Culprit:
    """What the loop thread's stack showed while the loop was held. ``held_by``: ``flow`` (flow's own code was
    running: a stage or the shell doing work it should not do on the loop), ``library`` (a library's code, on
    a path of flow's), or ``waiting`` (the loop's thread mostly did not run — it used under half the stall in
    CPU time —: the machine gave the process no core, or another thread kept the GIL)."""

    held_by: str = "waiting"
    where: str | None = None
    stage: str | None = None
    route: str | None = None


@dataclass
class Stall:
    """One stall: how long the loop was held, and what held it (as far as its stack tells)."""

    seconds: float
    culprit: Culprit
    at: float

    def json(self) -> dict[str, Any]:
        culprit = self.culprit
        return {"ms": round(self.seconds * 1000, 1), "held_by": culprit.held_by, "where": culprit.where,
                "stage": culprit.stage, "route": culprit.route, "at": self.at}

    def describe(self) -> str:
        parts = [f"the event loop was held for {self.seconds * 1000:.0f} ms ({self.culprit.held_by})"]
        culprit = self.culprit
        if culprit.route:
            parts.append(f"by {culprit.route}")
        if culprit.stage:
            parts.append(f"in stage {culprit.stage}")
        if culprit.where:
            parts.append(f"at {culprit.where}")
        return " ".join(parts)


def _frame_name(frame: FrameType) -> str:
    code = frame.f_code
    path = code.co_filename
    shown = os.path.relpath(path, _ROOT) if path.startswith(_ROOT) else "/".join(path.split(os.sep)[-3:])
    return f"{shown}:{frame.f_lineno} in {code.co_name}"


def _culprit(frame: FrameType | None) -> Culprit:
    """What a stack, innermost frame first, says held the loop."""
    if frame is None:
        return Culprit()
    innermost = frame
    if f"{os.sep}trio{os.sep}_core{os.sep}_io_" in innermost.f_code.co_filename:
        return Culprit("waiting", _frame_name(innermost))
    where = stage = route = None
    # From the innermost frame out to trio's scheduler: the task step that holds the loop (the frames
    # beyond are the thread's and trio's own, the same for every task).
    while frame is not None and not frame.f_code.co_filename.endswith(_SCHEDULER):
        code = frame.f_code
        if where is None and code.co_filename.startswith(_OWN):
            where = _frame_name(frame)
        local = frame.f_locals
        owner = local.get("self")
        if stage is None and isinstance(owner, Stage):
            stage = f"{owner.id} ({owner.type_name})"
        http = local.get("http")
        if route is None and isinstance(http, HttpRequest):
            route = f"{http.method} {http.path}"
        frame = frame.f_back
    return Culprit("flow" if where is not None else "library", where or _frame_name(innermost), stage, route)


class LoopWatch:
    """The lag monitor of one server: :meth:`run` in its nursery; its metrics join ``registry``."""

    def __init__(self, registry: Registry, stall_seconds: float = 0.1) -> None:
        self.stall_seconds = stall_seconds
        self.lag = registry.histogram("flow_event_loop_lag_seconds",
                                      "How late the event loop ran a timer (every 20 ms).", LAG_BUCKETS)
        registry.collector(self._metrics)
        self.last_lag = 0.0
        self.max_lag = 0.0
        self.stalls = 0
        self.held_by = {"flow": 0, "library": 0, "waiting": 0}  # stalls, by what held the loop
        self.last_stall: Stall | None = None
        self.recent: deque[Stall] = deque(maxlen=RECENT_STALLS)
        self._beat = time.perf_counter()
        self._loop_thread: int | None = None
        self._seen: Culprit | None = None
        self._stop = threading.Event()

    async def run(self) -> None:
        self._loop_thread = threading.get_ident()
        watcher = threading.Thread(target=self._watch, name="flow-loop-watch", daemon=True)
        watcher.start()
        try:
            while True:
                before = self._beat = time.perf_counter()
                cpu = time.thread_time()
                await trio.sleep(INTERVAL)
                self._woke(time.perf_counter() - before - INTERVAL, time.thread_time() - cpu)
        finally:
            self._stop.set()

    def _woke(self, lag: float, cpu: float) -> None:
        """A wake-up ``lag`` seconds late, the loop's thread having run ``cpu`` seconds since it slept."""
        lag = max(0.0, lag)
        self.last_lag = lag
        self.max_lag = max(self.max_lag, lag)
        self.lag.observe(lag)
        seen, self._seen = self._seen, None
        if lag <= self.stall_seconds:
            return
        self.stalls += 1
        culprit = seen or Culprit()
        if cpu < 0.5 * lag:  # the thread mostly did not run: it was not held by work, whatever its stack says
            culprit = replace(culprit, held_by="waiting")
        self.last_stall = Stall(lag, culprit, time.time())
        self.recent.append(self.last_stall)
        self.held_by[self.last_stall.culprit.held_by] += 1
        log.warning("%s", self.last_stall.describe())

    def _watch(self) -> None:
        """The thread: while the loop is held past ``stall_seconds``, read its stack (once per stall)."""
        while not self._stop.wait(INTERVAL):
            held = time.perf_counter() - self._beat - INTERVAL
            if held > self.stall_seconds and self._seen is None and self._loop_thread is not None:
                frame = _thread_frames().get(self._loop_thread)
                self._seen = _culprit(frame)

    def json(self) -> dict[str, Any]:
        return {"lag_ms": round(self.last_lag * 1000, 2), "max_lag_ms": round(self.max_lag * 1000, 2),
                "stall_ms": self.stall_seconds * 1000, "stalls": self.stalls, "stalls_held_by": dict(self.held_by),
                "last_stall": self.last_stall.json() if self.last_stall is not None else None,
                "recent_stalls": [stall.json() for stall in self.recent]}

    def _metrics(self) -> Iterable[Metric]:
        largest = Metric("flow_event_loop_lag_max_seconds", "The largest event-loop lag since the server started.",
                         "gauge")
        largest.set(self.max_lag)
        stalls = Metric("flow_event_loop_stalls_total", f"Times the event loop was held for over "
                        f"{self.stall_seconds * 1000:g} ms, by what its stack showed (flow, library, waiting).",
                        "counter")
        for held_by, count in self.held_by.items():
            stalls.set(count, held_by=held_by)
        return [largest, stalls]
