"""Every number in every schema, property-based: valid records with one field or a few replaced by
hostile values (integers of 400 digits, 1e400, NaN, ±∞, booleans, strings, lists, nulls) are judged
by each decoder and endpoint — an answer, or an error naming the field — never another exception,
never a 5xx. Redis is untrusted input: malformed status and telemetry records are reported for their
instance while the rest of the page answers."""

from __future__ import annotations

import json
import time

import pytest
from django.test import Client
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from controlplane.accounts import services as account_services
from controlplane.accounts.roles import Role
from controlplane.policies.models import ConfigRevision
from relay_engine.core.capture import CaptureError, CaptureRecord
from relay_engine.core.config import default_policy, validate_policy
from relay_engine.core.telemetry import LatencyHistogram, Snapshot
from relay_engine.core.trace import parse_query
from relay_engine.core.wire import UNKNOWN, DesiredRevision, InstanceStatus, PoolKeys, WireError
from tests.reliability.figures import FIGURES, scaled
from workers.payloads import PayloadError, PreInferPayload, RankPayload

POOL = "ranking-a"
HUGE = 10**400

HOSTILE = st.one_of(
    st.sampled_from([HUGE, -HUGE, 2**63, -(2**63) - 1, 2**64, 1e308, -1e308, 5e-324, -0.0]),
    st.integers(-(10**30), 10**30), st.floats(allow_nan=True, allow_infinity=True), st.booleans(), st.none(),
    st.text(max_size=8), st.lists(st.integers(-3, 3), max_size=3), st.dictionaries(st.text(max_size=3),
                                                                                   st.integers(), max_size=2))


def fuzz(examples: int) -> settings:
    return settings(max_examples=scaled(examples), deadline=None, suppress_health_check=list(HealthCheck),
                    database=None)


def leaf_paths(value, path=()) -> list[tuple]:
    if isinstance(value, dict):
        return [p for key, item in value.items() for p in leaf_paths(item, (*path, key))] or [path]
    if isinstance(value, list):
        return [p for i, item in enumerate(value) for p in leaf_paths(item, (*path, i))] or [path]
    return [path]


@st.composite
def mutated(draw, record):
    """``record`` with 1 to 3 of its fields (or a new one) replaced by hostile values."""
    record = json.loads(json.dumps(record))
    for _ in range(draw(st.integers(1, 3))):
        path = draw(st.sampled_from(leaf_paths(record)))
        if not path:
            return draw(HOSTILE)
        parent = record
        for key in path[:-1]:
            parent = parent[key]
        parent[path[-1]] = draw(HOSTILE)
    return record


def dumps(value) -> str:
    return json.dumps(value, allow_nan=True)  # NaN and ±Infinity as JavaScript writes them


# --- the decoders both sides share -------------------------------------------------------------------

STATUS = InstanceStatus("p.0", "p", "cpu", 12, 1e9, 1e9, applied_generation=3, applied_sha256="a" * 64,
                        config_state="ACK", hbm_bytes=10, hbm_budget_bytes=20).to_json()
DESIRED = DesiredRevision(3, "a" * 64, default_policy().to_dict(), 1e9, "sre").to_json()
SNAPSHOT = json.dumps(Snapshot(instance="p.0", ts=1e9, started_at=1e9, counters={"rank_ok": 5},
                               refusals={"not_at_risk": 1}, rank_latency=LatencyHistogram()).to_dict())


@pytest.mark.parametrize(("name", "record", "decode", "error"), [
    ("status", STATUS, InstanceStatus.from_json, WireError),
    ("desired revision", DESIRED, DesiredRevision.from_json, WireError),
    ("telemetry snapshot", SNAPSHOT, Snapshot.from_json, ValueError),
])
def test_redis_records_decode_or_raise_the_contract_error(name, record, decode, error):
    @fuzz(300)
    @given(data=mutated(json.loads(record)))
    def check(data):
        try:
            decode(dumps(data))
        except error as exc:
            assert str(exc)
    check()
    FIGURES.hostile(f"Redis records: {name} (hypothesis)", scaled(300))


CAPTURE = CaptureRecord(ts_ms=1.7e12, user="0123abcd", prefix_len=300, short_len=4, candidates=16, gap_ms=30.0,
                        outcome="hbm", latency_ms=2.5).to_fields()
CAPTURE_TEXT = st.one_of(st.text(max_size=12), st.sampled_from(
    ["nan", "inf", "-inf", "-1", "1e400", "9" * 400, "", "0", "1.5", "-0.0", "true", "hbm", "ÿ"]))


@fuzz(300)
@given(data=st.dictionaries(st.sampled_from(sorted(CAPTURE) + ["x"]), CAPTURE_TEXT, max_size=4),
       drop=st.sets(st.sampled_from(sorted(CAPTURE)), max_size=2))
def test_capture_records_decode_or_name_the_field(data, drop):
    FIGURES.hostile("Redis records: traffic capture (hypothesis)")
    fields = {k: v for k, v in {**CAPTURE, **data}.items() if k not in drop}
    try:
        CaptureRecord.from_fields(fields)
    except CaptureError as exc:
        assert str(exc).startswith("capture record.")


RANK = {"user_id": "u", "deadline_s": 1e9, "query_index": 3, "seq_len": 16, "short_len": 2, "n_candidates": 4}
PRE_INFER = {"user_id": "u", "prefix_items": [1, 2, 3], "prefix_actions": [0, 1, 0], "prefix_timestamps": [1, 2, 3]}


@pytest.mark.parametrize(("name", "payload", "parse"), [("rank", RANK, RankPayload.parse),
                                                        ("pre-infer", PRE_INFER, PreInferPayload.parse)])
def test_task_payloads_parse_or_name_the_field(name, payload, parse):
    @fuzz(300)
    @given(data=mutated(payload))
    def check(data):
        try:
            parse(json.loads(dumps(data)))
        except PayloadError as exc:
            assert exc.errors and str(exc)
    check()
    FIGURES.hostile(f"task payloads: {name} (hypothesis)", scaled(300))


TRACE_LINE = {"t_ms": 5, "user_id": "u", "seq_len": 100, "short_len": 4, "n_candidates": 8, "rank_delay_ms": 20}


@fuzz(300)
@given(data=mutated(TRACE_LINE))
def test_trace_lines_parse_or_name_the_field(data):
    FIGURES.hostile("trace lines (hypothesis)")
    try:
        parse_query(dumps(data))
    except ValueError as exc:  # the line's error; iter_trace adds the line number (TraceError)
        assert str(exc).startswith(("field", "missing field", "must be", "not"))


SPEC = {"trigger": {"at_risk_seq_len": 512, "max_preinfer_inflight": 4, "max_preinfer_tokens_per_s": 1e6,
                    "ranking_p99_slo_ms": 50, "latency_model": {"base_ms": 1, "per_token_ms": 0.1,
                                                                "per_token_sq_ms": 0}},
        "cache": {"hbm_budget_mb": 512, "dram_budget_mb": 1024, "entry_ttl_ms": 1000, "dram_ttl_ms": 2000},
        "slo": {"target_ratio": 0.99}, "schema_version": 1,
        "editing": {"fingerprint": {"num_layers": 2, "num_heads": 2, "head_dim": 2}, "scope": "all",
                    "edits": [{"layer": 1, "head": 0, "direction": [0.5, -1], "alpha": 2}],
                    "provenance": {"k": 3, "accuracy": 0.75}}}


@fuzz(500)
@given(data=mutated(SPEC))
def test_policies_validate_or_name_every_bad_field(data):
    FIGURES.hostile("policy specs (hypothesis)")
    spec, errors = validate_policy(json.loads(dumps(data)))
    assert (spec is None) == bool(errors)
    if spec is not None:
        assert len(spec.sha256()) == 64


# --- the same through the control plane's endpoints --------------------------------------------------


@pytest.fixture
def browser(db):
    account_services.user_create(username="sre-fuzz", role=Role.OPERATOR, password="correct horse battery",
                                 actor="fixture")
    client = Client()
    assert client.login(username="sre-fuzz", password="correct horse battery")
    return client


def test_revision_create_answers_every_hostile_spec_with_201_or_a_4xx_naming_it(operator, pool, settings):
    settings.RELAYGR_WRITE_THROTTLE_RATE = "100000/min"
    seen: set[int] = set()

    @fuzz(150)
    @given(data=mutated(SPEC))
    def check(data):
        latest = ConfigRevision.objects.filter(pool=pool).order_by("-generation").first().generation
        body = f'{{"parent_generation": {latest}, "spec": {dumps(data)}}}'
        response = operator.generic("POST", f"/api/v1/pools/{POOL}/revisions/", body.encode(),
                                    content_type="application/json")
        seen.add(response.status_code)
        assert response.status_code in (201, 400), response.content[:300]
        if response.status_code == 400:
            detail = response.json()
            assert "spec" in json.dumps(detail.get("errors", {})) or "JSON parse error" in detail["detail"]

    check()
    FIGURES.hostile("API revision specs (hypothesis)", scaled(150))
    assert 400 in seen


def test_the_editors_check_answers_every_hostile_spec_without_a_server_error(browser, pool):
    @fuzz(150)
    @given(data=mutated(SPEC))
    def check(data):
        response = browser.post(f"/ui/pools/{POOL}/check/", f'{{"spec": {dumps(data)}}}'.encode(),
                                content_type="application/json")
        assert response.status_code in (200, 400), response.content[:300]
        if response.status_code == 200:
            assert response.json()["valid"] == (not response.json()["errors"])

    check()
    FIGURES.hostile("editor check specs (hypothesis)", scaled(150))


def test_a_malformed_status_in_redis_is_reported_for_its_instance_and_the_rest_answers(viewer, pool, redis_client,
                                                                                     worker_factory):
    good = worker_factory(POOL, 0)
    keys = PoolKeys(POOL)

    @fuzz(100)
    @given(data=mutated(json.loads(STATUS)))
    def check(data):
        good.heartbeat()
        redis_client.zadd(keys.members, {f"{POOL}.1": time.time()})
        redis_client.set(keys.status(f"{POOL}.1"), dumps(data))
        response = viewer.get(f"/api/v1/pools/{POOL}/status/")
        assert response.status_code == 200, response.content[:300]
        instances = {i["instance"]: i for i in response.json()["instances"]}
        assert instances[good.name]["config_state"] != UNKNOWN
        bad = instances[f"{POOL}.1"]
        try:
            InstanceStatus.from_json(dumps(data))
        except WireError:
            assert bad["config_state"] == UNKNOWN and "unreadable status" in bad["error"]

    check()
    FIGURES.hostile("status records via the API (hypothesis)", scaled(100))


def test_malformed_telemetry_in_redis_leaves_the_metrics_answering(viewer, pool, redis_client, worker_factory):
    keys = PoolKeys(POOL)

    @fuzz(60)
    @given(data=mutated(json.loads(SNAPSHOT)))
    def check(data):
        redis_client.xadd(keys.telemetry("1s", f"{POOL}.0"), {"d": dumps(data)}, maxlen=50)
        redis_client.zadd(keys.members, {f"{POOL}.0": time.time()})
        for path in (f"/api/v1/pools/{POOL}/metrics/?window=5m", "/metrics"):
            response = viewer.get(path)
            assert response.status_code == 200, (path, response.content[:300])

    check()
    FIGURES.hostile("telemetry records via the API (hypothesis)", scaled(60))
