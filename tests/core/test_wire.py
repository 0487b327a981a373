"""Words both sides of the wire speak: instance names and the live-member listing."""

from __future__ import annotations

import pytest

from relay_engine.core.wire import (
    MAX_INSTANCE_INDEX,
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
