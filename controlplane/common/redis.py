"""The control plane's Redis connection; key names come from relay_engine.core.wire."""

from __future__ import annotations

import threading

import redis
from django.conf import settings

from .errors import Unavailable

_clients: dict[str, redis.Redis] = {}
_bytes_clients: dict[int, tuple[redis.ConnectionPool, redis.Redis]] = {}
_lock = threading.Lock()


def get_redis() -> redis.Redis:
    """A client for settings.REDIS_URL (one pool per URL), or Unavailable naming the setting."""
    url = settings.REDIS_URL
    if not url:
        raise Unavailable("Redis is not configured: set REDIS_URL (e.g. redis://127.0.0.1:6379/0).")
    with _lock:
        client = _clients.get(url)
        if client is None:
            # Redis is untrusted: bytes that are not UTF-8 read as U+FFFD, so the decoder of the
            # record refuses it for that item, instead of the reply parser failing the whole request.
            client = redis.Redis.from_url(
                url, decode_responses=True, encoding_errors="replace", socket_timeout=5.0,
                socket_connect_timeout=2.0, health_check_interval=30,
            )
            _clients[url] = client
    return client


def bytes_client(client: redis.Redis) -> redis.Redis:
    """A client of ``client``'s server whose answers stay bytes: what binary values need (a forwards
    stream's deflated records), which a decoding client would mangle. One per connection pool, kept."""
    pool = client.connection_pool
    if not pool.connection_kwargs.get("decode_responses"):
        return client
    with _lock:
        kept = _bytes_clients.get(id(pool))
        if kept is None or kept[0] is not pool:
            raw = redis.Redis(connection_pool=redis.ConnectionPool(
                connection_class=pool.connection_class, **{**pool.connection_kwargs, "decode_responses": False}))
            kept = _bytes_clients[id(pool)] = (pool, raw)
    return kept[1]


def redis_unreachable(exc: Exception) -> Unavailable:
    return Unavailable(f"Redis at REDIS_URL cannot be reached ({type(exc).__name__}).")
