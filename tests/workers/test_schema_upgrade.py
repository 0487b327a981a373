"""A running pool upgraded to a schema with a new field (``tests.schema_next``) never NACKs.

Real Redis, real worker processes: the pool runs the released schema and its current revision, stored
the way the control plane stores it (``PolicySpec.to_dict()`` and ``sha256()``); each instance in turn
is stopped and started again as the next release (same index, same local disk), while the other still
runs the released one. Every status the instances write meanwhile is watched for a NACK.
"""

from __future__ import annotations

import signal
import threading
import time

import pytest

from relay_engine.core import config
from relay_engine.core.wire import NACK, InstanceStatus, WireError
from tests import schema_next
from tests.workers.fleet import START_TIMEOUT_S, Fleet, wait_for
from workers.pool import spawn_instance, wait_until_live

pytestmark = pytest.mark.integration

CONVERGE_S = 30.0


class NackWatch:
    """Reads every instance's status every few ms on a thread; ``nacks`` holds each NACK seen."""

    def __init__(self, pool: Fleet):
        self.pool = pool
        self.nacks: list[tuple[str, int, str]] = []
        self.reads = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, daemon=True)

    def _watch(self) -> None:
        keys = [self.pool.keys.status(name) for name in self.pool.names]
        while not self._stop.wait(0.005):
            for raw in self.pool.redis.mget(keys):
                try:
                    status = InstanceStatus.from_json(raw) if raw is not None else None
                except WireError:
                    continue
                self.reads += 1
                if status is not None and (status.config_state == NACK or status.nacked_generation):
                    self.nacks.append((status.instance, status.nacked_generation, status.error))

    def __enter__(self) -> NackWatch:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(5)


def publish_stored(pool: Fleet, spec: dict) -> int:
    """Publish as the control plane does: the validated plain form, hashed by the schema in this process."""
    policy = config.parse_policy(spec)
    revision = pool.desired_revision(policy.to_dict(), sha256=policy.sha256())
    pool.redis.set(pool.keys.desired, revision.to_json())
    pool.redis.publish(pool.keys.poke_channel, str(revision.generation))
    return revision.generation


def acked(pool: Fleet, generation: int, sha256: str | None = None) -> bool:
    return all(s.config_state == "ACK" and s.applied_generation == generation
               and (sha256 is None or s.applied_sha256 == sha256) for s in pool.running_statuses())


def upgrade(pool: Fleet, index: int) -> None:
    """Stop instance ``index`` and start it again as the next release, on the same local disk."""
    name = pool.names[index]
    old = pool.procs[name]
    old.send_signal(signal.SIGTERM)
    old.wait(30)
    log = (pool.logdir / f"{name}.next.log").open("w")
    pool.procs[name] = spawn_instance(pool.settings, index, module="tests.schema_next", stdout=log,
                                      stderr=log)
    wait_for(lambda: pool.status(name).pid == pool.procs[name].pid, START_TIMEOUT_S,
             what=f"{name} restarted as the next release")
    wait_until_live(pool.redis, pool.settings, [name], START_TIMEOUT_S, [pool.procs[name]])


def test_upgrading_a_running_pool_to_a_schema_with_a_new_field_nacks_nothing(redis_url, tmp_path, monkeypatch):
    pool = Fleet(redis_url, tmp_path, pool="upgrade", size=2).start()
    try:
        current = config.parse_policy({"cache": {"hbm_budget_mb": 310.0}})
        generation = publish_stored(pool, current.to_dict())
        wait_for(lambda: acked(pool, generation, current.sha256()), CONVERGE_S, what="ACK before the upgrade")
        with NackWatch(pool) as watch:
            upgrade(pool, 0)
            wait_for(lambda: acked(pool, generation, current.sha256()), CONVERGE_S,
                     what="the upgraded instance ACKing the revision stored before the upgrade")
            # A pool half upgraded, and the control plane upgraded too: a new revision that leaves the new
            # field at its default is one the released instance accepts as well.
            schema_next.install(monkeypatch)
            mixed = publish_stored(pool, {**current.to_dict(), "cache": {"hbm_budget_mb": 311.0}})
            wait_for(lambda: acked(pool, mixed), CONVERGE_S, what="ACK of a revision by a half-upgraded pool")
            upgrade(pool, 1)
            wait_for(lambda: acked(pool, mixed), CONVERGE_S, what="ACK after the whole pool was upgraded")
            uses_it = publish_stored(pool, {"trigger": {schema_next.NEW_FIELD: 9.0}})
            wait_for(lambda: acked(pool, uses_it), CONVERGE_S, what="ACK of a revision setting the new field")
            time.sleep(2 * 1.0)  # two reconcile periods: a late NACK would show
        assert watch.reads > 100, "the watch read too few statuses to have seen a NACK"
        assert watch.nacks == [], f"NACKs during the upgrade: {watch.nacks[:3]}"
        assert all(s.tiers["hbm"]["budget_bytes"] == 1024 * 2**20 for s in pool.running_statuses())
    finally:
        pool.stop()
