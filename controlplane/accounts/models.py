from __future__ import annotations

import hashlib

from django.conf import settings
from django.db import models


def token_digest(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


class ApiToken(models.Model):
    """An API key for automation. Only the sha256 of the key is stored; the key is shown once."""

    user = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="api_tokens")
    name = models.CharField(max_length=100, blank=True, default="")
    key_digest = models.CharField(max_length=64, unique=True)
    # The first characters of the key, so a person can tell tokens apart without the secret.
    key_prefix = models.CharField(max_length=12)
    read_only = models.BooleanField(default=False)
    created_at = models.DateTimeField(auto_now_add=True)
    revoked_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        ordering = ["id"]

    def __str__(self) -> str:
        return f"token {self.key_prefix}… of {self.user}"

    @property
    def is_active(self) -> bool:
        return self.revoked_at is None
