"""Reads of pools and revisions; each returns a queryset or a model instance (the audit trail: ``controlplane.audit``)."""

from __future__ import annotations

from django.db.models import (
    BooleanField,
    Exists,
    ExpressionWrapper,
    IntegerField,
    JSONField,
    Max,
    OuterRef,
    Q,
    QuerySet,
    Subquery,
)
from django.db.models.fields.json import KeyTextTransform
from django.db.models.functions import Cast

from controlplane.audit.models import AuditEntry
from controlplane.common.errors import NotFound
from controlplane.rollouts.models import Rollout

from .models import ConfigRevision, Pool


def pool_list() -> QuerySet[Pool]:
    """Pools with ``latest_generation`` and ``desired_spec`` annotated (one query for any number)."""
    desired_spec = ConfigRevision.objects.filter(pool=OuterRef("pk"), generation=OuterRef("desired_generation"))
    return Pool.objects.annotate(
        latest_generation=Max("revisions__generation"),
        desired_spec=Subquery(desired_spec.values("spec")[:1], output_field=JSONField()),
    )


def pool_get(*, name: str) -> Pool:
    pool = pool_list().filter(name=name).first()
    if pool is None:
        raise NotFound(f"Pool {name!r} does not exist.")
    return pool


def _revisions(pool: Pool) -> QuerySet[ConfigRevision]:
    """A pool's revisions, each with its past: ``was_desired`` (the whole pool's desired generation once:
    the first generation, made desired with the pool, or one the audit trail records a publish of — a
    promotion and a rollback publish too) and ``rollout_state`` (its latest canary's state, or None)."""
    published = AuditEntry.objects.filter(pool=pool.name, action=AuditEntry.Action.REVISION_PUBLISH).annotate(
        published=Cast(KeyTextTransform("desired_generation", "after"), IntegerField()),
    ).filter(published=OuterRef("generation"))
    canaries = Rollout.objects.filter(pool=OuterRef("pool"), generation=OuterRef("generation")).order_by("-id")
    return ConfigRevision.objects.filter(pool=pool).annotate(
        was_desired=ExpressionWrapper(Q(generation=1) | Exists(published), output_field=BooleanField()),
        rollout_state=Subquery(canaries.values("state")[:1]),
    )


def revision_list(*, pool: Pool) -> QuerySet[ConfigRevision]:
    return _revisions(pool).order_by("-generation")


def revision_get(*, pool: Pool, generation: int) -> ConfigRevision:
    revision = _revisions(pool).filter(generation=generation).first()
    if revision is None:
        latest = revision_latest_generation(pool=pool)
        raise NotFound(f"Pool {pool.name!r} has no generation {generation}; generations are 1 to {latest}.")
    return revision


def revision_latest_generation(*, pool: Pool) -> int:
    latest = ConfigRevision.objects.filter(pool=pool).order_by("-generation").values_list("generation", flat=True)
    return latest.first() or 0


def revision_desired(*, pool: Pool) -> ConfigRevision:
    return revision_get(pool=pool, generation=pool.desired_generation)
