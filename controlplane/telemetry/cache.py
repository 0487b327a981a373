"""The read side's one in-process cache: decoded telemetry, least recently used, bounded in bytes.

Each gunicorn worker keeps its own. That is correct because every entry is derived from Redis
alone and brought up to date incrementally on each read (entries newer than the last one seen),
so two processes answer the same request alike; and it is cheap because what every process would
otherwise share (the pool's aggregates) is already aggregated in Redis by the writers (the pool
rollups). The budget is ``settings.TELEMETRY_CACHE_MB``; an entry reports its size as ``nbytes``
and is re-measured after each update.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable, Hashable
from typing import Protocol, TypeVar

from django.conf import settings


class Sized(Protocol):
    @property
    def nbytes(self) -> int: ...


T = TypeVar("T", bound=Sized)


class BoundedCache:
    """Entries by key, least recently used first out, while their sizes add up to more than the
    budget. ``lock`` is held by a reader across its whole read (fetch, update, compute), so entries
    are never updated by two threads at once."""

    def __init__(self, budget_bytes: Callable[[], int]):
        self._budget_bytes = budget_bytes
        self._entries: OrderedDict[Hashable, Sized] = OrderedDict()
        self.lock = threading.RLock()

    def get(self, key: Hashable, make: Callable[[], T]) -> T:
        """The entry under ``key`` (made if absent), now the most recently used."""
        with self.lock:
            entry = self._entries.get(key)
            if entry is None:
                entry = self._entries[key] = make()
            else:
                self._entries.move_to_end(key)
            return entry  # type: ignore[return-value]

    def trim(self) -> None:
        """Drop the least recently used entries until the rest fit the budget (the newest stays)."""
        with self.lock:
            budget = self._budget_bytes()
            total = sum(entry.nbytes for entry in self._entries.values())
            while total > budget and len(self._entries) > 1:
                _, dropped = self._entries.popitem(last=False)
                total -= dropped.nbytes

    @property
    def nbytes(self) -> int:
        with self.lock:
            return sum(entry.nbytes for entry in self._entries.values())

    def __len__(self) -> int:
        return len(self._entries)

    def clear(self) -> None:
        with self.lock:
            self._entries.clear()


telemetry_cache = BoundedCache(lambda: int(settings.TELEMETRY_CACHE_MB * 2**20))
