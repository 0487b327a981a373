"""Every URL the project routes × every kind of caller: only the right role gets through.

The routes come from Django's resolver, not from a list kept by hand: an endpoint added without an
entry in ``RULES`` fails ``test_every_route_has_an_access_rule``, and a method a view answers that
its rule does not name fails too. Callers: anonymous, a user without a role, viewer, operator, admin
(API calls with their token, pages with their session) and an admin's read-only token.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
from django.contrib.auth import get_user_model
from django.db import transaction
from django.test import Client
from django.urls import URLPattern, URLResolver, get_resolver
from rest_framework.test import APIClient

from controlplane.accounts import services as account_services
from controlplane.accounts.roles import Role
from controlplane.audit.models import AuditEntry

pytestmark = pytest.mark.integration  # publish and pool status reach the test Redis

POOL = "ranking-a"
PASSWORD = "correct horse battery staple"
PRINCIPALS = ("anonymous", "norole", "viewer", "operator", "admin", "readonly")
ROLE_RANK = {"norole": 0, "viewer": 1, "operator": 2, "admin": 3, "readonly": 3}
PUBLIC, ANY_ROLE = "public", "viewer"
ALL_METHODS = ("get", "post", "put", "patch", "delete")


API, PAGE, JSON = "api", "page", "json"


@dataclass(frozen=True)
class Rule:
    least: str  # PUBLIC, or the least role: "viewer", "operator", "admin"
    ok: int  # the status the allowed callers get
    body: dict | None = None
    query: str = ""
    # API: token or session, anonymous → 401. PAGE: session, anonymous → the login page. JSON: an
    # endpoint of the pages' scripts, session only, anonymous → 401.
    kind: str = API
    signed_in: int | None = None  # what a caller with a session gets instead (a login page sends it on)


LOGIN_FORM = Rule(PUBLIC, 200, kind=PAGE, signed_in=302)  # Django's LoginView answers PUT as it does POST
DRF_LOGIN_FORM = Rule(PUBLIC, 200, kind=PAGE)

# route (as the resolver spells it) → method → rule. Sample paths fill the route's parameters below.
RULES: dict[str, dict[str, Rule]] = {
    "api/v1/pools/": {"get": Rule("viewer", 200), "post": Rule("admin", 201, {"name": "matrix-new"})},
    "api/v1/pools/<poolname:pool>/": {"get": Rule("viewer", 200)},
    "api/v1/pools/<poolname:pool>/revisions/": {
        "get": Rule("viewer", 200), "post": Rule("operator", 201, {"parent_generation": 1, "spec": {}})},
    "api/v1/pools/<poolname:pool>/revisions/<generation:generation>/": {"get": Rule("viewer", 200)},
    "api/v1/pools/<poolname:pool>/revisions/<generation:generation>/diff/": {"get": Rule("viewer", 200)},
    "api/v1/pools/<poolname:pool>/revisions/<generation:generation>/publish/": {"post": Rule("operator", 200)},
    "api/v1/pools/<poolname:pool>/rollback/": {"post": Rule("operator", 201, {"to_generation": 1, "parent_generation": 1})},
    "api/v1/audit/": {"get": Rule("viewer", 200)},
    "api/v1/pools/<poolname:pool>/rollout/": {"get": Rule("viewer", 200)},
    # No canary bakes: the allowed callers learn that (409), the others never reach the rollout.
    "api/v1/pools/<poolname:pool>/rollout/promote/": {"post": Rule("operator", 409)},
    "api/v1/pools/<poolname:pool>/rollout/abort/": {"post": Rule("operator", 409)},
    "api/v1/pools/<poolname:pool>/status/": {"get": Rule("viewer", 200)},
    "api/v1/pools/<poolname:pool>/metrics/": {"get": Rule("viewer", 200, query="?window=5m")},
    "api/v1/pools/<poolname:pool>/instances/": {"get": Rule("viewer", 200, query="?window=5m")},
    "api/v1/pools/<poolname:pool>/instances/<instancename:instance>/metrics/": {"get": Rule("viewer", 200)},
    "api/v1/pools/<poolname:pool>/traffic/": {"get": Rule("viewer", 200, query="?window=15m")},
    "api/v1/pools/<poolname:pool>/forwards/": {"get": Rule("viewer", 200, query="?window_s=900")},
    # No captured traffic: the allowed callers learn that (409), the others never reach the capture.
    "api/v1/pools/<poolname:pool>/revisions/<generation:generation>/preview/": {"post": Rule("operator", 409)},
    "api/v1/pools/<poolname:pool>/previews/<generation:preview>/": {"get": Rule("viewer", 404)},
    "api/v1/pools/<poolname:pool>/previews/scores/": {"get": Rule("viewer", 200)},
    # No worker wrote a status: the allowed callers learn that, the others never reach Redis.
    "api/v1/pools/<poolname:pool>/instances/<instancename:instance>/": {"get": Rule("viewer", 404)},
    "api/v1/me/": {"get": Rule("viewer", 200)},
    "api/v1/users/": {"get": Rule("admin", 200), "post": Rule("admin", 201, {"username": "newbie", "role": "viewer"})},
    "api/v1/tokens/": {"get": Rule("admin", 200), "post": Rule("admin", 201, {"username": "viewer"})},
    "api/v1/tokens/<generation:token_id>/": {"delete": Rule("admin", 200)},
    "api/schema/": {"get": Rule("viewer", 200)},
    "api/docs/": {"get": Rule("viewer", 200)},
    "api/redoc/": {"get": Rule("viewer", 200)},
    "metrics": {"get": Rule("viewer", 200)},
    # No captured traffic in the matrix's pool: the allowed callers learn that (409).
    "api/v1/pools/<poolname:pool>/cache-curves/": {"get": Rule("viewer", 409, query="?window=15m")},
    # The health probe: anyone, no login (it says only whether the database and Redis answer).
    "healthz": {"get": Rule(PUBLIC, 200)},
    # The browsable API's log-in form and log-out.
    "api/auth/login/": {"get": DRF_LOGIN_FORM, "post": DRF_LOGIN_FORM, "put": DRF_LOGIN_FORM},
    "api/auth/logout/": {"post": Rule(PUBLIC, 302, kind=PAGE)},
    # Pages, and the JSON endpoints of their scripts.
    "": {"get": Rule(ANY_ROLE, 200, kind=PAGE)},
    "login/": {"get": LOGIN_FORM, "post": LOGIN_FORM, "put": LOGIN_FORM},
    "logout/": {"post": Rule(PUBLIC, 302, kind=PAGE)},
    "audit/": {"get": Rule(ANY_ROLE, 200, kind=PAGE)},
    "pools/<poolname:pool>/": {"get": Rule(ANY_ROLE, 200, kind=PAGE)},
    "pools/<poolname:pool>/config/": {"get": Rule(ANY_ROLE, 200, kind=PAGE)},
    "pools/<poolname:pool>/fleet/": {"get": Rule(ANY_ROLE, 200, kind=PAGE)},
    "pools/<poolname:pool>/instances/<instancename:instance>/": {"get": Rule(ANY_ROLE, 200, kind=PAGE)},
    "ui/pools/<poolname:pool>/check/": {"post": Rule(ANY_ROLE, 200, {"spec": {}}, kind=JSON)},
    # No file: the allowed callers get the validation error, the others never reach validation.
    "ui/pools/<poolname:pool>/editing-upload/": {"post": Rule(ANY_ROLE, 400, kind=JSON)},
    "vendor/plotly.min.js": {"get": Rule(PUBLIC, 200, kind=PAGE)},
    "vendor/redoc.standalone.js": {"get": Rule(PUBLIC, 200, kind=PAGE)},
    "favicon.ico": {"get": Rule(PUBLIC, 204, kind=PAGE)},
}


def routes() -> dict[str, URLPattern]:
    """Every route of the URL map, as its full pattern string → the pattern that serves it."""
    found: dict[str, URLPattern] = {}

    def walk(patterns, prefix: str) -> None:
        for entry in patterns:
            if isinstance(entry, URLResolver):
                walk(entry.url_patterns, prefix + str(entry.pattern))
            else:
                found[prefix + str(entry.pattern)] = entry

    walk(get_resolver().url_patterns, "")
    return found


def view_methods(pattern: URLPattern) -> set[str] | None:
    """The methods a class-based view answers (None for a function view: its rule is trusted)."""
    view_class = getattr(pattern.callback, "view_class", None)
    if view_class is None:
        return None
    allowed = getattr(pattern.callback, "view_initkwargs", {}).get("http_method_names", view_class.http_method_names)
    return {m for m in ALL_METHODS if hasattr(view_class, m) and m in allowed}


def sample_path(route: str, token_id: int) -> str:
    return "/" + (route.replace("<poolname:pool>", POOL).replace("<instancename:instance>", f"{POOL}.0")
                  .replace("<generation:generation>", "1").replace("<generation:preview>", "1")
                  .replace("<generation:token_id>", str(token_id)))


def expected(rule: Rule, method: str, principal: str) -> int | str:
    """The status a caller gets: ``rule.ok`` when allowed, else how it is turned away."""
    has_session = principal not in ("anonymous", "readonly")  # a token is no login for the pages
    if rule.least == PUBLIC:
        return rule.signed_in if has_session and rule.signed_in else rule.ok
    if rule.kind != API:
        if not has_session:
            return "login" if rule.kind == PAGE else 401
        return 403 if principal == "norole" else rule.ok
    if principal == "anonymous":
        return 401
    if ROLE_RANK[principal] < ROLE_RANK[rule.least] or (principal == "readonly" and method != "get"):
        return 403
    return rule.ok


@pytest.fixture
def callers(db, pool, redis_on):
    """principal → (API client with its token, browser client with its session)."""
    out = {"anonymous": (APIClient(), Client())}
    for name, role in (("norole", None), ("viewer", Role.VIEWER), ("operator", Role.OPERATOR),
                       ("admin", Role.ADMIN)):
        if role is None:
            user = get_user_model().objects.create_user(username=name, password=PASSWORD)
        else:
            user = account_services.user_create(username=name, role=role, password=PASSWORD, actor="fixture")
        api = APIClient()
        api.credentials(HTTP_AUTHORIZATION=f"Token {account_services.token_create(user=user, actor='fixture').key}")
        browser = Client()
        assert browser.login(username=name, password=PASSWORD)
        out[name] = (api, browser)
    admin = get_user_model().objects.get(username="admin")
    readonly = APIClient()
    readonly.credentials(HTTP_AUTHORIZATION="Token " + account_services.token_create(
        user=admin, actor="fixture", read_only=True).key)
    out["readonly"] = (readonly, Client())
    return out


def call(client, method: str, path: str, body: dict | None):
    if body is None:
        return getattr(client, method)(path)
    return getattr(client, method)(path, body, content_type="application/json")


def test_every_route_has_an_access_rule():
    found = routes()
    assert sorted(set(found) - set(RULES)) == [], "routes without an access rule in RULES"
    assert sorted(set(RULES) - set(found)) == [], "rules for routes that no longer exist"
    for route, pattern in found.items():
        methods = view_methods(pattern)
        if methods is not None:
            assert methods == set(RULES[route]), f"{route}: the view answers {sorted(methods)}"


@pytest.mark.parametrize("route", sorted(RULES), ids=lambda r: r or "(root)")
def test_route_admits_only_its_principals(callers, route):
    spare = account_services.token_create(user=get_user_model().objects.get(username="viewer"), actor="t").token
    path = sample_path(route, spare.pk)
    wrong: list[str] = []
    for method, rule in RULES[route].items():
        for principal in PRINCIPALS:
            api, browser = callers[principal]
            with transaction.atomic():  # whatever a caller changed is undone before the next one calls
                response = call(api if rule.kind == API else browser, method, path + rule.query, rule.body)
                transaction.set_rollback(True)
            want = expected(rule, method, principal)
            got: int | str = response.status_code
            if got == 302 and "/login/" in response.get("Location", "") and want == "login":
                got = "login"
            if got != want:
                wrong.append(f"{method.upper()} {path} as {principal}: {got}, expected {want}")
    assert wrong == []


@pytest.mark.parametrize("route", sorted(RULES), ids=lambda r: r or "(root)")
def test_methods_without_a_rule_are_refused(callers, route):
    """A method a route does not serve gets 405, even from an admin (e.g. editing the audit log)."""
    rules = list(RULES[route].values())
    api, browser = callers["admin"]
    if rules[0].kind != API and rules[0].least == PUBLIC:
        browser = callers["anonymous"][1]  # a signed-in caller is sent on by the login page first
    before = AuditEntry.objects.count()
    for method in sorted(set(ALL_METHODS) - set(RULES[route])):
        response = call(api if rules[0].kind == API else browser, method, sample_path(route, 1), {"actor": "mallory"})
        assert response.status_code == 405, f"{method.upper()} /{route}: {response.status_code}"
    assert AuditEntry.objects.count() == before


def test_the_audit_log_cannot_be_edited_through_the_api(callers):
    api, _ = callers["admin"]
    entry = AuditEntry.objects.order_by("id").first()
    snapshot = (entry.actor, entry.action, entry.request_id, entry.after)
    for method in ("put", "patch", "delete"):
        for path in ("/api/v1/audit/", f"/api/v1/audit/{entry.pk}/"):
            assert call(api, method, path, {"actor": "mallory"}).status_code in (404, 405)
    entry.refresh_from_db()
    assert (entry.actor, entry.action, entry.request_id, entry.after) == snapshot
    assert AuditEntry.objects.filter(actor="mallory").count() == 0


WRITES = [(route, method) for route, methods in RULES.items() for method in methods if method != "get"]


@pytest.mark.parametrize(("route", "method"), WRITES, ids=[f"{m} /{r}" for r, m in WRITES])
def test_every_session_write_needs_a_csrf_token(callers, route, method):
    """A signed-in browser's write without the CSRF token is refused (403) and changes nothing;
    the log-in forms too (login CSRF). Token callers carry no cookie, so CSRF does not apply to them."""
    rule = RULES[route][method]
    browser = Client(enforce_csrf_checks=True)
    if not (rule.least == PUBLIC and rule.signed_in):  # a login form would send a signed-in caller on
        assert browser.login(username="admin", password=PASSWORD)
    before = AuditEntry.objects.count()
    response = call(browser, method, sample_path(route, 1) + rule.query, rule.body)
    assert response.status_code == 403, response.content[:300]
    assert b"CSRF" in response.content
    assert AuditEntry.objects.count() == before


BROWSER_ACCEPT = "text/html,application/xhtml+xml,application/xml;q=0.9,*/*;q=0.8"  # Chromium's, for a page
API_READS = [route for route, methods in RULES.items() if "get" in methods and methods["get"].kind == API]


@pytest.mark.parametrize("route", API_READS, ids=lambda r: f"/{r}")
def test_every_api_read_opens_in_the_browsable_api(callers, route):
    """What a person gets opening an API URL in a browser (Accept: text/html, signed in): DRF's
    browsable page with the same status the JSON caller gets, never a server error."""
    _, browser = callers["admin"]
    rule = RULES[route]["get"]
    response = browser.get(sample_path(route, 1) + rule.query, HTTP_ACCEPT=BROWSER_ACCEPT)
    assert response.status_code == rule.ok, f"/{route}: {response.status_code}"
    # text, YAML and a probe's JSON by design
    if response.status_code == 200 and route not in ("metrics", "api/schema/", "healthz"):
        assert response["Content-Type"].startswith("text/html"), response["Content-Type"]
