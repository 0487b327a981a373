"""The benchmark runs end to end (``--quick``) and writes the figures the issue asks for.

Shape only: a timed test on a shared machine would be flaky, so no assertion here is about speed.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from relay_engine.core.trace import write_trace
from relay_engine.lab.bench.runner import MODES
from relay_engine.lab.traffic import TraceSpec, generate_trace

REPO = Path(__file__).resolve().parents[2]
REFERENCE_KEYS = {"qps", "cap", "p50_ms", "p99_ms", "p999_ms", "hbm_hit_rate", "dram_hit_rate", "miss_rate",
                  "preinfer", "deadline_missed", "hbm_peak_bytes", "hbm_budget_bytes", "dram_peak_bytes",
                  "dram_budget_bytes", "within_budget"}


def run_bench(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "relay_engine.bench", *args], cwd=REPO, capture_output=True,
                          text=True, timeout=280)


@pytest.mark.slow
def test_quick_run_writes_every_mode_the_ratios_and_a_table(tmp_path):
    trace = tmp_path / "trace.jsonl"
    write_trace(trace, generate_trace(TraceSpec(queries=1500, seed=3)))
    out = tmp_path / "bench.json"

    proc = run_bench("--quick", "--trace", str(trace), "--out", str(out))

    assert proc.returncode == 0, proc.stderr[-2000:]
    result = json.loads(out.read_text())
    assert set(result["modes"]) == {m.name for m in MODES}
    for name, mode in result["modes"].items():
        assert isinstance(mode["max_seq_len_at_slo"], int), name
        assert isinstance(mode["slo_throughput_qps"], (int, float)), name
        assert mode["within_budget"] is True, name
        assert mode["probes"], name
        assert set(mode["reference"]) >= REFERENCE_KEYS, name
    assert set(result["ratios"]) == {"slo_throughput", "max_seq_len"}
    assert result["overhead"]["engine_over_bare_ratio"] > 0
    assert "| relay |" in proc.stdout and "| baseline |" in proc.stdout


def test_a_malformed_trace_line_is_an_error_naming_the_line(tmp_path):
    trace = tmp_path / "bad.jsonl"
    good = generate_trace(TraceSpec(queries=2))[0].to_json()
    trace.write_text(good + "\n" + '{"t_ms": 1, "user_id": "u1"}\n')

    proc = run_bench("--quick", "--trace", str(trace), "--out", str(tmp_path / "bench.json"))

    assert proc.returncode == 2
    assert "line 2" in proc.stderr and "seq_len" in proc.stderr
    assert not (tmp_path / "bench.json").exists()
