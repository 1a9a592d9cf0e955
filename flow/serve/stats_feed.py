"""``GET /stats/events``: the ``/stats`` figures as server-sent events, each reading sent as what changed.

A page that polls ``/stats`` pays for a whole HTTP request every second, on both sides: the server parses
it, routes it, guards it and answers it; the browser builds it, sends it through its network service and
loads the answer. On a machine that also decodes, that is CPU taken from the model. The feed is one
long request instead:

* ``event: stats`` — a whole reading (the ``/stats`` body): the first event, and again whenever something
  disappeared from the reading (a model unloaded, a reload replaced resources), so a client never has to
  delete anything;
* ``event: change`` — what changed since the last event: a JSON object to merge into the client's copy,
  objects recursively, anything else (numbers, strings, arrays, ``null``) replacing the value;
* nothing while nothing changed, and a comment line every ``KEEPALIVE_SECONDS`` so that proxies and
  clients see a live connection.

The interval is the query's ``interval`` (seconds, default 1). The feed ends when the server begins to stop.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from typing import Any

import orjson
import trio

from protocols.errors import ApiError
from protocols.sse import dumps, event_frame

DEFAULT_INTERVAL = 1.0
MIN_INTERVAL, MAX_INTERVAL = 0.2, 60.0
KEEPALIVE_SECONDS = 15.0
RETRY_MILLISECONDS = 2000  # what an EventSource waits before it reconnects
# Each open feed builds a reading every interval on the event loop: a client opening feeds by the hundred would
# take the loop from the requests. A console is one feed; a few dashboards more.
MAX_FEEDS = 16


class FeedLimit:
    """Counts the feeds running; :meth:`check` refuses a new one at ``limit`` with a 429 that says why. A feed
    counts from its first bytes to its end (a response whose body never began holds nothing)."""

    def __init__(self, limit: int = MAX_FEEDS) -> None:
        self.limit = limit
        self.open = 0

    def check(self) -> None:
        if self.open >= self.limit:
            raise ApiError("rate_limit", f"{self.open} /stats/events feeds are open, the most this server keeps; "
                           "close one, or read GET /stats.", retry_after=RETRY_MILLISECONDS / 1000)


def parse_interval(query: dict[str, str]) -> float:
    """The ``interval`` query parameter in seconds; a 400 naming the accepted range otherwise."""
    raw = query.get("interval")
    if raw is None:
        return DEFAULT_INTERVAL
    try:
        value = float(raw)
    except ValueError:
        value = float("nan")
    if not MIN_INTERVAL <= value <= MAX_INTERVAL:  # NaN fails too
        raise ApiError("invalid_request", f"interval must be a number of seconds from {MIN_INTERVAL:g} to "
                       f"{MAX_INTERVAL:g}; got {raw!r}.", param="interval")
    return value


def changes(before: dict[str, Any], after: dict[str, Any]) -> dict[str, Any] | None:
    """What to merge into ``before`` to make ``after`` (see the module's docstring), or None when a key of
    ``before`` is gone from ``after``: merging cannot delete, so the whole reading must go instead."""
    out: dict[str, Any] = {}
    for key, value in after.items():
        old = before.get(key, _MISSING)
        if isinstance(value, dict) and isinstance(old, dict):
            inner = changes(old, value)
            if inner is None:
                return None
            if inner:
                out[key] = inner
        elif old is _MISSING or not _same(old, value):
            out[key] = value
    if any(key not in after for key in before):
        return None
    return out


_MISSING = object()


def _same(a: Any, b: Any) -> bool:
    """Equal as JSON: of one type all the way down (Python has ``1 == 1.0 == True``, also inside lists)."""
    if type(a) is not type(b):
        return False
    if isinstance(a, list):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same(v, b[k]) for k, v in a.items())
    return bool(a == b)


async def stats_events(read: Callable[[], dict[str, Any]], interval: float, stop: trio.Event,
                       limit: FeedLimit | None = None) -> AsyncIterator[bytes]:
    """The feed's bytes: ``read()`` every ``interval`` seconds until ``stop`` is set, counted in ``limit`` while
    it runs, however it ends."""
    if limit is not None:
        limit.open += 1
    try:
        async for frame in _events(read, interval, stop):
            yield frame
    finally:
        if limit is not None:
            limit.open -= 1


async def _events(read: Callable[[], dict[str, Any]], interval: float, stop: trio.Event) -> AsyncIterator[bytes]:
    yield f"retry: {RETRY_MILLISECONDS}\n\n".encode()
    sent: dict[str, Any] | None = None
    quiet = 0.0  # seconds since the last bytes sent
    while not stop.is_set():
        # What the client holds is what it parsed: compare against the same JSON round trip (tuples become
        # lists, and a resource's stats dict the next reading mutates is not shared with this copy).
        reading = orjson.loads(dumps(read()))
        delta = None if sent is None else changes(sent, reading)
        if delta is None:
            yield event_frame("stats", reading)
            quiet = 0.0
        elif delta:
            yield event_frame("change", delta)
            quiet = 0.0
        elif quiet >= KEEPALIVE_SECONDS:
            yield b": keepalive\n\n"
            quiet = 0.0
        sent = reading
        with trio.move_on_after(interval):
            await stop.wait()
        quiet += interval
