"""Rate limits per user, counted in the shared cache (Redis: every process and machine counts together).

Writes (POST/PUT/PATCH/DELETE) are throttled; reads are not (dashboards poll). Uploads to the editor
have their own, lower limit. While the cache cannot be reached a request is let through and the
outage logged: a throttle must not turn a Redis outage into refused writes to the database.
"""

from __future__ import annotations

import logging

import redis
from django.conf import settings
from rest_framework.permissions import SAFE_METHODS
from rest_framework.throttling import UserRateThrottle

log = logging.getLogger(__name__)


class SharedRateThrottle(UserRateThrottle):
    """A per-user rate read from ``setting`` at each request (deployments and tests change it)."""

    setting = ""

    def get_rate(self) -> str:
        return getattr(settings, self.setting)

    def allow_request(self, request, view) -> bool:
        self.rate = self.get_rate()
        self.num_requests, self.duration = self.parse_rate(self.rate)
        try:
            return super().allow_request(request, view)
        except redis.RedisError as exc:
            log.warning("%s throttle not applied: the cache (Redis) cannot be reached: %s", self.scope, exc)
            return True


class WriteRateThrottle(SharedRateThrottle):
    scope = "write"
    setting = "RELAYGR_WRITE_THROTTLE_RATE"

    def allow_request(self, request, view) -> bool:
        return request.method in SAFE_METHODS or super().allow_request(request, view)


class UploadRateThrottle(SharedRateThrottle):
    scope = "upload"
    setting = "RELAYGR_UPLOAD_THROTTLE_RATE"
