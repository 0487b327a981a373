"""DRAM tier under HBM in the stack: demotion on eviction, promotion on reuse, never both tiers, one
reload per key."""

from __future__ import annotations

import threading
import time

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from relay_engine.core.dram import DRAMTier
from relay_engine.core.kvcache import CacheKey, HBMCache
from relay_engine.core.model import PrefixKV
from relay_engine.core.outcomes import Outcome
from relay_engine.core.tiers import SingleFlight, TierStack


def kv_of(nbytes: int) -> PrefixKV:
    return PrefixKV(torch.arange(nbytes // 4, dtype=torch.float32), None, nbytes // 4, "v", "none")


def key(i: int) -> CacheKey:
    return CacheKey(f"user{i}", "d", "v", "none")


def tiers(hbm_budget: int, dram_budget: int) -> tuple[TierStack, DRAMTier]:
    dram = DRAMTier(torch.device("cpu"), dram_budget, ttl_s=60)
    return TierStack(HBMCache(budget_bytes=hbm_budget, ttl_s=60), [dram], torch.device("cpu")), dram


def all_at_once(n: int, call):
    """call() from n threads started together; their results once all have returned."""
    results = []
    threads = [threading.Thread(target=lambda: results.append(call())) for _ in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert len(results) == n, f"{n - len(results)} of {n} calls did not return"
    return results


def test_an_evicted_entry_is_demoted_then_promoted_back():
    stack, dram = tiers(800, 4000)
    stack.insert(key(1), kv_of(400))
    stack.lookup(key(1))
    stack.insert(key(2), kv_of(400))
    stack.insert(key(3), kv_of(400))  # evicts key 1 (consumed) to DRAM
    assert stack.where(key(1)) is Outcome.DRAM
    found = stack.lookup(key(1))
    assert found.outcome is Outcome.DRAM
    assert torch.equal(found.kv.kv, kv_of(400).kv)
    assert key(1) in stack.hbm and key(1) not in dram
    assert stack.demotions >= 1 and stack.promotions == 1 and dram.counters.hits == 1


@settings(max_examples=200, deadline=None)
@given(ops=st.lists(st.tuples(st.sampled_from(["insert", "lookup", "promote", "expire"]), st.integers(0, 5),
                              st.integers(1, 40).map(lambda n: n * 4)), max_size=60))
def test_an_entry_is_never_in_both_tiers_and_dram_stays_in_budget(ops):
    stack, dram = tiers(200, 300)
    for op, i, nbytes in ops:
        if op == "insert":
            stack.insert(key(i), kv_of(nbytes))
        elif op == "lookup":
            stack.hbm.lookup(key(i))
        elif op == "promote":
            stack.promote(key(i))
        else:
            dram.expire()
        for j in range(6):
            assert not (key(j) in stack.hbm and key(j) in dram)
        assert dram.used_bytes <= dram.budget_bytes
        assert stack.hbm.used_bytes <= stack.hbm.budget_bytes


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
    assert flight.shared_runs == 1


def test_n_threads_promoting_one_entry_reload_it_once_and_each_counts_once():
    stack, dram = tiers(10_000, 10_000)
    slow_lookups = []
    real_lookup = dram.lookup

    def slow_lookup(k):
        slow_lookups.append(1)
        time.sleep(0.2)  # a reload that takes long enough for everyone to pile up
        return real_lookup(k)

    dram.admit(key(7), kv_of(400))
    assert stack.flush(timeout_s=30)
    dram.lookup = slow_lookup
    results = all_at_once(8, lambda: stack.promote(key(7)))
    assert len(slow_lookups) == 1
    assert stack.promotions == 1
    assert all(r.found for r in results)
    outcomes = sorted(r.outcome for r in results)
    assert outcomes == [Outcome.DRAM] + [Outcome.INFLIGHT] * 7  # a joiner is a join, not a DRAM hit too
    assert stack.dedup_reloads == 1


def test_demotion_larger_than_dram_budget_is_dropped():
    stack, dram = tiers(1000, 100)
    stack.insert(key(1), kv_of(400))
    stack.insert(key(2), kv_of(800))
    assert stack.where(key(1)) is None
    assert dram.counters.rejected == 1
