"""``flow.serve.stats_feed``: what changed between two readings, and the feed's events (the route itself, over a real
server: test_console.py)."""

from __future__ import annotations

import json
from typing import Any

import pytest
import trio
from hypothesis import given
from hypothesis import strategies as st

from flow.serve.stats_feed import KEEPALIVE_SECONDS, FeedLimit, changes, parse_interval, stats_events
from protocols.errors import ApiError
from tests.harness import merged

SCALARS = st.one_of(st.none(), st.booleans(), st.integers(-5, 5), st.floats(-2, 2, allow_nan=False),
                    st.sampled_from(["a", "b", ""]))
VALUES = st.recursive(SCALARS, lambda inner: st.one_of(
    st.lists(inner, max_size=3), st.dictionaries(st.sampled_from("pqrs"), inner, max_size=3)), max_leaves=12)
READINGS = st.dictionaries(st.sampled_from("abcde"), VALUES, max_size=5)


@given(READINGS, READINGS)
def test_merging_the_change_gives_the_new_reading(before: dict[str, Any], after: dict[str, Any]) -> None:
    change = changes(before, after)
    if change is None:  # only when something of the old reading is gone, at any depth
        assert _keys(before) - _keys(after)
        return
    assert merged(before, change) == after
    assert json.dumps(merged(before, change), sort_keys=True) == json.dumps(after, sort_keys=True)  # 1 vs 1.0
    if before == after and json.dumps(before) == json.dumps(after):
        assert change == {}


def _keys(reading: Any, prefix: str = "") -> set[str]:
    """Every key path of the nested objects in ``reading`` (where both sides hold an object)."""
    if not isinstance(reading, dict):
        return set()
    return {p for k, v in reading.items() for p in {prefix + "/" + k} | _keys(v, prefix + "/" + k)}


def test_a_change_holds_only_what_changed() -> None:
    before = {"uptime": 1.0, "requests": {"total": 3, "failed": 0}, "recent": [1, 2], "loaded": None}
    after = {"uptime": 2.0, "requests": {"total": 4, "failed": 0}, "recent": [1, 2], "loaded": None}
    assert changes(before, after) == {"uptime": 2.0, "requests": {"total": 4}}
    # null is a value like any (merging cannot delete); a list is replaced whole; a key that is gone: None
    assert changes(before, {**after, "loaded": 5, "recent": [2]}) == {
        "uptime": 2.0, "requests": {"total": 4}, "loaded": 5, "recent": [2]}
    assert changes({**before, "loaded": 5}, before) == {"loaded": None}
    assert changes(before, {k: v for k, v in before.items() if k != "recent"}) is None
    assert changes(before, {**before, "requests": {"total": 3}}) is None
    assert changes({"x": 1}, {"x": True}) == {"x": True}  # equal in Python, not in JSON
    assert changes({"c": [False, [False]]}, {"c": [False, [0]]}) == {"c": [False, [0]]}  # inside lists too


@pytest.mark.parametrize(("raw", "value"), [(None, 1.0), ("0.2", 0.2), ("2.5", 2.5), ("60", 60.0)])
def test_the_interval_is_read_from_the_query(raw: str | None, value: float) -> None:
    assert parse_interval({} if raw is None else {"interval": raw}) == value


@pytest.mark.parametrize("raw", ["0", "0.1", "61", "nan", "inf", "-1", "fast", ""])
def test_a_bad_interval_is_refused_naming_the_range(raw: str) -> None:
    with pytest.raises(ApiError) as refused:
        parse_interval({"interval": raw})
    assert refused.value.status == 400 and refused.value.param == "interval"
    assert "from 0.2 to 60" in refused.value.message


async def test_the_feed_sends_a_reading_then_changes_then_keepalives_and_ends_on_stop(
        autojump_clock: trio.testing.MockClock) -> None:
    readings = iter([
        {"t": 1, "models": {"a": {"state": "ready"}}, "pair": (1, 2)},
        {"t": 2, "models": {"a": {"state": "ready"}}, "pair": (1, 2)},  # a tuple equals the list sent before
        {"models": {"a": {"state": "ready"}}, "pair": [1, 2]},  # "t" is gone: a whole reading
    ])
    last: dict[str, Any] = {"models": {}, "pair": [1, 2]}

    def read() -> dict[str, Any]:
        return next(readings, last)

    stop = trio.Event()
    frames: list[bytes] = []
    interval = 0.2
    quiet_readings = int(KEEPALIVE_SECONDS / interval) + 2

    async def collect() -> None:
        async for frame in stats_events(read, interval, stop):
            frames.append(frame)

    with trio.fail_after(60):  # mock seconds: a feed that never ends fails instead
        async with trio.open_nursery() as nursery:
            nursery.start_soon(collect)
            await trio.sleep(interval * (4 + quiet_readings))  # the autojump clock makes this instant
            stop.set()
    assert stop.is_set() and frames[0] == b"retry: 2000\n\n"
    events = [f.decode() for f in frames[1:]]
    assert events[0] == 'event: stats\ndata: {"t":1,"models":{"a":{"state":"ready"}},"pair":[1,2]}\n\n'
    assert events[1] == 'event: change\ndata: {"t":2}\n\n'
    assert events[2] == 'event: stats\ndata: {"models":{"a":{"state":"ready"}},"pair":[1,2]}\n\n'
    assert events[3] == 'event: stats\ndata: {"models":{},"pair":[1,2]}\n\n'  # "a" is gone
    assert events[4:] and set(events[4:]) == {": keepalive\n\n"}  # nothing changed since


async def test_a_feed_counts_while_it_runs_and_the_limit_refuses_one_more() -> None:
    limit = FeedLimit(2)
    stop = trio.Event()
    feeds = [stats_events(lambda: {"t": 1}, 1.0, stop, limit) for _ in range(3)]
    assert limit.open == 0  # a response whose body never began holds nothing
    for feed in feeds[:2]:
        assert await feed.__anext__() == b"retry: 2000\n\n"
    with pytest.raises(ApiError) as refused:
        limit.check()
    assert refused.value.status == 429 and "2 /stats/events feeds are open" in refused.value.message
    await feeds[0].aclose()  # the client left
    assert limit.open == 1
    limit.check()
    stop.set()
    assert [frame async for frame in feeds[1]] == []  # ends at the stop
    assert limit.open == 0
    await feeds[2].aclose()  # never began: nothing to leave
    assert limit.open == 0
