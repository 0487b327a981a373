"""The audit log every app writes to (NetBox keeps its ObjectChange in the shared ``core`` app)."""

from __future__ import annotations

from django.db import models


class AuditEntry(models.Model):
    """Who changed what, when, from which request; before/after as JSON (NetBox ObjectChange)."""

    class Action(models.TextChoices):
        POOL_CREATE = "pool.create"
        REVISION_CREATE = "revision.create"
        REVISION_PUBLISH = "revision.publish"
        POOL_ROLLBACK = "pool.rollback"
        ROLLOUT_START = "rollout.start"
        ROLLOUT_PROMOTE = "rollout.promote"
        ROLLOUT_ROLLBACK = "rollout.rollback"
        ROLLOUT_ABORT = "rollout.abort"
        USER_CREATE = "user.create"
        USER_ROLE = "user.role"
        TOKEN_CREATE = "token.create"
        TOKEN_REVOKE = "token.revoke"
        # Reads that matter: starting a simulation on the control plane, taking captured traffic away.
        PREVIEW_START = "preview.start"
        TRAFFIC_DOWNLOAD = "traffic.download"

    time = models.DateTimeField(auto_now_add=True, db_index=True)
    actor = models.CharField(max_length=150)
    request_id = models.CharField(max_length=64, blank=True, default="")
    action = models.CharField(max_length=32, choices=Action.choices)
    object_type = models.CharField(max_length=32)
    object_id = models.CharField(max_length=200)
    # Pool name, kept as text so the trail outlives whatever it describes.
    pool = models.CharField(max_length=63, blank=True, default="", db_index=True)
    before = models.JSONField(null=True, blank=True)
    after = models.JSONField(null=True, blank=True)

    class Meta:
        # The table the model had in ``policies``, kept (and its rows with it) when it moved here.
        db_table = "policies_auditentry"
        ordering = ["-time", "-id"]
        indexes = [models.Index(fields=["pool", "time"]), models.Index(fields=["action", "time"])]

    def __str__(self) -> str:
        return f"{self.time:%Y-%m-%d %H:%M:%S} {self.actor} {self.action} {self.object_id}"
