"""The pages on the server side, without a browser: access, roles, the plotly bundle, no external URLs,
the editor's dry-run check and the audit filters."""

from __future__ import annotations

import gzip
import importlib.resources
import re

import pytest
from django.contrib.auth import get_user_model
from django.test import Client

from controlplane.accounts import services as account_services
from controlplane.accounts.roles import Role
from controlplane.policies import services as policy_services

POOL = "ranking-a"
PASSWORD = "correct horse battery staple"
PAGES = ["/", f"/pools/{POOL}/", f"/pools/{POOL}/config/", f"/pools/{POOL}/fleet/", "/audit/"]


@pytest.fixture
def pool(db, settings):
    settings.REDIS_URL = None  # created in the database only; the pages do not need Redis to render
    return policy_services.pool_create(name=POOL, description="a pool", expected_instances=2, actor="fixture")


def _browser(username: str, role: Role | None) -> Client:
    if role is None:
        get_user_model().objects.create_user(username=username, password=PASSWORD)
    else:
        account_services.user_create(username=username, role=role, password=PASSWORD, actor="fixture")
    client = Client()
    assert client.login(username=username, password=PASSWORD)
    return client


@pytest.fixture
def operator(db):
    return _browser("sre", Role.OPERATOR)


@pytest.fixture
def viewer(db):
    return _browser("pm", Role.VIEWER)


@pytest.mark.parametrize("path", PAGES)
def test_pages_send_an_anonymous_visitor_to_the_login_page(pool, path):
    response = Client().get(path)
    assert response.status_code == 302
    assert response["Location"].startswith("/login/?next=")


def test_login_page_logs_in_and_lands_on_the_overview(pool, operator):
    client = Client()
    response = client.post("/login/", {"username": "sre", "password": PASSWORD})
    assert response.status_code == 302 and response["Location"] == "/"
    assert client.get("/").status_code == 200


def test_logout_needs_a_post(operator):
    assert operator.get("/logout/").status_code == 405
    assert operator.post("/logout/").status_code == 302
    assert operator.get("/").status_code == 302


@pytest.mark.parametrize("path", PAGES)
def test_pages_reference_nothing_outside_the_server(pool, operator, path):
    html = operator.get(path).content.decode()
    external = re.findall(r"""(?:src|href|action)\s*=\s*["']((?:https?:)?//[^"']+)""", html)
    assert external == []
    assert "cdn" not in html.lower()


def test_plotly_is_served_from_the_installed_package_with_long_caching(pool, operator):
    bundle = (importlib.resources.files("plotly") / "package_data" / "plotly.min.js").read_bytes()
    page = operator.get(f"/pools/{POOL}/").content.decode()
    url = re.search(r'<script src="(/vendor/plotly\.min\.js\?v=[\d.]+)"', page)
    assert url, "the live view loads plotly.js from this server, versioned"
    plain = Client().get(url.group(1))
    assert plain.content == bundle
    assert "immutable" in plain["Cache-Control"] and "max-age=31536000" in plain["Cache-Control"]
    zipped = Client().get("/vendor/plotly.min.js", HTTP_ACCEPT_ENCODING="gzip, br")
    assert zipped["Content-Encoding"] == "gzip" and gzip.decompress(zipped.content) == bundle
    assert Client().get("/vendor/plotly.min.js", HTTP_IF_NONE_MATCH=plain["ETag"]).status_code == 304


def test_overview_without_pools_explains_how_to_start(db):
    admin = _browser("root", Role.ADMIN)
    html = admin.get("/").content.decode()
    assert "No pools yet" in html and "python -m workers.pool" in html
    assert 'id="create-pool"' in html
    viewer = _browser("pm", Role.VIEWER)
    assert 'id="create-pool"' not in viewer.get("/").content.decode()


def test_a_user_without_a_role_is_told_to_ask_for_one(pool):
    response = _browser("nobody", None).get(f"/pools/{POOL}/")
    assert response.status_code == 403
    assert b"holds no role" in response.content


def test_an_unknown_pool_is_a_page_listing_the_pools(pool, operator):
    response = operator.get("/pools/no-such-pool/")
    assert response.status_code == 404
    assert b"No pool named" in response.content and f"/pools/{POOL}/".encode() in response.content


def test_the_editor_gives_operators_inputs_and_viewers_none(pool, operator, viewer):
    editable = operator.get(f"/pools/{POOL}/config/").content.decode()
    assert 'data-path="cache.hbm_budget_mb"' in editable and 'data-role="publish"' in editable
    read_only = viewer.get(f"/pools/{POOL}/config/").content.decode()
    assert "<input" not in read_only.split("<main>")[1].split("</main>")[0].replace('type="hidden"', "")
    assert 'data-role="publish"' not in read_only and "read-only for you" in read_only


def _check(client, spec):
    return client.post(f"/ui/pools/{POOL}/check/", {"spec": spec}, content_type="application/json")


def test_the_check_reports_schema_errors_by_field_path(pool, operator):
    body = _check(operator, {"trigger": {"max_preinfer_inflight": -1}, "cache": {"hbm_budget_mb": "lots"}}).json()
    assert body["valid"] is False
    assert body["errors"] == {
        "trigger.max_preinfer_inflight": ["must be in [0, 100000], got -1"],
        "cache.hbm_budget_mb": ["must be a number in [0.0, 16777216], got 'lots'"],
    }


def test_the_check_diffs_a_valid_spec_against_the_live_revision(pool, operator):
    body = _check(operator, {"trigger": {"at_risk_seq_len": 256}}).json()
    assert body["valid"] is True and body["against"] == 1
    assert body["changes"] == [{"path": "trigger.at_risk_seq_len", "op": "changed", "before": 512, "after": 256}]


def test_the_check_needs_a_session_and_a_json_body(pool, operator):
    assert _check(Client(), {}).status_code == 401
    assert operator.post(f"/ui/pools/{POOL}/check/", "nope", content_type="application/json").status_code == 400
    assert operator.post("/ui/pools/nope/check/", {"spec": {}}, content_type="application/json").status_code == 404


def test_audit_log_filters_by_action_and_reports_bad_filters(pool, operator):
    html = operator.get("/audit/", {"action": "pool.create"}).content.decode()
    assert "pool.create" in html and "user.create</span>" not in html
    bad = operator.get("/audit/", {"since": "yesterday"}).content.decode()
    assert "since:" in bad and "No entries match" in bad
