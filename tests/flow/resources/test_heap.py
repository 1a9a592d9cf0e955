"""The cycle collector and a long-running server: what is alive after a load is frozen; an unload or a stop gives
it back, so an unloaded model's cycles are still freed."""

from __future__ import annotations

import gc
import weakref
from collections.abc import Iterator

import pytest

from flow.resources import heap


class _Node:
    """An object in a reference cycle (a model's modules hold each other, as checkpointed blocks do)."""

    def __init__(self) -> None:
        self.me = self


@pytest.fixture(autouse=True)
def _unfrozen() -> Iterator[None]:
    yield
    gc.unfreeze()


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
