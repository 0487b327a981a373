"""A pool's configuration is a chain of immutable revisions; "desired" is a pointer into it.

Rollback publishes an older spec again as a new generation, so the chain only grows and the
desired generation only increases: a worker never has to guess whether a lower number is newer.
"""

from __future__ import annotations

from django.core.validators import MaxValueValidator, MinValueValidator, RegexValidator
from django.db import models

from relay_engine.core.config import SloTarget, slo_of
from relay_engine.core.wire import NAME_RE

DEVICE_KINDS = ("auto", "cpu", "cuda", "npu")
MAX_EXPECTED_INSTANCES = 1024


class Pool(models.Model):
    name = models.CharField(
        max_length=63, unique=True,
        validators=[RegexValidator(NAME_RE, "lower-case letters, digits, '-' and '_', starting with a letter or digit")],
    )
    description = models.CharField(max_length=500, blank=True, default="")
    device_kind = models.CharField(max_length=8, choices=[(k, k) for k in DEVICE_KINDS], default="auto")
    expected_instances = models.PositiveIntegerField(
        default=1, validators=[MinValueValidator(1), MaxValueValidator(MAX_EXPECTED_INSTANCES)]
    )
    # The generation the workers should run, and the last one known to be written to Redis. They
    # differ only while Redis is unreachable; ``desired_sync`` closes the gap.
    desired_generation = models.PositiveIntegerField(default=1)
    published_generation = models.PositiveIntegerField(default=0)
    # Generations above the desired one that canary instances ran and a rollback withdrew: the desired
    # record lists them (``wire.DesiredRevision.revoked``) so those instances may step down to it.
    revoked_generations = models.JSONField(default=list, blank=True)
    desired_at = models.DateTimeField(null=True, blank=True)
    desired_by = models.CharField(max_length=150, blank=True, default="")
    created_by = models.CharField(max_length=150, blank=True, default="")
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ["name"]

    def __str__(self) -> str:
        return self.name

    @property
    def slo(self) -> SloTarget:
        """The desired revision's SLO; needs the ``desired_spec`` annotation of ``selectors.pool_list``."""
        return slo_of(getattr(self, "desired_spec", None))


class ConfigRevision(models.Model):
    """Immutable: never updated after creation (``save`` refuses)."""

    pool = models.ForeignKey(Pool, on_delete=models.PROTECT, related_name="revisions")
    generation = models.PositiveIntegerField()
    parent_generation = models.PositiveIntegerField(null=True, blank=True)
    spec = models.JSONField()
    sha256 = models.CharField(max_length=64)
    author = models.CharField(max_length=150)
    comment = models.CharField(max_length=1000, blank=True, default="")
    # For a rollback: the generation whose spec this one copies.
    restored_from = models.PositiveIntegerField(null=True, blank=True)
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ["pool", "-generation"]
        constraints = [
            models.UniqueConstraint(fields=["pool", "generation"], name="unique_generation_per_pool"),
        ]

    def __str__(self) -> str:
        return f"{self.pool.name}@{self.generation}"

    def save(self, *args, **kwargs):
        if self.pk is not None:
            raise ValueError("a ConfigRevision is immutable; create a new generation instead")
        super().save(*args, **kwargs)

