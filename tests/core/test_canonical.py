"""Canonical hashing: policies equal by value have one canonical JSON and one sha256, whatever the
spelling of their numbers (1 or 1.0, 0 or -0.0) or the order of their keys; a changed value changes it."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from relay_engine.core.config import parse_policy, validate_policy

FP = {"num_layers": 2, "num_heads": 4, "head_dim": 3}


def errors_of(data) -> dict[str, list[str]]:
    spec, errors = validate_policy(data)
    assert spec is None
    return errors


# --- canonical hashing, as a property: equal by value ⇒ one sha256 --------------------------------

NUMBER = st.one_of(st.integers(-10**6, 10**6), st.floats(-1e6, 1e6, allow_nan=False), st.just(0.0), st.just(-0.0))
PROVENANCE = st.recursive(
    st.one_of(st.none(), st.booleans(), NUMBER, st.text(max_size=5)),
    lambda inner: st.one_of(st.lists(inner, max_size=3), st.dictionaries(st.text(max_size=4), inner, max_size=3)),
    max_leaves=8)


@st.composite
def valid_specs(draw) -> dict:
    edits = [{"layer": layer, "head": head, "alpha": draw(st.floats(-10, 10)),
              "direction": draw(st.lists(st.sampled_from([0.0, -0.0, 1.0, 1, 0, -2.5, 3]), min_size=3, max_size=3))}
             for layer, head in draw(st.sets(st.tuples(st.integers(0, 1), st.integers(0, 3)), max_size=3))]
    return {
        "trigger": {"at_risk_seq_len": draw(st.integers(0, 4096)), "max_preinfer_inflight": draw(st.integers(0, 64)),
                    "max_preinfer_tokens_per_s": draw(st.sampled_from([0.0, -0.0, 5, 5.0, 1e6])),
                    "ranking_p99_slo_ms": draw(st.sampled_from([50, 50.0, 12.5]))},
        "cache": {"hbm_budget_mb": draw(st.sampled_from([0, 0.0, -0.0, 512, 512.0, 0.25])),
                  "entry_ttl_ms": draw(st.sampled_from([1000, 1000.0]))},
        "slo": {"target_ratio": draw(st.sampled_from([1, 1.0, 0.99]))},
        "editing": {"fingerprint": FP, "edits": edits, "scope": "candidates",
                    "provenance": {"run": draw(PROVENANCE)}},
    }


@st.composite
def respelled(draw, value):
    """``value`` with every number written another way it may be (1 ↔ 1.0, 0 ↔ -0.0) and keys reordered."""
    if isinstance(value, dict):
        keys = draw(st.permutations(list(value)))
        return {key: draw(respelled(value[key])) for key in keys}
    if isinstance(value, list):
        return [draw(respelled(item)) for item in value]
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return value
    spellings = [value, float(value)] + ([int(value)] if float(value).is_integer() else [])
    spellings += [-0.0, 0] if value == 0 else []
    return draw(st.sampled_from(spellings))


def same_json_value(a, b) -> bool:
    """Equal as JSON values: numbers by value, booleans and strings by what they are."""
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(same_json_value(a[k], b[k]) for k in a)
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(same_json_value(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, bool) or isinstance(b, bool):
        return type(a) is type(b) and a == b
    return a == b


@settings(max_examples=300, deadline=None)
@given(data=st.data())
def test_policies_equal_by_value_have_one_sha256(data):
    spec = data.draw(valid_specs())
    other = data.draw(respelled(spec))
    assert same_json_value(spec, other)
    first, second = parse_policy(spec), parse_policy(other)
    assert first.sha256() == second.sha256()
    assert first.canonical_json() == second.canonical_json()
    assert first.edit_hash() == second.edit_hash()
    assert parse_policy(first.to_dict()).sha256() == first.sha256()  # the stored form hashes as it says


@settings(max_examples=100, deadline=None)
@given(spec=valid_specs(), budget=st.floats(1, 1e6))
def test_a_changed_value_changes_the_sha256(spec, budget):
    before = parse_policy(spec)
    after = parse_policy({**spec, "cache": {**spec["cache"], "hbm_budget_mb": budget}})
    assert (before.sha256() == after.sha256()) == (before.cache.hbm_budget_mb == budget)


def test_negative_zero_and_zero_hash_alike_everywhere():
    spec = {"cache": {"hbm_budget_mb": 0}, "editing": {"fingerprint": FP, "provenance": {"x": 0}, "edits": [
        {"layer": 0, "head": 0, "direction": [0, 1, 0], "alpha": 0}]}}
    negative = {"cache": {"hbm_budget_mb": -0.0}, "editing": {"fingerprint": FP, "provenance": {"x": -0.0}, "edits": [
        {"layer": 0, "head": 0, "direction": [-0.0, 1, -0.0], "alpha": -0.0}]}}
    assert parse_policy(spec).sha256() == parse_policy(negative).sha256()
    assert "-0" not in parse_policy(negative).canonical_json()


def test_provenance_integers_beyond_2_63_are_refused_by_path():
    errors = errors_of({"editing": {"fingerprint": FP, "provenance": {"n": 10**400}}})
    assert "editing.provenance.n" in errors and "2^63" in errors["editing.provenance.n"][0]
