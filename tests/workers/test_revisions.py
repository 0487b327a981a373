"""The config reconciler against real workers: publish → ACK within 2 s; bad revisions → NACK."""

from __future__ import annotations

import time

import pytest

from relay_engine.core.config import parse_policy, sha256_of
from relay_engine.core.wire import DesiredRevision
from tests.workers.fleet import wait_for

pytestmark = pytest.mark.integration

# A condition's deadline, generous for a loaded machine: how fast instances ACK is a benchmark's figure
# (workers.bench_roundtrip, the fleet-scale bench), never a timed test.
CONVERGE_S = 30.0


def acked(fleet, generation: int) -> bool:
    return all(s.config_state == "ACK" and s.applied_generation == generation for s in fleet.running_statuses())


def nacked(fleet, generation: int) -> bool:
    return all(s.config_state == "NACK" and s.nacked_generation == generation for s in fleet.running_statuses())


def test_published_revision_is_acked_by_every_instance(fleet):
    spec = {"cache": {"hbm_budget_mb": 300.0}, "trigger": {"ranking_p99_slo_ms": 40.0}}
    generation = fleet.publish(spec)
    wait_for(lambda: acked(fleet, generation), CONVERGE_S, what=f"ACK of generation {generation}")
    for status in fleet.statuses().values():
        assert status.applied_sha256 == parse_policy(spec).sha256()
        assert status.tiers["hbm"]["budget_bytes"] == 300 * 2**20
        assert status.error == ""


def test_revision_without_a_poke_still_converges(fleet):
    generation = fleet.publish({"cache": {"hbm_budget_mb": 301.0}}, poke=False)
    wait_for(lambda: acked(fleet, generation), CONVERGE_S, what="level-based convergence without a poke")


def test_invalid_revision_is_nacked_and_the_previous_keeps_serving(fleet):
    good = fleet.publish({"cache": {"hbm_budget_mb": 302.0}})
    wait_for(lambda: acked(fleet, good), CONVERGE_S)
    bad = fleet.publish({"trigger": {"at_risk_seq_len": -5}, "cahce": {}})
    wait_for(lambda: nacked(fleet, bad), CONVERGE_S, what=f"NACK of generation {bad}")
    for status in fleet.statuses().values():
        assert status.applied_generation == good
        assert status.tiers["hbm"]["budget_bytes"] == 302 * 2**20
        assert "trigger.at_risk_seq_len" in status.error and "cahce" in status.error
    for user in ("after-nack-1", "after-nack-2", "after-nack-3"):
        assert fleet.client.rank(user, seq_len=32, short_len=2, n_candidates=4).scores


def test_revision_the_instance_cannot_apply_is_nacked(fleet):
    good = fleet.publish({})
    wait_for(lambda: acked(fleet, good), CONVERGE_S)
    too_big = fleet.publish({"cache": {"hbm_budget_mb": 16.0 * 2**20}})  # valid by the schema, not on this host
    wait_for(lambda: nacked(fleet, too_big), CONVERGE_S)
    assert all("cache.hbm_budget_mb" in s.error and s.applied_generation == good
               for s in fleet.running_statuses())


def test_revision_whose_spec_does_not_match_its_sha256_is_nacked(fleet):
    good = fleet.publish({})
    wait_for(lambda: acked(fleet, good), CONVERGE_S)
    revision = fleet.desired_revision({"cache": {"hbm_budget_mb": 10.0}}, sha256="f" * 64)
    fleet.redis.set(fleet.keys.desired, revision.to_json())
    fleet.redis.publish(fleet.keys.poke_channel, str(revision.generation))
    wait_for(lambda: nacked(fleet, revision.generation), CONVERGE_S)
    assert all(s.error.startswith("sha256") for s in fleet.running_statuses())


def test_a_revision_stored_before_a_field_with_a_default_existed_is_acked_after_the_upgrade(fleet):
    """The control plane stores a spec with the schema's defaults filled in and hashes what it stores.
    A field added later (here: one the stored spec lacks, as an older schema would have stored it) is
    filled in by the upgraded worker's parse: the stored hash still holds, so no instance NACKs the
    pool's current revision after an upgrade, and a spec changed anywhere still does not pass."""
    stored = parse_policy({"cache": {"hbm_budget_mb": 303.0}}).to_dict()
    del stored["trigger"]["preinfer_compute_share"]  # "not yet in the schema" when it was stored
    del stored["cache"]["dram_ttl_ms"]
    revision = fleet.desired_revision(stored, sha256=sha256_of(stored))
    fleet.redis.set(fleet.keys.desired, revision.to_json())
    fleet.redis.publish(fleet.keys.poke_channel, str(revision.generation))
    wait_for(lambda: acked(fleet, revision.generation), CONVERGE_S, what="ACK of a revision stored by an older schema")
    assert all(s.tiers["hbm"]["budget_bytes"] == 303 * 2**20 and s.applied_sha256 == sha256_of(stored)
               for s in fleet.running_statuses())
    tampered = fleet.desired_revision({**stored, "cache": {**stored["cache"], "hbm_budget_mb": 304.0}},
                                      sha256=sha256_of(stored))
    fleet.redis.set(fleet.keys.desired, tampered.to_json())
    fleet.redis.publish(fleet.keys.poke_channel, str(tampered.generation))
    wait_for(lambda: nacked(fleet, tampered.generation), CONVERGE_S)


def test_next_good_revision_after_a_nack_is_acked(fleet):
    bad = fleet.publish({"slo": {"target_ratio": 2.0}})
    wait_for(lambda: nacked(fleet, bad), CONVERGE_S)
    good = fleet.publish({"cache": {"hbm_budget_mb": 303.0}})
    wait_for(lambda: acked(fleet, good), CONVERGE_S)
    assert all(s.nacked_generation == 0 and s.error == "" for s in fleet.running_statuses())


def test_a_refused_generation_repaired_under_the_same_generation_is_applied(fleet):
    """A split fleet otherwise: instances that refused it would stay behind while restarted peers apply it."""
    broken = fleet.desired_revision({"cache": {"hbm_budget_mb": -7}})
    fleet.redis.set(fleet.keys.desired, broken.to_json())
    fleet.redis.publish(fleet.keys.poke_channel, str(broken.generation))
    wait_for(lambda: nacked(fleet, broken.generation), CONVERGE_S)
    spec = {"cache": {"hbm_budget_mb": 307.0}}  # what relaygr_sync writes from the database, same generation
    repaired = DesiredRevision(broken.generation, parse_policy(spec).sha256(), spec, time.time(), "sync")
    fleet.redis.set(fleet.keys.desired, repaired.to_json())  # no poke: the periodic pass finds it
    wait_for(lambda: acked(fleet, broken.generation), CONVERGE_S + 1.5, what="the repaired generation's ACK")
    assert all(s.tiers["hbm"]["budget_bytes"] == 307 * 2**20 for s in fleet.running_statuses())


def test_an_older_generation_in_redis_is_reported_not_applied(fleet):
    good = fleet.publish({"cache": {"hbm_budget_mb": 308.0}})
    wait_for(lambda: acked(fleet, good), CONVERGE_S)
    spec = {"cache": {"hbm_budget_mb": 11.0}}
    stale = DesiredRevision(good - 1, parse_policy(spec).sha256(), spec, time.time(), "an old snapshot")
    fleet.redis.set(fleet.keys.desired, stale.to_json())
    fleet.redis.publish(fleet.keys.poke_channel, str(stale.generation))
    wait_for(lambda: nacked(fleet, stale.generation), CONVERGE_S)
    assert all(s.applied_generation == good and "older than the applied generation" in s.error
               and s.tiers["hbm"]["budget_bytes"] == 308 * 2**20 for s in fleet.running_statuses())
