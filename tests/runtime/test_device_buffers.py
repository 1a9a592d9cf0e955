"""The device thread keeps MLX's freed buffers while it works and gives them back once it idles."""

from __future__ import annotations

import time

import mlx.core as mx
import pytest

import runtime.device
from runtime.device import DeviceThread, keep_buffers

MB = 2**20


def test_the_cpu_keeps_freed_buffers_up_to_what_is_loaded() -> None:
    """At least CACHE_FLOOR_BYTES (MLX's own CPU default would be 32 MB), as much as the arrays alive once more is
    loaded, and the limit follows an unload down: the device thread fits it after every job."""
    if mx.default_device().type != mx.DeviceType.cpu:
        pytest.skip("MLX's GPU backends keep their buffers already")
    floor = runtime.device.CACHE_FLOOR_BYTES
    assert floor > 32 * MB
    device = DeviceThread("test-cache-limit")

    def fitted() -> tuple[int, int]:
        """The limit the last job left, and what is alive (nothing ran on the device thread in between)."""
        return device.cache_limit, int(mx.get_active_memory())

    try:
        limit, alive = device.call(fitted)
        assert limit == max(floor, alive)
        weights: list[mx.array] = []

        def load() -> None:  # a model's weights: 640 MB, more than the floor
            weights.append(mx.ones((160 * MB,), dtype=mx.float32))
            mx.eval(weights[-1])

        device.call(load)
        loaded, alive = device.call(fitted)
        assert loaded == alive >= 640 * MB
        assert device.stats_json()["buffer_cache_limit_mib"] == round(loaded / MB, 1)
        device.call(weights.clear)  # unloaded
        limit, alive = device.call(fitted)
        assert limit == max(floor, alive) < loaded
        assert keep_buffers() == max(floor, int(mx.get_active_memory()))
    finally:
        device.stop()


def test_an_idle_device_releases_its_cached_buffers(monkeypatch: pytest.MonkeyPatch) -> None:
    if mx.default_device().type != mx.DeviceType.cpu:
        pytest.skip("the cache policy is the CPU's")
    monkeypatch.setattr(runtime.device, "IDLE_RELEASE_SECONDS", 0.3)
    device = DeviceThread("test-buffers")
    try:
        def allocate_and_free() -> int:
            # 48 MB in 12 MB buffers: more than MLX's default CPU cache of 32 MB holds
            arrays = [mx.ones((3 * MB,), dtype=mx.float32) for _ in range(4)]
            mx.eval(*arrays)
            del arrays
            return int(mx.get_cache_memory())

        kept = device.call(allocate_and_free)
        assert kept >= 48 * MB
        deadline = time.monotonic() + 10
        while mx.get_cache_memory() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert mx.get_cache_memory() == 0
        # and it still works after releasing: the next job allocates afresh
        assert device.call(lambda: mx.ones((4,)).sum().item()) == 4.0
    finally:
        device.stop()


class _Busy:
    """A stepper with work until ``stop``: each step allocates and frees MLX buffers, as a decode step does."""

    def __init__(self, device: DeviceThread) -> None:
        self.device = device
        self.stop = time.monotonic() + 1.5
        self.steps = 0
        self.releases_seen: set[int] = set()  # the device's release count, as each step saw it

    def has_work(self) -> bool:
        return time.monotonic() < self.stop

    def step(self) -> None:
        self.releases_seen.add(self.device.releases)
        mx.eval(mx.ones((MB,), dtype=mx.float32) * self.steps)
        self.steps += 1
        time.sleep(0.01)

    def abandon(self, error: Exception) -> None:
        pass


def test_memory_is_released_only_once_the_device_idles_and_only_after_work(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(runtime.device, "IDLE_RELEASE_SECONDS", 0.3)
    device = DeviceThread("test-idle-release")
    try:
        device.call(lambda: None)
        deadline = time.monotonic() + 10
        while device.releases < 1 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert device.releases == 1  # after the first job
        busy = _Busy(device)
        device.add_stepper(busy)
        while busy.has_work():
            time.sleep(0.05)
        # 1.5 s of steps, five times the idle delay: no release ran between them
        assert busy.steps > 20 and busy.releases_seen == {1}
        deadline = time.monotonic() + 10
        while device.releases < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert device.releases == 2
        assert runtime.device.trim_heap() == (device.last_release["trimmed"] is True)
        time.sleep(1.0)  # idle with nothing done since: no further release
        assert device.releases == 2
        stats = device.stats_json()
        assert stats["idle_releases"] == 2 and stats["last_idle_release"]["rss_after_mib"] > 0
    finally:
        device.stop()
