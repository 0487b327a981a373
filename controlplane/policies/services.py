"""Writes: pools, revisions, publish, rollback and the Redis side of publishing, each audited.

Publishing is crash-safe by ordering: the desired generation and its audit entry commit in one
database transaction first; only then is the revision written to Redis and the pool poked. If Redis
cannot be reached the caller gets ``Unavailable`` (HTTP 503) but the database already holds the
truth, and ``desired_sync`` (``manage.py relaygr_sync``) writes it to Redis later. A pool whose
``published_generation`` lags its ``desired_generation`` is exactly one waiting for that repair.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import redis
from django.db import IntegrityError, transaction
from django.utils import timezone

from controlplane.audit.models import AuditEntry
from controlplane.audit.services import audit_record
from controlplane.common.errors import Conflict, InvalidInput
from controlplane.common.redis import get_redis, redis_unreachable
from controlplane.rollouts.selectors import rollout_baking, rollout_latest
from relay_engine.core.config import default_policy, validate_policy
from relay_engine.core.wire import DesiredRevision, PoolKeys, pools_key, revoked_ranges

from . import selectors
from .models import ConfigRevision, Pool
from .signals import revision_published

logger = logging.getLogger(__name__)


def _pool_state(pool: Pool) -> dict[str, Any]:
    return {
        "name": pool.name, "description": pool.description, "device_kind": pool.device_kind,
        "expected_instances": pool.expected_instances, "desired_generation": pool.desired_generation,
    }


def _revision_state(revision: ConfigRevision) -> dict[str, Any]:
    return {
        "generation": revision.generation, "parent_generation": revision.parent_generation,
        "sha256": revision.sha256, "comment": revision.comment, "restored_from": revision.restored_from,
        "spec": revision.spec,
    }


def _validated_spec(spec: Any) -> tuple[dict[str, Any], str]:
    """The normalised spec (defaults filled in) and its sha256, or InvalidInput with every error."""
    parsed, errors = validate_policy(spec)
    if errors:
        by_path = {f"spec.{path}" if path != "(root)" else "spec": msgs for path, msgs in errors.items()}
        summary = "; ".join(f"{p}: {' '.join(m)}" for p, m in by_path.items())
        raise InvalidInput(f"Invalid spec: {summary}", errors=by_path)
    assert parsed is not None
    return parsed.to_dict(), parsed.sha256()


def pool_create(
    *, name: str, description: str = "", device_kind: str = "auto", expected_instances: int = 1, actor: str,
) -> Pool:
    """A pool starts at generation 1 holding the schema's defaults, desired, so every edit has a parent."""
    spec = default_policy()
    try:
        with transaction.atomic():
            pool = Pool.objects.create(
                name=name, description=description, device_kind=device_kind,
                expected_instances=expected_instances, desired_generation=1, desired_at=timezone.now(),
                desired_by=actor, created_by=actor,
            )
            revision = ConfigRevision.objects.create(
                pool=pool, generation=1, parent_generation=None, spec=spec.to_dict(), sha256=spec.sha256(),
                author=actor, comment="initial revision: the schema's defaults",
            )
            audit_record(actor=actor, action=AuditEntry.Action.POOL_CREATE, object_type="pool", object_id=name,
                         pool=name, after={**_pool_state(pool), "revision": _revision_state(revision)})
    except IntegrityError:
        raise Conflict(f"Pool {name!r} already exists.", errors={"name": ["A pool with this name exists."]}) from None
    # A fresh pool with Redis down still exists; ``published_generation`` 0 shows it awaits the sync.
    try:
        desired_push(pool=pool)
    except Exception as exc:  # noqa: BLE001 - any Redis failure leaves the repair to desired_sync
        logger.warning("pool %s created but not yet written to Redis: %s", name, exc)
    pool.refresh_from_db()
    return pool


def revision_create(
    *, pool: Pool, spec: Any, parent_generation: int, author: str, comment: str = "",
    restored_from: int | None = None,
) -> ConfigRevision:
    """A new generation on top of ``parent_generation``, which must be the pool's latest (else 409)."""
    normalised, digest = _validated_spec(spec)
    try:
        with transaction.atomic():
            locked = Pool.objects.select_for_update().get(pk=pool.pk)
            latest = selectors.revision_latest_generation(pool=locked)
            if parent_generation != latest:
                raise Conflict(
                    f"parent_generation {parent_generation} is stale: pool {pool.name!r} is at generation "
                    f"{latest}. Re-read generation {latest}, apply your change to it and retry.",
                    errors={"parent_generation": [f"must be the latest generation, {latest}"]},
                )
            revision = ConfigRevision.objects.create(
                pool=locked, generation=latest + 1, parent_generation=parent_generation, spec=normalised,
                sha256=digest, author=author, comment=comment, restored_from=restored_from,
            )
            audit_record(actor=author, action=AuditEntry.Action.REVISION_CREATE, object_type="revision",
                         object_id=str(revision), pool=pool.name, after=_revision_state(revision))
    except IntegrityError:
        # Two writers raced past the check on a database without row locks: the loser is stale.
        raise Conflict(
            f"parent_generation {parent_generation} is stale: another revision was created concurrently.",
            errors={"parent_generation": ["another revision was created concurrently"]},
        ) from None
    return revision


@dataclass(frozen=True)
class PublishResult:
    pool: Pool
    revision: ConfigRevision
    changed: bool


def revision_publish(*, pool: Pool, generation: int, actor: str) -> PublishResult:
    """Make ``generation`` desired (DB, audited), then write it to Redis and poke the pool.

    Publishing the generation already desired changes nothing in the database and writes Redis
    again (a manual repair). An older generation is refused: rollback copies it forward instead.
    """
    with transaction.atomic():
        result = desired_set(pool=pool, generation=generation, actor=actor)
    return _pushed(result)


def pool_roll_back(*, pool: Pool, to_generation: int, parent_generation: int, actor: str,
                   comment: str = "") -> PublishResult:
    """Publish the spec of ``to_generation`` again, as a new generation on top of ``parent_generation``.

    ``parent_generation`` is the pool's latest generation as the caller saw it, as for a create: when
    another revision came first it is stale, and the rollback a 409 that writes nothing. The same
    request again — same pool, ``parent_generation`` and ``to_generation`` — is answered with the
    revision it created (``changed`` false) instead of a second one, so a caller that lost the answer
    may retry safely.
    """
    with transaction.atomic():
        locked = Pool.objects.select_for_update().get(pk=pool.pk)
        done = _rollback_done(pool=locked, to_generation=to_generation, parent_generation=parent_generation)
        if done is not None:
            result = PublishResult(pool=locked, revision=done, changed=False)
        else:
            source = selectors.revision_get(pool=locked, generation=to_generation)
            revision = revision_create(
                pool=locked, spec=source.spec, parent_generation=parent_generation, author=actor,
                comment=comment or f"rollback to generation {to_generation}", restored_from=to_generation,
            )
            audit_record(actor=actor, action=AuditEntry.Action.POOL_ROLLBACK, object_type="pool",
                         object_id=pool.name, pool=pool.name,
                         before={"desired_generation": locked.desired_generation},
                         after={"to_generation": to_generation, "new_generation": revision.generation})
            result = desired_set(pool=locked, generation=revision.generation, actor=actor)
    if not result.changed and result.revision.generation != result.pool.desired_generation:
        return result  # a repeated rollback that was since superseded: nothing to write to Redis
    return _pushed(result)


def _rollback_done(*, pool: Pool, to_generation: int, parent_generation: int) -> ConfigRevision | None:
    """The revision an identical rollback already created, if any (it is the one right above its parent)."""
    return ConfigRevision.objects.filter(pool=pool, generation=parent_generation + 1,
                                         parent_generation=parent_generation, restored_from=to_generation).first()


def desired_set(*, pool: Pool, generation: int, actor: str, via: str = "publish") -> PublishResult:
    """The database half of a publish (a canary's promotion included, ``via="canary"``); call inside
    a transaction. While a canary bakes on the pool nothing else is published: 409 saying how to end
    the bake. A new desired generation is announced (``signals.revision_published``) once committed."""
    locked = Pool.objects.select_for_update().get(pk=pool.pk)
    baking = rollout_baking(pool=locked)
    if baking is not None:
        raise baking.busy()
    revision = selectors.revision_get(pool=locked, generation=generation)
    if generation < locked.desired_generation:
        raise Conflict(
            f"generation {generation} is older than the desired generation {locked.desired_generation}; "
            f"roll back to it instead (POST /api/v1/pools/{pool.name}/rollback/), which publishes its "
            "spec as a new generation.",
            errors={"generation": [f"must be at least the desired generation, {locked.desired_generation}"]},
        )
    changed = generation != locked.desired_generation
    if changed:
        before = {"desired_generation": locked.desired_generation}
        locked.desired_generation = generation
        locked.desired_at = timezone.now()
        locked.desired_by = actor
        # A revocation only lets instances step down to the desired generation: none above it is left.
        locked.revoked_generations = [g for g in locked.revoked_generations if g > generation]
        locked.save(update_fields=["desired_generation", "desired_at", "desired_by", "revoked_generations"])
        audit_record(actor=actor, action=AuditEntry.Action.REVISION_PUBLISH, object_type="pool",
                     object_id=pool.name, pool=pool.name, before=before,
                     after={"desired_generation": generation, "sha256": revision.sha256,
                            "restored_from": revision.restored_from})
        published_at = locked.desired_at
        transaction.on_commit(lambda: _announce(pool=locked, generation=generation, published_at=published_at,
                                                actor=actor, via=via))
    return PublishResult(pool=locked, revision=revision, changed=changed)


def _announce(**published: Any) -> None:
    """``revision_published`` to its receivers; one that fails is logged, the publish stands."""
    for receiver, outcome in revision_published.send_robust(sender=Pool, **published):
        if isinstance(outcome, Exception):
            logger.error("a receiver of revision_published (%s) failed for %s@%s: %r", getattr(
                receiver, "__qualname__", receiver), published["pool"].name, published["generation"], outcome)


def _pushed(result: PublishResult) -> PublishResult:
    """The Redis half of a publish, after the database committed."""
    desired_push(pool=result.pool)
    result.pool.refresh_from_db()
    return result


# Sets the desired revision unless Redis already holds a newer generation (a slower concurrent
# publish must not overwrite a faster one) or a newer rollout state than the writer read (the rollout
# fence: KEYS[4], the writer's token ARGV[5], 0 for a pool that never had a rollout), registers the pool
# and pokes it; all in one step.
_PUSH_SCRIPT = """
local token = tonumber(ARGV[5]) or 0
if token > 0 then
  local fence = tonumber(redis.call('GET', KEYS[4]) or '0') or 0
  if fence > token then return 0 end
end
local current = redis.call('GET', KEYS[1])
if current and ARGV[4] == '0' then
  local ok, decoded = pcall(cjson.decode, current)
  if ok and tonumber(decoded['generation']) and tonumber(decoded['generation']) > tonumber(ARGV[2]) then
    return 0
  end
end
if token > 0 then redis.call('SET', KEYS[4], ARGV[5]) end
redis.call('SET', KEYS[1], ARGV[1])
redis.call('SADD', KEYS[2], ARGV[3])
redis.call('PUBLISH', KEYS[3], ARGV[2])
return 1
"""


def desired_push(*, pool: Pool, force: bool = False) -> bool:
    """Write the pool's desired revision to Redis and poke it; record it as published.

    ``force`` overwrites whatever Redis holds (the database is the source of truth); without it a
    newer generation already in Redis is kept. Raises Unavailable when Redis cannot be reached.

    The record is built from the pool as the database holds it now, the pool's latest rollout read
    first: a writer that read the pool before a canary was rolled back (the sync loop's pass over
    every pool, say) would drop the revocation and leave the canary on the aborted generation. The
    push compare-and-sets the pool's rollout fence (``Rollout.fence_token``), as the overrides do, so
    a record built before a newer rollout state is refused even in the moment between the two reads.
    """
    latest = rollout_latest(pool=pool)  # before the pool's row: a row read after it is never older
    pool = Pool.objects.get(pk=pool.pk)
    revision = selectors.revision_desired(pool=pool)
    baking = latest if latest is not None and latest.state == latest.State.BAKING else None
    message = DesiredRevision(
        generation=revision.generation, sha256=revision.sha256, spec=revision.spec,
        published_at=(pool.desired_at or revision.created_at).timestamp(), published_by=pool.desired_by,
        # However many canaries were rolled back: at most two ranges, leaving out only the one baking.
        revoked=revoked_ranges(pool.revoked_generations, above=revision.generation,
                               keep=[baking.generation] if baking is not None else []),
    )
    keys = PoolKeys(pool.name)
    client = get_redis()
    try:
        written = client.eval(
            _PUSH_SCRIPT, 4, keys.desired, pools_key(), keys.poke_channel, keys.rollout_fence,
            message.to_json(), str(revision.generation), pool.name, "1" if force else "0",
            str(latest.fence_token if latest is not None else 0),
        )
    except redis.RedisError as exc:
        raise redis_unreachable(exc) from exc
    Pool.objects.filter(pk=pool.pk, published_generation__lt=revision.generation).update(
        published_generation=revision.generation
    )
    return bool(written)


def desired_sync() -> dict[str, int]:
    """Idempotent repair: write every pool's desired revision from the database into Redis."""
    synced = 0
    for pool in selectors.pool_list():
        desired_push(pool=pool, force=True)
        synced += 1
    return {"pools": synced}
