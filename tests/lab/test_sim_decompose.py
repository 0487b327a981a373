"""``python -m relay_engine.sim decompose``: a kept preview replayed request by request against the capture."""

from __future__ import annotations

import json
import random

import pytest

from relay_engine.core.capture import CaptureRecord, to_trace, trace_order
from relay_engine.lab.sim import cli
from relay_engine.lab.sim.decompose import KeptError, read_capture, replay_rows
from tests.lab.test_livefit import true_model


def captured(n: int = 300, seed: int = 0) -> list[CaptureRecord]:
    """Records as two instances would write them: arrival order differs from signal order (gaps vary)."""
    rng = random.Random(seed)
    out = []  # as read back from the stream (times kept to the µs)
    for i in range(n):
        user = f"u{rng.randrange(20)}"
        outcome = rng.choice(["hbm", "miss", "miss", "inflight", "deadline_exceeded"])
        out.append(CaptureRecord(ts_ms=1.7e12 + 250.0 * i + rng.uniform(0, 200), user=user,
                                 prefix_len=rng.choice([64, 256, 1024]), short_len=8, candidates=16,
                                 gap_ms=rng.uniform(20, 200), outcome=outcome,
                                 latency_ms=0.0 if outcome == "deadline_exceeded" else rng.uniform(5, 90),
                                 instance=f"main.{int(user[1:]) % 2}"))
    return [CaptureRecord.from_fields(r.to_fields()) for r in out]


def keep(tmp_path, records: list[CaptureRecord], base_path, *, warmup: int = 50, max_requests: int = 200):
    """A preview folder as the control plane keeps it (``RELAYGR_PREVIEW_KEEP_DIR``)."""
    folder = tmp_path / "preview-7"
    folder.mkdir()
    (folder / "trace.jsonl").write_text("".join(q.to_json() + "\n" for q in to_trace(records)))
    (folder / "capture.jsonl").write_text("".join(json.dumps(r.to_fields()) + "\n" for _, r in trace_order(records)))
    (folder / "live.json").write_text(json.dumps({"trigger": {"ranking_p99_slo_ms": 60}}))
    (folder / "proposed.json").write_text("{}")
    elsewhere = "/tmp/relaygr-preview-gone"  # the preview's own temporary folder, long deleted
    (folder / "command.json").write_text(json.dumps({"pool": "main", "argv": [
        "preview", "--trace", f"{elsewhere}/trace.jsonl", "--live", f"{elsewhere}/live.json",
        "--proposed", f"{elsewhere}/proposed.json", "--instances", "2", "--profile", str(base_path),
        "--out", f"{elsewhere}/out.json", "--warmup-requests", str(warmup), "--max-requests", str(max_requests)]}))
    return folder


def test_every_measured_request_is_set_beside_its_own_captured_record(tmp_path, capsys):
    base_path = tmp_path / "base.json"
    true_model().save(base_path)
    records = captured()
    folder = keep(tmp_path, records, base_path)
    out = tmp_path / "decomposed.json"
    assert cli.main(["decompose", str(folder), "--out", str(out), "--slowest", "5"]) == 0
    report = json.loads(out.read_text())
    ordered = [r for _, r in trace_order(records)]
    rows = report["rows"]
    # 300 requests, the first 50 warm up: the last 200 are measured, each once, against its own record.
    assert len(rows) == 200 and sorted(r["query"] for r in rows) == list(range(100, 300))
    for row in rows:
        record = ordered[row["query"]]
        assert (row["prefix_len"], row["real_outcome"], row["real_instance"]) == (
            record.prefix_len, record.outcome, record.instance)
        assert row["real_ms"] == pytest.approx(record.latency_ms, abs=1e-3)  # kept to the µs
        assert row["sim_ms"] >= row["queued_ms"] and row["forward_ms"] >= row["work_ms"] - 1e-9
    measured = [ordered[i] for i in range(100, 300)]
    served = sorted(r.latency_ms for r in measured if r.outcome != "deadline_exceeded")
    assert report["real"]["deadline_missed"] == sum(r.outcome == "deadline_exceeded" for r in measured)
    assert report["real"]["max_ms"] == pytest.approx(served[-1], abs=1e-3)
    assert sum(o["requests"] for o in report["outcomes"]) == 200
    assert len(report["slowest_real"]) == 5 and report["slowest_real"][0]["real_ms"] == pytest.approx(served[-1], abs=1e-3)
    printed = capsys.readouterr().out
    assert "Outcomes, captured → simulated" in printed and "Where the simulated time went" in printed


def test_a_capture_that_is_not_the_traces_requests_is_refused(tmp_path):
    base_path = tmp_path / "base.json"
    true_model().save(base_path)
    records = captured(120)
    folder = keep(tmp_path, records, base_path, warmup=10)
    lines = (folder / "capture.jsonl").read_text().splitlines()
    (folder / "capture.jsonl").write_text("\n".join(lines[:-1]) + "\n")
    with pytest.raises(KeptError, match="the trace holds 120 queries and the capture 119 records"):
        replay_rows(to_trace(records), read_capture(folder / "capture.jsonl"), None, true_model(), instances=2,
                    rank_threads=4, host=(1, 1.0), max_requests=200, warmup_requests=10)
    (folder / "capture.jsonl").write_text('{"t": "x"}\n')
    assert cli.main(["decompose", str(folder)]) == 2
