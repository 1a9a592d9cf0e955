"""A share of the event loop's time for inline work (stages/loop_share.py)."""

from __future__ import annotations

import time

import pytest

from stages.loop_share import LoopShare


def test_inline_work_is_paid_back_before_more_may_run_on_the_loop() -> None:
    share = LoopShare(0.25)
    assert share.available()
    with share.spending():
        time.sleep(0.02)  # 20 ms on the loop: the next inline work waits 60 ms more
    assert not share.available()
    time.sleep(0.1)
    assert share.available()


def test_work_that_raises_is_paid_back_too() -> None:
    share = LoopShare(0.5)
    with pytest.raises(ValueError), share.spending():
        time.sleep(0.02)
        raise ValueError("the work failed")
    assert not share.available()


def test_a_share_is_a_fraction() -> None:
    with pytest.raises(ValueError):
        LoopShare(0.0)
