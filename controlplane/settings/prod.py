"""Production: every secret and host name comes from the environment; nothing has a default.

Required: DJANGO_SECRET_KEY (at least 50 characters, not Django's insecure placeholder),
DJANGO_ALLOWED_HOSTS (comma-separated), DATABASE_URL (PostgreSQL: the control plane's writes need its
row locks across machines; SQLite is for one machine and development), REDIS_URL. Any of them
missing or unfit, the process refuses to start (ImproperlyConfigured) rather than warn.
Optional: DJANGO_CSRF_TRUSTED_ORIGINS (comma-separated https://… origins), DJANGO_BEHIND_TLS_PROXY=1
(trust X-Forwarded-Proto from the reverse proxy that terminates TLS).
"""

import os

from django.core.exceptions import ImproperlyConfigured

from .base import *  # noqa: F403


def _required(name: str) -> str:
    value = os.environ.get(name, "").strip()
    if not value:
        raise ImproperlyConfigured(f"environment variable {name} is required by controlplane.settings.prod")
    return value


def _strong_secret(value: str) -> str:
    # Django's own bar (check --deploy, security.W009), enforced instead of warned about.
    if len(value) < 50 or len(set(value)) < 5 or value.startswith("django-insecure-"):
        raise ImproperlyConfigured(
            "DJANGO_SECRET_KEY is too weak for controlplane.settings.prod: use at least 50 random characters, e.g. "
            "python3 -c 'import secrets; print(secrets.token_urlsafe(50))'")
    return value


def _postgresql(url: str) -> None:
    engine = DATABASES["default"]["ENGINE"]  # noqa: F405 - from base, parsed from the same DATABASE_URL
    if engine != "django.db.backends.postgresql":
        scheme = url.split(":", 1)[0]
        raise ImproperlyConfigured(
            f"DATABASE_URL names a {scheme!r} database; controlplane.settings.prod needs PostgreSQL "
            "(postgres://user:password@host:5432/name). SQLite is for one machine: use the dev settings.")


def _csv(value: str) -> list[str]:
    return [item.strip() for item in value.split(",") if item.strip()]


DEBUG = False
SECRET_KEY = _strong_secret(_required("DJANGO_SECRET_KEY"))
ALLOWED_HOSTS = _csv(_required("DJANGO_ALLOWED_HOSTS"))
CSRF_TRUSTED_ORIGINS = _csv(os.environ.get("DJANGO_CSRF_TRUSTED_ORIGINS", ""))
_postgresql(_required("DATABASE_URL"))  # base already parsed it; prod refuses SQLite and its fallback
REDIS_URL = _required("REDIS_URL")

SECURE_SSL_REDIRECT = True
# The health probe (/healthz) is asked on the container's own port, in plain HTTP: never redirected.
SECURE_REDIRECT_EXEMPT = [r"^healthz$"]
# Set to 1 where a Prometheus scrapes /metrics over a private network without TLS (docker-compose.yml's
# prometheus service scrapes web:8000): that one path is then served over plain HTTP, not redirected.
if os.environ.get("RELAYGR_METRICS_PLAIN_HTTP") == "1":
    SECURE_REDIRECT_EXEMPT.append(r"^metrics$")
SESSION_COOKIE_SECURE = True
CSRF_COOKIE_SECURE = True
SECURE_HSTS_SECONDS = 31_536_000
SECURE_HSTS_INCLUDE_SUBDOMAINS = True
SECURE_HSTS_PRELOAD = True
SECURE_CONTENT_TYPE_NOSNIFF = True
SECURE_REFERRER_POLICY = "same-origin"
X_FRAME_OPTIONS = "DENY"
if os.environ.get("DJANGO_BEHIND_TLS_PROXY") == "1":
    SECURE_PROXY_SSL_HEADER = ("HTTP_X_FORWARDED_PROTO", "https")
    RELAYGR_PROXY_COUNT = 1  # the client's address is the one that proxy appended to X-Forwarded-For

