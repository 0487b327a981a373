"""Writes are throttled per user; reads are not (dashboards poll)."""

from django.conf import settings
from rest_framework.permissions import SAFE_METHODS
from rest_framework.throttling import UserRateThrottle


class WriteRateThrottle(UserRateThrottle):
    scope = "write"

    def get_rate(self) -> str:
        # Read per request rather than at import, so deployments and tests can change it.
        return settings.RELAYGR_WRITE_THROTTLE_RATE

    def allow_request(self, request, view) -> bool:
        if request.method in SAFE_METHODS:
            return True
        self.rate = self.get_rate()
        self.num_requests, self.duration = self.parse_rate(self.rate)
        return super().allow_request(request, view)
