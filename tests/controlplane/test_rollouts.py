"""Canary rollouts through the API and the bake's evaluation, against the real Redis: instances are
``FakeWorker``s speaking the wire contract (their own record before the pool's, revocations) and the
telemetry is real snapshots written by the workers' own ``TelemetryWriter``. The reconciler's side is
``tests/workers/test_canary_reconciler.py``; the whole stack with a browser is ``tests/frontend``."""

from __future__ import annotations

import io
import json
import time
from datetime import timedelta

import pytest
from django.core.management import call_command
from django.utils import timezone
from hypothesis import given

from controlplane.audit.models import AuditEntry
from controlplane.policies import services as policy_services
from controlplane.policies.models import Pool
from controlplane.rollouts import services
from controlplane.rollouts.evaluation import GroupFigures, decide, difference_interval, wilson_interval
from controlplane.rollouts.models import Rollout
from relay_engine.core.wire import DesiredRevision, PoolKeys
from tests.controlplane.fleet_helpers import snapshot
from tests.reliability.figures import FIGURES
from tests.security.test_hostile_numbers import fuzz, mutated

POOL = "ranking-a"
BASE = f"/api/v1/pools/{POOL}"
CANARY = {"strategy": "canary", "canary_instances": 1, "bake_s": 30, "max_burn": 1.0}


# --- the rule, on plain numbers ----------------------------------------------------------------------

def test_the_wilson_interval_has_its_textbook_values():
    assert wilson_interval(0, 10) == pytest.approx((0.0, 0.2775), abs=1e-4)
    assert wilson_interval(5, 100) == pytest.approx((0.0215, 0.1118), abs=1e-4)
    assert wilson_interval(0, 0) == (0.0, 1.0)


def _decide(canary, stable=(1000, 5), *, bake_over=False, min_requests=50, **faults):
    return decide(canary=GroupFigures.of(*canary), stable=GroupFigures.of(*stable), max_burn=1.0,
                  bake_over=bake_over, min_requests=min_requests, nacked=faults.get("nacked", {}),
                  not_live=faults.get("not_live", []), not_running=faults.get("not_running", []))


def test_burn_is_the_bad_share_over_the_p99_budget():
    figures = GroupFigures.of(1000, 20)
    assert figures.burn == pytest.approx(2.0) and figures.burn_low < 2.0 < figures.burn_high


def test_a_burning_canary_is_rolled_back_before_bake_end_once_the_evidence_suffices():
    assert _decide((49, 49)).action == "bake"  # every request bad, but fewer than min_requests
    assert _decide((50, 50)).action == "rollback"
    assert _decide((1000, 15)).action == "bake"  # burn 1.5, but its lower bound (0.91) does not exceed 1.0


def test_a_nack_rolls_back_at_once_naming_the_instance():
    decision = _decide((0, 0), nacked={"ranking-a.0": "invalid spec"})
    assert decision.action == "rollback" and "ranking-a.0" in decision.reason and "NACK" in decision.reason


@pytest.mark.parametrize(("canary", "faults", "words"), [
    ((1000, 0), {"not_live": ["ranking-a.0"]}, "ranking-a.0 is not live"),
    ((1000, 0), {"not_running": ["ranking-a.0"]}, "ranking-a.0 does not run"),
    ((10, 0), {}, "fewer than the 50"),
    ((1000, 12), {}, "exceeds max_burn"),  # burn 1.2 against stable's 0.5: over, though not provably worse
], ids=["dead canary", "canary not on the generation", "too few requests", "burn above max at the end"])
def test_at_bake_end_these_are_not_promoted(canary, faults, words):
    decision = _decide(canary, bake_over=True, **faults)
    assert decision.action == "rollback" and words in decision.reason


def test_at_bake_end_a_canary_materially_worse_than_stable_is_not_promoted():
    assert _decide((5000, 40), stable=(5000, 5), bake_over=True).action == "rollback"  # burn 0.8 vs 0.1
    assert _decide((5000, 40), stable=(5000, 30), bake_over=True).action == "promote"  # overlapping intervals


def test_at_bake_end_a_canary_within_max_burn_is_promoted():
    decision = _decide((1000, 3), bake_over=True)
    assert decision.action == "promote" and "burn 0.30" in decision.reason


def test_the_difference_of_the_bad_shares_has_newcombes_interval():
    # Newcombe (1998), method 10, his example: 56/70 against 48/80, a difference of 0.2
    assert difference_interval(GroupFigures.of(70, 56), GroupFigures.of(80, 48)) == pytest.approx((0.0524, 0.3339),
                                                                                                 abs=2e-4)


def test_when_both_sides_burn_the_canary_is_judged_against_stable_not_the_budget():
    """The demo's case: both over budget. A canary no worse than stable is not rolled back for the pool's
    burn; at bake end it is promoted, saying both burn; a worse one is rolled back saying by how much."""
    assert _decide((1000, 100), stable=(1000, 100)).action == "bake"
    promoted = _decide((1000, 100), stable=(1000, 100), bake_over=True)
    assert promoted.action == "promote" and "both sides burn" in promoted.reason and "not worse" in promoted.reason
    early = _decide((1000, 300), stable=(1000, 100))
    assert early.action == "rollback" and "canary is worse" in early.reason and "points" in early.reason


def test_a_canary_worse_than_stable_is_rolled_back_even_with_a_lax_max_burn():
    """Measured on the demo: a canary at 50 % bad requests against stable's 34 %, max_burn 100, was
    promoted as 'not worse than stable'."""
    decision = decide(canary=GroupFigures.of(240, 120), stable=GroupFigures.of(240, 82), max_burn=100.0,
                      bake_over=True, min_requests=50, nacked={}, not_live=[], not_running=[],
                      yardstick="the stable revision's SLO, 260 ms")
    assert decision.action == "rollback" and "materially worse" in decision.reason
    assert "judged on the stable revision's SLO, 260 ms" in decision.reason


# --- through the API, with instances and telemetry in Redis ----------------------------------------------

@pytest.fixture
def fleet(operator, pool, worker_factory):
    """Three live instances on generation 1 and a revision 2 to canary."""
    policy_services.desired_push(pool=pool)
    workers = [worker_factory(POOL, i) for i in range(3)]
    for worker in workers:
        worker.reconcile()
    response = operator.post(f"{BASE}/revisions/", {"parent_generation": 1, "spec": {"cache": {"hbm_budget_mb": 300}}},
                             format="json")
    assert response.status_code == 201, response.content
    return workers


def _start(client, body=CANARY, generation=2):
    return client.post(f"{BASE}/revisions/{generation}/publish/", body, format="json")


def _serve(worker, rollout, generation, requests, within, *, at=1.0):
    """One cumulative snapshot of a run that began at bake start: ``requests`` served, ``within`` in SLO."""
    since = rollout.started_at.timestamp()
    worker.publish_snapshot(snapshot(worker.name, since + at, since, rank_requests=requests, rank_within_slo=within,
                                     applied_generation=generation, latencies_ms=[3.0] * min(requests, 200)))


def _end_bake(rollout):
    Rollout.objects.filter(pk=rollout.pk).update(bake_ends_at=timezone.now() - timedelta(seconds=1))


def test_a_canary_publish_sends_the_generation_to_the_lowest_index_only(operator, fleet, redis_client, key_prefix):
    response = _start(operator)
    assert response.status_code == 201, response.content
    body = response.json()
    assert (body["state"], body["generation"], body["stable_generation"], body["canary"]) == \
        ("baking", 2, 1, ["ranking-a.0"])
    keys = PoolKeys(POOL, prefix=key_prefix)
    assert DesiredRevision.from_json(redis_client.get(keys.instance_desired("ranking-a.0"))).generation == 2
    assert redis_client.get(keys.instance_desired("ranking-a.1")) is None
    assert DesiredRevision.from_json(redis_client.get(keys.desired)).generation == 1
    assert [w.reconcile().applied_generation for w in fleet] == [2, 1, 1]
    status = operator.get(f"{BASE}/status/").json()
    assert status["converged"] is True and status["desired_generation"] == 1
    assert [(i["canary"], i["desired_generation"]) for i in status["instances"]] == [(True, 2), (False, 1), (False, 1)]
    assert AuditEntry.objects.filter(action=AuditEntry.Action.ROLLOUT_START, pool=POOL).count() == 1


def test_a_fraction_of_the_live_instances_is_rounded_up(operator, fleet):
    response = _start(operator, {**CANARY, "canary_instances": 0.4})
    assert response.status_code == 201 and response.json()["canary"] == ["ranking-a.0", "ranking-a.1"]


def test_a_canary_of_every_live_instance_is_refused(operator, fleet):
    response = _start(operator, {**CANARY, "canary_instances": 3})
    assert response.status_code == 409
    assert "at least one stable instance" in response.json()["detail"]
    assert response.json()["errors"] == {"canary_instances": ["at most 2 for this pool now"]}


@pytest.mark.parametrize(("body", "field", "words"), [
    ({"strategy": "slow"}, "strategy", "not a valid choice"),
    ({**CANARY, "canary_instances": 0}, "canary_instances", "a count of instances"),
    ({**CANARY, "canary_instances": "1"}, "canary_instances", "a count of instances"),
    ({**CANARY, "canary_instances": 1.5}, "canary_instances", "a fraction"),
    ({**CANARY, "bake_s": 1}, "bake_s", "greater than or equal to 5"),
    ({**CANARY, "bake_s": 10**400}, "bake_s", "less than or equal to 86400"),
    ({**CANARY, "max_burn": 0}, "max_burn", "above 0 and at most 100"),
    ({**CANARY, "max_burn": True}, "max_burn", "above 0"),
    ({**CANARY, "max_burn": 10**401}, "max_burn", "above 0 and at most 100"),  # an OverflowError page before
    ({**CANARY, "max_burn": -10**401}, "max_burn", "above 0 and at most 100"),
    ({**CANARY, "canary_instances": 10**401}, "canary_instances", "a count of instances"),
    ({**CANARY, "canary_instances": -10**401}, "canary_instances", "a count of instances"),
    ({**CANARY, "bake": 30}, "bake", "Unknown field"),
    ({"strategy": "all", "bake_s": 30}, "bake_s", 'only with strategy "canary"'),
])
def test_a_bad_publish_body_names_the_field_and_its_range(operator, fleet, body, field, words):
    response = _start(operator, body)
    assert response.status_code == 400, response.content
    assert words in " ".join(response.json()["errors"][field])
    assert not Rollout.objects.exists()


@pytest.mark.parametrize("body", [None, CANARY, {"strategy": "all"}], ids=["plain", "canary", "all"])
def test_nothing_else_is_published_while_a_canary_bakes(operator, fleet, body):
    assert _start(operator).status_code == 201
    operator.post(f"{BASE}/revisions/", {"parent_generation": 2, "spec": {}}, format="json")
    response = _start(operator, body, generation=3)
    assert response.status_code == 409
    detail = response.json()["detail"]
    assert "canary of generation 2 is baking" in detail and "rollout/promote/" in detail and "rollout/abort/" in detail
    assert Pool.objects.get(name=POOL).desired_generation == 1


def test_a_rollback_during_a_bake_is_refused_too(operator, fleet):
    assert _start(operator).status_code == 201
    response = operator.post(f"{BASE}/rollback/", {"to_generation": 1, "parent_generation": 2}, format="json")
    assert response.status_code == 409 and "baking" in response.json()["detail"]


def test_the_rollout_is_none_before_the_first(viewer, pool):
    body = viewer.get(f"{BASE}/rollout/").json()
    assert (body["state"], body["canary"], body["generation"]) == ("none", [], None)


def test_a_burning_canary_is_rolled_back_and_steps_down(operator, fleet, redis_client, key_prefix):
    _start(operator)
    rollout = Rollout.objects.get()
    for worker in fleet:
        worker.reconcile()
    _serve(fleet[0], rollout, 2, requests=100, within=0)
    for worker in fleet[1:]:
        _serve(worker, rollout, 1, requests=100, within=100)

    services.rollouts_tick()

    rollout.refresh_from_db()
    assert (rollout.state, rollout.decided_by) == ("rolled_back", services.EVALUATOR)
    assert "exceeds max_burn" in rollout.reason and rollout.canary_burn == pytest.approx(100.0)
    assert rollout.stable_burn == 0.0
    keys = PoolKeys(POOL, prefix=key_prefix)
    assert redis_client.get(keys.instance_desired("ranking-a.0")) is None
    assert DesiredRevision.from_json(redis_client.get(keys.desired)).revoked == ((2, 2),)
    assert fleet[0].reconcile().applied_generation == 1  # down to the stable generation
    entry = AuditEntry.objects.get(action=AuditEntry.Action.ROLLOUT_ROLLBACK)
    figures = entry.after["figures"]
    assert (figures["canary"]["requests"], figures["canary"]["bad"], figures["stable"]["requests"]) == (100, 100, 200)
    assert figures["canary"]["burn_low"] > 1.0 and "exceeds max_burn" in entry.after["reason"]


def test_a_good_canary_is_promoted_at_bake_end(operator, fleet, redis_client, key_prefix):
    _start(operator)
    rollout = Rollout.objects.get()
    for worker in fleet:
        worker.reconcile()
    _serve(fleet[0], rollout, 2, requests=400, within=400)
    for worker in fleet[1:]:
        _serve(worker, rollout, 1, requests=400, within=399)

    _end_bake(rollout)
    services.rollouts_tick()

    rollout.refresh_from_db()
    assert rollout.state == "promoted" and "within max_burn" in rollout.reason
    assert Pool.objects.get(name=POOL).desired_generation == 2
    keys = PoolKeys(POOL, prefix=key_prefix)
    assert redis_client.get(keys.instance_desired("ranking-a.0")) is None
    assert DesiredRevision.from_json(redis_client.get(keys.desired)).generation == 2
    assert [w.reconcile().applied_generation for w in fleet] == [2, 2, 2]
    assert AuditEntry.objects.filter(action=AuditEntry.Action.REVISION_PUBLISH, after__desired_generation=2).exists()
    assert AuditEntry.objects.filter(action=AuditEntry.Action.ROLLOUT_PROMOTE).get().actor == services.EVALUATOR


def test_counts_served_on_another_generation_are_not_the_canarys(operator, fleet):
    _start(operator)
    rollout = Rollout.objects.get()
    _serve(fleet[0], rollout, 1, requests=100, within=0)  # still on the stable one: not canary evidence
    services.rollouts_tick()
    rollout.refresh_from_db()
    assert rollout.state == "baking" and rollout.figures["canary"]["requests"] == 0


def test_the_second_a_canary_changed_revision_counts_for_neither_side(operator, fleet):
    _start(operator)
    rollout = Rollout.objects.get()
    _serve(fleet[0], rollout, 1, requests=10, within=10, at=1.0)
    _serve(fleet[0], rollout, 2, requests=20, within=15, at=2.0)  # requests of both revisions in this second
    _serve(fleet[0], rollout, 2, requests=30, within=15, at=3.0)
    services.rollouts_tick()
    canary = Rollout.objects.get().figures["canary"]
    assert (canary["requests"], canary["bad"]) == (10, 10)


def test_a_canary_that_nacks_is_rolled_back(operator, fleet):
    _start(operator)
    fleet[0].reconcile()
    fleet[0].status.config_state, fleet[0].status.nacked_generation = "NACK", 2
    fleet[0].status.error = "hbm_budget_mb: no device here holds it"
    fleet[0].heartbeat()
    services.rollouts_tick()
    rollout = Rollout.objects.get()
    assert rollout.state == "rolled_back" and "ranking-a.0 refused" in rollout.reason


def test_a_dead_canary_is_not_promoted(operator, fleet):
    _start(operator)
    rollout = Rollout.objects.get()
    fleet[0].reconcile()
    _serve(fleet[0], rollout, 2, requests=400, within=400)
    fleet[0].heartbeat(at=time.time() - 60)  # silent since
    _end_bake(rollout)
    services.rollouts_tick()
    rollout.refresh_from_db()
    assert rollout.state == "rolled_back" and "ranking-a.0 is not live" in rollout.reason


@pytest.mark.parametrize("role", ["operator", "admin"])
def test_abort_returns_the_canaries_to_stable(clients, fleet, role):
    _start(clients["operator"])
    response = clients[role].post(f"{BASE}/rollout/abort/")
    assert response.status_code == 200, response.content
    assert (response.json()["state"], response.json()["decided_by"]) == ("aborted", role)
    assert fleet[0].reconcile().applied_generation == 1
    assert AuditEntry.objects.get(action=AuditEntry.Action.ROLLOUT_ABORT).actor == role


def test_promote_by_hand_publishes_to_every_instance(operator, fleet):
    _start(operator)
    response = operator.post(f"{BASE}/rollout/promote/")
    assert response.status_code == 200 and response.json()["state"] == "promoted"
    assert [w.reconcile().applied_generation for w in fleet] == [2, 2, 2]


@pytest.mark.parametrize("action", ["promote", "abort"])
def test_promote_and_abort_need_an_operator_and_a_bake(clients, fleet, action):
    assert clients["operator"].post(f"{BASE}/rollout/{action}/").status_code == 409  # nothing bakes
    _start(clients["operator"])
    assert clients["viewer"].post(f"{BASE}/rollout/{action}/").status_code == 403
    assert clients["anonymous"].post(f"{BASE}/rollout/{action}/").status_code in (401, 403)
    assert clients["viewer"].get(f"{BASE}/rollout/").json()["state"] == "baking"
    assert Rollout.objects.get().state == "baking"


def test_relaygr_sync_restores_the_overrides_and_the_revocation(operator, fleet, redis_client, key_prefix):
    _start(operator)
    keys = PoolKeys(POOL, prefix=key_prefix)
    redis_client.delete(keys.instance_desired("ranking-a.0"), keys.desired)  # a Redis that restarted empty
    call_command("relaygr_sync", stdout=io.StringIO())
    assert DesiredRevision.from_json(redis_client.get(keys.instance_desired("ranking-a.0"))).generation == 2
    operator.post(f"{BASE}/rollout/abort/")
    redis_client.set(keys.instance_desired("ranking-a.0"), redis_client.get(keys.desired))  # stale leftovers
    call_command("relaygr_sync", stdout=io.StringIO())
    assert redis_client.get(keys.instance_desired("ranking-a.0")) is None
    assert DesiredRevision.from_json(redis_client.get(keys.desired)).revoked == ((2, 2),)


def test_a_decision_taken_while_redis_is_down_reaches_redis_on_the_next_tick(operator, fleet, settings, redis_client,
                                                                           key_prefix):
    _start(operator)
    redis_url, settings.REDIS_URL = settings.REDIS_URL, "redis://127.0.0.1:1/0"  # nothing listens on port 1
    response = operator.post(f"{BASE}/rollout/abort/")
    assert response.status_code == 503
    rollout = Rollout.objects.get()
    assert (rollout.state, rollout.published) == ("aborted", False)  # the database holds the decision
    settings.REDIS_URL = redis_url
    assert services.rollouts_tick()["published"] == 1
    keys = PoolKeys(POOL, prefix=key_prefix)
    assert redis_client.get(keys.instance_desired("ranking-a.0")) is None
    assert DesiredRevision.from_json(redis_client.get(keys.desired)).revoked == ((2, 2),)
    assert Rollout.objects.get().published is True


def test_seventy_aborted_canaries_in_a_row_leave_every_instance_on_stable(operator, fleet, redis_client, key_prefix,
                                                                         settings):
    """Before, the 65th abort made every instance NACK the pool's record ("revoked must be a list of
    at most 64") and left the canary on the aborted generation. Each round here also leaves a
    never-published what-if revision between the aborted ones, as Preview clicks do."""
    settings.RELAYGR_WRITE_THROTTLE_RATE = "10000/min"  # 280 writes: the throttle is not what is tested
    latest = 2
    for round_ in range(70):
        assert _start(operator, generation=latest).status_code == 201, round_
        assert [w.reconcile().applied_generation for w in fleet] == [latest, 1, 1]
        assert operator.post(f"{BASE}/rollout/abort/").status_code == 200
        states = [w.reconcile() for w in fleet]
        assert [(s.applied_generation, s.config_state) for s in states] == [(1, "ACK")] * 3, (round_, states[0].error)
        for _ in range(2):  # the next canary's revision, and a what-if revision nobody publishes
            response = operator.post(f"{BASE}/revisions/", {"parent_generation": latest, "spec": {
                "cache": {"hbm_budget_mb": 300 + latest}}}, format="json")
            assert response.status_code == 201
            latest = response.json()["generation"]
    record = DesiredRevision.from_json(redis_client.get(PoolKeys(POOL, prefix=key_prefix).desired))
    assert record.generation == 1 and record.revoked == ((2, 140),)
    assert Rollout.objects.filter(state="aborted").count() == 70


def test_a_canary_baking_between_revoked_generations_is_not_revoked(operator, fleet, redis_client, key_prefix):
    """Generation 3 aborted, then generation 2 canaried: the pool's record revokes 3 but not 2, so a
    canary that lost its own record for a moment keeps generation 2."""
    response = operator.post(f"{BASE}/revisions/", {"parent_generation": 2, "spec": {"cache": {"hbm_budget_mb": 301}}},
                             format="json")
    assert response.status_code == 201
    assert _start(operator, generation=3).status_code == 201
    assert operator.post(f"{BASE}/rollout/abort/").status_code == 200
    assert _start(operator, generation=2).status_code == 201
    record = DesiredRevision.from_json(redis_client.get(PoolKeys(POOL, prefix=key_prefix).desired))
    assert record.revoked == ((3, 3),) and not record.may_step_down(2)


def test_an_abort_sticks_against_a_pass_that_read_the_bake_before_it(operator, fleet, redis_client, key_prefix):
    """The interleaving that made an aborted canary serve its generation again: the periodic pass
    reads the bake, the abort commits and clears the overrides, then the pass re-sends what it read.
    The rollout fence in Redis refuses the stale write."""
    assert _start(operator).status_code == 201
    read_by_the_pass = Rollout.objects.select_related("pool").get()  # still baking, as the pass saw it
    assert operator.post(f"{BASE}/rollout/abort/").status_code == 200
    keys = PoolKeys(POOL, prefix=key_prefix)
    assert redis_client.get(keys.instance_desired("ranking-a.0")) is None
    assert services.overrides_push(rollout=read_by_the_pass) is False
    assert redis_client.get(keys.instance_desired("ranking-a.0")) is None
    assert fleet[0].reconcile().applied_generation == 1
    services.rollouts_tick()  # a whole pass afterwards: nothing baking, nothing re-sent
    assert redis_client.get(keys.instance_desired("ranking-a.0")) is None


def test_a_later_rollouts_overrides_win_over_an_earlier_decision_written_late(operator, fleet, redis_client,
                                                                               key_prefix):
    assert _start(operator).status_code == 201
    assert operator.post(f"{BASE}/rollout/abort/").status_code == 200
    first = Rollout.objects.get()
    response = operator.post(f"{BASE}/revisions/", {"parent_generation": 2, "spec": {"cache": {"hbm_budget_mb": 301}}},
                             format="json")
    assert _start(operator, generation=response.json()["generation"]).status_code == 201
    Rollout.objects.filter(pk=first.pk).update(published=False)  # its Redis half "failed" earlier
    services.rollouts_tick()
    keys = PoolKeys(POOL, prefix=key_prefix)
    assert DesiredRevision.from_json(redis_client.get(keys.instance_desired("ranking-a.0"))).generation == 3
    assert Rollout.objects.get(pk=first.pk).published is True  # superseded: not retried forever


@pytest.mark.parametrize(("change", "field"), [
    ({"trigger": {"ranking_p99_slo_ms": 60_000}}, "trigger.ranking_p99_slo_ms"),
    ({"slo": {"target_ratio": 0.5}}, "slo.target_ratio"),
])
def test_a_canary_that_changes_the_slo_is_refused_naming_the_field(operator, fleet, change, field):
    """Each instance counts its requests against its own revision's SLO: a canary with a 60 s SLO beside
    a stable one at 50 ms looked healthy and was promoted. An SLO change goes to the whole pool."""
    response = operator.post(f"{BASE}/revisions/", {"parent_generation": 2, "spec": change}, format="json")
    assert response.status_code == 201, response.content
    started = _start(operator, generation=3)
    assert started.status_code == 409, started.content
    assert field in started.json()["errors"] and "strategy" in started.json()["detail"]
    assert not Rollout.objects.exists()
    assert operator.post(f"{BASE}/revisions/3/publish/", {"strategy": "all"}, format="json").status_code == 200


def test_the_decision_says_which_slo_it_was_judged_on(operator, fleet):
    _start(operator)
    rollout = Rollout.objects.get()
    for worker, generation in zip(fleet, (2, 1, 1), strict=True):
        worker.reconcile()
        _serve(worker, rollout, generation, requests=200, within=200)
    _end_bake(rollout)
    decided = services.rollout_evaluate(rollout=Rollout.objects.get())
    assert decided.state == "promoted" and "judged on the stable revision's SLO, 50 ms" in decided.reason
    assert decided.figures["slo_ms"] == 50.0


def test_members_with_malformed_names_are_never_made_canaries(operator, fleet, redis_client, key_prefix):
    """The members set is written by workers, so by anyone who can write Redis: a name without an index
    made the canary publish a 500. They are left out; the real instances are chosen as before."""
    keys = PoolKeys(POOL, prefix=key_prefix)
    now = time.time()
    redis_client.zadd(keys.members, {name: now for name in (POOL, f"{POOL}.x", "other.3", f"{POOL}.99999",
                                                            f"{POOL}.01", f"{POOL}.-1", f"{POOL}.²", f"{POOL}.1.2")})
    response = _start(operator)
    assert response.status_code == 201, response.content
    assert response.json()["canary"] == [f"{POOL}.0"]
    assert operator.get(f"{BASE}/status/").status_code == 200


def test_a_sync_pass_that_read_the_pool_before_an_abort_keeps_the_revocation(operator, fleet, redis_client,
                                                                               key_prefix):
    """The sync loop reads every pool, then writes each one's record: a pool read before a canary was
    aborted lacked the revocation, so the canary (its own record gone) could not step down and NACKed
    the pool's older generation until the next pass."""
    assert _start(operator).status_code == 201
    fleet[0].reconcile()
    read_by_the_sync = Pool.objects.get(name=POOL)  # no revocation yet
    assert operator.post(f"{BASE}/rollout/abort/").status_code == 200
    policy_services.desired_push(pool=read_by_the_sync, force=True)
    record = DesiredRevision.from_json(redis_client.get(PoolKeys(POOL, prefix=key_prefix).desired))
    assert record.may_step_down(2)
    status = fleet[0].reconcile()
    assert (status.applied_generation, status.config_state) == (1, "ACK")


@fuzz(150)
@given(body=mutated(CANARY))
def test_hostile_numbers_in_a_canary_body_are_a_400_naming_the_field_never_a_5xx(operator, fleet, settings, body):
    settings.RELAYGR_WRITE_THROTTLE_RATE = "100000/min"  # each example writes once or twice
    FIGURES.hostile("canary publish bodies (hypothesis)")
    response = operator.post(f"{BASE}/revisions/2/publish/", json.dumps(body), content_type="application/json")
    assert response.status_code in (201, 400, 409), response.content  # 409: more canaries than the pool can give
    if response.status_code == 201:
        assert operator.post(f"{BASE}/rollout/abort/").status_code == 200
    elif response.status_code == 400:  # a field named, or the body refused as JSON (NaN, Infinity)
        answer = response.json()
        assert set(answer.get("errors", {})) <= set(CANARY) | {"non_field_errors"}, answer
        assert answer.get("errors") or "JSON" in answer["detail"], answer
