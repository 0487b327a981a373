"""The pre-inference lane: its own thread, its compute share as a scheduling weight, jobs in order."""

from __future__ import annotations

import os
import threading

import pytest
import torch

from relay_engine.core.lane import PreInferLane, nice_for_share, share_of_nice

LINUX_PRIORITIES = pytest.mark.skipif(not hasattr(os, "getpriority"), reason="no per-thread priorities here")


@pytest.mark.parametrize(("share", "nice"), [(0.5, 0), (0.9, 0), (0.25, 5), (0.1, 10), (0.01, 19)])
def test_a_share_is_the_nice_value_whose_cfs_weight_gives_it(share, nice):
    assert nice_for_share(share) == nice


def test_the_chosen_nice_gives_about_the_share_asked_for():
    for share in (0.05, 0.1, 0.2, 0.3, 0.4, 0.5):
        assert abs(share_of_nice(nice_for_share(share)) - share) < 0.05


def _record(seen: list, i: int) -> None:
    me = threading.current_thread()
    seen.append((i, me.name, os.getpriority(os.PRIO_PROCESS, threading.get_native_id())))


@LINUX_PRIORITIES
def test_jobs_run_in_order_on_the_lane_thread_at_its_nice():
    lane = PreInferLane(torch.device("cpu"), share=0.25, name="test-lane")
    seen: list = []
    for i in range(5):
        lane.submit(lambda i=i: _record(seen, i))
    lane.close()
    assert [i for i, _, _ in seen] == list(range(5))
    assert {name for _, name, _ in seen} == {"test-lane"}
    assert {nice for _, _, nice in seen} == {nice_for_share(0.25)}


@LINUX_PRIORITIES
def test_a_larger_share_takes_effect_on_a_fresh_thread():
    lane = PreInferLane(torch.device("cpu"), share=0.1, name="test-lane")
    seen: list = []
    ran = threading.Event()
    lane.submit(lambda: (_record(seen, 0), ran.set()))
    assert ran.wait(10)
    lane.set_share(0.5)
    lane.submit(lambda: _record(seen, 1))
    lane.close()
    assert [nice for _, _, nice in sorted(seen)] == [nice_for_share(0.1), 0]


def test_a_failing_job_does_not_stop_the_lane():
    lane = PreInferLane(torch.device("cpu"), share=0.5)
    seen: list = []
    lane.submit(lambda: 1 / 0)
    lane.submit(lambda: seen.append("after"))
    lane.close()
    assert seen == ["after"]
