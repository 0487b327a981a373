"""Limit/offset pagination with both numbers bounded, so no query parameter reaches the database
as an integer it cannot hold."""

from rest_framework.pagination import LimitOffsetPagination

MAX_OFFSET = 1_000_000_000


class BoundedLimitOffsetPagination(LimitOffsetPagination):
    max_limit = 1000

    def get_offset(self, request) -> int:
        return min(super().get_offset(request), MAX_OFFSET)
