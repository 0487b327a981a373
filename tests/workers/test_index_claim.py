"""Scaled replicas (``--index auto``) take distinct free indexes from a real Redis."""

from __future__ import annotations

import time

import redis

from relay_engine.core.wire import PoolKeys
from workers.membership import IndexClaim


def test_replicas_claim_distinct_lowest_free_indexes(redis_url, key_prefix):
    client = redis.Redis.from_url(redis_url, decode_responses=True)
    keys = PoolKeys("scaled", prefix=key_prefix)
    client.zadd(keys.members, {"scaled.0": time.time()})  # index 0 is live already
    first, second = IndexClaim(client, keys, "a"), IndexClaim(client, keys, "b")
    assert (first.claim(), second.claim()) == (1, 2)
    first.release()
    assert IndexClaim(client, keys, "c").claim() == 1
    second.release()  # only its own claim
    assert client.get(f"{keys.base}:claim:1") == "c"
