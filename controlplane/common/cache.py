"""The shared cache (Django's Redis cache: throttle and log-in lock-out counters) stores JSON.

Django's Redis backend pickles every value that is not an integer, and so unpickles what it reads
back: whoever can write to Redis would run code in the web server. Redis is untrusted input here as
everywhere, so values are JSON, which decodes to data and nothing else. Integers stay raw, as
Django's own serializer keeps them, so Redis's INCR counts them atomically.

A stored value that is not JSON (a planted pickle, stray bytes) is a ``CacheValueError`` when read:
the reader reports it for that entry and carries on; nothing in it is ever run.
"""

from __future__ import annotations

import json


class CacheValueError(ValueError):
    """A value in the shared cache that is not JSON."""


class JSONSerializer:
    """Django ``RedisCacheClient`` serializer (``OPTIONS: {"serializer": ...}``): JSON, integers raw."""

    def dumps(self, value):
        if type(value) is int:  # not bool: True must come back as True, not 1
            return value
        return json.dumps(value, separators=(",", ":"), allow_nan=False).encode()

    def loads(self, data: bytes):
        try:
            return int(data)
        except ValueError:
            pass
        try:
            return json.loads(data)
        except (ValueError, RecursionError) as exc:  # UnicodeDecodeError is a ValueError
            raise CacheValueError(f"not a JSON value ({len(data)} bytes starting {bytes(data[:16])!r})") from exc


def redis_cache(location: str, key_prefix: str) -> dict:
    """The ``CACHES`` entry of the shared cache on the Redis at ``location``, keys under ``key_prefix``.
    Short socket timeouts: a Redis outage must not hold requests."""
    return {
        "BACKEND": "django.core.cache.backends.redis.RedisCache",
        "LOCATION": location,
        "KEY_PREFIX": key_prefix,
        "OPTIONS": {"serializer": "controlplane.common.cache.JSONSerializer",
                    "socket_timeout": 1.0, "socket_connect_timeout": 1.0},
    }


def stored_count(value) -> int | None:
    """A counter read from the cache, or None when what was stored there is not a count."""
    return value if type(value) is int and value >= 0 else None
