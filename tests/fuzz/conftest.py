"""One ``flow serve`` child process for the whole fuzz run (restarted by the judge if a case kills it)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from hypothesis.configuration import set_hypothesis_home_dir

from tests.fuzz import FlowProcess


@pytest.fixture(scope="module", autouse=True)
def hypothesis_outside_the_repo(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """Hypothesis keeps caches in ./.hypothesis; the fuzz run writes nothing into the checkout."""
    set_hypothesis_home_dir(tmp_path_factory.mktemp("hypothesis"))
    try:
        yield
    finally:
        set_hypothesis_home_dir(None)


@pytest.fixture(scope="session")
def fuzz_server(tiny_qwen3: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[FlowProcess]:
    server = FlowProcess(tmp_path_factory.mktemp("fuzz"), tiny_qwen3)
    try:
        yield server
    finally:
        server.close()


@pytest.fixture(scope="session")
def fuzz_client() -> Iterator[httpx.Client]:
    with httpx.Client() as client:
        yield client
