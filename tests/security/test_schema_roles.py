"""schemathesis over the whole OpenAPI schema, once per kind of caller: no 5xx, and no response the
schema does not describe (status code, content type, body), whoever asks.

``tests/controlplane/test_schema.py`` fuzzes as an admin for server errors; here every role (and a
read-only token) gets the generated requests, so the 401/403 paths and each role's view of the data
are checked against the schema too.
"""

from __future__ import annotations

import pytest
import schemathesis
from hypothesis import HealthCheck, given
from hypothesis import settings as hypothesis_settings
from schemathesis.checks import (
    content_type_conformance,
    not_a_server_error,
    response_schema_conformance,
    status_code_conformance,
)

from controlplane.accounts import services as account_services
from controlplane.accounts.roles import Role
from controlplane.policies import services as policy_services
from controlplane.wsgi import application
from tests.reliability.figures import FIGURES, scaled

pytestmark = pytest.mark.integration

EXISTING_POOL = "fuzzed"
# Fewer per operation than the admin run: the four callers together still try several hundred.
EXAMPLES_PER_OPERATION = scaled(5)
CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance, response_schema_conformance]
CALLERS = {"viewer": (Role.VIEWER, False), "operator": (Role.OPERATOR, False), "admin": (Role.ADMIN, False),
           "readonly": (Role.ADMIN, True)}


@pytest.mark.parametrize("caller", list(CALLERS))
def test_generated_requests_conform_to_the_schema_for_every_role(db, caller, redis_on, settings,
                                                                  keep_test_connection):
    settings.RELAYGR_WRITE_THROTTLE_RATE = "100000/min"
    settings.AXES_FAILURE_LIMIT = 1_000_000  # generated bad tokens must not lock the fuzzer out (tested apart)
    role, read_only = CALLERS[caller]
    user = account_services.user_create(username=f"fuzz-{caller}", role=role, actor="fixture")
    key = account_services.token_create(user=user, actor="fixture", read_only=read_only).key
    policy_services.pool_create(name=EXISTING_POOL, actor="fixture")
    headers = {"Authorization": f"Token {key}"}
    schema = schemathesis.openapi.from_wsgi("/api/schema/?format=json", application, headers=headers)
    operations = [result.ok() for result in schema.get_all_operations()]
    statuses: set[int] = set()
    tried = 0

    for operation in operations:

        @given(case=operation.as_strategy())
        @hypothesis_settings(max_examples=EXAMPLES_PER_OPERATION, deadline=None, database=None,
                             suppress_health_check=list(HealthCheck))
        def check(case):
            nonlocal tried
            if case.path_parameters and "pool" in case.path_parameters and hash(repr(case.body)) % 2:
                case.path_parameters["pool"] = EXISTING_POOL
            response = case.call_and_validate(headers=headers, checks=CHECKS)
            statuses.add(response.status_code)
            tried += 1

        check()
    FIGURES.hostile(f"schemathesis: conforms to the schema ({caller})", tried)
    assert 200 in statuses
    assert (403 in statuses) == (caller != "admin")  # each non-admin met a door it may not open
