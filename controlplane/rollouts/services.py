"""Canary rollouts: start, judge, promote, roll back; every step audited with the figures that decided it.

The order is the publish's (``policies.services``): the database first, in one transaction with its
audit entry, then Redis. While a canary bakes, Redis holds one override per canary instance
(``PoolKeys.instance_desired``) and the pool's own record stays the stable generation. Promoting
publishes the generation to the pool the normal way, then removes the overrides. Rolling back adds
the generation to the pool's ``revoked_generations`` and rewrites the pool's record (which then lists
it, so the canaries may step down), then removes the overrides. A decision whose Redis half failed
stays ``published = False`` and the periodic task (``rollouts_tick``) writes it; ``relaygr_sync``
rewrites the overrides of every pool from the database too (``rollout_sync``).
"""

from __future__ import annotations

import logging
import math
import time
from datetime import timedelta

import redis
from django.conf import settings
from django.db import IntegrityError, transaction
from django.utils import timezone

from controlplane.audit.models import AuditEntry
from controlplane.audit.services import audit_record
from controlplane.common.errors import Conflict, ServiceError
from controlplane.common.redis import get_redis, redis_unreachable
from controlplane.fleet import selectors as fleet_selectors
from controlplane.policies import selectors as policy_selectors
from controlplane.policies.models import Pool
from controlplane.policies.services import desired_push, desired_set
from relay_engine.core.config import slo_of
from relay_engine.core.wire import ACK, NACK, DesiredRevision, PoolKeys, live_members

from . import bake, selectors
from .evaluation import DEFAULT_MIN_REQUESTS, GroupFigures, decide
from .models import Rollout

logger = logging.getLogger(__name__)

EVALUATOR = "rollout-evaluator"  # ``decided_by`` of the periodic task's decisions
MAX_SERIES_POINTS = 600  # chart points kept per rollout (older ones thinned out by half)


def live_instances(*, pool: Pool, now: float | None = None) -> list[str]:
    """The pool's live instances, lowest index first (the order canaries are chosen in); a member whose
    name is not ``<pool>.<index>`` is left out and logged, never made a canary."""
    try:
        names, malformed = live_members(get_redis(), PoolKeys(pool.name), now=now or time.time())
    except redis.RedisError as exc:
        raise redis_unreachable(exc) from exc
    if malformed:
        logger.warning("pool %s: members with malformed names left out: %s", pool.name, ", ".join(malformed))
    return names


def canary_count(canary_instances: int | float, live: int) -> int:
    """A count as given, a fraction of the live instances rounded up (at least one)."""
    if isinstance(canary_instances, float) and canary_instances < 1:
        return max(1, math.ceil(canary_instances * live))
    return int(canary_instances)


def rollout_state(rollout: Rollout) -> dict:
    return {
        "generation": rollout.generation, "stable_generation": rollout.stable_generation,
        "canary": rollout.canary_instances, "bake_s": rollout.bake_s, "max_burn": rollout.max_burn,
        "state": rollout.state, "bake_ends_at": rollout.bake_ends_at.isoformat(),
    }


def rollout_start(*, pool: Pool, generation: int, canary_instances: int | float, bake_s: int, max_burn: float,
                  actor: str) -> Rollout:
    """Send ``generation`` to the first live instances (by index) of the pool, the rest keep the stable one."""
    live = live_instances(pool=pool)
    try:
        with transaction.atomic():
            locked = Pool.objects.select_for_update().get(pk=pool.pk)
            baking = selectors.rollout_baking(pool=locked)
            if baking is not None:
                raise baking.busy()
            canary_revision = policy_selectors.revision_get(pool=locked, generation=generation)
            if generation <= locked.desired_generation:
                raise Conflict(
                    f"generation {generation} is not newer than the desired generation {locked.desired_generation}: "
                    "a canary sends a newer generation to a few instances first.",
                    errors={"generation": [f"must be above the desired generation, {locked.desired_generation}"]})
            _same_yardstick(canary_revision.spec, policy_selectors.revision_desired(pool=locked).spec, generation)
            count = canary_count(canary_instances, len(live))
            if count >= len(live):
                raise Conflict(
                    f"pool {pool.name!r} has {len(live)} live instance(s) ({', '.join(live) or 'none'}) and "
                    f"canary_instances asks for {count}: at least one stable instance must remain to compare with. "
                    "Publish without a body to send it to every instance at once.",
                    errors={"canary_instances": [f"at most {max(0, len(live) - 1)} for this pool now"]})
            now = timezone.now()
            rollout = Rollout.objects.create(
                pool=locked, generation=generation, stable_generation=locked.desired_generation,
                canary_instances=live[:count], bake_s=bake_s, max_burn=max_burn, started_by=actor, started_at=now,
                bake_ends_at=now + timedelta(seconds=bake_s),
            )
            audit_record(actor=actor, action=AuditEntry.Action.ROLLOUT_START, object_type="rollout",
                         object_id=str(rollout), pool=pool.name,
                         before={"desired_generation": locked.desired_generation},
                         after={**rollout_state(rollout), "live_instances": live})
    except IntegrityError:  # a concurrent start won the pool's one baking slot
        raise selectors.rollout_baking(pool=pool).busy() from None
    overrides_push(rollout=rollout)
    return rollout


# Writes or deletes the canary overrides only if no newer rollout state was written before: KEYS =
# fence, poke channel, overrides…; ARGV = token, "set" or "delete", the record, the generation.
# Returns 1 when written, 0 when a newer state's token is already there.
_OVERRIDES_SCRIPT = """
local fence = tonumber(redis.call('GET', KEYS[1]) or '0') or 0
if fence > tonumber(ARGV[1]) then return 0 end
redis.call('SET', KEYS[1], ARGV[1])
for i = 3, #KEYS do
  if ARGV[2] == 'set' then redis.call('SET', KEYS[i], ARGV[3]) else redis.call('DEL', KEYS[i]) end
end
redis.call('PUBLISH', KEYS[2], ARGV[4])
return 1
"""


def _same_yardstick(canary_spec: dict, stable_spec: dict, generation: int) -> None:
    """Conflict unless the canary keeps the stable revision's SLO: each instance counts a request as
    within the SLO of the revision *it* runs, so a canary with a looser SLO would be judged on its own
    yardstick (a 60 s SLO looks healthy beside a stable one burning at 1 ms). Changing the SLO is
    published to the whole pool at once."""
    canary, stable = slo_of(canary_spec), slo_of(stable_spec)
    changed = {path: (old, new) for path, old, new in (
        ("trigger.ranking_p99_slo_ms", stable.p99_ms, canary.p99_ms),
        ("slo.target_ratio", stable.target_ratio, canary.target_ratio)) if old != new}
    if changed:
        raise Conflict(
            f"generation {generation} changes the SLO ({'; '.join(f'{p} {o} → {n}' for p, (o, n) in changed.items())}). "
            "A canary is judged against the SLO the stable instances keep, and each instance counts its requests "
            "against its own revision's SLO, so an SLO change cannot be canaried: publish it to the whole pool "
            "(strategy \"all\"), or canary the other changes first with the stable SLO.",
            errors={path: [f"differs from the stable revision's ({old} → {new}); an SLO change is published to "
                           "every instance at once"] for path, (old, new) in changed.items()})


def overrides_push(*, rollout: Rollout) -> bool:
    """Redis after the database: the canaries' overrides while baking, none after; then poke the pool.

    A compare-and-set on the pool's rollout fence: a writer holding a state that is no longer current
    (a periodic pass that read the bake before an abort, say) writes nothing, so a decision sticks.
    Returns whether it wrote."""
    pool = rollout.pool
    keys = PoolKeys(pool.name)
    overrides = [keys.instance_desired(name) for name in rollout.canary_instances]
    message = ""
    if rollout.state == Rollout.State.BAKING:
        revision = policy_selectors.revision_get(pool=pool, generation=rollout.generation)
        message = DesiredRevision(generation=revision.generation, sha256=revision.sha256, spec=revision.spec,
                                  published_at=rollout.started_at.timestamp(),
                                  published_by=rollout.started_by).to_json()
    try:
        written = get_redis().eval(_OVERRIDES_SCRIPT, 2 + len(overrides), keys.rollout_fence, keys.poke_channel,
                                   *overrides, str(rollout.fence_token), "set" if message else "delete", message,
                                   str(rollout.generation))
    except redis.RedisError as exc:
        raise redis_unreachable(exc) from exc
    if not written:
        logger.info("rollout %s: overrides not written, a newer rollout state is in Redis", rollout)
        if rollout.state == Rollout.State.BAKING:
            return False
        # A decision a newer rollout superseded has nothing left to write: not retried by the tick.
    if not rollout.published:
        Rollout.objects.filter(pk=rollout.pk).update(published=True)
        rollout.published = True
    return bool(written)


def _decided(*, rollout: Rollout, state: str, actor: str, reason: str, figures: dict) -> Rollout:
    """Lock the rollout, check it still bakes (else 409), record the decision; call inside a transaction."""
    locked = Rollout.objects.select_for_update().select_related("pool").filter(pk=rollout.pk).first()
    if locked is None or locked.state != Rollout.State.BAKING:
        raise Conflict(f"no canary is baking on pool {rollout.pool.name!r}: the rollout of generation "
                       f"{rollout.generation} is already {locked.state if locked else 'gone'}.")
    locked.state, locked.decided_at, locked.decided_by, locked.reason = state, timezone.now(), actor, reason[:1000]
    locked.figures = figures
    locked.canary_burn = (figures.get("canary") or {}).get("burn")
    locked.stable_burn = (figures.get("stable") or {}).get("burn")
    locked.published = False
    locked.save()
    action = {Rollout.State.PROMOTED: AuditEntry.Action.ROLLOUT_PROMOTE,
              Rollout.State.ROLLED_BACK: AuditEntry.Action.ROLLOUT_ROLLBACK,
              Rollout.State.ABORTED: AuditEntry.Action.ROLLOUT_ABORT}[state]
    audit_record(actor=actor, action=action, object_type="rollout", object_id=str(locked), pool=locked.pool.name,
                 before={"state": Rollout.State.BAKING},
                 after={**rollout_state(locked), "reason": reason, "figures": _without_series(figures)})
    return locked


def _without_series(figures: dict) -> dict:
    return {key: value for key, value in figures.items() if key != "series"}


def rollout_promote(*, rollout: Rollout, actor: str, reason: str, figures: dict | None = None) -> Rollout:
    """Publish the canary's generation to the whole pool (the normal publish, audited), then drop the overrides."""
    with transaction.atomic():
        Pool.objects.select_for_update().get(pk=rollout.pool_id)
        decided = _decided(rollout=rollout, state=Rollout.State.PROMOTED, actor=actor, reason=reason,
                           figures=figures if figures is not None else rollout.figures)
        desired_set(pool=decided.pool, generation=decided.generation, actor=actor, via="canary")
    return decision_publish(rollout=decided)


def rollout_roll_back(*, rollout: Rollout, actor: str, reason: str, figures: dict | None = None,
                      state: str = Rollout.State.ROLLED_BACK) -> Rollout:
    """Return the canaries to the stable generation: revoke the canary's generation, drop the overrides."""
    with transaction.atomic():
        pool = Pool.objects.select_for_update().get(pk=rollout.pool_id)
        decided = _decided(rollout=rollout, state=state, actor=actor, reason=reason,
                           figures=figures if figures is not None else rollout.figures)
        pool.revoked_generations = sorted({g for g in pool.revoked_generations if g > pool.desired_generation}
                                          | {decided.generation})
        pool.save(update_fields=["revoked_generations"])
    return decision_publish(rollout=decided)


def decision_publish(*, rollout: Rollout) -> Rollout:
    """The Redis half of a decision: the pool's record (the new generation, or the revocation) first,
    then the overrides go. Raises Unavailable when Redis cannot be reached (the tick retries)."""
    pool = policy_selectors.pool_get(name=rollout.pool.name)
    desired_push(pool=pool)
    rollout.pool = pool
    overrides_push(rollout=rollout)
    return rollout


def rollout_evaluate(*, rollout: Rollout, now: float | None = None) -> Rollout:
    """Judge one baking rollout on the telemetry so far; promote, roll back, or keep baking (figures saved)."""
    now = time.time() if now is None else now
    pool = policy_selectors.pool_get(name=rollout.pool.name)
    since = rollout.started_at.timestamp()
    client = get_redis()
    try:
        canary = bake.served(client, pool=pool.name, instances=rollout.canary_instances,
                             generation=rollout.generation, since=since, now=now)
        stable_names = bake.stable_instances(client, pool=pool.name, canary=rollout.canary_instances, since=since)
        stable = bake.served(client, pool=pool.name, instances=stable_names,
                             generation=rollout.stable_generation, since=since, now=now)
    except redis.RedisError as exc:
        raise redis_unreachable(exc) from exc
    views = {view.instance: view for view in fleet_selectors.pool_status(pool=pool, now=now).instances}
    canary_views = [views.get(name) for name in rollout.canary_instances]
    nacked = {view.instance: view.status.error for view in canary_views
              if view is not None and view.status.config_state == NACK and view.status.nacked_generation == rollout.generation}
    not_live = [name for name, view in zip(rollout.canary_instances, canary_views, strict=True)
                if view is None or not view.live]
    not_running = [name for name, view in zip(rollout.canary_instances, canary_views, strict=True)
                   if view is not None and view.live and not (view.status.config_state == ACK and
                                                              view.status.applied_generation == rollout.generation)]
    canary_figures = GroupFigures.of(canary.requests, canary.bad, canary.p99_ms)
    stable_figures = GroupFigures.of(stable.requests, stable.bad, stable.p99_ms)
    min_requests = getattr(settings, "RELAYGR_ROLLOUT_MIN_REQUESTS", DEFAULT_MIN_REQUESTS)
    bake_over = now >= rollout.bake_ends_at.timestamp()
    slo = slo_of(policy_selectors.revision_get(pool=pool, generation=rollout.stable_generation).spec)
    yardstick = f"the stable revision's SLO, {slo.p99_ms:g} ms" if slo.p99_ms is not None else ""
    decision = decide(canary=canary_figures, stable=stable_figures, max_burn=rollout.max_burn, bake_over=bake_over,
                      min_requests=min_requests, nacked=nacked, not_live=not_live, not_running=not_running,
                      yardstick=yardstick)
    series = list(rollout.figures.get("series", []))
    series.append({"t": round(now, 3), "canary_p99_ms": canary_figures.p99_ms, "stable_p99_ms": stable_figures.p99_ms,
                   "canary_burn": canary_figures.burn, "stable_burn": stable_figures.burn})
    if len(series) > MAX_SERIES_POINTS:
        series = series[::2]
    figures = {
        "canary": canary_figures.to_dict(), "stable": stable_figures.to_dict(), "stable_instances": stable_names,
        "min_requests": min_requests, "max_burn": rollout.max_burn, "slo_ms": slo.p99_ms, "bake_over": bake_over,
        "nacked": nacked,
        "not_live": not_live, "not_running": not_running, "evaluated_at": round(now, 3), "decision": decision.action,
        "reason": decision.reason, "series": series,
        # Where the figures came from (Redis alone, or Prometheus for a long bake's start) and, when only part
        # of the bake could be read, from when.
        "history": canary.history, "judged_since": canary.judged_since,
    }
    if decision.action == "promote":
        return rollout_promote(rollout=rollout, actor=EVALUATOR, reason=decision.reason, figures=figures)
    if decision.action == "rollback":
        return rollout_roll_back(rollout=rollout, actor=EVALUATOR, reason=decision.reason, figures=figures)
    Rollout.objects.filter(pk=rollout.pk, state=Rollout.State.BAKING).update(
        figures=figures, canary_burn=canary_figures.burn, stable_burn=stable_figures.burn)
    rollout.refresh_from_db()
    return rollout


def rollouts_tick() -> dict[str, int]:
    """The periodic task's pass: write decisions Redis missed, re-assert the overrides of every bake
    (a Redis that restarted converges), and judge every bake. One pool's failure never stops the others."""
    done = {"published": 0, "evaluated": 0, "failed": 0}
    for rollout in selectors.rollouts_unpublished():
        try:
            decision_publish(rollout=rollout)
            done["published"] += 1
        except ServiceError as exc:
            logger.warning("rollout %s: decision not written to Redis yet: %s", rollout, exc.detail)
            done["failed"] += 1
    for rollout in selectors.rollouts_baking():
        try:
            overrides_push(rollout=rollout)
            rollout_evaluate(rollout=rollout)
            done["evaluated"] += 1
        except ServiceError as exc:  # Redis down, or decided by hand meanwhile (409)
            logger.warning("rollout %s: not evaluated: %s", rollout, exc.detail)
            done["failed"] += 1
    return done


def rollout_sync() -> dict[str, int]:
    """Idempotent repair (``relaygr_sync``): every pool's canary overrides as the database says."""
    synced = 0
    for pool in policy_selectors.pool_list():
        latest = selectors.rollout_latest(pool=pool)
        if latest is not None:
            latest.pool = pool
            overrides_push(rollout=latest)
            synced += 1
    return {"rollouts": synced}
