"""A pool of two real worker processes on a real Redis: routing, caching, deadlines, bad input."""

from __future__ import annotations

import json
import time
from datetime import UTC, datetime

import pytest

from relay_engine.core.telemetry import Snapshot
from relay_engine.core.wire import is_live
from tests.security.payloads import CreatesFileWhenUnpickled
from tests.workers.fleet import wait_for
from workers import signals
from workers.app import RANK_TASK
from workers.client import PendingRank, RankDeadlineExceeded, RankError

pytestmark = pytest.mark.integration

SMALL = {"seq_len": 48, "short_len": 4, "n_candidates": 8}


def latest_snapshot(fleet, name: str) -> Snapshot:
    entries = fleet.redis.xrevrange(fleet.keys.telemetry("1s", name), count=1)
    return Snapshot.from_entry(entries[0][1]["d"])


def snapshot_after(fleet, name: str, at_s: float) -> Snapshot:
    """The first snapshot taken after ``at_s`` (unix seconds): what the instance had counted by then,
    not by the last publish before it (a snapshot is up to a second old)."""
    wait_for(lambda: latest_snapshot(fleet, name).ts > at_s, 5.0, what=f"a snapshot of {name} after {at_s:.3f}")
    return latest_snapshot(fleet, name)


def test_instances_join_the_live_set_and_report_their_status(fleet):
    assert fleet.client.live_instances() == tuple(fleet.names)
    for name, status in fleet.statuses().items():
        assert (status.instance, status.pool, status.device) == (name, "test", "cpu")
        assert status.pid == fleet.procs[name].pid
        assert is_live(status.heartbeat_ts, time.time())  # the liveness rule, not a speed
        assert status.tiers["hbm"]["budget_bytes"] > 0 and status.device_memory_bytes > 0


def test_same_user_is_served_by_one_instance_and_hits_its_cache_on_the_second_request(fleet):
    users = [f"affinity-{i}" for i in range(8)]
    hits_before = {name: latest_snapshot(fleet, name).counters["hbm_hits"] for name in fleet.names}
    first = {u: fleet.client.rank(u, query_index=1, **SMALL) for u in users}
    second = {u: fleet.client.rank(u, query_index=2, **SMALL) for u in users}

    for u in users:
        assert first[u].instance == second[u].instance == fleet.client.route(u)
        assert first[u].source == "miss"
        assert second[u].source == "hbm"
    assert {reply.instance for reply in first.values()} == set(fleet.names)  # users spread over both
    expected = {name: sum(r.instance == name for r in second.values()) for name in fleet.names}
    wait_for(lambda: all(latest_snapshot(fleet, n).counters["hbm_hits"] - hits_before[n] == expected[n]
                         for n in fleet.names), 3.0, what="hbm_hits counted in telemetry")


def test_pre_infer_signal_and_ranking_request_meet_on_one_instance(fleet):
    user, seq_len = "relay-race-user", 600  # above the default at_risk_seq_len: the trigger admits it
    instance = fleet.client.pre_infer(user, seq_len=seq_len)
    time.sleep(0.3)
    reply = fleet.client.rank(user, seq_len=seq_len, short_len=4, n_candidates=8, query_index=1)
    assert instance == reply.instance == fleet.client.route(user)
    assert reply.source in ("hbm", "inflight")


def test_rank_past_its_deadline_fails_fast_with_a_deadline_error(fleet):
    deadline_s = time.time() + 0.005  # far less than the recompute of a 3000-token prefix takes
    with pytest.raises(RankDeadlineExceeded, match="deadline|expired"):
        fleet.client.rank("late-user", seq_len=3000, short_len=4, n_candidates=8, deadline_s=deadline_s)
    assert time.time() - deadline_s < fleet.client.grace_s + 2.0  # + slack for a loaded machine


def test_request_that_expired_in_the_queue_is_revoked_and_reported(fleet):
    name = fleet.names[0]
    before = latest_snapshot(fleet, name).counters["rank_deadline_exceeded"]
    deadline_s = time.time() - 1.0
    result = fleet.client.app.send_task(RANK_TASK, args=[{"user_id": "u", "deadline_s": deadline_s, **SMALL}],
                                        queue=fleet.keys.rank_queue(name),
                                        expires=datetime.fromtimestamp(deadline_s, tz=UTC))
    with pytest.raises(RankDeadlineExceeded, match="expired in .* queue"):
        PendingRank(result, name, time.time() + 1.0, time.perf_counter(), 0.25).wait()
    wait_for(lambda: latest_snapshot(fleet, name).counters["rank_deadline_exceeded"] > before, 3.0,
             what="the expired request counted as a deadline error")


@pytest.mark.parametrize(("payload", "field"), [
    ("not an object", "payload"),
    ({**SMALL}, "user_id"),
    ({"user_id": "u", **SMALL, "seq_len": -1}, "seq_len"),
    ({"user_id": "u", **SMALL, "seq_len": True}, "seq_len"),
    ({"user_id": "u", **SMALL, "deadline_s": "soon"}, "deadline_s"),
    ({"user_id": "u", **SMALL, "colour": "red"}, "colour"),
    ({"user_id": "u", "short_len": 1, "n_candidates": 2, "prefix_items": [1, 2], "prefix_actions": [1]},
     "prefix_actions"),
    ({"user_id": "u", **SMALL, "n_candidates": None, "candidates": [1, 10**9]}, "candidates"),
    ({"user_id": "u", **SMALL, "seq_len": 5000}, "prefix"),  # longer than the model takes
])
def test_malformed_rank_payload_gets_an_error_result_naming_the_field(fleet, payload, field):
    with pytest.raises(RankError) as caught:
        fleet.client.send_rank(payload, instance=fleet.names[0]).wait()
    assert caught.value.kind == "invalid_input"
    assert caught.value.field == field, str(caught.value)


def test_task_called_with_the_wrong_arguments_gets_an_error_result(fleet):
    name = fleet.names[0]
    result = fleet.client.app.send_task(RANK_TASK, args=[1, 2], kwargs={"x": 3}, queue=fleet.keys.rank_queue(name))
    data = result.get(timeout=5)
    assert (data["ok"], data["error"], data["field"]) == (False, "invalid_input", "payload")


def test_bad_pre_infer_signals_are_skipped_and_the_good_one_after_them_is_taken(fleet):
    name = fleet.names[0]
    # The test before may have sent a signal whose count the last snapshot does not hold yet.
    before = snapshot_after(fleet, name, time.time()).counters["preinfer_signals"]
    fleet.redis.rpush(fleet.keys.preinfer_signals(name), "not json", "[1, 2]", json.dumps({"p": "x", "t": time.time()}),
                      json.dumps({"p": {"user_id": "u", "seq_len": 600}, "t": "yesterday"}),
                      signals.entry({"user_id": "u", "seq_len": "long"}),  # refused by validation
                      signals.entry({"user_id": "stale-user", "seq_len": 600}, sent_s=time.time() - 60))  # too old
    assert fleet.client.pre_infer("good-signal-user", seq_len=600, instance=name) == name
    wait_for(lambda: latest_snapshot(fleet, name).counters["preinfer_signals"] == before + 1, 5.0,
             what="the one good signal counted by the engine")
    assert fleet.redis.llen(fleet.keys.preinfer_signals(name)) == 0
    reply = fleet.client.send_rank({"user_id": "good-signal-user", "deadline_s": time.time() + 5, **SMALL,
                                    "seq_len": 600}, instance=name).wait()
    assert reply.source in ("hbm", "inflight") and fleet.procs[name].poll() is None
    time.sleep(1.2)  # a later snapshot: the bad entries were never counted as signals
    assert latest_snapshot(fleet, name).counters["preinfer_signals"] == before + 1


def test_worker_keeps_serving_after_bad_input(fleet):
    for name in fleet.names:
        with pytest.raises(RankError, match="user_id"):
            fleet.client.send_rank({"user_id": ["not", "a", "string"]}, instance=name).wait()
        assert fleet.client.app.send_task(RANK_TASK, args=[None], queue=fleet.keys.rank_queue(name)).get(5)["error"]
    for name in fleet.names:
        reply = fleet.client.send_rank({"user_id": "after-bad-input", "deadline_s": time.time() + 2, **SMALL},
                                       instance=name).wait()
        assert reply.instance == name
        assert fleet.procs[name].poll() is None


def test_a_pickled_task_is_refused_unread_and_the_instance_serves_on(fleet, tmp_path):
    # Whoever can write to Redis can queue a message: one in pickle would run code when loaded.
    marker = tmp_path / "unpickled"
    refusals = {name: refused_pickles(fleet, name) for name in fleet.names}
    for name in fleet.names:
        fleet.client.app.send_task(RANK_TASK, args=[CreatesFileWhenUnpickled(marker)],
                                   queue=fleet.keys.rank_queue(name), serializer="pickle")
    for name in fleet.names:
        wait_for(lambda name=name: refused_pickles(fleet, name) == refusals[name] + 1, 30.0,
                 what=f"{name} to refuse the pickle")
        reply = fleet.client.send_rank({"user_id": "after-a-pickle", "deadline_s": time.time() + 5, **SMALL},
                                       instance=name).wait()
        assert reply.instance == name and fleet.procs[name].poll() is None
    assert not marker.exists()


def refused_pickles(fleet, name: str) -> int:
    return (fleet.logdir / f"{name}.log").read_text().count(
        "Received invalid task message: Refusing to deserialize untrusted content of type pickle")


def test_ranking_does_not_wait_behind_a_pre_infer_backlog(fleet):
    name = fleet.names[0]
    key = fleet.keys.preinfer_signals(name)
    # A backlog at once, as a burst of retrievals would leave it: written straight to the signal list.
    pipe = fleet.redis.pipeline(transaction=False)
    for i in range(5000):
        pipe.rpush(key, signals.entry({"user_id": f"backlog-{i}", "seq_len": 600}))
    pipe.execute()
    reply = fleet.client.send_rank({"user_id": "behind-backlog", "deadline_s": time.time() + 30, **SMALL},
                                   instance=name).wait()
    still_queued = fleet.redis.llen(key)
    assert len(reply.scores) == SMALL["n_candidates"]
    assert still_queued > 0, "the ranking request waited until the pre-infer backlog drained"
    fleet.redis.delete(key)  # the rest is no later test's business
