"""The memory-aware expander: a DRAM tier under the HBM tier, and single-flight reloads.

An entry evicted from HBM for space is *demoted* here (server DRAM; pinned host memory beside an
accelerator, so the copy back is asynchronous) instead of being thrown away; a later ranking
request for it *promotes* it back. The entry leaves DRAM when it is promoted, so it is never held
in both tiers. Concurrent requests for one key share one reload (``SingleFlight``): the first
does the work, the others wait on its result.

Demotion is accounting only on the thread that evicted (often a ranking request making room for
a recompute's prefix): the entry joins the DRAM tier at once, still holding its device KV, and a
copy thread moves it to host memory afterwards, so ranking never pays for that copy. A promotion
that finds the copy not yet done takes the device KV back as it is. Until the copy runs, that
device memory is outside the HBM budget (the copy thread runs while entries wait, then exits).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Generic, TypeVar

import torch

from relay_engine.core.devices import host_pinning_supported
from relay_engine.core.kvcache import CacheEntry, CacheKey, HBMCache
from relay_engine.core.model import PrefixKV

T = TypeVar("T")
log = logging.getLogger(__name__)


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
    kv: PrefixKV  # in host memory once copied; until then the device KV, queued for the copy thread
    nbytes: int
    stored_at: float
    last_access: float
    on_host: bool = False


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
        self._to_copy: deque[tuple[CacheKey, _DramEntry]] = deque()  # demoted, copy to the host pending
        self._copying = False  # a copy thread is running
        self._copies_done = threading.Condition(self._lock)
        self.hbm.on_evict = self.demote
        self.hbm.on_resident = self.discard

    def __contains__(self, key: CacheKey) -> bool:
        with self._lock:
            return key in self._entries

    def __len__(self) -> int:
        return len(self._entries)

    def copy_to_host(self, kv: PrefixKV) -> PrefixKV:
        """The device→host copy of a demoted entry (run by the copy thread, never by the evictor)."""
        return kv.to(torch.device("cpu"), pin=self._pin)

    def demote(self, entry: CacheEntry) -> None:
        """Keep an entry evicted from HBM in DRAM (dropping the least recently used for space); its
        copy to the host is queued for the copy thread."""
        if entry.kv is not None:
            now = self.clock()
            self._store(entry.key, _DramEntry(entry.kv, entry.kv.nbytes, now, now))

    def _store(self, key: CacheKey, entry: _DramEntry) -> None:
        with self._lock:
            if entry.nbytes > self.budget_bytes:
                self.counters.rejected += 1
                return
            while self.used_bytes + entry.nbytes > self.budget_bytes and self._entries:
                _, victim = self._entries.popitem(last=False)
                self.used_bytes -= victim.nbytes
                self.counters.evictions += 1
            old = self._entries.pop(key, None)
            if old is not None:
                self.used_bytes -= old.nbytes
            entry.last_access = self.clock()
            self._entries[key] = entry
            self.used_bytes += entry.nbytes
            self.counters.demotions += 1
            self.counters.peak_bytes = max(self.counters.peak_bytes, self.used_bytes)
            if entry.on_host:
                return
            self._to_copy.append((key, entry))
            if self._copying:
                return
            self._copying = True
        threading.Thread(target=self._copy_queued, name="dram-demotion", daemon=True).start()

    def _copy_queued(self) -> None:
        """The copy thread: moves queued demotions to host memory, then exits when none is left."""
        while True:
            with self._lock:
                if not self._to_copy:
                    self._copying = False
                    self._copies_done.notify_all()
                    return
                key, entry = self._to_copy.popleft()
                if self._entries.get(key) is not entry or entry.on_host:
                    continue  # promoted, dropped or replaced since it was queued
            try:
                host_kv = self.copy_to_host(entry.kv)
            except Exception:  # noqa: BLE001 — e.g. pinned memory exhausted: this entry is lost, the tier lives on
                log.exception("demoting %s to DRAM failed; the entry is dropped", key.user_id)
                host_kv = None
            with self._lock:
                if self._entries.get(key) is not entry:
                    continue
                if host_kv is None:
                    del self._entries[key]
                    self.used_bytes -= entry.nbytes
                    self.counters.rejected += 1
                else:
                    entry.kv, entry.on_host = host_kv, True

    def flush(self, timeout_s: float | None = None) -> bool:
        """Wait until every demotion so far is in host memory (or dropped); False on timeout."""
        with self._copies_done:
            return self._copies_done.wait_for(lambda: not self._copying, timeout_s)

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
        # A demotion whose copy has not run yet still holds the device KV: it comes back without a copy.
        kv = entry.kv.to(self.device, non_blocking=self._pin) if entry.on_host else entry.kv
        with self._lock:
            self.counters.promotions += 1
        # Back in HBM (consumed: this request reads it now). If HBM cannot take it, this request still
        # gets the KV; the entry stays in DRAM as it was for the next one, never in both tiers.
        if not self.hbm.insert(key, kv, consumed=True):
            self._store(key, entry)
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
