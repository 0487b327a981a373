"""Fixtures of the browser tests: Debian's Chromium driven by Playwright, against the real stack.

Chromium is found at ``$CHROMIUM_PATH`` or ``/usr/bin/chromium``. Without it the browser tests skip
with the reason, except under CI (``CI=true``), where a missing browser is a failure.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.controlplane.fixtures import redis_cache  # noqa: F401 - a fixture, found by name

from .stack import PASSWORD, REPO, Stack

SCREENSHOTS = REPO / "artifacts" / "screenshots"
LAUNCH_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
               "--disable-background-networking", "--disable-component-update", "--disable-sync"]
VIEWPORT = {"width": 1440, "height": 900}  # a laptop screen


def chromium_path() -> str | None:
    for candidate in (os.environ.get("CHROMIUM_PATH"), "/usr/bin/chromium", shutil.which("chromium")):
        if candidate and Path(candidate).is_file():
            return candidate
    return None


@pytest.fixture(scope="module")
def chromium() -> str:
    path = chromium_path()
    if path is None:
        reason = "no Chromium at $CHROMIUM_PATH or /usr/bin/chromium (install Debian's 'chromium')"
        if os.environ.get("CI") == "true":
            pytest.fail(f"CI=true and {reason}")
        pytest.skip(reason)
    return path


@pytest.fixture(scope="module")
def stack(chromium, redis_url, tmp_path_factory) -> Iterator[Stack]:
    """Control plane + two small-model workers + steady traffic, for every test of the module."""
    running = Stack(redis_url, tmp_path_factory.mktemp("frontend-stack"))
    try:
        yield running.start()
    finally:
        running.stop()


@pytest.fixture(scope="module")
def browser(chromium):
    from playwright.sync_api import sync_playwright

    with sync_playwright() as playwright:
        # Playwright gives every launch a fresh temporary user-data-dir; the flags keep Chromium off
        # the network (this machine has none) and quiet.
        launched = playwright.chromium.launch(executable_path=chromium, headless=True, args=LAUNCH_ARGS)
        try:
            yield launched
        finally:
            launched.close()


# Every Content-Security-Policy violation on a page, as the page's own event reports it.
_REPORT_CSP_VIOLATIONS = """document.addEventListener("securitypolicyviolation", (event) => window.reportCspViolation(
    `${event.effectiveDirective} blocked ${event.blockedURI || "inline"} at ${event.sourceFile}:${event.lineNumber}`));"""


def watch_csp(context, violations: list[str]) -> None:
    """Record in ``violations`` every CSP violation of the context's pages: their securitypolicyviolation
    events and the browser's console messages about a refusal."""
    context.expose_binding("reportCspViolation", lambda source, text: violations.append(f"{source['page'].url}: {text}"))
    context.add_init_script(_REPORT_CSP_VIOLATIONS)
    context.on("console", lambda message: violations.append(f"console: {message.text}")
               if "Content Security Policy" in message.text else None)


class Session:
    """A logged-in browser context for one user, every URL its pages requested and every CSP violation."""

    def __init__(self, browser, stack: Stack, username: str):
        self.stack = stack
        self.context = browser.new_context(viewport=VIEWPORT, base_url=stack.base_url)
        self.context.set_default_timeout(15_000)
        self.requested: list[str] = []
        self.page_errors: list[str] = []
        self.csp_violations: list[str] = []
        self.context.on("request", lambda request: self.requested.append(request.url))
        watch_csp(self.context, self.csp_violations)
        self.page = self.new_page()
        login(self.page, username)

    def new_page(self):
        page = self.context.new_page()
        page.on("pageerror", lambda error: self.page_errors.append(str(error)))
        return page

    def close(self) -> None:
        self.context.close()


def login(page, username: str) -> None:
    page.goto("/login/")
    page.fill("input[name=username]", username)
    page.fill("input[name=password]", PASSWORD)
    page.click("button[type=submit]")
    page.wait_for_url("**/")


@pytest.fixture(scope="module")
def operator_session(browser, stack) -> Iterator[Session]:
    session = Session(browser, stack, "sre")
    yield session
    session.close()


@pytest.fixture
def sre(operator_session):
    """The operator's page; a script error or a Content-Security-Policy violation on it fails the test."""
    operator_session.page_errors.clear()
    operator_session.csp_violations.clear()
    yield operator_session.page
    operator_session.page.goto("about:blank")  # stop its polling: the machine is small
    assert operator_session.page_errors == []
    assert operator_session.csp_violations == []


@pytest.fixture
def screenshot():
    SCREENSHOTS.mkdir(parents=True, exist_ok=True)

    def take(page, name: str) -> Path:
        path = SCREENSHOTS / f"{name}.png"
        page.evaluate("window.scrollTo(0, 0)")  # else the sticky header lands mid-page
        page.screenshot(path=str(path), full_page=True)
        return path

    return take
