"""The reconciler under a canary rollout, in-process against the real Redis and a real engine: an
instance's own desired record overrides the pool's, and a rolled-back canary steps down to the pool's
older generation only when the pool's record revokes the one it runs (a stale record still cannot
take it down). The rollout's control-plane side is in ``tests/controlplane/test_rollouts.py``."""

from __future__ import annotations

import json

import pytest
import redis

from relay_engine.core.config import parse_policy
from relay_engine.core.engine import RelayEngine
from relay_engine.core.wire import ACK, NACK, DesiredRevision, WireError, revoked_ranges
from tests.workers.test_reconciler import make_instance, record
from workers.settings import MODELS

pytestmark = pytest.mark.integration

STABLE = {"cache": {"hbm_budget_mb": 60}}
CANARY = {"cache": {"hbm_budget_mb": 70}}


@pytest.fixture(scope="module")
def engine() -> RelayEngine:
    return RelayEngine(MODELS["small"], device="cpu", name="canary")


@pytest.fixture(scope="module")
def client(redis_url) -> redis.Redis:
    with redis.Redis.from_url(redis_url, decode_responses=True) as c:
        yield c


def revoking(generation: int, spec: dict, revoked: list[int]) -> str:
    data = json.loads(record(generation, spec))
    return json.dumps({**data, "revoked": revoked})


def test_the_instances_own_record_overrides_the_pools(engine, client, tmp_path):
    instance = make_instance(engine, client, tmp_path)
    assert instance.put(record(1, STABLE)).applied_generation == 1
    client.set(instance.keys.instance_desired("p.0"), record(2, CANARY))
    status = instance.reconciler.reconcile()
    assert (status.config_state, status.applied_generation) == (ACK, 2)
    assert engine.policy.cache.hbm_budget_mb == 70


def test_an_override_of_another_instance_is_ignored(engine, client, tmp_path):
    instance = make_instance(engine, client, tmp_path)
    instance.put(record(1, STABLE))
    client.set(instance.keys.instance_desired("p.1"), record(2, CANARY))
    assert instance.reconciler.reconcile().applied_generation == 1


def test_a_rolled_back_canary_steps_down_to_the_pools_generation_when_revoked(engine, client, tmp_path):
    instance = make_instance(engine, client, tmp_path)
    instance.put(record(1, STABLE))
    client.set(instance.keys.instance_desired("p.0"), record(2, CANARY))
    assert instance.reconciler.reconcile().applied_generation == 2
    client.delete(instance.keys.instance_desired("p.0"))
    status = instance.put(revoking(1, STABLE, [2]))
    assert (status.config_state, status.applied_generation) == (ACK, 1)
    assert engine.policy.cache.hbm_budget_mb == 60


def test_without_the_revocation_an_older_pool_record_is_still_refused(engine, client, tmp_path):
    instance = make_instance(engine, client, tmp_path)
    instance.put(record(1, STABLE))
    client.set(instance.keys.instance_desired("p.0"), record(2, CANARY))
    instance.reconciler.reconcile()
    client.delete(instance.keys.instance_desired("p.0"))
    stale = instance.put(record(1, STABLE))  # what Redis held before the rollback wrote its revocation
    assert (stale.config_state, stale.nacked_generation, stale.applied_generation) == (NACK, 1, 2)
    other = instance.put(revoking(1, STABLE, [3]))  # a revocation of another generation does not apply here
    assert (other.config_state, other.applied_generation) == (NACK, 2)


def test_a_revocation_never_takes_down_an_instance_whose_own_record_holds_it(engine, client, tmp_path):
    instance = make_instance(engine, client, tmp_path)
    instance.put(record(1, STABLE))
    client.set(instance.keys.instance_desired("p.0"), record(2, CANARY))
    status = instance.put(revoking(1, STABLE, [2]))
    assert (status.config_state, status.applied_generation) == (ACK, 2)


def test_a_restarted_canary_follows_its_override_or_the_revocation(engine, client, tmp_path):
    first = make_instance(engine, client, tmp_path)
    first.put(record(1, STABLE))
    client.set(first.keys.instance_desired("p.0"), record(2, CANARY))
    first.reconciler.reconcile()
    restarted = make_instance(engine, client, tmp_path, keys=first.keys)  # restores generation 2 from disk
    assert restarted.reconciler.reconcile().applied_generation == 2  # still baking: its override
    client.delete(first.keys.instance_desired("p.0"))
    status = restarted.put(revoking(1, STABLE, [2]))
    assert (status.config_state, status.applied_generation) == (ACK, 1)


def test_a_malformed_override_is_a_nack_naming_the_instance_and_the_field(engine, client, tmp_path):
    instance = make_instance(engine, client, tmp_path)
    instance.put(record(1, STABLE))
    client.set(instance.keys.instance_desired("p.0"), '{"generation": "2", "sha256": "x", "spec": {}}')
    status = instance.reconciler.reconcile()
    assert status.config_state == NACK and status.applied_generation == 1
    assert "desired revision of p.0" in status.error and "generation" in status.error


@pytest.mark.parametrize(("revoked", "field"), [
    ("[1]", "only generations above"), ('"2"', "revoked must be a list"), ('[2.5]', "revoked must be int"),
    ("[" + ", ".join(["9"] * 65) + "]", "at most 64"), ("[1e400]", "revoked must be int"),
    ("[[3]]", r"\[first, last\]"), ("[[3, 4, 5]]", r"\[first, last\]"), ("[[5, 3]]", "is empty"),
    ("[[1, 4]]", "only generations above"), ("[[2, 1e400]]", "revoked must be int"),
])
def test_the_revoked_list_is_decoded_strictly(revoked, field):
    digest = parse_policy({}).sha256()
    raw = f'{{"generation": 1, "sha256": "{digest}", "spec": {{}}, "revoked": {revoked}}}'
    with pytest.raises(WireError, match=field):
        DesiredRevision.from_json(raw)


def test_a_record_without_revocations_is_written_as_before():
    assert "revoked" not in json.loads(DesiredRevision(1, "x", {}, 1.0).to_json())
    assert json.loads(DesiredRevision(1, "x", {}, 1.0, revoked=((2, 2), (4, 9))).to_json())["revoked"] == [2, [4, 9]]


def test_revocations_round_trip_and_an_older_list_of_generations_still_decodes():
    record = DesiredRevision(1, "x", {}, 1.0, revoked=((2, 2), (4, 9)))
    assert DesiredRevision.from_json(record.to_json()) == record
    old = DesiredRevision.from_json('{"generation": 1, "sha256": "x", "spec": {}, "revoked": [3, 5]}')
    assert old.revoked == ((3, 3), (5, 5)) and old.may_step_down(5) and not old.may_step_down(4)


def test_any_number_of_revoked_generations_is_at_most_two_ranges():
    """70 canaries rolled back in a row (generations 2…71, each next to a never-sent what-if
    revision) are one range; the one baking now is the only gap."""
    assert revoked_ranges(range(2, 142, 2), above=1) == ((2, 140),)
    assert revoked_ranges(range(2, 142, 2), above=1, keep=[71]) == ((2, 70), (72, 140))
    assert revoked_ranges([5, 6], above=6) == ()  # none above the record's own
    assert revoked_ranges([3, 4], above=1, keep=[9]) == ((3, 4),)  # a later baking generation: no gap
