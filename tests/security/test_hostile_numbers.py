"""Every number in every schema, property-based: valid records with one field or a few replaced by
hostile values (integers of 400 digits, 1e400, NaN, ±∞, booleans, strings, lists, nulls) are judged
by each decoder and endpoint — an answer, or an error naming the field — never another exception,
never a 5xx. Redis is untrusted input: malformed status and telemetry records are reported for their
instance while the rest of the page answers."""

from __future__ import annotations

import json
import math
import time

import numpy as np
import pytest
from django.test import Client
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from controlplane.accounts import services as account_services
from controlplane.accounts.roles import Role
from controlplane.policies.models import ConfigRevision
from controlplane.rollouts import bake
from controlplane.telemetry.cache import telemetry_cache
from relay_engine.core import fields
from relay_engine.core.capture import CaptureError, CaptureRecord
from relay_engine.core.config import default_policy, validate_policy
from relay_engine.core.telemetry import LatencyHistogram, Snapshot
from relay_engine.core.trace import parse_query, read_trace
from relay_engine.core.wire import (
    HEARTBEAT_MAX_AHEAD_S,
    HEARTBEAT_TIMEOUT_S,
    UNKNOWN,
    DesiredRevision,
    InstanceStatus,
    PoolKeys,
    WireError,
)
from tests.controlplane.fleet_helpers import snapshot
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
                        config_state="ACK", tiers={"hbm": {"bytes": 10, "budget_bytes": 20}}).to_json()
DESIRED = DesiredRevision(3, "a" * 64, default_policy().to_dict(), 1e9, "sre").to_json()
SNAPSHOT = json.dumps(Snapshot(instance="p.0", ts=1e9, started_at=1e9, counters={"rank_ok": 5},
                               refusals={"not_at_risk": 1}, rank_latency=LatencyHistogram()).to_dict())


@pytest.mark.parametrize(("name", "record", "decode", "error"), [
    ("status", STATUS, InstanceStatus.from_json, WireError),
    ("desired revision", DESIRED, DesiredRevision.from_json, WireError),
    ("telemetry snapshot", SNAPSHOT, Snapshot.from_entry, ValueError),
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


# --- Redis values behind the pages and the bake (round three): each class through its real reader ------

# Texts a worker never writes where a number belongs: digits Python's int() refuses or cannot hold
# ("²", 5000 digits), other scripts' digits int() does accept ("١٢"), signs, floats, blanks.
NUMBER_TEXT = st.one_of(st.text(max_size=12), st.sampled_from(
    ["9" * 5000, "9" * 4000, "²", "١٢", "-1", "1e3", "1e400", "nan", "inf", " 7 ", "1_000", "", "0x10",
     str(2**53), str(2**53 + 1), str(2**64), "12"]))


def _raw(redis_client):
    """A client of the same Redis that writes bytes as they are (not UTF-8 included)."""
    import redis

    return redis.Redis(connection_pool=redis.ConnectionPool(**{
        **redis_client.connection_pool.connection_kwargs, "decode_responses": False}))


def test_hostile_dropped_counts_are_reported_for_their_instance_and_the_summary_answers(viewer, pool, redis_client):
    keys = PoolKeys(POOL)

    @fuzz(150)
    @given(value=NUMBER_TEXT)
    def check(value):
        redis_client.delete(keys.traffic_dropped)
        redis_client.hset(keys.traffic_dropped, mapping={f"{POOL}.0": "7", f"{POOL}.1": value})
        response = viewer.get(f"/api/v1/pools/{POOL}/traffic/")
        assert response.status_code == 200, response.content[:300]
        body = response.json()
        try:
            readable = fields.number_text(value, 0, 2**53, as_int=True)
        except fields.FieldValueError:
            assert body["dropped_total"] == 7
            assert list(body["dropped_unreadable"]) == [f"{POOL}.1"]
            assert body["dropped_unreadable"][f"{POOL}.1"].startswith("dropped count must be")
        else:
            assert body["dropped_total"] == 7 + readable and body["dropped_unreadable"] == {}

    check()
    FIGURES.hostile("Redis values: capture dropped counts via the API (hypothesis)", scaled(150))


HEARTBEAT_SCORE = st.one_of(
    st.sampled_from([float("inf"), float("-inf"), 1e300, -1e300, -1.0, 0.0, 1e12, 2.0**63]),
    st.floats(allow_nan=False, allow_infinity=False),  # Redis holds no NaN score (ZADD refuses it)
    st.floats(-120, 120).map(lambda ahead: time.time() + ahead))


def test_a_hostile_heartbeat_score_is_reported_for_its_instance_and_the_rest_answers(viewer, pool, redis_client,
                                                                                     worker_factory, browser):
    good, odd = worker_factory(POOL, 0), worker_factory(POOL, 1)
    keys = PoolKeys(POOL)

    @fuzz(150)
    @given(score=HEARTBEAT_SCORE)
    def check(score):
        good.heartbeat()
        odd.heartbeat()
        redis_client.zadd(keys.members, {odd.name: score})
        now = time.time()
        pool_view = viewer.get(f"/api/v1/pools/{POOL}/status/")
        one = viewer.get(f"/api/v1/pools/{POOL}/instances/{odd.name}/")
        for response in (pool_view, one, viewer.get("/metrics"), browser.get(f"/pools/{POOL}/instances/{odd.name}/"),
                         browser.get(f"/pools/{POOL}/fleet/")):
            assert response.status_code == 200, response.content[:300]
        instances = {i["instance"]: i for i in pool_view.json()["instances"]}
        assert instances[good.name]["live"] and instances[good.name]["error"] == ""
        shown = one.json()
        assert instances[odd.name] | {"heartbeat_age_s": None} == shown | {"heartbeat_age_s": None}
        if not (math.isfinite(score) and 0 <= score <= now + HEARTBEAT_MAX_AHEAD_S - 1):
            if not 0 <= score <= now + HEARTBEAT_MAX_AHEAD_S + 1:  # clear of the bound's edge
                assert not shown["live"] and shown["heartbeat_age_s"] is None
                assert "unreadable heartbeat" in shown["error"] and "members score" in shown["error"]
        elif score >= now - HEARTBEAT_TIMEOUT_S + 1:
            assert shown["live"] and shown["error"] == ""

    check()
    FIGURES.hostile("Redis values: heartbeat scores via the API and pages (hypothesis)", scaled(150))


def _capture_fields(draw_time_ms: float) -> dict[str, str]:
    return {**CAPTURE, "t": f"{draw_time_ms:.3f}"}


def test_hostile_capture_records_leave_the_summary_and_a_readable_export(viewer, pool, redis_client, tmp_path):
    keys = PoolKeys(POOL)

    @fuzz(100)
    @given(records=st.lists(st.tuples(
        st.dictionaries(st.sampled_from(sorted(CAPTURE)), CAPTURE_TEXT, max_size=3),
        st.one_of(st.just(0.0), st.floats(-3.6e6, 3.6e6), st.sampled_from([-1.7e12, 1e14, 1e300]))),
        min_size=1, max_size=6))
    def check(records):
        redis_client.delete(keys.traffic)
        now_ms = int(time.time() * 1000) - 5000
        entries = {now_ms - 1000 * i: _capture_fields(now_ms - 1000 * i) for i in range(3)}  # good ones
        for i, (changes, skew_ms) in enumerate(records):  # and hostile ones between them
            entries[now_ms - 500 - 10 * i] = {**_capture_fields(now_ms - 500 - 10 * i + skew_ms), **changes}
        pipe = redis_client.pipeline(transaction=False)
        for entry_ms in sorted(entries):
            pipe.xadd(keys.traffic, entries[entry_ms], id=f"{entry_ms}-0")
        pipe.execute()
        summary = viewer.get(f"/api/v1/pools/{POOL}/traffic/?window=1m")
        assert summary.status_code == 200, summary.content[:300]
        body = summary.json()
        assert 3 <= body["requests"] <= 3 + len(records)
        assert body["requests"] + body["skipped_records"] == 3 + len(records)
        export = viewer.get(f"/api/v1/pools/{POOL}/traffic/?window=1m&format=jsonl")
        assert export.status_code == 200
        path = tmp_path / "export.jsonl"
        path.write_bytes(b"".join(export.streaming_content))
        assert len(read_trace(path)) >= 3  # every line one the trace reader takes (a TraceError fails here)

    check()
    FIGURES.hostile("Redis values: capture records via the summary and the export (hypothesis)", scaled(100))


ROLLUP_FIELDS = ["rank_requests", "rank_within_slo", "hbm_hits", "misses", "le.10", "le.30", "sum_ms", "hbm_bytes",
                 "hbm_budget_bytes", "instances", "refused.not_at_risk"]
HUGE_TEXT = st.sampled_from(["1e308", "-1e308", "1.7976931348623157e308", str(2**63), str(2**53), "-5", "3"])


def test_hostile_rollup_fields_leave_the_pool_charts_answering(viewer, pool, redis_client):
    keys = PoolKeys(POOL)

    @fuzz(100)
    @given(periods=st.lists(st.dictionaries(st.sampled_from(ROLLUP_FIELDS), st.one_of(NUMBER_TEXT, HUGE_TEXT),
                                            min_size=1, max_size=6), min_size=1, max_size=4))
    def check(periods):
        telemetry_cache.clear()
        now = int(time.time())
        for window, tier, step in (("5m", "1s", 1), ("1h", "10s", 10)):
            for i, hostile in enumerate(periods):
                key = keys.rollup(tier, (now // step - 1 - i) * step)
                redis_client.delete(key)
                redis_client.hset(key, mapping=hostile)
            response = viewer.get(f"/api/v1/pools/{POOL}/metrics/?window={window}")
            assert response.status_code == 200, (window, response.content[:300])

    check()
    FIGURES.hostile("Redis values: pool rollups via the API (hypothesis)", scaled(100))


COUNT = st.one_of(st.sampled_from([1e308, -1e308, 1.7e308, 2**53, 2**53 + 1, 2**63, 10**400, -1, 0.5]),
                  st.integers(0, 10_000))


@st.composite
def snapshot_runs(draw):
    """Two to four snapshots of one run whose counts are drawn from ``COUNT``: differences between
    consecutive ones reach ±inf if a reader sums what it should have refused."""
    now = time.time()
    runs = []
    for i in range(draw(st.integers(2, 4))):
        snap = json.loads(SNAPSHOT)
        snap.update(instance=f"{POOL}.0", ts=now - 4 + i, started_at=now - 100, applied_generation=2)
        snap["counters"] = {name: draw(COUNT) for name in ("rank_requests", "rank_within_slo", "hbm_hits")}
        snap["rank_latency"] = {"buckets": {"10": draw(COUNT)}, "sum_ms": draw(COUNT)}
        snap["hbm_bytes"] = draw(COUNT)
        runs.append(snap)
    return runs


def _write_snapshots(redis_client, keys, runs) -> None:
    for tier in ("1s", "10s"):
        redis_client.delete(keys.telemetry(tier, f"{POOL}.0"))
        for snap in runs:
            redis_client.xadd(keys.telemetry(tier, f"{POOL}.0"), {"d": dumps(snap)}, id=f"{int(snap['ts'] * 1000)}-0")
    redis_client.zadd(keys.reporting, {f"{POOL}.0": runs[-1]["ts"]})


def test_hostile_counts_across_snapshots_leave_every_telemetry_view_answering(viewer, pool, redis_client):
    keys = PoolKeys(POOL)

    @fuzz(100)
    @given(runs=snapshot_runs())
    def check(runs):
        telemetry_cache.clear()
        _write_snapshots(redis_client, keys, runs)
        for path in (f"/api/v1/pools/{POOL}/metrics/?window=5m", f"/api/v1/pools/{POOL}/instances/?window=5m",
                     f"/api/v1/pools/{POOL}/instances/{POOL}.0/metrics/?window=5m", "/metrics"):
            response = viewer.get(path)
            assert response.status_code == 200, (path, response.content[:300])

    check()
    FIGURES.hostile("Redis values: counts across telemetry snapshots via the API (hypothesis)", scaled(100))


def test_the_bakes_telemetry_read_counts_hostile_snapshots_as_nothing_never_as_infinity(pool, redis_client):
    keys = PoolKeys(POOL)

    @fuzz(150)
    @given(runs=snapshot_runs())
    def check(runs):
        _write_snapshots(redis_client, keys, runs)
        since = runs[0]["ts"] - 1
        served = bake.served(redis_client, pool=POOL, instances=[f"{POOL}.0"], generation=2, since=since,
                             now=runs[-1]["ts"] + 1)
        assert 0 <= served.requests <= 2**53 and 0 <= served.bad <= served.requests
        assert np.isfinite(served.buckets).all() and (served.p99_ms is None or math.isfinite(served.p99_ms))

    check()
    FIGURES.hostile("Redis values: telemetry read by the canary bake (hypothesis)", scaled(150))


REPORTING_SCORE = st.one_of(st.sampled_from([float("inf"), float("-inf"), 1e300, -1e300, 0.0]),
                            st.floats(allow_nan=False))


def test_hostile_reporting_scores_leave_the_telemetry_views_answering(viewer, pool, redis_client, worker_factory):
    keys = PoolKeys(POOL)
    worker = worker_factory(POOL, 0)
    now = time.time()
    worker.publish_snapshot(snapshot(worker.name, now - 2, now - 50, rank_requests=5, rank_within_slo=5))
    worker.publish_snapshot(snapshot(worker.name, now - 1, now - 50, rank_requests=9, rank_within_slo=9))

    @fuzz(60)
    @given(scores=st.lists(REPORTING_SCORE, min_size=1, max_size=3))
    def check(scores):
        telemetry_cache.clear()
        redis_client.zadd(keys.reporting, {f"{POOL}.{i}": score for i, score in enumerate(scores)})
        for path in (f"/api/v1/pools/{POOL}/metrics/?window=5m", f"/api/v1/pools/{POOL}/instances/?window=1h",
                     "/metrics"):
            response = viewer.get(path)
            assert response.status_code == 200, (path, response.content[:300])

    check()
    FIGURES.hostile("Redis values: reporting scores via the API (hypothesis)", scaled(60))


def test_bytes_that_are_not_utf8_in_any_record_are_reported_and_the_rest_answers(viewer, pool, redis_client,
                                                                                 worker_factory):
    raw = _raw(redis_client)
    keys = PoolKeys(POOL)
    good = worker_factory(POOL, 0)
    now_ms = int(time.time() * 1000) - 2000

    @fuzz(60)
    @given(blob=st.binary(min_size=1, max_size=24).filter(lambda b: not _is_utf8(b)))
    def check(blob):
        good.heartbeat()
        raw.zadd(keys.members, {f"{POOL}.1": time.time()})
        raw.set(keys.status(f"{POOL}.1"), b'{"instance": "' + blob + b'"}')
        raw.hset(keys.traffic_dropped, f"{POOL}.1", blob)
        raw.xadd(keys.traffic, {**_capture_fields(now_ms), "u": blob}, maxlen=20)
        raw.xadd(keys.telemetry("1s", f"{POOL}.1"), {"d": blob}, maxlen=20)
        raw.hset(keys.rollup("1s", now_ms // 1000 - 1), "rank_requests", blob)
        for path in (f"/api/v1/pools/{POOL}/status/", f"/api/v1/pools/{POOL}/instances/{POOL}.1/",
                     f"/api/v1/pools/{POOL}/traffic/?window=1m", f"/api/v1/pools/{POOL}/metrics/?window=5m",
                     f"/api/v1/pools/{POOL}/instances/?window=5m", "/metrics"):
            response = viewer.get(path)
            assert response.status_code == 200, (path, response.content[:300])
        assert viewer.get(f"/api/v1/pools/{POOL}/instances/{POOL}.1/").json()["config_state"] == UNKNOWN

    check()
    FIGURES.hostile("Redis values: bytes that are not UTF-8, in every record the control plane reads (hypothesis)",
                    scaled(60))


def _is_utf8(blob: bytes) -> bool:
    try:
        blob.decode()
    except UnicodeDecodeError:
        return False
    return True


def test_the_bakes_read_holds_a_sum_of_differences_past_two_to_the_53_at_it(pool, redis_client):
    """Found by the test above (hypothesis, one run in several): each difference is at most ``MAX_COUNT``,
    but two of them summed are past it. Here a run that counts 2**53 and then 2 more after a reset."""
    keys = PoolKeys(POOL)
    now = time.time()
    runs = []
    for i, count in enumerate((0, 2**53, 0, 2)):
        snap = json.loads(SNAPSHOT)
        snap.update(instance=f"{POOL}.0", ts=now - 4 + i, started_at=now - 100, applied_generation=2)
        snap["counters"] = {"rank_requests": count, "rank_within_slo": 0, "hbm_hits": 0}
        runs.append(snap)
    _write_snapshots(redis_client, keys, runs)
    served = bake.served(redis_client, pool=POOL, instances=[f"{POOL}.0"], generation=2, since=now - 5, now=now + 1)
    assert served.requests == 2**53 and served.bad == 2**53
