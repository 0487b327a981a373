"""The policy schema: strict, every error by field path, canonical hashing."""

from __future__ import annotations

import dataclasses
import math

import pytest

from relay_engine.core import config
from relay_engine.core.config import (
    PolicyError,
    default_policy,
    parse_policy,
    sha256_of,
    to_plain,
    validate_policy,
)
from relay_engine.core.lower_tiers import PolicySection, integer_field
from tests import schema_next

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


def test_a_policy_without_a_cache_must_not_pre_infer():
    with pytest.raises(PolicyError) as info:
        parse_policy({"cache": {"enabled": False}})
    assert set(info.value.errors) == {"cache.enabled"}
    assert "trigger.max_preinfer_inflight must be 0" in info.value.errors["cache.enabled"][0]
    assert errors_of({"cache": {"enabled": "no"}}) == {"cache.enabled": ["must be true or false, got 'no'"]}
    off = parse_policy({"cache": {"enabled": False}, "trigger": {"max_preinfer_inflight": 0}})
    assert off.to_dict()["cache"]["enabled"] is False
    assert "enabled" not in parse_policy({"cache": {"enabled": True}}).to_dict()["cache"]  # the default keeps its hash


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


# --- low-rank (input-dependent) edits --------------------------------------------------------------

R2 = [[1, 0, 0, 0, 0, 0], [0, 1, 0, 0, 0, 0]]  # rank 2 over heads [0, 1] (2 × head_dim 3 = 6 wide)


def lowrank_map(**changes) -> dict:
    return {"layer": 1, "heads": [0, 1], "rotation": R2, "source_weight": [[0.5] * 6, [0.1] * 6],
            "source_bias": [0.0, 1.0], "alpha": 1.0, **changes}


def test_a_lowrank_map_parses_with_its_shapes_and_defaults():
    without_alpha = {k: v for k, v in lowrank_map().items() if k != "alpha"}
    spec = parse_policy({"editing": {"fingerprint": FP, "lowrank": [without_alpha]}})
    (m,) = spec.editing.lowrank
    assert (m.layer, m.heads, m.rank, m.alpha) == (1, (0, 1), 2, 1.0)
    assert spec.editing.scope == "candidates", "an edit leaves the prefix alone unless asked"
    assert parse_policy(spec.to_dict()) == spec and spec.edit_hash() != "none"


@pytest.mark.parametrize(("changes", "path", "fragment"), [
    ({"layer": 2}, "editing.lowrank[0].layer", "[0, 1]"),
    ({"heads": [0, 4]}, "editing.lowrank[0].heads", "[0, 3]"),
    ({"heads": []}, "editing.lowrank[0].heads", "empty"),
    ({"heads": [1, 1]}, "editing.lowrank[0].heads", "twice"),
    ({"heads": [0]}, "editing.lowrank[0].rotation[0]", "len(heads)·head_dim is 3"),
    ({"rotation": []}, "editing.lowrank[0].rotation", "non-empty"),
    ({"rotation": [[1, 0, 0, 0, 0, math.nan], [0] * 6]}, "editing.lowrank[0].rotation[0]", "finite"),
    ({"rotation": [[0] * 6] * 7}, "editing.lowrank[0].rotation", "at most 6"),
    ({"source_weight": [[0] * 6]}, "editing.lowrank[0].source_weight", "rank is 2"),
    ({"source_bias": [0, 0, 0]}, "editing.lowrank[0].source_bias", "rank is 2"),
    ({"alpha": math.inf}, "editing.lowrank[0].alpha", "finite"),
    ({"gamma": 1}, "editing.lowrank[0].gamma", "unknown"),
])
def test_lowrank_errors_name_the_map_and_field(changes, path, fragment):
    errors = errors_of({"editing": {"fingerprint": FP, "lowrank": [lowrank_map(**changes)]}})
    assert path in errors and any(fragment in m for m in errors[path]), errors


def test_a_lowrank_map_needs_its_parts():
    errors = errors_of({"editing": {"fingerprint": FP, "lowrank": [{"layer": 0}]}})
    assert {f"editing.lowrank[0].{k}" for k in ("heads", "rotation", "source_weight", "source_bias")} <= set(errors)


def test_a_head_takes_one_lowrank_map_per_layer():
    errors = errors_of({"editing": {"fingerprint": FP, "lowrank": [lowrank_map(), lowrank_map(heads=[1, 2])]}})
    assert "already edited by editing.lowrank[0]" in errors["editing.lowrank[1].heads"][0]
    other_layer = parse_policy({"editing": {"fingerprint": FP, "lowrank": [lowrank_map(), lowrank_map(layer=0)]}})
    assert len(other_layer.editing.lowrank) == 2


def test_lowrank_maps_are_size_limited_before_their_numbers_are_read():
    wide = {"num_layers": 1, "num_heads": 64, "head_dim": 4096}
    row = [0.0] * (64 * 4096)
    errors = errors_of({"editing": {"fingerprint": wide, "lowrank": [
        {"layer": 0, "heads": list(range(64)), "rotation": [row] * 64, "source_weight": [row] * 64,
         "source_bias": [0.0] * 64}]}})
    assert "at most 1048576" in errors["editing.lowrank"][0]


def test_a_section_without_lowrank_maps_keeps_the_plain_form_and_hash_it_had():
    section = {"fingerprint": FP, "scope": "all", "provenance": {},
               "edits": [{"layer": 0, "head": 0, "direction": [1.0, 2.0, 3.0], "alpha": 1.0}]}
    spec = parse_policy({"editing": section})
    assert spec.to_dict()["editing"] == section
    assert spec.editing.content_hash() == sha256_of(section)


# --- adding a field (README, "Adding a policy field") ----------------------------------------

# A revision as the control plane stored it before any field was added: the plain form and its sha256.
STORED_BEFORE_AN_UPGRADE = {
    "trigger": {"at_risk_seq_len": 512, "latency_model": None, "admit_all": False, "max_preinfer_inflight": 4,
                "max_preinfer_tokens_per_s": 2000000.0, "ranking_p99_slo_ms": 40.0, "preinfer_compute_share": 0.25},
    "cache": {"hbm_budget_mb": 310.0, "dram_budget_mb": 4096.0, "entry_ttl_ms": 120000, "dram_ttl_ms": 600000},
    "slo": {"target_ratio": 0.99}, "editing": None, "schema_version": 1,
}
STORED_SHA256 = "6afe5c0969528c5b3fac7f1d4273c59e33b22421b7d1c533718b278d585a584a"
# Every field of the schema as revisions were first stored; a field beyond these is an ``added_field``.
BASELINE_FIELDS = {
    "PolicySpec": {"trigger", "cache", "slo", "editing", "schema_version"},
    "TriggerPolicy": {"at_risk_seq_len", "latency_model", "admit_all", "max_preinfer_inflight",
                      "max_preinfer_tokens_per_s", "ranking_p99_slo_ms", "preinfer_compute_share"},
    "LatencyModel": {"base_ms", "per_token_ms", "per_token_sq_ms"},
    "CacheBudget": {"hbm_budget_mb", "dram_budget_mb", "entry_ttl_ms", "dram_ttl_ms"},
    "SLO": {"target_ratio"},
    "EditingConfig": {"fingerprint", "edits", "scope", "provenance"},
    "ModelFingerprint": {"num_layers", "num_heads", "head_dim"},
    "HeadEdit": {"layer", "head", "direction", "alpha"},
    "LowRankEdit": {"layer", "heads", "rotation", "source_weight", "source_bias", "alpha"},
}


def test_a_stored_revision_keeps_its_sha256_under_todays_schema():
    assert sha256_of(STORED_BEFORE_AN_UPGRADE) == STORED_SHA256
    assert parse_policy(STORED_BEFORE_AN_UPGRADE).sha256() == STORED_SHA256
    assert parse_policy(STORED_BEFORE_AN_UPGRADE).to_dict() == STORED_BEFORE_AN_UPGRADE


def test_a_stored_revision_keeps_its_sha256_after_a_field_with_a_default_is_added(monkeypatch):
    schema_next.install(monkeypatch)
    policy = config.parse_policy(STORED_BEFORE_AN_UPGRADE)
    assert getattr(policy.trigger, schema_next.NEW_FIELD) == schema_next.NEW_DEFAULT
    assert policy.to_dict() == STORED_BEFORE_AN_UPGRADE
    assert policy.sha256() == STORED_SHA256
    assert config.revision_policy(STORED_BEFORE_AN_UPGRADE, STORED_SHA256) == policy


def test_a_new_field_set_away_from_its_default_is_stored_and_hashed(monkeypatch):
    schema_next.install(monkeypatch)
    changed = config.parse_policy({**STORED_BEFORE_AN_UPGRADE, "trigger": {schema_next.NEW_FIELD: 9.0}})
    assert changed.to_dict()["trigger"][schema_next.NEW_FIELD] == 9.0
    assert changed.sha256() != config.parse_policy({}).sha256()
    assert config.parse_policy({"trigger": {schema_next.NEW_FIELD: schema_next.NEW_DEFAULT}}).sha256() \
        == config.parse_policy({}).sha256()


def test_every_field_beyond_the_baseline_is_declared_as_added():
    seen = set()
    for cls in (config.PolicySpec, config.TriggerPolicy, config.LatencyModel, config.CacheBudget, config.SLO,
                config.EditingConfig, config.ModelFingerprint, config.HeadEdit, config.LowRankEdit):
        seen.add(cls.__name__)
        for f in dataclasses.fields(cls):
            assert f.name in BASELINE_FIELDS[cls.__name__] or f.metadata.get(config.OMIT_WHEN_DEFAULT), (
                f"{cls.__name__}.{f.name} is new: declare it with config.added_field(default) (README, "
                "'Adding a policy field'), or every stored revision changes its sha256")
    assert seen == set(BASELINE_FIELDS)


def test_a_revision_whose_spec_is_not_its_sha256_is_refused():
    with pytest.raises(config.DigestMismatch, match="sha256: the revision says"):
        config.revision_policy({**STORED_BEFORE_AN_UPGRADE, "slo": {"target_ratio": 0.98}}, STORED_SHA256)


def test_a_revision_stored_before_the_rule_hashed_as_stored_is_accepted():
    legacy = {**STORED_BEFORE_AN_UPGRADE, "trigger": {"at_risk_seq_len": 512, "ranking_p99_slo_ms": 40.0}}
    assert config.revision_policy(legacy, sha256_of(legacy)).trigger.ranking_p99_slo_ms == 40.0


def test_the_disk_tier_is_off_by_default_and_leaves_the_hash_of_a_spec_without_it_alone():
    plain = parse_policy({"cache": {"hbm_budget_mb": 512}})
    assert plain.cache.disk is None and "disk" not in plain.to_dict()["cache"]
    assert parse_policy({"cache": {"hbm_budget_mb": 512, "disk": None}}).sha256() == plain.sha256()
    with_disk = parse_policy({"cache": {"hbm_budget_mb": 512, "disk": {"path": "/var/cache/relaygr"}}})
    assert with_disk.sha256() != plain.sha256()
    assert with_disk.cache.disk.budget_mb == 16 * 1024 and with_disk.cache.disk.ttl_ms == 3_600_000
    assert parse_policy(with_disk.to_dict()) == with_disk


def test_every_error_of_the_disk_section_is_named_by_field():
    with pytest.raises(PolicyError) as info:
        parse_policy({"cache": {"disk": {"path": "relative/dir", "budget_mb": -1, "ttl_ms": 0, "size": 3}}})
    assert set(info.value.errors) == {"cache.disk.path", "cache.disk.budget_mb", "cache.disk.ttl_ms",
                                      "cache.disk.size"}


def test_the_features_section_is_off_by_default_leaves_the_hash_alone_and_names_its_field():
    from relay_engine.core.config import PolicySpec

    plain = PolicySpec()
    assert "features" not in plain.to_dict()  # a spec stored before the section keeps its sha256
    on = parse_policy({"features": {"dedup_events_within_s": 1.5}})
    assert on.features.dedup_events_within_s == 1.5 and on.to_dict()["features"] == {"dedup_events_within_s": 1.5}
    assert parse_policy(on.to_dict()).sha256() == on.sha256() != plain.sha256()
    assert parse_policy({"features": {"dedup_events_within_s": None}}).sha256() == plain.sha256()
    with pytest.raises(PolicyError) as err:
        parse_policy({"features": {"dedup_events_within_s": -1, "dedup": 1}})
    assert set(err.value.errors) == {"features.dedup_events_within_s", "features.dedup"}


def test_a_field_added_to_a_tier_section_leaves_the_hash_of_a_section_without_it_alone():
    before = PolicySection("t", "n", "on", (integer_field("ttl_ms", 5, 1, 10, label="", unit="", help=""),))
    added = integer_field("depth", 2, 1, 9, label="", unit="", help="")
    after = PolicySection("t", "n", "on", (*before.fields, dataclasses.replace(added, added=True)))
    old, new = config._section_type("probe", before)(ttl_ms=7), config._section_type("probe", after)(ttl_ms=7)
    assert sha256_of(new) == sha256_of(old) and "depth" not in to_plain(new)
    assert to_plain(config._section_type("probe", after)(ttl_ms=7, depth=3))["depth"] == 3
