"""A canary rollout: one revision sent to a few instances first, judged on their error-budget burn
against the stable instances', then promoted to the pool or rolled back (``services``).

The row is the whole state of the bake (the periodic task resumes it after a restart); ``published``
says whether Redis already reflects that state (the overrides while it bakes, none after).
"""

from __future__ import annotations

from django.db import models

from controlplane.common.errors import Conflict
from controlplane.policies.models import Pool


class Rollout(models.Model):
    class State(models.TextChoices):
        BAKING = "baking"
        PROMOTED = "promoted"
        ROLLED_BACK = "rolled_back"
        ABORTED = "aborted"

    pool = models.ForeignKey(Pool, on_delete=models.PROTECT, related_name="rollouts")
    generation = models.PositiveIntegerField()
    stable_generation = models.PositiveIntegerField()
    canary_instances = models.JSONField(default=list)  # instance names, e.g. ["ranking-a.0"]
    bake_s = models.PositiveIntegerField()
    max_burn = models.FloatField()
    state = models.CharField(max_length=16, choices=State.choices, default=State.BAKING, db_index=True)
    started_by = models.CharField(max_length=150)
    started_at = models.DateTimeField()
    bake_ends_at = models.DateTimeField()
    decided_at = models.DateTimeField(null=True, blank=True)
    decided_by = models.CharField(max_length=150, blank=True, default="")  # a user, or "rollout-evaluator"
    reason = models.CharField(max_length=1000, blank=True, default="")
    canary_burn = models.FloatField(null=True, blank=True)
    stable_burn = models.FloatField(null=True, blank=True)
    # The last evaluation's figures (per group: requests, bad, burn, Wilson bounds, P99) and their series.
    figures = models.JSONField(default=dict, blank=True)
    published = models.BooleanField(default=False)

    class Meta:
        ordering = ["pool", "-id"]
        constraints = [
            # One rollout at a time per pool, whatever races past the service's check.
            models.UniqueConstraint(fields=["pool"], condition=models.Q(state="baking"),
                                    name="one_baking_rollout_per_pool"),
        ]

    def __str__(self) -> str:
        return f"{self.pool.name}@{self.generation} canary ({self.state})"

    @property
    def fence_token(self) -> int:
        """Grows with every state a pool's rollouts go through (the rollout fence in Redis,
        ``PoolKeys.rollout_fence``): a later rollout's (one bakes at a time, so start times order them)
        and a decided one's above its bake's. Microseconds × 2 stay below 2^53, a Lua number's exact
        range; start times, unlike ids, keep growing across a database restored or rebuilt."""
        return int(self.started_at.timestamp() * 1_000_000) * 2 + (self.state != self.State.BAKING)

    def busy(self) -> Conflict:
        """The 409 for anything published on the pool while this rollout bakes."""
        name = self.pool.name
        return Conflict(
            f"a canary of generation {self.generation} is baking on pool {name!r} until "
            f"{self.bake_ends_at.isoformat(timespec='seconds')}; one rollout at a time: promote it "
            f"(POST /api/v1/pools/{name}/rollout/promote/) or abort it (POST /api/v1/pools/{name}/rollout/abort/) "
            "first.",
            errors={"rollout": [f"generation {self.generation} is baking"]},
        )
