"""Capture records: what Redis hands back is checked field by field; records become a trace."""

from __future__ import annotations

import pytest

from relay_engine.core.capture import (
    DEFAULT_GAP_MS,
    CaptureError,
    CaptureRecord,
    capture_key,
    to_trace,
    trace_order,
    user_hash,
)
from relay_engine.core.telemetry import MissReason

KEY = capture_key("a capture secret of the core tests, not a real one", "p")


def record(ts_ms: float, user: str = "u", gap_ms: float | None = 40.0, **changes) -> CaptureRecord:
    values = dict(ts_ms=ts_ms, user=user_hash(KEY, user), prefix_len=300, short_len=4, candidates=16,
                  gap_ms=gap_ms, outcome="hbm", latency_ms=2.0)
    return CaptureRecord(**{**values, **changes})


def test_a_record_survives_its_stream_fields():
    for gap in (12.5, None):
        r = record(1.7e12, gap_ms=gap)
        assert CaptureRecord.from_fields(r.to_fields()) == r


def test_a_miss_carries_its_reason_and_an_older_record_without_one_reads_as_none():
    miss = record(1.7e12, outcome="miss", miss_reason=MissReason.EVICTED_HBM)
    assert miss.to_fields()["r"] == MissReason.EVICTED_HBM
    assert CaptureRecord.from_fields(miss.to_fields()) == miss
    older = record(1.7e12).to_fields()
    assert "r" not in older and CaptureRecord.from_fields(older).miss_reason == ""


def test_the_ranks_cpu_time_and_the_signals_delay_survive_their_fields_and_older_records_have_none():
    r = record(1.7e12, cpu_ms=4.25, signal_delay_ms=12.5)
    assert (r.to_fields()["k"], r.to_fields()["d"]) == ("4.250", "12.500") and CaptureRecord.from_fields(r.to_fields()) == r
    older = record(1.7e12).to_fields()
    assert "k" not in older and "d" not in older
    assert (CaptureRecord.from_fields(older).cpu_ms, CaptureRecord.from_fields(older).signal_delay_ms) == (None, None)
    for name in ("k", "d"):
        with pytest.raises(CaptureError, match="cpu_ms" if name == "k" else "signal_delay_ms"):
            CaptureRecord.from_fields({**older, name: "-3"})


def test_the_serving_instance_survives_its_stream_field_and_older_records_have_none():
    r = record(1.7e12, instance="pool-a:gpu0:1234")
    assert r.to_fields()["i"] == "pool-a:gpu0:1234" and CaptureRecord.from_fields(r.to_fields()) == r
    older = record(1.7e12).to_fields()
    assert "i" not in older and CaptureRecord.from_fields(older).instance == ""


def test_an_instance_that_is_no_name_is_an_error_naming_it():
    fields = {**record(1.7e12).to_fields(), "i": "x" * 500}
    with pytest.raises(CaptureError, match=r"capture record\.instance"):
        CaptureRecord.from_fields(fields)


@pytest.mark.parametrize(("name", "value", "field"), [
    ("p", "-1", "prefix_len"), ("p", "9" * 500, "prefix_len"), ("t", "nan", "ts_ms"), ("o", "exploded", "outcome"),
    ("u", "not a hash!", "user"), ("g", "inf", "gap_ms"), ("c", "1.5", "candidates"), ("r", "bad luck", "miss_reason"),
])
def test_a_broken_field_is_an_error_naming_it(name, value, field):
    fields = record(1.7e12).to_fields()
    fields[name] = value
    with pytest.raises(CaptureError, match=rf"capture record\.{field}"):
        CaptureRecord.from_fields(fields)


def test_a_missing_field_is_named():
    fields = record(1.7e12).to_fields()
    del fields["l"]
    with pytest.raises(CaptureError, match="latency_ms is missing"):
        CaptureRecord.from_fields(fields)


def test_the_trace_starts_at_the_first_pre_infer_signal_and_keeps_the_gaps():
    queries = to_trace([record(10_100.0, "a", 50.0), record(10_000.0, "b", 20.0), record(10_200.0, "a", None)])
    assert [q.t_ms for q in queries] == [0.0, 70.0, 185.0]  # signals at 9,980; 10,050; 10,200 − median 35
    assert [q.rank_delay_ms for q in queries] == [20.0, 50.0, 35.0]
    assert queries[1].user_id == queries[2].user_id != queries[0].user_id


def test_requests_no_trace_can_hold_are_left_out_and_a_window_without_gaps_assumes_the_default():
    queries = to_trace([record(0.0, gap_ms=None), record(5.0, prefix_len=0, outcome="invalid_input")])
    assert len(queries) == 1 and queries[0].rank_delay_ms == DEFAULT_GAP_MS


def test_the_trace_names_the_instance_that_served_each_request_in_the_records_order():
    records = [record(10_100.0, "a", 50.0, instance="main.1"), record(10_000.0, "b", 20.0, instance="main.0"),
               record(10_200.0, "a", None)]
    queries = to_trace(records)
    assert [q.instance for q in queries] == ["main.0", "main.1", ""]
    assert [r for _, r in trace_order(records)] == [records[1], records[0], records[2]]  # query i is record i
