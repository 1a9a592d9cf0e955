"""Work a request brings that could run away, in a child process with a CPU and a memory budget.

Some decoding has no useful bound in its input's size: a 16 KB PDF whose pages share one compressed content
stream of thousands of text operators costs a minute of CPU in pypdf. A thread cannot be stopped, and pure
Python holds the GIL the event loop needs, so such work runs here instead: in a child process of its own
(``python -m flow.graph.isolation``: a fresh interpreter with the worker's modules imported, never MLX or the
device thread), under ``RLIMIT_CPU`` and ``RLIMIT_AS``. The caller blocks — always on a worker thread, never
on the event loop — until the child answers or runs out of CPU, memory or wall-clock time; the child is
killed and reaped in every case. One child does one job, so no state and no limit carries over; a spare is
started after each job, so the next one does not wait for an interpreter to start. At most
:data:`MAX_CHILDREN` run at once, so hostile requests cannot fork a process each.

The job and its answer cross the child's stdin and stdout pickled: an exception that pickles comes back as
itself, any other as a :class:`ChildFailed` naming its type.
"""

from __future__ import annotations

import importlib
import os
import pickle
import resource
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal, TypeVar

T = TypeVar("T")

MAX_CHILDREN = max(1, min(4, os.cpu_count() or 2))
PRELOAD = ("pypdf", "protocols.documents")  # imported by a spare while it waits

_spare_lock = threading.Lock()
_spare: subprocess.Popen[bytes] | None = None
_slots = threading.BoundedSemaphore(MAX_CHILDREN)


@dataclass(frozen=True)
class Budget:
    """What one job may take: CPU seconds, bytes of address space, seconds of wall-clock time (waiting for a
    free child included)."""

    cpu_seconds: float
    memory_bytes: int = 2 << 30
    wall_seconds: float | None = None

    @property
    def wall(self) -> float:
        # CPU time is the bound that means something; wall time only catches a child that cannot get a core.
        return self.wall_seconds if self.wall_seconds is not None else 4 * self.cpu_seconds + 10


class BudgetExceeded(Exception):
    """The job used up its budget (``limit``: ``cpu``, ``memory`` or ``time``) and was stopped."""

    def __init__(self, limit: Literal["cpu", "memory", "time"], budget: Budget) -> None:
        self.limit = limit
        self.budget = budget
        super().__init__(f"stopped: over its {limit} budget")


class ChildFailed(Exception):
    """The child raised something that could not be sent back as itself, or died."""


def _start_child() -> subprocess.Popen[bytes]:
    return subprocess.Popen([sys.executable, "-m", "flow.graph.isolation"], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, close_fds=True)


def _take_child() -> subprocess.Popen[bytes]:
    """The spare (if it is still alive) or a new child; a new spare starts either way."""
    global _spare
    with _spare_lock:
        child, _spare = _spare, _start_child()
    return child if child is not None and child.poll() is None else _start_child()


def run_bounded(fn: Callable[..., T], *args: Any, budget: Budget) -> T:
    """``fn(*args)`` in a child process within ``budget``; blocks (call it from a worker thread). ``fn`` must
    be a module-level function, and ``args`` and its result must pickle."""
    started = time.monotonic()
    if not _slots.acquire(timeout=budget.wall):
        raise BudgetExceeded("time", budget)
    try:
        child = _take_child()
        try:
            out, _ = child.communicate(pickle.dumps((fn, args, budget)), timeout=budget.wall)
        except subprocess.TimeoutExpired:
            child.kill()
            child.communicate()
            raise BudgetExceeded("time", budget) from None
        finally:
            if child.poll() is None:
                child.kill()
                child.wait()
    finally:
        _slots.release()
    if child.returncode in (-signal.SIGXCPU, -signal.SIGKILL):  # the kernel's two steps at RLIMIT_CPU
        raise BudgetExceeded("cpu", budget)
    try:
        message = pickle.loads(out)
    except Exception:  # noqa: BLE001 - nothing, or half an answer: the child died
        raise ChildFailed(f"the worker process ended with exit code {child.returncode}") from None
    if message[0] == "ok":
        result: T = message[1]
        return result
    if message[0] == "memory":
        raise BudgetExceeded("memory", budget)
    if message[0] == "raised":
        raise message[1]
    raise ChildFailed(message[1])


def _serve_one() -> None:
    """The child: import what jobs use, wait for one job on stdin, run it within its budget, answer."""
    for name in PRELOAD:
        importlib.import_module(name)
    job = sys.stdin.buffer.read()
    if not job:  # the server stopped, or never needed this spare
        return
    fn, args, budget = pickle.loads(job)
    used = resource.getrusage(resource.RUSAGE_SELF)
    seconds = int(used.ru_utime + used.ru_stime + budget.cpu_seconds) + 1
    resource.setrlimit(resource.RLIMIT_CPU, (seconds, seconds + 1))  # SIGXCPU at the soft limit, KILL at hard
    resource.setrlimit(resource.RLIMIT_AS, (budget.memory_bytes, budget.memory_bytes))
    try:
        message: tuple[Any, ...] = ("ok", fn(*args))
    except MemoryError:
        message = ("memory",)
    except Exception as exc:  # noqa: BLE001 - everything the job raised goes back to the caller
        message = ("raised", exc)
    try:
        answer = pickle.dumps(message)
    except Exception as exc:  # noqa: BLE001 - the result or the exception does not pickle
        answer = pickle.dumps(("failed", f"{type(exc).__name__}: {exc}"))
    sys.stdout.buffer.write(answer)
    sys.stdout.buffer.flush()


if __name__ == "__main__":
    _serve_one()
