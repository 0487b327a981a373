"""Brute-force protection of log-ins and tokens, on django-axes with its counters in the shared cache.

- **Passwords** (the site's log-in page, the browsable API's): failures count per client address
  and per user name; either reaching ``AXES_FAILURE_LIMIT`` refuses further attempts with 429 for
  ``AXES_COOLOFF_TIME``, the right password included.
- **Tokens**: a request with an unknown or revoked token counts against its address only (a token
  names no user), so an address guessing tokens is refused too; a user locked out by password
  guesses keeps the tokens its automation holds.

The counters live in Redis through Django's cache (``settings.CACHES``), so every gunicorn process
and machine counts together. While Redis cannot be reached the checks let attempts through and log
it: during an outage the console must stay reachable, and password hashing still slows guessing.
"""

from __future__ import annotations

import logging

import redis
from axes.backends import AxesStandaloneBackend
from axes.handlers.cache import AxesCacheHandler
from axes.handlers.proxy import AxesProxyHandler
from axes.helpers import get_client_cache_keys
from django.conf import settings
from django.contrib.auth.signals import user_login_failed
from django.core.cache import caches
from django.http import HttpRequest, HttpResponse, JsonResponse
from django.shortcuts import render

from controlplane.common.cache import CacheValueError, stored_count

log = logging.getLogger(__name__)

# Marks the credentials of a failed token check (they hold no user name to count).
TOKEN_CREDENTIALS = {"token": "(redacted)"}


def lockout_parameters(request, credentials: dict | None) -> list[str]:
    """What failures are counted by: the address, and the user name where there is one."""
    if credentials and "token" in credentials:
        return ["ip_address"]
    return ["ip_address", "username"]


def client_address(request: HttpRequest) -> str:
    """The peer's address, or the one the trusted proxies in front appended to X-Forwarded-For."""
    proxies = settings.RELAYGR_PROXY_COUNT
    forwarded = [part.strip() for part in request.META.get("HTTP_X_FORWARDED_FOR", "").split(",") if part.strip()]
    if proxies and len(forwarded) >= proxies:
        return forwarded[-proxies]
    return request.META.get("REMOTE_ADDR", "")


def retry_after_s() -> int:
    return int(settings.AXES_COOLOFF_TIME.total_seconds())


def lockout_message() -> str:
    minutes = max(1, round(retry_after_s() / 60))
    return (f"Too many failed log-ins from this address or for this user: try again in {minutes} minute(s). "
            "An admin can lift it sooner (python manage.py axes_reset_ip / axes_reset_username).")


def lockout_response(request: HttpRequest, original_response: HttpResponse | None, credentials: dict | None):
    """429 with the API's error shape for API callers, the log-in page saying why for people."""
    if request.path.startswith("/api/") and not request.path.startswith("/api/auth/"):
        response = JsonResponse({"detail": lockout_message()}, status=429)
    else:
        response = render(request, "frontend/login.html", {"lockout": lockout_message(), "next": ""}, status=429)
    response["Retry-After"] = str(retry_after_s())
    return response


def token_check_allowed(request: HttpRequest) -> bool:
    """False when the request's address is locked out (its token is then not even looked up)."""
    return AxesProxyHandler.is_allowed(request, TOKEN_CREDENTIALS)


def token_failed(request: HttpRequest) -> None:
    """Count a bad token against the request's address."""
    user_login_failed.send(sender=__name__, credentials=TOKEN_CREDENTIALS, request=request)


class LockoutHandler(AxesCacheHandler):
    """Axes' cache handler (atomic add/incr in Redis), letting attempts through while Redis is down."""

    @property
    def cache(self):
        # Looked up at each use, not kept from start-up: Django's cache handles are per thread, and
        # settings.CACHES may change (tests point it at their own Redis prefix).
        return caches[getattr(settings, "AXES_CACHE", "default")]

    @cache.setter
    def cache(self, _value) -> None:  # AxesCacheHandler.__init__ assigns one
        pass

    def get_failures(self, request, credentials: dict | None = None) -> int:
        try:
            return max((self._failures(key) for key in get_client_cache_keys(request, credentials)), default=0)
        except redis.RedisError as exc:
            log.warning("log-in lock-out not checked: the cache (Redis) cannot be reached: %s", exc)
            return 0

    def _failures(self, key: str) -> int:
        try:
            value = self.cache.get(key, default=0)
        except CacheValueError as exc:
            value = exc
        count = stored_count(value)
        if count is None:  # Redis is untrusted: a value planted there is reported and dropped, never run
            log.warning("log-in failures at %s are not a count (%s); counting afresh", key, str(value)[:80])
            self.cache.delete(key)
            return 0
        return count

    def user_login_failed(self, sender, credentials: dict, request=None, **kwargs):
        try:
            return super().user_login_failed(sender, credentials, request, **kwargs)
        except redis.RedisError as exc:
            log.warning("failed log-in not counted: the cache (Redis) cannot be reached: %s", exc)
            return None


class LockoutBackend(AxesStandaloneBackend):
    """Axes' gate before the password check. A call without a request comes from the server itself
    (a management command, a test client's ``login``): there is no address to count, nothing to lock."""

    def authenticate(self, request, username=None, password=None, **kwargs):
        if request is None:
            return None
        return super().authenticate(request, username=username, password=password, **kwargs)
