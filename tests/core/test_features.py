"""Feature-side id canonicalisation: the alias map."""

from __future__ import annotations

import pytest
import torch

from relay_engine.core.features import AliasMap
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
