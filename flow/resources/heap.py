"""Python's cycle collector in a server that runs for weeks.

A full collection scans every object the collector tracks. With MLX, mlx-lm, transformers and a loaded model
that is tens of thousands of modules, functions and dicts, and a collection stops the event loop and the
device thread alike (they share the GIL): in the embeddings benchmark's server, ten full collections in a
minute, the later ones 112–148 ms each, more than a one-sentence request takes end to end. What a server holds
for its lifetime — imported modules, loaded models, their tokenizers and graphs — never becomes garbage, so once
a model has loaded, everything alive is moved out of the collector's view (``gc.freeze``) and later collections
scan only what requests made since. Unloading a model gives the frozen objects back first, so that the cycles
the unloaded model leaves are found and freed.

What requests make is still a lot while they run: at 256 streams ~80,000 objects (coroutines, cancel scopes,
channels, lanes), and a full collection of them holds the loop 20–45 ms, twice in every ~800 requests by
Python's default rule. Most of those objects die by reference count when their request ends; the cycles they
leave (tracebacks, a cancelled task's frames) are few. So once settled, full collections run on their own only
a tenth as often (:data:`BUSY_FULL_EVERY`), and :func:`collect_when_quiet` runs one whenever the server has
had no request in flight for a while: the collector's pause falls where nobody waits for it.
"""

from __future__ import annotations

import gc
import logging
import time
from collections.abc import Callable

import trio

log = logging.getLogger("flow.resources.heap")

DEFAULT_THRESHOLDS = gc.get_threshold()
# Collections of the middle generation between two full ones (Python's default: 10, and a full one also waits
# until the objects that survived into the oldest generation grew by a quarter since the last).
BUSY_FULL_EVERY = 100
QUIET_CHECK_SECONDS = 0.5  # a full collection when two checks this far apart saw no request in flight


def settle() -> None:
    """After a load: free what the load left behind, then freeze what is alive (long-lived from here on)."""
    started = time.perf_counter()
    gc.collect()
    gc.freeze()
    young, middle, _ = DEFAULT_THRESHOLDS
    gc.set_threshold(young, middle, BUSY_FULL_EVERY)
    log.debug("heap settled: %d objects frozen (%.0f ms)", gc.get_freeze_count(),
              1000 * (time.perf_counter() - started))


def release() -> None:
    """After an unload: unfreeze, collect the unloaded model's cycles, and freeze what is still alive."""
    gc.unfreeze()
    settle()


def thaw() -> None:
    """The server stops: give every frozen object back to the collector (an embedded server's process goes on,
    and the models it closed are garbage now)."""
    gc.unfreeze()
    gc.set_threshold(*DEFAULT_THRESHOLDS)


def full_collection_due() -> bool:
    """Whether anything reached the oldest generation since its last collection (a middle collection ran)."""
    return gc.get_count()[2] > 0


async def collect_when_quiet(requests: Callable[[], tuple[int, int]]) -> None:
    """Run a full collection whenever the server is quiet: ``requests()`` (in flight, started so far) showed
    none in flight and none started across a check. Runs until cancelled."""
    last: tuple[int, int] | None = None
    while True:
        await trio.sleep(QUIET_CHECK_SECONDS)
        now = requests()
        if now == last and now[0] == 0 and full_collection_due():
            started = time.perf_counter()
            found = gc.collect()
            log.debug("quiet: full collection, %d unreachable objects (%.1f ms)", found,
                      1000 * (time.perf_counter() - started))
        last = now
