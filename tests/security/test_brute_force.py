"""Brute force against the log-ins and tokens: failures count per address and per user name, in the
shared Redis cache (Django's Redis backend, the test Redis under this test's own key prefix), so a
limit reached through one process holds in another; past it even the right password gets 429."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from django.test import Client
from rest_framework.test import APIClient

from controlplane.accounts import services as account_services
from controlplane.accounts.roles import Role
from tests.reliability.figures import FIGURES

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]
PASSWORD = "correct horse battery staple"
LIMIT = 5


@pytest.fixture
def lockouts(settings, redis_cache):
    settings.AXES_FAILURE_LIMIT = LIMIT
    return redis_cache


@pytest.fixture
def sre(db):
    return account_services.user_create(username="sre", role=Role.OPERATOR, password=PASSWORD, actor="fixture")


def log_in(path: str, username: str, password: str, address: str = "10.0.0.1"):
    return Client(REMOTE_ADDR=address).post(path, {"username": username, "password": password})


def guess(path: str, username: str, times: int, address: str = "10.0.0.1") -> list[int]:
    FIGURES.hostile("password guesses", times)
    return [log_in(path, username, f"guess-{i}", address).status_code for i in range(times)]


@pytest.mark.parametrize("path", ["/login/", "/api/auth/login/"])
def test_after_the_limit_even_the_right_password_is_refused_from_that_address(lockouts, sre, path):
    # Guesses at many user names from one address: the address reaches the limit, no user does.
    assert [guess(path, f"user-{i}", 1)[0] for i in range(LIMIT - 1)] == [200] * (LIMIT - 1)  # the form again
    assert log_in(path, "user-last", "wrong").status_code == 429  # the address's LIMIT-th failure
    refused = log_in(path, "sre", PASSWORD)
    assert refused.status_code == 429 and int(refused["Retry-After"]) > 0
    assert "Too many failed log-ins" in refused.content.decode()
    assert "_auth_user_id" not in refused.client.session
    assert log_in(path, "sre", PASSWORD, address="10.0.0.2").status_code == 302  # another address is not punished


def test_guesses_for_one_user_from_many_addresses_lock_that_user_only(lockouts, sre, db):
    account_services.user_create(username="pm", role=Role.VIEWER, password=PASSWORD, actor="fixture")
    for i in range(LIMIT):
        guess("/login/", "sre", 1, address=f"10.1.0.{i}")
    assert log_in("/login/", "sre", PASSWORD, address="10.9.9.9").status_code == 429
    assert log_in("/login/", "pm", PASSWORD, address="10.9.9.9").status_code == 302


def test_bad_tokens_lock_out_their_address_but_not_the_users_tokens_elsewhere(lockouts, sre):
    key = account_services.token_create(user=sre, actor="fixture").key
    attacker = APIClient(REMOTE_ADDR="10.6.6.6")
    for i in range(LIMIT):
        attacker.credentials(HTTP_AUTHORIZATION=f"Token rgr_guess{i}")
        assert attacker.get("/api/v1/me/").status_code in (401, 429)
    FIGURES.hostile("token guesses", LIMIT)
    attacker.credentials(HTTP_AUTHORIZATION=f"Token {key}")
    refused = attacker.get("/api/v1/me/")
    assert refused.status_code == 429 and "Too many failed" in refused.json()["detail"]
    elsewhere = APIClient(REMOTE_ADDR="10.7.7.7")
    elsewhere.credentials(HTTP_AUTHORIZATION=f"Token {key}")
    assert elsewhere.get("/api/v1/me/").status_code == 200
    # Password guesses against the user do not cut off its automation either.
    for i in range(LIMIT):
        guess("/login/", "sre", 1, address=f"10.2.0.{i}")
    assert elsewhere.get("/api/v1/me/").status_code == 200


_OTHER_PROCESS = """
import json, django
django.setup()
from django.test import Client
response = Client(REMOTE_ADDR="10.3.3.3").post("/login/", {"username": "sre", "password": %r})
print(json.dumps({"status": response.status_code}))
"""


def test_the_lockout_holds_in_another_process_sharing_the_redis(lockouts, sre, redis_url):
    guess("/login/", "sre", LIMIT, address="10.3.3.3")
    env = {**os.environ, "DJANGO_SETTINGS_MODULE": "controlplane.settings.dev", "REDIS_URL": redis_url,
           "RELAYGR_LOGIN_FAILURE_LIMIT": str(LIMIT),
           # No database at all: a locked-out attempt is refused before any user is looked up.
           "DATABASE_URL": "sqlite:////nonexistent/relaygr.sqlite3"}
    done = subprocess.run([sys.executable, "-c", _OTHER_PROCESS % PASSWORD], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert json.loads(done.stdout.strip().splitlines()[-1]) == {"status": 429}


def test_write_throttle_counts_in_redis_for_every_process(settings, redis_cache, operator, pool, redis_client):
    settings.RELAYGR_WRITE_THROTTLE_RATE = "3/min"
    codes = [operator.post(f"/api/v1/pools/{pool.name}/revisions/{1}/publish/").status_code for _ in range(5)]
    assert 429 not in codes[:3] and codes[3:] == [429, 429]
    assert list(redis_client.scan_iter(f"{redis_cache}:*throttle_write*"))  # the count lives in Redis


def test_with_the_cache_unreachable_log_ins_and_writes_still_work(settings, sre, operator, pool):
    settings.CACHES = {"default": {"BACKEND": "django.core.cache.backends.redis.RedisCache",
                                   "LOCATION": "redis://127.0.0.1:1/0", "OPTIONS": {"socket_connect_timeout": 0.2}}}
    assert log_in("/login/", "sre", "wrong").status_code == 200
    assert log_in("/login/", "sre", PASSWORD).status_code == 302
    assert operator.post(f"/api/v1/pools/{pool.name}/revisions/1/publish/").status_code in (200, 503)
