"""The fleet simulator: the real engine on a virtual clock. Exact, hand-checkable cases only."""

from __future__ import annotations

import random
from dataclasses import replace

import greenlet
import numpy as np
import pytest
import torch

from relay_engine.core.config import CacheBudget, LatencyModel, PolicySpec, TriggerPolicy
from relay_engine.core.lane import nice_for_share, share_of_nice
from relay_engine.core.trace import TraceQuery
from relay_engine.lab.bench.modes import MODES, Regime
from relay_engine.lab.bench.workload import Window, paired_windows, route, schedule, trace_qps, window_rng
from relay_engine.lab.costmodel import OPS, TERMS, CostModel, SpeedDrift
from relay_engine.lab.sim.des import SharedCompute, Simulation
from relay_engine.lab.sim.fleet import FleetSpec, computes
from relay_engine.lab.sim.preview import (
    MAX_BACKGROUND,
    MAX_REPLICATES,
    PROFILES_DIR,
    host_background,
    model_error_of,
    preview,
    preview_routing,
    profile_for,
    recent_share,
    replay_trace,
    replicates_for,
    run_preview,
    simulate_trace,
)
from relay_engine.lab.sim.virtual import CostForwards
from relay_engine.lab.traffic import TraceSpec, generate_trace
from tests.models import SMALL


def constant_cost(prefill_ms: float = 0.0, rank_ms: float = 0.0, full_ms: float = 0.0) -> CostModel:
    """Every operation takes a fixed time, whatever its shape."""
    coef = {op: (0.0,) * len(TERMS[op]) for op in OPS}
    coef["prefill"] = (prefill_ms, 0.0, 0.0)
    coef["rank"] = (rank_ms,) + (0.0,) * 4
    coef["rank_full"] = (full_ms,) + (0.0,) * 3
    return CostModel(coef, device="test", model={k: getattr(SMALL, k) for k in SMALL.__dataclass_fields__})


def evenly(n: int, gap_ms: float, *, user=lambda i: f"u{i}", seq_len: int = 64, delay_ms: float = 0.0):
    return [TraceQuery(i * gap_ms, user(i), seq_len, 4, 8, delay_ms) for i in range(n)]


def test_one_instance_is_the_hand_computed_fifo_queue():
    # 20 requests 5 ms apart, each taking 10 ms alone, one ranking thread: request i waits 5·i ms.
    queries = evenly(20, 5.0)
    spec = FleetSpec(None, instances=1, deadline_ms=10_000, rank_threads=1)
    point = simulate_trace(queries, spec, constant_cost(full_ms=10.0), slo_ms=100.0, warmup_share=0.0)
    expected = np.array([10.0 + 5.0 * i for i in range(20)])
    assert point.n == 20
    assert np.allclose(np.sort(point.latencies_ms), expected)
    assert point.p99_ms == pytest.approx(float(np.quantile(expected, 0.99, method="inverted_cdf")))


def test_the_replay_says_where_each_requests_time_went():
    # The same queue: request i waits 5·i ms for the thread, then its 10 ms forward has the core alone.
    queries = evenly(20, 5.0)
    spec = FleetSpec(None, instances=1, deadline_ms=10_000, rank_threads=1)
    (report,) = replay_trace(queries, spec, constant_cost(full_ms=10.0), cap=64, warmup_share=0.0)
    detail = sorted(report.detail)
    assert [q for q, *_ in detail] == list(range(20))
    assert np.allclose([queued for _, queued, *_ in detail], [5.0 * i for i in range(20)])
    assert np.allclose([work for _, _, work, *_ in detail], 10.0)
    assert np.allclose([on_compute for *_, on_compute, _ in detail], 10.0)
    assert {reason for *_, reason in detail} == {""}  # the baseline's full ranks are not misses


def test_a_requests_cpu_outside_its_forwards_and_other_processes_share_are_charged_to_its_instance():
    # One request alone: 10 ms of forwards, plus 2 ms of the process's own per request = 12 ms; on a core
    # of which other processes take half, every part takes twice as long = 24 ms.
    spec = FleetSpec(None, instances=1, deadline_ms=10_000, rank_threads=1, rank_overhead_ms=2.0)
    (report,) = replay_trace(evenly(1, 5.0), spec, constant_cost(full_ms=10.0), cap=64, warmup_share=0.0)
    [(_, ms, _, _)] = report.ranks
    [(_, queued, work, _, _)] = report.detail
    assert ms == pytest.approx(12.0) and queued == 0.0 and work == pytest.approx(10.0)  # forwards alone
    (report,) = replay_trace(evenly(1, 5.0), replace(spec, background_share=0.5), constant_cost(full_ms=10.0),
                             cap=64, warmup_share=0.0)
    assert report.ranks[0][1] == pytest.approx(24.0)


def test_shared_compute_splits_by_weight_and_gives_all_to_a_job_alone():
    sim = Simulation()
    compute = SharedCompute(sim)
    done = {}

    def job(name, work_s):
        compute.run(work_s)
        done[name] = sim.now

    sim.spawn(job, "ranking", 1.0, weight=1.0)
    sim.spawn(job, "prefill", 0.5, weight=1 / 3)  # a quarter of the device while ranking runs
    sim.run()
    # ranking at 3/4 speed ends at 4/3 s; the prefill has done 1/3 s of work, the last 1/6 s alone.
    assert done["ranking"] == pytest.approx(4 / 3)
    assert done["prefill"] == pytest.approx(1.5)


def test_interleaved_jobs_each_cost_more_the_more_share_the_core():
    # Two 1 s jobs on one core with thrash 0.5: both run at ½ ÷ 1.5 until the first ends at 3 s; alone then,
    # none of it is lost. A job alone is never slowed.
    sim = Simulation()
    compute = SharedCompute(sim, thrash=0.5)
    done = {}

    def job(name, work_s):
        compute.run(work_s)
        done[name] = sim.now

    sim.spawn(job, "a", 1.0)
    sim.spawn(job, "b", 2.0)
    sim.run()
    assert done["a"] == pytest.approx(3.0) and done["b"] == pytest.approx(4.0)
    # On a host of two cores two jobs do not interleave; a third makes each 1 + 0.5 × (3/2 − 1) slower.
    sim = Simulation()
    host = SharedCompute(sim, capacity=2.0, job_cap=1.0, thrash=0.5)
    for name in ("x", "y"):
        sim.spawn(lambda name=name: (host.run(1.0), done.__setitem__(name, sim.now)))
    sim.run()
    assert done["x"] == done["y"] == pytest.approx(1.0)
    sim = Simulation()
    host = SharedCompute(sim, capacity=2.0, job_cap=1.0, thrash=0.5)
    for name in ("x", "y", "z"):
        sim.spawn(lambda name=name: (host.run(1.0), done.__setitem__(name, sim.now)))
    sim.run()
    assert done["z"] == pytest.approx(1.5 * 1.25)  # 2/3 of a core each, 1.25× slower


def test_a_host_of_two_cores_runs_two_single_threaded_jobs_at_full_speed_and_shares_by_weight_past_that():
    sim = Simulation()
    host = SharedCompute(sim, capacity=2.0, job_cap=1.0)
    done = {}

    def job(name, work_s, weight=1.0):
        host.run(work_s, weight)
        done[name] = sim.now

    sim.spawn(job, "a", 1.0)
    sim.spawn(job, "b", 1.0)
    sim.run()
    assert done == {"a": pytest.approx(1.0), "b": pytest.approx(1.0)}  # a core each, never two for one
    done.clear()
    sim = Simulation()
    host = SharedCompute(sim, capacity=2.0, job_cap=1.0)
    for name in "abc":
        sim.spawn(job, name, 1.0)
    sim.run()
    assert all(t == pytest.approx(1.5) for t in done.values())  # three on two cores: 2/3 each
    done.clear()
    sim = Simulation()
    host = SharedCompute(sim, capacity=2.0, job_cap=1.0)
    sim.spawn(job, "heavy", 1.0, 8.0)  # capped at one core however heavy
    sim.spawn(job, "x", 1.0, 1.0)
    sim.spawn(job, "y", 1.0, 1.0)
    sim.run()
    # x and y share the other core (half each) until heavy is done at 1 s, then have a core each: done at 1.5 s
    assert done["heavy"] == pytest.approx(1.0) and done["x"] == pytest.approx(1.5) and done["y"] == pytest.approx(1.5)


def test_other_processes_of_a_host_slow_a_forward_alone_by_their_share_of_each_core():
    sim = Simulation()
    spec = FleetSpec(None, instances=2, deadline_ms=10_000, instances_per_host=2, host_cores=2.0,
                     background_share=0.2)
    a, b = computes(sim, spec)
    assert a is b  # one host
    done = {}
    sim.spawn(lambda: (a.run(1.0), done.__setitem__("alone", sim.now)))
    sim.run()
    assert done["alone"] == pytest.approx(1.25)  # 0.8 of a core
    sim = Simulation()
    host = computes(sim, replace(spec, background_share=0.0))[0]
    sim.spawn(lambda: (host.run(1.0), done.__setitem__("quiet", sim.now)))
    sim.run()
    assert done["quiet"] == pytest.approx(1.0)


def test_the_preview_models_the_hosts_other_processes_from_the_pools_wall_over_cpu_time():
    queries = generate_trace(TraceSpec(queries=300, qps=10, seed=3))
    live = PolicySpec(trigger=TriggerPolicy(at_risk_seq_len=256))
    cost = constant_cost(20.0, 4.0, 30.0)
    quiet = run_preview(queries, live, live, instances=2, cost=cost, max_requests=300, jobs=1)
    assert quiet["host_background"]["share"] == 0 and quiet["host_background"]["pool_sharing"] is None
    busy = run_preview(queries, live, live, instances=2, cost=cost, max_requests=300, jobs=1, pool_sharing=1.25)
    background = busy["host_background"]
    # The simulator's own instances explain a little of the pool's 1.25 (two of them, light load): the rest
    # is the other processes', and every forward alone runs at what they leave.
    assert 1.0 <= background["simulated_sharing"] < 1.05
    assert background["share"] == pytest.approx(1 - background["simulated_sharing"] / 1.25, abs=1e-3)
    assert "other processes took" in background["note"]
    assert busy["relay_off"]["p50_ms"] == pytest.approx(30.0 / (1 - background["share"]), rel=0.01)
    assert busy["live"]["p50_ms"] > quiet["live"]["p50_ms"]
    # A pool that says its wall time was less than the simulator's own sharing: nothing else modelled;
    # one whose wall clock is many times its CPU time: at most MAX_BACKGROUND of a core.
    assert host_background(queries, live, 2, cost, pool_sharing=1.0).share == 0.0
    assert host_background(queries, live, 2, cost, pool_sharing=20.0).share == MAX_BACKGROUND


def test_a_paced_prefill_keeps_its_share_while_its_instance_ranks_even_with_a_core_free():
    """engine.RankingGate pauses a prefill between layers while its instance ranks, whether or not a
    core is free; another instance's ranking does not pace it."""
    sim = Simulation()
    host = SharedCompute(sim, capacity=2.0, job_cap=1.0)
    done = {}

    def job(name, work_s):
        host.run(work_s)
        done[name] = sim.now

    sim.spawn(job, "rank", 1.0, group="a")
    sim.spawn(job, "prefill", 1.0, weight=1 / 3, group="a", paced=0.25)
    sim.run()
    # a quarter of a core while the rank runs (0.25 s of work by 1 s), then a whole core: 0.75 s more
    assert done == {"rank": pytest.approx(1.0), "prefill": pytest.approx(1.75)}
    done.clear()
    sim = Simulation()
    host = SharedCompute(sim, capacity=2.0, job_cap=1.0)
    sim.spawn(job, "rank", 1.0, group="b")
    sim.spawn(job, "prefill", 1.0, weight=1 / 3, group="a", paced=0.25)
    sim.run()
    assert done == {"rank": pytest.approx(1.0), "prefill": pytest.approx(1.0)}  # a core each


def test_forward_times_are_drawn_about_their_mean_with_the_stated_dispersion_and_repeat_per_seed():
    sim = Simulation()
    cost = replace(constant_cost(10.0, 4.0, 30.0), dispersion={"rank": 0.2})
    config = SMALL

    def times(seed):
        forwards = CostForwards(cost, SharedCompute(sim), config, "v", random.Random(seed))
        drawn = []
        forwards.compute = type("Clock", (), {"run": lambda self, s: drawn.append(s * 1000)})()
        kv = forwards.virtual_kv(64)
        for _ in range(4000):
            forwards.rank(kv, torch.zeros(4, dtype=torch.int64), torch.zeros(8, dtype=torch.int64))
        forwards.prefill(torch.zeros(64, dtype=torch.int64))
        return drawn

    a, b = times(1), times(1)
    assert a == b and times(2) != a  # a replay repeats; another seed draws anew
    ranks = np.array(a[:-1])
    assert ranks.mean() == pytest.approx(4.0, rel=0.02) and ranks.std() / ranks.mean() == pytest.approx(0.2, rel=0.1)
    assert a[-1] == 10.0  # no dispersion stated for prefill: exactly its mean


def test_replays_of_a_window_combine_by_median_with_the_p99_range():
    # The median and range of seeded replays do not depend on the window's size: a short one keeps it quick.
    queries = generate_trace(TraceSpec(queries=100, qps=20, seed=7))
    spec = PolicySpec(trigger=TriggerPolicy(at_risk_seq_len=256), cache=CacheBudget(hbm_budget_mb=32,
                                                                                      dram_budget_mb=64))
    cost = replace(constant_cost(20.0, 4.0, 30.0), dispersion={"prefill": 0.3, "rank": 0.3, "rank_full": 0.3})
    one = [preview(queries, spec, 2, cost, seed=s) for s in range(3)]
    three = preview(queries, spec, 2, cost, replicates=3)
    p99s = sorted(f.p99_ms for f in one)
    assert three.replicates == 3 and three.p99_ms == pytest.approx(p99s[1])
    assert three.p99_range_ms == pytest.approx((p99s[0], p99s[2])) and p99s[0] < p99s[2]
    assert three.requests == one[0].requests
    assert replicates_for(1_000, cost, 15_000) == MAX_REPLICATES and replicates_for(10_000, cost, 15_000) == 1
    assert replicates_for(1_000, constant_cost(20.0, 4.0, 30.0), 15_000) == 1  # every forward its mean: one


def test_the_simulation_loop_cannot_block_itself():
    with pytest.raises(RuntimeError):
        Simulation().block()
    assert greenlet.getcurrent()  # still the main greenlet, unharmed


def _relay_spec(**trigger) -> FleetSpec:
    policy = PolicySpec(trigger=TriggerPolicy(**{"at_risk_seq_len": 32, **trigger}),
                        cache=CacheBudget(hbm_budget_mb=64, dram_budget_mb=64))
    return FleetSpec(policy, instances=1, deadline_ms=500.0, rank_threads=1)


def test_a_pre_inferred_prefix_makes_ranking_the_cached_forward():
    # prefill 30 ms finishes inside the 50 ms gap; ranking then costs the cached 5 ms, not the full 40.
    queries = evenly(1, 0.0, delay_ms=50.0)
    point = simulate_trace(queries, _relay_spec(), constant_cost(30.0, 5.0, 40.0), slo_ms=100.0,
                           warmup_share=0.0)
    assert point.outcomes == {"hbm": 1}
    assert point.latencies_ms.tolist() == pytest.approx([5.0])


def test_a_rank_joins_a_prefill_that_finishes_in_time_and_recomputes_when_it_would_not():
    # Ranking arrives 10 ms after the signal, deadline 500 ms, a recompute predicted at 200 ms: it waits
    # up to 290 ms. A 100 ms prefill is joined (done at 100, +5 cached); a 1 s one is abandoned at
    # 310 ms (the wait began at 10) for a 40 ms recompute.
    queries = evenly(1, 0.0, delay_ms=10.0)
    spec = _relay_spec(latency_model=LatencyModel(base_ms=200.0))
    joined = simulate_trace(queries, spec, constant_cost(100.0, 5.0, 40.0), slo_ms=1000.0, warmup_share=0.0)
    late = simulate_trace(queries, spec, constant_cost(1000.0, 5.0, 40.0), slo_ms=1000.0, warmup_share=0.0)
    assert joined.outcomes == {"inflight": 1} and joined.latencies_ms.tolist() == pytest.approx([95.0])
    # the lane and the recompute share the device from then on: ranking gets 1 − the lane's share
    ranking_share = 1 - share_of_nice(nice_for_share(TriggerPolicy().preinfer_compute_share))
    assert late.outcomes == {"miss": 1}
    assert late.latencies_ms.tolist() == pytest.approx([300.0 + 40.0 / ranking_share])


def test_paired_windows_replay_the_same_ranking_requests_in_every_mode():
    queries = generate_trace(TraceSpec(queries=400, seed=5))
    windows = paired_windows(len(queries), 2, 20, 100, prime=50)
    rate = trace_qps(queries)
    for window in windows:
        ranks = {}
        for mode in MODES:
            events = schedule(queries, window, cap=512, qps=7.0, trace_rate=rate, time_scale=3.0,
                              with_preinfer=mode.preinfer)
            ranks[mode.name] = [(e.query, e.at_s, e.measured) for e in events if e.kind == "rank"]
            if mode.affinity and mode.preinfer:  # routed at the signal (others: at the ranking request)
                routed = route(events, ["a", "b"], True, window_rng(0, window), 3.0)
                ranks[mode.name + "/routes"] = sorted((e.query, n) for n, evs in routed.items()
                                                      for e in evs if e.kind == "rank")
        plain = [v for k, v in ranks.items() if "/" not in k]
        assert plain and all(r == plain[0] for r in plain)
        assert sum(1 for _, _, m in plain[0] if m) == window.measured
        routes = [v for k, v in ranks.items() if k.endswith("/routes")]
        assert len(routes) >= 2 and all(r == routes[0] for r in routes)


def test_a_preview_sends_each_captured_request_where_the_pools_router_sent_it():
    # One hot user whose load trips the bounded-load fallback of the benchmark's router: the product's
    # client never uses it, so a captured trace goes where it went, and a plain one by pure rendezvous.
    queries = [TraceQuery(i * 20.0, "hot" if i % 2 else f"u{i}", 64, 4, 8, 5.0, instance=f"main.{i % 2}")
               for i in range(400)]
    spec = replace(_relay_spec(), instances=2)
    cost = constant_cost(2.0, 1.0, 3.0)

    def served_by(routing, trace):
        reports = replay_trace(trace, replace(spec, routing=routing), cost, cap=64)
        return [{q for q, *_ in r.ranks} for r in reports]

    captured = served_by("captured", queries)
    assert captured == [{i for i in range(400) if i % 2 == 0}, {i for i in range(400) if i % 2}]
    plain = [replace(q, instance="") for q in queries]
    hot = {i for i in range(400) if i % 2}
    rendezvous = served_by("rendezvous", plain)
    assert any(hot <= served for served in rendezvous)  # the hot user on one instance, always
    assert not any(hot <= served for served in served_by("bounded", plain))  # the fallback moved some
    assert preview_routing(queries, 2)[0] == "captured"
    assert preview_routing(queries, 3) == ("rendezvous", "by rendezvous hashing of the users, as the pool's router "
                                           "does (the capture names 2 instances, the preview simulates 3)")
    assert preview_routing(plain, 2)[0] == "rendezvous"


def test_the_preview_gives_every_figure_of_a_policy_on_a_window():
    queries = generate_trace(TraceSpec(queries=300, qps=20, seed=7))
    spec = PolicySpec(trigger=TriggerPolicy(at_risk_seq_len=256), cache=CacheBudget(hbm_budget_mb=32,
                                                                                      dram_budget_mb=64))
    figures = preview(queries, spec, 2, constant_cost(20.0, 4.0, 30.0))
    assert figures.requests > 200
    assert 0 < figures.p50_ms <= figures.p99_ms
    assert 0 <= figures.within_slo_share <= 1 and 0 <= figures.hit_ratio <= 1
    assert 0 < figures.slo_throughput_qps <= 20 * 1.5
    assert 0 < figures.peak_bytes["hbm"] <= 32 * 2**20
    plain = figures.to_dict()  # one peak per tier the core can run, by its name: the API's figures
    assert plain["hbm_peak_bytes"] == figures.peak_bytes["hbm"] and plain["disk_peak_bytes"] == 0
    assert figures.preinfer_admitted > 0 and figures.preinfer_refused.get("not_at_risk", 0) > 0


def test_the_what_if_preview_replays_the_same_requests_under_both_specs():
    queries = generate_trace(TraceSpec(queries=400, qps=20, seed=3))
    live = PolicySpec(trigger=TriggerPolicy(at_risk_seq_len=256))
    stricter = PolicySpec(trigger=TriggerPolicy(at_risk_seq_len=2048))
    result = run_preview(queries, live, stricter, instances=2, cost=constant_cost(20.0, 4.0, 30.0),
                         max_requests=300, jobs=1)
    assert result["requests"] == 300 and result["requests_captured"] == 400
    assert "most recent 300 of 400" in result["sampling"]
    assert result["live"]["requests"] == result["proposed"]["requests"] > 0
    assert result["proposed"]["preinfer_admitted"] < result["live"]["preinfer_admitted"]
    # The relay off on the same requests: nothing pre-inferred or cached, every rank the full one.
    off = result["relay_off"]
    assert off["requests"] == result["live"]["requests"]
    assert off["preinfer_admitted"] == 0 and off["hbm_peak_bytes"] == 0 and not off["hit_ratio"]
    assert off["p50_ms"] == pytest.approx(30.0, rel=0.01)  # the full rank's 30 ms, alone on its instance
    assert off["p50_ms"] > result["live"]["p50_ms"]


def test_recent_share_keeps_the_latest_requests_from_time_zero():
    queries = evenly(10, 100.0)
    kept, note = recent_share(queries, 4)
    assert [q.user_id for q in kept] == ["u6", "u7", "u8", "u9"] and kept[0].t_ms == 0 and kept[-1].t_ms == 300
    assert recent_share(queries, 10) == (queries, None)
    assert "4 of 10" in note


def test_the_profile_falls_back_to_the_reference_and_says_why():
    path, note = profile_for("auto")
    assert path == PROFILES_DIR / "reference.json" and "reference profile" in note and "'auto'" in note
    path, note = profile_for("npu")
    assert path.is_file() and ("npu profile" in note or "no npu profile" in note)


def test_model_error_is_the_last_validations_largest_p99_error(tmp_path):
    missing, note = model_error_of(tmp_path / "none.json")
    assert missing is None and "not validated on this machine" in note
    (tmp_path / "v.json").write_text('{"max_abs_p99_error": 0.12, "points": [{"n": 2000}, {"n": 2400}, {}]}')
    error, note = model_error_of(tmp_path / "v.json")
    assert error == 0.12 and "3 validated points of at least 2000 requests each" in note
    (tmp_path / "bad.json").write_text("{")
    assert model_error_of(tmp_path / "bad.json")[0] is None


def test_regime_scaling_multiplies_every_time_constant():
    r = Regime(slo_ms=50, deadline_ms=100, entry_ttl_ms=1000, dram_ttl_ms=2000).scaled(4)
    assert (r.slo_ms, r.deadline_ms, r.entry_ttl_ms, r.dram_ttl_ms, r.time_scale) == (200, 400, 4000, 8000, 4)
    w = Window(0, 0, 0, 2)
    events = schedule(evenly(2, 10.0, delay_ms=5.0), w, cap=64, qps=100.0 / 4, trace_rate=100.0, time_scale=4.0,
                      with_preinfer=True)
    assert [e.kind for e in events] == ["preinfer", "rank", "preinfer", "rank"]
    assert [e.at_s for e in events] == pytest.approx([0.0, 0.02, 0.04, 0.06])


def test_with_a_drift_forward_times_come_in_runs_with_the_same_mean_and_spread():
    sim = Simulation()
    cost = replace(constant_cost(10.0, 4.0, 30.0), dispersion={"rank": 0.2}, drift=SpeedDrift(0.03, 0.5))
    forwards = CostForwards(cost, SharedCompute(sim), SMALL, "v", random.Random(4))
    independent = CostForwards(replace(cost, drift=None), SharedCompute(sim), SMALL, "v", random.Random(4))

    def factors(f, every_s):
        out = []
        for i in range(20_000):
            sim.now = i * every_s
            out.append(f._factor("rank"))
        return np.array(out)

    def lag1(x):
        return np.corrcoef(x[:-1], x[1:])[0, 1]

    close, far, alone = factors(forwards, 0.05), factors(forwards, 5.0), factors(independent, 0.05)
    for x in (close, far, alone):  # the mean and the spread the cost model states, drift or not
        assert x.mean() == pytest.approx(1.0, abs=0.01) and x.std() == pytest.approx(0.2, rel=0.08)
    # log variance 0.039 of which 0.03 slow: neighbours 50 ms apart correlate ~0.7, 5 s apart not at all.
    assert 0.6 < lag1(close) < 0.85 and abs(lag1(far)) < 0.05 and abs(lag1(alone)) < 0.05
