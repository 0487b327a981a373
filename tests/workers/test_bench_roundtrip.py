"""The round-trip bench's guard between modes: a backlog block ends only once the instance is quiet."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

from workers.bench_roundtrip import process_cpu_s, wait_until_quiet


def _spawn(code: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", code], start_new_session=True)  # its own group: killed whole


def test_a_busy_childs_cpu_counts_for_its_parent_and_only_an_idle_process_is_quiet():
    # A parent sleeping while its child spins: the work a prefill process does for its instance.
    parent = _spawn("import subprocess, sys, time\n"
                    "child = subprocess.Popen([sys.executable, '-c', 'while True: pass'])\n"
                    "time.sleep(60)")
    idle = _spawn("import time; time.sleep(60)")
    try:
        before = process_cpu_s(parent.pid)
        waited = wait_until_quiet(parent.pid, window_s=0.2, timeout_s=1.0)
        assert waited >= 1.0, "a process whose child spins was taken as quiet"
        assert process_cpu_s(parent.pid) - before > 0.3
        assert wait_until_quiet(idle.pid, window_s=0.2, timeout_s=5.0) < 5.0
    finally:
        for p in (parent, idle):
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()
