"""Feature-side canonicalisation: the alias map, duplicate events, both in order."""

from __future__ import annotations

import pytest
import torch

from relay_engine.core.features import AliasMap, Canonical, EventDedup
from relay_engine.core.model import History


def test_the_alias_map_writes_every_item_under_its_canonical_id():
    alias_map = AliasMap([0, 1, 2, 1, 0])  # ids 3 and 4 are aliases of 1 and 0
    h = History.from_lists([4, 2, 3, 1], [1, 2, 3, 4], [10, 20, 30, 40])
    mapped = alias_map.apply(h)
    assert mapped.items.tolist() == [0, 2, 1, 1]
    assert torch.equal(mapped.actions, h.actions) and torch.equal(mapped.timestamps, h.timestamps)
    assert alias_map.apply(mapped).digest() == mapped.digest(), "applying it twice is applying it once"
    assert alias_map.apply(History.from_lists([0, 2, 1, 1], [1, 2, 3, 4], [10, 20, 30, 40])).digest() \
        == mapped.digest(), "two writings of one history share a cache key"


@pytest.mark.parametrize(("table", "fragment"), [
    ([], "non-empty"),
    ([[0, 1]], "1-D"),
    ([0, 1, 5], "alias_map[2]: 5 is not an item id in [0, 2]"),
    ([0, 2, 1], "alias_map[1]: maps to 2, which is itself an alias of 1"),
])
def test_a_bad_alias_map_is_refused_naming_the_entry(table, fragment):
    with pytest.raises(ValueError, match=fragment.replace("[", r"\[").replace("]", r"\]")):
        AliasMap(table)


def test_an_item_beyond_the_map_is_refused():
    with pytest.raises(ValueError, match=r"items: ids must be in \[0, 2\]"):
        AliasMap([0, 1, 2]).apply(History.from_lists([0, 3], [1, 1]))


def test_an_event_logged_twice_within_the_tolerance_is_one_event_and_one_cache_key():
    once = History.from_lists([5, 7, 9], [1, 2, 1], [100, 200, 300])
    twice = History.from_lists([5, 7, 7, 9], [1, 2, 2, 1], [100, 200, 201, 300])  # 7 logged again 1 s later
    dedup = EventDedup(tolerance_s=1.0)
    assert dedup.apply(twice).items.tolist() == [5, 7, 9]
    assert dedup.apply(twice).digest() == dedup.apply(once).digest() == once.digest()
    assert dedup.apply(dedup.apply(twice)).digest() == dedup.apply(twice).digest(), "idempotent"
    run = History.from_lists([7, 7, 7], [2, 2, 2], [200, 201, 202])
    assert dedup.apply(run).items.tolist() == [7], "a run of repeats collapses whole"


@pytest.mark.parametrize(("items", "actions", "ts", "why"), [
    ([7, 7], [2, 2], [200, 205], "later than the tolerance: a second view"),
    ([7, 7], [2, 3], [200, 200], "another action on the item"),
    ([7, 8, 7], [2, 2, 2], [200, 200, 200], "not adjacent: something came between"),
])
def test_what_is_not_a_repeat_is_kept(items, actions, ts, why):
    h = History.from_lists(items, actions, ts)
    assert EventDedup(1.0).apply(h).items.tolist() == items, why


def test_without_timestamps_nothing_collapses_and_a_bad_tolerance_is_refused():
    h = History.from_lists([7, 7], [2, 2])
    assert EventDedup(1.0).apply(h) is h
    with pytest.raises(ValueError, match="tolerance_s"):
        EventDedup(-1)


def test_ids_are_canonicalised_before_repeats_are_found():
    # 3 is an alias of 1: the same behaviour logged once under each id is a repeat once ids are canonical.
    h = History.from_lists([3, 1, 2], [1, 1, 1], [50, 50, 60])
    both = Canonical(AliasMap([0, 1, 2, 1]), EventDedup(1.0))
    assert both.apply(h).items.tolist() == [1, 2]
