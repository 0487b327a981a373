"""The host under the benchmark: cores pinned per instance, and a contention check on every point.

``HostMonitor`` samples ``/proc`` twice a second while a point runs: the CPU time all processes used
(``/proc/stat``), the CPU time of the benchmark's own processes (``/proc/<pid>/stat``, every thread),
and the hypervisor's steal. What others used is the difference. A point whose host was busy — on
average over the point, or in any 2-second stretch, or with steal — is flagged and measured again.
Where ``/proc`` is missing the check says so instead of passing silently.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass

_HZ = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def pin(cores: Sequence[int]) -> list[int] | None:
    """Pin the calling process to cores (where the OS allows); returns the cores, or None."""
    if not hasattr(os, "sched_setaffinity"):
        return None
    try:
        allowed = sorted(os.sched_getaffinity(0))
        chosen = [allowed[c % len(allowed)] for c in cores]
        os.sched_setaffinity(0, chosen)
        return chosen
    except OSError:
        return None


def cores_for(index: int, per_instance: int) -> list[int]:
    return list(range(index * per_instance, (index + 1) * per_instance))


def cores_busy_s(cores: Sequence[int] | None) -> float | None:
    """CPU seconds the given cores have spent busy since boot (``/proc/stat``'s per-CPU lines: user,
    nice, system, irq, softirq), or None where that cannot be read."""
    if not cores:
        return None
    wanted, busy = {f"cpu{c}" for c in cores}, 0
    try:
        with open("/proc/stat", encoding="ascii") as f:
            for line in f:
                parts = line.split()
                if parts and parts[0] in wanted:
                    user, nice, system, _idle, _iowait, irq, softirq = ([int(x) for x in parts[1:8]] + [0] * 7)[:7]
                    busy += user + nice + system + irq + softirq
                    wanted.discard(parts[0])
    except (OSError, ValueError):
        return None
    return None if wanted else busy / _HZ


def _cpu_ticks() -> tuple[int, int] | None:
    """(busy ticks of all CPUs, steal ticks) from /proc/stat."""
    try:
        with open("/proc/stat", encoding="ascii") as f:
            parts = f.readline().split()
    except OSError:
        return None
    values = [int(x) for x in parts[1:]]
    user, nice, system, idle, iowait, irq, softirq, steal = (values + [0] * 8)[:8]
    return user + nice + system + irq + softirq, steal


def _process_ticks(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return 0
    return int(fields[11]) + int(fields[12])  # utime, stime (all threads)


@dataclass
class HostVerdict:
    available: bool
    other_share: float = 0.0  # of the machine, mean over the point
    other_share_max_2s: float = 0.0
    steal_share: float = 0.0
    busy: bool = False

    def to_dict(self) -> dict:
        return {"checked": self.available, "other_cpu_share": round(self.other_share, 4),
                "other_cpu_share_max_2s": round(self.other_share_max_2s, 4),
                "steal_share": round(self.steal_share, 4), "busy": self.busy}


class HostMonitor:
    """Samples the host while a point runs (``with HostMonitor(pids, ...) as m: ...; m.verdict``)."""

    def __init__(self, pids: Sequence[int], *, other_share: float, window_share: float, steal_share: float,
                 interval_s: float = 0.5):
        self.pids = list(pids)
        self.limits = (other_share, window_share, steal_share)
        self.interval_s = interval_s
        self.samples: list[tuple[float, int, int, int]] = []  # (time, busy, steal, ours)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="host-monitor", daemon=True)
        self.verdict = HostVerdict(False)

    def _sample(self) -> None:
        ticks = _cpu_ticks()
        if ticks is not None:
            ours = sum(_process_ticks(p) for p in self.pids)
            self.samples.append((time.monotonic(), ticks[0], ticks[1], ours))

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self._sample()

    def __enter__(self) -> HostMonitor:
        self._sample()
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self._sample()
        self.verdict = self._judge()

    def _judge(self) -> HostVerdict:
        s = self.samples
        if len(s) < 2:
            return HostVerdict(False)
        cpus = os.cpu_count() or 1

        def other(a: int, b: int) -> tuple[float, float]:
            dt = (s[b][0] - s[a][0]) * _HZ * cpus
            if dt <= 0:
                return 0.0, 0.0
            return (max(0, (s[b][1] - s[a][1]) - (s[b][3] - s[a][3])) / dt, (s[b][2] - s[a][2]) / dt)

        mean_other, steal = other(0, len(s) - 1)
        worst = 0.0
        j = 0
        for i in range(len(s)):  # every stretch of at least 2 s
            while j < len(s) and s[j][0] - s[i][0] < 2.0:
                j += 1
            if j < len(s):
                worst = max(worst, other(i, j)[0])
        other_limit, window_limit, steal_limit = self.limits
        busy = mean_other > other_limit or worst > window_limit or steal > steal_limit
        return HostVerdict(True, mean_other, worst, steal, busy)
