"""The benchmark and the simulator run end to end (``--quick``) and write the figures the issue asks for.

Shape only: a timed test on a shared machine would be flaky, so no assertion here is about speed. The runs
over the shared trace start together, once per session (tests/lab/smoke_runs.py; beside the history test of
tests/deploy where that one runs too): each replays in real time and leaves the cores idle much of the while,
so side by side they take about the longest one's time, not the sum, and none of what they are asked to show
depends on how fast it ran.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from relay_engine.lab.bench.modes import MODES
from relay_engine.lab.sim.validate import REPLAYS
from relay_engine.lab.traffic import TraceSpec, generate_trace
from tests.background import REPO, BackgroundRun
from tests.lab.smoke_runs import RUN_TIMEOUT_S

POINT_KEYS = {"qps", "qps_unscaled", "cap", "n", "p50_ms", "p99_ms", "p99_ci_ms", "p99_ms_unscaled", "passed",
              "within_slo_share", "hit_ratio", "hbm_hit_rate", "dram_hit_rate", "miss_rate", "preinfer",
              "deadline_missed", "hbm_peak_bytes", "hbm_budget_bytes", "dram_peak_bytes", "dram_budget_bytes",
              "within_budget", "host", "redone"}


def run_module(module: str, *args: str, timeout: int = RUN_TIMEOUT_S) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", module, *args], cwd=REPO, capture_output=True, text=True,
                          timeout=timeout)


@pytest.fixture
def started(request, bench_smoke_runs) -> tuple[BackgroundRun, Path]:
    """This test's run, started with the session's others (tests/conftest.py), and its output file."""
    return bench_smoke_runs[request.node.name]


@pytest.mark.slow
def test_quick_run_writes_every_mode_the_ratios_with_intervals_a_table_and_plots(started):
    run, out = started

    proc = run.result()

    assert proc.returncode == 0, proc.stderr[-2000:]
    result = json.loads(out.read_text())
    assert set(result["modes"]) == {m.name for m in MODES}
    points = [p for m in result["modes"].values() for sw in m["sweeps"].values() for p in sw["points"]]
    assert points and all(set(p) >= POINT_KEYS for p in points)
    assert all(p["n"] == result["windows"]["measured_per_point"] for p in points)  # no early abort
    for name in ("baseline", "relay"):
        mode = result["modes"][name]
        assert isinstance(mode["max_seq_len_at_slo"], int), name
        assert isinstance(mode["slo_throughput_qps"], (int, float)), name
        assert mode["reference"]["within_budget"] is True, name
    assert {"slo_throughput", "max_seq_len", "slo_throughput_ci", "max_seq_len_ci"} <= set(result["ratios"])
    assert result["time_scale"]["time_scale"] > 0 and "meaning" in result["time_scale"]
    assert result["overhead"]["engine_over_bare_ratio"] > 0
    assert "| relay |" in proc.stdout and "| baseline |" in proc.stdout
    assert [Path(p).name for p in result["plots"]] == ["bench-p99-vs-load.png", "bench-p99-vs-cap.png"]
    assert all(Path(p).stat().st_size > 1000 for p in result["plots"])


def test_a_malformed_trace_line_is_an_error_naming_the_line(tmp_path):
    bad = tmp_path / "bad.jsonl"
    good = generate_trace(TraceSpec(queries=2))[0].to_json()
    bad.write_text(good + "\n" + '{"t_ms": 1, "user_id": "u1"}\n')

    proc = run_module("relay_engine.bench", "--quick", "--trace", str(bad), "--out", str(tmp_path / "bench.json"))

    assert proc.returncode == 2
    assert "line 2" in proc.stderr and "seq_len" in proc.stderr
    assert not (tmp_path / "bench.json").exists()


def test_the_simulator_replays_a_trace_per_mode_and_writes_its_figures(started):
    run, out = started

    proc = run.result()

    assert proc.returncode == 0, proc.stderr[-2000:]
    result = json.loads(out.read_text())
    assert set(result["modes"]) == {"baseline", "relay", "relay_cache_only"}
    for mode in result["modes"].values():
        assert mode["n"] > 1000 and mode["p99_ms"] >= mode["p50_ms"] > 0
    assert result["modes"]["baseline"]["hit_ratio"] == 0 < result["modes"]["relay"]["hit_ratio"]


@pytest.mark.slow
def test_validation_reports_the_simulators_error_at_every_point(started):
    run, out = started

    proc = run.result()

    assert proc.returncode == 0, proc.stderr[-2000:]
    result = json.loads(out.read_text())
    assert len(result["points"]) >= 4
    for p in result["points"]:
        assert p["real"]["n"] == p["sim"]["n"] == p["sim_profile"]["n"] > 0
        assert isinstance(p["p99_error"], float) and isinstance(p["p99_error_profile"], float)
        # The simulator replays with the real instances' own forwards at the point, fitted as a preview fits
        # a pool's: every operation the point ran is the instances' own.
        fit = p["in_service_fit"]
        if p["mode"] == "baseline":  # every request a full forward: many to a length bucket
            assert fit["rank_full"]["how"] != "profile" and fit["rank_full"]["forwards"] > 0
        else:  # the relay's full forwards are its misses: a loaded run may leave too few in every bucket
            assert fit["rank"]["forwards"] > 0
        for op in fit.values():  # the profile's exactly where no bucket held enough of the pool's own
            assert (op["how"] == "profile") == (op["buckets"] == 0)
        for side in ("real", "sim"):  # where the time went, on both sides, all requests and the tail
            parts = p[side]["time_parts_ms"]
            assert set(parts) == {"all", "tail"} and parts["all"]["requests"] > 0
            assert parts["all"]["work"] > 0 and parts["tail"]["latency"] >= parts["all"]["latency"]
            assert ("dispatched_late" in parts["all"]) == (side == "real")
        # Where the real instances' CPU went, and the simulator charged the rest of the process to each
        # request (the forwards-only replay kept beside it).
        cpu = p["real"]["cpu_ms"]
        assert cpu["rank_requests"] > 0 and cpu["process"] >= cpu["ranks"] > 0 and cpu["window"] > 0
        assert p["in_service_overhead"]["rank_overhead_ms"] == pytest.approx(cpu["outside_per_rank"], abs=0.01)
        assert p["sim_forwards_only"]["n"] == p["sim"]["n"] and isinstance(p["p99_error_forwards_only"], float)
    assert result["p99_target"] == 0.15 and "within_target" in result
    assert isinstance(result["max_abs_p99_error_profile"], float)
    assert isinstance(result["max_abs_p99_error_forwards_only"], float)
    thrash = result["thrash"]  # what interleaving costs (its slope from within the points), each point's figures in it
    assert 0 <= thrash["thrash"] <= 2 and thrash["level"] > 0 and len(thrash["points"]) == len(result["points"])
    assert all(p["interleaving"]["sharing"] >= 1 for p in result["points"])
    for p in result["points"]:  # the point's replay is the median of its replays, the real interval beside it
        replays = p["sim"]["p99_replays_ms"]
        assert len(replays) == REPLAYS and p["sim"]["p99_ms"] == sorted(replays)[REPLAYS // 2]
        drift = p["drift"]  # how the real instances' speed drifted: None where their forwards paired too little
        assert drift is None or (0 < drift["variance"] <= drift["deviation_variance"] + 1e-5 and drift["tau_s"] > 0)
        assert isinstance(p["p99_within_real_interval"], bool)
    assert "Where the time went" in proc.stdout and "Where the real instances' CPU went" in proc.stdout
