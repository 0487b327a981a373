"""The benchmark's statistics and windows: crossings, intervals, verdicts, paired windows, priming."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from relay_engine.core.config import parse_policy
from relay_engine.core.engine import RelayEngine
from relay_engine.core.forward_times import ForwardTimes
from relay_engine.core.model import PrefixKV
from relay_engine.core.outcomes import Outcome
from relay_engine.lab.bench.stats import (
    PointResult,
    bootstrap_quantiles,
    cpu_parts,
    crossing,
    interval,
    time_parts,
)
from relay_engine.lab.bench.warmup import prime
from relay_engine.lab.bench.workload import InstanceReport, paired_windows
from tests.models import SMALL, make_history


def point(latencies, slo_ms=100.0) -> PointResult:
    return PointResult("m", 512, 10.0, 1.0, slo_ms, np.asarray(latencies, dtype=float), {}, 0, 0, {}, {}, {})


def test_the_crossing_is_interpolated_between_the_last_pass_and_the_first_failure():
    c = crossing([1, 2, 4, 8], [50, 80, 120, 300], 100.0)
    assert c.bound == "exact"
    assert c.value == pytest.approx(2 * 2 ** ((100 - 80) / (120 - 80)))  # halfway in log2 between 2 and 4


@pytest.mark.parametrize(("p99s", "bound", "value"), [([10, 20, 30], "above", 4.0), ([150, 200, 300], "below", 1.0)])
def test_a_sweep_that_never_crosses_says_which_side_it_is_on(p99s, bound, value):
    c = crossing([1, 2, 4], p99s, 100.0)
    assert (c.bound, c.value) == (bound, value)


def test_a_point_passes_on_its_p99_estimate_alone():
    within = point([10.0] * 990 + [100.0] * 10)  # P99 exactly at the SLO
    over = point([10.0] * 980 + [150.0] * 20)  # 2 % over: P99 over it
    assert within.passed and not over.passed
    assert within.n == 1000 and within.within_slo_share == 1.0


def test_the_bootstrap_interval_brackets_the_p99():
    rng = np.random.default_rng(0)
    values = rng.exponential(20.0, 5000)
    reps = bootstrap_quantiles(values, 0.99, 400, rng)
    lo, hi = interval(reps)
    estimate = np.quantile(values, 0.99)
    assert lo < estimate < hi and hi - lo < estimate / 2


def test_paired_windows_are_spread_over_the_trace_after_the_primed_part():
    windows = paired_windows(10_000, 3, warmup=100, measured=1000, prime=2000)
    assert len(windows) == 3
    assert all(w.measured == 1000 and w.first_measured - w.start == 100 and w.primed == 2000 for w in windows)
    assert windows[0].start == 2000 and windows[-1].end == 10_000
    assert all(a.end <= b.first_measured for a, b in zip(windows, windows[1:], strict=False))


def test_a_window_longer_than_the_trace_is_refused():
    with pytest.raises(ValueError, match="needs 1100 queries"):
        paired_windows(1000, 1, 100, 1000)


def test_priming_leaves_the_tiers_as_serving_the_queries_would():
    per_prefix = SMALL.kv_bytes_per_token() * 100
    engine = RelayEngine(SMALL, device="cpu", policy=parse_policy(
        {"cache": {"hbm_budget_mb": 2.5 * per_prefix / 2**20, "dram_budget_mb": 10 * per_prefix / 2**20}}))
    prefixes = {u: make_history(100, SMALL, seed=i) for i, u in enumerate("abcd")}
    order = ["a", "b", "a", "c", "d", "a"]

    def zeros(prefix) -> PrefixKV:
        c = SMALL
        return PrefixKV(torch.zeros(c.num_layers, 2, c.num_heads, len(prefix), c.head_dim), None, len(prefix),
                        engine.model.version, "none")

    inserted = prime(engine, ((u, prefixes[u]) for u in order), zeros)
    assert inserted == 4  # a repeat is a hit or a promotion, never a second insert
    keys = {u: engine.cache_key(u, p) for u, p in prefixes.items()}
    where = {u: engine.cache.where(k) for u, k in keys.items()}
    assert where["a"] is where["d"] is Outcome.HBM  # the most recent stay in HBM
    assert sorted(where.values()) == ["dram", "dram", "hbm", "hbm"]  # the others were demoted, none lost
    stats = engine.stats()
    assert stats.hbm_bytes <= stats.hbm_budget_bytes


def test_throughput_only_sweeps_give_an_ablation_its_ratio_against_the_mode_it_is_measured_against():
    from relay_engine.lab.bench.modes import MODES_BY_NAME, Regime
    from relay_engine.lab.bench.run import measure_sweeps, throughput_against
    from relay_engine.lab.bench.settings import BenchSettings

    knees = {"baseline": 6.0, "relay": 12.0, "relay_small_dram": 9.0, "relay_disk": 13.5}  # where P99 passes the SLO
    rng = np.random.default_rng(1)

    def measure(mode, cap, qps):
        p = point(rng.normal(60.0 * qps / knees[mode.name], 2.0, 500))
        p.mode, p.cap, p.qps = mode.name, cap, qps
        p.bootstrap(200, rng)
        return p

    modes = [MODES_BY_NAME[n] for n in ("relay_small_dram", "relay_disk")]  # no baseline or relay needed
    s = BenchSettings(headline_cap=1024, seq_len_sweeps=False, ref_qps=10.0, load_steps=(0.5, 1.0, 1.5, 2.0))
    sweeps, headline = measure_sweeps(s, measure, None, Regime(slo_ms=100.0, deadline_ms=200.0), modes)

    assert headline == 1024 and set(sweeps) == {"relay_small_dram", "relay_disk"}
    assert all(set(by_name) == {"qps@1024"} for by_name in sweeps.values())  # no max-seq-len sweeps
    vs = throughput_against(sweeps, MODES_BY_NAME["relay_disk"], headline)
    assert vs["mode"] == "relay_small_dram" and vs["ratio"] == pytest.approx(13.5 / 9.0, rel=0.1)
    assert vs["ci"][0] <= vs["ratio"] <= vs["ci"][1]
    assert throughput_against(sweeps, MODES_BY_NAME["relay"], headline) is None  # measured against nothing


def test_replicates_that_never_cross_make_an_interval_end_a_bound_never_a_zero():
    from relay_engine.lab.bench.stats import Replicates, ratio_interval

    rng = np.random.default_rng(2)
    den = Replicates(rng.normal(10.0, 0.5, 400), np.zeros(400, dtype=np.int8))
    values, censored = rng.normal(20.0, 1.0, 400), np.zeros(400, dtype=np.int8)
    values[:40], censored[:40] = 4.0, -1  # 10 % of the relay's replicates never passed: crossing below cap 4
    found = ratio_interval(Replicates(values, censored), den)
    assert found["ends"] == ["at most", "exact"]
    assert found["ci"][0] > 0  # the bound, not 0
    exact = ratio_interval(Replicates(rng.normal(20.0, 1.0, 400), np.zeros(400, dtype=np.int8)), den)
    assert exact["ends"] == ["exact", "exact"] and exact["ci"][0] < 2.0 < exact["ci"][1]


def test_the_compute_bound_divides_a_full_rank_by_a_cached_rank_plus_the_computed_share_of_prefills():
    from relay_engine.core.trace import TraceQuery
    from relay_engine.lab.bench.bound import compute_bound
    from relay_engine.lab.bench.workload import Window

    class Linear:  # costs linear in the prefix length, so the means are easy to check by hand
        def rank_full_ms(self, n, s, c):
            return 1.0 + n / 100

        def rank_ms(self, n, s, c):
            return 1.0

        def prefill_ms(self, n):
            return n / 100

    queries = [TraceQuery(t_ms=i, user_id=f"u{i}", seq_len=n, short_len=32, n_candidates=128, rank_delay_ms=20)
               for i, n in enumerate([100, 300, 500, 5000])]
    windows = [Window(prime_start=0, start=0, first_measured=0, end=4)]
    relay_point = {"outcomes": {"hbm": 6, "miss": 2, "deadline": 2}, "preinfer": {"admitted": 2}}
    b = compute_bound(Linear(), queries, windows, 1000, relay_point, measured_ratio=1.5)
    # capped lengths 100, 300, 500, 1000: full 1 + 4.75, cached 1, prefill 4.75; (2 + 2) of 8 ranked computed
    assert b["prefill_share"] == 0.5 and b["full_ms"] == 5.75 and b["prefill_ms"] == 4.75
    assert b["bound"] == pytest.approx(5.75 / (1.0 + 0.5 * 4.75), abs=1e-3)
    assert b["efficiency"] == pytest.approx(1.5 / b["bound"], abs=1e-3)
    assert compute_bound(Linear(), queries, windows, 1000, None, 1.5) is None


def test_time_parts_say_where_the_ranked_requests_time_went_overall_and_in_the_tail():
    # 100 requests: 97 take 10 ms (2 queued, 7 forwards, 1 the rest); 3 take 200 ms, 150 of them waiting.
    report = InstanceReport()
    for q in range(100):
        ms, queued, work = (200.0, 0.0, 50.0) if q in (40, 41, 42) else (10.0, 2.0, 7.0)
        report.ranks.append((q, ms, "hbm", True))
        report.detail.append((q, queued, work, work, ""))
    report.ranks.append((100, 500.0, "deadline", True))  # failed: not ranked, not in the parts
    report.detail.append((100, 500.0, 0.0, 0.0, ""))
    report.ranks.append((101, 1.0, "hbm", False))  # warm-up: not measured
    report.detail.append((101, 0.0, 1.0, 1.0, ""))
    parts = time_parts([report])
    assert parts["all"]["requests"] == 100
    assert parts["all"]["latency"] == pytest.approx((97 * 10 + 3 * 200) / 100)
    assert parts["all"]["queued"] == pytest.approx(97 * 2 / 100)
    assert parts["all"]["work"] == pytest.approx((97 * 7 + 3 * 50) / 100)
    assert parts["tail"] == {"requests": 3, "latency": 200.0, "queued": 0.0, "work": 50.0, "rest": 150.0}
    assert time_parts([InstanceReport()]) == {}
    # A real instance says how late its dispatcher handed each request on: part of its queued time.
    report.dispatched_late = {q: 1.0 for q in range(102)}
    assert time_parts([report])["all"]["dispatched_late"] == pytest.approx(97 * 1.0 / 100)  # never above queued


def test_cpu_parts_split_a_real_instances_process_time_into_ranks_prefills_and_the_rest():
    # Two instances over 1 s windows: ranks' own threads 10 × 30 ms, prefills 2 × 40 ms, the process 400 ms;
    # the pinned cores 450 ms busy, so 50 ms went to other processes.
    reports = []
    for _ in range(2):
        report = InstanceReport()
        report.detail.extend((q, 0.0, 30.0, 30.0, "") for q in range(10))
        report.forward_times = ForwardTimes()
        report.forward_times.record("prefill", 512, 0, 0, 40.0)
        report.forward_times.record("prefill", 1024, 0, 0, 40.0)
        report.forward_times.record("rank", 512, 8, 64, 25.0)
        report.cpu_ms = {"window": 1000.0, "process": 400.0, "cores_busy": 450.0}
        reports.append(report)
    parts = cpu_parts(reports)
    assert parts["rank_requests"] == 20 and parts["ranks"] == pytest.approx(600.0)
    assert parts["prefill"] == pytest.approx(160.0) and parts["process"] == pytest.approx(800.0)
    assert parts["outside"] == pytest.approx(40.0) and parts["outside_per_rank"] == pytest.approx(2.0)
    assert parts["others"] == pytest.approx(100.0) and parts["others_share"] == pytest.approx(0.05)
    del reports[1].cpu_ms["cores_busy"]  # where /proc cannot tell for one, no share is claimed for any
    assert "others_share" not in cpu_parts(reports)
    assert cpu_parts([InstanceReport()]) == {}  # the simulator's reports have none


def test_a_refined_load_sweep_measures_once_more_between_its_crossing_pair_and_interpolates_there():
    from relay_engine.lab.bench.modes import MODES_BY_NAME
    from relay_engine.lab.bench.sweeps import sweep

    def measure(mode, cap, qps):  # P99 convex in the load: 100 ms (the SLO) at 10.5 QPS
        p = point(np.full(200, 100.0 * (qps / 10.5) ** 4))
        p.cap, p.qps = cap, qps
        return p

    grid = [8.0, 8.0 * 2 ** 0.5, 16.0]
    plain = sweep(measure, MODES_BY_NAME["relay"], "qps", grid, 512, 100.0)
    refined = sweep(measure, MODES_BY_NAME["relay"], "qps", grid, 512, 100.0, refine=True)
    assert sorted(plain.x(p) for p in plain.points) == [8.0, 8.0 * 2 ** 0.5]  # bisection: the pair only
    assert len(refined.points) == len(plain.points) + 1
    assert refined.x(refined.points[-1]) == pytest.approx(8.0 * 2 ** 0.25)  # between 8 (pass) and 11.3 (fail)
    # closer to the true 10.5 than the plain sweep's interpolation across the whole √2 step
    assert abs(refined.crossing.value - 10.5) < abs(plain.crossing.value - 10.5)


def test_a_refined_cap_sweep_measures_a_multiple_of_64_tokens_and_nothing_where_none_fits_between():
    from relay_engine.lab.bench.modes import MODES_BY_NAME
    from relay_engine.lab.bench.sweeps import sweep

    def measure(mode, cap, qps):  # passes up to 700 tokens
        p = point(np.full(200, 50.0 if cap <= 700 else 150.0))
        p.cap, p.qps = cap, qps
        return p

    found = sweep(measure, MODES_BY_NAME["relay"], "cap", [256, 512, 768, 1024], 10.0, 100.0, refine=True)
    assert sorted(found.x(p) for p in found.points)[-3:] == [512, 640, 768]
    assert found.best_passing == 640
    tight = sweep(measure, MODES_BY_NAME["relay"], "cap", [640, 704], 10.0, 100.0, refine=True)
    assert len(tight.points) == 2  # √(640·704) rounds to 704: no cap in between
