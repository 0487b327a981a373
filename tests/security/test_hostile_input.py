"""Hostile payloads, one table: each is refused with a 4xx that names what is wrong, and the database
is exactly as it was. Text that is allowed (a comment holding SQL or HTML) is stored verbatim and
shown escaped by the audit page."""

from __future__ import annotations

import json

import pytest
from django.contrib.auth import get_user_model
from django.test import Client

from controlplane.accounts import services as account_services
from controlplane.accounts.models import ApiToken
from controlplane.accounts.roles import Role
from controlplane.audit.models import AuditEntry
from controlplane.policies.models import ConfigRevision, Pool
from tests.reliability.figures import FIGURES

POOL = "ranking-a"
REVISIONS = f"/api/v1/pools/{POOL}/revisions/"
PASSWORD = "correct horse battery staple"


def revision(spec, **extra) -> str:
    return json.dumps({"parent_generation": 1, "spec": spec, **extra})


def nested(depth: int) -> str:
    return '{"a":' * depth + "1" + "}" * depth


# (name, method, path, raw body, expected status, what the message must name)
HOSTILE = [
    # wrong types
    ("generation as a string", "post", REVISIONS, '{"parent_generation": "1", "spec": {}}', 400, "parent_generation"),
    ("generation as a bool", "post", REVISIONS, '{"parent_generation": true, "spec": {}}', 400, "parent_generation"),
    ("generation as a float", "post", REVISIONS, '{"parent_generation": 1.5, "spec": {}}', 400, "parent_generation"),
    ("spec as a list", "post", REVISIONS, revision([1, 2]), 400, "spec"),
    ("threshold as a string", "post", REVISIONS, revision({"trigger": {"at_risk_seq_len": "512"}}), 400,
     "spec.trigger.at_risk_seq_len"),
    ("budget as an object", "post", REVISIONS, revision({"cache": {"hbm_budget_mb": {"$gt": 0}}}), 400,
     "spec.cache.hbm_budget_mb"),
    ("body a JSON list", "post", REVISIONS, "[1, 2, 3]", 400, "object"),
    ("body a JSON string", "post", REVISIONS, '"spec"', 400, "object"),
    ("body not JSON", "post", REVISIONS, "parent_generation=1&spec=", 400, "JSON parse error"),
    # NaN and infinities
    ("NaN literal", "post", REVISIONS, '{"parent_generation": 1, "spec": {"cache": {"hbm_budget_mb": NaN}}}', 400,
     "NaN"),
    ("Infinity literal", "post", REVISIONS,
     '{"parent_generation": 1, "spec": {"slo": {"target_ratio": -Infinity}}}', 400, "Infinity"),
    ("overflowing float (parses to inf)", "post", REVISIONS,
     '{"parent_generation": 1, "spec": {"cache": {"hbm_budget_mb": 1e400}}}', 400, "spec"),
    # huge and negative numbers
    ("huge generation", "post", REVISIONS, '{"parent_generation": ' + "9" * 30 + ', "spec": {}}', 400,
     "parent_generation"),
    ("5000-digit generation", "post", REVISIONS, '{"parent_generation": ' + "9" * 5000 + ', "spec": {}}', 400,
     "JSON parse error"),
    ("huge threshold", "post", REVISIONS, revision({"trigger": {"at_risk_seq_len": 10**40}}), 400,
     "spec.trigger.at_risk_seq_len"),
    ("negative HBM budget", "post", REVISIONS, revision({"cache": {"hbm_budget_mb": -1}}), 400,
     "spec.cache.hbm_budget_mb"),
    ("negative DRAM budget", "post", REVISIONS, revision({"cache": {"dram_budget_mb": -5.5}}), 400,
     "spec.cache.dram_budget_mb"),
    ("negative in-flight limit", "post", REVISIONS, revision({"trigger": {"max_preinfer_inflight": -1}}), 400,
     "spec.trigger.max_preinfer_inflight"),
    # deep nesting and size
    ("spec nested 100 deep", "post", REVISIONS, '{"parent_generation": 1, "spec": ' + nested(100) + "}", 400,
     "nested deeper"),
    ("spec nested 50000 deep", "post", REVISIONS,
     '{"parent_generation": 1, "spec": ' + "[" * 50_000 + "]" * 50_000 + "}", 400, "nested deeper"),
    ("oversized body", "post", REVISIONS, revision({}, comment="x" * (3 * 1024 * 1024)), 413, "bytes"),
    # unicode and control characters
    ("look-alike key (Cyrillic i)", "post", REVISIONS, revision({"tr\u0456gger": {}}), 400, "spec.tr\u0456gger"),
    ("lone surrogate in a comment", "post", REVISIONS, '{"parent_generation": 1, "spec": {}, "comment": "\\ud800"}',
     400, "surrogate"),
    ("lone surrogate as a spec key", "post", REVISIONS, '{"parent_generation": 1, "spec": {"\\udfff": 1}}', 400,
     "surrogate"),
    ("NUL in a comment", "post", REVISIONS, revision({}, comment="a\u0000b"), 400, "comment"),
    ("comment too long", "post", REVISIONS, revision({}, comment="x" * 1001), 400, "comment"),
    ("caller sets the author", "post", REVISIONS, revision({}, author="root"), 400, "author"),
    # pools
    ("pool name with spaces", "post", "/api/v1/pools/", '{"name": "My Pool"}', 400, "name"),
    ("pool name in unicode", "post", "/api/v1/pools/", '{"name": "p\u00f6\u00f6l"}', 400, "name"),
    ("pool name with SQL", "post", "/api/v1/pools/", json.dumps({"name": "x'; DROP TABLE policies_pool;--"}), 400,
     "name"),
    ("pool name too long", "post", "/api/v1/pools/", json.dumps({"name": "a" * 64}), 400, "name"),
    ("negative instance count", "post", "/api/v1/pools/", '{"name": "ok", "expected_instances": -1}', 400,
     "expected_instances"),
    ("huge instance count", "post", "/api/v1/pools/", '{"name": "ok", "expected_instances": 1000000000000}', 400,
     "expected_instances"),
    ("unknown device kind", "post", "/api/v1/pools/", '{"name": "ok", "device_kind": "tpu"}', 400, "device_kind"),
    ("HTML description too long", "post", "/api/v1/pools/",
     json.dumps({"name": "ok", "description": "<b>" * 200}), 400, "description"),
    # rollback, users, tokens
    ("rollback to generation 0", "post", f"/api/v1/pools/{POOL}/rollback/", '{"to_generation": 0}', 400,
     "to_generation"),
    ("rollback to a string", "post", f"/api/v1/pools/{POOL}/rollback/", '{"to_generation": "1"}', 400,
     "to_generation"),
    ("rollback to a huge generation", "post", f"/api/v1/pools/{POOL}/rollback/", '{"to_generation": 1e30}', 400,
     "to_generation"),
    ("user name with markup", "post", "/api/v1/users/", '{"username": "<script>", "role": "viewer"}', 400,
     "username"),
    ("user with a made-up role", "post", "/api/v1/users/", '{"username": "eve", "role": "root"}', 400, "role"),
    ("user with a short password", "post", "/api/v1/users/", '{"username": "eve", "role": "viewer", "password": "x"}',
     400, "password"),
    ("token for a number", "post", "/api/v1/tokens/", '{"username": 123}', 400, "username"),
    ("token read_only as a string", "post", "/api/v1/tokens/", '{"username": "admin", "read_only": "yes"}', 400,
     "read_only"),
    # query strings
    ("unknown metrics window", "get", f"/api/v1/pools/{POOL}/metrics/?window=1y", None, 400, "window"),
    ("audit filter not a date", "get", "/api/v1/audit/?since=yesterday", None, 400, "since"),
    ("diff against a huge generation", "get", f"/api/v1/pools/{POOL}/revisions/1/diff/?against=99999999999", None,
     400, "against"),
    # the editor's dry-run check (a session endpoint of the config page)
    ("check body nested 50000 deep", "post", f"/ui/pools/{POOL}/check/", '{"spec": ' + "[" * 50_000 + "]" * 50_000
     + "}", 400, "JSON"),
    ("check body a surrogate", "post", f"/ui/pools/{POOL}/check/", '{"spec": {"\\ud800": 1}}', 400, "JSON"),
]


def database_state() -> tuple:
    return (Pool.objects.count(), ConfigRevision.objects.count(), AuditEntry.objects.count(),
            get_user_model().objects.count(), ApiToken.objects.count(),
            tuple(Pool.objects.values_list("name", "desired_generation", "published_generation")))


@pytest.fixture
def session(db):
    user = account_services.user_create(username="sre-session", role=Role.ADMIN, password=PASSWORD, actor="fixture")
    browser = Client()
    assert browser.login(username=user.username, password=PASSWORD)
    return browser


@pytest.mark.parametrize(("name", "method", "path", "body", "status", "names"), HOSTILE,
                         ids=[row[0] for row in HOSTILE])
def test_hostile_input_is_refused_naming_the_problem_and_changes_nothing(admin, session, pool, name, method, path,
                                                                         body, status, names):
    client = session if path.startswith("/ui/") else admin
    before = database_state()
    if body is None:
        response = getattr(client, method)(path)
    else:
        response = client.generic(method.upper(), path, body.encode("utf-8", "surrogatepass"),
                                  content_type="application/json")
    FIGURES.hostile("API payloads")
    assert response.status_code == status, response.content[:500]
    message = response.json()
    assert names in json.dumps(message, ensure_ascii=False), message
    assert database_state() == before


HTML_AND_SQL = "<script>alert('pwned')</script> ' OR 1=1; DROP TABLE policies_pool; -- <img src=x onerror=alert(1)>"


def test_markup_and_sql_in_a_comment_are_stored_verbatim_and_shown_escaped(operator, session, pool):
    created = operator.post(REVISIONS, {"parent_generation": 1, "spec": {}, "comment": HTML_AND_SQL}, format="json")
    assert created.status_code == 201, created.content
    assert operator.get(f"{REVISIONS}2/").json()["comment"] == HTML_AND_SQL
    assert Pool.objects.filter(name=POOL).exists()
    page = session.get("/audit/").content.decode()
    FIGURES.hostile("markup shown on pages")
    assert "<script>alert" not in page and "<img src=x" not in page
    assert "&lt;script&gt;alert(" in page and "&lt;img src=x onerror=alert(1)&gt;" in page
