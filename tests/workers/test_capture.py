"""Traffic capture on the real Redis: bounded, hashed, off the ranking path, and a replayable trace."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import secrets
import stat
import time
from datetime import UTC, datetime

import pytest
import redis

from relay_engine.core.capture import CaptureRecord, capture_key, to_trace, user_hash
from relay_engine.core.telemetry import Snapshot
from relay_engine.core.trace import read_trace, write_trace
from relay_engine.core.wire import PoolKeys
from tests.workers.fleet import Fleet, wait_for
from workers.app import RANK_TASK
from workers.capture import TrafficCapture
from workers.stack import capture_secret

pytestmark = pytest.mark.integration


@pytest.fixture
def client(redis_url, key_prefix):
    connection = redis.Redis.from_url(redis_url, decode_responses=True)
    yield connection
    for key in connection.scan_iter(f"{key_prefix}*"):
        connection.delete(key)
    connection.close()


SECRET = secrets.token_hex(32)  # the deployment's capture secret: in the workers' environment only


def _capture(client, key_prefix, pool: str = "ranking-a", index: int = 0, secret: str = SECRET,
             **kwargs) -> TrafficCapture:
    return TrafficCapture(client, PoolKeys(pool, prefix=key_prefix), f"{pool}.{index}", secret=secret, **kwargs)


def _record(capture: TrafficCapture, user: str, arrived_s: float | None = None, **shape) -> bool:
    return capture.record(user, arrived_s=time.time() if arrived_s is None else arrived_s,
                          prefix_len=shape.get("prefix_len", 700), short_len=4, candidates=16, outcome="hbm",
                          latency_ms=3.5, cpu_ms=shape.get("cpu_ms"))


def _records(client, capture: TrafficCapture) -> list[CaptureRecord]:
    return [CaptureRecord.from_fields(data) for _, data in client.xrange(capture.keys.traffic)]


def _captured_users(client, capture: TrafficCapture, *users: str) -> list[str]:
    for user in users:
        assert _record(capture, user)
    assert capture.drain(wait_s=1.0) == len(users)
    return [r.user for r in _records(client, capture)[-len(users):]]


def test_records_carry_a_keyed_hash_never_the_user_id(client, key_prefix):
    capture = _capture(client, key_prefix)
    users = _captured_users(client, capture, "alice@example.com", "bob", "alice@example.com")
    entries = client.xrange(capture.keys.traffic)
    assert len(entries) == 3
    assert not any("alice" in value or value == "bob" for _, data in entries for value in data.values())
    assert users[0] == users[2] != users[1]  # one user, one hash: repeats stay visible


def test_records_name_the_instance_that_served_them(client, key_prefix):
    capture = _capture(client, key_prefix, index=3)
    _captured_users(client, capture, "carol")
    (_, data), = client.xrange(capture.keys.traffic)
    assert CaptureRecord.from_fields(data).instance == "ranking-a.3"


def _every_string_in_redis(client, key_prefix) -> set[str]:
    """Every key name, hash field and value, stream field and value, string value under the prefix."""
    found: set[str] = set()
    for key in client.scan_iter(f"{key_prefix}*"):
        found.add(key)
        kind = client.type(key)
        if kind == "string":
            found.add(client.get(key))
        elif kind == "hash":
            found.update(part for item in client.hgetall(key).items() for part in item)
        elif kind == "stream":
            found.update(part for _, data in client.xrange(key) for item in data.items() for part in item)
    return found


def test_nothing_in_redis_recomputes_the_hashes_only_the_secret_does(client, key_prefix):
    capture = _capture(client, key_prefix)
    [hashed] = _captured_users(client, capture, "user-17")
    assert set(client.scan_iter(f"{key_prefix}*")) == {capture.keys.traffic}  # no salt, no key: the records only
    assert hashed == user_hash(capture_key(SECRET, "ranking-a"), "user-17")
    candidates = _every_string_in_redis(client, key_prefix)
    assert hashed in candidates and len(candidates) > 5
    for candidate in candidates:  # neither as a secret of today's derivation nor as a salt of the old one
        assert user_hash(capture_key(candidate, "ranking-a"), "user-17") != hashed
        assert hashlib.sha256(f"{candidate}\x00user-17".encode()).hexdigest()[:16] != hashed
    assert user_hash(capture_key(secrets.token_hex(32), "ranking-a"), "user-17") != hashed


def test_instances_of_a_pool_hash_a_user_alike_and_pools_apart(client, key_prefix):
    first = _captured_users(client, _capture(client, key_prefix, index=0), "alice", "bob")
    second = _captured_users(client, _capture(client, key_prefix, index=1), "alice", "bob")
    other_pool = _captured_users(client, _capture(client, key_prefix, pool="ranking-b"), "alice", "bob")
    other_secret = _captured_users(client, _capture(client, key_prefix, pool="ranking-c", secret=secrets.token_hex(32)),
                                   "alice", "bob")
    assert first == second and first[0] != first[1]
    assert not set(first) & set(other_pool) and not set(first) & set(other_secret)


def test_the_stacks_capture_secret_is_made_once_per_data_dir_for_its_owner_only(tmp_path):
    made = capture_secret(tmp_path)
    assert len(made) == 64 and capture_secret(tmp_path) == made  # kept: the same hashes after a restart
    assert stat.S_IMODE((tmp_path / "capture-secret").stat().st_mode) == 0o600
    other = tmp_path / "other"
    other.mkdir()
    assert capture_secret(other) != made


def test_the_stream_is_bounded_by_count(client, key_prefix):
    capture = _capture(client, key_prefix, max_records=1_000, batch_size=1_000, queue_size=5_000)
    for i in range(3_000):
        _record(capture, f"user-{i % 50}")
    while capture.drain(wait_s=0.1):
        pass
    assert capture.written == 3_000
    assert 1_000 <= client.xlen(capture.keys.traffic) < 1_200  # MAXLEN ~: whole stream nodes at a time


def test_records_older_than_the_age_bound_are_trimmed(client, key_prefix):
    capture = _capture(client, key_prefix, batch_size=100)
    for i in range(300):
        _record(capture, f"user-{i}")
    while capture.drain(wait_s=0.1):
        pass
    assert client.xlen(capture.keys.traffic) == 300
    capture.clock = lambda: time.time() + 2 * 3600  # two hours on: everything above is past the hour
    _record(capture, "late-user")
    capture.drain(wait_s=1.0)
    assert client.xlen(capture.keys.traffic) <= 101


def test_a_full_queue_drops_and_counts_instead_of_blocking(client, key_prefix):
    capture = _capture(client, key_prefix, queue_size=5)
    accepted = [_record(capture, f"user-{i}") for i in range(20)]
    assert accepted == [True] * 5 + [False] * 15
    assert capture.dropped == 15
    assert capture.drain(wait_s=1.0) == 5
    assert client.hget(capture.keys.traffic_dropped, "ranking-a.0") == "15"


def test_the_gap_is_the_time_since_the_users_pre_infer_signal(client, key_prefix):
    now = [1000.0]
    capture = _capture(client, key_prefix, clock=lambda: now[0])
    capture.signal("u1")
    _record(capture, "u1", arrived_s=1000.045)
    _record(capture, "u2", arrived_s=1000.050)  # no signal seen
    capture.drain(wait_s=1.0)
    gaps = [r.gap_ms for r in _records(client, capture)]
    assert gaps[0] == pytest.approx(45.0, abs=0.01)
    assert gaps[1] is None


def test_a_signal_the_trigger_took_late_starts_its_trace_query_when_it_was_taken(client, key_prefix):
    """Sent at 1000.000, decided on at 1000.030 (a reader behind): the gap is from the send, the delay is
    recorded, and the replayed signal arrives when the instance could first have started its prefill."""
    now = [1000.030]
    capture = _capture(client, key_prefix, clock=lambda: now[0])
    capture.signal("u1", sent_s=1000.0)
    _record(capture, "u1", arrived_s=1000.045, cpu_ms=3.5)
    capture.drain(wait_s=1.0)
    (record,) = _records(client, capture)
    assert record.gap_ms == pytest.approx(45.0, abs=0.01) and record.signal_delay_ms == pytest.approx(30.0, abs=0.01)
    assert record.cpu_ms == pytest.approx(3.5)
    (query,) = to_trace([record])
    assert query.rank_delay_ms == pytest.approx(15.0, abs=0.01)


def test_captured_records_replay_as_a_trace(client, key_prefix, tmp_path):
    capture = _capture(client, key_prefix)
    start = time.time() - 10
    for i in range(40):
        _record(capture, f"user-{i % 7}", arrived_s=start + i * 0.1, prefix_len=100 + i % 7)
    capture.drain(wait_s=1.0)
    queries = to_trace(_records(client, capture))
    path = tmp_path / "captured.jsonl"
    write_trace(path, queries)
    replayed = read_trace(path)
    assert replayed == queries and len(replayed) == 40
    assert replayed[0].t_ms == 0.0
    assert len({q.user_id for q in replayed}) == 7
    # a user's prefix length is stable, so its repeats can hit the cache in a replay
    assert all(len({q.seq_len for q in replayed if q.user_id == u}) == 1 for u in {q.user_id for q in replayed})


def test_a_fleet_captures_what_it_served_and_what_expired_in_its_queue(fleet):
    """Real worker processes: the pre-infer → rank gap, the outcome, hashed users, and a request
    revoked in the queue (traffic the pool received, never served)."""
    fleet.client.pre_infer("capture-user", seq_len=48)
    time.sleep(0.05)
    fleet.client.rank("capture-user", short_len=4, n_candidates=8, seq_len=48)
    name = fleet.names[0]
    deadline_s = time.time() - 1.0
    fleet.client.app.send_task(RANK_TASK, args=[{"user_id": "expired-user", "deadline_s": deadline_s, "seq_len": 48,
                                                 "short_len": 4, "n_candidates": 8}],
                               queue=fleet.keys.rank_queue(name), expires=datetime.fromtimestamp(deadline_s, tz=UTC))

    def captured() -> list[CaptureRecord]:
        return [CaptureRecord.from_fields(data) for _, data in fleet.redis.xrange(fleet.keys.traffic)]

    wait_for(lambda: {"deadline_exceeded"} < {r.outcome for r in captured()}, 5.0,
             what="the served and the expired request in the capture")
    records = captured()
    served = [r for r in records if r.outcome in ("hbm", "dram", "inflight", "miss")]
    assert served and all(r.prefix_len == 48 and r.short_len == 4 and r.candidates == 8 for r in served)
    assert any(r.gap_ms is not None and r.gap_ms >= 40 for r in served)
    # Where the time went: the rank's own CPU time (at most its latency, less on a wait), the signal's delay.
    assert all(r.cpu_ms is not None and 0 < r.cpu_ms <= r.latency_ms + 1.0 for r in served)
    assert any(r.signal_delay_ms is not None and 0 <= r.signal_delay_ms <= r.gap_ms for r in served)
    raw = json.dumps([data for _, data in fleet.redis.xrange(fleet.keys.traffic)])
    assert "capture-user" not in raw and "expired-user" not in raw


def test_every_instance_of_the_pool_hashes_a_user_alike(fleet):
    """The same user's request sent to each instance's own queue: one hash, the secret's derivation."""
    for name in fleet.names:
        fleet.client.app.send_task(RANK_TASK, args=[{"user_id": "shared-user", "deadline_s": time.time() + 30,
                                                     "seq_len": 32, "short_len": 4, "n_candidates": 8}],
                                   queue=fleet.keys.rank_queue(name))
    expected = user_hash(capture_key(fleet.settings.capture_secret, fleet.settings.pool), "shared-user")

    def hashes() -> list[str]:
        return [r.user for r in (CaptureRecord.from_fields(d) for _, d in fleet.redis.xrange(fleet.keys.traffic))
                if r.prefix_len == 32]

    assert len(fleet.names) == 2
    wait_for(lambda: len(hashes()) >= 2, 10.0, what="the request of each instance in the capture")
    assert hashes() == [expected, expected]


def test_an_instance_without_a_capture_secret_captures_nothing_and_says_so(redis_url, tmp_path):
    pool = Fleet(redis_url, tmp_path, pool="nosecret", size=1)
    pool.settings = dataclasses.replace(pool.settings, capture_secret="")
    try:
        pool.start()
        [status] = pool.running_statuses()
        assert "RELAYGR_CAPTURE_SECRET is not set" in status.capture_off
        assert pool.client.rank("some-user", short_len=4, n_candidates=8, seq_len=32).instance == status.instance

        def ranked_in_telemetry() -> bool:  # published after the request, like a capture's batch would be
            entries = pool.redis.xrevrange(pool.keys.telemetry("1s", status.instance), count=1)
            return bool(entries) and Snapshot.from_entry(entries[0][1]["d"]).counters.get("rank_requests", 0) >= 1

        wait_for(ranked_in_telemetry, 10.0, what="the request in the instance's telemetry")
        time.sleep(1.0)  # four capture flush intervals more: a capture would have written by now
        # Nothing captured, and no salt or key made up in Redis instead.
        assert list(pool.redis.scan_iter(f"{pool.settings.key_prefix}:*traffic*")) == []
    finally:
        pool.stop()
