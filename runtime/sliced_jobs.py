"""Long model calls on the device thread in time slices, beside the engines' steps.

Some model work is one long call — an mlx-audio transcription, a vision tower over a large image — that the
device thread must not spend in one piece while chat streams wait. A :class:`SlicedWorker` is a stepper of the
device thread that runs each such call (a *job*) as a *greenlet* — a coroutine on the device thread's own
stack, so MLX's thread-local state is never crossed — and the model's passes (layers, decoder steps: modules
given :func:`with_checkpoint`) are *checkpoints* where the job gives the device back once its slice
(``slice_seconds``) is used up.

Fair sharing: while other steppers (a chat engine, an embedder) have work, jobs get at most ``share`` of the
device's time — after a slice of ``d`` seconds the worker waits ``d × (1 - share) / share`` seconds of others'
steps before its next slice. With nobody else waiting, slices follow each other back to back and a job runs at
the speed of a direct call. Several jobs take slices in turn.

A job cancelled while it waits or runs (its waiter left) is ended at its next checkpoint.
"""

from __future__ import annotations

import concurrent.futures
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from runtime.device import DeviceThread, JobQueue

T = TypeVar("T")
P = TypeVar("P")


class JobCancelled(Exception):
    """Raised inside a job's greenlet at its next checkpoint once its future is cancelled."""


class WorkerClosed(Exception):
    """The model was unloaded while the job waited."""


@dataclass(eq=False)  # a job is itself: queued and dropped by identity
class _Job(Generic[T]):
    fn: Callable[[], T]
    future: concurrent.futures.Future[T]
    greenlet: Any = None
    cancelled: bool = False  # its waiter left: it ends at its next checkpoint

    @property
    def abandoned(self) -> bool:
        return self.cancelled or self.future.cancelled()


class SlicedWorker(JobQueue[_Job[Any]]):
    """Runs jobs on the device thread in time slices (see the module docstring); ``what`` names its model's kind
    in messages."""

    def __init__(self, device: DeviceThread, share: float = 0.2, what: str = "audio",
                 slice_seconds: float = 0.05) -> None:
        super().__init__(device)
        self.what = what
        self.share = share
        self.slice_seconds = slice_seconds
        self._slice_ends = 0.0
        self._resume_at = 0.0
        self.jobs_done = 0
        self.jobs_cancelled = 0
        self.device_seconds = 0.0
        self.yields = 0
        self.batch_passes = 0  # passes of a job serving several requests at once (a speech batch's steps)
        self.shared_passes = 0  # … of them holding more than one request
        self.most_requests_in_a_pass = 0
        device.add_stepper(self)

    def submit(self, fn: Callable[[], T]) -> concurrent.futures.Future[T]:
        """Run ``fn`` as a job on the device thread; thread-safe."""
        future: concurrent.futures.Future[T] = concurrent.futures.Future()
        with self._lock:
            self._jobs.append(_Job(fn, future))
        self.device.wake()
        return future

    def cancel(self, future: concurrent.futures.Future[Any]) -> None:
        """The waiter of ``future`` left: its job ends at its next checkpoint (or never starts)."""
        future.cancel()  # a job not started yet
        with self._lock:
            for job in self._jobs:
                if job.future is future:
                    job.cancelled = True

    def checkpoint(self) -> None:
        """Called from the model's passes inside a job: give the device back once the slice is used up."""
        import greenlet

        current = greenlet.getcurrent()
        job = getattr(current, "flow_job", None)
        if job is None:
            return  # a direct call outside the worker (a test's reference run)
        if job.abandoned:
            raise JobCancelled
        if time.perf_counter() >= self._slice_ends:
            self.yields += 1
            current.parent.switch()
            if job.abandoned:
                raise JobCancelled

    def count_pass(self, requests: int) -> None:
        """A job serving several requests (a batch) runs one pass holding ``requests`` of them."""
        self.batch_passes += 1
        self.shared_passes += requests > 1
        self.most_requests_in_a_pass = max(self.most_requests_in_a_pass, requests)

    def step(self) -> None:
        import greenlet

        if time.monotonic() < self._resume_at and self.device.contended(self):
            time.sleep(0.0005)  # others' turn: the loop runs their steps meanwhile
            return
        with self._lock:
            if not self._jobs:
                return
            job = self._jobs[0]  # it stays queued while it runs: has_work() says so
        if job.greenlet is None:
            if not job.future.set_running_or_notify_cancel():
                self._drop(job)
                return
            job.greenlet = greenlet.greenlet(lambda: self._run(job))
            job.greenlet.flow_job = job
        started = time.perf_counter()
        self._slice_ends = started + self.slice_seconds
        job.greenlet.switch()
        spent = time.perf_counter() - started
        self.device_seconds += spent
        self._resume_at = time.monotonic() + spent * (1 - self.share) / self.share
        if job.greenlet.dead:
            if job.abandoned:
                self.jobs_cancelled += 1
            else:
                self.jobs_done += 1
            self._drop(job)
        else:
            with self._lock:
                if self._jobs and self._jobs[0] is job:
                    self._jobs.rotate(-1)  # the next job's turn

    def _drop(self, job: _Job[Any]) -> None:
        with self._lock:
            if job in self._jobs:
                self._jobs.remove(job)

    @staticmethod
    def _run(job: _Job[Any]) -> None:
        try:
            result = job.fn()
        except JobCancelled as cancelled:
            if not job.future.done():
                job.future.set_exception(cancelled)
            return
        except BaseException as exc:  # delivered to the waiter; the device thread goes on
            if not job.future.cancelled():
                job.future.set_exception(exc)
            return
        if not job.future.cancelled():
            job.future.set_result(result)

    def closed_error(self) -> Exception:
        return WorkerClosed(f"the {self.what} model was unloaded")

    def stats_json(self) -> dict[str, Any]:
        return {"jobs_done": self.jobs_done, "jobs_cancelled": self.jobs_cancelled, "waiting_jobs": len(self._jobs),
                "device_seconds": round(self.device_seconds, 3), "yields": self.yields, "share": self.share,
                "batch_passes": self.batch_passes, "shared_passes": self.shared_passes,
                "most_requests_in_a_pass": self.most_requests_in_a_pass}


async def run_reporting(worker: SlicedWorker, job: Callable[[Callable[[P], None]], T],
                        deliver: Callable[[P], Awaitable[None]]) -> T:
    """Run ``job(report)`` as a job of ``worker`` and wait for its result in trio. What the job reports on the
    device thread (a transcript's finished segments, a sentence's speech) is handed to ``deliver`` in trio, in
    order, all of it before the result returns. Cancelling the wait (the client left) ends the job at its next
    checkpoint."""
    return await wait_reporting(lambda report: worker.submit(lambda: job(report)), worker.cancel, deliver)


async def wait_reporting(start: Callable[[Callable[[P], None]], concurrent.futures.Future[T]],
                         cancel: Callable[[concurrent.futures.Future[T]], None],
                         deliver: Callable[[P], Awaitable[None]]) -> T:
    """Start work on the device thread with ``start(report)`` (a future of its result) and wait for it in trio,
    handing what it reports to ``deliver`` as :func:`run_reporting` does; ``cancel(future)`` if the wait is
    cancelled."""
    import math

    import trio

    from runtime.device import wait_future

    send, receive = trio.open_memory_channel[P](math.inf)
    token = trio.lowlevel.current_trio_token()

    def push(item: P) -> None:
        try:
            send.send_nowait(item)
        except (trio.ClosedResourceError, trio.BrokenResourceError):
            pass  # the request is over

    def report(item: P) -> None:  # on the device thread
        try:
            token.run_sync_soon(push, item)
        except trio.RunFinishedError:
            pass

    future = start(report)
    async with trio.open_nursery() as nursery:
        async def forward() -> None:
            async for item in receive:
                await deliver(item)

        nursery.start_soon(forward)
        try:
            return await wait_future(future)
        except trio.Cancelled:
            cancel(future)
            raise
        finally:
            send.close()  # reports made before the result came first: run_sync_soon keeps their order


def with_checkpoint(module: Any, checkpoint: Callable[[], None], evaluate: bool | Callable[[], bool] = False) -> None:
    """Make every call of ``module`` (an mlx ``nn.Module``) pass ``checkpoint`` first: its class is swapped for
    a subclass of it (this one instance only; the parameter tree stays the checkpoint's). ``evaluate`` (or, when
    a function, whenever it says so): compute its output at once (MLX is lazy: without it, a chain of such
    modules is computed in one piece at the end, which no checkpoint can divide)."""
    base = type(module)

    def __call__(self: Any, *args: Any, **kwargs: Any) -> Any:
        checkpoint()
        out = base.__call__(self, *args, **kwargs)
        if evaluate is True or (callable(evaluate) and evaluate()):
            import mlx.core as mx

            mx.eval(out[0] if isinstance(out, tuple) else out)
        return out

    module.__class__ = type(f"Checkpointed{base.__name__}", (base,), {"__call__": __call__})


def repeated_blocks(model: Any) -> list[Any]:
    """A model's repeated blocks: its longest list of modules, however deep (a BERT encoder's ``encoder.layer``,
    a decoder's ``model.layers``); none if it has no list of two or more."""
    from mlx.nn.layers.base import Module

    best: list[Any] = []

    def walk(value: Any) -> None:
        nonlocal best
        if isinstance(value, Module):
            for child in value.values():  # its parameters and sub-modules
                walk(child)
        elif isinstance(value, (list, tuple, dict)):
            items = list(value.values() if isinstance(value, dict) else value)
            if isinstance(value, list) and len(items) > max(1, len(best)) and all(isinstance(i, Module) for i in items):
                best = items
            for item in items:
                walk(item)

    walk(model)
    return best


def checkpoint_children(module: Any, checkpoint: Callable[[], None], depth: int,
                        evaluate: bool | Callable[[], bool] = False) -> None:
    """Checkpoints on ``module``'s sub-modules down to ``depth`` levels (a text-to-speech model's language model
    calls its embedding once per generated token; its decoder once per sentence); ``evaluate`` as
    :func:`with_checkpoint` takes it."""
    from mlx.nn.layers.base import Module

    for child in module.children().values():
        if issubclass(type(child), Module):  # not a module compiled by mx.compile (it passes isinstance)
            with_checkpoint(child, checkpoint, evaluate)
            if depth > 1:
                checkpoint_children(child, checkpoint, depth - 1, evaluate)
