"""What a deployment relies on: production answers only over TLS with secure cookies and HSTS, no
secret is kept in the repository, and API tokens are never written anywhere but shown once.
(``manage.py check --deploy`` under the production settings: ``tests/controlplane/test_commands.py``.)"""

from __future__ import annotations

import json
import logging
import math
import re
import subprocess
import sys
from collections import Counter
from pathlib import Path

from controlplane.audit.models import AuditEntry
from tests.controlplane.fixtures import PROD_ENV

REPO = Path(__file__).resolve().parents[2]

# Under controlplane.settings.prod: a plain-HTTP request and a TLS one (as the proxy forwards it).
_PROD_PROBE = """
import json
import django
django.setup()
from django.conf import settings
from django.test import Client
client = Client(HTTP_HOST="relaygr.example.com")
plain = client.get("/login/")
probe = client.get("/healthz")
tls = client.get("/login/", secure=True)
csrf = tls.cookies.get("csrftoken")
print(json.dumps({
    "plain": [plain.status_code, plain.get("Location", "")],
    "probe": [probe.status_code, probe.get("Location", "")],
    "tls": tls.status_code,
    "hsts": tls.get("Strict-Transport-Security", ""),
    "nosniff": tls.get("X-Content-Type-Options", ""),
    "frame": tls.get("X-Frame-Options", ""),
    "referrer": tls.get("Referrer-Policy", ""),
    "csrf_cookie": {"secure": bool(csrf and csrf["secure"]), "samesite": csrf and csrf["samesite"]},
    "session_cookie": {"secure": settings.SESSION_COOKIE_SECURE, "httponly": settings.SESSION_COOKIE_HTTPONLY,
                       "samesite": settings.SESSION_COOKIE_SAMESITE},
    "debug": settings.DEBUG,
}))
"""


def test_production_serves_only_tls_with_secure_cookies_and_hsts(tmp_path):
    env = {"PATH": "/usr/bin:/bin", **PROD_ENV}  # PostgreSQL is named, never reached: the pages probed need no query
    done = subprocess.run([sys.executable, "-c", _PROD_PROBE], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    seen = json.loads(done.stdout.strip().splitlines()[-1])
    assert seen["plain"] == [301, "https://relaygr.example.com/login/"]
    # the health probe answers on plain HTTP, never redirected (whether the database it names answers or not)
    assert seen["probe"][0] in (200, 503) and seen["probe"][1] == ""
    assert seen["tls"] == 200
    assert seen["hsts"] == "max-age=31536000; includeSubDomains; preload"
    assert seen["nosniff"] == "nosniff" and seen["frame"] == "DENY" and seen["referrer"] == "same-origin"
    assert seen["csrf_cookie"] == {"secure": True, "samesite": "Lax"}
    assert seen["session_cookie"] == {"secure": True, "httponly": True, "samesite": "Lax"}
    assert seen["debug"] is False


# --- no secret in the repository --------------------------------------------------------------

SECRET_PATTERNS = {
    "private key": re.compile(r"-----BEGIN [A-Z ]*PRIVATE KEY-----"),
    "AWS access key": re.compile(r"\b(?:AKIA|ASIA)[0-9A-Z]{16}\b"),
    "GitHub token": re.compile(r"\bgh[pousr]_[A-Za-z0-9]{36,}\b"),
    "Slack token": re.compile(r"\bxox[abposr]-[A-Za-z0-9-]{10,}"),
    "Google API key": re.compile(r"\bAIza[0-9A-Za-z_-]{35}\b"),
    "Stripe key": re.compile(r"\b[sr]k_live_[0-9A-Za-z]{16,}"),
    "JSON web token": re.compile(r"\beyJ[A-Za-z0-9_-]{10,}\.eyJ[A-Za-z0-9_-]{10,}\.[A-Za-z0-9_-]{10,}"),
    "RelayGR API token": re.compile(r"\brgr_[A-Za-z0-9_-]{40,}"),
    "password in a URL": re.compile(r"\b[a-z][a-z0-9+]*://[^/\s:@'\"]+:([^@\s/'\"]+)@"),
    "Django SECRET_KEY": re.compile(r"SECRET_KEY[\"']?\s*[:=]\s*[\"'](?!\$\{)([^\"']{8,})[\"']"),
}
# Values assigned to names that say they are secret, long and random enough to be real.
SECRET_ASSIGNMENT = re.compile(
    r"(?i)\b[\w-]*(?:secret|passw(?:or)?d|api_?key|access_?key|private_?key|auth_?token)[\w-]*[\"']?\s*[:=]\s*"
    r"[\"']([^\"'\s$]{16,})[\"']")

# Passwords in example URLs that are not passwords: a variable (``${…}``, ``{…}``, ``<…>``), a mask.
PLACEHOLDER = re.compile(r"^(?:\$?\{.*\}|<.*>|\*+|pw|pass|password|secret|changeme|example|x+)$", re.IGNORECASE)

# The only secrets the repository may hold: the throwaway keys of the dev and test settings, named
# as such. Production takes its key from the environment only (controlplane/settings/prod.py).
ALLOWED = {
    ("controlplane/settings/dev.py", "dev-only-not-secret-relaygr-control-plane-0123456789abcdefghijklmnop"),
    ("controlplane/settings/test.py", "test-only-not-secret-relaygr-control-plane-0123456789abcdefghijklmnop"),
}


def shannon_bits_per_char(text: str) -> float:
    counts = Counter(text)
    return -sum(n / len(text) * math.log2(n / len(text)) for n in counts.values())


def repository_files() -> list[str]:
    """Tracked files and the new ones that would be committed (not ignored)."""
    listed = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard", "-z"], cwd=REPO,
                            capture_output=True, check=True).stdout.decode()
    return sorted({name for name in listed.split("\0") if name and (REPO / name).is_file()})


def find_secrets(path: str, text: str) -> list[str]:
    found = []
    for kind, pattern in SECRET_PATTERNS.items():
        for match in pattern.finditer(text):
            value = match.group(1) if pattern.groups else match.group(0)
            if (path, value) not in ALLOWED and not PLACEHOLDER.match(value):
                found.append(f"{path}: {kind}: {match.group(0)[:60]}")
    for match in SECRET_ASSIGNMENT.finditer(text):
        value = match.group(1)
        if (path, value) not in ALLOWED and shannon_bits_per_char(value) >= 3.5:
            found.append(f"{path}: secret-looking assignment: {match.group(0)[:60]}")
    return found


def test_the_scanner_finds_what_it_looks_for():
    # Assembled here, so this file does not hold what it plants.
    planted = {
        "key.pem": "-----BEGIN RSA " + "PRIVATE KEY-----\nMIIE...",
        "aws.txt": "aws_access_key_id = " + "AKIA" + "IOSFODNN7EXAMPLE",
        "settings.py": "SECRET_KEY" + ' = "q8#Lr2@pVt7$Wm4^Zs8&Nd1*Hc6(Fb0)Gj5"',
        "ci.yml": "DATABASE_URL: postgres://app:" + "hunter2hunter2@db:5432/app",
        "client.py": "client_secret" + ' = "3f9a7c1e5b8d2f4a6c0e9b7d5f3a1c8e"',
        "notes.md": "token rgr_" + "Zk3" * 15,
    }
    assert {path for path, text in planted.items() if find_secrets(path, text)} == set(planted)
    harmless = 'PASSWORD = "correct horse battery staple"\nREDIS_URL: redis://redis:6379/0\n' \
               "DATABASE_URL: postgres://relaygr:${POSTGRES_PASSWORD:?set it}@postgres:5432/relaygr\n" \
               "# e.g. postgres://user:pw@host:5432/db\n"
    assert find_secrets("compose.yml", harmless) == []


def test_no_secret_is_kept_in_the_repository():
    found: list[str] = []
    scanned = 0
    for path in repository_files():
        raw = (REPO / path).read_bytes()
        if len(raw) > 2_000_000 or b"\0" in raw[:8192]:
            continue  # binary or generated data
        scanned += 1
        found += find_secrets(path, raw.decode("utf-8", errors="replace"))
    assert scanned > 50
    assert found == []


# --- tokens are shown once, stored as digests, never logged ------------------------------------


def test_an_issued_token_is_in_its_response_only(admin, caplog):
    caplog.set_level(logging.DEBUG)
    issued = admin.post("/api/v1/tokens/", {"username": "viewer", "name": "ci"}, format="json")
    assert issued.status_code == 201
    key = issued.json()["key"]
    listed = admin.get("/api/v1/tokens/").content.decode()
    audit = json.dumps(list(AuditEntry.objects.values("before", "after", "object_id")))
    assert key not in listed and key not in audit and key[10:] not in audit  # the audit keeps a 10-char prefix
    assert key not in caplog.text
    revoked = admin.delete(f"/api/v1/tokens/{issued.json()['id']}/")
    assert revoked.status_code == 200 and revoked.json()["active"] is False
