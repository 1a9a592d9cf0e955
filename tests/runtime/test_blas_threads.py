"""BLAS threads follow the event loop's load: one fewer while it is busy, the default again once it is quiet."""

from __future__ import annotations

import time

import pytest

from runtime.blas_threads import WINDOW_SECONDS, BlasControl, CoreSharing, openblas_control
from runtime.device import DeviceThread


class FakeBlas:
    def __init__(self, threads: int) -> None:
        self.threads = threads
        self.calls: list[int] = []

    def control(self) -> BlasControl:
        def put(n: int) -> None:
            self.threads = n
            self.calls.append(n)
        return BlasControl(get=lambda: self.threads, set=put)


class Clocks:
    """The wall clock and the watched thread's CPU clock, moved by hand."""

    def __init__(self) -> None:
        self.wall = 0.0
        self.cpu = 0.0
        self.ended = False

    def loop_cpu(self) -> float:
        if self.ended:
            raise OSError("no such thread")
        return self.cpu

    def advance(self, seconds: float, share: float) -> None:
        self.wall += seconds
        self.cpu += seconds * share


def sharing(threads: int = 4) -> tuple[CoreSharing, FakeBlas, Clocks]:
    blas, clocks = FakeBlas(threads), Clocks()
    return CoreSharing(blas.control(), clocks.loop_cpu, clock=lambda: clocks.wall), blas, clocks


def test_a_busy_loop_gets_a_core_and_gives_it_back_when_quiet() -> None:
    cores, blas, clocks = sharing(4)
    clocks.advance(WINDOW_SECONDS, share=0.6)
    cores.update()
    assert blas.threads == 3 and cores.threads == 3
    clocks.advance(WINDOW_SECONDS, share=0.2)  # between the thresholds: stays reduced (no flapping)
    cores.update()
    assert blas.threads == 3
    clocks.advance(WINDOW_SECONDS, share=0.05)
    cores.update()
    assert blas.threads == 4
    clocks.advance(WINDOW_SECONDS, share=0.2)  # between the thresholds from the default: stays at the default
    cores.update()
    assert blas.calls == [3, 4] and cores.switches == 2


def test_the_share_is_measured_over_a_window_not_each_step() -> None:
    cores, blas, clocks = sharing(2)
    clocks.advance(WINDOW_SECONDS / 3, share=1.0)
    cores.update()
    assert blas.calls == []  # too short a time to judge
    clocks.advance(WINDOW_SECONDS, share=1.0)
    cores.update()
    assert blas.threads == 1


def test_nothing_changes_with_one_thread_no_blas_or_no_clock() -> None:
    one, blas, clocks = sharing(1)
    clocks.advance(1.0, share=1.0)
    one.update()
    assert not one.active and blas.calls == []
    assert not CoreSharing(None, Clocks().loop_cpu).active
    assert not CoreSharing(FakeBlas(4).control(), None).active


def test_the_default_comes_back_when_the_watched_thread_ends_or_the_device_stops() -> None:
    cores, blas, clocks = sharing(4)
    clocks.advance(WINDOW_SECONDS, share=0.9)
    cores.update()
    assert blas.threads == 3
    cores.restore()
    assert blas.threads == 4
    clocks.advance(WINDOW_SECONDS, share=0.9)
    cores.update()
    clocks.ended = True
    clocks.advance(WINDOW_SECONDS, share=0.0)
    cores.update()
    assert blas.threads == 4 and not cores.active


def test_the_device_thread_sets_openblas_from_the_main_threads_load() -> None:
    """Real OpenBLAS (preloaded by the test command where the machine has it), a real device thread, and this
    test's thread (pytest's main thread, as ``flow serve``'s event loop is) busy, then idle."""
    control = openblas_control()
    if control is None or control.get() < 2:
        pytest.skip("needs OpenBLAS with pthreads and two or more threads (the test command preloads it)")
    default = control.get()
    device = DeviceThread(name="test-device")
    device.start()
    try:
        # Until the loop has seen a busy window (4 windows on an idle machine; on a loaded one this thread may get
        # less than BUSY_SHARE of a core in some windows, and then, rightly, nothing changes in them).
        deadline = time.monotonic() + 60
        while not (device.cores is not None and device.cores.threads == default - 1 and control.get() == default - 1):
            assert time.monotonic() < deadline, "the busy main thread never took a BLAS thread from the device"
            sum(i * i for i in range(20_000))  # the main thread computes; the device loop turns between jobs
            device.call(lambda: None)
        deadline = time.monotonic() + 60
        while True:  # quiet: the first window may still hold some of the busy time
            time.sleep(2 * WINDOW_SECONDS)
            device.call(lambda: None)  # the loop looks at the load after each round of jobs: after this one
            if device.call(control.get) == default:
                break
            assert time.monotonic() < deadline, "the idle main thread never gave the BLAS thread back"
    finally:
        device.stop()
        control.set(default)


def test_the_setting_can_be_left_to_openblas(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FLOW_BLAS_FOLLOW_LOAD", "0")
    assert not CoreSharing.for_main_thread().active
