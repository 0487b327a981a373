"""Previews cannot hold the canary bake: the control plane's two Celery workers, on the real stack.

The browser tests' stack (``tests/frontend/stack.py``: gunicorn, two small-model workers, steady
traffic captured by them, and the control plane's workers started as ``make run`` starts them)
without a browser. Previews fill the previews' worker — their simulator runs are frozen with SIGSTOP
once started, so they stay running however fast this machine is — and a canary's bake is still
judged by the bake's own worker, while those previews are running and queued.
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
from pathlib import Path

import pytest

from tests.frontend.stack import POOL, Stack

pytestmark = [pytest.mark.integration, pytest.mark.slow]

BASE = f"/api/v1/pools/{POOL}"
PREVIEWS = 4  # the pool's default limit: two running on the previews' worker, two queued behind them


@pytest.fixture(scope="module")
def stack(redis_url, tmp_path_factory):
    running = Stack(redis_url, tmp_path_factory.mktemp("controlplane-workers"),
                    env={"RELAYGR_PREVIEW_MAX_PER_USER": str(PREVIEWS)})
    try:
        yield running.start()
    finally:
        running.stop()


def wait_for(condition, timeout_s: float, what: str):
    deadline = time.monotonic() + timeout_s
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s:.0f} s waiting for {what}")
        time.sleep(0.05)


def simulator_runs(parent: int) -> list[int]:
    """The simulator processes (``python -m relay_engine.sim``) the previews' worker started."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            ppid = int(stat.read_text().rsplit(")", 1)[1].split()[1])
            cmdline = (stat.parent / "cmdline").read_bytes().split(b"\0")
        except (OSError, IndexError, ValueError):
            continue
        if ppid == parent and b"relay_engine.sim" in cmdline:
            found.append(int(stat.parent.name))
    return found


def new_revision(stack: Stack, **trigger) -> int:
    _, pool = stack.api("GET", f"{BASE}/")
    status, revision = stack.api("POST", f"{BASE}/revisions/", {"parent_generation": pool["latest_generation"],
                                                                "spec": {"trigger": trigger}})
    assert status == 201, revision
    return revision["generation"]


def test_a_bake_is_decided_while_previews_fill_their_worker(stack):
    wait_for(lambda: stack.api("GET", f"{BASE}/traffic/?window=1m")[1].get("requests", 0) >= 100, 180,
             "a minute of captured traffic")
    asked = []
    for i in range(PREVIEWS):
        status, preview = stack.api("POST", f"{BASE}/revisions/{new_revision(stack, at_risk_seq_len=900 + i)}/preview/",
                                    {"window": "1m"})
        assert status == 202, preview
        asked.append(preview["url"])
    status, refused = stack.api("POST", f"{BASE}/revisions/{new_revision(stack, at_risk_seq_len=950)}/preview/",
                                {"window": "1m"})
    assert status == 429 and "RELAYGR_PREVIEW_MAX_PER_POOL allows (4)" in refused["detail"], refused

    worker = stack.controlplane_workers["previews"].pid
    frozen: set[int] = set()

    def previews_stuck_running() -> bool:
        for pid in set(simulator_runs(worker)) - frozen:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGSTOP)
                frozen.add(pid)
        return len(frozen) >= 2

    try:
        wait_for(previews_stuck_running, 120, "two simulator runs of previews to start")
        states = [stack.api("GET", url)[1]["status"] for url in asked]
        assert states.count("running") == 2 and states.count("queued") == 2, states

        generation = new_revision(stack, at_risk_seq_len=777)  # any change but the SLO (refused for canaries)
        status, rollout = stack.api("POST", f"{BASE}/revisions/{generation}/publish/",
                                    {"strategy": "canary", "canary_instances": 1, "bake_s": 5, "max_burn": 1.0})
        assert status == 201, rollout
        decided = wait_for(lambda: (r := stack.api("GET", f"{BASE}/rollout/")[1])["state"] != "baking" and r, 120,
                           "the bake's evaluation to decide the canary")
        assert decided["decided_by"] == "rollout-evaluator", decided
        # Decided while the previews still held every thread of their worker, and two more waited.
        states = [stack.api("GET", url)[1]["status"] for url in asked]
        assert states.count("running") == 2 and states.count("queued") == 2, states
    finally:
        for pid in frozen:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
