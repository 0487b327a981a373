"""Worker processes across restarts: an instance starts from the revision it last applied (kept on its
disk), never from the schema's defaults in place of a revision it has not seen, and says so."""

from __future__ import annotations

import signal
import subprocess
import time

import pytest

from relay_engine.core.config import parse_policy
from relay_engine.core.wire import ACK, PENDING, InstanceStatus, instance_name
from tests.workers.fleet import START_TIMEOUT_S, Fleet, wait_for
from workers.membership import live_members
from workers.pool import spawn_instance

pytestmark = [pytest.mark.integration, pytest.mark.slow]

BUDGET_MB = 321.0


@pytest.fixture
def single(redis_url, tmp_path):
    pool = Fleet(redis_url, tmp_path, pool="restart", size=1)
    try:
        yield pool
    finally:
        pool.stop()


def restart(fleet: Fleet, name: str) -> None:
    proc = fleet.procs[name]
    proc.send_signal(signal.SIGTERM)
    proc.wait(30)
    log = (fleet.logdir / f"{name}.log").open("a")
    fleet.procs[name] = spawn_instance(fleet.settings, int(name.rsplit(".", 1)[1]), stdout=log,
                                       stderr=subprocess.STDOUT)


def status_of(fleet: Fleet, name: str) -> InstanceStatus | None:
    raw = fleet.redis.get(fleet.keys.status(name))
    return InstanceStatus.from_json(raw) if raw else None


def test_restarted_with_redis_empty_it_serves_its_last_applied_revision_and_reports_pending(single):
    single.start()
    name = single.names[0]
    generation = single.publish({"cache": {"hbm_budget_mb": BUDGET_MB}})
    wait_for(lambda: (s := status_of(single, name)) and s.config_state == ACK and s.applied_generation == generation,
             10, what="the ACK")

    single.redis.delete(single.keys.desired)  # Redis restarted empty; the sync loop has not run yet
    restart(single, name)
    wait_for(lambda: name in live_members(single.redis, single.keys) and single.procs[name].poll() is None
             and (s := status_of(single, name)) and s.pid == single.procs[name].pid, START_TIMEOUT_S,
             what="the restarted instance to serve")
    status = status_of(single, name)
    assert (status.config_state, status.applied_generation) == (PENDING, generation)
    assert status.tiers["hbm"]["budget_bytes"] == BUDGET_MB * 2**20  # its revision, not the schema's 1024 MB
    assert "serving generation" in status.error
    single.client.refresh()
    assert single.client.rank("after-restart", seq_len=32, short_len=2, n_candidates=4).instance == name

    spec = {"cache": {"hbm_budget_mb": BUDGET_MB}}
    single.generation -= 1  # the sync loop rewrites the same generation from the database
    single.publish(spec)
    wait_for(lambda: (s := status_of(single, name)) and s.config_state == ACK, 10, what="the ACK once desired is back")
    assert status_of(single, name).applied_sha256 == parse_policy(spec).sha256()


def test_with_no_revision_anywhere_it_does_not_serve_until_one_is_published(single):
    name = instance_name(single.settings.pool, 0)
    single.procs[name] = spawn_instance(single.settings, 0, stdout=(single.logdir / f"{name}.log").open("w"),
                                        stderr=subprocess.STDOUT)  # no desired revision in Redis, none on disk
    wait_for(lambda: (s := status_of(single, name)) and "not serving" in s.error, START_TIMEOUT_S,
             what="the waiting instance's status")
    time.sleep(2)
    assert single.procs[name].poll() is None and live_members(single.redis, single.keys) == []

    generation = single.publish({"cache": {"hbm_budget_mb": BUDGET_MB}})
    wait_for(lambda: name in live_members(single.redis, single.keys), START_TIMEOUT_S, what="it to join")
    status = status_of(single, name)
    assert (status.config_state, status.applied_generation) == (ACK, generation)
