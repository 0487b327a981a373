"""The security tests stand on the control plane's fixtures (``tests.controlplane.fixtures``)."""

from tests.controlplane.fixtures import (  # noqa: F401 - fixtures are found by name
    _fresh_caches,
    admin,
    clients,
    keep_test_connection,
    no_redis,
    operator,
    pool,
    redis_cache,
    redis_client,
    redis_on,
    throttle_clock,
    viewer,
    worker_factory,
)
