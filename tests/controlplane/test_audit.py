"""Every change writes an audit entry: who, when, which request, before and after."""

from __future__ import annotations

import io

import pytest
from django.core.management import call_command
from django.db import connection
from django.db.migrations.executor import MigrationExecutor

from controlplane.audit.models import AuditEntry

POOL = "ranking-a"
BASE = f"/api/v1/pools/{POOL}"


def test_every_change_is_audited_with_actor_and_request_id(admin, operator, redis_on):
    steps = [
        (admin, "post", "/api/v1/pools/", {"name": POOL}, "pool.create"),
        (operator, "post", f"{BASE}/revisions/", {"parent_generation": 1, "spec": {"slo": {"target_ratio": 0.9}}},
         "revision.create"),
        (operator, "post", f"{BASE}/revisions/2/publish/", None, "revision.publish"),
        (operator, "post", f"{BASE}/rollback/", {"to_generation": 1, "parent_generation": 2}, "pool.rollback"),
        (admin, "post", "/api/v1/users/", {"username": "pm", "role": "viewer"}, "user.create"),
        (admin, "post", "/api/v1/tokens/", {"username": "pm"}, "token.create"),
    ]
    for i, (client, method, path, body, action) in enumerate(steps):
        request_id = f"req-{i}"
        response = getattr(client, method)(path, body, format="json", HTTP_X_REQUEST_ID=request_id)
        assert response.status_code in (200, 201), response.content
        assert response["X-Request-ID"] == request_id
        entry = AuditEntry.objects.filter(request_id=request_id, action=action).get()
        assert entry.actor == ("admin" if client is admin else "operator")

    token_id = admin.get("/api/v1/tokens/").json()["results"][-1]["id"]
    admin.delete(f"/api/v1/tokens/{token_id}/")
    assert AuditEntry.objects.filter(action="token.revoke", object_id=str(token_id)).exists()

    publish = AuditEntry.objects.filter(action="revision.publish").order_by("id")
    assert [(e.before, e.after["desired_generation"]) for e in publish] == [
        ({"desired_generation": 1}, 2), ({"desired_generation": 2}, 3)]
    created = AuditEntry.objects.get(action="revision.create", request_id="req-1")
    assert created.after["spec"]["slo"]["target_ratio"] == 0.9


def test_failed_changes_leave_no_audit_entry(operator, pool):
    before = AuditEntry.objects.count()
    operator.post(f"{BASE}/revisions/", {"parent_generation": 9, "spec": {}}, format="json")
    operator.post(f"{BASE}/revisions/", {"parent_generation": 1, "spec": {"nope": 1}}, format="json")
    assert AuditEntry.objects.count() == before


def test_audit_is_filterable(admin, operator, viewer, pool, redis_on):
    operator.post(f"{BASE}/revisions/", {"parent_generation": 1, "spec": {}}, format="json")
    admin.post("/api/v1/pools/", {"name": "other"}, format="json")
    by_pool = viewer.get("/api/v1/audit/", {"pool": "other"}).json()["results"]
    assert [e["action"] for e in by_pool] == ["pool.create"]
    by_actor = viewer.get("/api/v1/audit/", {"actor": "operator"}).json()["results"]
    assert [e["action"] for e in by_actor] == ["revision.create"]
    by_action = viewer.get("/api/v1/audit/", {"action": "pool.create"}).json()["results"]
    assert {e["pool"] for e in by_action} == {POOL, "other"}
    newest = by_action[0]["time"]
    assert viewer.get("/api/v1/audit/", {"since": newest}).json()["count"] >= 1
    assert viewer.get("/api/v1/audit/", {"until": "2000-01-01T00:00:00Z"}).json()["count"] == 0


def test_bad_audit_filters_are_400_naming_the_field(viewer, pool):
    response = viewer.get("/api/v1/audit/", {"since": "yesterday", "action": "explode"})
    assert response.status_code == 400
    assert set(response.json()["errors"]) == {"since", "action"}


def test_huge_offsets_are_harmless(viewer, pool):
    response = viewer.get("/api/v1/audit/", {"offset": "9" * 40, "limit": "9" * 40})
    assert response.status_code == 200
    assert response.json()["results"] == []


# --- the audit log's move from ``policies`` to the shared ``audit`` app --------------------------

MOVE = [("policies", "0005_audit_entry_moves_to_audit"), ("audit", "0001_initial")]


@pytest.mark.django_db(transaction=True)  # SQLite's schema editor runs outside a transaction
@pytest.mark.parametrize(("app", "migration"), MOVE)
def test_the_move_touches_no_table(app, migration):
    """Only Django's state moves: the migrations run no SQL that creates, alters, copies or drops."""
    out = io.StringIO()
    call_command("sqlmigrate", app, migration, stdout=out)
    statements = [line for line in out.getvalue().splitlines()
                  if line.strip() and not line.startswith("--") and line.strip() not in ("BEGIN;", "COMMIT;")]
    assert statements == []


@pytest.mark.django_db(transaction=True)
def test_entries_written_before_the_move_are_read_after_it_from_the_same_table():
    policies_before = ("policies", "0004_audit_previews_and_traffic_downloads")
    executor = MigrationExecutor(connection)
    executor.migrate([policies_before, ("audit", None)])
    old_model = executor.loader.project_state(policies_before).apps.get_model("policies", "AuditEntry")
    written = old_model.objects.create(actor="sre", action="revision.publish", object_type="pool",
                                       object_id="ranking-a", pool="ranking-a", after={"desired_generation": 2})

    executor = MigrationExecutor(connection)
    executor.migrate(executor.loader.graph.leaf_nodes())

    read = AuditEntry.objects.get(pk=written.pk)
    assert (read.actor, read.action, read.pool, read.after) == ("sre", "revision.publish", "ranking-a",
                                                                {"desired_generation": 2})
    assert AuditEntry._meta.app_label == "audit" and AuditEntry._meta.db_table == "policies_auditentry"
    tables = connection.introspection.table_names()
    assert "policies_auditentry" in tables and "audit_auditentry" not in tables
