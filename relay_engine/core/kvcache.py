"""The HBM tier: prefix KV caches resident in accelerator memory under a hard byte budget.

Storage and accounting live here; which entry to evict is the ``EvictionPolicy``'s decision
(vLLM keeps its block allocator and its eviction policy apart the same way).

The top tier of the stack (``tiers.TierStack``), and the one with a producing state. Life cycle of an
entry: ``reserve`` (producing: bytes held for a pre-inference in flight) → ``commit`` (ready: the KV
is resident) → ``lookup`` (consumed: a ranking request read it; it stays resident for reuse) →
evicted (handed to ``on_evict``: the stack demotes it to the tier below) or expired (TTL).
Invariant, checked by a property test: ``ready_bytes + reserved_bytes ≤ budget_bytes`` always.
"""

from __future__ import annotations

import enum
import itertools
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Protocol

from relay_engine.core.model import PrefixKV
from relay_engine.core.outcomes import Outcome, TierCounters
from relay_engine.core.telemetry import MissReason


@dataclass(frozen=True)
class CacheKey:
    user_id: str
    prefix_digest: str
    model_version: str
    edit_hash: str


# What a tier calls with the keys it lost other than by evicting them for space (expired, unreadable, a
# copy that failed), and why: the stack's miss ledger (``miss_ledger``). A leaf: it may run under the
# tier's lock. Standalone, a tier tells no one.
LostHook = Callable[[list[CacheKey], MissReason], None]


def ignore_lost(keys: list[CacheKey], reason: MissReason) -> None:
    """The hook of a tier outside a stack: nobody asks why its keys are gone."""


class EntryState(enum.Enum):
    PRODUCING = "producing"
    READY = "ready"
    CONSUMED = "consumed"


@dataclass
class CacheEntry:
    key: CacheKey
    nbytes: int
    state: EntryState
    created_at: float
    last_access: float
    kv: PrefixKV | None = None
    hits: int = 0


class EvictionPolicy(Protocol):
    def order(self, evictable: Mapping[EntryState, Iterable[CacheEntry]]) -> Iterable[CacheEntry]:
        """Evictable entries, first victim first (the cache takes only as many as it needs, so a lazy
        order costs only the victims it yields). ``evictable`` holds the ready and the consumed entries,
        each state's least recently used first; entries still producing are never offered."""


class LRUPolicy:
    """Consumed entries before ready-but-unread ones (a ranking request is about to read those),
    least recently used first within each group: the cache keeps each group in last-use order, so the
    victims come without looking at any other entry. (Filtering one list of every entry cost a scan of
    the whole cache per reservation once it was full: under a stream of pre-inferences that are never
    read, most of the instance's interpreter time, on the ranking threads' recomputes too.)"""

    def order(self, evictable: Mapping[EntryState, Iterable[CacheEntry]]) -> Iterable[CacheEntry]:
        return itertools.chain(evictable[EntryState.CONSUMED], evictable[EntryState.READY])


@dataclass
class HBMCache:
    budget_bytes: int
    ttl_s: float
    policy: EvictionPolicy = field(default_factory=LRUPolicy)
    # Called (outside the lock) with each entry evicted for space, so the tier below can keep it.
    on_evict: Callable[[CacheKey, PrefixKV], None] | None = None
    # Told of the entries dropped past their TTL.
    on_lost: LostHook = ignore_lost
    clock: Callable[[], float] = time.monotonic
    name = Outcome.HBM

    def __post_init__(self) -> None:
        if self.budget_bytes < 0:
            raise ValueError(f"budget_bytes must be ≥ 0, got {self.budget_bytes}")
        self._entries: dict[CacheKey, CacheEntry] = {}  # every entry, producing ones in reservation order
        # The evictable entries by state, each least recently used first (what ``policy.order`` is given).
        self._evictable: dict[EntryState, OrderedDict[CacheKey, CacheEntry]] = {
            EntryState.READY: OrderedDict(), EntryState.CONSUMED: OrderedDict()}
        self._lock = threading.RLock()
        self.ready_bytes = 0
        self.reserved_bytes = 0
        self.unread_bytes = 0  # ready entries no request has read yet (part of ready_bytes)
        self.counters = TierCounters()

    # --- accounting --------------------------------------------------------------------------

    @property
    def used_bytes(self) -> int:
        return self.ready_bytes + self.reserved_bytes

    @property
    def pinned_bytes(self) -> int:
        """Bytes that eviction cannot free now: reservations and entries no request has read yet."""
        with self._lock:
            return self.reserved_bytes + self.unread_bytes

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: CacheKey) -> bool:
        with self._lock:
            entry = self._entries.get(key)
            return entry is not None and entry.state is not EntryState.PRODUCING

    def state_of(self, key: CacheKey) -> EntryState | None:
        with self._lock:
            entry = self._entries.get(key)
            return None if entry is None else entry.state

    def _note_peak(self) -> None:
        self.counters.peak_bytes = max(self.counters.peak_bytes, self.used_bytes)

    # --- life cycle --------------------------------------------------------------------------

    def reserve(self, key: CacheKey, nbytes: int) -> bool:
        """Hold nbytes for a KV being produced; evicts for space. False when it cannot fit."""
        evicted: list[CacheEntry] = []
        with self._lock:
            if key in self._entries:
                return False
            if not self._make_room(nbytes, evicted):
                self.counters.rejected += 1
                ok = False
            else:
                now = self.clock()
                self._entries[key] = CacheEntry(key, nbytes, EntryState.PRODUCING, now, now)
                self.reserved_bytes += nbytes
                self._note_peak()
                ok = True
        self._hand_off(evicted)
        return ok

    def commit(self, key: CacheKey, kv: PrefixKV) -> bool:
        """Make a reserved entry ready. The KV's real size replaces the reservation; if it is larger
        and cannot fit, the entry is dropped (False) and the budget still holds."""
        evicted: list[CacheEntry] = []
        with self._lock:
            entry = self._entries.get(key)
            if entry is None or entry.state is not EntryState.PRODUCING:
                return False
            self.reserved_bytes -= entry.nbytes
            del self._entries[key]
            if not self._make_room(kv.nbytes, evicted):
                self.counters.rejected += 1
                ok = False
            else:
                entry.nbytes, entry.kv, entry.state = kv.nbytes, kv, EntryState.READY
                entry.last_access = self.clock()
                self._entries[key] = entry
                self._evictable[EntryState.READY][key] = entry
                self.ready_bytes += kv.nbytes
                self.unread_bytes += kv.nbytes
                self.counters.admissions += 1
                self._note_peak()
                ok = True
        self._hand_off(evicted)
        return ok

    def abort(self, key: CacheKey) -> None:
        """Release a reservation whose production failed."""
        with self._lock:
            entry = self._entries.get(key)
            if entry is not None and entry.state is EntryState.PRODUCING:
                del self._entries[key]
                self.reserved_bytes -= entry.nbytes

    def admit(self, key: CacheKey, kv: PrefixKV, *, consumed: bool = False) -> bool:
        """Reserve and commit in one step (a promotion from a lower tier, or a recompute on a miss)."""
        if not self.reserve(key, kv.nbytes):
            return False
        ok = self.commit(key, kv)
        if ok and consumed:
            with self._lock:
                entry = self._entries.get(key)
                if entry is not None and entry.state is EntryState.READY:
                    self._consume(entry)
        return ok

    def lookup(self, key: CacheKey) -> PrefixKV | None:
        """The resident KV for key (marking it consumed and recently used; it stays resident), or None."""
        with self._lock:
            entry = self._entries.get(key)
            if entry is None or entry.state is EntryState.PRODUCING:
                return None
            now = self.clock()
            if now - entry.created_at > self.ttl_s:
                self._drop(entry)
                self.counters.expirations += 1
                self.on_lost([key], MissReason.EXPIRED)
                return None
            self._consume(entry)
            entry.last_access = now
            entry.hits += 1
            self.counters.hits += 1
            return entry.kv

    def expire(self) -> int:
        """Drop entries older than the TTL (not demoted: they are stale). Returns the count."""
        with self._lock:
            now = self.clock()
            stale = [e for e in self._entries.values()
                     if e.state is not EntryState.PRODUCING and now - e.created_at > self.ttl_s]
            for entry in stale:
                self._drop(entry)
            self.counters.expirations += len(stale)
            self.on_lost([e.key for e in stale], MissReason.EXPIRED)
            return len(stale)

    def resize(self, budget_bytes: int, ttl_s: float) -> None:
        """Apply a new budget: evicts (demoting) down to it; if reservations in flight alone exceed
        it, the newest are cancelled (their commit then fails and the KV serves only its waiters)."""
        evicted: list[CacheEntry] = []
        with self._lock:
            self.budget_bytes, self.ttl_s = budget_bytes, ttl_s
            producing = [e for e in self._entries.values() if e.state is EntryState.PRODUCING]
            while self.reserved_bytes > budget_bytes and producing:
                self._drop(producing.pop())
                self.counters.rejected += 1
            self._make_room(0, evicted)
        self._hand_off(evicted)

    def discard(self, key: CacheKey) -> None:
        """Drop key's ready entry, if any (reservations in flight stay)."""
        with self._lock:
            entry = self._entries.get(key)
            if entry is not None and entry.state is not EntryState.PRODUCING:
                self._drop(entry)

    def clear(self) -> list[CacheKey]:
        """Drop every ready entry (reservations in flight stay); returns their keys."""
        with self._lock:
            dropped = [e for e in self._entries.values() if e.state is not EntryState.PRODUCING]
            for entry in dropped:
                self._drop(entry)
            return [e.key for e in dropped]

    # --- internals (lock held) -----------------------------------------------------------------

    def _make_room(self, nbytes: int, evicted: list[CacheEntry]) -> bool:
        """Evict until nbytes more fit; evicts nothing when even evicting everything would not do."""
        if nbytes > self.budget_bytes:
            return False
        excess = self.used_bytes + nbytes - self.budget_bytes
        if excess <= 0:
            return True
        victims: list[CacheEntry] = []
        for victim in self.policy.order({state: group.values() for state, group in self._evictable.items()}):
            victims.append(victim)
            excess -= victim.nbytes
            if excess <= 0:
                break
        if excess > 0:
            return False
        for victim in victims:
            self._drop(victim)
            self.counters.evictions += 1
            evicted.append(victim)
        return True

    def _consume(self, entry: CacheEntry) -> None:
        """Mark a resident entry read, and its most recent use now."""
        if entry.state is EntryState.READY:
            self.unread_bytes -= entry.nbytes
            del self._evictable[EntryState.READY][entry.key]
        entry.state = EntryState.CONSUMED
        consumed = self._evictable[EntryState.CONSUMED]
        consumed[entry.key] = entry
        consumed.move_to_end(entry.key)

    def _drop(self, entry: CacheEntry) -> None:
        del self._entries[entry.key]
        if entry.state is EntryState.PRODUCING:
            self.reserved_bytes -= entry.nbytes
        else:
            del self._evictable[entry.state][entry.key]
            self.ready_bytes -= entry.nbytes
            if entry.state is EntryState.READY:
                self.unread_bytes -= entry.nbytes

    def _hand_off(self, evicted: list[CacheEntry]) -> None:
        if self.on_evict is None:
            return
        for entry in evicted:
            if entry.kv is not None:
                self.on_evict(entry.key, entry.kv)
