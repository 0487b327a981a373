"""The read side at fleet scale: pool rollups, incremental polls, the worst instances, the per-instance
table and drill-down, and the bounded cache. Real Redis; snapshots written by the workers' writer."""

from __future__ import annotations

import json
import time

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from controlplane.telemetry.cache import BoundedCache
from controlplane.telemetry.history import COUNTER_COLUMN, InstanceHistory, _fast_values, decode_snapshot
from relay_engine.core.config import parse_policy
from relay_engine.core.engine import RelayEngine
from relay_engine.core.telemetry import COUNTERS, LatencyHistogram, Snapshot, rollup_contribution
from tests.models import SMALL
from workers.instance import engine_gauges

from .fleet_helpers import snapshot

POOL = "ranking-a"
BASE = f"/api/v1/pools/{POOL}"


def _fleet(worker_factory, now: float, *, instances: int = 4, seconds: int = 20):
    """``instances`` instances, instance i ranking at 2^i ms and filling i/instances of its HBM,
    10 requests a second each, for ``seconds`` one-second samples ending at ``now``."""
    workers = [worker_factory(POOL, i) for i in range(instances)]
    hists = [LatencyHistogram() for _ in workers]
    for k in range(seconds + 1):
        ts = now - seconds + k
        for i, (worker, hist) in enumerate(zip(workers, hists, strict=True)):
            if k:
                for _ in range(10):
                    hist.record(float(2**i))
            snap = snapshot(worker.name, ts, now - seconds - 5, rank_requests=10 * k, rank_within_slo=10 * k,
                            hbm_hits=10 * k, hbm_bytes=1000 * i, hbm_budget_bytes=1000 * instances)
            snap.rank_latency = hist.copy()
            worker.publish_snapshot(snap)
    return workers


# --- the writer's rollup contribution ---------------------------------------------------------

runs = st.lists(st.lists(st.integers(0, 50), min_size=1, max_size=6), min_size=1, max_size=4)


@settings(max_examples=60, deadline=None)
@given(runs)
def test_rollup_contributions_add_up_to_every_count_of_every_run(increments_by_run):
    """Summed over every write, the contributions are each run's final counts: nothing lost at a
    restart, nothing counted twice."""
    previous, total, expected = None, 0, 0
    for run, increments in enumerate(increments_by_run):
        count = 0
        for k, step in enumerate(increments):
            count += step
            current = snapshot("p.0", 100.0 * run + k + 1, 100.0 * run, rank_requests=count)
            total += rollup_contribution(current, previous).get("rank_requests", 0)
            previous = current
        expected += count
    assert total == expected


def test_a_contribution_carries_gauges_once_and_leaves_zeros_out():
    current = snapshot("p.0", 10, 0, rank_requests=5, hbm_bytes=300, hbm_budget_bytes=1000)
    added = rollup_contribution(current, snapshot("p.0", 9, 0, rank_requests=5))
    assert added == {"hbm_bytes": 300, "hbm_budget_bytes": 1000, "instances": 1}


# --- decoding ---------------------------------------------------------------------------------

@pytest.mark.parametrize("packed", [True, False], ids=["packed", "plain JSON"])
def test_the_fast_decoder_agrees_with_the_one_decoder(packed):
    snap = snapshot("p.0", 12.5, 2.0, latencies_ms=[1.0, 3.0, 3.0, 900.0], rank_requests=4, misses=1,
                    refusals={"cache_budget": 2}, hbm_bytes=7)
    import json

    raw = snap.to_entry() if packed else json.dumps(snap.to_dict())
    assert _fast_values(raw) is not None  # what workers write takes the fast path, packed or not
    ts, started_at, row, gauges = decode_snapshot(raw)
    strict = Snapshot.from_entry(raw)
    assert (ts, started_at) == (strict.ts, strict.started_at)
    assert row[COUNTER_COLUMN["rank_requests"]] == 4 and row[COUNTER_COLUMN["misses"]] == 1
    assert row[len(COUNTERS):].sum() == 2 + 4 + 1.0 + 3.0 + 3.0 + 900.0  # refusals, buckets, sum
    assert gauges[0] == 7


@pytest.mark.parametrize("raw", ['{"instance": "p.0", "ts": 1, "counters": {"rank_ok": true}}',
                                 '{"instance": "p.0", "ts": 1, "counters": {"rank_ok": 1e999}}',
                                 '{"instance": "p.0", "ts": "NaN"}'])
def test_what_the_fast_path_refuses_the_one_decoder_judges(raw):
    with pytest.raises(ValueError, match="snapshot"):
        decode_snapshot(raw)


# --- the bounded cache ------------------------------------------------------------------------

class _Blob:
    def __init__(self, nbytes: int):
        self.nbytes = nbytes


def test_the_cache_drops_the_least_recently_used_past_its_budget():
    cache = BoundedCache(lambda: 250)
    for name in "abc":
        cache.get(name, lambda: _Blob(100))
    cache.get("a", lambda: _Blob(100))  # used again: now the newest
    cache.trim()
    assert cache.nbytes == 200 and len(cache) == 2
    kept = {name for name in "abc" if cache.get(name, lambda: _Blob(0)).nbytes == 100}
    assert kept == {"a", "c"}


def test_the_cache_keeps_the_newest_entry_even_when_it_alone_is_over_budget():
    cache = BoundedCache(lambda: 10)
    cache.get("big", lambda: _Blob(1000))
    cache.trim()
    assert len(cache) == 1


# --- pool series from the rollups -------------------------------------------------------------

def test_pool_series_sum_every_instance(viewer, pool, worker_factory):
    _fleet(worker_factory, time.time(), instances=4)
    fleet = viewer.get(f"{BASE}/metrics/?window=5m&top=0").json()["fleet"]
    assert fleet["totals"]["rank_requests"] == 4 * 10 * 20
    assert [v for v in fleet["rank_per_s"] if v] == [40.0] * 20
    newest = {k: [v for v in fleet[k] if v is not None][-1] for k in ("instances", "hbm_bytes",
                                                                                 "hbm_budget_bytes")}
    assert newest == {"instances": 4, "hbm_bytes": 1000 * (0 + 1 + 2 + 3), "hbm_budget_bytes": 4 * 4000}


def test_an_incremental_poll_sends_only_the_points_from_since(viewer, pool, worker_factory):
    now = time.time()
    _fleet(worker_factory, now)
    full = viewer.get(f"{BASE}/metrics/?window=5m&top=0").json()
    since = full["timestamps"][-3]
    poll = viewer.get(f"{BASE}/metrics/?window=5m&top=0&since={since}").json()
    # (A point more when the clock has moved on to the next second since the first request.)
    assert poll["from"] == since and poll["timestamps"][:3] == full["timestamps"][-3:] and len(poll["timestamps"]) <= 4
    assert poll["fleet"]["rank_per_s"][:3] == full["fleet"]["rank_per_s"][-3:]
    assert poll["fleet"]["totals"] == full["fleet"]["totals"]  # totals are always the whole window


def test_a_since_before_the_window_gets_the_whole_window(viewer, pool, worker_factory):
    _fleet(worker_factory, time.time())
    poll = viewer.get(f"{BASE}/metrics/?window=5m&top=0&since=1").json()
    assert len(poll["timestamps"]) == 300 and poll["from"] == poll["start"]


def test_known_top_instances_get_only_the_newer_points(viewer, pool, worker_factory):
    _fleet(worker_factory, time.time())
    full = viewer.get(f"{BASE}/metrics/?window=5m&top=2").json()
    since = full["timestamps"][-2]
    held = full["top"]["instances"][0]["instance"]
    poll = viewer.get(f"{BASE}/metrics/?window=5m&top=2&since={since}&known={held}").json()
    by_name = {t["instance"]: t for t in poll["top"]["instances"]}
    assert by_name[held]["from"] == since and len(by_name[held]["p99_ms"]) == len(poll["timestamps"]) <= 3
    other = next(name for name in by_name if name != held)
    assert by_name[other]["from"] == poll["start"] and len(by_name[other]["p99_ms"]) == 300


def test_the_worst_instances_by_p99_and_by_hbm_pressure(viewer, pool, worker_factory):
    _fleet(worker_factory, time.time(), instances=4)
    by_p99 = viewer.get(f"{BASE}/metrics/?window=5m&top=3").json()["top"]
    assert [t["instance"] for t in by_p99["instances"]] == [f"{POOL}.3", f"{POOL}.2", f"{POOL}.1"]
    values = [t["value"] for t in by_p99["instances"]]
    assert values == sorted(values, reverse=True) and 6.6 < values[0] <= 8.9
    by_hbm = viewer.get(f"{BASE}/metrics/?window=5m&top=2&rank_by=hbm").json()["top"]
    assert [(t["instance"], t["value"]) for t in by_hbm["instances"]] == [(f"{POOL}.3", 0.75), (f"{POOL}.2", 0.5)]


def test_a_restart_within_the_window_is_counted_exactly(viewer, pool, worker_factory):
    now = time.time()
    worker = worker_factory(POOL, 0)
    for k in range(6):  # run 1: 5 requests a second
        worker.publish_snapshot(snapshot(worker.name, now - 10 + k, now - 100, rank_requests=5 * k))
    for k in range(1, 5):  # run 2 began at now - 4.5: its counts are all new
        worker.publish_snapshot(snapshot(worker.name, now - 5 + k, now - 4.5, rank_requests=3 * k))
    [row] = viewer.get(f"{BASE}/instances/?window=5m").json()["results"]
    assert row["rank_requests"] == 5 * 5 + 3 * 4


# --- the per-instance table -------------------------------------------------------------------

def test_the_table_sorts_and_pages(viewer, pool, worker_factory):
    _fleet(worker_factory, time.time(), instances=5)
    page = viewer.get(f"{BASE}/instances/?window=5m&sort=-p99_ms&limit=2&offset=0").json()
    assert page["count"] == 5 and [r["instance"] for r in page["results"]] == [f"{POOL}.4", f"{POOL}.3"]
    rest = viewer.get(f"{BASE}/instances/?window=5m&sort=-p99_ms&limit=2&offset=4").json()
    assert [r["instance"] for r in rest["results"]] == [f"{POOL}.0"]
    ascending = viewer.get(f"{BASE}/instances/?window=5m&sort=hbm_pressure").json()["results"]
    assert [r["hbm_pressure"] for r in ascending] == [0.0, 0.2, 0.4, 0.6, 0.8]
    first = ascending[-1]
    assert (first["rank_requests"], first["hbm_bytes"], first["hbm_budget_bytes"]) == (200, 4000, 5000)


def test_instances_without_a_value_sort_last_either_way(viewer, pool, worker_factory):
    now = time.time()
    _fleet(worker_factory, now, instances=2)
    idle = worker_factory(POOL, 7)
    for k in range(3):
        idle.publish_snapshot(snapshot(idle.name, now - 3 + k, now - 10))
    for sort in ("p99_ms", "-p99_ms"):
        names = [r["instance"] for r in viewer.get(f"{BASE}/instances/?window=5m&sort={sort}").json()["results"]]
        assert names[-1] == f"{POOL}.7" and len(names) == 3


@pytest.mark.parametrize(("query", "field"), [
    ("sort=p98", "sort"), ("limit=0", "limit"), ("limit=501", "limit"), ("offset=-1", "offset"),
    ("limit=" + "9" * 400, "limit"), ("window=2d", "window"),
])
def test_bad_table_queries_are_400_naming_the_field(viewer, pool, redis_on, query, field):
    response = viewer.get(f"{BASE}/instances/?{query}")
    assert response.status_code == 400
    assert field in response.json()["errors"]


@pytest.mark.parametrize(("query", "field"), [
    ("since=1e999", "since"), ("since=nan", "since"), ("since=" + "9" * 400, "since"), ("top=65", "top"),
    ("top=-1", "top"), ("rank_by=p50", "rank_by"), ("known=other.1,../x", "known"),
])
def test_bad_metrics_queries_are_400_naming_the_field(viewer, pool, redis_on, query, field):
    response = viewer.get(f"{BASE}/metrics/?{query}")
    assert response.status_code == 400
    assert field in response.json()["errors"]


# --- one instance -----------------------------------------------------------------------------

def test_the_drill_down_has_one_instances_every_figure(viewer, pool, worker_factory):
    _fleet(worker_factory, time.time(), instances=3)
    body = viewer.get(f"{BASE}/instances/{POOL}.2/metrics/?window=5m").json()
    assert body["instance"] == f"{POOL}.2" and body["totals"]["rank_requests"] == 200
    assert {"p99_ms", "rank_per_s", "hbm_hit_ratio", "hbm_bytes", "dram_budget_bytes",
            "preinfer_refused_per_s"} <= set(body["series"])
    assert all(3.7 < v <= 5 for v in body["series"]["p99_ms"] if v is not None)
    since = body["timestamps"][-1]
    poll = viewer.get(f"{BASE}/instances/{POOL}.2/metrics/?window=5m&since={since}").json()
    assert poll["timestamps"][0] == since and len(poll["series"]["p99_ms"]) == len(poll["timestamps"]) <= 2


def test_an_instance_of_another_pool_is_404(viewer, pool, redis_on):
    assert viewer.get(f"{BASE}/instances/other.1/metrics/").status_code == 404
    assert viewer.get(f"{BASE}/instances/other.1/").status_code == 404


def test_one_instances_status(operator, pool, worker_factory):
    operator.post(f"{BASE}/revisions/1/publish/")
    worker = worker_factory(POOL, 3)
    worker.reconcile()
    body = operator.get(f"{BASE}/instances/{POOL}.3/").json()
    assert (body["instance"], body["live"], body["config_state"], body["applied_generation"]) == (
        f"{POOL}.3", True, "ACK", 1)
    assert operator.get(f"{BASE}/instances/{POOL}.4/").status_code == 404


def test_a_history_of_differences_matches_its_snapshots():
    history = InstanceHistory(instance="p.0", step_s=1)

    entries = [(f"{k + 1}-0", {"d": snapshot("p.0", 10 + k, 9.5, rank_requests=3 * k).to_entry()})
               for k in range(5)]
    history.extend(entries, keep_since=0)
    assert np.diff(history.totals[:, COUNTER_COLUMN["rank_requests"]]).tolist() == [0, 3, 3, 3, 3]


def test_a_listed_instance_keeps_its_place_against_a_barely_worse_one():
    from controlplane.telemetry.selectors import _ranked

    names = ["p.0", "p.1", "p.2"]
    pressure = np.array([0.50, 0.51, 0.60])  # p.2 clearly worst, p.1 a hair above p.0
    assert [name for name, _ in _ranked(names, pressure)[:2]] == ["p.2", "p.1"]
    assert [name for name, _ in _ranked(names, pressure, known=("p.0", "p.2"))[:2]] == ["p.2", "p.0"]
    pressure[0] = 0.40  # now clearly better: displaced
    assert [name for name, _ in _ranked(names, pressure, known=("p.0", "p.2"))[:2]] == ["p.2", "p.1"]


@settings(max_examples=40, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 40), st.booleans()), min_size=2, max_size=40), st.integers(0, 3))
def test_decoding_only_each_points_last_sample_sums_the_same(steps, offset):
    """A 24 h chart decodes one 60 s sample in four; restarts (a new ``started_at``) make it decode
    the samples between, so every point sums exactly what decoding every sample would."""

    from controlplane.telemetry.merge import bucketed

    entries, count, started, t0 = [], 0, 1000.0, 240_000.0 + 60 * offset
    for k, (increment, restart) in enumerate(steps):
        ts = t0 + 60 * k + 0.1
        if restart:
            count, started = 0, ts - 0.05
        count += increment
        snap = snapshot("p.0", ts, started, rank_requests=count, hbm_bytes=k)
        entries.append((f"{int(ts * 1000)}-0", {"d": snap.to_entry()}))
    full, thin = InstanceHistory(instance="p.0", step_s=60), InstanceHistory(instance="p.0", step_s=60)
    full.extend(entries, keep_since=0)
    thin.extend(entries, keep_since=0, point_s=240)
    start, n_points = 240_000.0, (len(steps) + offset) // 4 + 2
    full_sums, full_levels = bucketed(full, start, 240, n_points)
    thin_sums, thin_levels = bucketed(thin, start, 240, n_points)
    assert np.array_equal(thin_sums, full_sums)
    assert np.array_equal(np.nan_to_num(thin_levels, nan=-1), np.nan_to_num(full_levels, nan=-1))
    assert len(thin.ts) <= len(full.ts)


# --- the fleet's cache tiers --------------------------------------------------------------------

def _status_tiers(name: str, **cache) -> dict:
    """What a worker's status says of its tiers (``workers.instance.engine_gauges``) under ``cache``."""
    engine = RelayEngine(SMALL, device="cpu", policy=parse_policy({"cache": cache}), name=name)
    try:
        return engine_gauges(engine)["tiers"]
    finally:
        engine.close()


def test_a_pool_running_the_disk_tier_gets_its_column_from_the_statuses_alone(viewer, pool, worker_factory, tmp_path):
    with_disk, without = worker_factory(POOL, 0), worker_factory(POOL, 1)
    with_disk.status.tiers = _status_tiers(with_disk.name, disk={"path": str(tmp_path / "kv"), "budget_mb": 64})
    without.status.tiers = _status_tiers(without.name)
    for worker in (with_disk, without):
        worker.heartbeat()
    body = viewer.get(f"{BASE}/status/").json()
    assert body["tiers"] == ["hbm", "dram", "disk"]
    rows = {row["instance"]: row["tiers"] for row in body["instances"]}
    assert list(rows[with_disk.name]) == ["hbm", "dram", "disk"]
    assert rows[with_disk.name]["disk"] == {"bytes": 0, "budget_bytes": 64 * 2**20}
    assert list(rows[without.name]) == ["hbm", "dram"]
    one = viewer.get(f"{BASE}/instances/{with_disk.name}/").json()
    assert one["tiers"] == rows[with_disk.name]


def test_a_status_an_older_worker_wrote_shows_its_fixed_tiers_in_the_per_tier_shape(viewer, pool, worker_factory,
                                                                                     redis_client):
    worker = worker_factory(POOL, 0)
    worker.heartbeat()
    old = {k: v for k, v in json.loads(worker.status.to_json()).items() if k != "tiers"}
    old.update(hbm_bytes=10, hbm_budget_bytes=20, dram_bytes=30, dram_budget_bytes=40)
    redis_client.set(worker.keys.status(worker.name), json.dumps(old))
    body = viewer.get(f"{BASE}/status/").json()
    assert body["tiers"] == ["hbm", "dram"]
    assert body["instances"][0]["tiers"] == {"hbm": {"bytes": 10, "budget_bytes": 20},
                                             "dram": {"bytes": 30, "budget_bytes": 40}}
    assert body["instances"][0]["error"] == ""


def test_a_page_of_a_256_instance_pool_with_three_tiers_stays_small(viewer, pool, worker_factory, redis_client):
    levels = {"bytes": 3 * 2**30, "budget_bytes": 16 * 2**30}
    pipe = redis_client.pipeline(transaction=False)
    for i in range(256):
        worker = worker_factory(POOL, i)
        worker.status.tiers = {"hbm": levels, "dram": levels, "disk": levels}
        pipe.zadd(worker.keys.members, {worker.name: time.time()})
        pipe.set(worker.keys.status(worker.name), worker.status.to_json())
    pipe.execute()
    response = viewer.get(f"{BASE}/status/?order=problems&limit=50")  # what the fleet page asks for
    body = response.json()
    assert body["total_instances"] == 256 and len(body["instances"]) == 50 and body["tiers"] == ["hbm", "dram", "disk"]
    assert len(response.content) <= 50 * 800  # bytes a row, three tiers included
