"""Canary rollouts on a real pool: worker processes (``tests.workers.fleet.Fleet``: ``python -m
workers.instance`` on the small model, their own reconcilers) meet the control plane, whose API runs
in this process, in the real Redis under one key prefix. The API-level rules are in ``test_rollouts``
(with stand-in instances); here the instances' own decoding of what the control plane writes is judged.
"""

from __future__ import annotations

import pytest

from controlplane.policies import services as policy_services
from relay_engine.core.wire import ACK, NACK, DesiredRevision, InstanceStatus
from tests.workers.fleet import Fleet, wait_for

pytestmark = [pytest.mark.integration, pytest.mark.slow]

POOL = "ranking-a"
BASE = f"/api/v1/pools/{POOL}"
ABORTS = 70  # more than the 64 generations a record could revoke one by one
STEP_S = 60.0  # generous: a poke is answered in milliseconds, a busy 2-core machine may take seconds


@pytest.fixture
def real_pool(pool, settings, redis_url, tmp_path, monkeypatch):
    """Two worker processes of the ``pool`` fixture's pool, on the control plane's generation 1."""
    fleet = Fleet(redis_url, tmp_path, pool=POOL, size=2)
    monkeypatch.setenv("RELAYGR_KEY_PREFIX", fleet.settings.key_prefix)
    settings.REDIS_URL = redis_url
    settings.RELAYGR_WRITE_THROTTLE_RATE = "100000/min"  # three writes per canary, seventy canaries
    try:
        fleet.start()
        policy_services.desired_push(pool=pool)
        yield fleet
    finally:
        fleet.stop()


class Watch:
    """Every status read while waiting, so a NACK seen on the way fails the test too."""

    def __init__(self, fleet: Fleet):
        self.fleet = fleet
        self.nacks: list[InstanceStatus] = []

    def running(self, name: str, generation: int) -> bool:
        status = self.fleet.status(name)
        if status.config_state == NACK:
            self.nacks.append(status)
        return status.config_state == ACK and status.applied_generation == generation

    def until(self, name: str, generation: int) -> None:
        wait_for(lambda: self.running(name, generation) or self.nacks, STEP_S,
                 what=f"{name} to ACK generation {generation} (now {self.fleet.status(name)})")
        assert not self.nacks, [(s.instance, s.nacked_generation, s.error) for s in self.nacks]


def test_seventy_aborted_canaries_in_a_row_end_with_every_instance_on_the_stable_generation(operator, real_pool):
    fleet, watch = real_pool, Watch(real_pool)
    canary, stable = fleet.names
    for step in range(ABORTS):
        created = operator.post(f"{BASE}/revisions/", {"parent_generation": 1 + step,
                                                       "spec": {"cache": {"hbm_budget_mb": 100 + step}}}, format="json")
        assert created.status_code == 201, created.content
        generation = created.json()["generation"]
        started = operator.post(f"{BASE}/revisions/{generation}/publish/", {
            "strategy": "canary", "canary_instances": 1, "bake_s": 3600, "max_burn": 1.0}, format="json")
        assert started.status_code == 201 and started.json()["canary"] == [canary], started.content
        watch.until(canary, generation)
        assert operator.post(f"{BASE}/rollout/abort/").status_code == 200
        watch.until(canary, 1)
        watch.until(stable, 1)

    record = DesiredRevision.from_json(fleet.redis.get(fleet.keys.desired))
    assert (record.generation, record.revoked) == (1, ((2, ABORTS + 1),))
    assert fleet.redis.get(fleet.keys.instance_desired(canary)) is None
