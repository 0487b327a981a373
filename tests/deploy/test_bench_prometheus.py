"""The Prometheus history benchmark end to end at a tiny size (2 instances, 1 h): the backfill through
promtool, the real prometheus on it, every history view read through the control plane. What it checks
is that each answer carried data, so the benchmark cannot quietly time empty reads, and that the server,
scraping the benchmark's live exporter, recorded a new minute for the pages' turn poll; never its timings.
The run itself (its arguments, and its start beside the history test) is tests/deploy/conftest.py's."""

from __future__ import annotations

import json

import pytest

from controlplane.telemetry.selectors import WINDOWS
from controlplane.telemetry.sources import LIVE_WINDOW_S
from tests.deploy.conftest import BENCH_INSTANCES
from tests.promtool import prometheus_binary

pytestmark = [pytest.mark.integration, pytest.mark.slow]

INSTANCES = BENCH_INSTANCES
VIEWS = ("live", "overview", "table", "instance")


def test_every_history_view_of_the_prometheus_benchmark_answers_with_data(request):
    prometheus_binary("prometheus")
    prometheus_binary("promtool")
    # The run (tests/deploy/conftest.py) began beside the history test where that one runs too, else now.
    run = request.getfixturevalue("prometheus_bench")
    result = run.result()
    report = run.report
    # 1 is a missed timing target (this machine's business, not the test's); anything else is a failure.
    assert result.returncode in (0, 1), result.stdout[-3000:] + result.stderr[-3000:]

    readings = json.loads(report.read_text())[str(INSTANCES)]
    history_windows = [window for window, (window_s, _) in WINDOWS.items() if window_s > LIVE_WINDOW_S]
    assert history_windows and sorted((r["window"], r["view"]) for r in readings) == \
        sorted((window, view) for window in history_windows for view in VIEWS)
    empty = [f"{r['window']} {r['view']}" for r in readings if r["values"] <= 0]
    assert empty == []
    assert all(r["values"] == INSTANCES for r in readings if r["view"] == "table")
    # Each view read cold as often as asked, the verdict's figure their median.
    assert all(len(r["colds"]) == 2 and r["cold_ms"] == pytest.approx(sum(r["colds"]) / 2) for r in readings)
    # Prometheus scraped the live exporter and recorded a new minute, at which every page polled once.
    assert all(len(r["turn_ms"]) == 1 for r in readings), result.stdout[-3000:]


def test_the_backfill_catches_up_to_now_so_the_servers_day_has_no_hole_at_its_newest_end(tmp_path):
    """A day's backfill takes minutes; the scrapes of those minutes are backfilled after it, on the same
    grid, until less than ``CAUGHT_UP_S`` is missing (a server scraping all along holds them)."""
    import time

    from controlplane.telemetry import bench_prometheus as bench

    prometheus_binary("promtool")
    exposition = '# HELP relaygr_probe Probe.\n# TYPE relaygr_probe counter\nrelaygr_probe_total{pool="p"} %d\n'
    now = time.time()
    last = now - 5 * bench.CAUGHT_UP_S  # the newest scrape the backfill wrote, five minutes ago
    scrapes = bench.Scrapes(exposition % 0, last - 600, exposition % 600, last)
    data_dir = tmp_path / "data"
    data_dir.mkdir()
    newest = bench.catch_up(scrapes, last, data_dir, tmp_path)

    step = bench.scrape_interval_s()
    assert time.time() - newest < bench.CAUGHT_UP_S
    assert (newest - last) / step == pytest.approx(round((newest - last) / step))  # the backfill's grid, going on
    blocks = [json.loads(meta.read_text()) for meta in data_dir.glob("*/meta.json")]
    assert blocks and min(b["minTime"] for b in blocks) == round((last + step) * 1000)
    assert max(b["maxTime"] for b in blocks) == round(newest * 1000) + 1  # a block's maxTime is exclusive
    assert sum(b["stats"]["numSamples"] for b in blocks) == round((newest - last) / step)
