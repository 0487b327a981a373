"""DRAM tier: demotion on eviction, promotion on reuse, never both tiers, one reload per key."""

from __future__ import annotations

import threading
import time

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from relay_engine.core.expander import MemoryAwareExpander, SingleFlight
from relay_engine.core.kvcache import CacheEntry, CacheKey, EntryState, HBMCache
from relay_engine.core.model import PrefixKV


def kv_of(nbytes: int) -> PrefixKV:
    return PrefixKV(torch.arange(nbytes // 4, dtype=torch.float32), None, nbytes // 4, "v", "none")


def key(i: int) -> CacheKey:
    return CacheKey(f"user{i}", "d", "v", "none")


def tiers(hbm_budget: int, dram_budget: int) -> tuple[HBMCache, MemoryAwareExpander]:
    hbm = HBMCache(budget_bytes=hbm_budget, ttl_s=60)
    return hbm, MemoryAwareExpander(hbm, torch.device("cpu"), dram_budget, ttl_s=60)


def test_an_evicted_entry_is_demoted_then_promoted_back():
    hbm, dram = tiers(800, 4000)
    hbm.insert(key(1), kv_of(400))
    hbm.get(key(1))
    hbm.insert(key(2), kv_of(400))
    hbm.insert(key(3), kv_of(400))  # evicts key 1 (consumed) to DRAM
    assert key(1) not in hbm and key(1) in dram
    kv, joined = dram.promote(key(1))
    assert kv is not None and not joined
    assert torch.equal(kv.kv, kv_of(400).kv)
    assert key(1) in hbm and key(1) not in dram
    assert dram.counters.demotions >= 1 and dram.counters.promotions == 1


@settings(max_examples=200, deadline=None)
@given(ops=st.lists(st.tuples(st.sampled_from(["insert", "get", "promote", "expire"]), st.integers(0, 5),
                              st.integers(1, 40).map(lambda n: n * 4)), max_size=60))
def test_an_entry_is_never_in_both_tiers_and_dram_stays_in_budget(ops):
    hbm, dram = tiers(200, 300)
    for op, i, nbytes in ops:
        if op == "insert":
            hbm.insert(key(i), kv_of(nbytes))
        elif op == "get":
            hbm.get(key(i))
        elif op == "promote":
            dram.promote(key(i))
        else:
            dram.expire()
        for j in range(6):
            assert not (key(j) in hbm and key(j) in dram)
        assert dram.used_bytes <= dram.budget_bytes
        assert hbm.used_bytes <= hbm.budget_bytes


def test_concurrent_callers_share_one_computation():
    flight: SingleFlight[int] = SingleFlight()
    calls = []
    gate = threading.Event()

    def compute() -> int:
        calls.append(1)
        gate.wait(5)
        return 42

    results = []
    threads = [threading.Thread(target=lambda: results.append(flight.do("k", compute))) for _ in range(16)]
    for t in threads:
        t.start()
    time.sleep(0.2)  # everyone is waiting on the leader
    gate.set()
    for t in threads:
        t.join(5)
    assert len(calls) == 1
    assert sorted(r for r, _ in results) == [42] * 16
    assert sum(shared for _, shared in results) == 15


def test_n_threads_promoting_one_entry_reload_it_once():
    hbm, dram = tiers(10_000, 10_000)
    slow_copies = []
    original_to = PrefixKV.to

    def slow_to(self, device, **kw):
        if device.type == "cpu" and not kw.get("pin"):
            slow_copies.append(1)
            time.sleep(0.2)  # a reload that takes long enough for everyone to pile up
        return original_to(self, device, **kw)

    now = time.monotonic()
    dram.demote(CacheEntry(key(7), 400, EntryState.CONSUMED, now, now, kv_of(400)))
    assert dram.flush(timeout_s=30)  # in host memory: a promotion copies it back
    PrefixKV.to = slow_to
    try:
        results = []
        threads = [threading.Thread(target=lambda: results.append(dram.promote(key(7)))) for _ in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(5)
    finally:
        PrefixKV.to = original_to
    assert len(slow_copies) == 1
    assert dram.counters.promotions == 1
    assert all(kv is not None for kv, _ in results)
    assert dram.counters.dedup_reloads == sum(joined for _, joined in results) == 7


def test_demotion_larger_than_dram_budget_is_dropped():
    hbm, dram = tiers(1000, 100)
    hbm.insert(key(1), kv_of(400))
    hbm.insert(key(2), kv_of(800))
    assert key(1) not in hbm and key(1) not in dram
    assert dram.counters.rejected == 1
