"""``on_request_end``: what a stage holds for a request is released however the request ends."""

from __future__ import annotations

import pytest
import trio

from flow.graph.stage import on_request_end, request_lifetime


async def test_callbacks_run_last_first_also_from_worker_threads() -> None:
    ran: list[str] = []
    with request_lifetime():
        on_request_end(lambda: ran.append("first"))
        await trio.to_thread.run_sync(on_request_end, lambda: ran.append("from a thread"))
        on_request_end(lambda: ran.append("last"))
        assert ran == []
    assert ran == ["last", "from a thread", "first"]


async def test_failed_and_cancelled_requests_run_them_and_one_failure_skips_none() -> None:
    ran: list[str] = []

    def broken() -> None:
        raise RuntimeError("release failed")

    with pytest.raises(ValueError), request_lifetime():
        on_request_end(lambda: ran.append("failed request"))
        on_request_end(broken)
        raise ValueError("a stage failed")
    with trio.move_on_after(0.01), request_lifetime():
        on_request_end(lambda: ran.append("cancelled request"))
        await trio.sleep_forever()
    assert ran == ["failed request", "cancelled request"]


def test_outside_a_request_it_is_an_error() -> None:
    with pytest.raises(RuntimeError, match="running a request"):
        on_request_end(lambda: None)
