"""Telemetry read side: differences of cumulative snapshots, merged buckets, dashboard series, /metrics."""

from __future__ import annotations

import json
import math
import time

import numpy as np
import pytest
from prometheus_client.parser import text_string_to_metric_families

from controlplane.policies import services as policy_services
from controlplane.telemetry.history import BUCKET_OFFSET, COUNTER_COLUMN, InstanceHistory
from controlplane.telemetry.merge import quantiles
from controlplane.telemetry.selectors import cache_tiers, lookup_outcomes, window_grid
from relay_engine.core.outcomes import TIERS, Outcome
from relay_engine.core.telemetry import GAUGES, N_BUCKETS, LatencyHistogram, quantile_from_counts
from relay_engine.core.wire import PoolKeys

from .fleet_helpers import snapshot

POOL = "ranking-a"
BASE = f"/api/v1/pools/{POOL}"


def _entries(*snapshots):
    return [(f"{i + 1}-0", {"d": s.to_entry()}) for i, s in enumerate(snapshots)]


@pytest.mark.parametrize("seed", range(5))
def test_vector_quantiles_match_the_engine(seed):
    rng = np.random.default_rng(seed)
    counts = rng.integers(0, 5, size=(20, N_BUCKETS)) * (rng.random((20, N_BUCKETS)) < 0.2)
    counts[0] = 0
    qs = (0.5, 0.9, 0.99)
    for q, got in zip(qs, quantiles(counts, qs), strict=True):
        for row, value in zip(counts, got, strict=True):
            expected = quantile_from_counts(row.tolist(), q)
            assert (expected is None and math.isnan(value)) or value == pytest.approx(expected)


def test_differences_restart_with_a_new_run_and_survive_counter_resets():
    t0 = 1_000_000.0
    history = InstanceHistory(instance="p.0", step_s=1)
    history.extend(_entries(
        snapshot("p.0", t0, t0 - 100, rank_requests=50),          # baseline: run began long ago
        snapshot("p.0", t0 + 1, t0 - 100, rank_requests=60),      # +10
        snapshot("p.0", t0 + 2, t0 + 1.5, rank_requests=4),       # new run: all 4 are new
        snapshot("p.0", t0 + 3, t0 + 1.5, rank_requests=9),       # +5
        snapshot("p.0", t0 + 4, t0 + 1.5, rank_requests=2),       # went down without a restart: reset
    ), keep_since=0)
    assert history.deltas[:, COUNTER_COLUMN["rank_requests"]].tolist() == [0, 10, 4, 5, 2]


def test_first_sample_of_a_fresh_run_counts():
    history = InstanceHistory(instance="p.0", step_s=1)
    history.extend(_entries(snapshot("p.0", 100.5, 100.0, rank_requests=7)), keep_since=0)
    assert history.deltas[0, COUNTER_COLUMN["rank_requests"]] == 7


def test_off_contract_entries_are_skipped():
    history = InstanceHistory(instance="p.0", step_s=1)
    history.extend([("1-0", {"d": "nope"}), ("2-0", {"x": "1"})] + _entries(snapshot("p.0", 5, 4.5, rank_ok=1))[:1],
                   keep_since=0)
    assert history.ts.tolist() == [5]


def test_a_stream_mid_upgrade_reads_plain_and_packed_entries_and_a_corrupt_one_costs_one_sample(redis_client):
    """A rolling upgrade: an older worker's plain JSON entries, then packed ones, in one stream, read
    through the control plane's own client (replies decoded, bytes that are not UTF-8 replaced)."""
    key = PoolKeys(POOL).telemetry("1s", "p.0")
    samples = [snapshot("p.0", 100.0 + k, 50.0, rank_requests=10 * k) for k in range(5)]
    fields = [json.dumps(samples[0].to_dict()), json.dumps(samples[1].to_dict()), samples[2].to_entry(),
              samples[3].to_entry()[:-20], samples[4].to_entry()]  # the fourth truncated
    for k, d in enumerate(fields):
        redis_client.xadd(key, {"d": d}, id=f"{100 + k}000-0")
    history = InstanceHistory(instance="p.0", step_s=1)
    history.extend(redis_client.xrange(key), keep_since=0)
    assert history.ts.tolist() == [100.0, 101.0, 102.0, 104.0]
    assert history.deltas[:, COUNTER_COLUMN["rank_requests"]].tolist() == [0, 10, 10, 20]


def test_window_grid_caps_points_and_aligns_to_the_tier():
    assert window_grid("5m", 1000.5)[:2] == ("1s", 1)
    assert window_grid("1h", 1000.5)[:2] == ("10s", 10)
    tier, step, start, n = window_grid("24h", 1_700_000_000.0)
    assert (tier, step, n) == ("60s", 240, 360)
    assert start % step == 0


def _publish_two_instances(worker_factory, now):
    """Instance 0 is fast (1 ms), instance 1 slow (40 ms, 9x the traffic) for 30 one-second samples."""
    fast, slow = worker_factory(POOL, 0), worker_factory(POOL, 1)
    started = now - 40
    fast_hist, slow_hist = LatencyHistogram(), LatencyHistogram()
    totals = {"fast": 0, "slow": 0}
    for i in range(31):
        ts = now - 30 + i
        if i:
            for _ in range(10):
                fast_hist.record(1.0)
            for _ in range(90):
                slow_hist.record(40.0)
            totals["fast"] += 10
            totals["slow"] += 90
        for worker, hist, n, within in ((fast, fast_hist, totals["fast"], totals["fast"]),
                                        (slow, slow_hist, totals["slow"], 0)):
            snap = snapshot(worker.name, ts, started, rank_requests=n, rank_within_slo=within, hbm_hits=n,
                            misses=n // 10, preinfer_admitted=i, refusals={"inflight_limit": 2 * i},
                            hbm_bytes=1000 * i, hbm_budget_bytes=50_000)
            snap.rank_latency = hist.copy()
            worker.publish_snapshot(snap)
    return fast, slow


def test_metrics_merge_histograms_before_taking_quantiles(viewer, pool, worker_factory):
    now = time.time()
    _publish_two_instances(worker_factory, now)
    body = viewer.get(f"{BASE}/metrics/?window=5m").json()
    assert (body["tier"], body["step_s"]) == ("1s", 1)
    fleet = body["fleet"]
    # 90 % of requests take 40 ms: the merged p50 and p99 sit in the 40 ms bucket, not halfway
    # between the instances' own p99s (1 ms and 40 ms), as averaging would give.
    p99 = [v for v in fleet["p99_ms"] if v is not None]
    p50 = [v for v in fleet["p50_ms"] if v is not None]
    assert len(p99) == 30
    assert all(37 < v <= 50 for v in p99 + p50)  # the (37.5, 50] bucket holding 40 ms
    assert fleet["totals"]["rank_requests"] == 3000
    assert fleet["totals"]["slo_compliance_ratio"] == pytest.approx(0.1)
    assert fleet["totals"]["preinfer_refused"]["inflight_limit"] == 2 * 2 * 30
    rates = [v for v in fleet["rank_per_s"] if v]
    assert rates == [100.0] * 30
    assert {round(v, 3) for v in fleet["hbm_hit_ratio"] if v is not None} == {round(100 / 110, 3)}
    newest = {k: [v for v in fleet[k] if v is not None][-1] for k in ("instances", "hbm_bytes", "hbm_budget_bytes")}
    assert newest == {"instances": 2, "hbm_bytes": 2 * 30_000, "hbm_budget_bytes": 2 * 50_000}
    assert len(body["timestamps"]) == len(fleet["p99_ms"]) == 300


def test_the_worst_instances_come_first_with_their_own_series(viewer, pool, worker_factory):
    _publish_two_instances(worker_factory, time.time())
    top = viewer.get(f"{BASE}/metrics/?window=5m").json()["top"]
    assert (top["by"], top["n"], top["reporting"]) == ("p99", 8, 2)
    slow, fast = top["instances"]
    assert (slow["instance"], fast["instance"]) == (f"{POOL}.1", f"{POOL}.0")
    assert 37 < slow["value"] <= 50 and fast["value"] < 2
    assert all(v < 2 for v in fast["p99_ms"] if v is not None)
    assert max(v for v in slow["hbm_bytes"] if v is not None) == 30_000
    assert {v for v in slow["hbm_budget_bytes"] if v is not None} == {50_000}


def test_top_n_is_bounded_by_the_request(viewer, pool, worker_factory):
    _publish_two_instances(worker_factory, time.time())
    body = viewer.get(f"{BASE}/metrics/?window=5m&top=1").json()
    assert [i["instance"] for i in body["top"]["instances"]] == [f"{POOL}.1"]
    assert "top" not in viewer.get(f"{BASE}/metrics/?window=5m&top=0").json()


def test_metrics_are_read_incrementally(viewer, pool, worker_factory):
    now = time.time() - 5
    fast, _ = _publish_two_instances(worker_factory, now)
    first = viewer.get(f"{BASE}/metrics/?window=5m").json()["fleet"]["totals"]["rank_requests"]
    snap = snapshot(fast.name, now + 1, now - 40, rank_requests=300 + 50)
    fast.publish_snapshot(snap)
    second = viewer.get(f"{BASE}/metrics/?window=5m").json()["fleet"]["totals"]["rank_requests"]
    assert second == first + 50


def test_publishes_appear_as_annotations(operator, pool, redis_on):
    operator.post(f"{BASE}/revisions/", {"parent_generation": 1, "spec": {}}, format="json")
    operator.post(f"{BASE}/revisions/2/publish/")
    operator.post(f"{BASE}/rollback/", {"to_generation": 1, "parent_generation": 2}, format="json")
    annotations = operator.get(f"{BASE}/metrics/?window=1h").json()["annotations"]
    assert [(a["generation"], a["kind"], a["actor"], a["label"]) for a in annotations] == [
        (1, "created", "fixture", "gen 1"), (2, "publish", "operator", "gen 2"),
        (3, "rollback", "operator", "rollback gen 3")]
    assert annotations[2]["detail"] == "Rollback by operator: generation 3 restores generation 1"


def test_a_canarys_start_and_end_appear_as_annotations_and_its_promotion_once(operator, pool, worker_factory):
    policy_services.desired_push(pool=pool)
    for index in range(2):
        worker_factory(POOL, index).reconcile()
    canary = {"strategy": "canary", "canary_instances": 1, "bake_s": 600, "max_burn": 1.0}
    for generation, end in ((2, "abort"), (3, "promote")):
        operator.post(f"{BASE}/revisions/", {"parent_generation": generation - 1, "spec": {}}, format="json")
        assert operator.post(f"{BASE}/revisions/{generation}/publish/", canary, format="json").status_code == 201
        assert operator.post(f"{BASE}/rollout/{end}/").status_code == 200
    annotations = operator.get(f"{BASE}/metrics/?window=5m").json()["annotations"]
    assert [(a["generation"], a["kind"], a["label"]) for a in annotations] == [
        (1, "created", "gen 1"), (2, "canary", "canary gen 2"), (2, "aborted", "aborted gen 2"),
        (3, "canary", "canary gen 3"), (3, "promoted", "promoted gen 3")]
    assert annotations[1]["detail"] == ("Canary of generation 2 started by operator on ranking-a.0 "
                                        "(bake 600 s, max burn 1.0)")
    assert annotations[2]["detail"] == "Canary of generation 2 aborted by operator"


@pytest.mark.parametrize("window", ["2h", "5M", "1h;drop", "24"])
def test_unknown_window_is_400_listing_the_allowed(viewer, pool, redis_on, window):
    response = viewer.get(f"{BASE}/metrics/", {"window": window})
    assert response.status_code == 400
    assert "5m, 1h, 6h, 24h" in response.json()["errors"]["window"][0]


def test_empty_pool_has_null_series(viewer, pool, redis_on):
    body = viewer.get(f"{BASE}/metrics/?window=6h").json()
    assert body["top"]["instances"] == [] and body["top"]["reporting"] == 0
    assert set(body["fleet"]["p99_ms"]) == {None}
    assert body["slo_ms"] == 50.0


def test_prometheus_exposition_parses_with_histograms(viewer, pool, worker_factory):
    now = time.time()
    fast, slow = _publish_two_instances(worker_factory, now)
    fast.reconcile()
    response = viewer.get("/metrics")
    assert response.status_code == 200
    assert response["Content-Type"].startswith("text/plain")
    families = {f.name: f for f in text_string_to_metric_families(response.content.decode())}
    latency = families["relaygr_rank_latency_seconds"]
    samples = {(s.name, s.labels.get("instance"), s.labels.get("le")): s.value for s in latency.samples}
    assert samples[("relaygr_rank_latency_seconds_count", slow.name, None)] == 2700
    assert samples[("relaygr_rank_latency_seconds_bucket", slow.name, "+Inf")] == 2700
    assert samples[("relaygr_rank_latency_seconds_sum", slow.name, None)] == pytest.approx(2700 * 0.040)
    requests = {s.labels["instance"]: s.value for s in families["relaygr_rank_requests"].samples
                if s.name == "relaygr_rank_requests_total"}
    assert requests == {fast.name: 300, slow.name: 2700}
    refusals = [s for s in families["relaygr_preinfer_refusals"].samples
                if s.labels["reason"] == "inflight_limit" and s.labels["instance"] == fast.name]
    assert refusals[0].value == 60
    assert families["relaygr_pool_desired_generation"].samples[0].value == 1
    assert families["relaygr_redis_up"].samples[0].value == 1
    up = {s.labels["instance"]: s.value for s in families["relaygr_instance_up"].samples}
    assert up == {fast.name: 1}


def test_prometheus_shows_every_cache_tier_through_the_generic_tier_series(viewer, pool, worker_factory):
    worker = worker_factory(POOL, 0)
    now = time.time()
    snap = snapshot(worker.name, now, now - 10, rank_requests=3, disk_hits=2)
    snap.tiers = {"hbm": {"bytes": 700, "budget_bytes": 1000, "hits": 5},
                  "disk": {"bytes": 4096, "budget_bytes": 2**30, "hits": 2, "failed_writes": 1, "corrupt_reads": 1}}
    worker.publish_snapshot(snap)
    families = {f.name: f for f in text_string_to_metric_families(viewer.get("/metrics").content.decode())}

    def series(family: str, sample: str) -> dict[str, float]:
        return {s.labels["tier"]: s.value for s in families[family].samples
                if s.name == sample and s.labels["instance"] == worker.name}

    assert series("relaygr_tier_bytes", "relaygr_tier_bytes") == {"hbm": 700, "disk": 4096}
    assert series("relaygr_tier_budget_bytes", "relaygr_tier_budget_bytes") == {"hbm": 1000, "disk": 2**30}
    assert series("relaygr_tier_hits", "relaygr_tier_hits_total") == {"hbm": 5, "disk": 2}
    assert series("relaygr_tier_failed_writes", "relaygr_tier_failed_writes_total") == {"hbm": 0, "disk": 1}
    disk_hits = [s.value for s in families["relaygr_disk_hits"].samples if s.name == "relaygr_disk_hits_total"]
    assert disk_hits == [2]


def test_prometheus_names_each_instances_tier_levels_from_its_status_as_before(viewer, pool, worker_factory):
    """``relaygr_instance_<tier>_bytes`` / ``…_budget_bytes`` keep their names (``hbm``, ``dram``) and
    come from the status's per-tier levels: a disk tier gets its own with no code of its own."""
    with_disk, without = worker_factory(POOL, 0), worker_factory(POOL, 1)
    with_disk.status.tiers = {"hbm": {"bytes": 1, "budget_bytes": 2}, "dram": {"bytes": 3, "budget_bytes": 4},
                              "disk": {"bytes": 5, "budget_bytes": 6}}
    without.status.tiers = {"hbm": {"bytes": 7, "budget_bytes": 8}, "dram": {"bytes": 9, "budget_bytes": 10}}
    for worker in (with_disk, without):
        worker.heartbeat()
    families = {f.name: f for f in text_string_to_metric_families(viewer.get("/metrics").content.decode())}

    def gauge(name: str) -> dict[str, float]:
        return {s.labels["instance"]: s.value for s in families[f"relaygr_instance_{name}"].samples}

    assert gauge("hbm_bytes") == {with_disk.name: 1, without.name: 7}
    assert gauge("dram_budget_bytes") == {with_disk.name: 4, without.name: 10}
    assert gauge("disk_bytes") == {with_disk.name: 5}  # only the instance that runs it


def _publish_with_and_without_disk(worker_factory, now):
    """Instance 0 runs a disk tier (1 GiB, 4 KiB used), instance 1 none; 20 one-second samples, each
    second 10 lookups on 0 (6 HBM hits, 3 disk hits, 1 miss) and 10 HBM hits on 1."""
    with_disk, without = worker_factory(POOL, 0), worker_factory(POOL, 1)
    started = now - 30
    for i in range(21):
        ts = now - 20 + i
        snap = snapshot(with_disk.name, ts, started, rank_requests=10 * i, hbm_hits=6 * i, disk_hits=3 * i, misses=i)
        snap.tiers = {"hbm": {"bytes": 700, "budget_bytes": 1000}, "dram": {"bytes": 0, "budget_bytes": 2000},
                      "disk": {"bytes": 4096, "budget_bytes": 2**30, "hits": 3 * i}}
        with_disk.publish_snapshot(snap)
        snap = snapshot(without.name, ts, started, rank_requests=10 * i, hbm_hits=10 * i)
        snap.tiers = {"hbm": {"bytes": 300, "budget_bytes": 1000}, "dram": {"bytes": 0, "budget_bytes": 2000}}
        without.publish_snapshot(snap)
    return with_disk, without


def _newest(values: list) -> object:
    return [v for v in values if v is not None][-1]


def test_the_pool_series_carry_every_tiers_levels_and_every_outcomes_share(viewer, pool, worker_factory):
    _publish_with_and_without_disk(worker_factory, time.time())
    fleet = viewer.get(f"{BASE}/metrics/?window=5m&top=0").json()["fleet"]
    newest = {name: _newest(fleet[name]) for name in ("hbm_bytes", "hbm_budget_bytes", "disk_bytes", "disk_budget_bytes")}
    assert newest == {"hbm_bytes": 1000, "hbm_budget_bytes": 2000, "disk_bytes": 4096, "disk_budget_bytes": 2**30}
    shares = fleet["lookup_ratio"]
    assert set(shares) == {outcome.value for outcome in Outcome}
    points = [i for i, v in enumerate(shares["disk"]) if v is not None]
    assert len(points) >= 10
    assert {round(shares["disk"][i], 6) for i in points} == {0.15}  # 3 of the pool's 20 lookups a second
    assert {round(shares["hbm"][i] + shares["miss"][i] + shares["disk"][i], 6) for i in points} == {1.0}


def test_an_instances_series_carry_its_disk_tier_and_one_without_reads_zero(viewer, pool, worker_factory):
    with_disk, without = _publish_with_and_without_disk(worker_factory, time.time())
    own = viewer.get(f"{BASE}/instances/{with_disk.name}/metrics/?window=5m").json()["series"]
    assert (_newest(own["disk_bytes"]), _newest(own["disk_budget_bytes"])) == (4096, 2**30)
    assert {round(v, 6) for v in own["lookup_ratio"]["disk"] if v is not None} == {0.3}
    other = viewer.get(f"{BASE}/instances/{without.name}/metrics/?window=5m").json()["series"]
    assert (_newest(other["disk_bytes"]), _newest(other["disk_budget_bytes"])) == (0, 0)


def test_the_pages_get_every_outcome_and_every_tier_from_the_server():
    outcomes = [o["outcome"] for o in lookup_outcomes()]
    assert outcomes == [o.value for o in Outcome] and all(o["label"] for o in lookup_outcomes())
    tiers = cache_tiers()
    assert [t["tier"] for t in tiers] == [t.value for t in TIERS]
    assert {name for t in tiers for name in (t["bytes"], t["budget_bytes"])} <= set(GAUGES)


def test_prometheus_without_redis_still_reports_the_database(viewer, pool, no_redis):
    families = {f.name: f for f in text_string_to_metric_families(viewer.get("/metrics").content.decode())}
    assert families["relaygr_redis_up"].samples[0].value == 0
    assert families["relaygr_pool_desired_generation"].samples[0].value == 1


def test_bucket_columns_line_up_with_the_engine():
    hist = LatencyHistogram()
    hist.record(3.0)
    history = InstanceHistory(instance="p.0", step_s=1)
    snap = snapshot("p.0", 10, 9.5)
    snap.rank_latency = hist
    history.extend(_entries(snap), keep_since=0)
    assert history.deltas[0, BUCKET_OFFSET:BUCKET_OFFSET + N_BUCKETS].tolist() == hist.counts
