"""A canary bake longer than Redis keeps, where Prometheus holds the history (``rollouts.bake.served``): its
start is read from a real Prometheus, its end from Redis's live tier, and the two together count what Redis
alone counts over the same span (the test's Redis still holds all of it); a generation the instances never
ran counts nothing; Prometheus unreachable, the bake is judged on Redis and says so. The split and the
point width are the module's, shrunk to the test's seconds (the machinery of test_prometheus_live.py: a
1 s scrape of a live control plane while three instances publish growing telemetry)."""

from __future__ import annotations

import bisect
import time
from collections.abc import Iterator

import numpy as np
import pytest
from django.test import override_settings

from controlplane.policies import services as policy_services
from controlplane.rollouts import bake
from relay_engine.core.telemetry import LATENCY_BUCKETS_MS
from tests.deploy.test_prometheus_live import (  # noqa: F401 - fixtures are found by name
    INSTANCES,
    POOL,
    Traffic,
    prometheus,
    scrape_token,
)

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.django_db(transaction=True)]

REDIS_SPAN_S = 8
STEP_S = 4
TICKS = 26  # of growth: five whole Prometheus points before the Redis part
TOLERANCE = 0.15  # each point's increase() is extrapolated within the point (test_prometheus_history.py)


@pytest.fixture
def fleet(redis_on, worker_factory) -> Iterator[Traffic]:
    """Three instances publishing the live tier only, as workers with RELAYGR_HISTORY=prometheus do."""
    pool = policy_services.pool_create(name=POOL, expected_instances=INSTANCES, actor="fixture")
    traffic = Traffic(pool, [worker_factory(POOL, i) for i in range(INSTANCES)])
    traffic.tick()
    yield traffic
    traffic.stop()


def _bucket_width_ms(value_ms: float) -> float:
    i = bisect.bisect_left(LATENCY_BUCKETS_MS, value_ms)
    return LATENCY_BUCKETS_MS[i] - (LATENCY_BUCKETS_MS[i - 1] if i else 0.0)


def test_a_long_bake_is_judged_from_prometheus_then_redis(prometheus, fleet, redis_client, monkeypatch):  # noqa: F811
    prometheus.wait_for("scrape of every instance's first snapshot", lambda: prometheus.query(
        f'count(relaygr_rank_requests_total{{pool="{POOL}"}}) == {INSTANCES}'))
    since = time.time()
    fleet.run()
    prometheus.wait_for(f"{TICKS} ticks of traffic", lambda: fleet.ticks > TICKS)
    now = time.time()
    monkeypatch.setattr(bake, "REDIS_SPAN_S", REDIS_SPAN_S)
    monkeypatch.setattr(bake, "PROMETHEUS_STEP_S", STEP_S)
    names = [worker.name for worker in fleet.workers]

    running = fleet.workers[0].status.applied_generation
    assert running > 0

    def served(generation: int = running) -> bake.Served:
        return bake.served(redis_client, pool=POOL, instances=names, generation=generation, since=since, now=now)

    with override_settings(PROMETHEUS_URL=None):
        alone = served()
    with override_settings(PROMETHEUS_URL=prometheus.url):
        both = served()
        never_ran = served(generation=running + 1)
    assert alone.history == "redis" and both.history == "prometheus+redis"
    assert alone.requests > 1000
    assert both.requests == pytest.approx(alone.requests, rel=TOLERANCE)
    assert both.bad == pytest.approx(alone.bad, rel=TOLERANCE)
    assert abs(both.p99_ms - alone.p99_ms) <= _bucket_width_ms(alone.p99_ms)
    assert never_ran.requests == 0
    # Judged tick by tick, each tick reading only the points added since the last: the same figures.
    bake.forget_reads()
    with override_settings(PROMETHEUS_URL=prometheus.url):
        for earlier in (now - 3 * STEP_S, now - STEP_S):
            bake.served(redis_client, pool=POOL, instances=names, generation=running, since=since, now=earlier)
        ticked = served()
    assert ticked.history == both.history
    # Prometheus's counts are extrapolated, not whole: summed in another order, they may round apart.
    assert abs(ticked.requests - both.requests) <= 1 and abs(ticked.bad - both.bad) <= 1
    assert np.allclose(ticked.buckets, both.buckets, rtol=1e-9, atol=1e-6)

    with override_settings(PROMETHEUS_URL=f"{prometheus.url}/not-prometheus"):
        fallback = served()
    assert fallback.history.startswith("redis: Prometheus at PROMETHEUS_URL"), fallback.history
    assert fallback.requests == alone.requests  # the whole bake is still in Redis's live tier here
