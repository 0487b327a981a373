"""The fleet-scale benchmark of the control plane's reads and Redis memory, at a handful of instances:
it runs, and its memory figure counts every key family a worker keeps, forward times included."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_the_memory_figure_counts_both_forward_time_streams(redis_url):
    proc = subprocess.run([sys.executable, "-m", "controlplane.telemetry.bench", "--instances", "4", "--requests", "2",
                           "--history", "prometheus"], cwd=REPO, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "REDIS_URL": redis_url})
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    out = proc.stdout
    # 6 min of the live tier (Prometheus holds the rest); each instance's two forward-time streams full: 6 short and
    # 7 long records of a busy instance a day into its run; the pool's capture full.
    assert "filled 1440 snapshots, 52 forward-time records and 100000 captured requests" in out
    families = {m[1]: float(m[2]) for m in re.finditer(r"^  (\S.*?)\s{2,}([\d.]+) KiB", out, re.M)}
    assert families["forwards, short stream"] > 6 * 2 and families["forwards, long stream"] > 7 * 2  # KB a record
    assert abs(families["total"] - sum(v for k, v in families.items() if k != "total")) < 0.5
    assert "stream 1s" in families and "stream 10s" not in families  # Prometheus holds the history
    assert "MiB for 4)" in out  # the target is at 256 instances: the shared rollups do not scale down
