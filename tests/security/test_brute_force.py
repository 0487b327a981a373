"""Brute force against the log-ins and tokens, and writes past the throttle: failures count per address
and per user name, writes per user, in the shared Redis cache (the test Redis under this test's own key
prefix), so a limit reached through one process holds in another; past it even the right password gets
429. Racing writes pass the throttle exactly its limit times, and what Redis holds is data, never code."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from django.db import connection, connections
from django.test import Client
from rest_framework.test import APIClient

from controlplane.accounts import services as account_services
from controlplane.accounts.roles import Role
from tests.reliability.figures import FIGURES
from tests.security.payloads import pickle_that_creates

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
from django.db import connection, connections
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


PUBLISH = "/api/v1/pools/ranking-a/revisions/1/publish/"


def operator_token(username: str = "racer") -> str:
    user = account_services.user_create(username=username, role=Role.OPERATOR, actor="fixture")
    return account_services.token_create(user=user, actor="fixture").key


@pytest.mark.django_db(transaction=True)
def test_racing_writes_of_one_user_pass_the_throttle_exactly_limit_times(settings, redis_cache, redis_on,
                                                                         throttle_clock, pool):
    # DRF's throttle read the history, appended and wrote it back: 200 racing writes all passed 120/min.
    limit, racers, each = 12, 8, 5
    settings.RELAYGR_WRITE_THROTTLE_RATE = f"{limit}/min"
    token = operator_token()
    barrier = threading.Barrier(racers)

    def writer() -> list[int]:
        client = APIClient()
        client.credentials(HTTP_AUTHORIZATION=f"Token {token}")
        try:
            barrier.wait(30)
            return [client.post(PUBLISH).status_code for _ in range(each)]
        finally:
            connections.close_all()

    with ThreadPoolExecutor(racers) as threads:
        codes = [code for future in [threads.submit(writer) for _ in range(racers)] for code in future.result(120)]
    FIGURES.concurrent_writes(connection.vendor, "writes racing the throttle", Counter(codes))
    assert Counter(codes) == {200: limit, 429: racers * each - limit}


def test_a_write_refused_as_invalid_counts_against_the_limit(settings, redis_cache, redis_on, throttle_clock,
                                                             operator, pool):
    settings.RELAYGR_WRITE_THROTTLE_RATE = "3/min"
    invalid = [operator.post("/api/v1/pools/ranking-a/revisions/", {"parent_generation": 1, "spec": {"x": 1}},
                             format="json").status_code for _ in range(3)]
    assert invalid == [400, 400, 400]
    assert operator.post(PUBLISH).status_code == 429


def test_retry_after_names_the_first_second_a_write_passes_again(settings, redis_cache, redis_on, throttle_clock,
                                                                 operator, pool):
    settings.RELAYGR_WRITE_THROTTLE_RATE = "3/min"
    assert [operator.post(PUBLISH).status_code for _ in range(3)] == [200, 200, 200]
    refused = operator.post(PUBLISH)
    assert refused.status_code == 429
    retry_after_s = int(refused["Retry-After"])
    assert 0 < retry_after_s <= 120
    throttle_clock.advance(retry_after_s - 1)
    assert operator.post(PUBLISH).status_code == 429
    throttle_clock.advance(1)
    assert operator.post(PUBLISH).status_code == 200


def plant(redis_client, pattern: str, value: bytes) -> None:
    """What an attacker who can write to Redis does: overwrite every entry matching ``pattern``."""
    keys = list(redis_client.scan_iter(pattern))
    assert keys, f"nothing stored under {pattern}"
    for key in keys:
        redis_client.set(key, value, keepttl=True)
    FIGURES.hostile("values planted in the shared cache", len(keys))


def test_a_pickle_planted_in_a_users_write_throttle_is_never_run(settings, redis_cache, redis_on, throttle_clock,
                                                                 operator, pool, redis_client, tmp_path):
    marker = tmp_path / "unpickled"
    assert operator.post(PUBLISH).status_code == 200  # the user's count now exists
    plant(redis_client, f"{redis_cache}:*throttle_write*", pickle_that_creates(marker))
    assert operator.post(PUBLISH).status_code == 200  # counted afresh over the planted value
    plant(redis_client, f"{redis_cache}:*throttle_write*", pickle_that_creates(marker))
    throttle_clock.advance(60)  # the planted count is the previous window's now: read back, not run
    assert operator.post(PUBLISH).status_code == 200
    assert not marker.exists()


def test_a_pickle_planted_in_a_log_in_failure_count_is_never_run(lockouts, sre, redis_client, tmp_path):
    marker = tmp_path / "unpickled"
    assert log_in("/login/", "sre", "wrong").status_code == 200  # the address's and the user's counts exist
    plant(redis_client, f"{lockouts}:*axes-*", pickle_that_creates(marker))
    assert log_in("/login/", "sre", PASSWORD).status_code == 302
    assert not marker.exists()


def test_a_failure_count_overwritten_with_garbage_counts_afresh_and_still_locks_out(lockouts, sre, redis_client):
    guess("/login/", "sre", 1)
    plant(redis_client, f"{lockouts}:*axes-*", b"\x80not json")
    assert guess("/login/", "sre", LIMIT - 1) == [200] * (LIMIT - 1)
    assert log_in("/login/", "sre", "wrong").status_code == 429  # the LIMIT-th failure since the garbage
    assert log_in("/login/", "sre", PASSWORD).status_code == 429


def test_with_the_cache_unreachable_log_ins_and_writes_still_work(settings, sre, operator, pool):
    settings.CACHES = {"default": {"BACKEND": "django.core.cache.backends.redis.RedisCache",
                                   "LOCATION": "redis://127.0.0.1:1/0", "OPTIONS": {"socket_connect_timeout": 0.2}}}
    assert log_in("/login/", "sre", "wrong").status_code == 200
    assert log_in("/login/", "sre", PASSWORD).status_code == 302
    assert operator.post(f"/api/v1/pools/{pool.name}/revisions/1/publish/").status_code in (200, 503)
