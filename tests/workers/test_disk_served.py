"""The local-disk tier served by real workers: a revision naming a disk directory is ACKed, a prefix
evicted from HBM and from DRAM comes back from disk with exact scores, the tier's figures reach
telemetry through the generic per-tier path, and a revision without the section turns it off."""

from __future__ import annotations

import time

import pytest
import torch

from relay_engine.core.features import SyntheticFeatures
from relay_engine.core.model import HSTUModel
from relay_engine.core.telemetry import Snapshot
from tests.workers.fleet import wait_for
from workers.settings import MODELS

pytestmark = pytest.mark.integration

CONVERGE_S = 3.0
REL_TOL = 1e-5
REQUEST = {"seq_len": 96, "short_len": 6, "n_candidates": 32}


def acked(fleet, generation: int) -> bool:
    statuses = fleet.statuses()
    return len(statuses) == len(fleet.names) and all(
        s.config_state == "ACK" and s.applied_generation == generation for s in statuses.values())


def users_on_one_instance(fleet, count: int) -> tuple[str, list[str]]:
    by_instance: dict[str, list[str]] = {}
    for i in range(400):
        user = f"disk-user-{i}"
        users = by_instance.setdefault(fleet.client.route(user), [])
        users.append(user)
        if len(users) == count:
            return fleet.client.route(user), users
    raise AssertionError(f"400 users do not put {count} on one instance")


def latest_snapshot(fleet, name: str) -> Snapshot:
    entries = fleet.redis.xrevrange(fleet.keys.telemetry("1s", name), count=1)
    return Snapshot.from_entry(entries[0][1]["d"])


def test_a_prefix_evicted_past_dram_is_served_from_disk_exactly_and_counted(fleet, tmp_path):
    config = MODELS["small"]
    per_prefix_mb = config.kv_bytes_per_token() * REQUEST["seq_len"] / 2**20
    room_for_one = 1.5 * per_prefix_mb
    disk_dir = tmp_path / "kv"
    spec = {"cache": {"hbm_budget_mb": room_for_one, "dram_budget_mb": room_for_one,
                      "disk": {"path": str(disk_dir), "budget_mb": 64}}}
    instance, users = users_on_one_instance(fleet, 3)
    try:
        generation = fleet.publish(spec)
        wait_for(lambda: acked(fleet, generation), CONVERGE_S, what=f"ACK of generation {generation} (disk tier)")
        for i, user in enumerate(users):  # each evicts the one before it: HBM → DRAM → disk
            assert fleet.client.rank(user, query_index=i, deadline_s=time.time() + 10, **REQUEST).source == "miss"
        reply = fleet.client.rank(users[0], query_index=9, deadline_s=time.time() + 10, **REQUEST)
        assert reply.source == "disk" and reply.instance == instance

        features = SyntheticFeatures(config)
        reference = HSTUModel(config).rank_full(features.prefix(users[0], REQUEST["seq_len"]),
                                                features.short_term(users[0], 9, REQUEST["short_len"]),
                                                features.candidates(9, REQUEST["n_candidates"]))
        err = float((torch.tensor(reply.scores, dtype=torch.float64) - reference.double()).abs().max()
                    / reference.double().abs().max())
        assert err <= REL_TOL

        def disk_figures() -> dict:
            return latest_snapshot(fleet, instance).tiers.get("disk", {})

        wait_for(lambda: disk_figures().get("hits", 0) >= 1, 3.0, what="the disk tier's hit in telemetry")
        snap = latest_snapshot(fleet, instance)
        assert snap.counters["disk_hits"] >= 1
        assert snap.tiers["disk"]["budget_bytes"] == 64 * 2**20
        assert list(snap.tiers) == ["hbm", "dram", "disk"]
        assert any(disk_dir.iterdir())  # the instance's own subdirectory
    finally:
        restore = fleet.publish({})  # the package's other tests expect the default pool
        wait_for(lambda: acked(fleet, restore), CONVERGE_S, what="ACK of the default revision")
    wait_for(lambda: "disk" not in latest_snapshot(fleet, instance).tiers, 3.0, what="the disk tier turned off")
    assert not any(p.is_file() for p in disk_dir.rglob("*"))
