"""Reads of the audit log: the filtered list, and the entries the charts mark."""

from __future__ import annotations

from datetime import datetime

from django.db.models import QuerySet

from .models import AuditEntry


def audit_list(
    *, pool: str | None = None, actor: str | None = None, action: str | None = None,
    since: datetime | None = None, until: datetime | None = None,
) -> QuerySet[AuditEntry]:
    entries = AuditEntry.objects.all()
    if pool:
        entries = entries.filter(pool=pool)
    if actor:
        entries = entries.filter(actor=actor)
    if action:
        entries = entries.filter(action=action)
    if since:
        entries = entries.filter(time__gte=since)
    if until:
        entries = entries.filter(time__lt=until)
    return entries


# What the charts mark: the pool's creation (its first generation desired), every publish (a rollback
# and a canary's promotion publish too) and each canary's start and end.
TIMELINE_ACTIONS = (
    AuditEntry.Action.POOL_CREATE, AuditEntry.Action.REVISION_PUBLISH, AuditEntry.Action.ROLLOUT_START,
    AuditEntry.Action.ROLLOUT_PROMOTE, AuditEntry.Action.ROLLOUT_ROLLBACK, AuditEntry.Action.ROLLOUT_ABORT,
)


def timeline_events(*, pool: str, since: datetime) -> QuerySet[AuditEntry]:
    """The ``TIMELINE_ACTIONS`` of a pool since a time, oldest first."""
    return (
        AuditEntry.objects.filter(pool=pool, action__in=TIMELINE_ACTIONS, time__gte=since)
        .order_by("time", "id")
    )
