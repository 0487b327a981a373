"""The policy schema: strict, every error by field path, canonical hashing."""

from __future__ import annotations

import math

import pytest

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
