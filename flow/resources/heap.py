"""Python's cycle collector in a server that runs for weeks.

A full collection scans every object the collector tracks. With MLX, mlx-lm, transformers and a loaded model
that is tens of thousands of modules, functions and dicts, and a collection stops the event loop and the
device thread alike (they share the GIL): in the embeddings benchmark's server, ten full collections in a
minute, the later ones 112–148 ms each, more than a one-sentence request takes end to end. What a server holds
for its lifetime — imported modules, loaded models, their tokenizers and graphs — never becomes garbage, so once
a model has loaded, everything alive is moved out of the collector's view (``gc.freeze``) and later collections
scan only what requests made since. Unloading a model gives the frozen objects back first, so that the cycles
the unloaded model leaves are found and freed.
"""

from __future__ import annotations

import gc
import logging
import time

log = logging.getLogger("flow.resources.heap")


def settle() -> None:
    """After a load: free what the load left behind, then freeze what is alive (long-lived from here on)."""
    started = time.perf_counter()
    gc.collect()
    gc.freeze()
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
