"""The pool's forward times over a window (``GET …/forwards/``): differences of each instance's
cumulative records, one model's only, and every unreadable record named instead of a 500."""

from __future__ import annotations

import time

import pytest

from relay_engine.core.forward_times import ForwardTimes, ForwardTimesRecord
from relay_engine.core.wire import PoolKeys

POOL = "ranking-a"
URL = f"/api/v1/pools/{POOL}/forwards/"


def times(op: str, n: int, ms: float, count: int) -> ForwardTimes:
    out = ForwardTimes()
    for _ in range(count):
        out.record(op, n, 32, 128, ms)
    return out


def plant(client, instance: str, at: float, started_at: float, recorded: ForwardTimes, model: str = "v1",
          device: str = "cpu", coarse: bool = False) -> None:
    record = ForwardTimesRecord(instance, at, started_at, device, model, "thread_cpu", recorded)
    client.xadd(PoolKeys(POOL).forward_times(instance, coarse=coarse), record.to_entry(), id=f"{int(at * 1000)}-0")
    client.zadd(PoolKeys(POOL).reporting, {instance: at})


def test_the_window_is_each_instances_newest_record_less_the_one_before_it(viewer, pool, redis_client):
    now = time.time()
    cumulative = times("rank", 1000, 4.0, 10)
    plant(redis_client, f"{POOL}.0", now - 1200, now - 3000, cumulative)  # before a 15-min window
    later = cumulative.copy()
    later.merge(times("rank", 1000, 6.0, 5))
    later.merge(times("prefill", 2000, 30.0, 3))
    plant(redis_client, f"{POOL}.0", now - 10, now - 3000, later)
    plant(redis_client, f"{POOL}.1", now - 5, now - 200, times("rank", 1000, 5.0, 4))  # a run begun in the window
    plant(redis_client, f"{POOL}.2", now - 5, now - 200, times("rank", 1000, 50.0, 9), model="v0")  # another model
    redis_client.xadd(PoolKeys(POOL).forward_times(f"{POOL}.3"), {"d": '{"format": "relaygr-forward-times/1", '
                                                                       '"instance": "x", "ops": {"rank": 7}}'})
    redis_client.zadd(PoolKeys(POOL).reporting, {f"{POOL}.3": now})
    answer = viewer.get(URL)
    assert answer.status_code == 200, answer.content
    body = answer.json()
    assert body["instances"] == [f"{POOL}.0", f"{POOL}.1"] and body["other_models"] == [f"{POOL}.2"]
    assert body["model_version"] == "v1" and body["device_kind"] == "cpu" and body["clock"] == "thread_cpu"
    assert list(body["unreadable"]) == [f"{POOL}.3"] and "forward-times record" in body["unreadable"][f"{POOL}.3"]
    rows = {row["op"]: row for row in body["summary"]}
    assert rows["rank"]["forwards"] == 9 and rows["rank"]["mean_ms"] == round((5 * 6.0 + 4 * 5.0) / 9, 4)
    assert rows["prefill"]["forwards"] == 3 and rows["rank"]["tokens_from"] <= 1000 < rows["rank"]["tokens_to"]
    assert body["forwards"] == 12 and ForwardTimes.from_dict(body["ops"]).count == 12
    # A window of 30 s: instance 0's newest record less its last one before the window (the same one).
    short = viewer.get(URL, {"window_s": 30}).json()
    assert short["window_s"] == 30 and short["forwards"] == 12
    assert viewer.get(URL, {"window_s": 8}).status_code == 400


def test_a_long_window_begins_at_the_long_streams_record_before_it_and_says_where(viewer, pool, redis_client):
    """The short stream keeps 2.5 min; an hour's window takes its far end from the long one (a record every
    10 min), the later of the two streams' records before the window, and says where the forwards begin."""
    now = time.time()
    name = f"{POOL}.0"
    at_start = times("rank", 1000, 4.0, 10)
    plant(redis_client, name, now - 3700, now - 4000, at_start, coarse=True)  # before an hour's window
    plant(redis_client, name, now - 1300, now - 4000, at_start, coarse=True)
    grown = at_start.copy()
    grown.merge(times("rank", 1000, 6.0, 5))
    plant(redis_client, name, now - 1000, now - 4000, grown, coarse=True)  # inside a 20 min window
    newest = grown.copy()
    newest.merge(times("rank", 1000, 8.0, 2))
    plant(redis_client, name, now - 100, now - 4000, grown)  # the short stream: 2.5 min of it
    plant(redis_client, name, now - 10, now - 4000, newest)

    hour = viewer.get(URL, {"window_s": 3600}).json()
    assert hour["forwards"] == 7 and hour["from"] == pytest.approx(now - 3700, abs=0.01)
    twenty = viewer.get(URL, {"window_s": 1200}).json()  # the far end to the nearest record: 1300 s back
    assert twenty["forwards"] == 7 and twenty["from"] == pytest.approx(now - 1300, abs=0.01)
    minute = viewer.get(URL, {"window_s": 60}).json()  # the short stream's record at 100 s back
    assert minute["forwards"] == 2 and minute["from"] == pytest.approx(now - 100, abs=0.01)
    # An older worker's plain JSON in field d is read too; a deflated entry that is not one is named.
    redis_client.xadd(PoolKeys(POOL).forward_times(f"{POOL}.1"), {"d": ForwardTimesRecord(
        f"{POOL}.1", now - 5, now - 60, "cpu", "v1", "thread_cpu", times("rank", 1000, 5.0, 3)).to_json()})
    redis_client.xadd(PoolKeys(POOL).forward_times(f"{POOL}.2"), {"z": b"\x00not deflated"})
    redis_client.zadd(PoolKeys(POOL).reporting, {f"{POOL}.1": now, f"{POOL}.2": now})
    body = viewer.get(URL, {"window_s": 60}).json()
    assert body["instances"] == [f"{POOL}.0", f"{POOL}.1"] and body["forwards"] == 5
    assert "not a deflated record" in body["unreadable"][f"{POOL}.2"]


def test_a_pool_without_forwards_answers_empty_and_a_bad_window_names_the_field(viewer, pool, redis_on):
    body = viewer.get(URL).json()
    assert (body["instances"], body["forwards"], body["summary"], body["model_version"]) == ([], 0, [], None)
    answer = viewer.get(URL, {"window_s": "1e400"})
    assert answer.status_code == 400 and "window_s" in answer.json()["errors"]


def test_forward_times_need_a_login(clients, pool, redis_on):
    assert clients["anonymous"].get(URL).status_code == 401


def test_the_simulated_fleet_shares_a_hosts_cores_between_its_cpu_instances(pool, worker_factory):
    from controlplane.previews.services import _sim_command, pool_fleet

    workers = [worker_factory(POOL, i) for i in range(3)]
    for i, worker in enumerate(workers):
        worker.status.host, worker.status.host_cpus, worker.status.torch_threads = ("box-a" if i < 2 else "box-b"), 2, 1
        worker.heartbeat()
    fleet = pool_fleet(pool=pool)
    assert (fleet.instances, fleet.device_kind, fleet.instances_per_host, fleet.host_cores) == (3, "cpu", 2, 2)
    assert "on 2 hosts (simulated 2 to a host of 2 cores" in fleet.note
    command = _sim_command({name: name for name in ("trace", "live", "proposed", "forwards", "out")}, fleet)
    assert command[command.index("--instances-per-host") + 1] == "2" and command[command.index("--host-cores") + 1] == "2"
    # Instances that say nothing of their host (an older worker), or run several torch threads: each its own.
    for worker in workers:
        worker.status.torch_threads = 4
        worker.heartbeat()
    fleet = pool_fleet(pool=pool)
    assert (fleet.instances_per_host, fleet.host_cores, fleet.note) == (1, 1, "3 live instances")
    assert "--instances-per-host" not in _sim_command({n: n for n in ("trace", "live", "proposed", "forwards", "out")},
                                                      fleet)
