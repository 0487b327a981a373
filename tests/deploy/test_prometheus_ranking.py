"""Ranking every instance by one column from Prometheus: the live view's worst instances and the instance
table's order read of each instance only what that column needs (a latency quantile computed in
Prometheus, a ratio's counters, the gauges), and only the rows shown whole. The answers must be those of
reading every instance's whole row: a small fleet's history (the Prometheus benchmark's traffic, one
instance idle: present, no requests) backfilled into a real ``prometheus`` with the history rules."""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from types import SimpleNamespace

import numpy as np
import pytest
from django.db import transaction
from django.test import override_settings

from controlplane.common.redis import get_redis
from controlplane.fleet.selectors import pool_status
from controlplane.policies import services as policy_services
from controlplane.policies.models import Pool
from controlplane.telemetry import bench_prometheus, promql, selectors
from controlplane.telemetry.bench import Writer
from controlplane.telemetry.cache import telemetry_cache
from controlplane.telemetry.history import N_COLUMNS
from controlplane.telemetry.merge import latency_counts, quantiles
from relay_engine.core.lifetime import free_port
from relay_engine.core.wire import instance_name
from tests.promtool import prometheus_binary

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.django_db(transaction=True)]

POOL = "rank"
INSTANCES = 7
HOURS = 0.75
IDLE_INDEX = 3
IDLE = instance_name(POOL, IDLE_INDEX)
NAMES = [instance_name(POOL, i) for i in range(INSTANCES)]


@pytest.fixture(scope="module")
def backfilled(redis_url, tmp_path_factory, django_db_setup, django_db_blocker) -> Iterator[tuple[str, float]]:
    """(PROMETHEUS_URL, now): the fleet's history up to now, the recorded minutes backfilled, one server for
    the module (backfilling costs seconds; the tests only read it, at moments up to now)."""
    prometheus_binary("prometheus")
    prometheus_binary("promtool")
    tmp_path = tmp_path_factory.mktemp("ranking")
    busy = bench_prometheus._snapshot

    def snapshot(instance, ts, started_at, rng):  # the idle instance counts nothing, ever
        return busy(instance, started_at if instance == IDLE else ts, started_at, rng)

    with pytest.MonkeyPatch.context() as patch, override_settings(REDIS_URL=redis_url):
        patch.setattr(bench_prometheus, "_snapshot", snapshot)
        patch.setenv("RELAYGR_KEY_PREFIX", f"test-{uuid.uuid4().hex[:10]}")
        now = time.time()
        data_dir = tmp_path / "data"
        data_dir.mkdir()
        # The scrapes render the pool as the control plane sees it, from rows rolled back once written: each
        # test makes its own.
        with django_db_blocker.unblock(), transaction.atomic():
            pool = policy_services.pool_create(name=POOL, actor="fixture", expected_instances=INSTANCES)
            _with_statuses(get_redis(), now)
            fleet = bench_prometheus.Fleet(POOL, NAMES, _started_at(now), pool_status(pool=pool, now=now))
            bench_prometheus.backfill(fleet, now, HOURS, data_dir, tmp_path)
            transaction.set_rollback(True)
        port = free_port()
        bench_prometheus.backfill_recorded(data_dir, now - HOURS * 3600, now, port, tmp_path)
        with bench_prometheus.prometheus_server(data_dir, port, tmp_path / "prometheus.log") as url:
            yield url, now


@pytest.fixture
def history(backfilled, redis_client) -> Iterator[tuple[str, float]]:
    """(PROMETHEUS_URL, now): the module's history, with this test's own pool row and statuses in Redis."""
    url, now = backfilled
    policy_services.pool_create(name=POOL, actor="fixture", expected_instances=INSTANCES)
    _with_statuses(redis_client, now)
    promql.forget_recorded()
    assert promql.PrometheusHistory(url, timeout_s=10).records()
    yield url, now
    promql.forget_recorded()


def _started_at(now: float) -> float:
    return now - (HOURS + 1) * 3600


def _with_statuses(client, now: float) -> None:
    """Every instance's status record and membership at ``now``, as their heartbeats write them."""
    writer = Writer(client, POOL)
    writer.started_at = _started_at(now)
    writer.statuses(NAMES, now)


def _whole_rows_table(url: str, window: str, now: float) -> dict[str, dict]:
    """Every instance's table row from its whole row of counts (what the table read before ranking by one
    column), by name."""
    with override_settings(PROMETHEUS_URL=url):
        tier, _, start, _ = selectors.window_grid(window, now)
    totals = promql.PrometheusHistory(url, timeout_s=10).window_totals(
        pool=POOL, tier=tier, window_s=selectors.WINDOWS[window][0], start=start, now=now)
    columns = selectors._table_columns(totals, max(1.0, now - start))
    return {name: {"instance": name, **{column: selectors._table_number(column, columns[column][i])
                                        for column in selectors.TABLE_COLUMNS[1:]}}
            for i, name in enumerate(totals.names)}


def _ordered(rows: dict[str, dict], sort: str) -> list[str]:
    """The table's documented order: by the column (``-``: descending), ties by name, no value last by name."""
    key = sort.lstrip("-")
    by_name = sorted(rows)
    with_value = sorted((name for name in by_name if rows[name][key] is not None), key=lambda name: rows[name][key],
                        reverse=sort.startswith("-"))
    return with_value + [name for name in by_name if rows[name][key] is None]


def test_every_sort_of_the_table_pages_as_the_whole_rows_do(history):
    url, now = history
    pool = SimpleNamespace(name=POOL)
    rows = _whole_rows_table(url, "1h", now)
    assert len(rows) == INSTANCES and rows[IDLE]["p99_ms"] is None and rows[IDLE]["hbm_bytes"] is not None
    compared = 0
    for column in selectors.TABLE_COLUMNS:
        for sort in (column, f"-{column}"):
            expected = _ordered(rows, sort)
            for offset in (0, 3):
                telemetry_cache.clear()  # a page read afresh, not the whole rows kept from above
                with override_settings(PROMETHEUS_URL=url):
                    page = selectors.instance_table(pool=pool, window="1h", sort=sort, limit=3, offset=offset,
                                                    now=now)
                assert page["count"] == INSTANCES
                assert page["results"] == [rows[name] for name in expected[offset:offset + 3]], sort
                compared += 1
    assert compared == 4 * len(selectors.TABLE_COLUMNS)


def test_a_latency_quantile_ranking_matches_the_merged_buckets_and_an_idle_instance_has_none(history):
    url, now = history
    source = promql.PrometheusHistory(url, timeout_s=10)
    with override_settings(PROMETHEUS_URL=url):
        tier, _, start, _ = selectors.window_grid("1h", now)
    window = {"pool": POOL, "tier": tier, "window_s": 3600, "start": start, "now": now}
    whole = source.window_totals(**window)
    for q in (0.5, 0.99):
        names, values = source.window_quantile(**window, q=q)
        [merged] = quantiles(latency_counts(whole.sums), (q,))
        assert names == whole.names and len(names) == INSTANCES
        busy = [i for i, name in enumerate(names) if name != IDLE]
        assert np.isnan(values[names.index(IDLE)]) and np.isnan(merged[names.index(IDLE)])
        assert np.all(values[busy] > 0)
        np.testing.assert_allclose(values[busy], merged[busy], rtol=1e-12)


def test_the_live_view_lists_the_worst_instances_of_the_whole_rows_and_counts_every_one(history):
    url, now = history
    pool = Pool.objects.get(name=POOL)
    rows = _whole_rows_table(url, "1h", now)
    worst = sorted((name for name in rows if rows[name]["p99_ms"] is not None), key=lambda name: -rows[name]["p99_ms"])
    with override_settings(PROMETHEUS_URL=url):
        answer = selectors.pool_metrics(pool=pool, window="1h", top=3, rank_by="p99", now=now)
    top = answer["top"]
    assert top["reporting"] == INSTANCES
    assert [item["value"] for item in top["instances"]] == pytest.approx([rows[name]["p99_ms"] for name in worst[:3]],
                                                                       abs=1e-3)
    # The idle instance has no value: ranked last, listed only when every other one is.
    with override_settings(PROMETHEUS_URL=url):
        everyone = selectors.pool_metrics(pool=pool, window="1h", top=INSTANCES, rank_by="p99", now=now)
    assert [item["instance"] for item in everyone["top"]["instances"]][-1] == IDLE
    assert everyone["top"]["instances"][-1]["value"] is None



def test_answers_kept_between_polls_are_those_asked_afresh(history):
    """Kept until a newer minute is recorded, so a later poll of the same window must get what a fresh read
    gives: the window's answer may not depend on the moment it is asked."""
    url, end_of_data = history
    source = promql.PrometheusHistory(url, timeout_s=10)
    # Two moments within the backfilled history (the live server records minutes after it only) between
    # the same two recorded minutes, in the same window.
    asked = end_of_data - 45
    with override_settings(PROMETHEUS_URL=url):
        tier, step_s, start, n_points = selectors.window_grid("1h", asked)
    newest = source._newest_recorded_minute(POOL, asked)
    assert newest is not None and asked - 60 < newest <= asked
    later = asked + min(start + n_points * step_s - asked, newest + 60 - asked) / 2
    window = {"pool": POOL, "tier": tier, "window_s": 3600, "start": start}
    page = [instance_name(POOL, i) for i in (1, 3, 5)]
    names, first = source.window_quantile(**window, now=asked, q=0.99)
    first_rows = source.window_totals(**window, now=asked, instances=page).sums
    _, kept = source.window_quantile(**window, now=later, q=0.99)
    kept_rows = source.window_totals(**window, now=later, instances=page).sums
    telemetry_cache.clear()
    _, fresh = source.window_quantile(**window, now=later, q=0.99)
    fresh_rows = promql.PrometheusHistory(url, timeout_s=10).window_totals(**window, now=later, instances=page).sums
    assert len(names) == INSTANCES and np.isfinite(first).sum() == INSTANCES - 1
    assert first_rows.shape == (3, N_COLUMNS) and first_rows.sum() > 0
    np.testing.assert_array_equal(kept, first)
    np.testing.assert_array_equal(fresh, first)
    np.testing.assert_array_equal(kept_rows, first_rows)
    np.testing.assert_array_equal(fresh_rows, first_rows)


def test_a_poll_past_a_new_minute_gets_the_kept_answer_at_once_and_the_next_one_the_new_minute(history):
    """The poll just after a newer minute is recorded is given the kept answer (one minute behind) while a
    thread reads the new minute's; once it has, polls get exactly what a fresh read gives."""
    url, end_of_data = history
    source = promql.PrometheusHistory(url, timeout_s=10)
    asked = end_of_data - 330
    later = asked + 60
    with override_settings(PROMETHEUS_URL=url):
        tier, _, start, _ = selectors.window_grid("1h", asked)
        _, _, later_start, _ = selectors.window_grid("1h", later)
    assert source._newest_recorded_minute(POOL, later) - source._newest_recorded_minute(POOL, asked) == 60
    page = [instance_name(POOL, i) for i in (0, 2, 4)]
    window = {"pool": POOL, "tier": tier, "window_s": 3600}
    _, first = source.window_quantile(**window, start=start, now=asked, q=0.99)
    first_rows = source.window_totals(**window, start=start, now=asked, instances=page).sums

    _, stale = source.window_quantile(**window, start=later_start, now=later, q=0.99)
    stale_rows = source.window_totals(**window, start=later_start, now=later, instances=page).sums
    np.testing.assert_array_equal(stale, first)
    np.testing.assert_array_equal(stale_rows, first_rows)
    refreshing = [entry.refreshing for entry in telemetry_cache._entries.values()
                  if isinstance(entry, promql.KeptAnswer) and entry.refreshing is not None]
    assert len(refreshing) == 4  # the quantiles, the page's rows, who reported, the page's gauges
    for future in refreshing:
        future.result(timeout=30)
    _, updated = source.window_quantile(**window, start=later_start, now=later, q=0.99)
    updated_rows = source.window_totals(**window, start=later_start, now=later, instances=page).sums

    telemetry_cache.clear()
    fresh_source = promql.PrometheusHistory(url, timeout_s=10)
    _, fresh = fresh_source.window_quantile(**window, start=later_start, now=later, q=0.99)
    fresh_rows = fresh_source.window_totals(**window, start=later_start, now=later, instances=page).sums
    np.testing.assert_array_equal(updated, fresh)
    np.testing.assert_array_equal(updated_rows, fresh_rows)
    assert not np.array_equal(fresh_rows, first_rows)  # a minute's more requests: the refresh did read anew

    # Further behind than STALE_FOR_S: read at once, never the kept answer.
    much_later = later + promql.STALE_FOR_S + 60
    with override_settings(PROMETHEUS_URL=url):
        _, _, much_later_start, _ = selectors.window_grid("1h", much_later)
    assert much_later < end_of_data
    behind = source.window_totals(**window, start=much_later_start, now=much_later, instances=page).sums
    telemetry_cache.clear()
    np.testing.assert_array_equal(behind, promql.PrometheusHistory(url, timeout_s=10).window_totals(
        **window, start=much_later_start, now=much_later, instances=page).sums)


@pytest.mark.parametrize("window", ["1h", "24h"])  # a minute a point; four
def test_recorded_minutes_read_as_written_are_the_points_sum_over_time_gives(history, window):
    """The recorded minutes as written (one instant query of a range), evaluated point by point, and as the
    history reads them (``_recorded_counts``: as written for a minute a point, the server's sums of each
    point's minutes for wider points) are the same counts, for the pool and for instances."""
    from controlplane.telemetry.recording import INSTANCE
    from controlplane.telemetry.recording import POOL as POOL_LEVEL

    url, now = history
    source = promql.PrometheusHistory(url, timeout_s=10)
    with override_settings(PROMETHEUS_URL=url):
        _, step_s, start, n_points = selectors.window_grid(window, now)
    names = [instance_name(POOL, i) for i in (0, 1, IDLE_INDEX)]
    for level, by, selector in ((POOL_LEVEL, ("pool",), f'pool="{POOL}"'),
                                (INSTANCE, ("instance",), promql._selector(POOL, names))):
        written = source._recorded_minutes(selector, level, start, step_s, n_points)
        evaluated = source._range(promql.counts_query(selector, by, step_s, recorded=True), start, step_s, n_points)
        read, add = source._recorded_counts(selector, level, start, step_s, n_points)
        assert add == (step_s == 60)
        groups = ([(POOL, written, evaluated, read)] if level == POOL_LEVEL else
                  [(name, *(promql._by_instance(series).get(name, []) for series in (written, evaluated, read)))
                   for name in names])
        for name, a_series, b_series, c_series in groups:
            a, b, c = (np.zeros((n_points, N_COLUMNS)) for _ in range(3))
            promql._fill_counts(a, a_series, add=True)
            promql._fill_counts(b, b_series)
            promql._fill_counts(c, c_series, add=add)
            assert (a.sum() > 0) == (name != IDLE), name
            np.testing.assert_allclose(a, b, rtol=1e-9, atol=1e-9, err_msg=name)
            np.testing.assert_allclose(a, c, rtol=1e-9, atol=1e-9, err_msg=name)
    # The instances' points as the charts read them (a wide window's in two halves at once): the same counts.
    rows = [counts for counts, _ in source._instances_read(POOL, names, start, step_s, n_points, True)]
    for name, counts in zip(names, rows, strict=True):
        written = np.zeros((n_points, N_COLUMNS))
        promql._fill_counts(written, promql._by_instance(
            source._recorded_minutes(promql._selector(POOL, names), INSTANCE, start, step_s, n_points)).get(name, []),
            add=True)
        assert (counts.sum() > 0) == (name != IDLE), name
        np.testing.assert_allclose(counts, written, rtol=1e-9, atol=1e-9, err_msg=name)
