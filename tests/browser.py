"""Headless Chromium for the UI tests (the Prefect UI, the MLflow UI), and the screenshots docs/ shows.

The distribution's binary (`apt-get install -y chromium`) is driven by Playwright, which downloads no browser.
With RLFLOW_SCREENSHOTS set to a folder, the tests save what they checked there: `python -m
bench.figures.ui_screenshot` runs them that way to refresh the PNGs of docs/operations.md.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
NO_CHROMIUM = "no chromium binary: apt-get install -y chromium (.ci/run installs it when it runs as root)"


def need_chromium() -> str:
    """The binary, or the test skips saying how to get it (CI, as root, installs it)."""
    if CHROMIUM is None:
        pytest.skip(NO_CHROMIUM)
    return CHROMIUM


@contextmanager
def browser_page(width: int = 1400, height: int = 900) -> Iterator:
    """A Playwright page in a fresh headless Chromium, closed on the way out."""
    from playwright.sync_api import sync_playwright  # only the browser tests need it

    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=need_chromium(), args=["--no-sandbox", "--disable-gpu"])
        try:
            yield browser.new_page(viewport={"width": width, "height": height})
        finally:
            browser.close()


def screenshot(page, name: str, full_page: bool = False) -> None:
    """Save the page as RLFLOW_SCREENSHOTS/name where that is set (docs/ keeps them); else nothing."""
    folder = os.environ.get("RLFLOW_SCREENSHOTS")
    if folder:
        Path(folder).mkdir(parents=True, exist_ok=True)
        page.screenshot(path=str(Path(folder) / name), full_page=full_page)
