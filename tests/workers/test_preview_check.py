"""The preview check's changes: each one field of the live spec, the rest as it was; its tables."""

from __future__ import annotations

import pytest

from relay_engine.core.config import parse_policy
from workers.preview_check import _at, changed, curve_table, live_table, table

LIVE = {"trigger": {"at_risk_seq_len": 600, "ranking_p99_slo_ms": 265}, "cache": {"hbm_budget_mb": 1024}}


@pytest.mark.parametrize(("change", "field", "before", "after"), [
    ("trigger", "trigger.at_risk_seq_len", 600, 1200),
    ("hbm", "cache.hbm_budget_mb", 1024, 512),
    ("ttl", "cache.entry_ttl_ms", 120_000, 30_000),  # not in the live spec: the schema's default
])
def test_each_change_is_one_field_and_parses(change, field, before, after):
    spec, words, values = changed(LIVE, change, None)
    assert values == {"field": field, "live": before, "proposed": after}
    assert words == f"{field} {before:g} → {after:g}"
    policy = parse_policy(spec)
    assert policy.trigger.ranking_p99_slo_ms == 265
    section, name = field.split(".")
    assert getattr(getattr(policy, section), name) == after
    assert LIVE["cache"] == {"hbm_budget_mb": 1024}  # the live spec itself untouched


def test_a_given_threshold_is_used_and_the_table_shows_ms_and_shares():
    spec, words, _ = changed(LIVE, "trigger", 2048)
    assert spec["trigger"]["at_risk_seq_len"] == 2048 and words == "trigger.at_risk_seq_len 600 → 2048"
    side = {"p99_ms": 54.36, "p50_ms": 11.78, "within_slo_share": 0.9975, "hit_ratio": 0.68, "requests": 1187}
    report = {"pool": "main", "window": "5m", "change": {"words": words},
              "predicted": {"live": side, "proposed": side}, "measured": {"live": side, "proposed": side},
              "preview": {"profile": {"note": "fitted"}, "model_error": None, "model_error_note": "n/a",
                          "wall_s": 2.4}}
    text = table(report)
    assert "| P99 (ms) | 54.4 |" in text and "| P50 (ms) | 11.8 |" in text and "| within SLO | 99.75 % |" in text
    assert "on the host" not in text
    report["preview"]["host_background"] = {"share": 0.07, "note": "other processes took 7.0 % of each core"}
    assert "profile: fitted; on the host, other processes took 7.0 % of each core)" in table(report)


def test_the_live_table_counts_the_windows_whose_p99_is_within_a_quarter():
    def row(predicted, measured):
        return {"predicted": {"p99_ms": predicted, "p50_ms": 11.0, "within_slo_share": 0.997, "hit_ratio": 0.65,
                              "requests": 1100, "replicates": 9, "p99_range_ms": [predicted * 0.8, predicted * 1.3]},
                "measured": {"p99_ms": measured, "p50_ms": 12.0, "within_slo_share": 0.995, "hit_ratio": 0.68,
                             "requests": 1180}}
    report = {"pool": "main", "window": "5m", "generation": 2,
              "windows": [row(50.0, 60.0), row(70.0, 50.0), row(40.0, 60.0)]}
    text = live_table(report)
    assert "| 1 | 1180 | 50.0 / 60.0 | -17 % | 9 (40.0–65.0) |" in text
    assert "| 2 | 1180 | 70.0 / 50.0 | +40 % |" in text
    assert "P99 within ±25 % of the measured in 1 of 3 windows." in text
    assert "own 95 % intervals" not in text
    report["windows"][1]["measured"]["p99_interval_ms"] = [41.0, 62.5]
    assert "Measured P99s' own 95 % intervals (the window's requests alone): window 2 41.0–62.5." in live_table(report)


def test_the_curve_is_read_between_its_points_and_never_past_them():
    points = [{"budget_mb": 128, "hit_ratio": 0.5}, {"budget_mb": 256, "hit_ratio": 0.7},
              {"budget_mb": 512, "hit_ratio": 0.8}]
    assert _at(points, 192) == pytest.approx(0.6)
    assert _at(points, 512) == pytest.approx(0.8)
    assert _at(points, 64) is None and _at(points, 1024) is None


def test_the_curve_table_sets_the_curve_against_the_measured_at_the_live_budget_and_the_simulator_elsewhere():
    report = {"pool": "main", "window": "15m", "requests": 7200, "sampling_rate": 1.0, "elapsed_ms": 41.0,
              "error_points": -1.2,
              "rows": [{"factor": 1.0, "hbm_budget_mb": 512, "curve": 0.70, "measured": 0.712, "simulated": None},
                       {"factor": 0.5, "hbm_budget_mb": 256, "curve": 0.61, "measured": None, "simulated": 0.63}]}
    text = curve_table(report)
    assert "| 512 MiB (1×) | 70.00 % | 71.20 % | – | -1.20 |" in text
    assert "| 256 MiB (0.5×) | 61.00 % | – | 63.00 % | -2.00 |" in text


def test_the_curve_table_sets_the_live_revisions_preview_against_the_measured_window():
    report = {"pool": "main", "window": "15m", "requests": 7200, "sampling_rate": 1.0, "elapsed_ms": 41.0,
              "error_points": 0.0, "rows": [],
              "measured": {"p99_ms": 40.0, "p50_ms": 10.0, "within_slo_share": 0.99, "hit_ratio": 0.5},
              "live_previews": [{"p99_ms": 46.0, "p50_ms": 11.0, "within_slo_share": 0.98, "hit_ratio": 0.49}]}
    text = curve_table(report)
    assert "P99 46.0 ms predicted, 40.0 measured (+15 %); within SLO 98.00 % / 99.00 %" in text


def test_the_table_splits_the_next_windows_error_and_shows_the_scorecard():
    live = {"p99_ms": 100.0, "p50_ms": 10.0, "within_slo_share": 0.99, "hit_ratio": 0.70, "requests": 3600}
    proposed = {"p99_ms": 120.0, "p50_ms": 12.0, "within_slo_share": 0.985, "hit_ratio": 0.60, "requests": 3600}
    measured = {"p99_ms": 100.0, "p50_ms": 12.0, "within_slo_share": 0.98, "hit_ratio": 0.62, "requests": 3500,
                "p99_interval_ms": [85.0, 125.0]}
    replayed = {"p99_ms": 105.0, "p50_ms": 12.5, "within_slo_share": 0.98, "hit_ratio": 0.615, "requests": 3500}
    report = {"pool": "main", "window": "15m", "change": {"words": "cache.hbm_budget_mb 1024 → 512"},
              "predicted": {"live": live, "proposed": proposed}, "measured": {"live": live, "proposed": measured},
              "preview": {"profile": {"note": "fitted"}, "model_error": None, "model_error_note": "n/a", "wall_s": 9.0},
              "hindsight": {"predicted": replayed},
              "score": {"status": "done", "reason": "", "measure_from": "a", "measure_to": "b",
                        "errors": {"p99": 0.183, "p50": -0.02, "within_slo_points": 0.4, "hit_ratio_points": -1.5}}}
    text = table(report)
    assert "| P99 (ms) | 100.0 | 100.0 | 120.0 | 100.0 | +20.0 % | 105.0 | +5.0 % |" in text
    assert "| hit ratio | 70.00 % | 70.00 % | 60.00 % | 62.00 % | -2.00 pt | 61.50 % | -0.50 pt |" in text
    assert "Measured P99 of the proposed revision: 100.0 ms, 95 % interval 85.0–125.0 from the window's requests " \
           "alone; the prediction is inside it." in text
    assert "Measured P99 of the live revision" not in text  # no interval there
    assert "Scorecard (the control plane's own score, a → b): P99 +18.3 %, P50 -2.0 %, within SLO +0.40 pt, " \
           "hit ratio -1.50 pt" in text
    report["score"] = {"status": "failed", "reason": "superseded by generation 9"}
    assert "Scorecard: failed: superseded by generation 9" in table(report)
    report["score"] = None
    assert "Scorecard: no score of this preview was read back." in table(report)
