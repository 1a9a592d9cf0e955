"""BLAS threads that leave the event loop a core while it is busy.

OpenBLAS splits each matrix product evenly across its threads (one per core by default) and waits for the
slowest. On a server the event loop needs a core of its own under load: it parses requests, tokenizes and
formats answers. A BLAS thread sharing that core runs at a fraction of its speed, the whole product waits for
it, and its spinning between products takes CPU from the loop in turn. Measured on 2 cores, all-MiniLM-L6-v2
under 64 concurrent clients (flow's event loop about 55% busy): the passes took as long with one BLAS thread
as with two (69 against 71 ms), the loop got 20% more done, and the server answered 5% more inputs a second.
Alone, two threads make the same pass 1.2× faster, so the count follows the load.

:class:`CoreSharing` reads the CPU clock of the event loop's thread on the device thread, at most every
``WINDOW_SECONDS``. While the loop used more than ``BUSY_SHARE`` of a core it gives BLAS one thread fewer than
its default; once the loop is back under ``QUIET_SHARE``, the default again. Only OpenBLAS built with pthreads
(flow's fast path on Linux, :mod:`flow.cli.blas`) takes the setting from another thread; elsewhere (Apple's
Accelerate, MLX's reference BLAS, OpenBLAS built with OpenMP) there is nothing to set and nothing changes.
"""

from __future__ import annotations

import ctypes
import logging
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

log = logging.getLogger("flow.device")

WINDOW_SECONDS = 0.25
BUSY_SHARE = 0.3  # of one core, over a window
QUIET_SHARE = 0.15


@dataclass(frozen=True)
class BlasControl:
    """A BLAS library's thread count: how to read and set it."""

    get: Callable[[], int]
    set: Callable[[int], None]


def openblas_control() -> BlasControl | None:
    """OpenBLAS's thread count, when the process has OpenBLAS with pthreads loaded (preloaded: its symbols are
    global); ``None`` otherwise."""
    try:
        process = ctypes.CDLL(None)
        get = process.openblas_get_num_threads
        put = process.openblas_set_num_threads
        parallel = process.openblas_get_parallel
    except (OSError, AttributeError):
        return None
    parallel.restype = ctypes.c_int
    if parallel() != 1:  # 0: sequential build, 2: OpenMP (the setting would hold for the calling thread only)
        return None
    get.restype = ctypes.c_int
    put.argtypes = [ctypes.c_int]
    put.restype = None
    return BlasControl(get=lambda: int(get()), set=lambda n: put(n))


def thread_cpu_clock(ident: int) -> Callable[[], float] | None:
    """The CPU seconds a thread has used so far, read from any thread (``None`` where the platform cannot)."""
    try:
        clock = time.pthread_getcpuclockid(ident)
        time.clock_gettime(clock)
    except (AttributeError, OSError):
        return None
    return lambda: time.clock_gettime(clock)


class CoreSharing:
    """Gives BLAS one thread fewer while the watched thread (the event loop) is busy; see the module docstring.
    :meth:`update` runs on the device thread, between its steps, when no product is under way."""

    def __init__(self, blas: BlasControl | None, loop_cpu: Callable[[], float] | None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.blas = blas if loop_cpu is not None else None
        self.loop_cpu = loop_cpu
        self.clock = clock
        self.default = blas.get() if blas is not None and loop_cpu is not None else 0
        self.threads = self.default
        self.switches = 0
        self._since = clock()
        self._cpu_since = loop_cpu() if self.default and loop_cpu is not None else 0.0

    @classmethod
    def for_main_thread(cls) -> CoreSharing:
        """Watching the process's main thread, where ``flow serve`` runs its event loop (``FLOW_BLAS_FOLLOW_LOAD=0``:
        not at all, OpenBLAS keeps its own count)."""
        if os.environ.get("FLOW_BLAS_FOLLOW_LOAD", "1") == "0":
            return cls(None, None)
        return cls(openblas_control(), thread_cpu_clock(threading.main_thread().ident or 0))

    @property
    def active(self) -> bool:
        return self.blas is not None and self.default > 1

    def update(self) -> None:
        if not self.active:
            return
        now = self.clock()
        if now - self._since < WINDOW_SECONDS:
            return
        assert self.loop_cpu is not None and self.blas is not None
        try:
            cpu = self.loop_cpu()
        except OSError:  # the watched thread has ended
            self.blas.set(self.default)
            self.blas = None
            return
        share = (cpu - self._cpu_since) / (now - self._since)
        self._since, self._cpu_since = now, cpu
        reduced = self.threads < self.default
        wanted = self.default - 1 if (share > BUSY_SHARE or (reduced and share >= QUIET_SHARE)) else self.default
        if wanted != self.threads:
            self.blas.set(wanted)
            self.threads = wanted
            self.switches += 1
            log.debug("event loop at %.0f%% of a core: %d BLAS threads", share * 100, wanted)

    def stats_json(self) -> dict[str, int]:
        return {"blas_threads": self.threads, "blas_default_threads": self.default, "blas_switches": self.switches}

    def restore(self) -> None:
        """Back to the default count (the device thread is stopping)."""
        if self.blas is not None and self.threads != self.default:
            self.blas.set(self.default)
            self.threads = self.default
