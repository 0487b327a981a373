"""Misses by reason on the read side: history columns and rollup fields that difference and sum like
every other count, old snapshots (no ``misses``) read as zeros, and the pool and instance answers
carrying ``misses_by_reason`` (window totals) and ``misses_per_s`` (by reason), typed in the schema."""

from __future__ import annotations

import json
import time

import pytest

from controlplane.telemetry.history import MISS_COLUMN, InstanceHistory, decode_snapshot
from controlplane.telemetry.rollups import decode_rollup
from controlplane.telemetry.selectors import miss_reasons
from relay_engine.core.telemetry import MISS_REASONS, MissReason, rollup_contribution, rollup_miss_field

from .fleet_helpers import snapshot
from .test_telemetry_schema import _answer_schema, _mismatches, _resolved

POOL = "ranking-a"
BASE = f"/api/v1/pools/{POOL}"
EVICTED_HBM, FIRST_VISIT = MissReason.EVICTED_HBM, MissReason.FIRST_VISIT


def _entries(*snapshots, drop_misses: bool = False):
    def raw(snap):
        data = snap.to_dict()
        if drop_misses:
            del data["misses"]
        return json.dumps(data)

    return [(f"{i + 1}-0", {"d": raw(s)}) for i, s in enumerate(snapshots)]


def _missed(history: InstanceHistory, reason: MissReason) -> list[float]:
    return history.deltas[:, MISS_COLUMN[reason]].tolist()


def test_misses_by_reason_difference_and_begin_again_with_a_new_run():
    t0 = 1_000_000.0
    history = InstanceHistory(instance="p.0", step_s=1)
    history.extend(_entries(
        snapshot("p.0", t0, t0 - 100, misses=50, miss_reasons={EVICTED_HBM: 40, FIRST_VISIT: 10}),  # baseline
        snapshot("p.0", t0 + 1, t0 - 100, misses=57, miss_reasons={EVICTED_HBM: 45, FIRST_VISIT: 12}),
        snapshot("p.0", t0 + 2, t0 + 1.5, misses=3, miss_reasons={EVICTED_HBM: 1, FIRST_VISIT: 2}),  # restart
        snapshot("p.0", t0 + 3, t0 + 1.5, misses=9, miss_reasons={EVICTED_HBM: 6, FIRST_VISIT: 3}),
    ), keep_since=0)
    assert _missed(history, EVICTED_HBM) == [0, 5, 1, 5]
    assert _missed(history, FIRST_VISIT) == [0, 2, 2, 1]
    # Over the whole history the reasons add up to the misses counted.
    total = history.totals[-1]
    assert sum(total[MISS_COLUMN[reason]] for reason in MISS_REASONS) == 5 + 2 + 3 + 6


def test_snapshots_from_before_miss_reasons_read_as_no_miss_by_any_reason():
    snap = snapshot("p.0", 12.0, 2.0, rank_requests=4, misses=3)
    data = snap.to_dict()
    del data["misses"]
    _, _, row, _ = decode_snapshot(json.dumps(data))
    assert [row[MISS_COLUMN[reason]] for reason in MISS_REASONS] == [0.0] * len(MISS_REASONS)
    history = InstanceHistory(instance="p.0", step_s=1)
    history.extend(_entries(snapshot("p.0", 100.5, 100.0, misses=3), snapshot("p.0", 101.5, 100.0, misses=7),
                            drop_misses=True), keep_since=0)
    assert history.deltas[:, MISS_COLUMN[EVICTED_HBM]].tolist() == [0.0, 0.0]


def test_the_fast_decoder_reads_misses_by_reason_as_published():
    snap = snapshot("p.0", 12.5, 2.0, misses=6, miss_reasons={reason: i for i, reason in enumerate(MISS_REASONS)})
    _, _, row, _ = decode_snapshot(json.dumps(snap.to_dict()))
    assert [row[MISS_COLUMN[reason]] for reason in MISS_REASONS] == list(range(len(MISS_REASONS)))


def test_a_negative_miss_count_is_judged_by_the_one_decoder_which_names_the_field():
    data = snapshot("p.0", 12.5, 2.0).to_dict()
    data["misses"] = {EVICTED_HBM.value: -1}
    with pytest.raises(ValueError, match="misses"):
        decode_snapshot(json.dumps(data))


def test_rollup_fields_of_misses_by_reason_sum_across_a_restart():
    before = snapshot("p.0", 10, 0, misses=8, miss_reasons={EVICTED_HBM: 8})
    later = snapshot("p.0", 11, 0, misses=11, miss_reasons={EVICTED_HBM: 10, FIRST_VISIT: 1})
    restarted = snapshot("p.0", 12, 11.5, misses=2, miss_reasons={FIRST_VISIT: 2})
    summed: dict[str, int] = {}
    for current, previous in ((later, before), (restarted, later)):
        for name, value in rollup_contribution(current, previous).items():
            summed[name] = summed.get(name, 0) + value
    row, _ = decode_rollup({name: str(value) for name, value in summed.items()})
    assert row[MISS_COLUMN[EVICTED_HBM]] == 2 and row[MISS_COLUMN[FIRST_VISIT]] == 1 + 2
    assert summed[rollup_miss_field(FIRST_VISIT)] == 3


def test_miss_reasons_name_every_reason_in_the_cores_order():
    reasons = miss_reasons()
    assert [r["reason"] for r in reasons] == list(MISS_REASONS)
    assert all(r["label"] == MissReason(r["reason"]).label for r in reasons)
    evicted = [r for r in reasons if r["family"] == EVICTED_HBM.family]
    assert len(evicted) > 1 and {r["detail"] for r in evicted} >= {EVICTED_HBM.detail}
    assert {r["family_label"] for r in evicted} == {EVICTED_HBM.family.replace("_", " ")}


def _publish(worker_factory, now: float) -> None:
    """Two instances for 30 one-second samples: instance 0 misses 2/s evicted from HBM and 1/s on a
    first visit; instance 1 1/s on a first visit, and from before miss reasons its first 10 s."""
    for index in (0, 1):
        worker = worker_factory(POOL, index)
        for i in range(31):
            by_reason = ({EVICTED_HBM: 2 * i, FIRST_VISIT: i} if index == 0 else {FIRST_VISIT: max(0, i - 10)})
            worker.publish_snapshot(snapshot(worker.name, now - 30 + i, now - 40, rank_requests=10 * i,
                                             hbm_hits=10 * i - sum(by_reason.values()),
                                             misses=sum(by_reason.values()), miss_reasons=by_reason))


def test_the_pool_answer_carries_misses_by_reason_and_their_rates(viewer, pool, worker_factory):
    _publish(worker_factory, time.time())
    fleet = viewer.get(f"{BASE}/metrics/?window=5m").json()["fleet"]
    totals = fleet["totals"]
    assert totals["misses_by_reason"][EVICTED_HBM] == 2 * 30
    assert totals["misses_by_reason"][FIRST_VISIT] == 30 + 20
    assert sorted(totals["misses_by_reason"]) == sorted(MISS_REASONS)
    assert totals["misses"] == sum(totals["misses_by_reason"].values())
    assert sorted(fleet["misses_per_s"]) == sorted(MISS_REASONS)
    assert [v for v in fleet["misses_per_s"][EVICTED_HBM] if v] == [2.0] * 30
    assert sum(v or 0 for v in fleet["misses_per_s"][FIRST_VISIT]) == 50
    hit = [v for v in fleet["hit_ratio"] if v is not None]
    assert len(hit) == 30 and all(0 < v < 1 for v in hit)


def test_the_instance_answer_carries_its_own_misses_by_reason(viewer, pool, worker_factory):
    _publish(worker_factory, time.time())
    body = viewer.get(f"{BASE}/instances/{POOL}.1/metrics/?window=5m").json()
    assert body["totals"]["misses_by_reason"][FIRST_VISIT] == 20
    assert body["totals"]["misses_by_reason"][EVICTED_HBM] == 0
    assert sum(v or 0 for v in body["series"]["misses_per_s"][FIRST_VISIT]) == 20


def test_the_schema_types_misses_by_reason_and_the_answers_conform(viewer, pool, worker_factory):
    schema = viewer.get("/api/schema/?format=json").json()
    _publish(worker_factory, time.time())
    for path, url, series in (("/api/v1/pools/{pool}/metrics/", f"{BASE}/metrics/?window=5m", "fleet"),
                              ("/api/v1/pools/{pool}/instances/{instance}/metrics/",
                               f"{BASE}/instances/{POOL}.0/metrics/?window=5m", "series")):
        answer = _resolved(schema, _answer_schema(schema, path))
        figures = _resolved(schema, answer["properties"][series])["properties"]
        assert sorted(_resolved(schema, figures["misses_per_s"])["properties"]) == sorted(MISS_REASONS)
        totals = _resolved(schema, (figures if series == "fleet" else answer["properties"])["totals"])
        assert sorted(_resolved(schema, totals["properties"]["misses_by_reason"])["properties"]) == sorted(MISS_REASONS)
        assert _mismatches(schema, viewer.get(url).json(), _answer_schema(schema, path)) == [], url
