"""The control plane's fixtures (tests/controlplane/fixtures.py), for the test that runs Prometheus
against a live control plane; and the Prometheus history benchmark's run (test_bench_prometheus.py), started
in the background as the history test begins and read by its test at the end of this folder.

The benchmark is a process of its own (its own Redis key prefix, SQLite database and Prometheus port) that
mostly waits: for its server, then for the server's next recorded minute. The history test mostly waits too,
for a wall-clock minute's turn and its rules group's phase. Side by side they take about the longer one's time
instead of the sum. The benchmark runs niced, so the history test's traffic, scrapes and reads come first;
nothing either checks is a timing (the benchmark's missed timing targets are its exit status 1, accepted)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from relay_engine.core.lifetime import die_with_parent
from tests.controlplane.fixtures import (  # noqa: F401 - fixtures are found by name
    _fresh_caches,
    redis_client,
    redis_on,
    worker_factory,
)

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
BENCH_MODULE = "test_bench_prometheus.py"
BENCH_TEST = "test_every_history_view_of_the_prometheus_benchmark_answers_with_data"
BESIDE = "test_prometheus_history.py"  # the test whose minute waits the benchmark's run shares
BENCH_INSTANCES = 2
BENCH_TIMEOUT_S = 240
BENCH_NICE = 10


class BenchRun:
    """``python -m controlplane.telemetry.bench_prometheus`` at a tiny size, started now, niced; its output
    kept in files (a pipe nobody reads would stall it) and its readings in ``report``."""

    def __init__(self, folder: Path, redis_url: str):
        self.report = folder / "readings.json"
        self.stdout, self.stderr = folder / "stdout.txt", folder / "stderr.txt"
        self.args = [sys.executable, "-m", "controlplane.telemetry.bench_prometheus",
                     "--instances", str(BENCH_INSTANCES), "--hours", "1", "--requests", "2", "--colds", "2",
                     "--turns", "1", "--no-merge-wait", "--json", str(self.report)]
        env = {key: value for key, value in os.environ.items() if not key.startswith(("DJANGO_", "RELAYGR_"))}
        follow = die_with_parent()

        def preexec() -> None:
            os.nice(BENCH_NICE)
            if follow is not None:
                follow()

        with self.stdout.open("w") as out, self.stderr.open("w") as err:
            self.process = subprocess.Popen(self.args, cwd=ROOT, env={**env, "REDIS_URL": redis_url},
                                            stdout=out, stderr=err, text=True, preexec_fn=preexec)

    def result(self) -> subprocess.CompletedProcess:
        self.process.wait(timeout=BENCH_TIMEOUT_S)
        return subprocess.CompletedProcess(self.args, self.process.returncode, self.stdout.read_text(),
                                           self.stderr.read_text())

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait()


def _bench_selected(session: pytest.Session) -> bool:
    return any(item.name == BENCH_TEST and item.path.name == BENCH_MODULE for item in session.items)


def pytest_collection_modifyitems(config, items) -> None:
    """The benchmark's test after every other test of this folder, so its run (started beside the history
    test) has had their time to finish."""
    bench = [item for item in items if item.name == BENCH_TEST and item.path.name == BENCH_MODULE]
    if not bench:
        return
    for item in bench:
        items.remove(item)
    here = [i for i, item in enumerate(items) if item.path.parent == HERE]
    at = here[-1] + 1 if here else len(items)
    items[at:at] = bench


@pytest.fixture(scope="session")
def prometheus_bench(tmp_path_factory, redis_url) -> Iterator[BenchRun]:
    """The benchmark's run, started at its first use (the history test's, or its own test's)."""
    run = BenchRun(tmp_path_factory.mktemp("bench-prometheus"), redis_url)
    try:
        yield run
    finally:
        run.stop()


@pytest.fixture(autouse=True)
def _bench_beside_the_history_test(request) -> None:
    if request.path.name == BESIDE and _bench_selected(request.session) and \
            shutil.which("prometheus") and shutil.which("promtool"):
        request.getfixturevalue("prometheus_bench")
