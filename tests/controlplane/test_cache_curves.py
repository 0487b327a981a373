"""``GET /api/v1/pools/{pool}/cache-curves/``: hit ratio against HBM budget, each lower tier's budget and the
entry TTL, from the pool's captured traffic, beside what the instances measured over the same window."""

from __future__ import annotations

import random
import time

import pytest

from controlplane.previews import cache_curves
from relay_engine.core.capture import CaptureRecord, capture_key, user_hash
from relay_engine.core.wire import PoolKeys

pytestmark = pytest.mark.integration
KEY = capture_key("a capture secret of the curve tests, not a real one", "ranking-a")


def write_capture(client, pool: str, *, n: int, qps: float, end_s: float, users: int = 60, seed: int = 0,
                  instances: int = 2) -> None:
    """n requests ending ``end_s``, Zipf-like users, each served by its own instance (as the router would)."""
    rng = random.Random(seed)
    weights = [1 / (u + 1) for u in range(users)]
    pipe = client.pipeline(transaction=False)
    for i in range(n):
        ts_ms = (end_s - (n - i) / qps) * 1000
        user = rng.choices(range(users), weights)[0]
        record = CaptureRecord(ts_ms=ts_ms, user=user_hash(KEY, f"user-{user}"), prefix_len=200 + 10 * (user % 7),
                               short_len=8, candidates=64, gap_ms=None, outcome=("hbm", "miss")[i % 2],
                               latency_ms=5.0, instance=f"{pool}.{user % instances}" if instances else "")
        pipe.xadd(PoolKeys(pool).traffic, record.to_fields(), id=f"{int(ts_ms)}-{i}")
    pipe.execute()


def test_curves_of_the_window_with_the_live_point_and_the_measured_hit_ratio(viewer, pool, redis_client):
    write_capture(redis_client, pool.name, n=800, qps=5, end_s=time.time() - 1)
    response = viewer.get(f"/api/v1/pools/{pool.name}/cache-curves/?window=15m")
    assert response.status_code == 200, response.content
    body = response.json()
    assert body["requests"] == body["requests_used"] == 800 and body["sampling_rate"] == 1.0
    assert body["entries_whole"] == 0
    assert body["window"] == "15m" and body["without_instance"] == 0
    assert set(body["axes"]) == {"hbm", "dram", "entry_ttl"}
    assert [t["name"] for t in body["tiers"]] == ["hbm", "dram"]
    hbm = body["axes"]["hbm"]
    assert hbm[0]["budget_mb"] == 0 and hbm[0]["hit_ratio"] == 0
    # HBM's share grows with its budget (the total need not: HBM's TTL runs from insertion, DRAM's is longer).
    assert all(a["tiers"]["hbm"] <= b["tiers"]["hbm"] + 1e-9 for a, b in zip(hbm, hbm[1:], strict=False))
    assert hbm[-1]["tiers"]["hbm"] > hbm[1]["tiers"]["hbm"]
    assert any(p["budget_mb"] == body["live"]["hbm_budget_mb"] for p in hbm)
    assert set(hbm[-1]["tiers"]) == {"hbm", "dram"}
    # 60 users' prefixes fit the default 1 GiB: hits but each user's first request and HBM's expiries.
    assert body["live"]["hit_ratio"] > 0.8
    assert body["measured_hit_ratio"] == 0.5
    assert body["error_points"] == pytest.approx((body["live"]["hit_ratio"] - 0.5) * 100, abs=0.01)
    assert body["elapsed_ms"] >= 0 and body["model"]["reported"] is False


def test_records_without_an_instance_share_one_stack_and_are_counted(viewer, pool, redis_client):
    write_capture(redis_client, pool.name, n=100, qps=5, end_s=time.time() - 1, instances=0)
    body = viewer.get(f"/api/v1/pools/{pool.name}/cache-curves/?window=1m").json()
    assert body["without_instance"] == body["requests"] > 0


def test_no_captured_traffic_in_the_window_is_a_409_naming_it_and_what_the_capture_holds(viewer, pool, redis_client):
    write_capture(redis_client, pool.name, n=50, qps=5, end_s=time.time() - 1800)
    response = viewer.get(f"/api/v1/pools/{pool.name}/cache-curves/?window=5m")
    assert response.status_code == 409
    detail = response.json()["detail"]
    assert "last 5m" in detail and "holds 50 requests" in detail


@pytest.mark.parametrize("window", ["2h", "30s", "abc"])
def test_a_window_out_of_range_is_a_400_naming_the_field_and_the_range(viewer, pool, redis_on, window):
    response = viewer.get(f"/api/v1/pools/{pool.name}/cache-curves/?window={window}")
    assert response.status_code == 400
    assert "window" in response.json()["errors"] and "1m" in response.json()["detail"]


@pytest.mark.parametrize(("role", "status"), [("anonymous", 401), ("norole", 403), ("viewer", 200), ("operator", 200)])
def test_curves_are_read_by_viewers_and_up(clients, pool, redis_client, role, status):
    write_capture(redis_client, pool.name, n=50, qps=5, end_s=time.time() - 1)
    assert clients[role].get(f"/api/v1/pools/{pool.name}/cache-curves/?window=1m").status_code == status


def test_the_default_model_dimensions_are_the_models_own():
    from relay_engine.core.model import ModelConfig

    assert ModelConfig().fingerprint() == cache_curves.DEFAULT_FINGERPRINT


def test_a_miss_the_trigger_refused_for_its_load_is_not_pre_inferred_at_any_budget():
    """The capture's miss reason decides: a load limit or a late computation loses the pre-inference
    whatever the budget; a refusal for the cache budget's share depends on the budget, so it counts as
    admitted, as does a request with no reason (a hit, or a miss for the cache's own reasons)."""
    from relay_engine.core.config import PolicySpec
    from relay_engine.core.telemetry import MissReason

    spec = PolicySpec()
    at_risk = spec.trigger.effective_at_risk_seq_len()
    reasons = ["", MissReason.NOT_ADMITTED_INFLIGHT_LIMIT, MissReason.NOT_ADMITTED_TOKEN_RATE_LIMIT,
               MissReason.TOO_LATE, MissReason.NOT_ADMITTED_CACHE_BUDGET, MissReason.EVICTED_HBM]
    records = [CaptureRecord(ts_ms=1000.0 * i, user=user_hash(KEY, f"user-{i}"), prefix_len=at_risk, short_len=8,
                             candidates=64, gap_ms=20.0, outcome="miss" if reason else "hbm", latency_ms=5.0,
                             miss_reason=str(reason), instance="p.0")
               for i, reason in enumerate(reasons)]
    requests = cache_curves.requests_of(records, spec, cache_curves.DEFAULT_FINGERPRINT)
    assert requests.preinferred.tolist() == [True, False, False, False, True, True]
