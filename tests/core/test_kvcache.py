"""HBM tier: the byte budget is never exceeded, whatever the sequence of operations."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from relay_engine.core.kvcache import CacheKey, EntryState, HBMCache, LRUPolicy
from relay_engine.core.model import PrefixKV


def kv_of(nbytes: int) -> PrefixKV:
    return PrefixKV(torch.zeros(nbytes // 4), None, nbytes // 4, "v", "none")


def key(i: int) -> CacheKey:
    return CacheKey(f"user{i}", "digest", "v", "none")


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


operations = st.lists(
    st.tuples(
        st.sampled_from(["reserve", "commit", "abort", "lookup", "admit", "resize", "expire", "tick"]),
        st.integers(0, 7),  # which key
        st.integers(1, 64).map(lambda n: n * 4),  # bytes
    ),
    max_size=80,
)


@settings(max_examples=300, deadline=None)
@given(budget=st.integers(0, 256), ops=operations)
def test_budget_is_never_exceeded_and_accounting_is_exact(budget, ops):
    clock = Clock()
    evicted: list = []
    cache = HBMCache(budget_bytes=budget, ttl_s=5.0, clock=clock, on_evict=lambda k, kv: evicted.append(k))
    for op, i, nbytes in ops:
        if op == "reserve":
            cache.reserve(key(i), nbytes)
        elif op == "commit":
            cache.commit(key(i), kv_of(nbytes))
        elif op == "abort":
            cache.abort(key(i))
        elif op == "lookup":
            cache.lookup(key(i))
        elif op == "admit":
            cache.admit(key(i), kv_of(nbytes), consumed=bool(i % 2))
        elif op == "resize":
            cache.resize(nbytes, ttl_s=5.0)
        elif op == "expire":
            cache.expire()
        else:
            clock.now += 1.0
        entries = list(cache._entries.values())
        assert cache.used_bytes <= cache.budget_bytes
        assert cache.reserved_bytes == sum(e.nbytes for e in entries if e.state is EntryState.PRODUCING)
        assert cache.ready_bytes == sum(e.nbytes for e in entries if e.state is not EntryState.PRODUCING)
        assert cache.pinned_bytes == cache.reserved_bytes + sum(e.nbytes for e in entries
                                                                if e.state is EntryState.READY)
        # Eviction reads each evictable state's entries, least recently used first, and nothing else.
        for state, group in cache._evictable.items():
            members = list(group.values())
            assert all(e.state is state for e in members)
            assert members == sorted(members, key=lambda e: e.last_access)
        assert sorted(k.user_id for g in cache._evictable.values() for k in g) == \
            sorted(e.key.user_id for e in entries if e.state is not EntryState.PRODUCING)
    assert cache.counters.peak_bytes <= max(budget, *(n for op, _, n in ops if op == "resize"), 0)


def test_life_cycle_producing_ready_consumed():
    cache = HBMCache(budget_bytes=1000, ttl_s=10)
    k = key(1)
    assert cache.reserve(k, 400)
    assert cache.state_of(k) is EntryState.PRODUCING and cache.lookup(k) is None
    assert cache.commit(k, kv_of(400))
    assert cache.state_of(k) is EntryState.READY
    assert cache.lookup(k) is not None
    assert cache.state_of(k) is EntryState.CONSUMED
    assert cache.used_bytes == 400


def test_consumed_entries_are_evicted_before_unread_ones():
    evicted = []
    cache = HBMCache(budget_bytes=1000, ttl_s=10, on_evict=lambda k, kv: evicted.append(k))
    cache.admit(key(1), kv_of(400))
    cache.admit(key(2), kv_of(400))
    cache.lookup(key(2))  # consumed: the first victim although more recently used
    assert cache.admit(key(3), kv_of(400))
    assert evicted == [key(2)]


def test_nothing_is_evicted_when_the_entry_cannot_fit_anyway():
    evicted = []
    cache = HBMCache(budget_bytes=1000, ttl_s=10, on_evict=lambda k, kv: evicted.append(k))
    cache.admit(key(1), kv_of(400))
    assert cache.reserve(key(2), 500)
    assert not cache.reserve(key(3), 700)  # only 400 evictable, 700 needed beyond the 500 reserved
    assert evicted == [] and key(1) in cache


def test_entries_expire_after_their_ttl():
    clock = Clock()
    cache = HBMCache(budget_bytes=1000, ttl_s=2.0, clock=clock)
    cache.admit(key(1), kv_of(100))
    clock.now = 3.0
    assert cache.lookup(key(1)) is None
    assert cache.counters.expirations == 1 and cache.used_bytes == 0


def test_shrinking_the_budget_evicts_down_to_it():
    evicted = []
    cache = HBMCache(budget_bytes=1000, ttl_s=10, on_evict=lambda k, kv: evicted.append(k))
    for i in range(4):
        cache.admit(key(i), kv_of(200))
    cache.resize(450, ttl_s=10)
    assert cache.used_bytes <= 450 and len(evicted) == 2


def test_making_room_looks_only_at_the_victims():
    """A full cache of unread entries (a pre-inference stream nobody reads) gives up one victim per
    reservation without the policy being handed, or walking, any other entry."""
    looked = []

    def pulled(group):
        for entry in group:
            looked.append(entry.key)
            yield entry

    class Counting(LRUPolicy):
        def order(self, evictable):
            return super().order({state: pulled(group) for state, group in evictable.items()})

    cache = HBMCache(budget_bytes=4000, ttl_s=10, policy=Counting())
    for i in range(1000):
        assert cache.admit(key(i), kv_of(4))
    cache.lookup(key(500))  # one read entry: the first victim, then the oldest unread
    assert looked == []
    assert cache.reserve(key(1000), 8)
    assert looked == [key(500), key(0)]
