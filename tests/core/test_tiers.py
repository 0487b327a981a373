"""The tier stack: it owns the lookup order, demotion down the tiers and promotion back, and says where
every prefix came from in one result type."""

from __future__ import annotations

import tempfile
from concurrent.futures import Future
from pathlib import Path

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from relay_engine.core.disk import DiskTier
from relay_engine.core.dram import DRAMTier
from relay_engine.core.kvcache import CacheKey, HBMCache
from relay_engine.core.model import PrefixKV
from relay_engine.core.outcomes import OUTCOME_COUNTERS, TIER_COUNTERS, TIER_GAUGES, Outcome
from relay_engine.core.telemetry import COUNTERS
from relay_engine.core.tiers import MISS, TierStack

CPU = torch.device("cpu")


def kv_of(nbytes: int, fill: float = 0.0) -> PrefixKV:
    return PrefixKV(torch.full((nbytes // 4,), float(fill)), None, nbytes // 4, "v", "none")


def key(i: int) -> CacheKey:
    return CacheKey(f"user{i}", "d", "v", "none")


def three_tiers(tmp_path, per_tier: int = 400) -> TierStack:
    """HBM, DRAM and disk, each with room for one 400-byte entry (disk files carry a header)."""
    return TierStack(HBMCache(per_tier, 60), [DRAMTier(CPU, per_tier, 60), DiskTier(tmp_path / "disk", 10 * per_tier, 60)],
                     CPU)


def test_every_outcome_has_one_counter_and_telemetry_carries_it():
    assert set(OUTCOME_COUNTERS) == set(Outcome)
    assert set(OUTCOME_COUNTERS.values()) <= set(COUNTERS)
    assert len(set(OUTCOME_COUNTERS.values())) == len(Outcome)


def test_an_empty_stack_is_a_miss():
    stack = TierStack(HBMCache(1000, 60), [DRAMTier(CPU, 1000, 60)], CPU)
    assert stack.lookup(key(1)) == MISS and stack.where(key(1)) is None


def test_evictions_cascade_down_the_tiers_and_lookups_come_back_from_each(tmp_path):
    stack = three_tiers(tmp_path)
    for i in (1, 2, 3):
        stack.insert(key(i), kv_of(400, fill=i), consumed=True)
    assert stack.flush(timeout_s=30)
    assert [stack.where(key(i)) for i in (1, 2, 3)] == [Outcome.DISK, Outcome.DRAM, Outcome.HBM]
    assert stack.demotions == 3  # 2 → DRAM, then 1 → DRAM → disk

    found = stack.lookup(key(1))
    assert found.outcome is Outcome.DISK and torch.equal(found.kv.kv, kv_of(400, fill=1).kv)
    assert stack.where(key(1)) is Outcome.HBM  # promoted, and only there
    assert sum(key(1) in t for t in stack.tiers) == 1
    assert stack.lookup(key(1)).outcome is Outcome.HBM


def test_a_computation_in_flight_is_joined_before_the_lower_tiers_are_asked(tmp_path):
    stack = three_tiers(tmp_path)
    stack.insert(key(1), kv_of(400))
    stack.insert(key(2), kv_of(400))  # key 1 → DRAM
    running, _ = stack.producing.begin(key(1))
    joined = []

    def join(future: Future) -> PrefixKV:
        joined.append(future)
        return kv_of(400, fill=9)

    found = stack.lookup(key(1), join=join)
    assert joined == [running] and found.outcome is Outcome.INFLIGHT
    assert stack.where(key(1)) is Outcome.DRAM  # DRAM was not asked


def test_a_failed_join_falls_through_to_the_lower_tiers(tmp_path):
    stack = three_tiers(tmp_path)
    stack.insert(key(1), kv_of(400))
    stack.insert(key(2), kv_of(400))
    stack.producing.begin(key(1))
    assert stack.lookup(key(1), join=lambda f: None).outcome is Outcome.DRAM


def test_a_promotion_hbm_cannot_take_is_served_and_goes_back_where_it_was():
    stack = TierStack(HBMCache(400, 60), [DRAMTier(CPU, 1000, 60)], CPU)
    stack.insert(key(1), kv_of(400), consumed=True)
    stack.insert(key(2), kv_of(400), consumed=True)  # key 1 → DRAM
    assert stack.reserve(key(3), 400)  # HBM is full of a reservation: nothing to evict
    found = stack.lookup(key(1))
    assert found.outcome is Outcome.DRAM and found.kv is not None
    assert stack.where(key(1)) is Outcome.DRAM


def test_committing_a_key_removes_it_from_every_lower_tier(tmp_path):
    stack = three_tiers(tmp_path)
    for i in (1, 2, 3):
        stack.insert(key(i), kv_of(400), consumed=True)
    assert stack.flush(timeout_s=30)
    assert stack.reserve(key(1), 400) and stack.commit(key(1), kv_of(400))
    assert stack.where(key(1)) is Outcome.HBM and sum(key(1) in t for t in stack.tiers) == 1


def test_figures_are_the_same_names_for_every_tier(tmp_path):
    stack = three_tiers(tmp_path)
    stack.insert(key(1), kv_of(400))
    figures = stack.figures()
    assert list(figures) == ["hbm", "dram", "disk"]
    for name, tier in figures.items():
        assert set(tier.to_dict()) == set(TIER_GAUGES) | set(TIER_COUNTERS), name
    assert figures["hbm"].bytes == 400 and figures["hbm"].budget_bytes == 400
    assert figures["disk"].budget_bytes == 4000


def test_removing_a_lower_tier_clears_and_closes_it(tmp_path):
    stack = three_tiers(tmp_path)
    for i in (1, 2, 3):
        stack.insert(key(i), kv_of(400), consumed=True)
    assert stack.flush(timeout_s=30) and any((tmp_path / "disk").iterdir())
    stack.set_lower(stack.tiers[1:2])
    assert [t.name for t in stack.tiers] == [Outcome.HBM, Outcome.DRAM]
    assert not (tmp_path / "disk").exists() and stack.where(key(1)) is None


@settings(max_examples=40, deadline=None)
@given(ops=st.lists(st.tuples(st.sampled_from(["insert", "lookup", "hbm_lookup", "expire", "resize"]),
                              st.integers(0, 5), st.integers(1, 4).map(lambda n: n * 100)), max_size=30))
def test_across_three_tiers_an_entry_is_in_at_most_one_and_every_tier_keeps_its_budget(ops):
    with tempfile.TemporaryDirectory() as directory:
        dram, disk = DRAMTier(CPU, 600, 60), DiskTier(Path(directory), 4000, 60)
        stack = TierStack(HBMCache(500, 60), [dram, disk], CPU)
        for op, i, n in ops:
            if op == "insert":
                stack.insert(key(i), kv_of(n, fill=i), consumed=True)
            elif op == "lookup":
                found = stack.lookup(key(i))
                assert found.kv is None or torch.equal(found.kv.kv, kv_of(found.kv.kv.numel() * 4, fill=i).kv)
            elif op == "hbm_lookup":
                stack.hbm.lookup(key(i))
            elif op == "expire":
                stack.expire()
            else:
                dram.resize(n * 2, 60)
            assert stack.flush(timeout_s=30)
            for j in range(6):
                assert sum(key(j) in t for t in stack.tiers) <= 1, (j, [t.name for t in stack.tiers if key(j) in t])
            for tier in stack.tiers:
                assert tier.used_bytes <= tier.budget_bytes, tier.name
        stack.close()
