"""Shared fixtures: tiny locally built models and servers running them."""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

if os.environ.get("FLOW_REAL_MODELS") != "hub":  # the real tier's hub mode (tests/real/conftest.py) may
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # reach the hub; no other test ever does
# Tests never read or write the developer's own capability store.
os.environ["FLOW_DATA_DIR"] = tempfile.mkdtemp(prefix="flow-test-data-")

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
