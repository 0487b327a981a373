"""Publishing through a real Redis, convergence reported from what a reconciling worker writes."""

from __future__ import annotations

import time

import pytest

from controlplane.audit.models import AuditEntry
from controlplane.policies import services
from controlplane.policies.models import ConfigRevision, Pool
from relay_engine.core.config import parse_policy
from relay_engine.core.wire import HEARTBEAT_TIMEOUT_S, DesiredRevision, PoolKeys, pools_key

POOL = "ranking-a"
BASE = f"/api/v1/pools/{POOL}"


def _new_revision(client, parent: int, spec: dict) -> int:
    response = client.post(f"{BASE}/revisions/", {"parent_generation": parent, "spec": spec}, format="json")
    assert response.status_code == 201, response.content
    return response.json()["generation"]


def _desired_in_redis(redis_client, key_prefix) -> DesiredRevision:
    return DesiredRevision.from_json(redis_client.get(PoolKeys(POOL, prefix=key_prefix).desired))


def test_publish_writes_the_spec_to_redis_and_pokes_the_pool(operator, pool, redis_client, key_prefix):
    generation = _new_revision(operator, 1, {"cache": {"hbm_budget_mb": 512}})
    pubsub = redis_client.pubsub()
    pubsub.subscribe(PoolKeys(POOL, prefix=key_prefix).poke_channel)
    pubsub.get_message(timeout=1.0)  # the subscribe confirmation

    response = operator.post(f"{BASE}/revisions/{generation}/publish/")

    assert response.status_code == 200, response.content
    assert response.json()["desired_generation"] == response.json()["published_generation"] == generation
    desired = _desired_in_redis(redis_client, key_prefix)
    revision = ConfigRevision.objects.get(pool=pool, generation=generation)
    assert (desired.generation, desired.sha256, desired.published_by) == (generation, revision.sha256, "operator")
    assert parse_policy(desired.spec).sha256() == revision.sha256  # the worker's validation accepts it
    assert redis_client.sismember(pools_key(key_prefix), POOL)
    poke = pubsub.get_message(timeout=2.0)
    assert poke is not None and poke["data"] == str(generation)
    pubsub.close()


def test_reconciling_worker_acks_and_the_pool_converges(operator, pool, worker_factory):
    workers = [worker_factory(POOL, i) for i in range(2)]
    generation = _new_revision(operator, 1, {"trigger": {"at_risk_seq_len": 2048}})
    operator.post(f"{BASE}/revisions/{generation}/publish/")

    workers[0].reconcile()
    workers[1].heartbeat()  # alive but has not reconciled yet
    status = operator.get(f"{BASE}/status/").json()
    assert status["desired_generation"] == generation
    assert status["converged"] is False
    assert [i["up_to_date"] for i in status["instances"]] == [True, False]

    workers[1].reconcile()
    status = operator.get(f"{BASE}/status/").json()
    assert status["converged"] is True
    assert status["live_instances"] == 2
    first = status["instances"][0]
    assert (first["instance"], first["config_state"], first["applied_generation"]) == (f"{POOL}.0", "ACK", generation)
    assert first["device"] == "cpu" and first["heartbeat_age_s"] < HEARTBEAT_TIMEOUT_S
    assert first["tiers"]["hbm"]["budget_bytes"] == 1024 * 1024 * 1024


def test_a_nack_keeps_the_pool_unconverged_and_shows_the_error(operator, pool, worker_factory, redis_client,
                                                                 key_prefix):
    worker = worker_factory(POOL)
    operator.post(f"{BASE}/revisions/1/publish/")
    worker.reconcile()
    # A spec the worker must refuse (written behind the control plane's back: its API would refuse it too).
    bad = DesiredRevision(generation=2, sha256="x", spec={"cache": {"hbm_budget_mb": -1}}, published_at=time.time())
    redis_client.set(PoolKeys(POOL, prefix=key_prefix).desired, bad.to_json())
    Pool.objects.filter(name=POOL).update(desired_generation=2)
    worker.reconcile()
    status = operator.get(f"{BASE}/status/").json()
    instance = status["instances"][0]
    assert status["converged"] is False
    assert (instance["config_state"], instance["applied_generation"], instance["nacked_generation"]) == ("NACK", 1, 2)
    assert "cache.hbm_budget_mb" in instance["error"]


def test_dead_instances_do_not_block_convergence(operator, pool, worker_factory):
    live, dead = worker_factory(POOL, 0), worker_factory(POOL, 1)
    operator.post(f"{BASE}/revisions/1/publish/")
    live.reconcile()
    dead.heartbeat(at=time.time() - HEARTBEAT_TIMEOUT_S - 10)
    status = operator.get(f"{BASE}/status/").json()
    assert status["converged"] is True
    assert [i["live"] for i in status["instances"]] == [True, False]
    assert status["instances"][1]["heartbeat_age_s"] > HEARTBEAT_TIMEOUT_S


def test_no_live_instance_is_not_converged(operator, pool, redis_on):
    status = operator.get(f"{BASE}/status/").json()
    assert status["instances"] == [] and status["converged"] is False


def test_rollback_publishes_the_old_spec_as_a_new_generation(operator, pool, worker_factory, redis_client, key_prefix):
    worker = worker_factory(POOL)
    generation = _new_revision(operator, 1, {"cache": {"hbm_budget_mb": 64}})
    operator.post(f"{BASE}/revisions/{generation}/publish/")
    worker.reconcile()

    response = operator.post(f"{BASE}/rollback/", {"to_generation": 1, "parent_generation": 2}, format="json")

    assert response.status_code == 201, response.content
    assert response.json()["generation"] == 3
    restored = ConfigRevision.objects.get(pool=pool, generation=3)
    assert restored.spec == ConfigRevision.objects.get(pool=pool, generation=1).spec
    assert (restored.parent_generation, restored.restored_from) == (2, 1)
    assert _desired_in_redis(redis_client, key_prefix).generation == 3
    worker.reconcile()
    assert operator.get(f"{BASE}/status/").json()["converged"] is True


def test_rollback_to_unknown_generation_is_404_and_writes_nothing(operator, pool, redis_on):
    before = (ConfigRevision.objects.count(), AuditEntry.objects.count())
    assert operator.post(f"{BASE}/rollback/", {"to_generation": 9, "parent_generation": 1}, format="json").status_code == 404
    assert (ConfigRevision.objects.count(), AuditEntry.objects.count()) == before


def test_publishing_an_older_generation_is_409(operator, pool, redis_on):
    generation = _new_revision(operator, 1, {})
    operator.post(f"{BASE}/revisions/{generation}/publish/")
    response = operator.post(f"{BASE}/revisions/1/publish/")
    assert response.status_code == 409
    assert "rollback" in response.json()["detail"]


def test_publishing_an_unknown_generation_is_404(operator, pool, redis_on):
    assert operator.post(f"{BASE}/revisions/5/publish/").status_code == 404


def test_republishing_the_desired_generation_rewrites_redis_without_a_new_audit(operator, pool, redis_client,
                                                                              key_prefix):
    operator.post(f"{BASE}/revisions/1/publish/")
    redis_client.delete(PoolKeys(POOL, prefix=key_prefix).desired)
    audits = AuditEntry.objects.count()
    response = operator.post(f"{BASE}/revisions/1/publish/")
    assert response.status_code == 200 and response.json()["changed"] is False
    assert _desired_in_redis(redis_client, key_prefix).generation == 1
    assert AuditEntry.objects.count() == audits


def test_publish_without_redis_is_503_but_the_database_keeps_it(operator, pool, settings):
    settings.REDIS_URL = "redis://127.0.0.1:1/0"  # nothing listens on port 1
    generation = _new_revision(operator, 1, {})
    response = operator.post(f"{BASE}/revisions/{generation}/publish/")
    assert response.status_code == 503
    assert "Redis" in response.json()["detail"]
    pool.refresh_from_db()
    assert (pool.desired_generation, pool.published_generation) == (generation, 0)


def test_sync_repairs_redis_from_the_database(operator, pool, settings, redis_url, key_prefix, redis_client):
    settings.REDIS_URL = None
    generation = _new_revision(operator, 1, {"cache": {"hbm_budget_mb": 300}})
    assert operator.post(f"{BASE}/revisions/{generation}/publish/").status_code == 503
    settings.REDIS_URL = redis_url

    assert services.desired_sync() == {"pools": 1}
    assert services.desired_sync() == {"pools": 1}  # idempotent

    assert _desired_in_redis(redis_client, key_prefix).generation == generation
    pool.refresh_from_db()
    assert pool.published_generation == generation


def test_a_slower_publish_never_overwrites_a_newer_generation_in_redis(operator, pool, redis_client, key_prefix):
    """A faster publish wrote a newer generation to Redis than the one this writer holds (it is
    emulated here by the newer record: the writer builds its record from the database as it is now)."""
    second = _new_revision(operator, 1, {})
    operator.post(f"{BASE}/revisions/{second}/publish/")
    newer = _desired_in_redis(redis_client, key_prefix)
    faster = DesiredRevision(second + 5, newer.sha256, newer.spec, newer.published_at)
    redis_client.set(PoolKeys(POOL, prefix=key_prefix).desired, faster.to_json())
    assert services.desired_push(pool=Pool.objects.get(name=POOL)) is False
    assert _desired_in_redis(redis_client, key_prefix).generation == second + 5


def test_status_without_redis_is_503(viewer, pool, no_redis):
    response = viewer.get(f"{BASE}/status/")
    assert response.status_code == 503
    assert "REDIS_URL" in response.json()["detail"]


@pytest.mark.parametrize("garbage", ["not json", "[1, 2]", '{"instance": "x"}', '{"pid": "abc"}'])
def test_off_contract_status_is_shown_not_fatal(viewer, pool, redis_client, key_prefix, garbage):
    keys = PoolKeys(POOL, prefix=key_prefix)
    redis_client.zadd(keys.members, {f"{POOL}.0": time.time()})
    redis_client.set(keys.status(f"{POOL}.0"), garbage)
    response = viewer.get(f"{BASE}/status/")
    assert response.status_code == 200
    instance = response.json()["instances"][0]
    assert "unreadable status" in instance["error"] and instance["config_state"] == "UNKNOWN"


def test_status_counts_every_state_and_pages_problems_first(operator, pool, worker_factory, redis_client, key_prefix):
    """At fleet scale the page shows what blocks convergence first; counts are over the whole pool."""
    operator.post(f"{BASE}/revisions/1/publish/")
    workers = [worker_factory(POOL, i) for i in range(5)]
    for worker in workers[:3]:
        worker.reconcile()  # ACK generation 1
    workers[3].heartbeat()  # live, not reconciled yet: waiting
    workers[4].heartbeat(at=time.time() - 60)  # gone
    body = operator.get(f"{BASE}/status/?order=problems&limit=2&offset=0").json()
    assert body["counts"] == {"acked": 3, "nacked": 0, "waiting": 1, "gone": 1}
    assert body["total_instances"] == 5 and body["converged"] is False
    assert [i["instance"] for i in body["instances"]] == [f"{POOL}.3", f"{POOL}.4"]
    rest = operator.get(f"{BASE}/status/?order=problems&limit=2&offset=2").json()["instances"]
    assert [i["instance"] for i in rest] == [f"{POOL}.0", f"{POOL}.1"]
    assert len(operator.get(f"{BASE}/status/").json()["instances"]) == 5  # no limit: all, by name
    assert operator.get(f"{BASE}/status/?limit=0").status_code == 400
