"""Every miss has a reason: each ``MissReason`` the engine can decide, produced once, and misses by
reason summing to the misses counted (``EngineStats.misses`` against ``counters["misses"]``)."""

from __future__ import annotations

import threading
import time
from concurrent.futures import TimeoutError as FutureTimeout

from relay_engine.core.config import parse_policy
from relay_engine.core.engine import PreInferRequest, RankRequest, RelayEngine
from relay_engine.core.kvcache import CacheKey
from relay_engine.core.miss_ledger import MissLedger
from relay_engine.core.outcomes import Outcome
from relay_engine.core.telemetry import MISS_REASONS, MissReason
from tests.models import SMALL, make_history

from .test_model import random_edit

SHORT = make_history(8, SMALL, seed=100)
CANDS = list(range(20))
PER_PREFIX_MIB = SMALL.kv_bytes_per_token() * 200 / 2**20  # one 200-token prefix


def engine_with(**kw) -> RelayEngine:
    policy = kw.pop("policy", {})
    return RelayEngine(SMALL, device="cpu", policy=parse_policy(policy), **kw)


def rank(engine: RelayEngine, user: str, prefix, **kw):
    return engine.rank(RankRequest(user, prefix, SHORT, CANDS, **kw))


def misses_by_reason(engine: RelayEngine) -> dict[str, int]:
    """The reasons counted (non-zero ones), checked to sum to the misses counted."""
    stats = engine.stats()
    assert set(stats.misses) == set(MISS_REASONS)
    assert sum(stats.misses.values()) == stats.counters["misses"]
    return {reason: n for reason, n in stats.misses.items() if n}


class FakeClock:
    def __init__(self) -> None:
        self.now_s = 1000.0

    def __call__(self) -> float:
        return self.now_s


def test_a_user_never_seen_misses_on_a_first_visit():
    engine = engine_with()
    result = rank(engine, "ann", make_history(200, SMALL, seed=1))
    assert (result.source, result.miss_reason) == ("miss", MissReason.FIRST_VISIT)
    assert rank(engine, "ann", make_history(200, SMALL, seed=1)).miss_reason is None  # a hit has none
    assert misses_by_reason(engine) == {MissReason.FIRST_VISIT: 1}


def test_a_user_back_with_another_prefix_misses_on_a_changed_prefix():
    engine = engine_with()
    rank(engine, "ben", make_history(200, SMALL, seed=1))
    assert rank(engine, "ben", make_history(200, SMALL, seed=2)).miss_reason == MissReason.PREFIX_CHANGED
    assert misses_by_reason(engine) == {MissReason.FIRST_VISIT: 1, MissReason.PREFIX_CHANGED: 1}


def test_an_entry_evicted_from_hbm_with_no_room_in_dram_misses_as_evicted_from_hbm():
    engine = engine_with(policy={"cache": {"hbm_budget_mb": 1.5 * PER_PREFIX_MIB, "dram_budget_mb": 0}})
    a, b = make_history(200, SMALL, seed=1), make_history(200, SMALL, seed=2)
    rank(engine, "a", a)
    rank(engine, "b", b)  # evicts a; DRAM takes nothing
    assert rank(engine, "a", a).miss_reason == MissReason.EVICTED_HBM
    assert misses_by_reason(engine) == {MissReason.FIRST_VISIT: 2, MissReason.EVICTED_HBM: 1}


def test_an_entry_evicted_from_dram_with_no_tier_under_it_misses_as_evicted_from_dram():
    room_for_one = 1.2 * PER_PREFIX_MIB
    engine = engine_with(policy={"cache": {"hbm_budget_mb": room_for_one, "dram_budget_mb": room_for_one}})
    prefixes = {user: make_history(200, SMALL, seed=i) for i, user in enumerate(["a", "b", "c"])}
    for user, prefix in prefixes.items():  # a: HBM → DRAM (b) → gone (c pushes b into DRAM)
        rank(engine, user, prefix)
    assert rank(engine, "a", prefixes["a"]).miss_reason == MissReason.EVICTED_DRAM
    assert misses_by_reason(engine) == {MissReason.FIRST_VISIT: 3, MissReason.EVICTED_DRAM: 1}


def test_an_entry_past_its_ttl_misses_as_expired():
    clock = FakeClock()
    engine = engine_with(policy={"cache": {"entry_ttl_ms": 1000, "dram_ttl_ms": 1000}}, clock=clock)
    prefix = make_history(200, SMALL, seed=1)
    rank(engine, "cat", prefix)
    clock.now_s += 2.0
    assert rank(engine, "cat", prefix).miss_reason == MissReason.EXPIRED
    assert misses_by_reason(engine) == {MissReason.FIRST_VISIT: 1, MissReason.EXPIRED: 1}


def test_a_prefix_the_trigger_refused_misses_as_not_admitted_for_that_refusal():
    engine = engine_with(policy={"trigger": {"at_risk_seq_len": 1000}})
    prefix = make_history(300, SMALL, seed=1)
    assert engine.pre_infer(PreInferRequest("dee", prefix)).reason == "not_at_risk"
    assert rank(engine, "dee", prefix).miss_reason == MissReason.NOT_ADMITTED_NOT_AT_RISK
    assert misses_by_reason(engine) == {MissReason.NOT_ADMITTED_NOT_AT_RISK: 1}


def test_an_already_cached_signal_leaves_no_reason_behind():
    engine = engine_with(policy={"trigger": {"at_risk_seq_len": 10}})
    prefix = make_history(200, SMALL, seed=1)
    assert engine.pre_infer(PreInferRequest("eve", prefix)).admitted
    assert engine.pre_infer(PreInferRequest("eve", prefix)).reason == "already_cached"
    assert len(engine.cache.ledger) == 0


def test_an_entry_cached_under_the_previous_edit_misses_as_edit_changed():
    engine = engine_with(policy={"trigger": {"at_risk_seq_len": 10}})
    prefix = make_history(200, SMALL, seed=8)
    engine.pre_infer(PreInferRequest("fay", prefix))
    assert rank(engine, "fay", prefix).source == "hbm"
    engine.apply_policy(parse_policy({"trigger": {"at_risk_seq_len": 10},
                                      "editing": random_edit(SMALL, seed=1, scope="all")}))
    assert rank(engine, "fay", prefix).miss_reason == MissReason.EDIT_CHANGED
    assert misses_by_reason(engine) == {MissReason.EDIT_CHANGED: 1}


def test_a_user_the_membership_moved_here_misses_as_rerouted_until_the_longest_ttl_passes():
    clock = FakeClock()
    engine = engine_with(policy={"cache": {"entry_ttl_ms": 1000, "dram_ttl_ms": 5000}}, clock=clock)
    engine.set_rerouted_check(lambda user_id: user_id.startswith("moved"))
    assert rank(engine, "moved-1", make_history(200, SMALL, seed=1)).miss_reason == MissReason.REROUTED
    assert rank(engine, "stayed", make_history(200, SMALL, seed=2)).miss_reason == MissReason.FIRST_VISIT
    clock.now_s += 5.5  # no entry made before the change can live any more
    assert rank(engine, "moved-2", make_history(200, SMALL, seed=3)).miss_reason == MissReason.FIRST_VISIT
    assert misses_by_reason(engine) == {MissReason.REROUTED: 1, MissReason.FIRST_VISIT: 2}


def test_a_lower_tiers_copy_that_fails_its_checksum_misses_as_unreadable(tmp_path):
    room_for_one = 1.2 * PER_PREFIX_MIB
    engine = engine_with(policy={"cache": {"hbm_budget_mb": room_for_one, "dram_budget_mb": room_for_one,
                                           "disk": {"path": str(tmp_path / "kv"), "budget_mb": 64}}})
    prefixes = {user: make_history(200, SMALL, seed=i) for i, user in enumerate(["ivy", "jon", "kim"])}
    try:
        for user, prefix in prefixes.items():  # ivy: HBM → DRAM (jon) → disk (kim)
            rank(engine, user, prefix)
        assert engine.cache.flush(timeout_s=30)
        ivy = engine.cache_key("ivy", prefixes["ivy"])
        assert engine.cache.where(ivy) is Outcome.DISK
        disk = engine.cache.tier(Outcome.DISK)
        data = bytearray(disk.path_of(ivy).read_bytes())
        data[-10] ^= 0xFF  # a flipped payload byte: the CRC no longer holds
        disk.path_of(ivy).write_bytes(bytes(data))
        assert rank(engine, "ivy", prefixes["ivy"]).miss_reason == MissReason.UNREADABLE
        assert disk.counters.corrupt_reads == 1
        assert misses_by_reason(engine) == {MissReason.FIRST_VISIT: 3, MissReason.UNREADABLE: 1}
    finally:
        engine.close()

class _HeldPrefill:
    """The model's forwards, with prefills held until released, then failing if told to."""

    def __init__(self, model, *, fail: bool = False):
        self.model = model
        self.fail = fail
        self.release = threading.Event()
        self.started = threading.Event()

    def prefill(self, prefix, edit=None, *, between_layers=None):
        self.started.set()
        assert self.release.wait(30), "never released"
        if self.fail:
            raise RuntimeError("the prefill failed")
        return self.model.prefill(prefix, edit, between_layers=between_layers)

    def __getattr__(self, name):
        return getattr(self.model, name)


def test_a_rank_that_joined_a_prefill_that_failed_misses_as_failed():
    model = engine_with().model
    forwards = _HeldPrefill(model, fail=True)
    joined = threading.Event()

    def waiter(future, timeout_s):
        joined.set()
        return future.result(timeout=timeout_s)

    engine = RelayEngine(model=model, device="cpu", policy=parse_policy({"trigger": {"at_risk_seq_len": 100}}),
                         forwards=forwards, waiter=waiter)
    prefix = make_history(300, SMALL, seed=1)
    try:
        assert engine.submit_pre_infer(PreInferRequest("gus", prefix)).admitted
        assert forwards.started.wait(10)
        results = []
        ranker = threading.Thread(target=lambda: results.append(rank(engine, "gus", prefix)))
        ranker.start()
        assert joined.wait(10), "the rank never joined the prefill"
        forwards.release.set()
        ranker.join(30)
    finally:
        forwards.release.set()
        engine.close()
    assert [(r.source, r.miss_reason) for r in results] == [("miss", MissReason.FAILED)]
    assert misses_by_reason(engine) == {MissReason.FAILED: 1}


def test_a_rank_that_gave_up_on_a_prefill_that_would_finish_too_late_misses_as_too_late():
    model = engine_with().model
    forwards = _HeldPrefill(model)

    def waiter(future, timeout_s):  # the prefill would not finish while a recompute is still on time
        raise FutureTimeout

    policy = parse_policy({"trigger": {"at_risk_seq_len": 100, "latency_model": {"base_ms": 1000.0}}})
    engine = RelayEngine(model=model, device="cpu", policy=policy, forwards=forwards, waiter=waiter)
    prefix = make_history(300, SMALL, seed=1)
    try:
        assert engine.submit_pre_infer(PreInferRequest("hal", prefix)).admitted
        assert forwards.started.wait(10)
        result = rank(engine, "hal", prefix, deadline_s=time.time() + 30)
    finally:
        forwards.release.set()
        engine.close()
    assert (result.source, result.miss_reason) == ("miss", MissReason.TOO_LATE)
    assert misses_by_reason(engine) == {MissReason.TOO_LATE: 1}


def test_concurrent_misses_are_each_counted_under_one_reason():
    engine = engine_with(policy={"cache": {"hbm_budget_mb": 2.5 * PER_PREFIX_MIB, "dram_budget_mb": 0}})
    prefixes = [make_history(200, SMALL, seed=i) for i in range(6)]

    def traffic(thread: int) -> None:
        for turn in range(6):
            user = (thread + turn) % 6
            rank(engine, f"u{user}", prefixes[user])

    threads = [threading.Thread(target=traffic, args=(t,)) for t in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    reasons = misses_by_reason(engine)
    assert engine.stats().counters["misses"] >= 6 and MissReason.EVICTED_HBM in reasons


def key(user: str, digest: str = "d") -> CacheKey:
    return CacheKey(user, digest, "m", "e")


def test_the_ledger_forgets_its_oldest_record_past_its_bound():
    ledger = MissLedger(max_keys=2)
    ledger.lost([key("a"), key("b"), key("c")], MissReason.EXPIRED)
    assert len(ledger) == 2
    never_rerouted = lambda user_id: False  # noqa: E731
    assert ledger.decide(key("a"), never_rerouted) == MissReason.FIRST_VISIT  # forgotten
    assert ledger.decide(key("c"), never_rerouted) == MissReason.EXPIRED
    assert ledger.decide(key("c"), never_rerouted) == MissReason.FIRST_VISIT  # a record explains one miss


def test_an_entry_kept_again_clears_its_old_loss():
    ledger = MissLedger()
    ledger.lost([key("a")], MissReason.EXPIRED)
    ledger.kept(key("a"))
    assert ledger.decide(key("a"), lambda user_id: True) == MissReason.FIRST_VISIT
