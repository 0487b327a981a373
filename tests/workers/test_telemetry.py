"""Telemetry from real workers: a snapshot a second per instance, and bounded keys in Redis."""

from __future__ import annotations

import json
import time

import pytest
import redis

from relay_engine.core.forward_times import ForwardTimesRecord, length_bucket
from relay_engine.core.telemetry import COUNTERS, REFUSAL_REASONS, Snapshot
from relay_engine.core.wire import (
    FORWARD_TIMES_COARSE_EVERY_S,
    FORWARD_TIMES_COARSE_KEPT,
    FORWARD_TIMES_EVERY_S,
    FORWARD_TIMES_KEPT,
    STATUS_TTL_S,
    TELEMETRY_TIERS,
)
from tests.workers.fleet import Fleet, wait_for

pytestmark = pytest.mark.integration


def snapshots(fleet, name: str, count: int) -> list[Snapshot]:
    entries = fleet.redis.xrevrange(fleet.keys.telemetry("1s", name), count=count)
    return [Snapshot.from_entry(fields["d"]) for _, fields in reversed(entries)]


def test_each_instance_publishes_a_cumulative_snapshot_every_second(fleet):
    for i in range(5):
        fleet.client.rank(f"telemetry-{i}", seq_len=32, short_len=2, n_candidates=4)
    time.sleep(3.2)
    for name in fleet.names:
        recent = snapshots(fleet, name, 3)
        gaps = [b.ts - a.ts for a, b in zip(recent, recent[1:], strict=False)]
        assert all(0.5 < gap < 1.5 for gap in gaps), gaps
        last = recent[-1]
        assert last.instance == name and set(COUNTERS) <= set(last.counters)
        assert set(REFUSAL_REASONS) <= set(last.refusals)
        assert last.rank_latency.count == last.counters["rank_ok"]
        assert last.applied_generation == fleet.status(name).applied_generation
        assert last.started_at == recent[0].started_at  # cumulative since this instance started
    assert sum(snapshots(fleet, n, 1)[0].counters["rank_ok"] for n in fleet.names) >= 5


def test_telemetry_streams_are_trimmed_to_their_tier_and_expire(fleet):
    name = fleet.names[0]
    key = fleet.keys.telemetry("1s", name)
    kept = TELEMETRY_TIERS["1s"][1]
    # A run longer than the tier keeps, and its length, in one transaction: the instance's own next snapshot
    # (which trims) cannot land between the two.
    pipe = fleet.redis.pipeline(transaction=True)
    for i in range(kept + 200):
        pipe.xadd(key, {"d": json.dumps({"instance": name, "ts": i})})
    pipe.xlen(key)
    assert pipe.execute()[-1] > kept
    last_id = fleet.redis.xrevrange(key, count=1)[0][0]
    wait_for(lambda: fleet.redis.xrevrange(key, count=1)[0][0] != last_id, 2.5, what="the next snapshot")
    assert fleet.redis.xlen(key) == kept
    for tier, (every_s, tier_kept) in TELEMETRY_TIERS.items():
        for n in fleet.names:
            ttl = fleet.redis.ttl(fleet.keys.telemetry(tier, n))
            assert 0 < ttl <= every_s * tier_kept


def test_every_key_the_fleet_writes_is_bounded(fleet):
    """Nothing grows without bound: each key has a TTL, or is one of the fixed per-pool/instance keys."""
    fixed = {fleet.keys.members, fleet.keys.desired, fleet.keys.reporting}  # the sets are pruned by score
    fixed |= {fleet.keys.rank_queue(n) for n in fleet.names}  # the signal lists expire (workers.signals)
    unbounded = []
    for key in fleet.redis.scan_iter(f"{fleet.settings.key_prefix}*"):
        if key in fixed:
            continue
        ttl = fleet.redis.ttl(key)
        if ttl < 0:
            unbounded.append(key)
    assert unbounded == []
    for name in fleet.names:
        assert 0 < fleet.redis.ttl(fleet.keys.status(name)) <= STATUS_TTL_S
    assert fleet.redis.zcard(fleet.keys.members) == len(fleet.names)


def test_the_pool_rollup_adds_up_every_instances_counts(fleet):
    """Over whole seconds, the rollup holds exactly the instances' own counts (differences of their
    cumulative snapshots), each instance reporting into a second at most once."""
    for i in range(6):
        fleet.client.rank(f"rollup-{i}", seq_len=32, short_len=2, n_candidates=4)
    real = {name: [s for s in snapshots(fleet, name, 600) if s.counters] for name in fleet.names}
    first = max(int(snaps[0].ts) + 1 for snaps in real.values())  # every instance published before it
    time.sleep(max(0.0, first + 5 - time.time()))
    last = int(time.time()) - 1
    published = {name: [s for s in snapshots(fleet, name, 600) if s.counters] for name in fleet.names}
    rolled = [fleet.redis.hgetall(fleet.keys.rollup("1s", t)) for t in range(first, last)]
    reported = [int(r.get("instances", 0)) for r in rolled]
    # Each instance reports into a second at most once (a busy one may skip a second: its next write carries it).
    assert max(reported) == len(fleet.names) and all(n <= len(fleet.names) for n in reported)
    own = 0
    for snaps in published.values():
        base = [s for s in snaps if s.ts < first][-1]
        end = [s for s in snaps if s.ts < last][-1]
        own += end.counters["rank_requests"] - base.counters["rank_requests"]
    assert sum(int(r.get("rank_requests", 0)) for r in rolled) == own
    assert fleet.redis.zcard(fleet.keys.reporting) == len(fleet.names)


@pytest.fixture
def fresh_fleet(redis_url, tmp_path):
    """Instances that have run no forward yet (the module's fleet has)."""
    pool = Fleet(redis_url, tmp_path, size=2)
    try:
        yield pool.start()
    finally:
        pool.stop()


def test_each_instance_publishes_its_forward_times_with_their_shapes(fresh_fleet):
    """The real model's forwards, timed on the instance: a cold user's full rank at its length, at once
    (an instance's first forwards are not held for the 30 s period), in a bounded stream of their own."""
    fleet = fresh_fleet
    ranked = {}
    for i in range(6):
        user = f"forwards-{i}"
        ranked[user] = fleet.client.rank(user, seq_len=96, short_len=3, n_candidates=5)

    raw = redis.Redis.from_url(fleet.settings.redis_url)  # the records are deflated bytes

    def records(coarse: bool = False):
        out = {}
        for name in fleet.names:
            entries = raw.xrevrange(fleet.keys.forward_times(name, coarse=coarse), count=1)
            if entries:
                out[name] = ForwardTimesRecord.from_entry(entries[0][1])
        return out

    def full_ranks():
        # The first forwards go out at once; those after them with the next 30 s record.
        got = records()
        return got if any(m.count for r in got.values() for m in r.times.means()
                          if (m.op, m.bucket) == ("rank_full", length_bucket(96))) else None

    got = wait_for(full_ranks, 5.0, interval_s=0.1, what="a forward-time record of the full ranks")
    for name, record in got.items():
        assert record.instance == name and record.clock == "thread_cpu" and record.device == "cpu"
        assert record.started_at == fleet.status(name).started_at
        for mean in record.times.means():
            if (mean.op, mean.bucket) == ("rank_full", length_bucket(96)):
                assert (round(mean.n), round(mean.s), round(mean.c)) == (96, 3, 5) and mean.mean_ms > 0
        # The short stream for windows of a few minutes, the long one, its first record written with the
        # first, for an hour's: both bounded, both expire.
        for coarse, every_s, kept in ((False, FORWARD_TIMES_EVERY_S, FORWARD_TIMES_KEPT),
                                      (True, FORWARD_TIMES_COARSE_EVERY_S, FORWARD_TIMES_COARSE_KEPT)):
            key = fleet.keys.forward_times(name, coarse=coarse)
            assert 0 < fleet.redis.ttl(key) <= every_s * (kept + 1) and fleet.redis.xlen(key) <= kept
    assert set(records(coarse=True)) == set(fleet.names)
    raw.close()
