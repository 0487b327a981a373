"""Management commands and deployment settings."""

from __future__ import annotations

import os
import subprocess
import sys
from io import StringIO
from pathlib import Path

import pytest
import redis
from django.core.management import call_command
from rest_framework.test import APIClient

from controlplane.accounts.models import ApiToken
from controlplane.audit.models import AuditEntry
from relay_engine.core.lifetime import die_with_parent
from relay_engine.core.wire import DesiredRevision, PoolKeys
from tests.controlplane.fixtures import PROD_ENV
from tests.workers.fleet import wait_for

REPO = Path(__file__).resolve().parents[2]


def test_relaygr_token_creates_a_user_with_a_role_and_prints_a_working_token(db):
    out, err = StringIO(), StringIO()
    call_command("relaygr_token", "--user", "sre-bot", "--role", "operator", stdout=out, stderr=err)
    key = out.getvalue().strip()
    assert key.startswith("rgr_") and "\n" not in key
    assert key not in err.getvalue()
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION=f"Token {key}")
    assert client.get("/api/v1/me/").json() == {"username": "sre-bot", "role": "operator", "read_only_token": False}
    assert AuditEntry.objects.filter(action="token.create", actor="cli:relaygr_token").exists()


def test_relaygr_token_read_only_and_role_change(db):
    call_command("relaygr_token", "--user", "dash", "--role", "viewer", stdout=StringIO(), stderr=StringIO())
    out = StringIO()
    call_command("relaygr_token", "--user", "dash", "--role", "admin", "--read-only", stdout=out, stderr=StringIO())
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION=f"Token {out.getvalue().strip()}")
    assert client.get("/api/v1/me/").json() == {"username": "dash", "role": "admin", "read_only_token": True}
    assert ApiToken.objects.filter(user__username="dash").count() == 2
    assert AuditEntry.objects.filter(action="user.role", object_id="dash").count() == 1


def test_relaygr_sync_writes_desired_revisions(pool, redis_client, key_prefix):
    out = StringIO()
    call_command("relaygr_sync", stdout=out)
    assert "synced 1 pool" in out.getvalue()
    desired = DesiredRevision.from_json(redis_client.get(PoolKeys(pool.name, prefix=key_prefix).desired))
    assert desired.generation == 1


def _manage(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "manage.py", *args], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=120)




def _prod_env(**changes: str) -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if not k.startswith(("DJANGO_", "DATABASE_URL"))} | PROD_ENV | changes


@pytest.mark.parametrize(("database_url", "named"), [("sqlite:///var/prod.sqlite3", "'sqlite'"),
                                                      ("mysql://127.0.0.1/relaygr", "'mysql'")])
def test_prod_settings_refuse_a_database_other_than_postgresql(database_url, named):
    result = _manage("check", env=_prod_env(DATABASE_URL=database_url))
    assert result.returncode != 0
    assert "ImproperlyConfigured" in result.stderr and named in result.stderr and "PostgreSQL" in result.stderr


@pytest.mark.parametrize("weak", ["short-but-secret", "django-insecure-" + "x1y2z3" * 10, "ab" * 40])
def test_prod_settings_refuse_a_weak_secret_key(weak):
    result = _manage("check", env=_prod_env(DJANGO_SECRET_KEY=weak))
    assert result.returncode != 0
    assert "ImproperlyConfigured" in result.stderr and "DJANGO_SECRET_KEY is too weak" in result.stderr
    assert weak not in result.stderr  # the refusal does not print the secret


def _lines(path: Path) -> list[str]:
    return path.read_text().splitlines() if path.exists() else []


def test_relaygr_sync_loop_outlives_an_unavailable_database_and_delivers_once_it_is_back(tmp_path, redis_url,
                                                                                          key_prefix):
    database = tmp_path / "not-yet" / "controlplane.sqlite3"  # its folder is missing: it cannot be opened
    env = {k: v for k, v in os.environ.items() if not k.startswith(("DJANGO_", "DATABASE_URL"))} | {
        "DJANGO_SETTINGS_MODULE": "controlplane.settings.dev", "DATABASE_URL": f"sqlite:///{database}",
        "REDIS_URL": redis_url, "RELAYGR_KEY_PREFIX": key_prefix}
    out, err = tmp_path / "sync.out", tmp_path / "sync.err"
    with out.open("w") as stdout, err.open("w") as stderr:
        sync = subprocess.Popen([sys.executable, "manage.py", "relaygr_sync", "--interval", "0.2"], cwd=REPO,
                                env=env, stdout=stdout, stderr=stderr, preexec_fn=die_with_parent())
    try:
        wait_for(lambda: len([line for line in _lines(err) if "sync failed" in line]) >= 3, 60,
                 what="the loop to report failed passes")
        assert sync.poll() is None, _lines(err)
        assert "the database cannot be read" in _lines(err)[0]

        database.parent.mkdir()
        for command in (["migrate", "--verbosity", "0"], ["relaygr_demo", "--pool", "main"]):
            assert _manage(*command, env=env).returncode == 0
        keys = PoolKeys("main", prefix=key_prefix)
        client = redis.Redis.from_url(redis_url, decode_responses=True)
        client.delete(keys.desired)  # the demo's own push undone: only the loop can restore it
        wait_for(lambda: client.get(keys.desired), 60, what="the loop to write the desired revision")
        assert DesiredRevision.from_json(client.get(keys.desired)).generation == 1
        assert sync.poll() is None and any("synced 1 pool(s)" in line for line in _lines(out))
    finally:
        sync.terminate()
        sync.wait(30)


def test_check_deploy_with_prod_settings_is_clean():
    env = {k: v for k, v in os.environ.items() if not k.startswith(("DJANGO_", "DATABASE_URL"))} | PROD_ENV
    result = _manage("check", "--deploy", "--fail-level", "WARNING", env=env)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "System check identified no issues" in result.stdout
    assert "WARNING" not in result.stdout + result.stderr


@pytest.mark.parametrize("missing", ["DJANGO_SECRET_KEY", "DJANGO_ALLOWED_HOSTS", "DATABASE_URL", "REDIS_URL"])
def test_prod_settings_refuse_to_start_without_required_environment(missing):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("DJANGO_", "DATABASE_URL"))} | PROD_ENV
    env.pop(missing)
    result = _manage("check", env=env)
    assert result.returncode != 0
    assert missing in result.stderr
