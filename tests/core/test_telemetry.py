"""Histograms merge by adding buckets; quantiles come from merged buckets."""

from __future__ import annotations

import random

import pytest

from relay_engine.core.telemetry import (
    LATENCY_BUCKETS_MS,
    REFUSAL_REASONS,
    LatencyHistogram,
    RefusalReason,
    Snapshot,
    quantile_from_counts,
)


def test_buckets_are_log_spaced_and_increasing():
    ratios = [b / a for a, b in zip(LATENCY_BUCKETS_MS, LATENCY_BUCKETS_MS[1:], strict=False)]
    assert all(1.3 < r < 1.4 for r in ratios)


def test_quantile_is_within_one_bucket_of_the_truth():
    rng = random.Random(0)
    values = [rng.lognormvariate(2.5, 0.8) for _ in range(20_000)]
    h = LatencyHistogram()
    for v in values:
        h.record(v)
    true_p99 = sorted(values)[int(0.99 * len(values))]
    assert abs(h.quantile(0.99) - true_p99) / true_p99 < 0.34


def test_merging_then_taking_the_quantile_differs_from_averaging_quantiles():
    fast, slow = LatencyHistogram(), LatencyHistogram()
    for _ in range(990):
        fast.record(1.0)
    for _ in range(10):
        slow.record(1000.0)
    merged = fast.copy()
    merged.merge(slow)
    assert merged.count == 1000
    assert merged.quantile(0.5) < 2.0
    assert quantile_from_counts(merged.counts, 0.995) > 500


def test_snapshot_round_trips():
    h = LatencyHistogram()
    h.record(3.0)
    snap = Snapshot("p.0", 10.0, 1.0, {"rank_ok": 1}, {"not_at_risk": 2}, h, 5, 10, 3, 50.0,
                    tiers={"dram": {"bytes": 0, "budget_bytes": 20}})
    again = Snapshot.from_dict(snap.to_dict())
    assert again == snap


def test_empty_histogram_has_no_quantile():
    assert LatencyHistogram().quantile(0.99) is None


def test_every_refusal_reason_is_counted_and_named():
    assert tuple(RefusalReason) == REFUSAL_REASONS
    assert [r.value for r in REFUSAL_REASONS] == ["not_at_risk", "already_cached", "inflight_limit",
                                                  "token_rate_limit", "cache_budget", "disabled"]  # wire order
    assert all(r.label and r.label != r.value for r in REFUSAL_REASONS if "_" in r.value)
    # the prefix is resident: nothing to pre-infer, nothing for an operator to act on
    assert [r for r in REFUSAL_REASONS if not r.is_refusal] == [RefusalReason.ALREADY_CACHED]


def test_a_snapshot_carries_every_tiers_figures_and_drops_figures_it_does_not_know():
    snap = Snapshot("p.0", 10.0, 1.0, tiers={"disk": {"bytes": 4096, "budget_bytes": 2**30, "corrupt_reads": 1}})
    data = snap.to_dict()
    data["tiers"]["disk"]["a_figure_from_a_newer_worker"] = 7
    assert Snapshot.from_dict(data).tiers == {"disk": {"bytes": 4096, "budget_bytes": 2**30, "corrupt_reads": 1}}


@pytest.mark.parametrize(("tiers", "message"), [
    ({"disk": {"bytes": -1}}, "tiers.disk.bytes"),
    ({"disk": {"bytes": float("nan")}}, "tiers.disk.bytes"),
    ({"no spaces": {}}, "tier names"),
    ({"disk": [1]}, "tiers.disk"),
    ({f"t{i}": {} for i in range(17)}, "at most 16"),
])
def test_bad_tier_figures_are_refused_naming_the_field(tiers, message):
    data = Snapshot("p.0", 10.0, 1.0).to_dict()
    data["tiers"] = tiers
    with pytest.raises(ValueError, match=message):
        Snapshot.from_dict(data)
