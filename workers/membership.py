"""Membership and status: the heartbeat that makes an instance routable, and the live set.

An instance is a member of its pool while its score in ``PoolKeys.members`` (the unix time of its
last heartbeat) is live by ``wire.is_live``: the router of every client and the control plane's pool
status apply that one rule. A cleanly stopped instance leaves at once; a crashed one
drops out when its heartbeat goes stale, and only its users move (rendezvous hashing).
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Callable
from typing import Any

import redis

from relay_engine.core import wire
from relay_engine.core.router import AffinityRouter
from relay_engine.core.wire import (
    HEARTBEAT_TIMEOUT_S,
    STATUS_TTL_S,
    InstanceStatus,
    PoolKeys,
)


def live_members(client: redis.Redis, keys: PoolKeys, *, now: float | None = None) -> list[str]:
    """Instances of the pool that are live by the wire's rule, lowest index first (``wire.live_members``:
    a member whose name breaks the contract is never routed to)."""
    return wire.live_members(client, keys, now=time.time() if now is None else now)[0]


class StatusBoard:
    """The instance's ``InstanceStatus``, updated by the reconciler and the heartbeat, written whole."""

    def __init__(self, client: redis.Redis, keys: PoolKeys, status: InstanceStatus,
                 gauges: Callable[[], dict[str, Any]]):
        self.client = client
        self.keys = keys
        self._status = status
        self._gauges = gauges
        self._lock = threading.Lock()  # held across the write, so a stale copy never lands last

    def current(self) -> InstanceStatus:
        with self._lock:
            return dataclasses.replace(self._status)

    def update(self, **fields: Any) -> None:
        with self._lock:
            self._status = dataclasses.replace(self._status, **fields)

    def publish(self, **fields: Any) -> InstanceStatus:
        """Apply ``fields``, write the status and return it (no heartbeat: membership is untouched)."""
        with self._lock:
            self._status = dataclasses.replace(self._status, **fields)
            self.client.set(self.keys.status(self._status.instance), self._status.to_json(), ex=STATUS_TTL_S)
            return dataclasses.replace(self._status)

    def heartbeat(self) -> None:
        """Refresh the gauges and the heartbeat time, write the status, renew membership."""
        now = time.time()
        with self._lock:
            self._status = dataclasses.replace(self._status, heartbeat_ts=now, **self._gauges())
            status = self._status
            pipe = self.client.pipeline(transaction=False)
            pipe.set(self.keys.status(status.instance), status.to_json(), ex=STATUS_TTL_S)
            pipe.zadd(self.keys.members, {status.instance: now})
            # Members silent for as long as a status is kept are gone for good: keep the set bounded.
            pipe.zremrangebyscore(self.keys.members, "-inf", now - STATUS_TTL_S)
            pipe.execute()

    def leave(self) -> None:
        """Leave the live set now (clean shutdown), so clients move this instance's users at once."""
        self.client.zrem(self.keys.members, self._status.instance)


class MembershipWatch:
    """Which users a membership change moved to this instance: what the engine needs to count a miss
    as rerouted (``RelayEngine.set_rerouted_check``). Each ``refresh`` (the heartbeat's) reads the live
    set; when it differs from the last one read, the engine is told "routed elsewhere under the previous
    set", by the rule clients route with (``AffinityRouter.route``, rendezvous, no load fallback). The
    first read (before this instance joins) is the baseline: the set it joins is a change from it."""

    def __init__(self, client: redis.Redis, keys: PoolKeys, instance: str,
                 tell: Callable[[Callable[[str], bool] | None], None]):
        self.client, self.keys, self.instance, self._tell = client, keys, instance, tell
        self._members: tuple[str, ...] | None = None

    def refresh(self) -> None:
        members = tuple(live_members(self.client, self.keys))
        previous, self._members = self._members, members
        if previous is None or previous == members:
            return
        if not previous:  # nobody served the pool before: nobody was moved
            self._tell(None)
            return
        router = AffinityRouter(previous)
        self._tell(lambda user_id: router.route(user_id) != self.instance)


class IndexClaim:
    """An instance index taken from the pool's free ones, for replicas that are not told theirs
    (``docker compose up --scale worker=N``): the lowest index with neither a live member nor a
    claim is claimed with ``SET NX`` and a TTL, renewed while the instance runs."""

    def __init__(self, client: redis.Redis, keys: PoolKeys, owner: str, ttl_s: float = 3 * HEARTBEAT_TIMEOUT_S,
                 max_index: int = 1024):
        self.client, self.keys, self.owner, self.ttl_s, self.max_index = client, keys, owner, ttl_s, max_index
        self.index: int | None = None

    def claim(self) -> int:
        live = set(live_members(self.client, self.keys))
        for index in range(self.max_index):
            if wire.instance_name(self.keys.pool, index) in live:
                continue
            if self.client.set(self.keys.claim(index), self.owner, nx=True, ex=int(self.ttl_s)):
                self.index = index
                return index
        raise RuntimeError(f"pool {self.keys.pool!r} has no free instance index below {self.max_index}")

    def renew(self) -> None:
        if self.index is not None:
            self.client.set(self.keys.claim(self.index), self.owner, ex=int(self.ttl_s))

    def release(self) -> None:
        if self.index is not None and self.client.get(self.keys.claim(self.index)) == self.owner:
            self.client.delete(self.keys.claim(self.index))
