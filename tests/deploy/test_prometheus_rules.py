"""The shipped Prometheus rules (deploy/prometheus/): valid for promtool, every unit test passing, and
every alert covered by a case that fires it and one that does not."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from tests.promtool import promtool

RULES_DIR = Path(__file__).resolve().parents[2] / "deploy" / "prometheus"
RULES = RULES_DIR / "relaygr-rules.yml"
RULE_TESTS = RULES_DIR / "relaygr-rules.test.yml"


def _alerts() -> list[str]:
    return [rule["alert"] for group in yaml.safe_load(RULES.read_text())["groups"] for rule in group["rules"]
            if "alert" in rule]


def _series_labels(series: str) -> dict[str, str]:
    """``name{a="x",b="y"}`` → {"a": "x", "b": "y"} (the test file's values hold no commas)."""
    body = series[series.index("{") + 1:series.rindex("}")] if "{" in series else ""
    return {k: v.strip('"') for k, v in (pair.split("=", 1) for pair in body.split(",") if pair)}


def _cases(alert: str) -> list[tuple[list[dict], list[dict]]]:
    """(input series labels, expected alerts' labels) of every evaluation of ``alert``."""
    cases = []
    for test in yaml.safe_load(RULE_TESTS.read_text())["tests"]:
        inputs = [_series_labels(series["series"]) for series in test["input_series"]]
        for check in test.get("alert_rule_test", []):
            if check["alertname"] == alert:
                cases.append((inputs, [e["exp_labels"] for e in check["exp_alerts"]]))
    return cases


def _quiet_on_some_series(inputs: list[dict], expected: list[dict]) -> bool:
    """Some input series matches no expected alert on the labels both carry: it did not fire."""
    def fired(series: dict) -> bool:
        return any(all(series[k] == str(v) for k, v in alert.items() if k in series) for alert in expected)

    return not expected or any(not fired(series) for series in inputs if "pool" in series)


def test_the_rules_file_is_valid():
    result = promtool("check", "rules", str(RULES))
    assert result.returncode == 0, result.stdout.decode() + result.stderr.decode()
    assert b"SUCCESS" in result.stdout


def test_every_rule_unit_test_passes():
    result = promtool("test", "rules", str(RULE_TESTS))
    assert result.returncode == 0, result.stdout.decode() + result.stderr.decode()


def test_the_rules_ship_the_alerts_the_slo_needs():
    assert set(_alerts()) >= {"RelayGRErrorBudgetFastBurn", "RelayGRErrorBudgetSlowBurn", "RelayGRHBMPressure",
                              "RelayGRInstanceNACK", "RelayGRPoolNotConverged", "RelayGRCanaryRolledBack",
                              "RelayGRPreinferRefusalsSpiking"}


@pytest.mark.parametrize("alert", _alerts())
def test_each_alert_has_a_case_that_fires_it_and_one_that_does_not(alert):
    cases = _cases(alert)
    assert any(expected for _, expected in cases), f"no unit test fires {alert}"
    assert any(_quiet_on_some_series(inputs, expected) for inputs, expected in cases), \
        f"no unit test shows series on which {alert} stays quiet"


def test_the_example_scrape_configuration_is_valid_with_the_rules(tmp_path):
    """deploy/prometheus/prometheus.yml, its token file put in a temporary folder (promtool reads it)."""
    config = yaml.safe_load((RULES_DIR / "prometheus.yml").read_text())
    job = config["scrape_configs"][0]
    assert (job["honor_labels"], job["metrics_path"], job["authorization"]["type"]) == (True, "/metrics", "Token")
    token = tmp_path / "relaygr.token"
    token.write_text("rgr_example\n")
    job["authorization"]["credentials_file"] = str(token)
    for rules in config["rule_files"]:
        (tmp_path / rules).write_text((RULES_DIR / rules).read_text())
    (tmp_path / "prometheus.yml").write_text(yaml.safe_dump(config))
    result = promtool("check", "config", str(tmp_path / "prometheus.yml"))
    assert result.returncode == 0, result.stdout.decode() + result.stderr.decode()


def test_the_history_rules_file_is_the_generators_output_and_valid():
    from controlplane.telemetry import recording

    assert recording.main(["--check"]) == 0, "run python -m controlplane.telemetry.recording"
    result = promtool("check", "rules", str(recording.RULES_PATH))
    assert result.returncode == 0, result.stdout.decode() + result.stderr.decode()


def test_the_history_rules_record_every_count_the_history_reads_and_every_minute():
    from controlplane.telemetry import recording
    from relay_engine.core.telemetry import COUNTERS

    group, blocks, sums = yaml.safe_load(recording.RULES_PATH.read_text())["groups"]
    assert group["interval"] == f"{recording.RECORDED_STEP_S}s"
    records = {rule["record"] for rule in group["rules"]}
    for by in (recording.POOL, recording.INSTANCE):
        assert {recording.counted_record(f"relaygr_{name}_total", None, by) for name in COUNTERS} <= records
    # Besides the counters: refusals and misses by reason, buckets by le, the latency sum.
    assert len(recording.COUNTED) == len(COUNTERS) + 4
    assert recording.PROBE_RECORD in records
    # Every raw gauge the history reads has its ten-minute block's last value, and each pool its block probe.
    assert blocks["name"] == recording.BLOCK_GROUP and blocks["interval"] == f"{recording.BLOCK_S}s"
    assert {rule["record"] for rule in blocks["rules"]} == \
        {recording.last_block_record(series) for series, _, _, _ in recording.GAUGED} | {recording.BLOCK_PROBE_RECORD}
    assert all(rule["expr"].startswith("last_over_time(") or rule["record"] == recording.BLOCK_PROBE_RECORD
               for rule in blocks["rules"])
    # Every instance-level minute record summed over the same blocks, each from its own minutes, and each pool's
    # probe of them.
    assert sums["name"] == recording.SUMS_GROUP and sums["interval"] == blocks["interval"]
    minutes = {recording.counted_record(series, split, recording.INSTANCE) for series, split, _ in recording.COUNTED}
    assert minutes <= records
    summed = {rule["record"]: rule["expr"] for rule in sums["rules"] if not recording.rolled(rule)}
    assert summed.keys() == {recording.block_sum_record(series, split) for series, split, _ in recording.COUNTED} | \
        {recording.SUMS_PROBE_RECORD}
    # After them (a group's rules run in order: each rolled sum holds the block just written), each one's last
    # ROLLED_BLOCKS blocks summed, and the pool's probe of them.
    order = [rule["record"] for rule in sums["rules"]]
    rolled = {rule["record"]: rule["expr"] for rule in sums["rules"] if recording.rolled(rule)}
    assert rolled.keys() == {recording.rolled_record(series, split) for series, split, _ in recording.COUNTED} | \
        {recording.ROLLED_PROBE_RECORD}
    assert max(order.index(name) for name in summed) < min(order.index(name) for name in rolled)
    for series, split, _ in recording.COUNTED:
        assert rolled[recording.rolled_record(series, split)] == (
            f"sum_over_time({recording.block_sum_record(series, split)}"
            f"[{recording.ROLLED_BLOCKS * recording.BLOCK_S * 1000 - 1}ms])")
    for series, split, _ in recording.COUNTED:
        assert summed[recording.block_sum_record(series, split)].startswith(
            f"sum_over_time({recording.counted_record(series, split, recording.INSTANCE)}[")
