"""Management commands and deployment settings."""

from __future__ import annotations

import os
import subprocess
import sys
from io import StringIO
from pathlib import Path

import pytest
from django.core.management import call_command
from rest_framework.test import APIClient

from controlplane.accounts.models import ApiToken
from controlplane.policies.models import AuditEntry
from relay_engine.core.wire import DesiredRevision, PoolKeys
from tests.controlplane.fixtures import PROD_ENV

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
