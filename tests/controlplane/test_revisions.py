"""Revisions: immutable generations, optimistic concurrency on the parent, strict validation."""

from __future__ import annotations

import hashlib
import importlib
import json
import math

import pytest

from controlplane.audit.models import AuditEntry
from controlplane.policies import services as policy_services
from controlplane.policies.models import ConfigRevision, Pool
from relay_engine.core import config
from relay_engine.core.config import ModelFingerprint, default_policy, parse_policy
from tests import schema_next
from tests.models import random_lowrank

POOL = "ranking-a"
REVISIONS = f"/api/v1/pools/{POOL}/revisions/"


def _counts() -> tuple[int, int, int]:
    return Pool.objects.count(), ConfigRevision.objects.count(), AuditEntry.objects.count()


def test_new_pool_starts_at_generation_one_with_the_defaults(admin, no_redis):
    response = admin.post("/api/v1/pools/", {"name": "fresh", "expected_instances": 4}, format="json")
    assert response.status_code == 201, response.content
    body = response.json()
    assert body["desired_generation"] == 1 and body["latest_generation"] == 1
    assert body["published_generation"] == 0  # no Redis yet: the sync delivers it later
    assert body["slo"] == {"ranking_p99_slo_ms": 50.0, "target_ratio": 0.99}
    first = admin.get("/api/v1/pools/fresh/revisions/1/").json()
    assert first["spec"] == default_policy().to_dict()
    assert first["sha256"] == default_policy().sha256()
    assert first["parent_generation"] is None


def test_duplicate_pool_is_409(admin, pool):
    before = _counts()
    response = admin.post("/api/v1/pools/", {"name": POOL}, format="json")
    assert response.status_code == 409
    assert _counts() == before


def test_revision_on_the_latest_parent_is_the_next_generation(operator, pool):
    spec = {"trigger": {"at_risk_seq_len": 1024}, "cache": {"hbm_budget_mb": 2048}}
    response = operator.post(REVISIONS, {"parent_generation": 1, "spec": spec, "comment": "longer prefixes"},
                             format="json")
    assert response.status_code == 201, response.content
    body = response.json()
    assert (body["generation"], body["parent_generation"], body["author"]) == (2, 1, "operator")
    # Stored normalised: defaults filled in, hash of the canonical JSON.
    assert body["spec"]["trigger"]["at_risk_seq_len"] == 1024
    assert body["spec"]["cache"]["dram_budget_mb"] == default_policy().cache.dram_budget_mb
    assert len(body["sha256"]) == 64
    # Creating does not publish.
    assert operator.get(f"/api/v1/pools/{POOL}/").json()["desired_generation"] == 1


def test_a_lowrank_edit_is_part_of_the_spec_a_revision_stores(operator, pool):
    section = random_lowrank(ModelFingerprint(2, 4, 3), seed=0, rank=2)
    response = operator.post(REVISIONS, {"parent_generation": 1, "spec": {"editing": section}}, format="json")
    assert response.status_code == 201, response.content
    stored = response.json()["spec"]["editing"]
    assert [(m["layer"], m["heads"]) for m in stored["lowrank"]] == [(0, [0, 1, 2, 3]), (1, [0, 1, 2, 3])]
    assert stored["scope"] == "candidates"
    assert response.json()["sha256"] == parse_policy({"editing": section}).sha256()


def test_stale_parent_is_409_and_writes_nothing(operator, pool):
    assert operator.post(REVISIONS, {"parent_generation": 1, "spec": {}}, format="json").status_code == 201
    before = _counts()
    response = operator.post(REVISIONS, {"parent_generation": 1, "spec": {"cache": {"hbm_budget_mb": 1}}},
                             format="json")
    assert response.status_code == 409
    assert "generation 2" in response.json()["detail"]
    assert "parent_generation" in response.json()["errors"]
    assert _counts() == before


def test_revisions_are_listed_newest_first(operator, pool):
    operator.post(REVISIONS, {"parent_generation": 1, "spec": {}}, format="json")
    listed = operator.get(REVISIONS).json()
    assert [r["generation"] for r in listed["results"]] == [2, 1]


def test_a_revision_says_whether_it_ever_was_the_pools_desired_generation(operator, pool, worker_factory):
    """What the editor offers rollback to: a canary that was not promoted, or a what-if made for a
    preview, never ran on the whole pool."""
    policy_services.desired_push(pool=pool)
    for index in range(2):
        worker_factory(POOL, index).reconcile()
    base = f"/api/v1/pools/{POOL}"
    canary = {"strategy": "canary", "canary_instances": 1, "bake_s": 600, "max_burn": 1.0}

    def create(parent: int, hbm_mb: int) -> int:
        response = operator.post(REVISIONS, {"parent_generation": parent, "spec": {"cache": {"hbm_budget_mb": hbm_mb}}},
                                 format="json")
        assert response.status_code == 201, response.content
        assert (response.json()["was_desired"], response.json()["rollout_state"]) == (False, None)
        return response.json()["generation"]

    def publish(generation: int, body: dict | None = None) -> None:
        response = operator.post(f"{REVISIONS}{generation}/publish/", body, format="json")
        assert response.status_code in (200, 201), response.content

    publish(create(1, 300))  # 2: published
    publish(create(2, 400), canary)  # 3: a canary, aborted
    assert operator.post(f"{base}/rollout/abort/").status_code == 200
    publish(create(3, 500), canary)  # 4: a canary, promoted
    assert operator.post(f"{base}/rollout/promote/").status_code == 200
    create(4, 600)  # 5: never published
    response = operator.post(f"{base}/rollback/", {"to_generation": 1, "parent_generation": 5}, format="json")
    assert response.status_code == 201, response.content  # 6: restores 1
    listed = {r["generation"]: (r["was_desired"], r["rollout_state"]) for r in operator.get(REVISIONS).json()["results"]}
    assert listed == {6: (True, None), 5: (False, None), 4: (True, "promoted"), 3: (False, "aborted"),
                      2: (True, None), 1: (True, None)}
    assert operator.get(f"{REVISIONS}3/").json()["was_desired"] is False


def test_diff_names_changed_paths(operator, pool):
    operator.post(REVISIONS, {"parent_generation": 1, "spec": {"trigger": {"max_preinfer_inflight": 9}}},
                  format="json")
    diff = operator.get(f"{REVISIONS}2/diff/").json()
    assert diff["against"] == 1
    assert diff["changes"] == [{"path": "trigger.max_preinfer_inflight", "op": "changed", "before": 4, "after": 9}]
    assert operator.get(f"{REVISIONS}1/diff/?against=2").json()["changes"][0]["before"] == 9
    assert operator.get(f"{REVISIONS}1/diff/?against=7").status_code == 404
    assert operator.get(f"{REVISIONS}1/diff/?against=x").status_code == 400


EDITING = {"fingerprint": {"num_layers": 2, "num_heads": 4, "head_dim": 3}}

# (body, the field path the error must name, a fragment of the message)
BAD_BODIES = [
    ({"parent_generation": "1", "spec": {}}, "parent_generation", "integer"),
    ({"parent_generation": True, "spec": {}}, "parent_generation", "integer"),
    ({"spec": {}}, "parent_generation", "required"),
    ({"parent_generation": 1}, "spec", "required"),
    ({"parent_generation": 1, "spec": {}, "specc": {}}, "specc", "Unknown field"),
    ({"parent_generation": 0, "spec": {}}, "parent_generation", "greater than or equal to 1"),
    ({"parent_generation": 1, "spec": []}, "spec", "must be an object"),
    ({"parent_generation": 1, "spec": {"triger": {}}}, "spec.triger", "unknown field"),
    ({"parent_generation": 1, "spec": {"trigger": {"at_risk_seqlen": 5}}}, "spec.trigger.at_risk_seqlen",
     "unknown field"),
    ({"parent_generation": 1, "spec": {"cache": {"hbm_budget_mb": -1}}}, "spec.cache.hbm_budget_mb",
     "must be in [0, "),
    ({"parent_generation": 1, "spec": {"cache": {"entry_ttl_ms": "soon"}}}, "spec.cache.entry_ttl_ms",
     "must be an integer in [1, "),
    ({"parent_generation": 1, "spec": {"trigger": {"ranking_p99_slo_ms": 0}}}, "spec.trigger.ranking_p99_slo_ms",
     "(0, 60000]"),
    ({"parent_generation": 1, "spec": {"slo": {"target_ratio": 1.5}}}, "spec.slo.target_ratio", "(0, 1]"),
    ({"parent_generation": 1, "spec": {"editing": {**EDITING, "edits": [
        {"layer": 2, "head": 0, "direction": [1, 0, 0], "alpha": 1}]}}}, "spec.editing.edits[0].layer",
     "must be in [0, 1]"),
    ({"parent_generation": 1, "spec": {"editing": {**EDITING, "edits": [
        {"layer": 0, "head": 9, "direction": [1, 0, 0], "alpha": 1}]}}}, "spec.editing.edits[0].head",
     "must be in [0, 3]"),
    ({"parent_generation": 1, "spec": {"editing": {**EDITING, "edits": [
        {"layer": 0, "head": 0, "direction": [1, 0], "alpha": 1}]}}}, "spec.editing.edits[0].direction",
     "head_dim is 3"),
    ({"parent_generation": 1, "spec": {"editing": {**EDITING, "lowrank": [
        {"layer": 0, "heads": [0], "rotation": [[1, 0]], "source_weight": [[0, 0, 0]], "source_bias": [0]}]}}},
     "spec.editing.lowrank[0].rotation[0]", "len(heads)·head_dim is 3"),
    ({"parent_generation": 1, "spec": {}, "comment": 5}, "comment", "valid string"),
]


@pytest.mark.parametrize(("body", "path", "fragment"), BAD_BODIES, ids=[b[1] + ":" + b[2] for b in BAD_BODIES])
def test_bad_input_is_400_naming_the_field_and_changes_nothing(operator, pool, body, path, fragment):
    before = _counts()
    response = operator.post(REVISIONS, body, format="json")
    assert response.status_code == 400, response.content
    errors = response.json()["errors"]
    assert path in errors, errors
    assert any(fragment in message for message in errors[path]), errors[path]
    assert _counts() == before


def test_every_spec_error_is_reported_at_once(operator, pool):
    spec = {"trigger": {"max_preinfer_inflight": -1}, "cache": {"hbm_budget_mb": -5, "dram_ttl_ms": 0}}
    errors = operator.post(REVISIONS, {"parent_generation": 1, "spec": spec}, format="json").json()["errors"]
    assert set(errors) == {"spec.trigger.max_preinfer_inflight", "spec.cache.hbm_budget_mb", "spec.cache.dram_ttl_ms"}


@pytest.mark.parametrize("constant", ["NaN", "Infinity", "-Infinity"])
def test_non_finite_numbers_are_400(operator, pool, constant):
    before = _counts()
    raw = '{"parent_generation": 1, "spec": {"cache": {"hbm_budget_mb": CONSTANT}}}'.replace("CONSTANT", constant)
    response = operator.post(REVISIONS, raw, content_type="application/json")
    assert response.status_code == 400
    assert _counts() == before


def test_malformed_json_is_400(operator, pool):
    response = operator.post(REVISIONS, '{"parent_generation": 1,', content_type="application/json")
    assert response.status_code == 400
    assert "JSON" in response.json()["detail"]


def test_oversized_body_is_413_and_changes_nothing(operator, pool, settings):
    before = _counts()
    huge = json.dumps({"parent_generation": 1, "spec": {}, "comment": "x" * (settings.RELAYGR_MAX_BODY_BYTES + 1)})
    response = operator.post(REVISIONS, huge, content_type="application/json")
    assert response.status_code == 413
    assert str(settings.RELAYGR_MAX_BODY_BYTES) in response.json()["detail"]
    assert _counts() == before


@pytest.mark.parametrize("path", [
    "/api/v1/pools/nope/", "/api/v1/pools/nope/revisions/", f"{REVISIONS}7/", f"{REVISIONS}7/diff/",
    f"{REVISIONS}99999999999999999999/", "/api/v1/pools/Bad Name/",
])
def test_unknown_pools_and_generations_are_404(viewer, pool, path):
    response = viewer.get(path)
    assert response.status_code == 404
    assert "detail" in response.json()


def test_unknown_generation_message_says_which_exist(viewer, pool):
    assert "generations are 1 to 1" in viewer.get(f"{REVISIONS}7/").json()["detail"]


@pytest.mark.parametrize("body", [
    {"name": "Has Caps"}, {"name": ""}, {"name": "x" * 64}, {"name": "ok", "expected_instances": 0},
    {"name": "ok", "expected_instances": 5000}, {"name": "ok", "device_kind": "tpu"}, {"name": "ok", "color": 1},
])
def test_bad_pool_is_400_and_creates_nothing(admin, pool, body):
    before = _counts()
    response = admin.post("/api/v1/pools/", body, format="json")
    assert response.status_code == 400, response.content
    assert response.json()["errors"]
    assert _counts() == before


def test_revision_rows_are_immutable(pool):
    revision = ConfigRevision.objects.get(pool=pool, generation=1)
    revision.comment = "rewritten"
    with pytest.raises(ValueError, match="immutable"):
        revision.save()


def test_spec_with_float_integers_is_normalised(operator, pool):
    body = {"parent_generation": 1, "spec": {"trigger": {"max_preinfer_inflight": 8.0}}}
    spec = operator.post(REVISIONS, body, format="json").json()["spec"]
    assert spec["trigger"]["max_preinfer_inflight"] == 8
    assert not math.isnan(spec["cache"]["hbm_budget_mb"])


def test_revisions_stored_before_canonical_hashing_verify_after_the_migration(pool):
    """A spec stored with -0.0 was hashed as written; the migration rewrites it in canonical form with
    the sha256 a worker recomputes, and leaves revisions already canonical as they were."""
    from django.apps import apps

    from relay_engine.core.config import parse_policy

    canonical_specs = importlib.import_module("controlplane.policies.migrations.0002_canonical_specs")
    legacy = default_policy().to_dict()
    legacy["cache"]["hbm_budget_mb"] = -0.0
    legacy_sha = hashlib.sha256(json.dumps(legacy, sort_keys=True, separators=(",", ":")).encode()).hexdigest()
    ConfigRevision.objects.create(pool=pool, generation=2, parent_generation=1, spec=legacy, sha256=legacy_sha,
                                  author="an older release")
    first = ConfigRevision.objects.values("spec", "sha256").get(pool=pool, generation=1)

    canonical_specs.canonicalise(apps, None)

    migrated = ConfigRevision.objects.get(pool=pool, generation=2)
    assert migrated.sha256 != legacy_sha and migrated.spec["cache"]["hbm_budget_mb"] == 0.0
    assert ConfigRevision.objects.values("spec", "sha256").get(pool=pool, generation=1) == first
    for revision in ConfigRevision.objects.all():  # what every worker checks before applying
        assert parse_policy(revision.spec).sha256() == revision.sha256


def test_after_a_field_with_a_default_is_added_stored_revisions_keep_their_sha256(operator, pool, monkeypatch):
    """The upgraded control plane (``tests.schema_next``): a revision stored before the field existed reads
    back, and re-validates, to its own sha256; a rollback to it stores the same spec and the same hash."""
    before = ConfigRevision.objects.get(pool=pool, generation=1)
    schema_next.install(monkeypatch)
    assert config.parse_policy(before.spec).sha256() == before.sha256
    assert schema_next.NEW_FIELD not in config.parse_policy(before.spec).to_dict()["trigger"]
    changed = operator.post(REVISIONS, {"parent_generation": 1, "spec": {"trigger": {schema_next.NEW_FIELD: 9}}},
                            format="json")
    assert changed.status_code == 201, changed.content
    assert changed.json()["spec"]["trigger"][schema_next.NEW_FIELD] == 9.0
    restored = policy_services.revision_create(pool=pool, spec=before.spec, parent_generation=2, author="operator")
    assert (restored.spec, restored.sha256) == (before.spec, before.sha256)
