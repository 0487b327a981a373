"""A pool's live members read from the real Redis through the wire (``wire.live_members``): by
index, and a member name that is none of the pool's instances — Redis is untrusted — reported,
never routed to (``workers.membership.live_members``) nor a failed read."""

from __future__ import annotations

import time

import pytest
import redis

from relay_engine.core import wire
from relay_engine.core.router import AffinityRouter
from relay_engine.core.wire import PoolKeys
from workers.membership import MembershipWatch, live_members

PLANTED = ["main", "main.x", "other.3", "main.01", "main.²", "main.1 "]


@pytest.fixture(params=[True, False], ids=["str", "bytes"])
def client(request, redis_url):
    with redis.Redis.from_url(redis_url, decode_responses=request.param) as c:
        yield c


def test_members_come_by_index_and_others_are_reported(client, key_prefix):
    keys = PoolKeys("main", prefix=key_prefix)
    now = time.time()
    client.zadd(keys.members, {**dict.fromkeys(["main.10", "main.2", "main.0", *PLANTED], now), "main.3": now - 60})
    names, malformed = wire.live_members(client, keys, now=now)
    assert names == ["main.0", "main.2", "main.10"]  # main.3 is not live
    assert sorted(malformed) == sorted(PLANTED)


def test_the_workers_route_only_to_well_named_members(client, key_prefix):
    keys = PoolKeys("main", prefix=key_prefix)
    client.zadd(keys.members, dict.fromkeys(["main.1", "main.0", *PLANTED], time.time()))
    assert live_members(client, keys) == ["main.0", "main.1"]



def test_an_instance_joining_is_told_which_users_the_previous_members_served(client, key_prefix):
    """The live set before joining is the baseline; the set it joins is a change, and the users the
    previous set routed to another instance are the ones it says were moved here."""
    keys = PoolKeys("main", prefix=key_prefix)
    client.zadd(keys.members, {"main.0": time.time()})
    told = []
    watch = MembershipWatch(client, keys, "main.1", told.append)
    watch.refresh()
    assert told == []  # the baseline
    client.zadd(keys.members, {"main.1": time.time()})
    watch.refresh()
    watch.refresh()  # no change since: nothing new to tell
    assert len(told) == 1
    users = [f"user-{i}" for i in range(200)]
    now_here = [u for u in users if AffinityRouter(["main.0", "main.1"]).route(u) == "main.1"]
    assert now_here and all(told[0](u) for u in now_here)  # each was main.0's before
