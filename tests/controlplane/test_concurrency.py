"""Concurrent writers against the real database (SQLite in WAL with IMMEDIATE transactions by default;
PostgreSQL when DATABASE_URL names it, as CI runs this directory): one winner, the others a 409 that
writes nothing, never a 5xx. Real threads, each with its own connection, released together by a barrier.
"""

from __future__ import annotations

import threading
from collections import Counter
from concurrent.futures import ThreadPoolExecutor

import pytest
from django.db import connection, connections, transaction
from rest_framework.test import APIClient

from controlplane.accounts import services as account_services
from controlplane.accounts.roles import Role
from controlplane.audit.models import AuditEntry
from controlplane.policies.models import ConfigRevision, Pool
from relay_engine.core.wire import DesiredRevision, PoolKeys
from tests.reliability.figures import FIGURES

pytestmark = pytest.mark.django_db(transaction=True)

POOL = "ranking-a"
BASE = f"/api/v1/pools/{POOL}"
WRITERS = 8


@pytest.fixture
def token(db) -> str:
    user = account_services.user_create(username="racer", role=Role.OPERATOR, actor="fixture")
    return account_services.token_create(user=user, actor="fixture").key


def race(token: str, requests: list[tuple[str, dict | None]]) -> list[tuple[int, dict]]:
    """POST every (path, body) at once, one thread and one database connection each."""
    barrier = threading.Barrier(len(requests))

    def post(path: str, body: dict | None) -> tuple[int, dict]:
        client = APIClient()
        client.credentials(HTTP_AUTHORIZATION=f"Token {token}")
        try:
            barrier.wait(30)
            response = client.post(path, body, format="json")
            return response.status_code, response.json()
        finally:
            connections.close_all()

    with ThreadPoolExecutor(len(requests)) as threads:
        futures = [threads.submit(post, path, body) for path, body in requests]
        return [future.result(timeout=120) for future in futures]


def statuses(results: list[tuple[int, dict]], operation: str) -> Counter:
    counts = Counter(status for status, _ in results)
    FIGURES.concurrent_writes(connection.vendor, operation, counts)
    assert not [body for status, body in results if status >= 500], results
    return counts


def revisions(count: int) -> list[int]:
    """``count`` more revisions on the pool, created one after another; their generations."""
    pool = Pool.objects.get(name=POOL)
    made = []
    for _ in range(count):
        latest = ConfigRevision.objects.filter(pool=pool).order_by("-generation").first().generation
        ConfigRevision.objects.create(pool=pool, generation=latest + 1, parent_generation=latest,
                                      spec=ConfigRevision.objects.get(pool=pool, generation=1).spec,
                                      sha256=ConfigRevision.objects.get(pool=pool, generation=1).sha256,
                                      author="fixture")
        made.append(latest + 1)
    return made


def test_concurrent_creates_on_one_parent_have_one_winner_and_409s(token, pool):
    results = race(token, [(f"{BASE}/revisions/", {"parent_generation": 1, "comment": f"writer {i}",
                                                   "spec": {"trigger": {"max_preinfer_inflight": i + 1}}})
                           for i in range(WRITERS)])
    assert statuses(results, "create on one parent") == Counter({201: 1, 409: WRITERS - 1})
    winner = next(body for status, body in results if status == 201)
    assert list(ConfigRevision.objects.filter(pool=pool).values_list("generation", flat=True)) == [2, 1]
    assert ConfigRevision.objects.get(pool=pool, generation=2).comment == winner["comment"]
    assert AuditEntry.objects.filter(action="revision.create").count() == 1
    assert all("parent_generation" in body["errors"] for status, body in results if status == 409)


def test_concurrent_rollbacks_on_one_parent_have_one_winner_and_409s(token, pool, redis_on):
    latest = revisions(WRITERS)[-1]
    results = race(token, [(f"{BASE}/rollback/", {"to_generation": target, "parent_generation": latest})
                           for target in range(1, WRITERS + 1)])
    assert statuses(results, "rollback on one parent") == Counter({201: 1, 409: WRITERS - 1})
    winner = next(body for status, body in results if status == 201)
    assert winner["generation"] == latest + 1 == Pool.objects.get(name=POOL).desired_generation
    assert ConfigRevision.objects.filter(pool=pool).count() == latest + 1
    assert AuditEntry.objects.filter(action="pool.rollback").count() == 1


def test_the_same_rollback_sent_concurrently_creates_one_revision(token, pool, redis_on, redis_client):
    latest = revisions(2)[-1]
    results = race(token, [(f"{BASE}/rollback/", {"to_generation": 1, "parent_generation": latest})] * WRITERS)
    assert statuses(results, "the same rollback repeated") == Counter({201: 1, 200: WRITERS - 1})
    assert {body["generation"] for _, body in results} == {latest + 1}
    assert [body["changed"] for status, body in results if status == 200] == [False] * (WRITERS - 1)
    assert ConfigRevision.objects.filter(pool=pool).count() == latest + 1
    assert AuditEntry.objects.filter(action="pool.rollback").count() == 1
    assert DesiredRevision.from_json(redis_client.get(PoolKeys(POOL).desired)).generation == latest + 1


def test_concurrent_publishes_of_one_generation_change_it_once(token, pool, redis_on):
    generation = revisions(1)[-1]
    results = race(token, [(f"{BASE}/revisions/{generation}/publish/", None)] * WRITERS)
    assert statuses(results, "publish of one generation") == Counter({200: WRITERS})
    assert sorted(body["changed"] for _, body in results) == [False] * (WRITERS - 1) + [True]
    assert AuditEntry.objects.filter(action="revision.publish").count() == 1


def test_concurrent_publishes_of_different_generations_end_on_the_newest(token, pool, redis_on, redis_client):
    generations = revisions(WRITERS)
    results = race(token, [(f"{BASE}/revisions/{g}/publish/", None) for g in generations])
    counts = statuses(results, "publish of different generations")
    assert set(counts) <= {200, 409} and counts[200] >= 1
    changed = sum(body["changed"] for status, body in results if status == 200)
    assert AuditEntry.objects.filter(action="revision.publish").count() == changed >= 1
    # Whatever the order, the newest wins everywhere: the database, and Redis (a monotonic push).
    pool_row = Pool.objects.get(name=POOL)
    assert pool_row.desired_generation == pool_row.published_generation == generations[-1]
    assert DesiredRevision.from_json(redis_client.get(PoolKeys(POOL).desired)).generation == generations[-1]


def test_a_mixed_storm_of_writes_gets_no_server_error_and_keeps_one_chain(token, pool, redis_on):
    latest = revisions(3)[-1]
    requests: list[tuple[str, dict | None]] = []
    for i in range(4):
        requests += [(f"{BASE}/revisions/", {"parent_generation": latest, "spec": {"slo": {"target_ratio": 0.9}}}),
                     (f"{BASE}/rollback/", {"to_generation": 1 + i % 2, "parent_generation": latest}),
                     (f"{BASE}/revisions/{latest - i % 2}/publish/", None)]
    statuses(race(token, requests), "mixed creates, rollbacks, publishes")
    chain = list(ConfigRevision.objects.filter(pool=pool).order_by("generation").values_list(
        "generation", "parent_generation"))
    assert chain == [(1, None)] + [(g, g - 1) for g in range(2, len(chain) + 1)]  # no fork, no gap
    assert len(chain) == latest + 1  # exactly one of the writers on the latest parent won


def _hold_write_lock(holding: threading.Event, release: threading.Event) -> None:
    """Hold the database's write lock (SQLite) or the pool table (PostgreSQL) until released."""
    try:
        with transaction.atomic(), connection.cursor() as cursor:
            if connection.vendor == "postgresql":
                cursor.execute("LOCK TABLE policies_pool IN ACCESS EXCLUSIVE MODE")
            else:
                cursor.execute("UPDATE policies_pool SET description = description")  # IMMEDIATE: locked already
            holding.set()
            release.wait(30)
    finally:
        connections.close_all()


def test_a_write_that_cannot_get_the_lock_in_time_is_a_503_that_writes_nothing(operator, pool):
    holding, release = threading.Event(), threading.Event()
    holder = threading.Thread(target=_hold_write_lock, args=(holding, release))
    holder.start()
    try:
        assert holding.wait(30)
        with connection.cursor() as cursor:  # a short wait for the lock, instead of the busy timeout
            cursor.execute("SET lock_timeout = '300ms'" if connection.vendor == "postgresql" else
                           "PRAGMA busy_timeout = 300")
        response = operator.post(f"{BASE}/revisions/", {"parent_generation": 1, "spec": {}}, format="json")
    finally:
        release.set()
        holder.join(30)
        connection.close()  # the next test's connection waits for locks as configured again
    assert response.status_code == 503, response.content
    assert response["Retry-After"] == "1" and "retry" in response.json()["detail"]
    assert ConfigRevision.objects.filter(pool=pool).count() == 1
    assert operator.post(f"{BASE}/revisions/", {"parent_generation": 1, "spec": {}}, format="json").status_code == 201


def test_promote_and_abort_racing_on_one_bake_have_one_winner(token, pool, redis_client, worker_factory):
    """Four promotes and four aborts of one baking canary at once: one decision, the rest 409, and
    Redis says what the database says (the winner's overrides and revocation, none of the loser's)."""
    from controlplane.policies import services as policy_services

    policy_services.desired_push(pool=pool)
    workers = [worker_factory(POOL, i) for i in range(3)]
    for worker in workers:
        worker.reconcile()
    generation = revisions(1)[-1]
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION=f"Token {token}")
    started = client.post(f"{BASE}/revisions/{generation}/publish/", {"strategy": "canary", "canary_instances": 1,
                                                                      "bake_s": 60}, format="json")
    assert started.status_code == 201, started.content
    results = race(token, [(f"{BASE}/rollout/{action}/", None) for action in ("promote", "abort") * 4])
    assert statuses(results, "promote vs abort of one bake") == Counter({200: 1, 409: WRITERS - 1})
    winner = next(body for status, body in results if status == 200)["state"]
    pool_row = Pool.objects.get(name=POOL)
    keys = PoolKeys(POOL)
    assert redis_client.get(keys.instance_desired(f"{POOL}.0")) is None
    record = DesiredRevision.from_json(redis_client.get(keys.desired))
    if winner == "promoted":
        assert pool_row.desired_generation == record.generation == generation
    else:
        assert winner == "aborted" and record.generation == 1 and record.may_step_down(generation)
    assert {w.reconcile().applied_generation for w in workers} == {record.generation}
