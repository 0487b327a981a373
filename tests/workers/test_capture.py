"""Traffic capture on the real Redis: bounded, hashed, off the ranking path, and a replayable trace."""

from __future__ import annotations

import json
import time
from datetime import UTC, datetime

import pytest
import redis

from relay_engine.core.capture import CaptureRecord, to_trace
from relay_engine.core.trace import read_trace, write_trace
from relay_engine.core.wire import PoolKeys
from tests.workers.fleet import wait_for
from workers.app import RANK_TASK
from workers.capture import TrafficCapture

pytestmark = pytest.mark.integration


@pytest.fixture
def client(redis_url, key_prefix):
    connection = redis.Redis.from_url(redis_url, decode_responses=True)
    yield connection
    for key in connection.scan_iter(f"{key_prefix}*"):
        connection.delete(key)
    connection.close()


def _capture(client, key_prefix, **kwargs) -> TrafficCapture:
    return TrafficCapture(client, PoolKeys("ranking-a", prefix=key_prefix), "ranking-a.0", **kwargs)


def _record(capture: TrafficCapture, user: str, arrived_s: float | None = None, **shape) -> bool:
    return capture.record(user, arrived_s=time.time() if arrived_s is None else arrived_s,
                          prefix_len=shape.get("prefix_len", 700), short_len=4, candidates=16, outcome="hbm",
                          latency_ms=3.5)


def _records(client, capture: TrafficCapture) -> list[CaptureRecord]:
    return [CaptureRecord.from_fields(data) for _, data in client.xrange(capture.keys.traffic)]


def test_records_carry_a_salted_hash_never_the_user_id(client, key_prefix):
    capture = _capture(client, key_prefix)
    for user in ("alice@example.com", "bob", "alice@example.com"):
        assert _record(capture, user)
    assert capture.drain(wait_s=1.0) == 3
    entries = client.xrange(capture.keys.traffic)
    assert len(entries) == 3
    assert not any("alice" in value or value == "bob" for _, data in entries for value in data.values())
    users = [r.user for r in _records(client, capture)]
    assert users[0] == users[2] != users[1]  # one user, one hash: repeats stay visible
    other_pool = TrafficCapture(client, PoolKeys("ranking-b", prefix=key_prefix), "ranking-b.0")
    _record(other_pool, "alice@example.com")
    other_pool.drain(wait_s=1.0)
    assert _records(client, other_pool)[0].user != users[0]  # salted per pool


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
    raw = json.dumps([data for _, data in fleet.redis.xrange(fleet.keys.traffic)])
    assert "capture-user" not in raw and "expired-user" not in raw
