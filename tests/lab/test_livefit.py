"""The pool's cost model from its own forward times: fitted, scaled or the profile's, and said which."""

from __future__ import annotations

import json
import math
import random

import pytest

from relay_engine.core.forward_times import ForwardTimes
from relay_engine.core.trace import write_trace
from relay_engine.lab.costmodel import CostModel
from relay_engine.lab.livefit import (
    COMPARE_LENGTHS,
    Interleaving,
    fit_drift,
    fit_live,
    fit_thrash,
    interleaving,
    thrash_within,
)
from relay_engine.lab.sim import cli
from relay_engine.lab.traffic import TraceSpec, generate_trace
from tests.lab.test_costmodel import true_model

LENGTHS = (150, 300, 600, 1200, 2400, 4800)


def recorded(truth: CostModel, ops=("prefill", "rank", "rank_full"), lengths=LENGTHS, per_bucket: int = 20,
             noise: float = 0.05, seed: int = 0) -> ForwardTimes:
    """Forwards as an instance would record them: lengths spread inside each bucket, times with noise."""
    rng = random.Random(seed)
    times = ForwardTimes()
    for op in ops:
        for n0 in lengths:
            for _ in range(per_bucket):
                n = int(n0 * rng.uniform(1.0, 1.15))
                s, c = (0, 0) if op == "prefill" else (rng.randint(20, 40), 128)
                times.record(op, n, s, c, truth.op_ms(op, n, s, c) * rng.uniform(1 - noise, 1 + noise))
    return times


def test_forwards_over_many_lengths_are_fitted_and_predict_the_devices_times():
    base = true_model()
    device = base.scaled(1.3)  # this pool's devices run 30 % slower than the offline profile says
    live = fit_live(recorded(device), base)
    assert {f.how for f in live.ops.values()} == {"fitted"}
    for op in ("prefill", "rank", "rank_full"):
        for n in COMPARE_LENGTHS:
            assert live.cost.op_ms(op, n, 32, 128) == pytest.approx(device.op_ms(op, n, 32, 128), rel=0.06)
        assert live.ops[op].vs_profile[2048] == pytest.approx(1.3, rel=0.06)
        assert live.ops[op].max_error < 0.05 and 0 < live.ops[op].cv < 0.1  # ±5 % noise and the spread in a bucket
        assert live.cost.dispersion[op] == pytest.approx(live.ops[op].cv)  # what the simulator draws with
    assert live.sentence().startswith("prefill fitted (") and live.forwards > 300


def test_an_operation_seen_at_few_lengths_is_the_profiles_shape_at_the_devices_level():
    base = true_model()
    times = recorded(base.scaled(2.0), ops=("rank",), lengths=(1000,), noise=0.0)
    times.record("prefill", 1000, 0, 0, 5.0)  # one forward: too few to count (MIN_FORWARDS)
    live = fit_live(times, base)
    assert (live.ops["rank"].how, live.ops["prefill"].how, live.ops["rank_full"].how) == ("scaled", "profile", "profile")
    assert live.ops["rank"].scale == pytest.approx(2.0, rel=0.01)
    assert live.cost.rank_ms(4000, 32, 128) == pytest.approx(2 * base.rank_ms(4000, 32, 128), rel=0.01)
    assert live.cost.prefill_ms(4000) == base.prefill_ms(4000)
    assert live.live_ops == ["rank"]
    assert "rank_full the profile's (no forwards)" in live.sentence()


def test_no_forwards_is_the_profile_and_says_so():
    live = fit_live(ForwardTimes(), true_model())
    assert live.live_ops == [] and live.sentence() == "no forwards of this pool's own in the window"
    assert live.cost.coefficients == true_model().coefficients


def pool_file(tmp_path, times: ForwardTimes):
    path = tmp_path / "forwards.json"
    path.write_text(json.dumps({"pool": "main", "window_s": 900, "instances": ["main.0", "main.1"],
                                "model_version": "v", "device_kind": "cpu", "clock": "thread_cpu",
                                "ops": times.to_dict()}))
    return path


def test_the_fit_command_prints_fitted_against_the_profile(tmp_path, capsys):
    base_path = tmp_path / "base.json"
    true_model().save(base_path)
    out = tmp_path / "fitted.json"
    path = pool_file(tmp_path, recorded(true_model().scaled(1.3)))
    assert cli.main(["fit", "--forward-times", str(path), "--profile", str(base_path), "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "360 forwards over the last 15 min on 2 instances" in printed
    assert CostModel.load(out).prefill_ms(2048) == pytest.approx(1.3 * true_model().prefill_ms(2048), rel=0.06)
    report = json.loads(out.with_suffix(".fit.json").read_text())
    assert report["ops"]["rank"]["how"] == "fitted"
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"ops": {"rank": {"44": [1, "x", 1, 1, 1, 1, 1]}}}))
    assert cli.main(["fit", "--forward-times", str(bad), "--profile", str(base_path)]) == 2
    assert "ops.rank.44.sum_ms must be a number" in capsys.readouterr().err


def preview_argv(tmp_path, base: CostModel, out) -> list[str]:
    """``sim preview``'s arguments on a generated 200-query window, the same spec live and proposed."""
    base_path = tmp_path / "base.json"
    base.save(base_path)
    trace = tmp_path / "trace.jsonl"
    write_trace(trace, generate_trace(TraceSpec(queries=200, qps=10, seed=1)))
    spec = tmp_path / "spec.json"
    spec.write_text("{}")
    return ["preview", "--trace", str(trace), "--live", str(spec), "--proposed", str(spec), "--instances", "2",
            "--profile", str(base_path), "--jobs", "1", "--max-requests", "200", "--out", str(out)]


def test_the_preview_replays_with_the_pools_own_times_and_says_so(tmp_path):
    base = true_model()
    runs = {}
    for name, extra in (("profile", []), ("own", ["--forward-times", str(pool_file(tmp_path, recorded(base.scaled(3.0))))])):
        out = tmp_path / f"{name}.json"
        assert cli.main([*preview_argv(tmp_path, base, out), *extra]) == 0
        runs[name] = json.loads(out.read_text())
    own = runs["own"]["profile"]
    assert own["pools_own"] is True and own["note"].startswith("fitted from this pool's own forwards over the last 15 min")
    assert own["live_fit"]["rank_full"]["how"] == "fitted"
    assert runs["profile"]["profile"]["live_fit"] is None
    # Three times slower forwards: the same traffic waits longer.
    assert runs["own"]["live"]["p50_ms"] > 2 * runs["profile"]["live"]["p50_ms"]
    # The pool's forwards took their CPU time in wall time: nothing else on the host; the profile alone
    # says nothing of it.
    assert own["pool_sharing"] == pytest.approx(1.0) and runs["own"]["host_background"]["share"] == 0.0
    assert runs["profile"]["host_background"]["pool_sharing"] is None


def test_a_pools_forwards_that_waited_beyond_their_cpu_time_model_the_hosts_other_processes(tmp_path):
    base = true_model()
    times = ForwardTimes()
    for op in ("prefill", "rank", "rank_full"):
        for n in LENGTHS:
            for _ in range(20):
                ms = base.op_ms(op, n, 30, 128)
                times.record(op, n, 0 if op == "prefill" else 30, 0 if op == "prefill" else 128, ms, 1.3 * ms)
    path = pool_file(tmp_path, times)
    out = tmp_path / "out.json"
    argv = [*preview_argv(tmp_path, base, out), "--forward-times", str(path)]
    assert cli.main(argv) == 0
    result = json.loads(out.read_text())
    assert result["profile"]["pool_sharing"] == pytest.approx(1.3)
    background = result["host_background"]
    assert background["share"] > 0.05  # the rest of 1.3 after what the simulator's own instances explain
    assert background["share"] == pytest.approx(1 - background["simulated_sharing"] / 1.3, abs=1e-3)
    # On an accelerator's wall clock there is no CPU time to set it against: nothing modelled.
    data = json.loads(path.read_text())
    path.write_text(json.dumps(data | {"clock": "wall", "device_kind": "cuda"}))
    assert cli.main(argv) == 0
    assert json.loads(out.read_text())["host_background"]["pool_sharing"] is None


def test_interleaving_is_the_ranking_forwards_wall_over_cpu_and_cpu_over_their_time_alone():
    # Ranks that cost 1.3× their time alone in CPU and 2.5× that in wall time; prefills do not count.
    base = true_model()
    times = ForwardTimes()
    for n in (300, 600, 1200, 2400):
        for _ in range(10):
            cpu = base.op_ms("rank", n, 32, 128) * 1.3
            times.record("rank", n, 32, 128, cpu, cpu * 2.5)
        times.record("prefill", n, 0, 0, base.op_ms("prefill", n, 0, 0) * 5, 1000.0)
    turns = interleaving(times, base)
    assert turns.sharing == pytest.approx(2.5) and turns.inflation == pytest.approx(1.3, rel=0.01)
    assert interleaving(ForwardTimes(), base) == Interleaving(1.0, 1.0)


def test_the_thrash_is_fitted_across_loads_apart_from_the_level_every_load_has():
    # In service a forward costs 1.2× its time alone at any load, and each further interleaved one adds 0.15.
    points = [Interleaving(s, 1.2 * (1 + 0.15 * (s - 1))) for s in (1.1, 1.6, 2.3, 3.0)]
    fitted = fit_thrash(points)
    assert fitted.thrash == pytest.approx(0.15, abs=0.005) and fitted.level == pytest.approx(1.2, rel=0.01)
    assert fitted.error < 0.01 and fitted.points == tuple(points)
    # One load cannot tell the two apart: no thrash, the level its inflation.
    single = fit_thrash([Interleaving(2.0, 1.4), Interleaving(2.1, 1.5)])
    assert single.thrash == 0.0 and single.level == pytest.approx(math.sqrt(1.4 * 1.5))


def _ou_forwards(variance: float, tau_s: float, *, n: int = 6000, every_s: float = 0.05, seed: int = 5) -> ForwardTimes:
    """Forwards every ``every_s`` whose times carry a slow Ornstein-Uhlenbeck factor and noise of their own."""
    rng = random.Random(seed)
    times, y = ForwardTimes(), 0.0
    keep = math.exp(-every_s / tau_s)
    for i in range(n):
        y = y * keep + rng.gauss(0, math.sqrt(variance * (1 - keep * keep)))
        times.record("rank", 1000, 32, 128, 10.0 * math.exp(y + rng.gauss(0, 0.1)), at_s=i * every_s)
    return times


def test_the_drift_fit_finds_the_slow_factors_variance_and_correlation_time():
    fitted = fit_drift(_ou_forwards(0.02, 0.5).drift)
    assert fitted is not None
    assert fitted.drift.variance == pytest.approx(0.02, rel=0.3) and fitted.drift.tau_s == pytest.approx(0.5, rel=0.35)
    assert fitted.to_dict()["share_of_variance"] == pytest.approx(0.02 / 0.03, rel=0.3)  # 0.01 of each forward's own
    # Independent forwards: no slow factor to speak of; too few pairs: none at all.
    independent = fit_drift(_ou_forwards(1e-9, 0.5).drift)
    assert independent is None or independent.drift.variance < 0.002
    assert fit_drift(_ou_forwards(0.02, 0.5, n=20).drift) is None


def test_the_live_fit_carries_the_drift_into_the_cost_model_and_its_file(tmp_path):
    times = recorded(true_model())
    times.merge(_ou_forwards(0.02, 0.5))
    live = fit_live(times, true_model())
    assert live.drift is not None and live.cost.drift == live.drift.drift
    assert "speed drifting in runs of ~" in live.sentence()  # what a preview's cost note says
    path = tmp_path / "cost.json"
    live.cost.save(path)
    loaded = CostModel.load(path).drift
    assert (loaded.variance, loaded.tau_s) == pytest.approx((live.cost.drift.variance, live.cost.drift.tau_s), rel=1e-3)
    assert live.cost.scaled(2.0).drift == live.cost.drift


def test_the_thrash_is_the_slope_of_each_forwards_deviation_on_its_own_interleaving():
    rng = random.Random(2)
    times = ForwardTimes()
    for i in range(3000):  # each forward shared its core with 0-3 others, each costing it 4 % more
        turns = rng.uniform(0, 3)
        ms = 10.0 * (1 + 0.04 * turns) * math.exp(rng.gauss(0, 0.05))
        times.record("rank", 1000, 32, 128, ms, ms * (1 + turns), at_s=i * 0.05)
    assert thrash_within(times.drift) == pytest.approx(0.04, abs=0.01)
    fixed = fit_thrash([Interleaving(1.5, 1.3), Interleaving(2.5, 1.6)], within=0.04)
    assert fixed.thrash == 0.04 and fixed.level == pytest.approx(math.sqrt(1.3 / 1.02 * 1.6 / 1.06), rel=1e-6)
    on_a_wall_clock = ForwardTimes()  # an accelerator's forwards: wall = own time, no turns to regress on
    for i in range(300):
        on_a_wall_clock.record("rank", 1000, 32, 128, 10.0 + i % 3, at_s=i * 0.05)
    assert thrash_within(on_a_wall_clock.drift) is None and thrash_within(ForwardTimes().drift) is None
