"""Pool status from what the workers write to Redis, judged against the database's desired generation.

An instance is live while its heartbeat (its score in the pool's ``members`` sorted set) is at most
``HEARTBEAT_TIMEOUT_S`` old. The pool has converged when it has at least one live instance and every
live instance reports ACK for exactly the desired generation.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import asdict, dataclass, field

import redis

from controlplane.common.redis import get_redis, redis_unreachable
from controlplane.policies.models import Pool
from relay_engine.wire import HEARTBEAT_TIMEOUT_S, InstanceStatus, PoolKeys


@dataclass(frozen=True)
class InstanceView:
    instance: str
    live: bool
    heartbeat_age_s: float | None
    device: str = ""
    pid: int = 0
    applied_generation: int = 0
    applied_sha256: str = ""
    config_state: str = "UNKNOWN"  # ACK / NACK / PENDING from the worker; UNKNOWN: no status yet
    nacked_generation: int = 0
    error: str = ""
    up_to_date: bool = False
    hbm_bytes: int = 0
    hbm_budget_bytes: int = 0
    dram_bytes: int = 0
    dram_budget_bytes: int = 0
    device_memory_bytes: int = 0
    started_at: float | None = None


@dataclass(frozen=True)
class PoolStatus:
    pool: str
    desired_generation: int
    published_generation: int
    expected_instances: int
    live_instances: int
    converged: bool
    instances: list[InstanceView] = field(default_factory=list)
    checked_at: float = 0.0

    def to_dict(self) -> dict:
        return asdict(self)


def _instance_view(name: str, heartbeat_ts: float, raw: str | None, desired: int, now: float) -> InstanceView:
    age = max(0.0, now - heartbeat_ts)
    live = age <= HEARTBEAT_TIMEOUT_S
    if raw is None:
        return InstanceView(instance=name, live=live, heartbeat_age_s=round(age, 3))
    try:
        status = InstanceStatus.from_json(raw)
        view = InstanceView(
            instance=name, live=live, heartbeat_age_s=round(age, 3), device=str(status.device),
            pid=int(status.pid), applied_generation=int(status.applied_generation),
            applied_sha256=str(status.applied_sha256), config_state=str(status.config_state),
            nacked_generation=int(status.nacked_generation), error=str(status.error),
            hbm_bytes=int(status.hbm_bytes), hbm_budget_bytes=int(status.hbm_budget_bytes),
            dram_bytes=int(status.dram_bytes), dram_budget_bytes=int(status.dram_budget_bytes),
            device_memory_bytes=int(status.device_memory_bytes), started_at=float(status.started_at),
        )
    except (ValueError, TypeError, AttributeError):
        # A worker wrote something off-contract: show the instance, say so, never fail the page.
        return InstanceView(instance=name, live=live, heartbeat_age_s=round(age, 3),
                            error="status in Redis is not valid InstanceStatus JSON")
    up_to_date = view.config_state == "ACK" and view.applied_generation == desired
    return dataclasses.replace(view, up_to_date=up_to_date)


def pool_status(*, pool: Pool, now: float | None = None) -> PoolStatus:
    now = time.time() if now is None else now
    keys = PoolKeys(pool.name)
    client = get_redis()
    try:
        members = client.zrange(keys.members, 0, -1, withscores=True)
        raws = client.mget([keys.status(name) for name, _ in members]) if members else []
    except redis.RedisError as exc:
        raise redis_unreachable(exc) from exc
    instances = [
        _instance_view(name, float(score), raw, pool.desired_generation, now)
        for (name, score), raw in zip(members, raws, strict=True)
    ]
    instances.sort(key=lambda view: view.instance)
    live = [view for view in instances if view.live]
    return PoolStatus(
        pool=pool.name, desired_generation=pool.desired_generation,
        published_generation=pool.published_generation, expected_instances=pool.expected_instances,
        live_instances=len(live), converged=bool(live) and all(view.up_to_date for view in live),
        instances=instances, checked_at=now,
    )
