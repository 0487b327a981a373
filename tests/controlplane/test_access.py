"""Who may do what: every endpoint × role; deny by default; tokens; sessions with CSRF."""

from __future__ import annotations

import pytest
from django.contrib.auth import get_user_model
from rest_framework.test import APIClient

from controlplane.accounts import services as account_services
from controlplane.accounts.models import ApiToken, token_digest
from controlplane.accounts.roles import Role

ROLE_ORDER = ["viewer", "operator", "admin"]
POOL = "ranking-a"

# (method, path, body, least role, status on success)
ENDPOINTS = [
    ("get", "/api/v1/pools/", None, "viewer", 200),
    ("post", "/api/v1/pools/", {"name": "new-pool"}, "admin", 201),
    ("get", f"/api/v1/pools/{POOL}/", None, "viewer", 200),
    ("get", f"/api/v1/pools/{POOL}/revisions/", None, "viewer", 200),
    ("post", f"/api/v1/pools/{POOL}/revisions/", {"parent_generation": 1, "spec": {}}, "operator", 201),
    ("get", f"/api/v1/pools/{POOL}/revisions/1/", None, "viewer", 200),
    ("get", f"/api/v1/pools/{POOL}/revisions/1/diff/", None, "viewer", 200),
    ("post", f"/api/v1/pools/{POOL}/revisions/1/publish/", None, "operator", 200),
    ("post", f"/api/v1/pools/{POOL}/rollback/", {"to_generation": 1, "parent_generation": 1}, "operator", 201),
    ("get", f"/api/v1/pools/{POOL}/status/", None, "viewer", 200),
    ("get", f"/api/v1/pools/{POOL}/metrics/?window=5m", None, "viewer", 200),
    ("get", "/api/v1/audit/", None, "viewer", 200),
    ("get", "/api/v1/me/", None, "viewer", 200),
    ("get", "/api/v1/users/", None, "admin", 200),
    ("post", "/api/v1/users/", {"username": "newcomer", "role": "viewer"}, "admin", 201),
    ("get", "/api/v1/tokens/", None, "admin", 200),
    ("post", "/api/v1/tokens/", {"username": "viewer", "read_only": True}, "admin", 201),
    ("delete", "/api/v1/tokens/{token_id}/", None, "admin", 200),
    ("get", "/metrics", None, "viewer", 200),
    ("get", "/api/schema/", None, "viewer", 200),
]


def _call(client, method, path, body):
    return getattr(client, method)(path, body, format="json") if body is not None else getattr(client, method)(path)


@pytest.mark.parametrize("role", ["anonymous", "norole", *ROLE_ORDER])
@pytest.mark.parametrize(("method", "path", "body", "least", "ok"), ENDPOINTS,
                         ids=[f"{m} {p}" for m, p, *_ in ENDPOINTS])
def test_endpoint_allows_only_its_roles(clients, pool, redis_on, role, method, path, body, least, ok):
    viewer_user = get_user_model().objects.get(username="viewer")
    spare = account_services.token_create(user=viewer_user, actor="test").token
    response = _call(clients[role], method, path.format(token_id=spare.pk), body)
    if role == "anonymous":
        assert response.status_code == 401, response.content
        assert response["WWW-Authenticate"] == "Token"
    elif role == "norole" or ROLE_ORDER.index(role) < ROLE_ORDER.index(least):
        assert response.status_code == 403, response.content
    else:
        assert response.status_code == ok, response.content


def test_tokens_are_stored_as_digests_only(db):
    user = account_services.user_create(username="robot", role=Role.OPERATOR, actor="test")
    issued = account_services.token_create(user=user, actor="test")
    stored = ApiToken.objects.get(pk=issued.token.pk)
    assert stored.key_digest == token_digest(issued.key)
    assert issued.key not in {str(v) for v in stored.__dict__.values()}


def test_read_only_token_reads_but_never_writes(db, pool):
    user = account_services.user_create(username="robot", role=Role.OPERATOR, actor="test")
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION=f"Token {account_services.token_create(user=user, actor='t', read_only=True).key}")
    assert client.get("/api/v1/pools/").status_code == 200
    response = client.post(f"/api/v1/pools/{POOL}/revisions/", {"parent_generation": 1, "spec": {}}, format="json")
    assert response.status_code == 403
    assert "read-only" in response.json()["detail"]


def test_revoked_token_is_refused(clients, admin):
    token = ApiToken.objects.get(user__username="viewer")
    assert admin.delete(f"/api/v1/tokens/{token.pk}/").status_code == 200
    assert clients["viewer"].get("/api/v1/pools/").status_code == 401


def test_unknown_token_is_401(db):
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION="Token rgr_not-a-real-key")
    assert client.get("/api/v1/pools/").status_code == 401


def test_bearer_keyword_is_accepted_for_scrapers(db):
    user = account_services.user_create(username="prom", role=Role.VIEWER, actor="test")
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION=f"Bearer {account_services.token_create(user=user, actor='t').key}")
    assert client.get("/api/v1/me/").json()["role"] == "viewer"


def test_session_writes_need_a_csrf_token(db, pool):
    get_user_model().objects.create_user(username="sre", password="correct horse battery")
    account_services.user_role_set(user=get_user_model().objects.get(username="sre"), role=Role.OPERATOR,
                                   actor="test")
    browser = APIClient(enforce_csrf_checks=True)
    assert browser.login(username="sre", password="correct horse battery")
    assert browser.get("/api/v1/pools/").status_code == 200
    body = {"parent_generation": 1, "spec": {}}
    refused = browser.post(f"/api/v1/pools/{POOL}/revisions/", body, format="json")
    assert refused.status_code == 403
    assert "CSRF" in refused.json()["detail"]
    browser.get("/api/auth/login/")
    csrf = browser.cookies["csrftoken"].value
    accepted = browser.post(f"/api/v1/pools/{POOL}/revisions/", body, format="json", HTTP_X_CSRFTOKEN=csrf)
    assert accepted.status_code == 201


def test_writes_are_throttled_per_user(operator, pool, settings):
    settings.RELAYGR_WRITE_THROTTLE_RATE = "3/min"
    codes = []
    for parent in range(1, 6):
        response = operator.post(f"/api/v1/pools/{POOL}/revisions/", {"parent_generation": parent, "spec": {}},
                                 format="json")
        codes.append(response.status_code)
    assert codes == [201, 201, 201, 429, 429]
    assert operator.get("/api/v1/pools/").status_code == 200  # reads are not throttled


def test_admin_creates_user_and_token_that_works(admin, pool):
    assert admin.post("/api/v1/users/", {"username": "pm", "role": "viewer"}, format="json").status_code == 201
    issued = admin.post("/api/v1/tokens/", {"username": "pm"}, format="json").json()
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION=f"Token {issued['key']}")
    assert client.get("/api/v1/me/").json() == {"username": "pm", "role": "viewer", "read_only_token": False}
    listed = admin.get("/api/v1/tokens/").json()["results"]
    assert all("key" not in token for token in listed)
