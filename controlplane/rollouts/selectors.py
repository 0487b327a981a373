"""Reads of rollouts."""

from __future__ import annotations

from datetime import datetime

from django.db.models import Count, QuerySet
from django.utils import timezone

from controlplane.policies.models import Pool

from .models import Rollout


def rollout_baking(*, pool: Pool) -> Rollout | None:
    return Rollout.objects.filter(pool=pool, state=Rollout.State.BAKING).first()


def rollout_latest(*, pool: Pool) -> Rollout | None:
    return Rollout.objects.filter(pool=pool).order_by("-id").first()


def rollouts_baking() -> QuerySet[Rollout]:
    return Rollout.objects.filter(state=Rollout.State.BAKING).select_related("pool").order_by("id")


def rollouts_unpublished() -> QuerySet[Rollout]:
    """Decisions whose Redis half has not been written yet (Redis was down when they were taken)."""
    return Rollout.objects.filter(published=False).exclude(state=Rollout.State.BAKING).select_related("pool")


def rollout_counts() -> dict[str, dict[str, int]]:
    """Rollouts per pool name and state, every state present (0 where none): one query for any number
    of pools. Rows are never deleted (a pool is PROTECTed), so each count only grows."""
    counts: dict[str, dict[str, int]] = {}
    for row in Rollout.objects.values("pool__name", "state").annotate(n=Count("id")).order_by():
        counts.setdefault(row["pool__name"], dict.fromkeys(Rollout.State.values, 0))[row["state"]] = row["n"]
    return counts


def instance_desired(*, pool: Pool) -> dict[str, int]:
    """The generation each canary instance should run while a canary bakes ({} otherwise); every
    other instance should run the pool's desired generation."""
    baking = rollout_baking(pool=pool)
    return {name: baking.generation for name in baking.canary_instances} if baking is not None else {}


def rollout_summary(*, pool: Pool, now: datetime | None = None) -> dict:
    """The pool's latest rollout as the API shows it (``state`` "none" when there never was one)."""
    rollout = rollout_latest(pool=pool)
    if rollout is None:
        return {"pool": pool.name, "state": "none", "generation": None, "stable_generation": None, "canary": [],
                "bake_s": None, "max_burn": None, "started_at": None, "started_by": "", "bake_ends_at": None,
                "bake_left_s": None, "decided_at": None, "decided_by": "", "reason": "", "canary_burn": None,
                "stable_burn": None, "canary_figures": None, "stable_figures": None, "series": []}
    now = now or timezone.now()
    baking = rollout.state == Rollout.State.BAKING
    figures = rollout.figures or {}
    return {
        "pool": pool.name, "state": rollout.state, "generation": rollout.generation,
        "stable_generation": rollout.stable_generation, "canary": rollout.canary_instances,
        "bake_s": rollout.bake_s, "max_burn": rollout.max_burn, "started_at": rollout.started_at,
        "started_by": rollout.started_by, "bake_ends_at": rollout.bake_ends_at,
        "bake_left_s": max(0.0, (rollout.bake_ends_at - now).total_seconds()) if baking else None,
        "decided_at": rollout.decided_at, "decided_by": rollout.decided_by,
        "reason": rollout.reason or figures.get("reason", ""), "canary_burn": rollout.canary_burn,
        "stable_burn": rollout.stable_burn, "canary_figures": figures.get("canary"),
        "stable_figures": figures.get("stable"), "series": figures.get("series", []),
    }
