"""Fixtures for the control plane: users per role with tokens, API clients, a real Redis, pools.

Shared by ``tests/controlplane`` and ``tests/security`` (each conftest imports them from here)."""

from __future__ import annotations

import secrets

import pytest
from django.core.cache import caches
from django.core.cache.backends.locmem import LocMemCache
from django.core.signals import request_finished, request_started
from django.db import close_old_connections
from rest_framework.test import APIClient

from controlplane.accounts import services as account_services
from controlplane.accounts.roles import Role
from controlplane.common.cache import redis_cache as shared_cache
from controlplane.common.throttling import SharedRateThrottle
from controlplane.policies import services as policy_services
from controlplane.telemetry.cache import telemetry_cache
from tests.controlplane.fleet_helpers import FakeWorker

# What production settings require, with throwaway secrets made up per test run (none is kept in
# the repository: tests/security/test_deployment.py scans it for secrets).
PROD_ENV = {
    "DJANGO_SETTINGS_MODULE": "controlplane.settings.prod",
    "DJANGO_SECRET_KEY": secrets.token_urlsafe(50),
    "DJANGO_ALLOWED_HOSTS": "relaygr.example.com",
    "DATABASE_URL": f"postgres://relaygr:{secrets.token_urlsafe(16)}@127.0.0.1:5432/relaygr",
    "REDIS_URL": "redis://127.0.0.1:6379/0",
}


@pytest.fixture(autouse=True)
def _fresh_caches():
    # Throttle counters live in the cache and user ids repeat across rolled-back tests. Only the
    # process's own memory cache is cleared: clearing a Redis cache would flush the whole database.
    _clear_local()
    telemetry_cache.clear()
    yield
    _clear_local()


def _clear_local() -> None:
    if isinstance(caches["default"], LocMemCache):
        caches["default"].clear()


@pytest.fixture
def redis_cache(settings, redis_url, key_prefix):
    """The shared cache as deployed (controlplane.common.cache) on the test Redis, under this test's
    own key prefix: throttle and lock-out counters shared with any other process using that prefix."""
    settings.CACHES = {"default": shared_cache(redis_url, f"{key_prefix}:django")}
    return f"{key_prefix}:django"


class FrozenClock:
    def __init__(self, now_s: float):
        self.now_s = now_s

    def now(self) -> float:
        return self.now_s

    def advance(self, seconds: float) -> None:
        self.now_s += seconds


@pytest.fixture
def throttle_clock(monkeypatch) -> FrozenClock:
    """The throttles' own clock, standing still (at the start of a window of every period) until a
    test moves it: what a test counts never depends on where the wall clock's windows fall."""
    clock = FrozenClock(86_400.0 * 20_000)
    monkeypatch.setattr(SharedRateThrottle, "timer", staticmethod(clock.now))
    return clock


@pytest.fixture
def no_redis(settings):
    settings.REDIS_URL = None


@pytest.fixture
def redis_on(settings, redis_url, key_prefix):
    """Point the control plane at the test Redis, under this test's own key prefix."""
    settings.REDIS_URL = redis_url
    return key_prefix


@pytest.fixture
def redis_client(redis_on):
    from controlplane.common.redis import get_redis

    return get_redis()


def _user_with_token(username: str, role: Role | None, read_only: bool = False):
    from django.contrib.auth import get_user_model

    if role is None:
        user = get_user_model().objects.create_user(username=username)
    else:
        user = account_services.user_create(username=username, role=role, actor="fixture")
    return user, account_services.token_create(user=user, actor="fixture", read_only=read_only).key


def _client(key: str | None) -> APIClient:
    client = APIClient()
    if key:
        client.credentials(HTTP_AUTHORIZATION=f"Token {key}")
    return client


@pytest.fixture
def clients(db):
    """API clients by role: anonymous, norole (authenticated, no role), viewer, operator, admin."""
    out = {"anonymous": _client(None)}
    for name, role in (("norole", None), ("viewer", Role.VIEWER), ("operator", Role.OPERATOR),
                       ("admin", Role.ADMIN)):
        out[name] = _client(_user_with_token(name, role)[1])
    return out


@pytest.fixture
def operator(clients):
    return clients["operator"]


@pytest.fixture
def viewer(clients):
    return clients["viewer"]


@pytest.fixture
def admin(clients):
    return clients["admin"]


@pytest.fixture
def pool(db, settings):
    """A pool at generation 1 (the schema's defaults), created without Redis."""
    previous, settings.REDIS_URL = settings.REDIS_URL, None
    created = policy_services.pool_create(name="ranking-a", description="test pool", expected_instances=2,
                                          actor="fixture")
    settings.REDIS_URL = previous
    return created


@pytest.fixture
def worker_factory(redis_client, key_prefix):
    def make(pool_name: str, index: int = 0, **kwargs) -> FakeWorker:
        return FakeWorker(redis_client, pool_name, index, prefix=key_prefix, **kwargs)

    return make


@pytest.fixture
def keep_test_connection():
    """Calling the WSGI app directly would close the test's database connection at each request
    (Django's own test client suspends this the same way)."""
    signals = (request_started, request_finished)
    for signal in signals:
        signal.disconnect(close_old_connections)
    yield
    for signal in signals:
        signal.connect(close_old_connections)
