"""The cache tiers as one stack: the interface every tier implements, the stack that owns their order,
and the one result type that says where a prefix came from.

The stack (``TierStack``) is what the engine asks; nothing outside the core touches a tier. It owns:

* the **lookup order**: HBM → a computation in flight (a pre-inference or a recompute, joined) →
  each lower tier in turn (DRAM, then local disk when the policy names one) → a miss;
* **demotion on eviction**: an entry a tier evicts for space is handed to the tier below it (the
  bottom tier's evictions are gone for good); an entry that becomes resident in HBM leaves every
  lower tier, so it is never held twice;
* **why a key is gone** (``miss_ledger.MissLedger``): an entry dropped for space with no tier under it
  to take it, expired, unreadable or cleared is written down there, so a miss can say why;
* **single-flight promotion**: concurrent ranks of one key share one reload from a lower tier; a rank
  that joins a reload another started is served ``Outcome.INFLIGHT`` and counted once, as a join.

How each tier under HBM is built from a policy is registered by its module (``LowerTier``; the module is
named in ``lower_tiers.LOWER_TIERS``, the one registration of a tier); ``build_lower_tiers`` builds the
ones a policy asks for, so the engine names none of them.

The top tier is the HBM tier (``kvcache.HBMCache``: it alone has a producing state, for pre-inferences
in flight); every tier below implements ``CacheTier``. The shape follows vLLM v1's core: one pool owns
each tier's storage and eviction order, one manager coordinates them, and a small result type
(``Lookup``) hides the internals from the caller.
"""

from __future__ import annotations

import functools
import importlib
import logging
import threading
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Generic, Protocol, TypeVar

import torch

from relay_engine.core.config import CacheBudget
from relay_engine.core.devices import lower_thread_priority
from relay_engine.core.kvcache import CacheKey, HBMCache, LostHook
from relay_engine.core.miss_ledger import MissLedger
from relay_engine.core.model import PrefixKV
from relay_engine.core.outcomes import LOWER_TIER_MODULES, Outcome, TierCounters
from relay_engine.core.telemetry import EVICTED_FROM, MissReason

log = logging.getLogger(__name__)

T = TypeVar("T")


class CacheTier(Protocol):
    """One cache tier under HBM. ``lookup`` takes the entry out (it moves up a tier); ``admit`` keeps
    an entry demoted from the tier above; ``on_evict`` (set by the stack) receives what the tier evicts
    for space, outside the tier's lock; ``on_lost`` (set by the stack, a leaf that may run under the
    lock) what it loses otherwise, and why. Thread-safe."""

    name: Outcome  # what a prefix served from this tier counts as
    counters: TierCounters
    budget_bytes: int
    ttl_s: float
    on_evict: Callable[[CacheKey, PrefixKV], None] | None
    on_lost: LostHook

    @property
    def used_bytes(self) -> int: ...

    def __contains__(self, key: CacheKey) -> bool: ...

    def __len__(self) -> int: ...

    def lookup(self, key: CacheKey) -> PrefixKV | None: ...

    def admit(self, key: CacheKey, kv: PrefixKV) -> bool: ...

    def discard(self, key: CacheKey) -> None: ...

    def expire(self) -> int: ...

    def resize(self, budget_bytes: int, ttl_s: float) -> None: ...

    def clear(self) -> list[CacheKey]:
        """Drop every entry; returns their keys."""

    def flush(self, timeout_s: float | None = None) -> bool:
        """Wait until the demotions so far are stored (or dropped); False on timeout."""

    def close(self) -> None: ...


@dataclass(frozen=True)
class TierSite:
    """Where one engine's tiers live: what a lower tier is built from besides the policy."""

    engine_name: str  # the instance's name (a tier keeping files keeps them in a directory of its own)
    device: torch.device  # the accelerator HBM is on (demotions come from it, promotions go back to it)
    clock: Callable[[], float]


@dataclass(frozen=True)
class LowerTier:
    """How one tier under HBM comes from a policy: what its module registers, as ``LOWER_TIER`` (the
    module is named in ``lower_tiers.LOWER_TIERS``). The engine names no tier; it asks these."""

    name: Outcome
    # The tier the cache section asks for: ``current`` (this tier as the engine runs it, None if it runs
    # none) resized, or a new one; None when the policy turns the tier off.
    build: Callable[[CacheBudget, TierSite, CacheTier | None], CacheTier | None]
    # Why this host cannot apply the cache section: (field path, what is wrong), None when it can.
    check: Callable[[CacheBudget], tuple[str, str] | None]


@functools.cache
def lower_tier_kinds() -> tuple[LowerTier, ...]:
    """Every registered tier under HBM, in lookup order."""
    kinds = []
    for name, module in LOWER_TIER_MODULES.items():
        kind = importlib.import_module(module).LOWER_TIER
        if kind.name != name:
            raise TypeError(f"{module}.LOWER_TIER builds the {kind.name} tier, registered as {name}")
        kinds.append(kind)
    return tuple(kinds)


def lower_tiers_problem(cache: CacheBudget) -> tuple[str, str] | None:
    """The first reason this host cannot run the lower tiers ``cache`` asks for: (field path, message)."""
    return next((problem for kind in lower_tier_kinds() if (problem := kind.check(cache)) is not None), None)


def build_lower_tiers(cache: CacheBudget, site: TierSite, current: Sequence[CacheTier]) -> list[CacheTier]:
    """The tiers under HBM ``cache`` asks for, in lookup order: those of ``current`` it keeps resized,
    new ones built (``TierStack.set_lower`` closes the ones left out)."""
    running = {tier.name: tier for tier in current}
    built = (kind.build(cache, site, running.get(kind.name)) for kind in lower_tier_kinds())
    return [tier for tier in built if tier is not None]


class Drain(Generic[T]):
    """Work a tier does off the ranking path (DRAM's copy to the host, disk's writes): a queue under the
    tier's lock, drained by a thread that starts when work arrives and exits once the queue has stayed
    empty for ``IDLE_S``. (A thread per burst of work cost a thread start per demotion under a steady
    stream of them, each start waiting for the new thread to be scheduled on a busy machine: a seventh of
    the pre-inference signal reader's time.) ``nice`` > 0 runs that thread at a lower CPU priority than
    ranking (Linux; elsewhere ignored), so its work takes a core only when ranking leaves it idle."""

    IDLE_S = 2.0

    def __init__(self, lock: threading.Lock, handle: Callable[[T], None], name: str, *, nice: int = 0):
        self._lock = lock
        self._nice = nice
        self._handle = handle  # runs outside the lock, in the drain's thread
        self._name = name
        self._items: deque[T] = deque()
        self._running = False  # a thread is draining or waiting for more
        self._handling = False  # that thread is handling an item taken off the queue
        self._changed = threading.Condition(lock)

    def __len__(self) -> int:
        return len(self._items)

    def put(self, item: T) -> bool:
        """Queue item (the tier's lock held); True when the caller must ``start`` the thread once it has
        released the lock."""
        self._items.append(item)
        if self._running:
            self._changed.notify_all()
            return False
        self._running = True
        return True

    def start(self) -> None:
        threading.Thread(target=self._run, name=self._name, daemon=True).start()

    def _run(self) -> None:
        if self._nice:
            lower_thread_priority(self._nice, self._name)
        while True:
            with self._lock:
                self._handling = False
                while not self._items:
                    self._changed.notify_all()  # drained: ``flush`` may return
                    if not self._changed.wait(self.IDLE_S) and not self._items:
                        self._running = False
                        return
                item = self._items.popleft()
                self._handling = True
            try:
                self._handle(item)
            except Exception:  # noqa: BLE001 — one item's failure is the handler's to report; the drain lives on
                log.exception("%s: an item failed", self._name)

    def flush(self, timeout_s: float | None = None) -> bool:
        """Wait until the queue is drained and its last item handled; False on timeout."""
        with self._changed:
            return self._changed.wait_for(lambda: not self._items and not self._handling, timeout_s)


class SingleFlight(Generic[T]):
    """At most one computation per key at a time; later callers join the running one."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._inflight: dict[object, Future] = {}
        self._joined: dict[object, int] = {}
        self.shared_runs = 0  # computations that at least one later caller joined

    def running(self, key: object) -> Future | None:
        with self._lock:
            return self._inflight.get(key)

    def begin(self, key: object) -> tuple[Future, bool]:
        """(future, leader): leader=True means the caller must compute and ``finish`` it."""
        with self._lock:
            fut = self._inflight.get(key)
            if fut is not None:
                self._joined[key] = self._joined.get(key, 0) + 1
                return fut, False
            fut = Future()
            fut.set_running_or_notify_cancel()
            self._inflight[key] = fut
            return fut, True

    def finish(self, key: object, result: T | None = None, error: BaseException | None = None) -> None:
        with self._lock:
            fut = self._inflight.pop(key, None)
            if self._joined.pop(key, 0):
                self.shared_runs += 1
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


@dataclass(frozen=True)
class Lookup:
    """Where a prefix came from: its KV on the device (None on a miss) and the outcome."""

    kv: PrefixKV | None
    outcome: Outcome

    @property
    def found(self) -> bool:
        return self.kv is not None


MISS = Lookup(None, Outcome.MISS)


@dataclass(frozen=True)
class TierFigures:
    """One tier's figures at one moment: its gauges and its cumulative counters."""

    bytes: int
    budget_bytes: int
    peak_bytes: int
    entries: int
    counters: TierCounters

    def to_dict(self) -> dict[str, int]:
        """The flat form telemetry carries (``outcomes.TIER_GAUGES`` + ``outcomes.TIER_COUNTERS``)."""
        return {"bytes": self.bytes, "budget_bytes": self.budget_bytes, "peak_bytes": self.peak_bytes,
                "entries": self.entries, **{name: getattr(self.counters, name) for name in _COUNTED}}


_COUNTED = tuple(n for n in TierCounters.__dataclass_fields__ if n != "peak_bytes")

# Joins the computation in flight for a key: its KV, or None when that computation failed. The engine
# passes its own (it knows the request's deadline and how long waiting is worth it).
Join = Callable[[Future], "PrefixKV | None"]


class TierStack:
    """HBM on top, then ``lower`` tiers in lookup order. Promotions come back to ``device``."""

    def __init__(self, hbm: HBMCache, lower: Sequence[CacheTier], device: torch.device):
        self.hbm = hbm
        self.device = device
        self.producing: SingleFlight[PrefixKV] = SingleFlight()  # prefills and recomputes, by key
        self.reloads: SingleFlight[Lookup] = SingleFlight()  # promotions from a lower tier, by key
        self._lower: list[CacheTier] = []
        self.demotions = 0  # entries handed down a tier (from HBM or from a lower tier)
        self.promotions = 0  # entries brought back to HBM from a lower tier
        self._count_lock = threading.Lock()
        self.ledger = MissLedger()
        self.hbm.on_evict = self._demoter(0)
        self.hbm.on_lost = self.ledger.lost
        self.set_lower(lower)

    # --- shape ---------------------------------------------------------------------------------

    @property
    def tiers(self) -> tuple[HBMCache | CacheTier, ...]:
        """Every tier, in lookup order (HBM first)."""
        return (self.hbm, *self._lower)

    def tier(self, name: Outcome) -> HBMCache | CacheTier | None:
        return next((t for t in self.tiers if t.name == name), None)

    def set_lower(self, lower: Sequence[CacheTier]) -> None:
        """Replace the tiers under HBM (a policy that adds or removes one). A tier no longer in the
        stack is cleared and closed."""
        kept = list(lower)
        for old in self._lower:
            if all(old is not t for t in kept):
                self.ledger.lost(old.clear(), EVICTED_FROM[old.name])
                old.close()
        for depth, tier in enumerate(kept):
            tier.on_evict = self._demoter(depth + 1)
            tier.on_lost = self.ledger.lost
        self._lower = kept

    def _demoter(self, depth: int) -> Callable[[CacheKey, PrefixKV], None]:
        """The eviction hook of the tier at ``depth``: hand the entry to the next tier down, if any; an
        entry no tier under it takes is lost, evicted from the tier at ``depth``."""

        def demote(key: CacheKey, kv: PrefixKV) -> None:
            lower = self._lower  # read once: ``set_lower`` may replace it meanwhile
            if depth < len(lower):
                with self._count_lock:
                    self.demotions += 1
                if lower[depth].admit(key, kv):
                    return
            self.ledger.lost([key], EVICTED_FROM[(self.hbm, *lower)[depth].name])

        return demote

    # --- the producing life cycle (HBM) ----------------------------------------------------------

    def reserve(self, key: CacheKey, nbytes: int) -> bool:
        return self.hbm.reserve(key, nbytes)

    def commit(self, key: CacheKey, kv: PrefixKV) -> bool:
        """Make a reserved entry resident; one HBM cannot hold after all is lost, evicted from HBM."""
        return self._kept(key, self.hbm.commit(key, kv))

    def abort(self, key: CacheKey) -> None:
        self.hbm.abort(key)

    def insert(self, key: CacheKey, kv: PrefixKV, *, consumed: bool = False) -> bool:
        """Make kv resident in HBM (a recompute's prefix, or a primed one); it leaves the lower tiers.
        One HBM cannot hold is lost, evicted from HBM."""
        return self._kept(key, self.hbm.admit(key, kv, consumed=consumed))

    def _kept(self, key: CacheKey, ok: bool) -> bool:
        if ok:
            self._leave_lower(key)
            self.ledger.kept(key)
        else:
            self.ledger.lost([key], MissReason.EVICTED_HBM)
        return ok

    def _leave_lower(self, key: CacheKey) -> None:
        for tier in self._lower:
            tier.discard(key)

    # --- lookups ---------------------------------------------------------------------------------

    def holds(self, key: CacheKey) -> bool:
        """True when some tier holds key ready, or a computation of it is in flight (nothing moves)."""
        return key in self.hbm or self.producing.running(key) is not None or any(key in t for t in self._lower)

    def where(self, key: CacheKey) -> Outcome | None:
        """The tier holding key ready now, None when none does (nothing moves)."""
        return next((t.name for t in self.tiers if key in t), None)

    def lookup(self, key: CacheKey, *, join: Join | None = None, timeout_s: float | None = None) -> Lookup:
        """The prefix KV for key, in the stack's order: HBM; the computation in flight (through
        ``join``; skipped without one); a lower tier, promoted back to HBM; else ``MISS``.

        Exceptions of ``join`` propagate; so does ``concurrent.futures.TimeoutError`` when a reload
        another rank started does not finish within timeout_s."""
        kv = self.hbm.lookup(key)
        if kv is not None:
            return Lookup(kv, Outcome.HBM)
        if join is not None:
            running = self.producing.running(key)
            if running is not None:
                kv = join(running)
                if kv is not None:
                    return Lookup(kv, Outcome.INFLIGHT)
        return self.promote(key, timeout_s=timeout_s)

    def promote(self, key: CacheKey, *, timeout_s: float | None = None) -> Lookup:
        """Bring key back to HBM from the first lower tier holding it, once for all concurrent callers;
        a caller that joined a reload another started gets ``Outcome.INFLIGHT``."""
        if self.reloads.running(key) is None and not any(key in t for t in self._lower):
            return MISS
        found, joined = self.reloads.do(key, lambda: self._reload(key), timeout_s)
        if joined and found.found:
            return Lookup(found.kv, Outcome.INFLIGHT)
        return found

    def _reload(self, key: CacheKey) -> Lookup:
        for tier in self._lower:
            kv = tier.lookup(key)
            if kv is None:
                continue
            # Host memory (pinned beside an accelerator: the copy is asynchronous) back to the device; a
            # DRAM demotion whose copy has not run yet still holds the device KV and comes back as it is.
            on_device = kv if kv.device == self.device else kv.to(self.device, non_blocking=kv.kv.is_pinned())
            with self._count_lock:
                self.promotions += 1
            # Back in HBM (consumed: this request reads it now). If HBM cannot take it, this request still
            # gets the KV; the entry goes back where it was for the next one, never in two tiers.
            if not self.hbm.admit(key, on_device, consumed=True):
                tier.admit(key, kv)
            else:
                self._leave_lower(key)
            return Lookup(on_device, tier.name)
        return MISS

    # --- upkeep ----------------------------------------------------------------------------------

    def expire(self) -> int:
        return sum(t.expire() for t in self.tiers)

    def clear(self, reason: MissReason) -> None:
        """Drop every entry of every tier, each written down as lost for ``reason``."""
        for tier in self.tiers:
            self.ledger.lost(tier.clear(), reason)

    def flush(self, timeout_s: float | None = None) -> bool:
        """Wait until every demotion so far has settled in its tier (copied, written or dropped)."""
        return all(t.flush(timeout_s) for t in self._lower)

    def close(self) -> None:
        for tier in self._lower:
            tier.close()

    @property
    def min_ttl_s(self) -> float:
        return min(t.ttl_s for t in self.tiers)

    @property
    def max_ttl_s(self) -> float:
        """The longest any entry may live in some tier."""
        return max(t.ttl_s for t in self.tiers)

    @property
    def pinned_bytes(self) -> int:
        return self.hbm.pinned_bytes

    # --- figures ---------------------------------------------------------------------------------

    @property
    def dedup_reloads(self) -> int:
        """Reloads that concurrent ranks joined (one per shared reload; each joining rank is counted
        once, as ``Outcome.INFLIGHT``)."""
        return self.reloads.shared_runs

    def figures(self) -> dict[str, TierFigures]:
        """Per-tier figures by tier name, in lookup order."""
        return {str(t.name): TierFigures(t.used_bytes, t.budget_bytes, t.counters.peak_bytes, len(t),
                                         TierCounters(**vars(t.counters))) for t in self.tiers}
