"""The policy schema: strict, every error by field path, canonical hashing."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from relay_engine.core.config import PolicyError, default_policy, parse_policy, validate_policy

FP = {"num_layers": 2, "num_heads": 4, "head_dim": 3}


def errors_of(data) -> dict[str, list[str]]:
    spec, errors = validate_policy(data)
    assert spec is None
    return errors


def test_empty_spec_is_the_defaults():
    assert parse_policy({}) == default_policy()


def test_round_trip_through_dict():
    spec = parse_policy({"trigger": {"at_risk_seq_len": 900}, "cache": {"hbm_budget_mb": 12.5},
                         "editing": {"fingerprint": FP, "edits": [
                             {"layer": 1, "head": 3, "direction": [1, 0, 0], "alpha": 3}]}})
    assert parse_policy(spec.to_dict()) == spec
    assert spec.sha256() == parse_policy(spec.to_dict()).sha256()


@pytest.mark.parametrize(("data", "path", "fragment"), [
    ({"trigger": {"at_risk_seq_len": -1}}, "trigger.at_risk_seq_len", "[0, 1048576]"),
    ({"trigger": {"at_risk_seq_len": True}}, "trigger.at_risk_seq_len", "integer"),
    ({"trigger": {"at_risk_seq_len": "512"}}, "trigger.at_risk_seq_len", "integer"),
    ({"trigger": {"max_preinfer_tokens_per_s": math.nan}}, "trigger.max_preinfer_tokens_per_s", "finite"),
    ({"trigger": {"ranking_p99_slo_ms": 0}}, "trigger.ranking_p99_slo_ms", "(0,"),
    ({"cache": {"hbm_budget_mb": -5}}, "cache.hbm_budget_mb", "[0,"),
    ({"cache": {"hbm_budget_mb": math.inf}}, "cache.hbm_budget_mb", "finite"),
    ({"cache": {"entry_ttl_ms": 0}}, "cache.entry_ttl_ms", "[1,"),
    ({"cache": {"hbm_budjet_mb": 5}}, "cache.hbm_budjet_mb", "unknown field"),
    ({"triger": {}}, "triger", "unknown field"),
    ({"cache": []}, "cache", "object"),
    ({"slo": {"target_ratio": 1.5}}, "slo.target_ratio", "(0, 1]"),
    ({"trigger": {"at_risk_seq_len": None}}, "trigger.at_risk_seq_len", "latency_model"),
    ({"schema_version": 2}, "schema_version", "must be 1"),
])
def test_each_bad_value_is_reported_at_its_path(data, path, fragment):
    errors = errors_of(data)
    assert path in errors, errors
    assert any(fragment in m for m in errors[path]), errors[path]


def test_all_errors_are_reported_not_just_the_first():
    errors = errors_of({"trigger": {"at_risk_seq_len": -1, "max_preinfer_inflight": 1.5},
                        "cache": {"dram_ttl_ms": "x"}, "bogus": 1})
    assert set(errors) == {"trigger.at_risk_seq_len", "trigger.max_preinfer_inflight", "cache.dram_ttl_ms", "bogus"}


@pytest.mark.parametrize(("edit", "path", "fragment"), [
    ({"layer": 2, "head": 0, "direction": [1, 2, 3], "alpha": 1}, "editing.edits[0].layer", "[0, 1]"),
    ({"layer": 0, "head": 4, "direction": [1, 2, 3], "alpha": 1}, "editing.edits[0].head", "[0, 3]"),
    ({"layer": 0, "head": 0, "direction": [1, 2], "alpha": 1}, "editing.edits[0].direction", "head_dim is 3"),
    ({"layer": 0, "head": 0, "direction": [1, math.nan, 3], "alpha": 1}, "editing.edits[0].direction", "finite"),
    ({"layer": 0, "head": 0, "direction": [1, 2, 3], "alpha": math.inf}, "editing.edits[0].alpha", "finite"),
    ({"layer": 0, "head": 0, "direction": [1, 2, 3]}, "editing.edits[0].alpha", "required"),
    ({"layer": 0, "head": 0, "direction": [1, 2, 3], "alpha": 1, "beta": 2}, "editing.edits[0].beta", "unknown"),
])
def test_editing_errors_name_the_edit(edit, path, fragment):
    errors = errors_of({"editing": {"fingerprint": FP, "edits": [edit]}})
    assert path in errors and any(fragment in m for m in errors[path]), errors


def test_duplicate_heads_are_refused():
    e = {"layer": 1, "head": 1, "direction": [0, 0, 1], "alpha": 1}
    errors = errors_of({"editing": {"fingerprint": FP, "edits": [e, dict(e)]}})
    assert "duplicates edits[0]" in errors["editing.edits[1]"][0]


def test_parse_raises_with_every_error():
    with pytest.raises(PolicyError) as info:
        parse_policy({"cache": {"hbm_budget_mb": -1, "dram_budget_mb": -1}})
    assert set(info.value.errors) == {"cache.hbm_budget_mb", "cache.dram_budget_mb"}


def test_hash_is_canonical_and_edit_hash_follows_the_edits():
    a = parse_policy({"cache": {"hbm_budget_mb": 10, "dram_budget_mb": 20}})
    b = parse_policy({"cache": {"dram_budget_mb": 20, "hbm_budget_mb": 10.0}})
    assert a.sha256() == b.sha256()
    assert a.edit_hash() == "none"
    edited = parse_policy({"editing": {"fingerprint": FP, "edits": [
        {"layer": 0, "head": 0, "direction": [1, 2, 3], "alpha": 1}]}})
    other = parse_policy({"editing": {"fingerprint": FP, "edits": [
        {"layer": 0, "head": 0, "direction": [1, 2, 3], "alpha": 2}]}})
    assert edited.edit_hash() != other.edit_hash() != "none"


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
