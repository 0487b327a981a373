"""Rate limits per user, counted in the shared cache (Redis: every process and machine counts together).

Writes (POST/PUT/PATCH/DELETE) are throttled; reads are not (dashboards poll). Uploads to the editor
have their own, lower limit. While the cache cannot be reached a request is let through and the
outage logged: a throttle must not turn a Redis outage into refused writes to the database.

The count is an increment, never a read-modify-write: DRF's own throttle reads a user's history,
appends and writes it back, so parallel requests overwrote each other's entries and 200 racing
writes all passed a limit of 120. Here each attempt increments the count of the current window of
the rate's period (``cache.add`` then ``cache.incr``: Redis's INCR, atomic across processes), so N
racing attempts receive the counts 1…N and exactly those within the limit pass. The previous
window's count is weighted by the share of it that still lies within one period of now (a sliding
window estimated from two fixed ones), so a burst at a window's end does not get the limit twice.
An attempt counts when it reaches the throttle, before its body is read: a write refused as invalid
counts as much as one that succeeded. An attempt the throttle refuses gives its count back.
"""

from __future__ import annotations

import logging

import redis
from django.conf import settings
from rest_framework.permissions import SAFE_METHODS
from rest_framework.throttling import UserRateThrottle

from .cache import CacheValueError, stored_count

log = logging.getLogger(__name__)


class SharedRateThrottle(UserRateThrottle):
    """A per-user rate read from ``setting`` at each request (deployments and tests change it).
    ``timer`` (DRF's, the wall clock) is the clock the windows are cut from."""

    setting = ""

    def get_rate(self) -> str:
        return getattr(settings, self.setting)

    def allow_request(self, request, view) -> bool:
        self.rate = self.get_rate()
        self.num_requests, self.duration = self.parse_rate(self.rate)
        key = self.get_cache_key(request, view)
        if key is None:
            return True
        window, self.into_window_s = divmod(self.timer(), self.duration)
        current_key = f"{key}:{int(window)}"
        try:
            count = self._count(current_key)
            self.previous = self._previous_count(f"{key}:{int(window) - 1}")
        except (redis.RedisError, ValueError) as exc:  # ValueError: the count vanished between add and incr
            log.warning("%s throttle not applied: the cache (Redis) cannot be reached: %s", self.scope, exc)
            return True
        if self._within_limit(count, self.into_window_s):
            return True
        self.current = count - 1  # the others' attempts: this one is given back
        try:
            self.cache.decr(current_key)
        except (redis.RedisError, ValueError) as exc:
            log.warning("%s throttle: a refused attempt stays counted, the cache failed: %s", self.scope, exc)
        return False

    def _within_limit(self, count: int, into_window_s: float) -> bool:
        # previous × (share of the previous window within one period of now) + count ≤ limit, multiplied
        # out by the period so that whole numbers compare exactly.
        period_s = self.duration
        return self.previous * (period_s - into_window_s) + count * period_s <= self.num_requests * period_s

    def wait(self) -> float | None:
        """Seconds until an attempt would pass (Retry-After), after ``allow_request`` refused one."""
        limit, period_s = self.num_requests, self.duration
        if limit <= 0:
            return None  # nothing ever passes
        if self.current + 1 <= limit:
            # Room in this window once the previous one's share has shrunk enough.
            passes_at_s = period_s - (limit - self.current - 1) * period_s / self.previous
            return max(0.0, passes_at_s - self.into_window_s)
        # Into the next window, where this window's count is the previous one's.
        passes_at_s = period_s - (limit - 1) * period_s / self.current
        return period_s - self.into_window_s + passes_at_s

    def _count(self, key: str) -> int:
        """This attempt's place in the window's count (the count after incrementing it)."""
        # The count lives on through the next window, where it is the previous window's.
        timeout_s = 2 * self.duration + 1
        self.cache.add(key, 0, timeout_s)
        try:
            count = self.cache.incr(key)
        except redis.ResponseError as exc:  # what is stored there is not an integer
            count = exc
        if type(count) is not int or count < 1:
            log.warning("%s throttle: the count at %s is not a count (%s); counting afresh", self.scope, key, count)
            self.cache.set(key, 1, timeout_s)
            return 1
        return count

    def _previous_count(self, key: str) -> int:
        try:
            value = self.cache.get(key, 0)
        except CacheValueError as exc:
            value = exc
        count = stored_count(value)
        if count is None:
            log.warning("%s throttle: the count at %s is not a count (%s); taken as 0", self.scope, key,
                        str(value)[:80])
            return 0
        return count


class WriteRateThrottle(SharedRateThrottle):
    scope = "write"
    setting = "RELAYGR_WRITE_THROTTLE_RATE"

    def allow_request(self, request, view) -> bool:
        return request.method in SAFE_METHODS or super().allow_request(request, view)


class UploadRateThrottle(SharedRateThrottle):
    scope = "upload"
    setting = "RELAYGR_UPLOAD_THROTTLE_RATE"
