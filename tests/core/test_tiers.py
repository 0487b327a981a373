"""The tier stack: it owns the lookup order, demotion down the tiers and promotion back, and says where
every prefix came from in one result type."""

from __future__ import annotations

import tempfile
import threading
import time
from concurrent.futures import Future
from pathlib import Path

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from relay_engine.core.config import parse_policy
from relay_engine.core.disk import DiskTier
from relay_engine.core.dram import DRAMTier
from relay_engine.core.kvcache import CacheKey, HBMCache
from relay_engine.core.model import PrefixKV
from relay_engine.core.outcomes import (
    LOWER_TIER_MODULES,
    OUTCOME_COUNTERS,
    TIER_COUNTERS,
    TIER_GAUGES,
    TIERS,
    Outcome,
)
from relay_engine.core.telemetry import COUNTERS
from relay_engine.core.tiers import (
    MISS,
    Drain,
    TierSite,
    TierStack,
    build_lower_tiers,
    lower_tier_kinds,
    lower_tiers_problem,
)

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


# --- the registry: how a policy's lower tiers are built -------------------------------------------


def site(name: str = "pool.0") -> TierSite:
    return TierSite(name, CPU, lambda: 0.0)


def test_every_registered_tier_is_built_by_its_module_under_its_name():
    kinds = lower_tier_kinds()
    assert [kind.name for kind in kinds] == list(LOWER_TIER_MODULES) == list(TIERS[1:])
    assert TIERS[0] is Outcome.HBM and len(kinds) >= 2


def test_the_default_policy_builds_dram_alone():
    built = build_lower_tiers(parse_policy({}).cache, site(), ())
    assert [tier.name for tier in built] == [Outcome.DRAM]
    assert built[0].budget_bytes == parse_policy({}).cache.dram_budget_bytes


def test_a_policy_naming_a_disk_directory_builds_disk_under_dram_in_a_directory_of_the_instance(tmp_path):
    cache = parse_policy({"cache": {"disk": {"path": str(tmp_path), "budget_mb": 2, "ttl_ms": 5000}}}).cache
    dram, disk = build_lower_tiers(cache, site("pool/0"), ())
    assert (dram.name, disk.name) == (Outcome.DRAM, Outcome.DISK)
    assert disk.directory == tmp_path / "pool_0" and disk.budget_bytes == 2 * 2**20 and disk.ttl_s == 5.0
    disk.close()


def test_tiers_the_engine_runs_are_kept_and_resized_not_rebuilt(tmp_path):
    first = parse_policy({"cache": {"disk": {"path": str(tmp_path), "budget_mb": 2}}}).cache
    running = build_lower_tiers(first, site(), ())
    smaller = parse_policy({"cache": {"dram_budget_mb": 1, "dram_ttl_ms": 700,
                                      "disk": {"path": str(tmp_path), "budget_mb": 1}}}).cache
    again = build_lower_tiers(smaller, site(), running)
    assert all(new is old for new, old in zip(again, running, strict=True))
    assert again[0].budget_bytes == 2**20 and again[0].ttl_s == 0.7 and again[1].budget_bytes == 2**20
    running[1].close()


def test_a_disk_directory_this_host_cannot_write_is_named_by_field(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    cache = parse_policy({"cache": {"disk": {"path": str(blocker / "kv")}}}).cache
    field_path, message = lower_tiers_problem(cache)
    assert field_path == "cache.disk.path" and "cannot create" in message
    assert lower_tiers_problem(parse_policy({}).cache) is None


def test_a_drain_serves_a_stream_of_work_on_one_thread_and_outlives_a_failed_item(monkeypatch):
    """Work arriving while the drain's thread waits goes to that thread (no thread started per item);
    ``flush`` returns once the last item is handled; an item that raises is logged and the next served;
    once idle for ``IDLE_S`` the thread exits and the next item starts another."""
    monkeypatch.setattr(Drain, "IDLE_S", 0.3)
    lock = threading.Lock()
    handled: list[tuple[int, int]] = []

    def handle(item: int) -> None:
        if item == 2:
            raise RuntimeError("a copy failed")
        handled.append((item, threading.get_ident()))

    drain: Drain[int] = Drain(lock, handle, "test-drain")
    starts = 0
    for item in range(5):
        with lock:
            start = drain.put(item)
        if start:
            starts += 1
            drain.start()
        assert drain.flush(timeout_s=10)
    assert starts == 1
    assert [item for item, _ in handled] == [0, 1, 3, 4] and len({ident for _, ident in handled}) == 1
    deadline = time.monotonic() + 10
    while drain._running and time.monotonic() < deadline:
        time.sleep(0.05)
    with lock:
        assert drain.put(5), "an idle drain's thread has exited: the next item starts one"
    drain.start()
    assert drain.flush(timeout_s=10) and handled[-1][0] == 5
