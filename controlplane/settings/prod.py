"""Production: every secret and host name comes from the environment; nothing has a default.

Required: DJANGO_SECRET_KEY, DJANGO_ALLOWED_HOSTS (comma-separated), DATABASE_URL, REDIS_URL.
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


def _csv(value: str) -> list[str]:
    return [item.strip() for item in value.split(",") if item.strip()]


DEBUG = False
SECRET_KEY = _required("DJANGO_SECRET_KEY")
ALLOWED_HOSTS = _csv(_required("DJANGO_ALLOWED_HOSTS"))
CSRF_TRUSTED_ORIGINS = _csv(os.environ.get("DJANGO_CSRF_TRUSTED_ORIGINS", ""))
_required("DATABASE_URL")  # base already parsed it; prod refuses the SQLite fallback
REDIS_URL = _required("REDIS_URL")

SECURE_SSL_REDIRECT = True
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

