"""Histograms merge by adding buckets; quantiles come from merged buckets; a snapshot packs into a stream
entry and back."""

from __future__ import annotations

import base64
import json
import random
import zlib

import pytest

from relay_engine.core.telemetry import (
    COUNTERS,
    LATENCY_BUCKETS_MS,
    MAX_ENTRY_JSON_BYTES,
    MISS_REASONS,
    PACKED_ENTRY_PREFIX,
    REFUSAL_REASONS,
    LatencyHistogram,
    RefusalReason,
    Snapshot,
    entry_json,
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


# --- the stream entry (field ``d``) -----------------------------------------------------------

def _busy_snapshot() -> Snapshot:
    h = LatencyHistogram()
    for ms in (0.4, 3.0, 3.0, 12.0, 900.0):
        h.record(ms)
    return Snapshot("ranking-a.7", 1_790_000_000.25, 1_789_900_000.5,
                    {name: 1_000_003 * (i + 1) for i, name in enumerate(COUNTERS)},
                    {reason: 17 * (i + 1) for i, reason in enumerate(REFUSAL_REASONS)}, h, 0, 0, 12, 50.0,
                    tiers={"hbm": {"bytes": 700 * 2**20, "budget_bytes": 2**30},
                           "dram": {"bytes": 3 * 2**30, "budget_bytes": 4 * 2**30}},
                    misses={reason: 101 * (i + 1) for i, reason in enumerate(MISS_REASONS)})


def test_a_packed_entry_decodes_to_the_snapshot_it_packs():
    snap = _busy_snapshot()
    assert Snapshot.from_entry(snap.to_entry()) == snap
    assert Snapshot.from_entry(snap.to_entry().encode()) == snap  # a client that does not decode replies


def test_a_packed_entry_is_ascii_text_a_fraction_of_its_json():
    snap = _busy_snapshot()
    entry, plain = snap.to_entry(), json.dumps(snap.to_dict(), separators=(",", ":"))
    assert entry.startswith(PACKED_ENTRY_PREFIX) and entry.isascii()
    assert 0 < len(entry) < len(plain) / 3


def test_an_older_workers_plain_json_entry_still_decodes():
    snap = _busy_snapshot()
    assert entry_json(json.dumps(snap.to_dict())) == json.dumps(snap.to_dict())
    assert Snapshot.from_entry(json.dumps(snap.to_dict())) == snap


def _packed(text: bytes, wbits: int = -12) -> str:
    deflater = zlib.compressobj(9, zlib.DEFLATED, wbits)
    return PACKED_ENTRY_PREFIX + base64.b64encode(deflater.compress(text) + deflater.flush()).decode()


@pytest.mark.parametrize(("entry", "message"), [
    (_busy_snapshot().to_entry()[:-24], "not packed JSON"),  # truncated
    (_busy_snapshot().to_entry()[:len(PACKED_ENTRY_PREFIX) + 40] + "A" * 40, "not packed JSON"),  # corrupt
    (PACKED_ENTRY_PREFIX + "not base64!", "not packed JSON"),
    (PACKED_ENTRY_PREFIX + "é", "not packed JSON"),
    (_busy_snapshot().to_entry() + "AAAA", "not packed JSON"),  # followed by other bytes
])
def test_a_bad_packed_entry_is_refused_naming_what_is_wrong(entry, message):
    with pytest.raises(ValueError, match=message):
        Snapshot.from_entry(entry)


def test_a_zlib_bomb_inflates_no_further_than_the_bound():
    bomb = _packed(b"0" * (64 * MAX_ENTRY_JSON_BYTES))  # 4 MiB of JSON from ~5 KB
    assert len(bomb) < MAX_ENTRY_JSON_BYTES
    with pytest.raises(ValueError, match=f"inflates past {MAX_ENTRY_JSON_BYTES} bytes"):
        entry_json(bomb)
