"""The device thread: the one thread in the process that touches MLX.

Theory of operation
-------------------
MLX streams are thread-local, so loading, prefill and decode must all happen on
one thread. :class:`DeviceThread` runs a loop that alternates between two kinds
of work:

* **jobs**: one-off callables (load a model, run a reference generation, read
  cache sizes) submitted from any thread with :meth:`DeviceThread.submit`, each
  answered through a :class:`concurrent.futures.Future`;
* **steppers**: long-lived objects (one engine per loaded model) whose
  ``step()`` advances every active sequence by one scheduler step.

When no stepper has work the loop blocks on the job queue, so an idle server
uses no CPU. Steppers wake the loop with :meth:`DeviceThread.wake` when a
sequence is submitted from trio.

Freed MLX buffers are kept for reuse while the device works (on the CPU up to the
size of what is loaded, :func:`fit_buffer_cache`), and given back to
the system once it has idled for ``IDLE_RELEASE_SECONDS`` (:func:`keep_buffers`),
together with the free pages of the C heap (:func:`trim_heap`): MLX's CPU
buffers are ``malloc`` blocks, and once glibc has seen large blocks freed it
serves the next ones from its heaps, which keep freed pages resident — after a
storm of vanishing clients on an 80M model, 1.2-2.1 GB of them for good.
Between steps the loop leaves the event loop a core while it is busy: OpenBLAS
gets one thread fewer then (:mod:`runtime.blas_threads`).

Trio code waits for a job with :func:`wait_future`, which crosses back into trio
through the run's :class:`trio.lowlevel.TrioToken` — never by polling.
"""

from __future__ import annotations

import concurrent.futures
import ctypes
import logging
import os
import queue
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any, Generic, Protocol, TypeVar

import trio

from runtime.blas_threads import CoreSharing

log = logging.getLogger("flow.device")

T = TypeVar("T")


class Stepper(Protocol):
    """Something the device loop advances while it has work."""

    def has_work(self) -> bool: ...

    def step(self) -> None: ...

    def abandon(self, error: Exception) -> None:
        """From another thread, the device thread being held for good: end what it serves with ``error``."""
        ...


class DeviceLost(RuntimeError):
    """The device thread is held for good — by a collective over a lost peer, which MLX's ring backend never
    ends (see runtime.distributed) — so nothing submitted to it can run until the process restarts."""


_WAKE = object()

# An idle device gives its cached MLX buffers back to the system after this long: a burst of work keeps them,
# a server left idle holds no more than its weights.
IDLE_RELEASE_SECONDS = 2.0


# The least MLX may keep of freed buffers on the CPU: one pass's churn for a small model (all-MiniLM-L6-v2 on 200
# inputs of 14 tokens frees and allocates ~270 MB a pass).
CACHE_FLOOR_BYTES = 512 * 2**20


def keep_buffers() -> int:
    """Let MLX keep freed buffers for reuse on the CPU, as it does on a Mac's GPU, up to :func:`fit_buffer_cache`;
    returns the cache limit set (0: not the CPU, MLX's own limit stands). On the CPU MLX keeps only 32 MB. A
    forward pass frees and allocates its activations again at every layer, and past those 32 MB each buffer is a
    ``malloc`` the kernel maps afresh and zeroes, page by page: all-MiniLM-L6-v2 on 200 inputs of 14 tokens took
    67 thousand page faults and 742 ms a pass, none and 612 ms with the buffers kept. The device thread releases
    the cache when it idles."""
    import mlx.core as mx

    if mx.default_device().type != mx.DeviceType.cpu or mx.get_memory_limit() <= 0:
        return 0
    return fit_buffer_cache()


def fit_buffer_cache() -> int:
    """Keep as much of freed buffers as the arrays alive now (the loaded weights, between jobs), and at least
    :data:`CACHE_FLOOR_BYTES`. Up to the memory limit, a busy batch's cache also kept every size its KV caches
    grew through, never used again: 1.7 GB beside an 80M model's 350 MB at 32 streams, for the same tokens/s."""
    import mlx.core as mx

    limit = min(int(mx.get_memory_limit()), max(CACHE_FLOOR_BYTES, int(mx.get_active_memory())))
    mx.set_cache_limit(limit)
    return limit


def _malloc_trim() -> Callable[[], int] | None:
    """glibc's ``malloc_trim(0)``, or ``None`` where the C library has none (macOS, musl)."""
    try:
        trim = ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError):
        return None
    trim.argtypes = [ctypes.c_size_t]
    trim.restype = ctypes.c_int
    return lambda: int(trim(0))


_TRIM = _malloc_trim()


def resident_bytes() -> int:
    """The process's resident set (0 where ``/proc`` has none)."""
    try:
        with open("/proc/self/statm", "rb") as statm:
            return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


def trim_heap() -> bool:
    """Give the C heap's free pages back to the system: every glibc arena's, not only the top of each (what
    ``free`` does by itself). MLX's CPU buffers are ``malloc`` blocks; a large one is first mapped on its own and
    unmapped when freed, but each such free raises glibc's mapping threshold (up to 32 MiB), and from then on
    blocks that size come from the heaps, whose freed pages stay resident until trimmed. It walks the heaps
    and holds each arena's lock meanwhile, and the kernel's unmapping is most of its time: 0.36-0.61 s for
    3.4 GB given back (two cores under load), under a millisecond when there is nothing to give back. So the
    device thread calls it only once it has idled. False where the C library has no ``malloc_trim``."""
    if _TRIM is None:
        return False
    _TRIM()
    return True


class DeviceThread:
    """Owns all MLX work for the process."""

    def __init__(self, name: str = "flow-device") -> None:
        self._jobs: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._steppers: list[Stepper] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self.lost: str | None = None  # why the thread is taken as held for good (see abandon)
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._started = False
        self.stream: Any = None  # the MLX stream, created on the device thread itself
        self.cores: CoreSharing | None = None  # BLAS threads against the event loop's load (runtime.blas_threads)
        self._worked = False  # a step or a job ran since the last idle release
        # Bytes of freed buffers MLX may keep, as last set here (0: not the CPU, MLX's own limit; on the CPU it
        # follows what is loaded, fitted after each job)
        self.cache_limit = 0
        self.releases = 0  # idle releases done
        self.last_release: dict[str, float | bool] = {}  # the last one's figures (for /stats)

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> None:
        with self._lock:
            if not self._started:
                self._started = True
                self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        self._stop.set()
        self._jobs.put(_WAKE)
        if self._started:
            self._thread.join(timeout)

    @property
    def is_current(self) -> bool:
        return threading.current_thread() is self._thread

    # ------------------------------------------------------------------ submission
    def submit(self, fn: Callable[[], T]) -> concurrent.futures.Future[T]:
        """Run ``fn`` on the device thread; thread-safe."""
        self.start()
        future: concurrent.futures.Future[T] = concurrent.futures.Future()
        if self.lost is not None:
            future.set_exception(DeviceLost(self.lost))
            return future
        self._jobs.put((fn, future))
        return future

    def abandon(self, reason: str) -> None:
        """From another thread: this thread is held for good. The jobs queued fail now, every stepper ends what
        it serves without this thread, and later jobs fail at once — so no request of any model on this device
        waits for it. Only a new process frees the thread (a lost group's restart re-executes the server)."""
        self.lost = reason
        error = DeviceLost(reason)
        while True:
            try:
                item = self._jobs.get_nowait()
            except queue.Empty:
                break
            if item is not _WAKE and item[1].set_running_or_notify_cancel():
                item[1].set_exception(error)
        with self._lock:
            steppers = list(self._steppers)
        for stepper in steppers:
            stepper.abandon(error)

    async def run(self, fn: Callable[[], T]) -> T:
        """Run ``fn`` on the device thread and wait for it from trio."""
        return await wait_future(self.submit(fn))

    def call(self, fn: Callable[[], T]) -> T:
        """Run ``fn`` on the device thread and block this (non-trio) thread for it."""
        if self.is_current:
            return fn()
        return self.submit(fn).result()

    def add_stepper(self, stepper: Stepper) -> None:
        with self._lock:
            self._steppers.append(stepper)
        self.wake()

    def remove_stepper(self, stepper: Stepper) -> None:
        with self._lock:
            if stepper in self._steppers:
                self._steppers.remove(stepper)

    def contended(self, stepper: Stepper) -> bool:
        """Another stepper has work (``stepper`` shares the device with it)."""
        with self._lock:
            others = [s for s in self._steppers if s is not stepper]
        return any(s.has_work() for s in others)

    def stats_json(self) -> dict[str, Any]:
        """The loop's BLAS threads against the event loop's load, and its idle releases (empty until the thread
        has started)."""
        if self.cores is None:
            return {}
        return {**self.cores.stats_json(), "idle_releases": self.releases, "last_idle_release": self.last_release,
                "buffer_cache_limit_mib": round(self.cache_limit / 2**20, 1)}

    def wake(self) -> None:
        """Make a blocked loop look at its steppers again."""
        self.start()
        self._jobs.put(_WAKE)

    # ------------------------------------------------------------------ the loop
    def _loop(self) -> None:
        import mlx.core as mx

        self.stream = mx.new_stream(mx.default_device())
        self.cache_limit = keep_buffers()
        cores = self.cores = CoreSharing.for_main_thread()
        with mx.stream(self.stream):
            while not self._stop.is_set():
                with self._lock:
                    busy = [s for s in self._steppers if s.has_work()]
                self._run_jobs(block=not busy)
                cores.update()
                if busy:
                    self._worked = True
                for stepper in busy:
                    try:
                        stepper.step()
                    except Exception:  # a stepper must fail its own sequences, not the thread
                        log.exception("device step failed")
        cores.restore()

    def _run_jobs(self, block: bool) -> None:
        if not block and self._jobs.empty():
            return  # between a busy loop's steps, most turns: no exception raised and caught to find that out
        try:
            item = self._jobs.get(block=block, timeout=IDLE_RELEASE_SECONDS if block else None)
        except queue.Empty:
            if not block:
                return
            if self._worked:
                self._release_memory()
            item = self._jobs.get()
        while True:
            if item is not _WAKE:
                self._worked = True
                fn, future = item
                if future.set_running_or_notify_cancel():
                    try:
                        future.set_result(fn())
                    except BaseException as exc:  # delivered to the waiter, never lost
                        future.set_exception(exc)
                    if self.cache_limit:  # the CPU: a job may have loaded or unloaded a model
                        self.cache_limit = fit_buffer_cache()
            try:
                item = self._jobs.get_nowait()
            except queue.Empty:
                return

    def _release_memory(self) -> None:
        """The device has idled (no stepper with work, no job for ``IDLE_RELEASE_SECONDS``) after working: hand
        MLX's cached buffers back to the system, then the C heap's free pages (:func:`trim_heap`). Never while
        busy; work that arrives while the cache is being released gets the device before the trim (the trim
        waits for the next idle spell)."""
        import mlx.core as mx

        self._worked = False
        started, before = time.perf_counter(), resident_bytes()
        cached = mx.get_cache_memory()
        if cached:
            mx.clear_cache()
        cleared = time.perf_counter()
        trimmed = False
        if self._jobs.empty():
            trimmed = trim_heap()
        else:
            self._worked = True
        after = resident_bytes()
        self.releases += 1
        self.last_release = {"cached_mib": round(cached / 2**20, 1), "rss_before_mib": round(before / 2**20, 1),
                             "rss_after_mib": round(after / 2**20, 1), "trimmed": trimmed,
                             "clear_ms": round(1000 * (cleared - started), 1),
                             "trim_ms": round(1000 * (time.perf_counter() - cleared), 1)}
        log.debug("device idle: released %.1f MB of cached buffers, %s the heap; RSS %.0f -> %.0f MB (%.0f + %.0f ms)",
                  cached / 2**20, "trimmed" if trimmed else "did not trim", before / 2**20, after / 2**20,
                  self.last_release["clear_ms"], self.last_release["trim_ms"])


async def wait_future(future: concurrent.futures.Future[T]) -> T:
    """Wait in trio for a future completed by another thread."""
    if not future.done():
        token = trio.lowlevel.current_trio_token()
        done = trio.Event()

        def _notify(_: concurrent.futures.Future[T]) -> None:
            try:
                token.run_sync_soon(done.set)
            except trio.RunFinishedError:
                pass

        future.add_done_callback(_notify)
        await done.wait()
    return future.result()


_shared: DeviceThread | None = None
_shared_lock = threading.Lock()


def shared_device() -> DeviceThread:
    """The process's device thread (there is exactly one)."""
    global _shared
    with _shared_lock:
        if _shared is None:
            _shared = DeviceThread()
        return _shared


J = TypeVar("J")


class JobQueue(Generic[J]):
    """What a stepper serving queued jobs shares (an embedder's requests, a sliced worker's calls): the queue and
    its lock, and closing — the jobs still queued fail with :meth:`closed_error` (each job has a ``future``)."""

    def __init__(self, device: DeviceThread) -> None:
        self.device = device
        self._jobs: deque[J] = deque()
        self._lock = threading.Lock()

    def has_work(self) -> bool:
        return bool(self._jobs)

    def closed_error(self) -> Exception:
        raise NotImplementedError

    def close(self) -> None:
        self.device.remove_stepper(self)  # type: ignore[arg-type]  # subclasses are steppers
        self.abandon(self.closed_error())

    def abandon(self, error: Exception) -> None:
        """Fail every queued job with ``error`` (the device thread will not run them)."""
        with self._lock:
            jobs, self._jobs = list(self._jobs), deque()
        for job in jobs:
            future: concurrent.futures.Future[Any] = job.future  # type: ignore[attr-defined]
            if not future.done():
                future.set_exception(error)
