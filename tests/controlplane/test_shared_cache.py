"""The shared cache's serializer: JSON values round-trip, integers stay raw (Redis INCR counts them),
and what is not JSON is an error naming it, never loaded as code."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from controlplane.common.cache import CacheValueError, JSONSerializer
from tests.security.payloads import pickle_that_creates

SERIALIZER = JSONSerializer()
JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False) | st.text(),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(), inner, max_size=4), max_leaves=12)


@given(JSON_VALUES)
def test_every_json_value_round_trips(value):
    assert SERIALIZER.loads(SERIALIZER.dumps(value)) == value


@given(st.integers(min_value=-(2**63), max_value=2**63 - 1))
def test_integers_are_stored_raw_for_incr(count):
    assert SERIALIZER.dumps(count) == count
    assert SERIALIZER.loads(str(count).encode()) == count


def test_true_stays_a_boolean():
    assert SERIALIZER.loads(SERIALIZER.dumps(True)) is True


@pytest.mark.parametrize("stored", [b"\x80\x04not json", b"[" * 100_000, b"9" * 5000, b""])
def test_what_is_not_json_is_an_error_not_a_value(stored):
    with pytest.raises(CacheValueError, match="not a JSON value"):
        SERIALIZER.loads(stored)


def test_a_pickle_is_refused_unloaded(tmp_path):
    marker = tmp_path / "unpickled"
    with pytest.raises(CacheValueError):
        SERIALIZER.loads(pickle_that_creates(marker))
    assert not marker.exists()
