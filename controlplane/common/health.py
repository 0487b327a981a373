"""``/healthz``: whether this web process can serve — its database answers and its Redis answers.

What a container's health check, a load balancer or an orchestrator's probe reads: 200 ``{"status": "ok"}``,
or 503 naming each dependency that is down (``down``) and why, by exception type only (nothing of the settings).
No authentication (it says nothing a caller could use), and no redirect to HTTPS in production
(``SECURE_REDIRECT_EXEMPT``): a probe on the container's own port speaks plain HTTP.
"""

from __future__ import annotations

import redis
from django.db import connection
from django.db.utils import DatabaseError
from django.http import HttpRequest, JsonResponse
from django.views.decorators.http import require_GET

from .errors import Unavailable
from .redis import get_redis


def _database() -> str | None:
    try:
        with connection.cursor() as cursor:
            cursor.execute("SELECT 1")
    except DatabaseError as exc:
        return f"the database did not answer ({type(exc).__name__})"
    return None


def _redis() -> str | None:
    try:
        get_redis().ping()
    except Unavailable as exc:
        return str(exc)
    except (redis.RedisError, OSError) as exc:
        return f"Redis at REDIS_URL did not answer ({type(exc).__name__})"
    return None


@require_GET
def healthz(request: HttpRequest) -> JsonResponse:
    down = {name: why for name, why in (("database", _database()), ("redis", _redis())) if why}
    if down:
        return JsonResponse({"status": "unavailable", "down": down}, status=503)
    return JsonResponse({"status": "ok"})
