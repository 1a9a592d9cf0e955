"""Headless Chromium for the console's tests and benchmark: the system's browser (Debian package
``chromium``) driven by Playwright for Python; no browser is downloaded."""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any


def chromium_path() -> str | None:
    """The system Chromium: ``$FLOW_CHROMIUM``, else ``chromium`` or ``chromium-browser`` on PATH."""
    return os.environ.get("FLOW_CHROMIUM") or shutil.which("chromium") or shutil.which("chromium-browser")


@contextmanager
def headless_chromium(executable: str) -> Iterator[Any]:
    """A Playwright ``Browser`` on ``executable``, closed at the end."""
    from playwright.sync_api import sync_playwright

    # The process may preload OpenBLAS for MLX (flow.cli.blas); the browser and Playwright's driver must not
    # inherit it (node cannot start its threads with it).
    preload = os.environ.pop("LD_PRELOAD", None)
    try:
        manager = sync_playwright().start()
        browser = manager.chromium.launch(executable_path=executable, args=["--no-sandbox", "--disable-gpu"])
    finally:
        if preload is not None:
            os.environ["LD_PRELOAD"] = preload
    try:
        yield browser
    finally:
        browser.close()
        manager.stop()
