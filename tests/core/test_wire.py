"""Words both sides of the wire speak: instance names, the live-member listing and the status record."""

from __future__ import annotations

import json

import pytest

from relay_engine.core.wire import (
    MAX_INSTANCE_INDEX,
    InstanceStatus,
    PoolKeys,
    WireError,
    instance_index,
    instance_name,
    live_members,
)


@pytest.mark.parametrize("index", [0, 7, MAX_INSTANCE_INDEX])
def test_an_instance_name_parses_back_to_its_index(index):
    assert instance_index(instance_name("main", index), "main") == index


@pytest.mark.parametrize("name", ["main", "main.", "main.x", "other.3", "main.01", "main.-1", "main.²", "main.1.2",
                                  f"main.{MAX_INSTANCE_INDEX + 1}", "main." + "9" * 5000, 7, None, b"main.1"])
def test_a_malformed_instance_name_is_a_wire_error(name):
    with pytest.raises(WireError):
        instance_index(name, "main")


class _Members:
    """The one call ``live_members`` makes of a Redis client, answering from a dict (name → score)."""

    def __init__(self, scores: dict[str, float]):
        self.scores = scores

    def zrangebyscore(self, key, low, high):
        return [name for name, score in self.scores.items() if low <= score <= high]


def test_live_members_are_ordered_by_index_and_malformed_names_are_reported():
    client = _Members({"main.10": 100.0, "main.2": 100.0, "main.x": 100.0, "main.3": 50.0, "main.4": 1e9})
    names, bad = live_members(client, PoolKeys("main", prefix="t"), now=101.0)
    assert names == ["main.2", "main.10"]  # 3 is stale, 4 is beyond any clock skew
    assert bad == ["main.x"]


def test_live_members_of_a_client_that_does_not_decode_are_names():
    names, bad = live_members(_Members({b"main.1": 100.0, b"main.\xff": 100.0}), PoolKeys("main", prefix="t"), now=100.0)
    assert names == ["main.1"] and len(bad) == 1


# --- the status record's cache tiers ----------------------------------------------------------

def _status(**fields) -> str:
    return json.dumps({"instance": "p.0", "pool": "p", "device": "cpu", "pid": 7, "heartbeat_ts": 1e9,
                       "started_at": 1e9, **fields})


def test_a_status_carries_every_tier_it_runs_in_lookup_order():
    tiers = {"hbm": {"bytes": 1, "budget_bytes": 2}, "dram": {"bytes": 3, "budget_bytes": 4},
             "disk": {"bytes": 5, "budget_bytes": 6}}
    status = InstanceStatus.from_json(InstanceStatus.from_json(_status(tiers=tiers)).to_json())
    assert status.tiers == tiers and list(status.tiers) == ["hbm", "dram", "disk"]


def test_a_status_from_a_worker_before_per_tier_levels_reads_its_fixed_fields_as_tiers():
    old = _status(hbm_bytes=10, hbm_budget_bytes=20, dram_bytes=30, dram_budget_bytes=40)
    assert InstanceStatus.from_json(old).tiers == {"hbm": {"bytes": 10, "budget_bytes": 20},
                                                   "dram": {"bytes": 30, "budget_bytes": 40}}


def test_a_tier_level_this_side_does_not_know_is_dropped_and_one_left_out_is_0():
    status = InstanceStatus.from_json(_status(tiers={"hbm": {"bytes": 1, "budget_bytes": 2, "shiny": 3},
                                                     "dram": {"bytes": 4}}))
    assert status.tiers == {"hbm": {"bytes": 1, "budget_bytes": 2}, "dram": {"bytes": 4, "budget_bytes": 0}}
    old = InstanceStatus.from_json(_status(hbm_budget_bytes=20))
    assert old.tiers == {"hbm": {"bytes": 0, "budget_bytes": 20}}


@pytest.mark.parametrize(("tiers", "field"), [
    ([1, 2], "status.tiers"), ({"hbm": 5}, "status.tiers.hbm"), ({"hbm": {"bytes": -1}}, "status.tiers.hbm.bytes"),
    ({"hbm": {"bytes": "lots"}}, "status.tiers.hbm.bytes"), ({"no such": {}}, "status.tiers"),
    ({f"t{i}": {} for i in range(17)}, "status.tiers"),
])
def test_a_malformed_tiers_field_is_a_wire_error_naming_it(tiers, field):
    with pytest.raises(WireError, match=field.replace(".", r"\.")):
        InstanceStatus.from_json(_status(tiers=tiers))
