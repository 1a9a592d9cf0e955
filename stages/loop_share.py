"""A share of the event loop's time for work a stage may do on the loop rather than on a worker thread.

Short work (templating a one-line chat) costs less on the loop than a worker thread's round trip (~0.2 ms of CPU
and as much latency). But requests come in bursts — many become runnable in one turn of trio's scheduler, which
runs each of them before it looks at a timer — and the same short work for all of them at once would hold the
loop for tens of milliseconds. :class:`LoopShare` lets such work run on the loop only within a share of its time:
after inline work of *d* seconds, the next waits until *d* · (1 / share − 1) has passed (the rest of a burst goes
to worker threads).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager


class LoopShare:
    def __init__(self, share: float = 0.25) -> None:
        if not 0.0 < share <= 1.0:
            raise ValueError("a loop share is in (0, 1]")
        self.share = share
        self._free_at = 0.0  # time.perf_counter() from which inline work may run again

    def available(self) -> bool:
        return time.perf_counter() >= self._free_at

    @contextmanager
    def spending(self) -> Iterator[None]:
        """Around work done on the loop: what it took is paid back before the next may run there."""
        start = time.perf_counter()
        try:
            yield
        finally:
            end = time.perf_counter()
            self._free_at = end + (end - start) * (1.0 / self.share - 1.0)
