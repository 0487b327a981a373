"""Forward times: the buckets, their sums and differences, the wire form and the timed real model."""

from __future__ import annotations

import json
import math
import zlib

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from relay_engine.core.config import parse_policy
from relay_engine.core.engine import PreInferRequest, RankRequest, RelayEngine
from relay_engine.core.forward_times import (
    DRIFT_MIN_COUNT,
    MAX_BUCKET,
    MAX_RECORD_JSON_BYTES,
    SUMS,
    ForwardTimes,
    ForwardTimesError,
    ForwardTimesRecord,
    bucket_bounds,
    length_bucket,
)
from relay_engine.core.model import History, ModelConfig


@pytest.mark.parametrize("n", [1, 2, 3, 127, 128, 129, 511, 512, 4096, 8191, 10**6])
def test_a_length_lies_in_its_buckets_bounds(n):
    lo, hi = bucket_bounds(length_bucket(n))
    assert lo <= n < hi or length_bucket(n) in (0, MAX_BUCKET)
    assert hi / max(lo, 1) <= 2 ** 0.25 + 0.02 or lo < 8  # quarter octaves (rounding shows at a few tokens)


def test_means_and_dispersion_of_a_bucket():
    times = ForwardTimes()
    for ms in (10.0, 12.0, 14.0):
        times.record("prefill", 1000, 0, 0, ms)
    times.record("rank", 1000, 32, 128, 3.0)
    times.record("rank", 1000, 32, 128, float("nan"))  # never counted
    prefill, rank = times.means()
    assert (prefill.op, prefill.count, prefill.n, prefill.mean_ms) == ("prefill", 3, 1000, 12.0)
    assert prefill.cv == pytest.approx(2.0 / 12.0)
    assert (rank.count, rank.s, rank.c, rank.cv) == (1, 32, 128, 0.0)
    assert times.count == 4


def test_a_window_is_the_newer_record_less_the_older():
    earlier = ForwardTimes()
    earlier.record("rank_full", 300, 8, 16, 5.0)
    later = earlier.copy()
    later.record("rank_full", 300, 8, 16, 7.0)
    later.record("prefill", 300, 0, 0, 2.0)
    window = later.minus(earlier)
    assert [(m.op, m.count, m.mean_ms) for m in window.means()] == [("prefill", 1, 2.0), ("rank_full", 1, 7.0)]
    # A bucket that went down (another run) counts whole, never negative.
    assert earlier.minus(later).means()[0].count == 1


def test_a_record_round_trips_and_hostile_fields_are_named():
    times = ForwardTimes()
    times.record("rank", 2048, 30, 128, 4.25)
    record = ForwardTimesRecord("ranking-a.0", 1.7e9, 1.7e9 - 5, "cpu", "v1", "thread_cpu", times)
    back = ForwardTimesRecord.from_json(record.to_json())
    assert back.times.to_dict() == times.to_dict() and back.instance == "ranking-a.0"
    good = json.loads(record.to_json())
    for path, value, named in [
        (("ops", "rank"), {"x": [1, 1, 1, 1, 1, 1, 1]}, "bucket 'x'"),
        (("ops", "rank"), {"9999": [1, 1, 1, 1, 1, 1, 1]}, "bucket '9999'"),
        (("ops", "rank"), {"44": [1, 1]}, "must be a list of 7"),
        (("ops", "rank"), {"44": [1, -1, 1, 1, 1, 1, 1]}, "sum_ms"),
        (("ops", "rank"), {"44": [1, 1, 1e400, 1, 1, 1, 1]}, "sum_sq_ms"),
        (("ops", "rank"), {"44": [True, 1, 1, 1, 1, 1, 1]}, "count"),
        (("ops",), {"dance": {}}, "unknown operation"),
        (("ts",), float("inf"), "ts"),
        (("device",), "", "device"),
    ]:
        data = json.loads(json.dumps(good))
        target = data
        for key in path[:-1]:
            target = target[key]
        target[path[-1]] = value
        with pytest.raises(ForwardTimesError, match=named):
            ForwardTimesRecord.from_json(json.dumps(data))
    with pytest.raises(ForwardTimesError, match="not JSON"):
        ForwardTimesRecord.from_json(b"\x80\x04pickle")


def test_a_stream_entry_is_the_record_deflated_its_sums_to_the_microsecond_and_a_bomb_is_refused():
    times = ForwardTimes()
    for n in range(64, 4096, 7):  # a busy instance's day: every bucket, large sums
        times.record("rank", n, 32, 128, 0.01 * n + 1 / 3, 0.011 * n)
    for row in times.sums["rank"].values():
        row[:] = [v * 1e4 for v in row]
    record = ForwardTimesRecord("ranking-a.0", 1.7e9, 1.7e9 - 5, "cpu", "v1", "thread_cpu", times)
    entry = record.to_entry()
    assert set(entry) == {"z"} and len(entry["z"]) < len(record.to_json()) / 2
    back = ForwardTimesRecord.from_entry({b"z": entry["z"]})  # as a client that does not decode reads it
    for b, row in times.sums["rank"].items():  # counts and token sums exact, times to the microsecond
        got = back.times.sums["rank"][b]
        assert got[0] == row[0] and got[3:6] == row[3:6]
        assert all(abs(x - y) <= 5e-4 for x, y in zip(got[1:3] + got[6:], row[1:3] + row[6:], strict=True))
    assert ForwardTimesRecord.from_entry({"d": record.to_json()}).times.to_dict() == back.times.to_dict()  # an older worker's
    deflater = zlib.compressobj(9, zlib.DEFLATED, -15)
    bomb = deflater.compress(b" " * (MAX_RECORD_JSON_BYTES + 10)) + deflater.flush()
    for fields, named in [({"z": bomb}, "inflates past"), ({"z": entry["z"][:-3]}, "truncated"),
                          ({"z": b"\x00plain"}, "not a deflated record"), ({"x": b"1"}, "neither field"),
                          ({"z": "text"}, "read as text")]:
        with pytest.raises(ForwardTimesError, match=named):
            ForwardTimesRecord.from_entry(fields)


@given(st.recursive(st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=5),
                    lambda inner: st.lists(inner, max_size=7) | st.dictionaries(st.text(max_size=5), inner, max_size=4),
                    max_leaves=20))
def test_any_ops_value_is_read_or_refused_by_name(value):
    try:
        times = ForwardTimes.from_dict(value)
    except ForwardTimesError as exc:
        assert str(exc).startswith("forwards")
    else:
        for mean in times.means():
            assert math.isfinite(mean.mean_ms) and mean.count >= 1
        assert set(SUMS) and times.count >= 0


def test_the_real_model_times_every_forward_with_its_shape():
    engine = RelayEngine(ModelConfig(num_layers=1, num_heads=2, head_dim=8, max_seq_len=512), device="cpu",
                         policy=parse_policy({"trigger": {"at_risk_seq_len": 100}}))
    try:
        assert engine.forward_clock == "thread_cpu"
        prefix = History(torch.arange(1, 201), torch.zeros(200, dtype=torch.int64))
        short = History(torch.arange(1, 5), torch.zeros(4, dtype=torch.int64))
        engine.rank(RankRequest("cold", prefix, short, torch.arange(1, 9)))  # a miss: the full rank
        assert engine.pre_infer(PreInferRequest("warm", prefix)).admitted
        engine.rank(RankRequest("warm", prefix, short, torch.arange(1, 9)))  # against the cached prefix
        got = {(m.op, m.count, round(m.n), round(m.s), round(m.c)) for m in engine.forward_times.means()}
        assert got == {("rank_full", 1, 200, 4, 8), ("prefill", 1, 200, 0, 0), ("rank", 1, 200, 4, 8)}
        assert all(m.mean_ms > 0 for m in engine.forward_times.means())
    finally:
        engine.close()


def _drifting(times: ForwardTimes, *, slow: bool, n: int = 600, seed: int = 3) -> None:
    """Forwards every 50 ms whose times either drift in runs of 2 s (slow) or vary on their own."""
    rng = __import__("random").Random(seed)
    level = 1.0
    for i in range(n):
        if slow and i % 40 == 0:
            level = rng.choice((0.7, 1.3))
        times.record("rank", 1000, 32, 128, 10.0 * (level if slow else rng.choice((0.7, 1.3))), at_s=i * 0.05)


def test_drift_pairs_forwards_by_lag_and_sees_runs_of_slow_forwards():
    runs, alone = ForwardTimes(), ForwardTimes()
    _drifting(runs, slow=True)
    _drifting(alone, slow=False)

    def covariance(times, lag_bin):
        count, total = times.drift.dev[:2]
        pairs, product, _ = times.drift.pairs[lag_bin]
        return product / pairs - (total / count) ** 2

    assert runs.drift.dev[0] == 600 - DRIFT_MIN_COUNT  # every forward once its bucket has a mean
    assert all(row[0] > 0 for row in runs.drift.pairs[:-1])  # 50 ms apart: pairs at 0.05 … 3.15 s (64 recent)
    assert 0.05 <= runs.drift.pairs[0][2] / runs.drift.pairs[0][0] < 0.1  # the bin [0, 0.1 s)'s mean lag
    assert covariance(runs, 0) > 0.05 and abs(covariance(alone, 0)) < 0.02  # log(1.3/0.7)²/4 ≈ 0.096 in runs


def test_drift_travels_subtracts_and_an_older_record_without_it_reads_as_none():
    times = ForwardTimes()
    _drifting(times, slow=True, n=200)
    record = ForwardTimesRecord("i-0", 1_700_000_000.0, 1_699_999_000.0, "cpu", "v1", "thread_cpu", times)
    back = ForwardTimesRecord.from_json(record.to_json()).times
    assert back.drift.dev[0] == times.drift.dev[0] and back.drift.pairs[1][0] == times.drift.pairs[1][0]
    earlier = ForwardTimes()
    _drifting(earlier, slow=True, n=100)
    window = times.minus(earlier)
    assert window.drift.dev[0] == times.drift.dev[0] - earlier.drift.dev[0]
    assert window.drift.pairs[0][0] == times.drift.pairs[0][0] - earlier.drift.pairs[0][0]
    old = json.loads(record.to_json())
    del old["drift"]
    assert ForwardTimesRecord.from_json(json.dumps(old)).times.drift.dev == [0.0] * 6
    for field, value, named in (("lag_edges_s", [0, 1], "lag_edges_s"), ("pairs", [[1, 2, 3]], "pairs"),
                                ("dev", [1, 2], "dev")):
        hostile = json.loads(record.to_json())
        hostile["drift"][field] = value
        with pytest.raises(ForwardTimesError, match=f"drift.{named}"):
            ForwardTimesRecord.from_json(json.dumps(hostile))
    hostile = json.loads(record.to_json())
    hostile["drift"]["pairs"][2][0] = -1
    with pytest.raises(ForwardTimesError, match=r"drift.pairs\[2\].pairs"):
        ForwardTimesRecord.from_json(json.dumps(hostile))
