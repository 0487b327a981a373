"""The two history backends on the same traffic, figure by figure: a real Prometheus scrapes a live control
plane while three instances publish growing telemetry into every Redis tier (the machinery of
test_prometheus_live.py); then the pool's ``6h`` answer (60 s points: Redis's 60 s tier, Prometheus's
recording rules' minute) is read from Redis (the rollups) and from Prometheus (``PROMETHEUS_URL``) for the
same moment and compared, twice: from the raw series (the server has no history rules), then from the
recorded ones (``promtool tsdb create-blocks-from rules`` backfills deploy/prometheus/relaygr-history-rules.yml
from the raw series of a frozen snapshot, and the server restarts on those blocks). Tolerances: counts and
rates within ``REL_TOLERANCE`` (Prometheus counts by scrape time and extrapolates ``increase()`` to a
range's edges, Redis by snapshot time; ``SERIES_TOLERANCE`` for a series' points), quantiles within the
width of the latency bucket they fall in, gauges exact. Recorded against raw: the same counts within
``REL_TOLERANCE`` (the series within ``SERIES_TOLERANCE``), each point's minutes up to one minute
earlier than the point (promtool evaluates at the group's own phase, as the live server would)."""

from __future__ import annotations

import bisect
import json
import math
import shutil
import time
from collections.abc import Iterator

import pytest
import yaml
from django.test import override_settings

from controlplane.policies import services as policy_services
from controlplane.telemetry import promql, selectors
from controlplane.telemetry.cache import telemetry_cache
from controlplane.telemetry.recording import RULES_PATH
from relay_engine.core.telemetry import LATENCY_BUCKETS_MS, MISS_REASONS, REFUSAL_REASONS
from relay_engine.core.wire import TELEMETRY_TIERS
from tests.deploy.test_prometheus_live import (  # noqa: F401 - fixtures are found by name
    INSTANCES,
    POOL,
    Prometheus,
    Traffic,
    prometheus,
    scrape_token,
)
from tests.promtool import promtool

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.django_db(transaction=True)]

WINDOW = "6h"  # past the live window, 60 s points either way: Prometheus's when PROMETHEUS_URL is set
TICKS = 22  # of growth
MINUTE_S = 60
REL_TOLERANCE = 0.05
# A point's increase() is extrapolated within the point only: the growth between its last scrape and the next
# point's first is partly lost (a few per cent of each point at a 1 s scrape), and a scrape's time and a
# snapshot's split the requests between points apart.
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


def _records(server: Prometheus) -> bool:
    promql.forget_recorded()
    return promql.PrometheusHistory(server.url, timeout_s=10).records()


def _frozen(server: Prometheus) -> None:
    """The server restarted on a snapshot of its data (the head a block too), scraping nothing: every read
    after sees the same samples, and blocks added under it cannot reach into a head that holds any."""
    snapshot = server.data_dir / "snapshots" / server.snapshot()
    server.stop()
    config = yaml.safe_load(server.config.read_text())
    config.pop("scrape_configs")
    server.config = server.config.with_name("frozen.yml")
    server.config.write_text(yaml.safe_dump(config))
    server.data_dir = snapshot
    server.start()


def _backfill_history_rules(server: Prometheus, start: float, end: float, out) -> float:
    """The history rules evaluated over the raw series from ``start`` to ``end``, their blocks moved under
    the (frozen) server, and the server restarted on them; returns the newest recorded sample's time."""
    result = promtool("tsdb", "create-blocks-from", "rules", f"--start={int(start)}", f"--end={int(end)}",
                      f"--url={server.url}", f"--output-dir={out}", str(RULES_PATH))
    assert result.returncode == 0, result.stdout.decode() + result.stderr.decode()
    blocks = [block for block in out.iterdir() if block.is_dir()]
    assert blocks, result.stdout.decode()
    newest_ms = max(json.loads((block / "meta.json").read_text())["maxTime"] for block in blocks)
    server.stop()
    for block in blocks:
        shutil.move(block, server.data_dir / block.name)
    server.start()
    return newest_ms / 1000  # maxTime is exclusive: one past the newest sample's milliseconds


def _assert_matches(redis_answer: dict, prometheus_answer: dict, published: int) -> None:
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
    # time), and a point with data holds the same occupancy against budget.
    step_s = redis_answer["step_s"]
    redis_fleet, prometheus_fleet = redis_answer["fleet"], prometheus_answer["fleet"]
    assert sum(v or 0 for v in prometheus_fleet["rank_per_s"]) * step_s == \
        pytest.approx(sum(v or 0 for v in redis_fleet["rank_per_s"]) * step_s, rel=SERIES_TOLERANCE)
    reported = [i for i, n in enumerate(redis_fleet["instances"]) if n]
    assert len(reported) >= 2
    last = reported[-2]  # a whole point: the last one may hold only the final snapshot's scrape
    for name in ("hbm_bytes", "hbm_budget_bytes", "instances"):
        # The recorded minute that holds this point's gauges may be evaluated a point earlier (the
        # rule group's phase): the same value at the point or beside it.
        near = [prometheus_fleet[name][i] for i in (last, last - 1, last + 1) if 0 <= i < len(prometheus_fleet[name])]
        assert redis_fleet[name][last] in near, (name, redis_fleet[name][last], near)

    # The worst instances, by window P99 from their own merged buckets: the same ones in the same order.
    assert [top["instance"] for top in prometheus_answer["top"]["instances"]] == \
        [top["instance"] for top in redis_answer["top"]["instances"]]
    for redis_top, prometheus_top in zip(redis_answer["top"]["instances"], prometheus_answer["top"]["instances"],
                                         strict=True):
        assert not math.isnan(redis_top["value"])
        assert abs(prometheus_top["value"] - redis_top["value"]) <= _bucket_width_ms(redis_top["value"])


def _without_totals(answer: dict) -> dict:
    return {**answer, "fleet": {k: v for k, v in answer["fleet"].items() if k != "totals"}}


def test_the_pool_history_from_prometheus_matches_redis_figure_by_figure_raw_and_recorded(
        prometheus, fleet, tmp_path):  # noqa: F811
    prometheus.wait_for("scrape of every instance's first snapshot", lambda: prometheus.query(
        f'count(relaygr_rank_requests_total{{pool="{POOL}"}}) == {INSTANCES}'))
    fleet.run()
    prometheus.wait_for(f"{TICKS} ticks of traffic", lambda: fleet.ticks > TICKS)
    fleet.stop()
    # Redis's 60 s tier holds counts up to its last write, at a minute's first snapshot: one more then.
    stopped_in = time.time() // MINUTE_S
    time.sleep(max(0.0, (stopped_in + 1) * MINUTE_S - time.time()) + 0.1)
    fleet.tick()
    published = sum(counts["rank_requests"] for counts in fleet.counts)
    prometheus.wait_for("scrape of the last snapshots", lambda: prometheus.query(
        f'sum(relaygr_rank_requests_total{{pool="{POOL}"}}) == {published}'))
    _frozen(prometheus)
    now = time.time()

    assert not _records(prometheus)
    redis_answer, raw_answer = _answers(prometheus.url, fleet.pool, now)
    _assert_matches(redis_answer, raw_answer, published)
    # A preview score's counts over a span Prometheus holds: minutes, not 10 s points of one scrape.
    with override_settings(PROMETHEUS_URL=prometheus.url):
        counted = selectors.pool_counts(pool=fleet.pool, start_s=now - 3600, end_s=now, now=now)
    assert counted is not None and counted["to"] - counted["from"] >= 3000
    assert counted["rank_requests"] == pytest.approx(published, rel=SERIES_TOLERANCE)

    first_minute = (fleet.started_at // MINUTE_S - 1) * MINUTE_S
    newest = _backfill_history_rules(prometheus, first_minute, raw_answer["end"], tmp_path / "recorded")
    # promtool evaluates at the group's own phase, which may put the one minute that holds this short
    # traffic a few seconds ahead of the clock: it is read once it is in the past.
    time.sleep(max(0.0, newest + 1 - time.time()))
    assert _records(prometheus)
    later = time.time()
    redis_again, recorded_answer = _answers(prometheus.url, fleet.pool, later)
    _assert_matches(redis_again, recorded_answer, published)
    # Recorded against raw: the same requests, a point at most one minute earlier (the group's phase).
    recorded_fleet, raw_fleet = recorded_answer["fleet"], raw_answer["fleet"]
    assert recorded_fleet["totals"]["rank_requests"] == \
        pytest.approx(raw_fleet["totals"]["rank_requests"], rel=REL_TOLERANCE)
    assert sum(recorded_fleet["rank_per_s"]) == pytest.approx(sum(raw_fleet["rank_per_s"]), rel=SERIES_TOLERANCE)
    raw_busy = [t for t, rate in zip(raw_answer["timestamps"], raw_fleet["rank_per_s"], strict=True) if rate]
    recorded_busy = [t for t, rate in zip(recorded_answer["timestamps"], recorded_fleet["rank_per_s"], strict=True)
                     if rate]
    assert raw_busy and recorded_busy
    assert all(min(abs(t - u) for u in raw_busy) <= MINUTE_S for t in recorded_busy)

    # Polled again: the final points come from those kept by the reads above, only the newest are read, and
    # every answer is the one a fresh read gives.
    with override_settings(PROMETHEUS_URL=prometheus.url):
        kept = [entry for entry in telemetry_cache._entries.values() if isinstance(entry, promql.KeptPoints)]
        assert kept and all(entry.nbytes > 0 for entry in kept)
        name = recorded_answer["top"]["instances"][0]["instance"]
        warm = (selectors.pool_metrics(pool=fleet.pool, window=WINDOW, top=INSTANCES, now=later),
                selectors.instance_metrics(pool=fleet.pool, instance=name, window=WINDOW, now=later))
        telemetry_cache.clear()
        fresh = (selectors.pool_metrics(pool=fleet.pool, window=WINDOW, top=INSTANCES, now=later),
                 selectors.instance_metrics(pool=fleet.pool, instance=name, window=WINDOW, now=later))
    assert warm == fresh
    assert warm[0] == recorded_answer
