"""A what-if preview: a revision replayed through the simulator on the pool's captured traffic,
beside the live revision on the same requests. Cached by what decides its answer: both specs'
sha256 and the window (its length and its end, rounded down so repeated clicks reuse one)."""

from __future__ import annotations

from django.db import models

from controlplane.policies.models import Pool


class Preview(models.Model):
    class Status(models.TextChoices):
        QUEUED = "queued"
        RUNNING = "running"
        DONE = "done"
        FAILED = "failed"

    pool = models.ForeignKey(Pool, on_delete=models.CASCADE, related_name="previews")
    generation = models.PositiveIntegerField()  # the proposed revision
    live_generation = models.PositiveIntegerField()  # the pool's desired revision when requested
    sha256 = models.CharField(max_length=64)  # of the proposed spec
    live_sha256 = models.CharField(max_length=64)
    window_s = models.PositiveIntegerField()
    window_end = models.DateTimeField()  # rounded down (``services.window_end_of``)
    status = models.CharField(max_length=8, choices=Status.choices, default=Status.QUEUED)
    error = models.TextField(blank=True, default="")
    result = models.JSONField(null=True, blank=True)
    requested_by = models.CharField(max_length=150)
    created_at = models.DateTimeField(auto_now_add=True)
    started_at = models.DateTimeField(null=True, blank=True)
    finished_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        ordering = ["-created_at", "-id"]
        # One live (not failed) preview per question: two clicks at once get the same one.
        constraints = [models.UniqueConstraint(
            fields=["pool", "sha256", "live_sha256", "window_s", "window_end"], condition=~models.Q(status="failed"),
            name="one_preview_per_question")]

    def __str__(self) -> str:
        return f"preview {self.pk} of {self.pool.name}@{self.generation} ({self.status})"


class PreviewScore(models.Model):
    """A previewed revision, published, scored: what its preview predicted beside what the pool then
    measured over a window as long as the preview's, starting once the fleet ran the revision. These
    records, not an offline validation, are what a preview's ``model_error`` says about trust."""

    class Status(models.TextChoices):
        WAITING = "waiting"  # for the fleet to converge, or for the window to end
        DONE = "done"
        FAILED = "failed"  # ``reason`` says why (no traffic, superseded, never converged)

    preview = models.ForeignKey(Preview, on_delete=models.CASCADE, related_name="scores")
    pool = models.ForeignKey(Pool, on_delete=models.CASCADE, related_name="preview_scores")
    generation = models.PositiveIntegerField()
    published_at = models.DateTimeField()
    published_via = models.CharField(max_length=16, default="publish")  # "publish" or "canary"
    window_s = models.PositiveIntegerField()  # the preview's window
    # The measured window: from the fleet's convergence (or the publish plus a settle, where the fleet
    # cannot tell), ``window_s`` long. ``converged_at`` is null where convergence could not be seen.
    measure_from = models.DateTimeField()
    measure_to = models.DateTimeField()
    converged_at = models.DateTimeField(null=True, blank=True)
    status = models.CharField(max_length=8, choices=Status.choices, default=Status.WAITING)
    reason = models.TextField(blank=True, default="")
    predicted = models.JSONField(default=dict, blank=True)
    measured = models.JSONField(null=True, blank=True)
    errors = models.JSONField(null=True, blank=True)
    created_at = models.DateTimeField(auto_now_add=True)
    scored_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        ordering = ["-published_at", "-id"]
        # One score per publish of a generation: a repeated signal or a retried receiver adds none.
        constraints = [models.UniqueConstraint(fields=["pool", "generation"], name="one_score_per_generation")]
        indexes = [models.Index(fields=["status", "measure_to"])]

    def __str__(self) -> str:
        return f"score of {self.pool.name}@{self.generation} ({self.status})"
