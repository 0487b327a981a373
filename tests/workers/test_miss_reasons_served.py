"""Every miss has a reason, on real workers: a pool driven through the policies and events that make
each reason (a first visit, an HBM budget for one prefix with no DRAM under it, a short TTL, a stricter
trigger, an edit publish, an instance joining), its published telemetry read back from Redis, and the
capture's records of the same requests.

Each step waits on what it needs (an ACK, a refusal in telemetry, the joiner's second heartbeat), never
on a guess of how long the pool takes.
"""

from __future__ import annotations

import time
from collections import Counter

import pytest

from relay_engine.core.capture import CaptureRecord
from relay_engine.core.outcomes import Outcome
from relay_engine.core.telemetry import MissReason, RefusalReason, Snapshot
from tests.workers.fleet import Fleet, wait_for
from tests.workers.test_editing_served import acked, edit_spec
from workers.client import RankReply
from workers.settings import MODELS

pytestmark = pytest.mark.integration

CONVERGE_S = 5.0
REQUEST = {"short_len": 4, "n_candidates": 8}
SEQ_LEN = 96
LONG_SEQ_LEN = 600  # above the default trigger's at_risk_seq_len (512): only a stricter trigger refuses it
TTL_MS = 200
PER_PREFIX_MB = MODELS["small"].kv_bytes_per_token() * SEQ_LEN / 2**20
MOVED_USERS = 3
# The misses the steps below make, by reason (each user's first request is a first visit, but for the
# refused one's and the moved ones').
EXPECTED_MISSES = {MissReason.FIRST_VISIT: 5, MissReason.EVICTED_HBM: 1, MissReason.EXPIRED: 1,
                   MissReason.NOT_ADMITTED_NOT_AT_RISK: 1, MissReason.EDIT_CHANGED: 1,
                   MissReason.REROUTED: MOVED_USERS}


@pytest.fixture
def pool(redis_url, tmp_path):
    fleet = Fleet(redis_url, tmp_path, pool="reasons", size=1)
    try:
        yield fleet.start()
    finally:
        fleet.stop()


def latest_snapshot(fleet: Fleet, name: str) -> Snapshot | None:
    entries = fleet.redis.xrevrange(fleet.keys.telemetry("1s", name), count=1)
    return Snapshot.from_entry(entries[0][1]["d"]) if entries else None


def refused_not_at_risk(fleet: Fleet, name: str) -> int:
    snapshot = latest_snapshot(fleet, name)
    return 0 if snapshot is None else snapshot.refusals.get(RefusalReason.NOT_AT_RISK, 0)


def captured(fleet: Fleet) -> list[CaptureRecord]:
    return [CaptureRecord.from_fields(data) for _, data in fleet.redis.xrange(fleet.keys.traffic)]


def test_misses_by_reason_sum_to_the_misses_counted_with_each_reason_produced_on_real_workers(pool):
    [first] = pool.names
    answered: Counter[str] = Counter()  # ranking requests answered, by instance

    def rank(user: str, seq_len: int = SEQ_LEN) -> RankReply:
        reply = pool.client.rank(user, seq_len=seq_len, deadline_s=time.time() + 30, **REQUEST)
        answered[reply.instance] += 1
        return reply

    def apply(spec: dict) -> None:
        generation = pool.publish(spec)
        wait_for(lambda: acked(pool, generation), CONVERGE_S, what=f"ACK of generation {generation}: {spec}")

    assert rank("first-visit").source == Outcome.MISS

    apply({"cache": {"hbm_budget_mb": 1.5 * PER_PREFIX_MB, "dram_budget_mb": 0}})  # room for one, none under it
    rank("evicted-a")
    rank("evicted-b")  # pushes evicted-a out of HBM, and out of the pool's tiers
    assert rank("evicted-a").source == Outcome.MISS

    apply({"cache": {"entry_ttl_ms": TTL_MS, "dram_ttl_ms": TTL_MS}})
    rank("expired")
    # The entry was made before its reply came: once the TTL has passed since, it is past it for sure.
    time.sleep(2 * TTL_MS / 1000)
    assert rank("expired").source == Outcome.MISS

    apply({"trigger": {"at_risk_seq_len": 2 * LONG_SEQ_LEN}})
    refused = refused_not_at_risk(pool, first)
    pool.client.pre_infer("not-admitted", seq_len=LONG_SEQ_LEN)
    wait_for(lambda: refused_not_at_risk(pool, first) > refused, CONVERGE_S, what="the signal refused as not at risk")
    assert rank("not-admitted", seq_len=LONG_SEQ_LEN).source == Outcome.MISS

    apply({})  # the default TTLs again: the joiner below counts its users rerouted while they could live
    rank("edited")
    apply(edit_spec(alpha=2.0, scope="all", seed=1))
    assert rank("edited").source == Outcome.MISS

    second = pool.add_instance()
    # Its first heartbeat joined it; the membership change is read right after, in the same beat, so
    # the second heartbeat says the engine was told which users it was given.
    joined_at = pool.redis.zscore(pool.keys.members, second)
    wait_for(lambda: pool.redis.zscore(pool.keys.members, second) > joined_at, CONVERGE_S,
             what=f"{second}'s second heartbeat")
    moved = [user for user in (f"moved-{i}" for i in range(100)) if pool.client.route(user) == second]
    assert len(moved) >= MOVED_USERS, f"{len(moved)} users of 100 moved to {second}"
    moved = moved[:MOVED_USERS]
    for user in moved:
        reply = rank(user)
        assert (reply.instance, reply.source) == (second, Outcome.MISS)

    def counted_all() -> dict[str, Snapshot] | None:
        snapshots = {name: latest_snapshot(pool, name) for name in pool.names}
        done = all(s is not None and s.counters["rank_requests"] >= answered[n] for n, s in snapshots.items())
        return snapshots if done else None

    snapshots = wait_for(counted_all, CONVERGE_S, what=f"every answered request in telemetry ({dict(answered)})")
    misses: Counter[str] = Counter()
    for name, snapshot in snapshots.items():
        assert set(snapshot.misses) == set(MissReason), name
        assert sum(snapshot.misses.values()) == snapshot.counters["misses"], (name, snapshot.misses)
        misses.update({reason: n for reason, n in snapshot.misses.items() if n})
    assert misses == EXPECTED_MISSES
    assert snapshots[second].misses[MissReason.REROUTED] == MOVED_USERS

    # The capture: a record per answered request, a reason on exactly the misses, the same reasons.
    def captured_all() -> list[CaptureRecord] | None:
        records = captured(pool)
        return records if len(records) >= sum(answered.values()) else None

    records = wait_for(captured_all, CONVERGE_S, what="every answered request in the capture")
    assert len(records) == sum(answered.values())
    assert [r for r in records if (r.outcome == Outcome.MISS) != (r.miss_reason != "")] == []
    assert Counter(r.miss_reason for r in records if r.miss_reason) == misses
