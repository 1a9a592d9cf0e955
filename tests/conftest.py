"""Shared fixtures: tiny locally built models and servers running them."""

from __future__ import annotations

import logging
import os
import shutil
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

if os.environ.get("FLOW_REAL_MODELS") != "hub":  # the real tier's hub mode (tests/real/conftest.py) may
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # reach the hub; no other test ever does
# Tests never read or write the developer's own capability store (removed at the end: see pytest_unconfigure).
TEST_DATA_DIR = os.environ["FLOW_DATA_DIR"] = tempfile.mkdtemp(prefix="flow-test-data-")

from runtime.tiny import ensure_tiny_model  # noqa: E402
from tests.harness import RunningServer, graph_with_model, running_server  # noqa: E402


@pytest.fixture(scope="session")
def tiny_qwen3() -> Path:
    return ensure_tiny_model("tiny-qwen3")


@pytest.fixture(scope="session")
def tiny_llama() -> Path:
    return ensure_tiny_model("tiny-llama")


@pytest.fixture(scope="session")
def qwen3_server(tiny_qwen3: Path) -> Iterator[RunningServer]:
    with running_server(graph_with_model(tiny_qwen3)) as server:
        yield server


@pytest.fixture(scope="session")
def llama_server(tiny_llama: Path) -> Iterator[RunningServer]:
    with running_server(graph_with_model(tiny_llama, name="tiny-llama")) as server:
        yield server


_exit_status = 0


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    global _exit_status
    _exit_status = int(exitstatus)


@pytest.hookimpl(trylast=True)
def pytest_unconfigure(config: pytest.Config) -> None:
    """The test process ends without the interpreter's teardown, as ``flow`` does (``flow.cli.main.run``): the
    threads that ran MLX (the embedded servers' device threads) keep thread-local MLX state whose teardown can
    abort a finished run ("terminate called without an active exception", exit 134 after every test passed).
    By now every fixture is closed and the summary printed; only that teardown is skipped (the data directory this
    process made goes first: no atexit hook runs after os._exit)."""
    shutil.rmtree(TEST_DATA_DIR, ignore_errors=True)
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(_exit_status)

