"""The control plane's fixtures (tests/controlplane/fixtures.py), for the test that runs Prometheus
against a live control plane."""

from tests.controlplane.fixtures import (  # noqa: F401 - fixtures are found by name
    _fresh_caches,
    redis_client,
    redis_on,
    worker_factory,
)
