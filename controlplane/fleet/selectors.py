"""Pool status from what the workers write to Redis, judged against the database's desired generation.

An instance is live by the wire's rule (``is_live``: its heartbeat, the score in the pool's ``members``
sorted set, is recent enough and not from the far future); a score that is no time at all is that
instance's problem, reported with it. Each instance is judged against its own desired generation: the pool's,
or, for a canary instance while a canary bakes, the canary's (``rollouts.selectors.instance_desired``).
The pool has converged when it has at least one live instance and every live instance reports ACK for
exactly its desired generation.
"""

from __future__ import annotations

import math
import time
from collections import Counter
from dataclasses import asdict, dataclass, field

import redis

from controlplane.common.errors import NotFound
from controlplane.common.redis import get_redis, redis_unreachable
from controlplane.policies.models import Pool
from controlplane.rollouts.selectors import instance_desired
from relay_engine.core.config import ModelFingerprint
from relay_engine.core.outcomes import TIERS
from relay_engine.core.wire import (
    ACK,
    HEARTBEAT_MAX_AHEAD_S,
    NACK,
    UNKNOWN,
    InstanceStatus,
    PoolKeys,
    WireError,
    is_live,
    live_until,
)


@dataclass(frozen=True)
class InstanceView:
    """An instance as the control plane judges it: the worker's own status record (``wire``), plus
    liveness by the shared rule and whether it runs the desired generation. ``problem`` says why the
    record could not be read, when it could not (the rest of the pool still shows)."""

    status: InstanceStatus
    live: bool
    heartbeat_age_s: float | None
    up_to_date: bool = False
    problem: str = ""
    desired_generation: int = 0
    canary: bool = False

    @property
    def instance(self) -> str:
        return self.status.instance

    def to_dict(self) -> dict:
        out = asdict(self.status)
        for internal in ("pool", "heartbeat_ts"):
            out.pop(internal)
        if self.status.config_state == UNKNOWN:
            out["started_at"] = None
        if self.problem:  # what the control plane could not read, then the worker's own error
            out["error"] = "; ".join(filter(None, (self.problem, self.status.error)))
        out.update(live=self.live, heartbeat_age_s=self.heartbeat_age_s, up_to_date=self.up_to_date,
                   desired_generation=self.desired_generation, canary=self.canary)
        return out


@dataclass(frozen=True)
class StateCounts:
    """How many instances are in which state: ``acked`` (live, on the desired generation), ``nacked``
    (live, refused it), ``waiting`` (live, neither yet), ``gone`` (heartbeat stale)."""

    acked: int = 0
    nacked: int = 0
    waiting: int = 0
    gone: int = 0


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
    counts: StateCounts = field(default_factory=StateCounts)
    total_instances: int = 0  # all of them, however many ``instances`` holds (a page)
    tiers: list[str] = field(default_factory=list)  # every cache tier an instance of the pool runs, in lookup order

    def to_dict(self) -> dict:
        out = asdict(self)
        out["instances"] = [view.to_dict() for view in self.instances]
        return out


def _heartbeat(score: float | None, now: float) -> tuple[bool, float | None, str]:
    """(live, heartbeat age, problem) of an instance's score in the pool's ``members`` (None: it has
    none). Redis is untrusted: a score that is no unix time (±inf, NaN, negative, further ahead than
    clocks differ) makes the instance not live, with no age and the reason, never a failed page."""
    if score is None:
        return False, None, ""
    if not (math.isfinite(score) and 0 <= score <= live_until(now)):
        return False, None, (f"unreadable heartbeat in Redis: its members score {score!r} is no unix time "
                             f"(at most {HEARTBEAT_MAX_AHEAD_S:g} s ahead of now)")
    return is_live(score, now), round(max(0.0, now - score), 3), ""


def _instance_view(pool: str, name: str, score: float | None, raw: str | None, desired: int,
                   now: float, canary: bool = False) -> InstanceView:
    live, age, heartbeat_problem = _heartbeat(score, now)
    mine = {"desired_generation": desired, "canary": canary}
    if raw is None:
        return InstanceView(InstanceStatus.unknown(name, pool), live, age, problem=heartbeat_problem, **mine)
    try:
        status = InstanceStatus.from_json(raw)
        if (status.instance, status.pool) != (name, pool):  # filed under one name, claiming another
            raise WireError(f"status names instance {status.instance[:80]!r} of pool {status.pool[:80]!r}")
    except WireError as exc:
        # A worker wrote something off-contract: show the instance, say what, never fail the page.
        problem = "; ".join(filter(None, (f"unreadable status in Redis: {exc}", heartbeat_problem)))
        return InstanceView(InstanceStatus.unknown(name, pool), live, age, problem=problem, **mine)
    up_to_date = status.config_state == ACK and status.applied_generation == desired
    return InstanceView(status, live, age, up_to_date, problem=heartbeat_problem, **mine)


def _state(view: InstanceView) -> str:
    if not view.live:
        return "gone"
    if view.up_to_date:
        return "acked"
    if view.status.config_state == NACK and view.status.nacked_generation == view.desired_generation:
        return "nacked"
    return "waiting"


# ``order="problems"``: what keeps a pool from converging first, then the gone, then the rest.
_PROBLEMS_FIRST = {"nacked": 0, "waiting": 1, "gone": 2, "acked": 3}


def pool_status(*, pool: Pool, now: float | None = None, order: str = "name", offset: int = 0,
                limit: int | None = None) -> PoolStatus:
    """Every instance judged; ``instances`` holds those of the page (``offset``, ``limit``) in
    ``order`` ("name", or "problems": NACKed, then waiting, gone, ACKed). ``counts`` and
    ``converged`` are always over the whole pool."""
    now = time.time() if now is None else now
    keys = PoolKeys(pool.name)
    client = get_redis()
    try:
        members = client.zrange(keys.members, 0, -1, withscores=True)
        raws = client.mget([keys.status(name) for name, _ in members]) if members else []
    except redis.RedisError as exc:
        raise redis_unreachable(exc) from exc
    canaries = instance_desired(pool=pool)
    instances = [
        _instance_view(pool.name, name, score, raw, canaries.get(name, pool.desired_generation), now,
                       canary=name in canaries)
        for (name, score), raw in zip(members, raws, strict=True)
    ]
    states = {view.instance: _state(view) for view in instances}
    if order == "problems":
        instances.sort(key=lambda view: (_PROBLEMS_FIRST[states[view.instance]], view.instance))
    else:
        instances.sort(key=lambda view: view.instance)
    live = [view for view in instances if view.live]
    tally = Counter(states.values())
    return PoolStatus(
        pool=pool.name, desired_generation=pool.desired_generation,
        published_generation=pool.published_generation, expected_instances=pool.expected_instances,
        live_instances=len(live), converged=bool(live) and all(view.up_to_date for view in live),
        instances=instances[offset:None if limit is None else offset + limit], checked_at=now,
        counts=StateCounts(**tally), total_instances=len(instances),
        tiers=_tiers_run(instances),
    )


def _tiers_run(instances: list[InstanceView]) -> list[str]:
    """Every tier an instance runs, in lookup order: the core's tiers in its order, then any it does not
    know (a newer worker's) in the order the instances list them."""
    run = dict.fromkeys(name for view in instances for name in view.status.tiers)
    return sorted(run, key=lambda name: TIERS.index(name) if name in TIERS else len(TIERS))


def instance_status(*, pool: Pool, instance: str, now: float | None = None) -> InstanceView:
    """One instance as ``pool_status`` judges it (a drill-down reads one, not the pool's all);
    NotFound when Redis holds neither its membership nor a status record."""
    now = time.time() if now is None else now
    keys = PoolKeys(pool.name)
    client = get_redis()
    try:
        pipe = client.pipeline(transaction=False)
        pipe.zscore(keys.members, instance)
        pipe.get(keys.status(instance))
        score, raw = pipe.execute()
    except redis.RedisError as exc:
        raise redis_unreachable(exc) from exc
    if score is None and raw is None:
        raise NotFound(f"instance {instance!r} has no status in pool {pool.name!r}: it never joined, or left "
                       f"more than an hour ago.")
    canaries = instance_desired(pool=pool)
    return _instance_view(pool.name, instance, score, raw,
                          canaries.get(instance, pool.desired_generation), now, canary=instance in canaries)


def pool_models(*, pool: Pool, now: float | None = None) -> dict[ModelFingerprint, list[str]]:
    """The models the pool's live instances say they serve, each with those instances (by name); an
    instance that says none (an older worker, a stand-in) is left out. Unavailable without Redis."""
    models: dict[ModelFingerprint, list[str]] = {}
    for view in pool_status(pool=pool, now=now).instances:
        fingerprint = view.status.model_fingerprint()
        if view.live and fingerprint is not None:
            models.setdefault(fingerprint, []).append(view.instance)
    return models
