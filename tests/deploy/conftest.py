"""The control plane's fixtures (tests/controlplane/fixtures.py), for the test that runs Prometheus
against a live control plane; and two sets of background runs started as the history test begins: the
Prometheus history benchmark's (test_bench_prometheus.py, read by its test at the end of this folder) and the
bench smoke's (tests/lab/smoke_runs.py, read by tests/lab/test_bench_smoke.py, whose tests run right after the
history test then, so that their runs share no other test's time).

The history test mostly waits, for a wall-clock minute's turn and its rules group's phase; the benchmark is a
process of its own (its own Redis key prefix, SQLite database and Prometheus port) that mostly waits too, for
its server and then for the server's next recorded minute; the smoke's runs replay in real time, leaving the
cores idle much of the while. Side by side they take about the longest one's time instead of the sum. None is
niced (the smoke's engines set their threads' nice values themselves, and a niced benchmark could starve past
its reads' timeouts); nothing any of them checks is a timing (the benchmark's missed timing targets are its
exit status 1, accepted; the smoke checks shapes only; the history test compares the two backends' figures on
the same traffic, read after it stopped)."""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.background import BackgroundRun
from tests.controlplane.fixtures import (  # noqa: F401 - fixtures are found by name
    _fresh_caches,
    redis_client,
    redis_on,
    worker_factory,
)
from tests.lab import smoke_runs

HERE = Path(__file__).resolve().parent
BENCH_MODULE = "test_bench_prometheus.py"
BENCH_TEST = "test_every_history_view_of_the_prometheus_benchmark_answers_with_data"
BESIDE = "test_prometheus_history.py"  # the test whose minute waits the background runs share
BENCH_INSTANCES = 2
BENCH_TIMEOUT_S = 240


class BenchRun(BackgroundRun):
    """``python -m controlplane.telemetry.bench_prometheus`` at a tiny size, started now; its readings in
    ``report``."""

    def __init__(self, folder: Path, redis_url: str):
        self.report = folder / "readings.json"
        env = {key: value for key, value in os.environ.items() if not key.startswith(("DJANGO_", "RELAYGR_"))}
        super().__init__(folder, "controlplane.telemetry.bench_prometheus",
                         "--instances", str(BENCH_INSTANCES), "--hours", "1", "--requests", "2", "--colds", "2",
                         "--turns", "1", "--no-merge-wait", "--json", str(self.report),
                         timeout_s=BENCH_TIMEOUT_S, env={**env, "REDIS_URL": redis_url})


def _bench_selected(session: pytest.Session) -> bool:
    return any(item.name == BENCH_TEST and item.path.name == BENCH_MODULE for item in session.items)


def _is_beside(item) -> bool:
    return item.path.parent == HERE and item.path.name == BESIDE


@pytest.hookimpl(trylast=True)  # after pytest-django's grouping by database use
def pytest_collection_modifyitems(config, items) -> None:
    """The benchmark's test after every other test of this folder, so its run (started beside the history
    test) has had their time to finish; the smoke's tests right after the history test, so their runs (started
    beside it) overlap no other test."""
    bench = [item for item in items if item.name == BENCH_TEST and item.path.name == BENCH_MODULE]
    for item in bench:
        items.remove(item)
    here = [i for i, item in enumerate(items) if item.path.parent == HERE]
    at = here[-1] + 1 if here else len(items)
    items[at:at] = bench

    beside = [i for i, item in enumerate(items) if _is_beside(item)]
    smoke = [item for item in items if item.path.name == smoke_runs.MODULE and item.path.parent.name == "lab"]
    if beside and smoke_runs.selected(smoke):
        for item in smoke:
            items.remove(item)
        at = [i for i, item in enumerate(items) if _is_beside(item)][-1] + 1
        items[at:at] = smoke


@pytest.fixture(scope="session")
def prometheus_bench(tmp_path_factory, redis_url) -> Iterator[BenchRun]:
    """The benchmark's run, started at its first use (the history test's, or its own test's)."""
    run = BenchRun(tmp_path_factory.mktemp("bench-prometheus"), redis_url)
    try:
        yield run
    finally:
        run.stop()


@pytest.fixture(autouse=True)
def _runs_beside_the_history_test(request) -> None:
    if request.path.name != BESIDE:
        return
    if _bench_selected(request.session) and shutil.which("prometheus") and shutil.which("promtool"):
        request.getfixturevalue("prometheus_bench")
    if smoke_runs.selected(request.session.items):
        request.getfixturevalue("bench_smoke_runs")
