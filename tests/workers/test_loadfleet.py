"""The load fleet: stand-in instances that run the workers' own loops against real Redis."""

from __future__ import annotations

import time
import uuid

import pytest

from relay_engine.core.config import parse_policy
from relay_engine.core.telemetry import Snapshot
from relay_engine.core.wire import ACK, NACK, DesiredRevision, InstanceStatus, instance_name
from tests.workers.fleet import wait_for
from workers.app import redis_client
from workers.loadfleet import LoadEngine, LoadFleet, Profile, profile_of
from workers.membership import live_members
from workers.settings import Settings

pytestmark = pytest.mark.integration

SIZE = 6


@pytest.fixture(scope="module")
def loadfleet(redis_url):
    settings = Settings.from_env({}, redis_url=redis_url, key_prefix=f"test-{uuid.uuid4().hex[:10]}", pool="load")
    fleet = LoadFleet(settings, SIZE, processes=2, slow_every=3, hot_every=3)
    client = redis_client(settings)
    try:
        yield fleet.start(), client
    finally:
        fleet.stop()
        for key in client.scan_iter(f"{settings.key_prefix}*"):
            client.delete(key)
        client.close()


def publish(fleet: LoadFleet, client, generation: int, spec: dict) -> None:
    """What the control plane does on publish: the desired revision into Redis, then a poke."""
    keys = fleet.settings.keys
    revision = DesiredRevision(generation, parse_policy(spec).sha256(), spec, time.time(), "tests")
    client.set(keys.desired, revision.to_json())
    client.publish(keys.poke_channel, str(generation))


def statuses(fleet: LoadFleet, client) -> list[InstanceStatus]:
    raws = client.mget([fleet.settings.keys.status(name) for name in fleet.names])
    return [InstanceStatus.from_json(raw) for raw in raws if raw is not None]


def test_every_instance_joins_the_live_set(loadfleet):
    fleet, client = loadfleet
    assert live_members(client, fleet.settings.keys) == sorted(fleet.names)
    assert {s.device for s in statuses(fleet, client)} == {"loadgen"}


def test_a_publish_is_acked_by_every_instance(loadfleet):
    fleet, client = loadfleet
    publish(fleet, client, 7, {"trigger": {"at_risk_seq_len": 640}})
    acked = wait_for(lambda: [s for s in statuses(fleet, client) if (s.config_state, s.applied_generation) == (ACK, 7)]
                     if len(statuses(fleet, client)) == SIZE else [], 10, what="every instance to ACK")
    wait_for(lambda: len([s for s in statuses(fleet, client) if s.applied_generation == 7]) == SIZE, 10,
             what="all six ACKs")
    assert acked


def test_a_policy_the_device_cannot_hold_is_nacked_and_the_last_good_one_kept(loadfleet):
    fleet, client = loadfleet
    publish(fleet, client, 8, {"trigger": {"at_risk_seq_len": 640}})
    wait_for(lambda: all(s.applied_generation == 8 for s in statuses(fleet, client)), 10, what="generation 8")
    publish(fleet, client, 9, {"cache": {"hbm_budget_mb": 20_000}})
    wait_for(lambda: all(s.config_state == NACK for s in statuses(fleet, client)), 10, what="NACKs")
    refused = statuses(fleet, client)
    assert len(refused) == SIZE
    assert all(s.nacked_generation == 9 and s.applied_generation == 8 and "cache.hbm_budget_mb" in s.error
               for s in refused)


def test_telemetry_reaches_the_streams_and_the_pool_rollup(loadfleet):
    fleet, client = loadfleet
    keys = fleet.settings.keys
    wait_for(lambda: client.zcard(keys.reporting) == SIZE, 10, what="every instance reporting")
    # The last whole second: every instance added its counts to it, once.
    rollup = wait_for(lambda: (r := client.hgetall(keys.rollup("1s", int(time.time()) - 1))).get("instances") == str(SIZE)
                      and r, 10, what="a second every instance reported into")
    assert int(rollup["rank_requests"]) > 0

    def newest() -> Snapshot:
        entries = client.xrevrange(keys.telemetry("1s", instance_name("load", 0)), count=1)
        return Snapshot.from_entry(entries[0][1]["d"])

    snap = wait_for(lambda: (s := newest()).counters["rank_requests"] > 0 and s, 10, what="traffic counted")
    assert 0 < snap.hbm_bytes <= snap.hbm_budget_bytes


def test_slow_and_hot_instances_are_the_ones_profiled():
    assert profile_of(3, rank_per_s=10, slow_every=3, hot_every=3).median_ms > \
        profile_of(1, rank_per_s=10, slow_every=3, hot_every=3).median_ms
    assert profile_of(1, rank_per_s=10, slow_every=3, hot_every=3).hbm_fill == 0.95
    assert profile_of(2, rank_per_s=10, slow_every=0, hot_every=0) == Profile(rank_per_s=10)


def test_a_stand_in_engine_counts_plausible_traffic():
    now = [0.0]
    engine = LoadEngine("p.0", Profile(rank_per_s=100, median_ms=8), seed=1, clock=lambda: now[0])
    now[0] = 10.0
    stats = engine.stats()
    requests = stats.counters["rank_requests"]
    assert 800 < requests < 1200
    assert stats.rank_latency.count == requests
    assert 5 < stats.rank_latency.quantile(0.5) < 12
    lookups = sum(stats.counters[n] for n in ("hbm_hits", "dram_hits", "inflight_joins", "misses"))
    assert lookups == requests and 0 < stats.hbm_bytes <= stats.hbm_budget_bytes


def test_ticked_loops_heartbeat_on_the_beat_and_publish_each_second(redis_url):
    """``InstanceLoops`` driven by ``tick`` (as the load fleet drives them) write what timers would."""
    settings = Settings.from_env({}, redis_url=redis_url, key_prefix=f"test-{uuid.uuid4().hex[:10]}", pool="tick")
    client = redis_client(settings)
    try:
        from workers.loadfleet import start_instance

        loops = start_instance(settings, 0, Profile())
        started = time.monotonic()
        while time.monotonic() - started < 2.6:
            loops.tick()
            time.sleep(0.05)
        keys = settings.keys
        assert live_members(client, keys) == ["tick.0"]
        assert 2 <= client.xlen(keys.telemetry("1s", "tick.0")) <= 4
        loops.stop()
        assert live_members(client, keys) == []
    finally:
        for key in client.scan_iter(f"{settings.key_prefix}*"):
            client.delete(key)
        client.close()
