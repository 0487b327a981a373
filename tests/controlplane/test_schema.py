"""The OpenAPI schema describes the API, and nothing generated from it makes the server fail (no 5xx)."""

from __future__ import annotations

import pytest
import schemathesis
from hypothesis import HealthCheck, given
from hypothesis import settings as hypothesis_settings
from schemathesis.checks import not_a_server_error

from controlplane.accounts import services as account_services
from controlplane.accounts.roles import Role
from controlplane.policies import services as policy_services
from controlplane.wsgi import application
from tests.reliability.figures import FIGURES, scaled

EXISTING_POOL = "fuzzed"


@pytest.fixture
def admin_key(db):
    user = account_services.user_create(username="fuzz-admin", role=Role.ADMIN, actor="fixture")
    return account_services.token_create(user=user, actor="fixture").key


EXAMPLES_PER_OPERATION = scaled(15)


def test_schema_and_docs_are_served_without_a_cdn(viewer):
    assert viewer.get("/api/schema/").status_code == 200
    # ReDoc is the sidecar's too, as frontend.assets serves it (without the logo it fetched from outside).
    for page, served in (("/api/docs/", "/static/drf_spectacular_sidecar/"), ("/api/redoc/", "/vendor/redoc.standalone.js")):
        html = viewer.get(page).content.decode()
        assert "cdn." not in html and "unpkg" not in html and "jsdelivr" not in html
        assert served in html


def test_generated_requests_never_cause_a_server_error(admin_key, redis_on, settings, keep_test_connection):
    # schemathesis' lazy pytest loader does not support this pytest; drive hypothesis per operation.
    settings.RELAYGR_WRITE_THROTTLE_RATE = "100000/min"
    settings.AXES_FAILURE_LIMIT = 1_000_000  # generated bad tokens must not lock the fuzzer out (tested apart)
    policy_services.pool_create(name=EXISTING_POOL, actor="fixture")
    headers = {"Authorization": f"Token {admin_key}"}
    schema = schemathesis.openapi.from_wsgi("/api/schema/?format=json", application, headers=headers)
    operations = [result.ok() for result in schema.get_all_operations()]
    assert len(operations) >= 19
    statuses: set[int] = set()
    tried = 0

    for operation in operations:

        @given(case=operation.as_strategy())
        @hypothesis_settings(max_examples=EXAMPLES_PER_OPERATION, deadline=None, database=None,
                             suppress_health_check=list(HealthCheck))
        def check(case):
            nonlocal tried
            # Half the cases aim at a pool that exists, so they get past the 404 into validation.
            if case.path_parameters and "pool" in case.path_parameters and hash(repr(case.body)) % 2:
                case.path_parameters["pool"] = EXISTING_POOL
            response = case.call_and_validate(headers=headers, checks=[not_a_server_error])
            statuses.add(response.status_code)
            tried += 1

        check()
    FIGURES.hostile("schemathesis: no server error (admin)", tried)
    assert {200, 201, 400, 404} <= statuses  # the fuzzing got past authentication and validation


def test_docs_assets_are_served_locally(viewer):
    for asset in ("/static/drf_spectacular_sidecar/swagger-ui-dist/swagger-ui-bundle.js",
                  "/static/drf_spectacular_sidecar/redoc/bundles/redoc.standalone.js"):
        response = viewer.get(asset)
        assert response.status_code == 200, asset
