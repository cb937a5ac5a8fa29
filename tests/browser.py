"""Chromium with the network cut off, for the tests that open the book's pages.

Debian's ``chromium`` (installed by the Makefile when missing) driven by the ``playwright``
client from PyPI, pointed at that binary: ``playwright install`` would download a browser of
its own, which a fresh machine must not need. Every request that is not a ``file:`` or
``data:`` URL is refused and recorded, so a test can say that a page loads nothing from a
network and still works.
"""

from __future__ import annotations

import os
import re
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest

LOCAL = ("file:", "data:", "about:", "blob:")
LOADS = re.compile(r'<(?:script|link|img|iframe|source|video|audio)\b[^>]*?\b(?:src|href)='
                   r'"((?:https?:)?//[^"]+)"')


def network_loads(html: str) -> list[str]:
    """What a page's HTML would fetch from a network when opened (links to click excluded)."""
    return LOADS.findall(html)


def chromium_path() -> str | None:
    return os.environ.get("MINISRV_CHROMIUM") or shutil.which("chromium") or shutil.which(
        "chromium-browser")


@contextmanager
def offline_page() -> Iterator[tuple[Any, list[str]]]:
    """A fresh page of headless Chromium and the list of network requests it tried (each
    refused). Skips where no Chromium is installed (``make test`` installs one as root)."""
    binary = chromium_path()
    if binary is None:
        pytest.skip("no chromium binary: apt-get install chromium (make test does, as root)")
    from playwright.sync_api import sync_playwright

    tried: list[str] = []

    def refuse(route: Any) -> None:
        url = route.request.url
        if url.startswith(LOCAL):
            route.continue_()
        else:
            tried.append(url)
            route.abort()

    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=binary, args=["--no-sandbox"])
        try:
            context = browser.new_context(offline=True)
            context.route("**/*", refuse)
            page = context.new_page()
            errors: list[str] = []
            page.on("pageerror", lambda e: errors.append(str(e)))
            page.errors = errors  # type: ignore[attr-defined]
            yield page, tried
        finally:
            browser.close()
