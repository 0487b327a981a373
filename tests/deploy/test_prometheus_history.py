"""The two history backends on the same traffic, figure by figure: a real Prometheus scrapes a live control
plane while three instances publish growing telemetry into every Redis tier (the machinery of
test_prometheus_live.py); then the pool's ``1h`` answer is read from Redis (the 10 s rollups) and from
Prometheus (``PROMETHEUS_URL``) for the same moment and compared. Tolerances: counts and rates within
``REL_TOLERANCE`` (Prometheus counts by scrape time and extrapolates ``increase()`` to a point's edges,
Redis by snapshot time; ``SERIES_TOLERANCE`` for a series' points), quantiles within the width of the latency bucket they fall in, gauges exact."""

from __future__ import annotations

import bisect
import math
import time
from collections.abc import Iterator

import pytest
from django.test import override_settings

from controlplane.policies import services as policy_services
from controlplane.telemetry import selectors
from relay_engine.core.telemetry import LATENCY_BUCKETS_MS, MISS_REASONS, REFUSAL_REASONS
from relay_engine.core.wire import TELEMETRY_TIERS
from tests.deploy.test_prometheus_live import (  # noqa: F401 - fixtures are found by name
    INSTANCES,
    POOL,
    Traffic,
    prometheus,
    scrape_token,
)

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.django_db(transaction=True)]

WINDOW = "1h"  # past the live window: Prometheus's when PROMETHEUS_URL is set
TICKS = 22  # of growth: two whole 10 s points and parts of two more
REL_TOLERANCE = 0.05
# A point's increase() is extrapolated within the point only: the growth between its last scrape and the next
# point's first is partly lost, a few per cent of each point at a 1 s scrape and 10 s points.
SERIES_TOLERANCE = 0.15


@pytest.fixture
def fleet(redis_on, worker_factory) -> Iterator[Traffic]:
    """Three instances publishing into every tier; the first snapshot (all zero) only: the test starts the
    growth once Prometheus has scraped it, so both backends count the same traffic from zero."""
    pool = policy_services.pool_create(name=POOL, expected_instances=INSTANCES, actor="fixture")
    traffic = Traffic(pool, [worker_factory(POOL, i) for i in range(INSTANCES)], tiers=tuple(TELEMETRY_TIERS))
    traffic.tick()
    yield traffic
    traffic.stop()


def _answers(prometheus_url: str, pool, now: float) -> tuple[dict, dict]:
    with override_settings(PROMETHEUS_URL=None):
        from_redis = selectors.pool_metrics(pool=pool, window=WINDOW, top=INSTANCES, now=now)
    with override_settings(PROMETHEUS_URL=prometheus_url):
        from_prometheus = selectors.pool_metrics(pool=pool, window=WINDOW, top=INSTANCES, now=now)
    return from_redis, from_prometheus


def _bucket_width_ms(value_ms: float) -> float:
    i = bisect.bisect_left(LATENCY_BUCKETS_MS, value_ms)
    return LATENCY_BUCKETS_MS[i] - (LATENCY_BUCKETS_MS[i - 1] if i else 0.0)


def test_the_pool_history_from_prometheus_matches_redis_figure_by_figure(prometheus, fleet):  # noqa: F811
    prometheus.wait_for("scrape of every instance's first snapshot", lambda: prometheus.query(
        f'count(relaygr_rank_requests_total{{pool="{POOL}"}}) == {INSTANCES}'))
    fleet.run()
    prometheus.wait_for(f"{TICKS} ticks of traffic", lambda: fleet.ticks > TICKS)
    fleet.stop()
    # Redis's 10 s tier holds counts up to its last write, at a 10 s period's first snapshot: one more then.
    ten_s = TELEMETRY_TIERS["10s"][0]
    stopped_in = time.time() // ten_s
    prometheus.wait_for("the next 10 s period", lambda: time.time() // ten_s > stopped_in)
    fleet.tick()
    published = sum(counts["rank_requests"] for counts in fleet.counts)
    prometheus.wait_for("scrape of the last snapshots", lambda: prometheus.query(
        f'sum(relaygr_rank_requests_total{{pool="{POOL}"}}) == {published}'))
    redis_answer, prometheus_answer = _answers(prometheus.url, fleet.pool, time.time())
    assert published > 1000
    assert {k: v for k, v in redis_answer.items() if k not in ("fleet", "top")} == \
        {k: v for k, v in prometheus_answer.items() if k not in ("fleet", "top")}

    redis_totals, prometheus_totals = redis_answer["fleet"]["totals"], prometheus_answer["fleet"]["totals"]
    assert redis_totals["rank_requests"] == published
    counts = ["rank_requests", "rank_within_slo", "preinfer_admitted", "misses"]
    counts += [f"preinfer_refused.{reason}" for reason in REFUSAL_REASONS]
    counts += [f"misses_by_reason.{reason}" for reason in MISS_REASONS]
    for name in counts:
        group, _, key = name.partition(".")
        expected = redis_totals[group][key] if key else redis_totals[name]
        got = prometheus_totals[group][key] if key else prometheus_totals[name]
        assert expected > 0, name
        assert got == pytest.approx(expected, rel=REL_TOLERANCE), name
    for name in ("slo_compliance_ratio", "hbm_hit_ratio", "hit_ratio"):
        assert prometheus_totals[name] == pytest.approx(redis_totals[name], abs=0.01), name
    for name in ("p50_ms", "p99_ms"):
        assert abs(prometheus_totals[name] - redis_totals[name]) <= _bucket_width_ms(redis_totals[name]), name

    # The series: the same requests over the window (points split them by a scrape's or a snapshot's
    # time), and the last point with data holds the same occupancy against budget.
    step_s = redis_answer["step_s"]
    redis_fleet, prometheus_fleet = redis_answer["fleet"], prometheus_answer["fleet"]
    assert sum(v or 0 for v in prometheus_fleet["rank_per_s"]) * step_s == \
        pytest.approx(sum(v or 0 for v in redis_fleet["rank_per_s"]) * step_s, rel=SERIES_TOLERANCE)
    reported = [i for i, n in enumerate(redis_fleet["instances"]) if n]
    assert len(reported) >= 2
    last = reported[-2]  # a whole point: the last one may hold only the final snapshot's scrape
    for name in ("hbm_bytes", "hbm_budget_bytes", "instances"):
        assert prometheus_fleet[name][last] == redis_fleet[name][last], name

    # The worst instances, by window P99 from their own merged buckets: the same ones in the same order.
    assert [top["instance"] for top in prometheus_answer["top"]["instances"]] == \
        [top["instance"] for top in redis_answer["top"]["instances"]]
    for redis_top, prometheus_top in zip(redis_answer["top"]["instances"], prometheus_answer["top"]["instances"],
                                         strict=True):
        assert not math.isnan(redis_top["value"])
        assert abs(prometheus_top["value"] - redis_top["value"]) <= _bucket_width_ms(redis_top["value"])
