"""The reconciler's decisions, in-process against the real Redis and a real engine (small model):
what it applies, refuses and reports for any sequence of records a Redis may hold, hostile ones
included, and what it starts from when Redis holds none.

The property test drives it with random sequences of records — valid, invalid, tampered, older,
rewritten under the same generation, malformed, with numbers beyond a float — and checks each
outcome against a model of the contract (``workers/reconciler.py``'s docstring). The worker
processes' side of the same behaviour is in ``test_revisions.py`` and ``test_restart_state.py``.
"""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass

import pytest
import redis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from relay_engine.core.config import default_policy, parse_policy
from relay_engine.core.engine import RelayEngine
from relay_engine.core.wire import ACK, NACK, PENDING, DesiredRevision, InstanceStatus, PoolKeys
from workers.membership import StatusBoard
from workers.reconciler import Reconciler
from workers.revision_store import RevisionStore
from workers.settings import MODELS

pytestmark = pytest.mark.integration

VALID_SPECS = [{}, {"cache": {"hbm_budget_mb": 100}}, {"cache": {"hbm_budget_mb": 101.5}},
               {"trigger": {"max_preinfer_inflight": 2}}, {"slo": {"target_ratio": 0.9}}]
INVALID_SPECS = [{"cache": {"hbm_budget_mb": -1}}, {"cahce": {}}, {"trigger": {"at_risk_seq_len": "512"}},
                 {"cache": {"hbm_budget_mb": 16.0 * 2**20}}]  # the last is valid, but no device here holds it


@pytest.fixture(scope="module")
def engine() -> RelayEngine:
    return RelayEngine(MODELS["small"], device="cpu", name="reconciled")


@pytest.fixture(scope="module")
def client(redis_url) -> redis.Redis:
    with redis.Redis.from_url(redis_url, decode_responses=True) as c:
        yield c


@dataclass
class Instance:
    reconciler: Reconciler
    keys: PoolKeys
    client: redis.Redis

    def put(self, raw: str | None) -> InstanceStatus:
        """The record Redis holds (None: none), then one reconcile pass."""
        if raw is None:
            self.client.delete(self.keys.desired)
        else:
            self.client.set(self.keys.desired, raw)
        return self.reconciler.reconcile()

    @property
    def known(self) -> bool:
        return self.reconciler.known.is_set()


def make_instance(engine: RelayEngine, client: redis.Redis, state_dir, *, restore: bool = True,
                  keys: PoolKeys | None = None) -> Instance:
    engine.apply_policy(default_policy())  # the state a fresh process starts in
    keys = keys or PoolKeys("p", prefix=f"test-{uuid.uuid4().hex[:10]}")
    board = StatusBoard(client, keys, InstanceStatus(instance="p.0", pool="p", device="cpu", pid=1,
                                                     heartbeat_ts=time.time(), started_at=time.time()),
                        gauges=lambda: {})
    reconciler = Reconciler(engine, client, keys, board, RevisionStore(state_dir / "p.0.json"))
    if restore:
        reconciler.restore()
    return Instance(reconciler, keys, client)


def record(generation: int, spec: dict, *, sha256: str | None = None) -> str:
    try:
        digest = parse_policy(spec).sha256()
    except ValueError:
        digest = "0" * 64
    return DesiredRevision(generation, sha256 or digest, spec, 1.0, "tests").to_json()


# --- the property: any sequence of records, judged as the contract says ----------------------------

HUGE = "9" * 400  # an integer no float can hold

MALFORMED = [
    "not json", "[]", "{}", '{"generation": 1}', '{"generation": "1", "sha256": "x", "spec": {}}',
    '{"generation": 1e400, "sha256": "x", "spec": {}}', f'{{"generation": {HUGE}, "sha256": "x", "spec": {{}}}}',
    '{"generation": 0, "sha256": "x", "spec": {}}', '{"generation": 1, "sha256": "x", "spec": []}',
    '{"generation": 1, "sha256": "x", "spec": {}, "published_at": 1e400}', "[" * 100_000,
]


@st.composite
def records(draw) -> tuple[str | None, dict]:
    """(raw record or None, what it is) for the model."""
    kind = draw(st.sampled_from(["valid", "valid", "invalid", "tampered", "huge number", "malformed", "missing"]))
    generation = draw(st.integers(1, 6))
    if kind == "valid":
        spec = draw(st.sampled_from(VALID_SPECS))
        return record(generation, spec), {"kind": kind, "generation": generation, "sha256": parse_policy(spec).sha256()}
    if kind == "invalid":
        return record(generation, draw(st.sampled_from(INVALID_SPECS))), {"kind": kind, "generation": generation}
    if kind == "tampered":  # a valid spec under another spec's sha256
        spec, other = draw(st.lists(st.sampled_from(VALID_SPECS[1:]), min_size=2, max_size=2, unique_by=json.dumps))
        claimed = parse_policy(other).sha256()  # equal to what is applied, it runs what it claims: an ACK
        return record(generation, spec, sha256=claimed), {"kind": kind, "generation": generation, "sha256": claimed}
    if kind == "huge number":  # a field of the spec holding 1e400 or a 400-digit integer
        value = draw(st.sampled_from(["1e400", "-1e400", HUGE, "-" + HUGE]))
        field = draw(st.sampled_from(['"cache": {"hbm_budget_mb": %s}', '"trigger": {"max_preinfer_inflight": %s}',
                                      '"slo": {"target_ratio": %s}']))
        raw = f'{{"generation": {generation}, "sha256": "{"0" * 64}", "spec": {{{field % value}}}}}'
        return raw, {"kind": "invalid", "generation": generation}
    if kind == "malformed":
        return draw(st.sampled_from(MALFORMED)), {"kind": kind}
    return None, {"kind": kind}


@settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck), database=None)
@given(steps=st.lists(records(), min_size=1, max_size=10))
def test_every_sequence_of_records_is_judged_as_the_contract_says(engine, client, tmp_path_factory, steps):
    instance = make_instance(engine, client, tmp_path_factory.mktemp("state"))
    applied = (0, "")
    for raw, what in steps:
        status = instance.put(raw)  # never raises, whatever the record holds
        if what["kind"] == "missing":
            assert status.config_state == PENDING and "no desired revision" in status.error
        elif what["kind"] == "malformed":
            assert (status.config_state, status.nacked_generation) == (NACK, 0)
            assert "malformed" in status.error
        elif (what["generation"], what.get("sha256")) == applied:
            assert status.config_state == ACK
        elif what["generation"] < applied[0]:
            assert (status.config_state, status.nacked_generation) == (NACK, what["generation"])
            assert "older than the applied generation" in status.error
        elif what["kind"] == "valid":
            applied = (what["generation"], what["sha256"])
            assert status.config_state == ACK and status.error == ""
        else:
            assert (status.config_state, status.nacked_generation) == (NACK, what["generation"])
            assert status.error
        assert (status.applied_generation, status.applied_sha256) == applied
        # What serves is what the status says is applied (the schema's defaults while nothing is).
        assert engine.policy.sha256() == (applied[1] or default_policy().sha256())


# --- single behaviours ------------------------------------------------------------------------------


def test_a_refused_record_rewritten_under_the_same_generation_is_applied(engine, client, tmp_path):
    instance = make_instance(engine, client, tmp_path)
    assert instance.put(record(2, {"cache": {"hbm_budget_mb": -5}})).config_state == NACK
    assert instance.put(record(2, {"cache": {"hbm_budget_mb": -5}})).config_state == NACK  # the same: not retried
    repaired = instance.put(record(2, {"cache": {"hbm_budget_mb": 77}}))  # relaygr_sync writes the database's
    assert (repaired.config_state, repaired.applied_generation, repaired.error) == (ACK, 2, "")
    assert engine.policy.cache.hbm_budget_mb == 77


def test_a_tampered_spec_repaired_under_the_same_sha256_is_applied(engine, client, tmp_path):
    instance = make_instance(engine, client, tmp_path)
    good = {"cache": {"hbm_budget_mb": 88}}
    tampered = instance.put(record(3, {"cache": {"hbm_budget_mb": 99}}, sha256=parse_policy(good).sha256()))
    assert tampered.config_state == NACK and tampered.error.startswith("sha256")
    assert instance.put(record(3, good)).config_state == ACK  # same generation, same sha256, the right spec


def test_an_older_generation_is_reported_and_not_applied(engine, client, tmp_path):
    instance = make_instance(engine, client, tmp_path)
    assert instance.put(record(5, {"cache": {"hbm_budget_mb": 55}})).config_state == ACK
    older = instance.put(record(4, {"cache": {"hbm_budget_mb": 44}}))
    assert (older.config_state, older.nacked_generation, older.applied_generation) == (NACK, 4, 5)
    assert "older than the applied generation 5" in older.error and "p.0.json" in older.error
    assert engine.policy.cache.hbm_budget_mb == 55


@pytest.mark.parametrize("raw", [
    '{"generation": 1e400, "sha256": "x", "spec": {}}', f'{{"generation": {HUGE}, "sha256": "x", "spec": {{}}}}',
    f'{{"generation": 2, "sha256": "{"0" * 64}", "spec": {{"cache": {{"hbm_budget_mb": 1e400}}}}}}',
    f'{{"generation": 2, "sha256": "{"0" * 64}", "spec": {{"trigger": {{"max_preinfer_inflight": {HUGE}}}}}}}',
], ids=["generation 1e400", "generation of 400 digits", "budget 1e400", "limit of 400 digits"])
def test_numbers_beyond_a_float_are_a_nack_naming_the_field(engine, client, tmp_path, raw):
    status = make_instance(engine, client, tmp_path).put(raw)
    assert status.config_state == NACK
    assert any(name in status.error for name in ("generation", "hbm_budget_mb", "max_preinfer_inflight"))


def test_the_last_applied_revision_is_kept_on_disk_and_restored_when_redis_has_none(engine, client, tmp_path):
    first = make_instance(engine, client, tmp_path)
    assert first.put(record(7, {"cache": {"hbm_budget_mb": 70}})).config_state == ACK
    restarted = make_instance(engine, client, tmp_path)  # a new process, Redis restarted empty
    assert restarted.known and engine.policy.cache.hbm_budget_mb == 70
    status = restarted.put(None)
    assert (status.config_state, status.applied_generation) == (PENDING, 7)
    assert "serving generation 7" in status.error
    back = restarted.put(record(7, {"cache": {"hbm_budget_mb": 70}}))  # the sync loop restores desired
    assert (back.config_state, back.applied_generation, back.error) == (ACK, 7, "")


def test_with_nothing_on_disk_and_nothing_in_redis_nothing_is_known(engine, client, tmp_path):
    instance = make_instance(engine, client, tmp_path)
    status = instance.put(None)
    assert not instance.known
    assert (status.config_state, status.applied_generation) == (PENDING, 0) and "not serving" in status.error
    assert instance.put("not json").config_state == NACK and not instance.known  # garbage is not a revision
    assert instance.put(record(1, {})).config_state == ACK and instance.known


def test_a_refused_first_revision_is_still_seen_and_reported(engine, client, tmp_path):
    instance = make_instance(engine, client, tmp_path)
    status = instance.put(record(1, {"cache": {"hbm_budget_mb": -1}}))
    assert instance.known and status.config_state == NACK and status.applied_generation == 0


@pytest.mark.parametrize("content", ["", "{", '{"generation": 1, "sha256": "x", "spec": {}}', "\x00" * 10])
def test_an_unreadable_or_tampered_state_file_is_ignored(engine, client, tmp_path, content):
    (tmp_path / "p.0.json").write_text(content)
    instance = make_instance(engine, client, tmp_path)
    assert not instance.known and engine.policy.sha256() == default_policy().sha256()


def test_the_state_file_is_replaced_whole_and_leaves_no_temporary_file(tmp_path):
    store = RevisionStore(tmp_path / "deep" / "p.0.json")
    for generation in (1, 2, 3):
        assert store.save(DesiredRevision.from_json(record(generation, {"slo": {"target_ratio": 0.5}})))
    assert store.load().generation == 3
    assert [p.name for p in (tmp_path / "deep").iterdir()] == ["p.0.json"]


def test_a_disk_that_refuses_the_write_does_not_stop_the_apply(engine, client, tmp_path):
    (tmp_path / "blocked").write_text("a file where the state folder should be")
    instance = make_instance(engine, client, tmp_path / "blocked")
    assert instance.put(record(1, {"cache": {"hbm_budget_mb": 33}})).config_state == ACK
