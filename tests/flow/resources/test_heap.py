"""The cycle collector and a long-running server: what is alive after a load is frozen; an unload or a stop gives
it back, so an unloaded model's cycles are still freed."""

from __future__ import annotations

import gc
import weakref
from collections.abc import Callable, Iterator

import pytest
import trio
import trio.testing

from flow.resources import heap


class _Node:
    """An object in a reference cycle (a model's modules hold each other, as checkpointed blocks do)."""

    def __init__(self) -> None:
        self.me = self


@pytest.fixture(autouse=True)
def _unfrozen() -> Iterator[None]:
    yield
    gc.unfreeze()
    gc.set_threshold(*heap.DEFAULT_THRESHOLDS)


def test_what_a_load_leaves_alive_is_out_of_the_collectors_scans() -> None:
    alive = _Node()
    heap.settle()
    assert gc.get_freeze_count() > 0
    assert not any(o is alive for generation in range(3) for o in gc.get_objects(generation))


def test_an_unloaded_models_cycles_are_freed() -> None:
    model = _Node()
    gone = weakref.ref(model)
    heap.settle()  # loaded: frozen
    del model  # unloaded: garbage, but frozen garbage is never collected
    gc.collect()
    assert gone() is not None
    heap.release()
    assert gone() is None


def test_a_stopped_servers_models_go_back_to_the_collector() -> None:
    model = _Node()
    gone = weakref.ref(model)
    heap.settle()
    del model
    heap.thaw()
    gc.collect()
    assert gone() is None and gc.get_freeze_count() == 0


def test_once_settled_full_collections_run_a_tenth_as_often_and_a_stop_restores_the_default() -> None:
    heap.settle()
    assert gc.get_threshold()[2] == heap.BUSY_FULL_EVERY
    heap.thaw()
    assert gc.get_threshold() == heap.DEFAULT_THRESHOLDS


def _full_collections() -> tuple[list[int], Callable[[str, dict[str, int]], None]]:
    seen: list[int] = []

    def callback(phase: str, info: dict[str, int]) -> None:
        if phase == "stop" and info["generation"] == 2:
            seen.append(info["collected"])

    return seen, callback


def test_a_full_collection_runs_when_no_request_is_in_flight() -> None:
    """Quiet (none in flight, none started across a check): one full collection, which frees a request's cycle;
    busy, or requests arriving between checks: none."""
    requests = [1, 10]  # in flight, started so far
    seen, callback = _full_collections()

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(heap.collect_when_quiet, lambda: (requests[0], requests[1]))
            for _ in range(6):  # busy
                _ = gc.collect(1), [[] for _ in range(1000)]  # objects reach the oldest generation
                await trio.sleep(heap.QUIET_CHECK_SECONDS)
            assert seen == []
            requests[0] = 0
            for _ in range(8):  # none in flight at each check, but new ones started in between
                requests[1] += 1
                await trio.sleep(heap.QUIET_CHECK_SECONDS / 2)
            assert seen == []
            leftover = _Node()  # a finished request's cycle
            gone = weakref.ref(leftover)
            del leftover
            gc.collect(1)
            await trio.sleep(3 * heap.QUIET_CHECK_SECONDS)  # quiet
            assert len(seen) == 1 and gone() is None
            await trio.sleep(4 * heap.QUIET_CHECK_SECONDS)  # still quiet, nothing new: no collection again
            assert len(seen) == 1
            nursery.cancel_scope.cancel()

    heap.settle()  # as a server is once its model loaded: full collections on their own are rare
    gc.callbacks.append(callback)
    # Only explicit collections (the test's, the watcher's): an automatic one set off by another thread of this
    # worker process (a server another test left shutting down) is no full collection of the watcher's.
    enabled = gc.isenabled()
    gc.disable()
    try:
        trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))
    finally:
        if enabled:
            gc.enable()
        gc.callbacks.remove(callback)
