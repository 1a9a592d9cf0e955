"""Requests on their way to an engine: how an idle engine tells a lone request from the first of a burst.

A burst of requests (parallel sub-agents, a client's batch) reaches an idle engine one at a time: the event loop
reads, decodes, tokenizes and submits each in turn, and the device thread wakes at the first. Prefilled at once,
that first prompt takes a pass of its own — the model's whole fixed cost for one row — while the rest are still
being taken in (on two cores shared with OpenBLAS, 7–17 ms for eight on an 80M model), and the rows join the batch
a pass apart. The server knows more are coming: :data:`ARRIVING` counts the requests it has started that have
neither submitted a sequence to an engine nor sent their first frame (a request that does not generate, or fails
first, leaves the count with its answer). An idle engine with new prompts waits while that count is not zero, up
to :data:`GATHER_SECONDS` after the oldest of them arrived (``Engine._gather``): a lone request has left the count
by the time its own prompt waits, and never waits.

A request's place in the count travels with its task's context (:data:`CURRENT`; trio copies it into the tasks a
request starts), so the engine's submit takes it out without knowing the server. Written on the event loop's
thread, read on the device thread: one int, replaced whole. Never imports the engine.
"""

from __future__ import annotations

import time
from contextvars import ContextVar

GATHER_SECONDS = 0.02  # the most a new prompt waits for the rest of its burst
POLL_SECONDS = 0.0001


class Arrival:
    """One request's place in the count, given up once."""

    __slots__ = ("_arrivals", "done")

    def __init__(self, arrivals: Arrivals) -> None:
        self._arrivals = arrivals
        self.done = False

    def settle(self) -> None:
        if not self.done:
            self.done = True
            self._arrivals.count -= 1


class Arrivals:
    """Requests a server has started that neither submitted a sequence nor sent their first frame."""

    def __init__(self) -> None:
        self.count = 0

    def started(self) -> Arrival:
        self.count += 1
        return Arrival(self)

    def wait(self, oldest: float) -> None:
        """On the device thread: sleep while requests are on their way, until :data:`GATHER_SECONDS` after
        ``oldest`` (the oldest new prompt's submit time, ``time.perf_counter``)."""
        deadline = oldest + GATHER_SECONDS
        while self.count and time.perf_counter() < deadline:
            time.sleep(POLL_SECONDS)


ARRIVING = Arrivals()  # the process's: its server's requests, whichever model they go to
CURRENT: ContextVar[Arrival | None] = ContextVar("flow_arrival", default=None)  # the running request's place


def submitted() -> None:
    """The running request has submitted its sequences (called by the engine's submit, in the request's task)."""
    arrival = CURRENT.get()
    if arrival is not None:
        arrival.settle()
