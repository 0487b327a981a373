"""The DRAM tier: prefix KV caches demoted from HBM into server DRAM, under their own byte budget.

An entry evicted from HBM for space is *demoted* here (server DRAM; pinned host memory beside an
accelerator, so the copy back is asynchronous) instead of being thrown away; a later ranking
request for it *promotes* it back (``tiers.TierStack`` does both). ``lookup`` takes the entry out,
so it is never held in two tiers. An entry this tier evicts for space is handed to ``on_evict``
(the stack demotes it once more, to the tier below, when there is one).

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
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from relay_engine.core.config import CacheBudget
from relay_engine.core.devices import host_memory_bytes, host_pinning_supported
from relay_engine.core.kvcache import CacheKey, LostHook, ignore_lost
from relay_engine.core.model import PrefixKV
from relay_engine.core.outcomes import Outcome, TierCounters
from relay_engine.core.telemetry import EVICTED_FROM, MissReason
from relay_engine.core.tiers import Drain, LowerTier, TierSite

log = logging.getLogger(__name__)


@dataclass
class _DramEntry:
    kv: PrefixKV  # in host memory once copied; until then the device KV, queued for the copy thread
    nbytes: int
    stored_at: float
    on_host: bool = False


@dataclass
class DRAMTier:
    device: torch.device  # the accelerator the demoted entries come from (host pinning follows it)
    budget_bytes: int
    ttl_s: float
    clock: Callable[[], float] = time.monotonic
    # Called (outside the lock) with each entry evicted for space, so the tier below can keep it.
    on_evict: Callable[[CacheKey, PrefixKV], None] | None = None
    # Told of the entries lost otherwise: expired, or their copy to the host failed.
    on_lost: LostHook = ignore_lost
    counters: TierCounters = field(default_factory=TierCounters)
    name = Outcome.DRAM

    def __post_init__(self) -> None:
        if self.budget_bytes < 0:
            raise ValueError(f"budget_bytes must be ≥ 0, got {self.budget_bytes}")
        self._entries: OrderedDict[CacheKey, _DramEntry] = OrderedDict()
        self._lock = threading.Lock()
        self.used_bytes = 0
        self._pin = host_pinning_supported(self.device)
        # demoted entries whose copy to the host is pending, and the copy thread
        self._to_copy: Drain[tuple[CacheKey, _DramEntry]] = Drain(self._lock, self._copy, "dram-demotion")

    def __contains__(self, key: CacheKey) -> bool:
        with self._lock:
            return key in self._entries

    def __len__(self) -> int:
        return len(self._entries)

    def copy_to_host(self, kv: PrefixKV) -> PrefixKV:
        """The device→host copy of a demoted entry (run by the copy thread, never by the evictor)."""
        return kv.to(torch.device("cpu"), pin=self._pin)

    def admit(self, key: CacheKey, kv: PrefixKV) -> bool:
        """Keep an entry demoted from the tier above (evicting the least recently stored for space);
        its copy to the host is queued for the copy thread. False when it is larger than the budget."""
        entry = _DramEntry(kv, kv.nbytes, self.clock())
        evicted: list[tuple[CacheKey, PrefixKV]] = []
        start_copy = False
        with self._lock:
            if entry.nbytes > self.budget_bytes:
                self.counters.rejected += 1
                return False
            old = self._entries.pop(key, None)
            if old is not None:
                self.used_bytes -= old.nbytes
            self._evict_down_to(self.budget_bytes - entry.nbytes, evicted)
            self._entries[key] = entry
            self.used_bytes += entry.nbytes
            self.counters.admissions += 1
            self.counters.peak_bytes = max(self.counters.peak_bytes, self.used_bytes)
            start_copy = self._to_copy.put((key, entry))
        if start_copy:
            self._to_copy.start()
        self._hand_off(evicted)
        return True

    def _copy(self, item: tuple[CacheKey, _DramEntry]) -> None:
        """In the copy thread: move one queued demotion to host memory."""
        key, entry = item
        with self._lock:
            if self._entries.get(key) is not entry or entry.on_host:
                return  # promoted, dropped or replaced since it was queued
        try:
            host_kv = self.copy_to_host(entry.kv)
        except Exception:  # noqa: BLE001 — e.g. pinned memory exhausted: this entry is lost, the tier lives on
            log.exception("demoting %s to DRAM failed; the entry is dropped", key.user_id)
            host_kv = None
        with self._lock:
            if self._entries.get(key) is not entry:
                return
            if host_kv is None:
                del self._entries[key]
                self.used_bytes -= entry.nbytes
                self.counters.failed_writes += 1
                self.on_lost([key], EVICTED_FROM[self.name])
            else:
                entry.kv, entry.on_host = host_kv, True

    def flush(self, timeout_s: float | None = None) -> bool:
        """Wait until every demotion so far is in host memory (or dropped); False on timeout."""
        return self._to_copy.flush(timeout_s)

    def lookup(self, key: CacheKey) -> PrefixKV | None:
        """Take key's KV out of DRAM (host memory, or the device KV if its copy has not run yet);
        None when DRAM does not hold it or it has expired."""
        with self._lock:
            entry = self._entries.pop(key, None)
            if entry is None:
                return None
            self.used_bytes -= entry.nbytes
            if self.clock() - entry.stored_at > self.ttl_s:
                self.counters.expirations += 1
                self.on_lost([key], MissReason.EXPIRED)
                return None
            self.counters.hits += 1
            return entry.kv

    def discard(self, key: CacheKey) -> None:
        """Drop DRAM's copy of a key that has become resident in a tier above."""
        with self._lock:
            entry = self._entries.pop(key, None)
            if entry is not None:
                self.used_bytes -= entry.nbytes

    def expire(self) -> int:
        with self._lock:
            now = self.clock()
            stale = [k for k, e in self._entries.items() if now - e.stored_at > self.ttl_s]
            for k in stale:
                self.used_bytes -= self._entries.pop(k).nbytes
            self.counters.expirations += len(stale)
            self.on_lost(stale, MissReason.EXPIRED)
            return len(stale)

    def resize(self, budget_bytes: int, ttl_s: float) -> None:
        evicted: list[tuple[CacheKey, PrefixKV]] = []
        with self._lock:
            self.budget_bytes, self.ttl_s = budget_bytes, ttl_s
            self._evict_down_to(budget_bytes, evicted)
        self._hand_off(evicted)

    def clear(self) -> list[CacheKey]:
        """Drop every entry; returns their keys."""
        with self._lock:
            dropped = list(self._entries)
            self._entries.clear()
            self.used_bytes = 0
            return dropped

    def close(self) -> None:
        """Nothing to stop: the copy thread exits by itself once its queue is empty."""

    def _evict_down_to(self, limit_bytes: int, evicted: list[tuple[CacheKey, PrefixKV]]) -> None:
        """Evict least recently stored entries until used_bytes ≤ limit_bytes (lock held)."""
        while self.used_bytes > limit_bytes and self._entries:
            victim_key, victim = self._entries.popitem(last=False)
            self.used_bytes -= victim.nbytes
            self.counters.evictions += 1
            evicted.append((victim_key, victim.kv))

    def _hand_off(self, evicted: list[tuple[CacheKey, PrefixKV]]) -> None:
        if self.on_evict is None:
            return
        for key, kv in evicted:
            self.on_evict(key, kv)


def _build(cache: CacheBudget, site: TierSite, current: DRAMTier | None) -> DRAMTier:
    """DRAM is always there: the one the engine runs, resized, or a new one."""
    # Not ``current or …``: an empty tier is falsy (``__len__``), and rebuilding it would reset its counters.
    tier = current if current is not None else DRAMTier(site.device, cache.dram_budget_bytes, cache.dram_ttl_ms / 1000,
                                                        clock=site.clock)
    tier.resize(cache.dram_budget_bytes, cache.dram_ttl_ms / 1000)
    return tier


def _check(cache: CacheBudget) -> tuple[str, str] | None:
    host_bytes = host_memory_bytes()
    if cache.dram_budget_bytes > host_bytes:
        return "cache.dram_budget_mb", (f"{cache.dram_budget_mb:.10g} MiB exceeds host memory, "
                                        f"{host_bytes / 2**20:.0f} MiB")
    return None


LOWER_TIER = LowerTier(Outcome.DRAM, build=_build, check=_check)
