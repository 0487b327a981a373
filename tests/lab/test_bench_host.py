"""The benchmark's reading of the host: per-core busy time."""

from __future__ import annotations

import os
import sys

import pytest

from relay_engine.lab.bench.host import cores_busy_s


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc/stat is Linux's")
def test_a_cores_busy_time_is_read_from_proc_stat_and_only_grows():
    core = min(os.sched_getaffinity(0))
    before = cores_busy_s([core])
    assert isinstance(before, float) and before > 0
    assert cores_busy_s([core]) >= before
    assert cores_busy_s([]) is None and cores_busy_s(None) is None
    assert cores_busy_s([core, 100_000]) is None  # a core /proc does not list: no figure, not a partial one
