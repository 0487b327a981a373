"""RelayEngine: the request path (HBM, in flight, DRAM, miss), deadlines, policies, bad input."""

from __future__ import annotations

import re
import threading
import time

import pytest
import torch

from relay_engine.core.config import parse_policy
from relay_engine.core.engine import (
    CACHE_OFF,
    DeadlineExceeded,
    PolicyApplyError,
    PreInferRequest,
    RankingGate,
    RankRequest,
    RelayEngine,
)
from relay_engine.core.lane import QUANTUM_S, YieldEveryOp
from relay_engine.core.model import History, HSTUModel, ModelInputError
from relay_engine.core.outcomes import Outcome
from tests.models import SMALL, make_history

from .test_model import TOLERANCE, random_edit, relative_error

SHORT = make_history(8, SMALL, seed=100)
CANDS = list(range(20))


def engine_with(**policy) -> RelayEngine:
    return RelayEngine(SMALL, device="cpu", policy=parse_policy(policy))


def rank(engine: RelayEngine, user: str, prefix: History, **kw):
    return engine.rank(RankRequest(user, prefix, SHORT, CANDS, **kw))


def test_pre_inferred_prefix_is_an_hbm_hit_with_exact_scores():
    engine = engine_with(trigger={"at_risk_seq_len": 100})
    prefix = make_history(300, SMALL, seed=1)
    assert engine.pre_infer(PreInferRequest("alice", prefix)).admitted
    result = rank(engine, "alice", prefix)
    assert result.source == "hbm"
    full = engine.model.rank_full(prefix, SHORT, CANDS)
    assert relative_error(torch.tensor(result.scores), full) <= TOLERANCE
    assert engine.stats().counters["hbm_hits"] == 1


def test_short_prefixes_are_not_pre_inferred_and_refusals_are_counted():
    engine = engine_with(trigger={"at_risk_seq_len": 1000})
    result = engine.pre_infer(PreInferRequest("bob", make_history(300, SMALL, seed=1)))
    assert not result.admitted and result.reason == "not_at_risk"
    assert engine.stats().refusals["not_at_risk"] == 1


def test_a_miss_recomputes_and_keeps_the_prefix_for_next_time():
    engine = engine_with()
    prefix = make_history(200, SMALL, seed=2)
    assert rank(engine, "carol", prefix).source == "miss"
    assert rank(engine, "carol", prefix).source == "hbm"
    counters = engine.stats().counters
    assert counters["misses"] == 1 and counters["hbm_hits"] == 1


def test_a_changed_prefix_never_hits_the_old_cache():
    engine = engine_with()
    rank(engine, "dan", make_history(200, SMALL, seed=2))
    assert rank(engine, "dan", make_history(200, SMALL, seed=3)).source == "miss"


def test_an_evicted_prefix_comes_back_from_dram():
    per_prefix = SMALL.kv_bytes_per_token() * 200
    engine = engine_with(cache={"hbm_budget_mb": 2.5 * per_prefix / 2**20})  # room for two
    prefixes = {u: make_history(200, SMALL, seed=i) for i, u in enumerate(["u1", "u2", "u3"])}
    for user, prefix in prefixes.items():
        rank(engine, user, prefix)
    result = rank(engine, "u1", prefixes["u1"])
    assert result.source == "dram"
    full = engine.model.rank_full(prefixes["u1"], SHORT, CANDS)
    assert relative_error(torch.tensor(result.scores), full) <= TOLERANCE
    stats = engine.stats()
    assert stats.counters["demotions"] >= 1 and stats.counters["promotions"] == 1
    assert stats.hbm_peak_bytes <= stats.hbm_budget_bytes


def test_each_lower_tiers_evictions_are_counted_under_its_name_and_its_levels_are_in_the_stats():
    per_prefix = SMALL.kv_bytes_per_token() * 200
    room_for_one = 1.5 * per_prefix / 2**20
    engine = engine_with(cache={"hbm_budget_mb": room_for_one, "dram_budget_mb": room_for_one})
    for i, user in enumerate(["u1", "u2", "u3"]):  # u1 goes down to DRAM, then out of it for u2
        rank(engine, user, make_history(200, SMALL, seed=i))
    assert engine.cache.flush(timeout_s=10)
    stats = engine.stats()
    assert stats.counters["evictions"] == 2 and stats.counters[f"{Outcome.DRAM}_evictions"] == 1
    levels = stats.tier_levels()
    assert list(levels) == [Outcome.HBM, Outcome.DRAM]
    assert levels[Outcome.DRAM] == {"bytes": stats.tiers[Outcome.DRAM].bytes,
                                    "budget_bytes": int(room_for_one * 2**20)}
    assert 0 < levels[Outcome.DRAM]["bytes"] <= levels[Outcome.DRAM]["budget_bytes"]


def test_without_dram_an_evicted_prefix_is_a_miss():
    per_prefix = SMALL.kv_bytes_per_token() * 200
    engine = engine_with(cache={"hbm_budget_mb": 1.5 * per_prefix / 2**20, "dram_budget_mb": 0})
    a, b = make_history(200, SMALL, seed=1), make_history(200, SMALL, seed=2)
    rank(engine, "a", a)
    rank(engine, "b", b)
    assert rank(engine, "a", a).source == "miss"


def test_rank_joins_a_pre_inference_in_flight():
    engine = engine_with(trigger={"at_risk_seq_len": 100})
    prefix = make_history(6000, SMALL, seed=4)
    key = engine.cache_key("erin", prefix)
    worker = threading.Thread(target=engine.pre_infer, args=(PreInferRequest("erin", prefix),))
    worker.start()
    deadline = time.monotonic() + 5
    while engine.cache.producing.running(key) is None and worker.is_alive() and time.monotonic() < deadline:
        time.sleep(0.001)
    assert engine.cache.producing.running(key) is not None, "pre-inference finished before rank could join it"
    result = rank(engine, "erin", prefix)
    worker.join()
    assert result.source == "inflight"
    assert engine.stats().counters["misses"] == 0


def test_concurrent_ranks_of_one_missing_prefix_compute_it_once():
    engine = engine_with()
    prefix = make_history(3000, SMALL, seed=5)
    results = []
    threads = [threading.Thread(target=lambda: results.append(rank(engine, "frank", prefix))) for _ in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    sources = sorted(r.source for r in results)
    assert len(sources) == 6 and sources.count("miss") == 1, sources
    assert engine.stats().counters["misses"] == 1
    first = torch.tensor(results[0].scores)
    assert all(relative_error(torch.tensor(r.scores), first) <= TOLERANCE for r in results)


def test_a_rank_whose_lookup_missed_before_another_computed_the_prefix_uses_that_computation():
    """The interleaving a busy machine makes (fixed here, not left to the scheduler): B looks the
    prefix up and misses, then is descheduled while A computes it, keeps it and finishes; B must
    find A's KV, not compute it a second time."""
    engine = engine_with()
    prefix = make_history(300, SMALL, seed=5)
    real_lookup = engine.cache.hbm.lookup
    b_looked_up, a_done = threading.Event(), threading.Event()

    def get_pausing_b_after_its_first_lookup(key):
        kv = real_lookup(key)
        if threading.current_thread().name == "B" and not b_looked_up.is_set():
            b_looked_up.set()
            assert a_done.wait(60), "A did not finish"
        return kv

    engine.cache.hbm.lookup = get_pausing_b_after_its_first_lookup
    results = {}
    b = threading.Thread(target=lambda: results.update(B=rank(engine, "frank", prefix)), name="B")
    b.start()
    assert b_looked_up.wait(60), "B never looked the prefix up"
    results["A"] = rank(engine, "frank", prefix)
    a_done.set()
    b.join(60)
    assert (results["A"].source, results["B"].source) == ("miss", "hbm")
    counters = engine.stats().counters
    assert counters["misses"] == 1 and counters["hbm_hits"] == 1
    assert relative_error(torch.tensor(results["B"].scores), torch.tensor(results["A"].scores)) <= TOLERANCE


def test_a_request_past_its_deadline_fails_fast_and_the_engine_stays_usable():
    engine = engine_with()
    prefix = make_history(100, SMALL, seed=6)
    with pytest.raises(DeadlineExceeded, match="missed its deadline"):
        rank(engine, "gina", prefix, deadline_s=time.time() - 0.01)
    assert rank(engine, "gina", prefix, deadline_s=time.time() + 30).source == "miss"
    counters = engine.stats().counters
    assert counters["rank_deadline_exceeded"] == 1 and counters["rank_ok"] == 1


@pytest.mark.parametrize(("request_", "field"), [
    (lambda p: RankRequest("h", p, SHORT, []), "candidates"),
    (lambda p: RankRequest("h", p, SHORT, [SMALL.num_items]), "candidates"),
    (lambda p: RankRequest("h", History(p.items[:0], p.actions[:0]), SHORT, [1]), "prefix"),
    (lambda p: RankRequest("h", History(p.items * 0 - 1, p.actions), SHORT, [1]), "prefix.items"),
    (lambda p: RankRequest("h", p, History(SHORT.items, SHORT.actions[:2]), [1]), "short_term.actions"),
])
def test_bad_input_names_the_field_and_leaves_the_engine_usable(request_, field):
    engine = engine_with()
    prefix = make_history(50, SMALL, seed=7)
    with pytest.raises(ModelInputError) as info:
        engine.rank(request_(prefix))
    assert info.value.field == field
    assert rank(engine, "h", prefix).source == "miss"
    assert engine.stats().counters["rank_errors"] == 1


def test_publishing_an_edit_invalidates_caches_and_ranks_exactly_under_it():
    engine = engine_with(trigger={"at_risk_seq_len": 10})
    prefix = make_history(200, SMALL, seed=8)
    engine.pre_infer(PreInferRequest("ivy", prefix))
    before = rank(engine, "ivy", prefix)
    assert before.source == "hbm"
    engine.apply_policy(parse_policy({"trigger": {"at_risk_seq_len": 10},
                                      "editing": random_edit(SMALL, seed=1, scope="all")}))
    after = rank(engine, "ivy", prefix)
    assert after.source == "miss"
    assert rank(engine, "ivy", prefix).source == "hbm"
    full = engine.model.rank_full(prefix, SHORT, CANDS, edit=engine.edit)
    assert relative_error(torch.tensor(after.scores), full) <= TOLERANCE
    assert relative_error(torch.tensor(after.scores), torch.tensor(before.scores)) > 1e-4


def test_a_policy_the_device_cannot_hold_is_refused_and_the_old_one_kept():
    engine = engine_with(cache={"hbm_budget_mb": 64})
    old = engine.policy
    with pytest.raises(PolicyApplyError) as info:
        engine.apply_policy(parse_policy({"cache": {"hbm_budget_mb": 16_000_000}}))
    assert info.value.field == "cache.hbm_budget_mb"
    assert re.search(r"16000000 MiB exceeds .*, \d+ MiB$", str(info.value)), str(info.value)  # as the form says
    assert engine.policy == old and engine.stats().hbm_budget_bytes == 64 * 2**20


def test_an_edit_for_another_model_is_refused_on_apply():
    engine = engine_with()
    bad = random_edit(SMALL, seed=1, scope="all")
    bad["fingerprint"]["num_layers"] = SMALL.num_layers + 3
    with pytest.raises(PolicyApplyError) as info:
        engine.apply_policy(parse_policy({"editing": bad}))
    assert info.value.field == "editing.fingerprint"


def test_shrinking_the_budget_applies_at_once():
    engine = engine_with()
    for i in range(5):
        rank(engine, f"u{i}", make_history(200, SMALL, seed=i))
    engine.apply_policy(parse_policy({"cache": {"hbm_budget_mb": SMALL.kv_bytes_per_token() * 250 / 2**20}}))
    stats = engine.stats()
    assert stats.hbm_bytes <= stats.hbm_budget_bytes and stats.hbm_entries == 1


@pytest.mark.parametrize(("slo_ms", "within"), [(60_000.0, 3), (1e-6, 0)])
def test_stats_count_requests_within_the_slo(slo_ms, within):
    engine = engine_with(trigger={"ranking_p99_slo_ms": slo_ms})
    for _ in range(3):
        rank(engine, "k", make_history(64, SMALL, seed=1))
    stats = engine.stats()
    assert stats.rank_latency.count == 3
    assert stats.counters["rank_within_slo"] == within
    assert stats.device == "cpu"


# --- apply_policy against work in flight --------------------------------------------------------


class GatedPrefill(HSTUModel):
    """The real model, whose ``prefill`` waits at its start until the test lets it run."""

    def __init__(self, config):
        super().__init__(config)
        self.started, self.release = threading.Event(), threading.Event()

    def prefill(self, prefix, edit=None, **kwargs):
        self.started.set()
        assert self.release.wait(30), "the test never released the prefill"
        return super().prefill(prefix, edit, **kwargs)


def edited_policy(seed: int | None) -> dict:
    return {"trigger": {"at_risk_seq_len": 10},
            **({} if seed is None else {"editing": random_edit(SMALL, seed=seed, scope="all")})}


@pytest.mark.parametrize(("switches", "kept"), [
    ([1], False),  # still running when the edit changed: its entry could never be read
    ([1, None], True),  # changed and changed back: its edit is in force again when it commits
])
def test_a_pre_inference_under_a_replaced_edit_leaves_nothing_pinned(switches, kept):
    model = GatedPrefill(SMALL)
    engine = RelayEngine(device="cpu", model=model, policy=parse_policy(edited_policy(None)))
    prefix = make_history(200, SMALL, seed=9)
    worker = threading.Thread(target=engine.pre_infer, args=(PreInferRequest("jo", prefix),))
    worker.start()
    assert model.started.wait(30)
    for seed in switches:
        engine.apply_policy(parse_policy(edited_policy(seed)))
    model.release.set()
    worker.join(30)
    assert not worker.is_alive()

    counters = engine.stats().counters
    assert counters["preinfer_completed"] == 1
    assert counters["preinfer_stale_edit"] == (0 if kept else 1)
    if kept:
        assert engine.cache.pinned_bytes == engine.stats().hbm_bytes == model.prefix_nbytes(200, False)
        assert rank(engine, "jo", prefix).source == "hbm"
    else:
        assert engine.cache.pinned_bytes == engine.stats().hbm_bytes == 0 and engine.stats().hbm_entries == 0
        result = rank(engine, "jo", prefix)
        assert result.source == "miss"
        full = model.rank_full(prefix, SHORT, CANDS, edit=engine.edit)
        assert relative_error(torch.tensor(result.scores), full) <= TOLERANCE


def test_demoting_an_evicted_prefix_copies_it_off_the_ranking_thread():
    per_prefix = SMALL.kv_bytes_per_token() * 200
    engine = engine_with(cache={"hbm_budget_mb": 1.5 * per_prefix / 2**20})  # room for one
    copy_threads, copying, release = [], threading.Event(), threading.Event()
    dram = engine.cache.tier(Outcome.DRAM)
    real_copy = dram.copy_to_host

    def gated_copy(kv):
        copy_threads.append(threading.get_ident())
        copying.set()
        assert release.wait(30), "the test never released the copy"
        return real_copy(kv)

    dram.copy_to_host = gated_copy
    a, b = make_history(200, SMALL, seed=1), make_history(200, SMALL, seed=2)
    rank(engine, "a", a)
    ranking = threading.Thread(target=rank, args=(engine, "b", b))  # its prefix evicts a's
    ranking.start()
    ranking.join(30)
    assert not ranking.is_alive(), "ranking waited for the demotion's copy"
    assert copying.wait(30) and ranking.ident not in copy_threads

    # Still being copied, a's prefix is in the DRAM tier: it comes back, exact, without a copy.
    result = rank(engine, "a", a)
    assert result.source == "dram"
    assert relative_error(torch.tensor(result.scores), engine.model.rank_full(a, SHORT, CANDS)) <= TOLERANCE
    release.set()
    assert engine.cache.flush(timeout_s=30)
    key_a, key_b = engine.cache_key("a", a), engine.cache_key("b", b)
    assert engine.cache.where(key_a) is Outcome.HBM and key_a not in dram  # the late copy did not bring it back
    assert engine.cache.where(key_b) is Outcome.DRAM and key_b not in engine.cache.hbm


class _HeldPrefill:
    """The model's forwards, with prefills held until released (a prefill that is slow to finish)."""

    def __init__(self, model):
        self.model = model
        self.release = threading.Event()
        self.started = threading.Event()

    def prefill(self, prefix, edit=None, *, between_layers=None):
        self.started.set()
        self.release.wait(30)
        return self.model.prefill(prefix, edit, between_layers=between_layers)

    def __getattr__(self, name):
        return getattr(self.model, name)


def test_a_submitted_pre_inference_runs_on_the_lane_and_ranking_finds_it():
    engine = engine_with(trigger={"at_risk_seq_len": 100})
    prefix = make_history(300, SMALL, seed=11)
    decision = engine.submit_pre_infer(PreInferRequest("ivy", prefix))
    assert decision.admitted
    engine.close()  # the lane drains
    assert rank(engine, "ivy", prefix).source == "hbm"
    assert engine.stats().counters["preinfer_completed"] == 1


def test_a_rank_recomputes_instead_of_waiting_on_a_prefill_that_would_finish_too_late():
    policy = parse_policy({"trigger": {"at_risk_seq_len": 100,
                                       "latency_model": {"base_ms": 1000.0}}})  # a recompute: 1 s
    model = engine_with().model
    forwards = _HeldPrefill(model)
    engine = RelayEngine(model=model, device="cpu", policy=policy, forwards=forwards)
    prefix = make_history(300, SMALL, seed=12)
    assert engine.submit_pre_infer(PreInferRequest("jay", prefix)).admitted
    assert forwards.started.wait(10)
    try:
        result = rank(engine, "jay", prefix, deadline_s=time.time() + 2.0)  # waits ~1 s, then recomputes
        assert result.source == "miss"
        assert not forwards.release.is_set() and engine.cache.producing.running(engine.cache_key("jay", prefix))
    finally:
        forwards.release.set()
        engine.close()
    full = model.rank_full(prefix, SHORT, CANDS)
    assert relative_error(torch.tensor(result.scores), full) <= TOLERANCE
    assert engine.stats().counters["misses"] == 1 and engine.stats().counters["inflight_joins"] == 0


class _Clocks:
    """Wall and CPU clocks a test moves by hand: a layer's compute, without timing anything."""

    def __init__(self):
        self.wall_s = self.cpu_s = 0.0

    def layer(self, wall_s: float, cpu_s: float) -> None:
        self.wall_s += wall_s
        self.cpu_s += cpu_s


def _pace_in_thread(pace) -> threading.Thread:
    thread = threading.Thread(target=pace, daemon=True)
    thread.start()
    return thread


def _gate_and_clocks() -> tuple[RankingGate, _Clocks]:
    clocks = _Clocks()
    return RankingGate(clock=lambda: clocks.wall_s), clocks


def test_a_prefill_beyond_its_share_waits_between_layers_until_ranking_ends():
    gate, clocks = _gate_and_clocks()
    pace = gate.pacer(0.001, cpu=lambda: clocks.cpu_s)
    gate.enter()
    clocks.layer(wall_s=0.01, cpu_s=0.01)  # a layer at full speed while ranking runs: ~15 s owed at share 0.001
    waiting = _pace_in_thread(pace)
    waiting.join(0.5)
    assert waiting.is_alive(), "the prefill went on while ranking ran"
    gate.leave()
    waiting.join(10)
    assert not waiting.is_alive(), "the prefill still waits after ranking ended"
    assert pace.credit_s == 0.0, "ranking ended: nothing carried into the next busy period"


def test_a_prefill_within_its_share_or_alone_does_not_pause():
    gate, clocks = _gate_and_clocks()
    pace = gate.pacer(0.5, cpu=lambda: clocks.cpu_s)
    gate.enter()  # ranking runs throughout, so any pause would last until the join gives up
    try:
        clocks.layer(wall_s=0.05, cpu_s=0.01)  # it got 20 % of a core: within its 50 %
        within = _pace_in_thread(pace)
        within.join(10)
        assert not within.is_alive(), "a prefill within its share paused"
    finally:
        gate.leave()
    clocks.layer(wall_s=0.01, cpu_s=0.01)  # beyond its share, but nothing is ranking now
    alone = _pace_in_thread(pace)
    alone.join(10)
    assert not alone.is_alive(), "a prefill paused with nothing ranking"


def test_a_prefill_earns_its_share_only_inside_the_busy_period():
    gate, clocks = _gate_and_clocks()
    pace = gate.pacer(0.001, cpu=lambda: clocks.cpu_s)
    clocks.layer(wall_s=1.0, cpu_s=0.0)  # a second blocked before ranking began: 1 ms of share, were it counted
    gate.enter()
    try:
        clocks.layer(wall_s=0.0, cpu_s=0.0005)  # half of that at once, in the busy period: ~5 s owed
        waiting = _pace_in_thread(pace)
        waiting.join(0.5)
        assert waiting.is_alive(), "time before the busy period counted as the prefill's share"
    finally:
        gate.leave()
    waiting.join(10)
    assert not waiting.is_alive()


def test_under_continuous_ranking_a_prefill_resumes_by_its_share_in_whole_quanta():
    gate, clocks = _gate_and_clocks()
    pace = gate.pacer(0.5, cpu=lambda: clocks.cpu_s)
    gate.enter()  # and never leaves: only the share lets the prefill on
    try:
        clocks.layer(wall_s=0.0, cpu_s=0.002)  # 2 ms over its share: waits (0.005 + 0.002) / 0.5 = 14 ms
        resumed = _pace_in_thread(pace)
        resumed.join(10)
        assert not resumed.is_alive(), "the share never let the prefill on"
        assert pace.credit_s == QUANTUM_S
        for _ in range(4):  # a quantum's worth of operations runs without a pause
            clocks.layer(wall_s=0.0, cpu_s=QUANTUM_S / 5)
            pace()
        assert 0 <= pace.credit_s < QUANTUM_S
    finally:
        gate.leave()


def test_the_pre_inference_threads_of_one_gate_share_one_share():
    """The lane's prefill and the signal reader draw on one credit: once the prefill has spent the
    share, the reader waits too, though it has spent nothing itself."""
    gate, clocks = _gate_and_clocks()
    reader_cpu_s = [0.0]
    prefill = gate.pacer(0.001, cpu=lambda: clocks.cpu_s)
    reader = gate.pacer(0.001, cpu=lambda: reader_cpu_s[0])
    assert prefill.account is reader.account
    gate.enter()
    try:
        clocks.layer(wall_s=0.01, cpu_s=0.01)  # the prefill ran a layer at full speed: ~15 s owed
        waiting_prefill = _pace_in_thread(prefill)
        waiting_reader = _pace_in_thread(reader)
        waiting_reader.join(0.5)
        assert waiting_reader.is_alive(), "the reader went on while the prefill had spent the share for both"
    finally:
        gate.leave()
    for thread in (waiting_prefill, waiting_reader):
        thread.join(10)
        assert not thread.is_alive(), "a pre-inference thread still waits after ranking ended"
    assert gate.pacer(0.5).account is not reader.account, "a new share starts a new account"


def test_the_gate_counts_threads_not_nesting_and_a_thread_can_step_out():
    gate = RankingGate()
    with gate.running(), gate.running():  # the request, then the engine's forward: one thread ranking
        assert gate.active == 1
        other = threading.Thread(target=gate.enter)  # and never leaves
        other.start()
        other.join()
        assert gate.active == 2
        with gate.stepped_out():  # waiting for a prefix being computed: not ranking
            assert gate.active == 1
        assert gate.active == 2


def test_a_prefill_yields_before_its_next_operation_once_a_rank_starts():
    gate = RankingGate()
    steps: list[int] = []
    started, go_on = threading.Event(), threading.Event()

    def prefill():
        pace = gate.pacer(1e-6)  # on the thread it paces: it reads that thread's CPU clock
        x = torch.ones(4)
        with YieldEveryOp(pace, gate.ranking):
            x = x + 1
            steps.append(1)
            started.set()
            go_on.wait(10)
            x = x * 2  # the first operation after the rank began: waits here
            steps.append(2)
        assert torch.equal(x, torch.full((4,), 4.0))

    thread = threading.Thread(target=prefill)
    thread.start()
    assert started.wait(10)
    gate.enter()
    go_on.set()
    thread.join(0.5)
    assert thread.is_alive() and steps == [1], "the prefill ran an operation while ranking ran"
    gate.leave()
    thread.join(10)
    assert steps == [1, 2]


def _logged_twice(h: History, at: int) -> History:
    """h with its event at index ``at`` written again one second later (a log's duplicate)."""
    keep = torch.cat([torch.arange(at + 1), torch.tensor([at]), torch.arange(at + 1, len(h))])
    ts = h.timestamps[keep].clone()
    ts[at + 1] += 1
    return History(h.items[keep], h.actions[keep], ts)


@pytest.mark.parametrize("on", [True, False])
def test_with_duplicates_collapsed_a_prefix_logged_twice_hits_the_cache_of_the_prefix_once(on):
    features = {"features": {"dedup_events_within_s": 1}} if on else {}
    engine = engine_with(trigger={"at_risk_seq_len": 100}, **features)
    once = make_history(300, SMALL, seed=7, timestamps=True, t0=10_000)
    short = make_history(8, SMALL, seed=8, timestamps=True, t0=10_000_000)
    assert engine.pre_infer(PreInferRequest("bob", once)).admitted
    result = engine.rank(RankRequest("bob", _logged_twice(once, 40), _logged_twice(short, 2), CANDS))
    assert result.source == ("hbm" if on else "miss")
    if on:  # the scores of the history as it happened, not of the one with the extra events
        full = engine.model.rank_full(once, short, CANDS)
        assert relative_error(torch.tensor(result.scores), full) <= TOLERANCE


def test_without_a_cache_every_rank_is_a_full_forward_and_nothing_is_kept():
    engine = engine_with(cache={"enabled": False}, trigger={"max_preinfer_inflight": 0})
    prefix = make_history(200, SMALL, seed=2)
    first, second = rank(engine, "erin", prefix), rank(engine, "erin", prefix)
    assert (first.source, second.source) == ("miss", "miss")
    assert second.miss_reason == CACHE_OFF
    full = engine.model.rank_full(prefix, SHORT, CANDS)
    assert relative_error(torch.tensor(second.scores), full) <= TOLERANCE
    stats = engine.stats()
    assert stats.counters["misses"] == 2 and stats.counters["hbm_hits"] == 0
    assert engine.cache.hbm.used_bytes == 0


def test_turning_the_cache_off_frees_what_the_tiers_hold():
    engine = engine_with()
    prefix = make_history(200, SMALL, seed=2)
    rank(engine, "frank", prefix)
    assert engine.cache.hbm.used_bytes > 0
    engine.apply_policy(parse_policy({"cache": {"enabled": False}, "trigger": {"max_preinfer_inflight": 0}}))
    assert engine.cache.hbm.used_bytes == 0
    engine.apply_policy(parse_policy({}))
    assert rank(engine, "frank", prefix).source == "miss"
