"""The memory-aware expander: a DRAM tier under the HBM tier, and single-flight reloads.

An entry evicted from HBM for space is *demoted* here (server DRAM; pinned host memory beside an
accelerator, so the copy back is asynchronous) instead of being thrown away; a later ranking
request for it *promotes* it back. The entry leaves DRAM when it is promoted, so it is never held
in both tiers. Concurrent requests for one key share one reload (``SingleFlight``): the first
does the work, the others wait on its result.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Generic, TypeVar

import torch

from relay_engine.core.devices import host_pinning_supported
from relay_engine.core.kvcache import CacheEntry, CacheKey, HBMCache
from relay_engine.core.model import PrefixKV

T = TypeVar("T")


class SingleFlight(Generic[T]):
    """At most one computation per key at a time; later callers join the running one."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._inflight: dict[object, Future] = {}

    def running(self, key: object) -> Future | None:
        with self._lock:
            return self._inflight.get(key)

    def begin(self, key: object) -> tuple[Future, bool]:
        """(future, leader): leader=True means the caller must compute and ``finish`` it."""
        with self._lock:
            fut = self._inflight.get(key)
            if fut is not None:
                return fut, False
            fut = Future()
            fut.set_running_or_notify_cancel()
            self._inflight[key] = fut
            return fut, True

    def finish(self, key: object, result: T | None = None, error: BaseException | None = None) -> None:
        with self._lock:
            fut = self._inflight.pop(key, None)
        if fut is None:
            return
        if error is not None:
            fut.set_exception(error)
        else:
            fut.set_result(result)

    def do(self, key: object, compute: Callable[[], T], timeout_s: float | None = None) -> tuple[T, bool]:
        """Run compute once for key across concurrent callers. Returns (result, shared)."""
        fut, leader = self.begin(key)
        if not leader:
            return fut.result(timeout=timeout_s), True
        try:
            result = compute()
        except BaseException as exc:
            self.finish(key, error=exc)
            raise
        self.finish(key, result)
        return result, False

    def __len__(self) -> int:
        with self._lock:
            return len(self._inflight)


@dataclass
class DRAMCounters:
    demotions: int = 0
    promotions: int = 0
    evictions: int = 0  # dropped from DRAM for space: gone for good
    expirations: int = 0
    rejected: int = 0  # demotions larger than the whole DRAM budget
    dedup_reloads: int = 0  # requests that joined a promotion already running
    peak_bytes: int = 0


@dataclass
class _DramEntry:
    kv: PrefixKV
    nbytes: int
    stored_at: float
    last_access: float


@dataclass
class MemoryAwareExpander:
    hbm: HBMCache
    device: torch.device
    budget_bytes: int
    ttl_s: float
    clock: Callable[[], float] = time.monotonic
    counters: DRAMCounters = field(default_factory=DRAMCounters)

    def __post_init__(self) -> None:
        if self.budget_bytes < 0:
            raise ValueError(f"budget_bytes must be ≥ 0, got {self.budget_bytes}")
        self._entries: OrderedDict[CacheKey, _DramEntry] = OrderedDict()
        self._lock = threading.Lock()
        self.used_bytes = 0
        self.reloads = SingleFlight[PrefixKV]()
        self._pin = host_pinning_supported(self.device)
        self.hbm.on_evict = self.demote
        self.hbm.on_resident = self.discard

    def __contains__(self, key: CacheKey) -> bool:
        with self._lock:
            return key in self._entries

    def __len__(self) -> int:
        return len(self._entries)

    def demote(self, entry: CacheEntry) -> None:
        """Keep an entry evicted from HBM in DRAM (dropping the least recently used for space)."""
        if entry.kv is not None:
            self._store(entry.key, entry.kv, self.clock())

    def _store(self, key: CacheKey, kv: PrefixKV, stored_at: float) -> None:
        nbytes = kv.nbytes
        host_kv = kv.to(torch.device("cpu"), pin=self._pin)
        with self._lock:
            if nbytes > self.budget_bytes:
                self.counters.rejected += 1
                return
            while self.used_bytes + nbytes > self.budget_bytes and self._entries:
                _, victim = self._entries.popitem(last=False)
                self.used_bytes -= victim.nbytes
                self.counters.evictions += 1
            old = self._entries.pop(key, None)
            if old is not None:
                self.used_bytes -= old.nbytes
            self._entries[key] = _DramEntry(host_kv, nbytes, stored_at, self.clock())
            self.used_bytes += nbytes
            self.counters.demotions += 1
            self.counters.peak_bytes = max(self.counters.peak_bytes, self.used_bytes)

    def discard(self, key: CacheKey) -> None:
        """Drop DRAM's copy of a key that has become resident in HBM again."""
        with self._lock:
            entry = self._entries.pop(key, None)
            if entry is not None:
                self.used_bytes -= entry.nbytes

    def promote(self, key: CacheKey, timeout_s: float | None = None) -> tuple[PrefixKV | None, bool]:
        """Bring key's KV back to the device, once for all concurrent callers.

        Returns (kv on the device or None if DRAM does not hold it, joined) where joined means this
        caller shared a reload another request had started.
        """
        running = self.reloads.running(key)
        if running is None:
            with self._lock:
                if key not in self._entries:
                    return None, False
        kv, joined = self.reloads.do(key, lambda: self._reload(key), timeout_s)
        if joined:
            with self._lock:
                self.counters.dedup_reloads += 1
        return kv, joined

    def _reload(self, key: CacheKey) -> PrefixKV | None:
        with self._lock:
            entry = self._entries.pop(key, None)
            if entry is None:
                return None
            self.used_bytes -= entry.nbytes
        if self.clock() - entry.stored_at > self.ttl_s:
            with self._lock:
                self.counters.expirations += 1
            return None
        kv = entry.kv.to(self.device, non_blocking=self._pin)
        with self._lock:
            self.counters.promotions += 1
        # Back in HBM (consumed: this request reads it now). If HBM cannot take it, this request still
        # gets the KV; it is kept in DRAM again for the next one, never in both tiers.
        if not self.hbm.insert(key, kv, consumed=True):
            self._store(key, kv, entry.stored_at)
        return kv

    def expire(self) -> int:
        with self._lock:
            now = self.clock()
            stale = [k for k, e in self._entries.items() if now - e.stored_at > self.ttl_s]
            for k in stale:
                self.used_bytes -= self._entries.pop(k).nbytes
            self.counters.expirations += len(stale)
            return len(stale)

    def resize(self, budget_bytes: int, ttl_s: float) -> None:
        with self._lock:
            self.budget_bytes, self.ttl_s = budget_bytes, ttl_s
            while self.used_bytes > self.budget_bytes and self._entries:
                _, victim = self._entries.popitem(last=False)
                self.used_bytes -= victim.nbytes
                self.counters.evictions += 1

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()
            self.used_bytes = 0
