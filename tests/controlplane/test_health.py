"""``/healthz``: 200 when the database and Redis answer; 503 naming the one that does not; no login."""

from __future__ import annotations

import pytest
from django.test import Client

from workers.embedded_redis import free_port

pytestmark = pytest.mark.django_db


def test_the_probe_is_ok_when_the_database_and_redis_answer(redis_on):
    response = Client().get("/healthz")
    assert response.status_code == 200 and response.json() == {"status": "ok"}


def test_the_probe_names_redis_when_it_does_not_answer(settings):
    settings.REDIS_URL = f"redis://127.0.0.1:{free_port()}/0"  # nothing listens there
    response = Client().get("/healthz")
    assert response.status_code == 503
    assert response.json()["status"] == "unavailable"
    assert set(response.json()["down"]) == {"redis"} and "REDIS_URL" in response.json()["down"]["redis"]


def test_the_probe_names_redis_when_none_is_configured(no_redis):
    response = Client().get("/healthz")
    assert response.status_code == 503 and "set REDIS_URL" in response.json()["down"]["redis"]


def test_the_probe_only_reads(redis_on):
    assert Client().post("/healthz").status_code == 405
