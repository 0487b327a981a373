"""The pages in real headless Chromium against the real stack (control plane, Redis, two workers).

The tests share one stack and run in order, the way an SRE's session goes: log in, watch, edit,
publish, see the fleet converge, roll back. Each test saves a screenshot under
artifacts/screenshots/.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import signal
import threading
import time
from collections.abc import Callable
from datetime import datetime, timedelta

import numpy as np
import pytest
from playwright.sync_api import TimeoutError as PlaywrightTimeoutError

from relay_engine.core.config import ModelFingerprint, parse_policy
from relay_engine.core.editing_io import write_editing_npz
from relay_engine.core.telemetry import MissReason
from tests.controlplane.fleet_helpers import FakeWorker, snapshot
from tests.models import random_lowrank

from .conftest import Session, login, watch_csp
from .stack import LARGE_POOL, LARGE_POOL_SIZE, POOL, POOL_NOTE, Traffic

pytestmark = [pytest.mark.browser, pytest.mark.integration, pytest.mark.slow]

LIVE = f"/pools/{POOL}/"
CONFIG = f"/pools/{POOL}/config/"
FLEET = f"/pools/{POOL}/fleet/"
TIME_CHARTS = ("latency", "throughput", "hbm", "hits", "misses", "tiers", "preinfer", "instance_p99")
CONVERGE_TIMEOUT_MS = 30_000


def pool_state(stack) -> dict:
    status, body = stack.api("GET", f"/api/v1/pools/{POOL}/")
    assert status == 200, body
    return body


def publish_via_api(stack, **trigger) -> int:
    """What automation (or a colleague) does: a new revision on the latest, published."""
    return publish_spec_via_api(stack, lambda spec: {**spec, "trigger": {**spec["trigger"], **trigger}})


def publish_spec_via_api(stack, change) -> int:
    """A new revision of ``change(live spec)`` on the latest, published."""
    pool = pool_state(stack)
    _, live = stack.api("GET", f"/api/v1/pools/{POOL}/revisions/{pool['desired_generation']}/")
    spec = change(live["spec"])
    status, revision = stack.api("POST", f"/api/v1/pools/{POOL}/revisions/",
                                 {"parent_generation": pool["latest_generation"], "spec": spec, "comment": "via API"})
    assert status == 201, revision
    status, published = stack.api("POST", f"/api/v1/pools/{POOL}/revisions/{revision['generation']}/publish/")
    assert status == 200, published
    return revision["generation"]


def field(page, path: str):
    return page.locator(f'input[data-path="{path}"]')


def annotation(page, chart: str, generation: int):
    return page.locator(f'[data-chart="{chart}"] .annotation-text', has_text=re.compile(rf"\bgen {generation}$"))


def test_login_lands_on_the_slo_overview_with_pool_health(sre, screenshot):
    sre.goto("/")
    card = sre.locator(f'.pool-card[data-pool="{POOL}"]')
    card.locator('[data-chart="p99"][data-has-data="true"]').wait_for()
    assert card.get_attribute("data-state") in {"healthy", "atrisk"}
    assert card.locator('[data-role="health"]').inner_text() in {"healthy", "at risk"}
    assert re.match(r"[\d.]+ ms / 50(\.0)? ms", card.locator('[data-figure="p99"]').inner_text())
    assert re.match(r"[\d.]+% of ≥ 99\.0%", card.locator('[data-figure="within"]').inner_text())
    assert card.locator('[data-figure="goodput"]').inner_text().endswith("/s")
    assert card.locator('[data-figure="burn"]').inner_text().endswith("×")
    screenshot(sre, "01-slo-overview")


def test_live_view_draws_every_chart_with_data(sre, screenshot):
    sre.goto(LIVE)
    for chart in TIME_CHARTS:
        sre.locator(f'[data-chart="{chart}"][data-has-data="true"] .main-svg').first.wait_for()
        assert sre.locator(f'[data-chart="{chart}"]').get_attribute("data-state") == "ready"
    rows = sre.locator('[data-role="instances"] tbody tr[data-instance]')
    assert rows.count() == 2
    assert sre.locator("#connection").get_attribute("data-state") == "live"
    screenshot(sre, "02-live-view")


def test_the_live_view_says_why_the_times_are_what_they_are_beside_the_slo(sre):
    sre.goto(LIVE)
    head = sre.locator(".page-head")
    note = head.locator('[data-role="pool-description"]')
    assert note.inner_text() == POOL_NOTE and note.is_visible()
    assert "muted" not in (note.get_attribute("class") or "")  # plain text, not a footnote
    assert "50" in head.locator('[data-role="slo"]').inner_text()


def drawn_range(page, chart: str) -> dict:
    """The chart's x range as drawn and its first trace's first point with a value (unix ms)."""
    return page.evaluate("""(name) => {
        const plot = document.querySelector(`[data-chart="${name}"] .plot`);
        const [from, to] = plot._fullLayout.xaxis.range.map((v) => new Date(v).getTime());
        const {x, y, mode} = plot.data[0];
        const i = y.findIndex((v) => v !== null);
        return {from, to, first: i < 0 ? null : new Date(x[i]).getTime(), mode};
    }""", chart)


def test_a_young_pools_first_chart_starts_at_its_first_data_not_the_windows_start(sre, stack):
    """The pool is minutes old and the default window an hour: its minutes fill the chart, not its right edge."""
    sre.goto(LIVE)  # the default window, 1 h
    sre.locator('[data-chart="latency"][data-has-data="true"]').wait_for()
    _, answer = stack.api("GET", f"/api/v1/pools/{POOL}/metrics/?window=1h&top=0")
    first_data = next(t for t, n in zip(answer["timestamps"], answer["fleet"]["instances"], strict=True) if n)
    first_mark = min(a["ts"] for a in answer["annotations"])  # the pool's creation, before any data
    drawn = drawn_range(sre, "latency")
    assert drawn["from"] > answer["start"] * 1000 + 60_000, "the chart starts at the window's start"
    assert drawn["from"] <= min(first_data, first_mark) * 1000 + 1
    assert drawn["first"] is not None and drawn["from"] <= drawn["first"] <= drawn["to"]


def overlapping(a: dict, b: dict) -> bool:
    return a["x"] < b["x"] + b["width"] and b["x"] < a["x"] + a["width"] and \
        a["y"] < b["y"] + b["height"] and b["y"] < a["y"] + a["height"]


def test_on_24_hours_a_lone_p99_point_shows_and_the_date_ticks_clear_the_legend(sre, screenshot):
    sre.goto(f"{LIVE}?window=24h")
    # The 60 s tier (what 24 h reads) gets an instance's counts once a minute.
    sre.locator('[data-chart="latency"][data-has-data="true"]').wait_for(timeout=150_000)
    assert "markers" in drawn_range(sre, "latency")["mode"]  # a few 4-minute points: no line to see
    assert sre.locator('[data-chart="latency"] .scatterlayer .trace').first.locator(".points path").count() >= 1
    for chart in TIME_CHARTS:
        ticks = [box for t in sre.locator(f'[data-chart="{chart}"] .xtick text').all() if (box := t.bounding_box())]
        legend = sre.locator(f'[data-chart="{chart}"] .legend').bounding_box()
        assert ticks and legend, chart
        assert not any(overlapping(tick, legend) for tick in ticks), chart
    screenshot(sre, "02b-live-view-24h")


def test_failures_show_deadline_misses_apart_and_cached_prefixes_are_no_refusal(sre):
    sre.goto(LIVE)
    sre.locator('[data-chart="preinfer"][data-has-data="true"]').wait_for()
    names = lambda chart: sre.evaluate(  # noqa: E731
        f"document.querySelector('[data-chart=\"{chart}\"] .plot').data.map((t) => t.name)")
    assert names("throughput") == ["ranking requests/s", "within SLO/s", "past their deadline/s (failed fast)",
                                   "other errors/s"]
    # Repeat users send pre-infer signals for prefixes already cached: shown apart, named as the server does.
    sre.wait_for_function("""() => document.querySelector('[data-chart="preinfer"] .plot').data
        .some((t) => t.name === "already cached")""")
    refused = [name for name in names("preinfer") if name.startswith("refused: ")]
    assert refused and "refused: already cached" not in refused and "refused: not at risk" in refused
    assert re.fullmatch(r"[\d,]+ already cached \(no refusal\)",
                        sre.locator('[data-role="preinfer-cached"]').inner_text())


def test_time_range_picker_redraws_for_the_chosen_window(sre):
    sre.goto(LIVE)
    sre.locator('[data-chart="latency"][data-has-data="true"]').wait_for()
    with sre.expect_response(re.compile(r"/metrics/\?window=5m")) as response:
        sre.click('.window-picker button[data-window="5m"]')
    assert response.value.json()["step_s"] == 1
    assert sre.locator('.window-picker button[data-window="5m"]').get_attribute("aria-pressed") == "true"
    assert "window=5m" in sre.url
    sre.locator('[data-chart="latency"][data-has-data="true"]').wait_for()


def test_editor_shows_the_schema_error_next_to_the_field(sre, screenshot):
    sre.goto(CONFIG)
    field(sre, "trigger.max_preinfer_inflight").fill("-1")
    error = sre.locator('[data-error-for="trigger.max_preinfer_inflight"]')
    error.wait_for()
    assert error.inner_text() == "must be in [0, 100000], got -1"
    field(sre, "cache.hbm_budget_mb").fill("lots")
    sre.locator('[data-error-for="cache.hbm_budget_mb"]', has_text="must be a number").wait_for()
    assert sre.locator('[data-role="publish"]').is_disabled()
    screenshot(sre, "03-config-validation-error")


def test_editor_turns_the_disk_tier_on_with_errors_by_field_and_off_leaving_the_spec_as_it_was(sre, screenshot):
    sre.goto(CONFIG)
    toggle = sre.locator('input[data-section="cache.disk"]')
    assert not toggle.is_checked() and field(sre, "cache.disk.path").is_disabled()
    toggle.check()
    assert field(sre, "cache.disk.path").is_enabled()
    sre.locator('[data-error-for="cache.disk.path"]', has_text="must be an absolute directory path").wait_for()
    field(sre, "cache.disk.path").fill("relative/kv")
    sre.locator('[data-error-for="cache.disk.path"]', has_text="got 'relative/kv'").wait_for()
    field(sre, "cache.disk.budget_mb").fill("-5")
    sre.locator('[data-error-for="cache.disk.budget_mb"]', has_text="got -5").wait_for()
    assert sre.locator('[data-role="publish"]').is_disabled()
    screenshot(sre, "03b-config-disk-tier-errors")

    field(sre, "cache.disk.path").fill("/var/tmp/relaygr-kv")
    field(sre, "cache.disk.budget_mb").fill("64")
    sre.locator('[data-role="diff"] tr[data-change^="cache.disk"]').first.wait_for()
    sre.wait_for_function("() => !document.querySelector('[data-role=\"publish\"]').disabled")
    assert sre.locator('[data-error-for^="cache.disk"]').all_inner_texts() == ["", "", "", ""]
    candidate = sre.evaluate("RelayGR.editor.form.candidate().cache.disk")
    assert candidate == {"path": "/var/tmp/relaygr-kv", "budget_mb": 64}  # the empty TTL takes the default

    toggle.uncheck()
    sre.locator('[data-role="diff-status"]', has_text="No changes against the live revision").wait_for()
    assert field(sre, "cache.disk.path").is_disabled() and sre.locator('[data-role="publish"]').is_disabled()
    assert sre.evaluate("'disk' in RelayGR.editor.form.candidate().cache") is False
    sre.wait_for_function("() => RelayGR.editor.state.lastCheck.sha256 === RelayGR.editor.state.live.sha256")


def test_publish_shows_the_diff_then_the_fleet_converges_and_every_chart_marks_it(sre, stack, screenshot):
    sre.goto(CONFIG)
    field(sre, "trigger.at_risk_seq_len").fill("384")
    field(sre, "cache.hbm_budget_mb").fill("512")
    diff = sre.locator('[data-role="diff"]')
    diff.locator('tr[data-change="trigger.at_risk_seq_len"] td.after', has_text="384").wait_for()
    assert diff.locator('tr[data-change="cache.hbm_budget_mb"] td.before').inner_text() == "1024"
    sre.fill('[data-role="comment"]', "smaller at-risk threshold, half the HBM")
    screenshot(sre, "04-config-diff-before-publish")
    expected = pool_state(stack)["latest_generation"] + 1
    publish = sre.locator('[data-role="publish"]')
    assert publish.inner_text() == f"Publish generation {expected}"
    publish.click()
    sre.locator(".ok-box", has_text=f"Published generation {expected}").wait_for()
    sre.locator(f'[data-role="convergence"][data-generation="{expected}"][data-converged="true"]').wait_for(
        timeout=CONVERGE_TIMEOUT_MS)
    assert pool_state(stack)["desired_generation"] == expected
    screenshot(sre, "05-config-published")

    sre.goto(FLEET)
    sre.locator('[data-role="convergence"][data-state="converged"]').wait_for(timeout=CONVERGE_TIMEOUT_MS)
    applied = sre.locator('[data-role="instances"] tbody tr[data-instance] td:nth-child(4)').all_inner_texts()
    assert applied == [str(expected)] * 2
    assert "2 of 2 live instances ACKed generation" in sre.locator('[data-role="summary"]').inner_text()
    screenshot(sre, "06-fleet-converged")

    sre.goto(f"{LIVE}?window=5m")
    for chart in TIME_CHARTS:
        annotation(sre, chart, expected).wait_for()
    screenshot(sre, "07-live-view-annotated")


def test_live_view_shows_a_new_publish_without_a_reload(sre, stack):
    """The open page draws a publish made elsewhere by itself (its incremental poll), no reload. How
    soon is the fleet-scale benchmark's figure, not this test's: a loaded machine only makes it later."""
    sre.goto(f"{LIVE}?window=5m")
    sre.locator('[data-chart="latency"][data-has-data="true"]').wait_for()
    loads = sre.evaluate("performance.getEntriesByType('navigation').length")
    generation = publish_via_api(stack, max_preinfer_inflight=6)
    annotation(sre, "latency", generation).wait_for(timeout=30_000)
    assert sre.evaluate("performance.getEntriesByType('navigation').length") == loads  # the same page


def test_a_stale_edit_is_refused_not_overwritten(sre, stack, screenshot):
    sre.goto(CONFIG)
    field(sre, "cache.dram_budget_mb").fill("2048")
    sre.locator('[data-role="diff"] tr[data-change="cache.dram_budget_mb"]').wait_for()
    theirs = publish_via_api(stack, ranking_p99_slo_ms=60.0)  # a colleague publishes meanwhile
    sre.click('[data-role="publish"]')
    stale = sre.locator('[data-role="stale"]')
    stale.wait_for()
    assert "someone changed this pool's configuration" in stale.inner_text()
    assert f"now at generation {theirs}" in stale.inner_text()
    state = pool_state(stack)
    assert state["latest_generation"] == theirs and state["desired_generation"] == theirs
    assert field(sre, "cache.dram_budget_mb").input_value() == "2048"  # the edit is still there
    assert sre.locator('[data-role="publish"]').is_disabled()
    screenshot(sre, "08-config-stale-edit-refused")


def test_rollback_from_history_is_one_click(sre, stack, screenshot):
    sre.goto(CONFIG)
    before = pool_state(stack)
    sre.locator('[data-role="history"] tr[data-generation="1"] [data-role="rollback"]').click()
    expected = before["latest_generation"] + 1
    sre.locator(".ok-box", has_text=f"generation {expected} restores generation 1").wait_for()
    sre.locator(f'[data-role="convergence"][data-generation="{expected}"][data-converged="true"]').wait_for(
        timeout=CONVERGE_TIMEOUT_MS)
    assert field(sre, "trigger.at_risk_seq_len").input_value() == "512"
    assert field(sre, "trigger.ranking_p99_slo_ms").input_value() == "50"
    _, revision = stack.api("GET", f"/api/v1/pools/{POOL}/revisions/{expected}/")
    assert revision["restored_from"] == 1 and pool_state(stack)["desired_generation"] == expected
    sre.locator(f'[data-role="history"] tr.live[data-generation="{expected}"]').wait_for()
    screenshot(sre, "09-config-rolled-back")


def wait_for_captured_traffic(stack, window: str = "1m", at_least: int = 30, timeout_s: float = 60.0) -> dict:
    deadline = time.monotonic() + timeout_s
    while True:
        status, summary = stack.api("GET", f"/api/v1/pools/{POOL}/traffic/?window={window}")
        assert status == 200, summary
        if summary["requests"] >= at_least or time.monotonic() > deadline:
            return summary
        time.sleep(1.0)


def test_preview_shows_live_and_proposed_side_by_side_then_publishes_that_revision(sre, stack, screenshot):
    """The workers capture the traffic; the control plane's Celery worker replays it in the simulator."""
    summary = wait_for_captured_traffic(stack)
    assert summary["requests"] >= 30 and summary["repeat_user_share"] > 0, summary
    sre.goto(CONFIG)
    before = field(sre, "trigger.at_risk_seq_len").input_value()
    field(sre, "trigger.at_risk_seq_len").fill("2048")  # longer than every prefix the traffic sends
    sre.locator('[data-role="diff"] tr[data-change="trigger.at_risk_seq_len"]').wait_for()
    sre.select_option('[data-role="preview-window"]', "1m")
    sre.click('[data-role="preview"]')
    table = sre.locator('[data-role="preview-table"]')
    table.wait_for(timeout=120_000)
    admitted = table.locator('tr[data-figure="preinfer_admitted"]')
    live = int(admitted.locator('td[data-side="live"]').inner_text().replace(",", ""))
    proposed = int(admitted.locator('td[data-side="proposed"]').inner_text().replace(",", ""))
    # 2048 is past every prefix the traffic sends: the proposed revision admits none. What the live one
    # admits in a 1-minute window can be 0 too: its dozen long-prefix users repeat within the TTL, so once
    # each was seen in the replay's warm-up their signals find the prefix already cached.
    assert proposed == 0 and proposed <= live
    p99 = table.locator('tr[data-figure="p99_ms"]')
    assert "SLO" in p99.locator('td[data-side="live"]').inner_text()
    assert "SLO" in p99.locator('td[data-side="proposed"]').inner_text()
    assert " of " in table.locator('tr[data-figure="hbm_peak_bytes"] td[data-side="proposed"]').inner_text()
    assert "Simulator error" in sre.locator('[data-role="preview-model-error"]').inner_text()
    # Whose times: the pool's own forwards where its instances ran enough of each operation, else this stack's
    # stand-in (the reference profile: it measured none at start), said in the main text.
    shown = sre.locator('div[data-role="preview"]').get_attribute("data-preview-id")
    status, body = stack.api("GET", f"/api/v1/pools/{POOL}/previews/{shown}/")
    assert status == 200, body
    result = body["result"]
    window_text = sre.locator('[data-role="preview"] [data-role="preview-window"]').inner_text()
    assert result["profile"]["note"] in window_text
    # The instances time their forwards for it (how many reach a fit depends on this short run's traffic).
    assert result["profile"]["live_fit"] is not None
    status, forwards = stack.api("GET", f"/api/v1/pools/{POOL}/forwards/")
    assert status == 200 and forwards["forwards"] > 0 and len(forwards["instances"]) == 2, forwards
    if result["profile"]["pools_own"]:
        assert result["profile"]["note"].startswith("fitted from this pool's own forwards")
        assert sre.locator('[data-role="preview-foreign-profile"]').count() == 0
    else:
        assert "not this pool's" in sre.locator('[data-role="preview-foreign-profile"]').inner_text()
    # What the relay is worth on this traffic: the same requests with it off.
    assert result["relay_off"]["requests"] == result["live"]["requests"]
    assert "Without the relay" in sre.locator('[data-role="preview-relay-worth"]').inner_text()
    off_p99 = table.locator('tr[data-figure="p99_ms"] td[data-side="relay-off"]').inner_text()
    # Forwards with a measured spread: several replays, each P99 cell with their range; else one replay.
    if result["replicates"] > 1:
        assert off_p99.endswith(f"over {result['replicates']} replays"), off_p99
        assert f"median of {result['replicates']} replays" in window_text
    else:
        assert off_p99.endswith(")"), off_p99
    assert "ago" in sre.locator('[data-role="preview"] [data-role="preview-window"]').inner_text()
    # The host's other processes, where the pool's forwards measured them (wall time beyond CPU time).
    background = result["host_background"]
    assert (f"On the host, {background['note']}." in window_text) == (background["share"] > 0), window_text
    # Beside the Preview button: how the pool's earlier previews scored (none was published yet here).
    sre.locator('[data-role="preview-scorecard"]', has_text="no preview of this pool has been scored yet").wait_for()
    screenshot(sre, "09b-config-preview")
    previewed = pool_state(stack)["latest_generation"]  # the preview created it, unpublished
    publish = sre.locator('[data-role="publish"]')
    assert publish.inner_text() == f"Publish generation {previewed}"
    publish.click()
    sre.locator(".ok-box", has_text=f"Published generation {previewed}").wait_for()
    assert pool_state(stack)["desired_generation"] == previewed
    # A previewed revision, published: the scorecard waits for its window after convergence.
    status, scores = stack.api("GET", f"/api/v1/pools/{POOL}/previews/scores/")
    assert status == 200 and scores["scores"][0]["generation"] == previewed, scores
    assert scores["scores"][0]["status"] == "waiting", scores
    publish_via_api(stack, at_risk_seq_len=int(before))  # the later tests expect the threshold as it was


def test_previewing_the_same_change_again_reuses_its_what_if_revision(sre, stack, screenshot):
    """Each Preview click made a revision; the history filled with what-ifs nobody published."""
    wait_for_captured_traffic(stack)

    def preview() -> None:
        sre.goto(CONFIG)  # a new page each time: only the server remembers the first preview
        field(sre, "trigger.at_risk_seq_len").fill("1536")
        sre.locator('[data-role="diff"] tr[data-change="trigger.at_risk_seq_len"]').wait_for()
        sre.select_option('[data-role="preview-window"]', "1m")
        sre.click('[data-role="preview"]')
        sre.locator('[data-role="preview-table"]').wait_for(timeout=120_000)

    before = pool_state(stack)["latest_generation"]
    preview()
    made = pool_state(stack)["latest_generation"]
    assert made == before + 1
    preview()
    assert pool_state(stack)["latest_generation"] == made
    row = sre.locator(f'[data-role="history"] tr[data-generation="{made}"]')
    row.locator('[data-role="past"]').wait_for()
    assert row.locator('[data-role="past"]').inner_text() == "what-if, never published"
    assert row.locator('[data-role="rollback"]').count() == 0
    assert sre.locator('[data-role="publish"]').inner_text() == f"Publish generation {made}"
    screenshot(sre, "09c-config-preview-reused")


SMALL_MODEL = {"num_layers": 2, "num_heads": 2, "head_dim": 16}


def test_an_edit_for_another_model_fails_the_check_naming_both_models(sre):
    """The instances would NACK it; the editor knows the model they serve from their status."""
    other = {"fingerprint": {**SMALL_MODEL, "num_layers": 4},
             "edits": [{"layer": 3, "head": 1, "direction": [0.25] * 16, "alpha": 0.5}]}
    sre.goto(CONFIG)
    sre.set_input_files('[data-role="editing-file"]', files=[
        {"name": "other.json", "mimeType": "application/json", "buffer": json.dumps(other).encode()}])
    error = sre.locator('[data-error-for="editing"]', has_text="live instances serve 2 layers × 2 heads × head_dim 16")
    error.wait_for()
    assert "targets 4 layers × 2 heads × head_dim 16" in error.inner_text()
    assert sre.locator('[data-role="publish"]').is_disabled()
    sre.click('[data-role="reset"]')
    sre.locator('[data-role="diff-status"]', has_text="No changes").wait_for()


def test_the_edit_in_force_is_removed_with_one_button(sre, stack, screenshot):
    pool = pool_state(stack)
    _, live = stack.api("GET", f"/api/v1/pools/{POOL}/revisions/{pool['desired_generation']}/")
    editing = {"fingerprint": SMALL_MODEL, "edits": [{"layer": 0, "head": 1, "direction": [0.25] * 16, "alpha": 0.5}]}
    status, edited = stack.api("POST", f"/api/v1/pools/{POOL}/revisions/", {
        "parent_generation": pool["latest_generation"], "spec": {**live["spec"], "editing": editing}})
    assert status == 201, edited
    assert stack.api("POST", f"/api/v1/pools/{POOL}/revisions/{edited['generation']}/publish/")[0] == 200
    sre.goto(CONFIG)
    sre.locator('[data-role="editing-biases"]').wait_for()
    sre.click('[data-role="editing-remove"]')
    sre.locator('[data-role="diff"] tr[data-change^="editing"]').first.wait_for()
    assert "No model edits" in sre.locator('[data-role="editing"]').inner_text()
    assert sre.locator('[data-role="editing-remove"]').is_hidden()
    screenshot(sre, "10a-config-edit-removed")
    expected = edited["generation"] + 1
    sre.click('[data-role="publish"]')
    sre.locator(".ok-box", has_text=f"Published generation {expected}").wait_for()
    sre.locator(f'[data-role="convergence"][data-generation="{expected}"][data-converged="true"]').wait_for(
        timeout=CONVERGE_TIMEOUT_MS)
    assert stack.api("GET", f"/api/v1/pools/{POOL}/revisions/{expected}/")[1]["spec"]["editing"] is None


def test_the_editing_section_can_be_replaced_from_a_json_file(sre, screenshot):
    fingerprint = {"num_layers": 2, "num_heads": 2, "head_dim": 16}  # the small model
    sre.goto(CONFIG)
    wrong = {"fingerprint": fingerprint, "edits": [{"layer": 0, "head": 1, "direction": [0.1, 0.2], "alpha": 0.5}]}
    sre.set_input_files('[data-role="editing-file"]', files=[
        {"name": "wrong.json", "mimeType": "application/json", "buffer": json.dumps(wrong).encode()}])
    sre.locator('[data-error-for="editing"]', has_text="has 2 values; the model's head_dim is 16").wait_for()
    assert sre.locator('[data-role="publish"]').is_disabled()
    right = {"editing": {**wrong, "edits": [{**wrong["edits"][0], "direction": [0.25] * 16}],
                         "provenance": {"dataset": "probe-v1"}}}
    sre.set_input_files('[data-role="editing-file"]', files=[
        {"name": "right.json", "mimeType": "application/json", "buffer": json.dumps(right).encode()}])
    sre.locator('[data-role="diff"] tr[data-change="editing.edits[0].alpha"]').wait_for()
    assert sre.locator('[data-error-for="editing"]').inner_text() == ""
    cells = sre.locator('[data-role="editing"] tbody td').all_inner_texts()
    assert cells == ["0", "1", "0.5", "1.000", "0.250, 0.250, 0.250, 0.250, …"]  # layer, head, α, norm, values
    screenshot(sre, "10-config-editing-upload")
    sre.click('[data-role="reset"]')
    sre.locator('[data-role="diff-status"]', has_text="No changes").wait_for()


def test_the_editing_section_can_be_replaced_from_numpy_directions(sre, screenshot):
    buffer = io.BytesIO()
    np.save(buffer, np.full((2, 16), 0.5, dtype=np.float32))
    npy = {"name": "dirs.npy", "mimeType": "application/octet-stream", "buffer": buffer.getvalue()}
    sre.goto(CONFIG)
    sre.click('[data-role="editing-npy"] summary')
    sre.set_input_files('[data-role="editing-npy-file"]', files=[npy])
    sre.fill('[data-role="editing-npy-rows"]', "0 1 2\n3 0 1")  # layer 3 does not exist in the small model
    sre.fill('input[name="num_layers"]', "2")
    sre.fill('input[name="num_heads"]', "2")
    sre.click('[data-role="editing-npy-apply"]')
    sre.locator('[data-role="editing-npy-errors"] li[data-path="editing.edits[1].layer"]',
                has_text="must be in [0, 1], got 3").wait_for()
    sre.fill('[data-role="editing-npy-rows"]', "0 1 2\n1 0 1")
    sre.click('[data-role="editing-npy-apply"]')
    sre.locator('[data-role="diff"] tr[data-change="editing.edits[1].alpha"]').wait_for()
    assert sre.locator('[data-role="editing-npy-errors"] li').count() == 0
    cells = sre.locator('[data-role="editing"] tbody td').all_inner_texts()
    assert cells[:4] == ["0", "1", "2", "2.000"]  # layer, head, α, ‖direction‖ = 0.5·√16
    screenshot(sre, "10b-config-editing-npy-upload")
    sre.click('[data-role="reset"]')
    sre.locator('[data-role="diff-status"]', has_text="No changes").wait_for()


def test_lowrank_maps_upload_from_the_evals_npz_and_show_as_a_table(sre, screenshot, tmp_path):
    section = random_lowrank(ModelFingerprint(2, 2, 16), seed=5, rank=4, alpha=1.5)  # the small model
    path = write_editing_npz(parse_policy({"editing": section}).editing, tmp_path / "gr_editing.npz")
    sre.goto(CONFIG)
    sre.click('[data-role="editing-npy"] summary')
    sre.set_input_files('[data-role="editing-npy-file"]', files=[
        {"name": "gr_editing.npz", "mimeType": "application/octet-stream", "buffer": path.read_bytes()}])
    sre.click('[data-role="editing-npy-apply"]')
    sre.locator('[data-role="diff"] tr[data-change="editing.lowrank[1].rotation"]').wait_for()
    assert sre.locator('[data-role="editing-npy-errors"] li').count() == 0
    rows = sre.locator('[data-role="editing-lowrank"] tbody tr')
    assert rows.count() == 2
    assert rows.nth(1).locator("td").all_inner_texts()[:4] == ["1", "0, 1", "4", "1.5"]  # layer, heads, rank, α
    assert "null" not in sre.locator('[data-role="editing"]').inner_text(), "absent parts are left out"
    screenshot(sre, "10c-config-editing-lowrank-upload")
    sre.click('[data-role="reset"]')
    sre.locator('[data-role="diff-status"]', has_text="No changes").wait_for()


def test_audit_log_filters_by_action(sre, screenshot):
    sre.goto("/audit/")
    sre.select_option('select[name="action"]', "revision.publish")
    sre.click('form[data-role="filters"] button[type="submit"]')
    sre.wait_for_url(re.compile(r"action=revision\.publish"))
    actions = sre.locator("table.audit tbody td:nth-child(3)").all_inner_texts()
    assert len(actions) >= 3 and set(actions) == {"revision.publish"}
    screenshot(sre, "11-audit-log")


def test_viewer_sees_no_edit_controls_and_the_server_refuses_anyway(browser, stack, screenshot):
    viewer = Session(browser, stack, "pm")
    try:
        page = viewer.page
        page.goto(CONFIG)
        page.locator('[data-role="history"] tbody tr[data-generation]').first.wait_for()
        assert page.locator('output[data-path="trigger.at_risk_seq_len"]').inner_text() == "512"
        assert page.locator("input[data-path], [data-role=publish], [data-role=rollback], "
                            "[data-role=editing-file], [data-role=preview]").count() == 0
        assert "read-only for you" in page.locator(".notice").inner_text()
        screenshot(page, "12-config-as-viewer")
        status = page.evaluate("""async (pool) => {
            const token = document.querySelector('meta[name="csrf-token"]').content;
            const response = await fetch(`/api/v1/pools/${pool}/rollback/`, {method: 'POST',
                headers: {'Content-Type': 'application/json', 'X-CSRFToken': token},
                body: JSON.stringify({to_generation: 1, parent_generation: 1})});
            return response.status;
        }""", POOL)
        assert status == 403
        page.goto(LIVE)
        page.locator('[data-chart="latency"][data-has-data="true"]').wait_for()
        assert viewer.page_errors == []
    finally:
        viewer.close()


def test_charts_reconnect_after_the_server_restarts(sre, stack, screenshot):
    sre.goto(LIVE)
    sre.locator('#connection[data-state="live"]').wait_for()
    stack.stop_server()
    try:
        sre.locator('#connection[data-state="reconnecting"]').wait_for()
        sre.locator('[data-chart="latency"][data-state="error"]').wait_for()
        screenshot(sre, "13-live-view-reconnecting")
    finally:
        stack.start_server()
    restarted = time.time() * 1000
    sre.locator('#connection[data-state="live"]').wait_for(timeout=15_000)
    # Predicates as functions: a bare expression is run through eval, which the pages' CSP refuses.
    sre.wait_for_function(f"() => Number(document.getElementById('live').dataset.updatedAt) > {restarted}")
    assert sre.locator('[data-chart="latency"]').get_attribute("data-state") == "ready"


def test_logging_out_ends_the_session(browser, stack):
    context = browser.new_context(base_url=stack.base_url)
    try:
        page = context.new_page()
        login(page, "sre")
        page.click(".logout button")
        page.wait_for_url("**/login/")
        page.goto(LIVE)
        assert "/login/?next=" in page.url
    finally:
        context.close()


# --- canary rollouts (the stack judges a bake every second: RELAYGR_ROLLOUT_EVAL_S=1) -----------------

ROLLOUT = f"/api/v1/pools/{POOL}/rollout/"
CANARY_CARD = '[data-role="rollout"]'


def new_revision(stack, comment: str, **trigger) -> int:
    """A revision on the latest generation, from the live spec with ``trigger`` changed; not published."""
    pool = pool_state(stack)
    _, live = stack.api("GET", f"/api/v1/pools/{POOL}/revisions/{pool['desired_generation']}/")
    spec = {**live["spec"], "trigger": {**live["spec"]["trigger"], **trigger}}
    status, revision = stack.api("POST", f"/api/v1/pools/{POOL}/revisions/",
                                 {"parent_generation": pool["latest_generation"], "spec": spec, "comment": comment})
    assert status == 201, revision
    return revision["generation"]


def start_canary(stack, generation: int, bake_s: int, max_burn: float = 1.0) -> dict:
    status, rollout = stack.api("POST", f"/api/v1/pools/{POOL}/revisions/{generation}/publish/",
                                {"strategy": "canary", "canary_instances": 1, "bake_s": bake_s, "max_burn": max_burn})
    assert status == 201, rollout
    assert (rollout["state"], rollout["canary"]) == ("baking", [f"{POOL}.0"])
    return rollout


@pytest.fixture
def no_canary_left(stack):
    """A canary a failing test left baking is aborted after it: the next tests publish, which a baking
    canary refuses (one failure, not a cascade of 409s)."""
    yield
    if stack.api("GET", ROLLOUT)[1]["state"] == "baking":
        stack.api("POST", f"{ROLLOUT}abort/")


def decided(stack, timeout_s: float) -> dict:
    deadline = time.monotonic() + timeout_s
    while True:
        _, rollout = stack.api("GET", ROLLOUT)
        if rollout["state"] != "baking" or time.monotonic() > deadline:
            return rollout
        time.sleep(0.5)


def wait_all_on(stack, generation: int, timeout_s: float = 30.0) -> list[int]:
    """Every live instance's applied generation, once all run ``generation`` (or at the timeout)."""
    deadline = time.monotonic() + timeout_s
    while True:
        _, status = stack.api("GET", f"/api/v1/pools/{POOL}/status/")
        applied = [i["applied_generation"] for i in status["instances"] if i["live"]]
        if (applied and set(applied) == {generation}) or time.monotonic() > deadline:
            return applied


@contextlib.contextmanager
def stalling(pid: int, stop_s: float = 2.5, run_s: float = 0.15):
    """The process frozen most of the time (SIGSTOP, then SIGCONT for ``run_s``): a canary instance
    most of whose requests wait past their 2 s deadline (the engine counts them as bad), while it still
    heartbeats (every stall is shorter than the 5 s heartbeat timeout) and reports telemetry."""
    done = threading.Event()

    def cycle() -> None:
        while not done.is_set():
            os.kill(pid, signal.SIGSTOP)
            done.wait(stop_s)
            os.kill(pid, signal.SIGCONT)
            done.wait(run_s)

    thread = threading.Thread(target=cycle, daemon=True)
    thread.start()
    try:
        yield
    finally:
        done.set()
        thread.join(5)
        os.kill(pid, signal.SIGCONT)


def test_a_canary_that_burns_its_error_budget_is_rolled_back_within_its_bake(sre, stack, screenshot):
    """A canary judged on the stable revision's SLO: its instance stalls (the revision may not change the
    SLO, which would be judged on its own yardstick), so its requests run late. A second client beside the
    stack's: a request the stall holds keeps its client waiting up to the deadline, so one client alone
    brings the canary the evidence it is judged on (RELAYGR_ROLLOUT_MIN_REQUESTS) in ~30 s, two in ~15 s."""
    stable = pool_state(stack)["desired_generation"]
    generation = new_revision(stack, "canary: a threshold change on an instance that stalls", at_risk_seq_len=640)
    with Traffic(stack.worker_settings), stalling(stack.workers[f"{POOL}.0"].pid):
        started = start_canary(stack, generation, bake_s=120)  # ample: the evidence comes within ~15 s
        sre.goto(LIVE)
        card = sre.locator(f'{CANARY_CARD}[data-state="rolled_back"]')
        card.wait_for(timeout=115_000)
    rollout = decided(stack, 5)
    assert rollout["state"] == "rolled_back" and rollout["decided_by"] == "rollout-evaluator", rollout
    # Rolled back before the bake was over.
    assert datetime.fromisoformat(rollout["decided_at"]) < datetime.fromisoformat(started["bake_ends_at"])
    assert "exceeds max_burn" in rollout["reason"] and rollout["canary_figures"]["burn_low"] > 1.0
    assert "rolled back by rollout-evaluator" in card.locator('[data-role="reason"]').inner_text()
    assert card.locator('[data-chart="rollout_burn"] .plot').count() == 1
    screenshot(sre, "14-canary-rolled-back")
    _, audit = stack.api("GET", f"/api/v1/audit/?pool={POOL}&action=rollout.rollback")
    figures = audit["results"][0]["after"]["figures"]
    # The requests a stall held past their deadline are bad on the stable revision's 50 ms SLO: enough that
    # even the lower bound of the canary's burn is past max_burn.
    assert figures["canary"]["requests"] >= 20 and figures["canary"]["bad"] >= 1
    assert figures["canary"]["burn_low"] > figures["max_burn"] and figures["slo_ms"] == 50.0
    assert wait_all_on(stack, stable) == [stable, stable]  # the canary instance stepped down


def test_a_good_canary_is_promoted_across_a_control_plane_worker_restart(sre, stack, no_canary_left):
    generation = new_revision(stack, "canary: a threshold change", at_risk_seq_len=520)
    # What is tested is the bake's clock across a restart, not the SLO: the largest budget (all requests bad is
    # a burn of 100) keeps a loaded machine's few late requests from rolling back a good canary (a CI run once
    # did, with a budget of 1: one request in a hundred past the 50 ms SLO).
    start_canary(stack, generation, bake_s=15, max_burn=100.0)
    stack.stop_controlplane_worker(signal.SIGKILL)  # the bake's clock dies mid-bake
    assert stack.api("GET", ROLLOUT)[1]["state"] == "baking"
    stack.start_controlplane_worker()
    rollout = decided(stack, 90)
    assert (rollout["state"], rollout["decided_by"]) == ("promoted", "rollout-evaluator"), rollout
    assert "not worse than stable" in rollout["reason"] and "judged on the stable revision's SLO" in rollout["reason"]
    assert pool_state(stack)["desired_generation"] == generation
    assert wait_all_on(stack, generation) == [generation, generation]


def test_a_canary_started_from_the_editor_is_marked_on_the_fleet_and_aborted_by_hand(browser, sre, stack, screenshot,
                                                                                    no_canary_left):
    before = pool_state(stack)
    stable = before["desired_generation"]
    sre.goto(CONFIG)
    field(sre, "trigger.at_risk_seq_len").fill("600")
    options = sre.locator('[data-role="canary-options"]')
    options.locator('input[name="canary"]').check()
    options.locator('input[name="bake_s"]').fill("600")
    # The form's largest budget: a burn can never exceed it (all requests bad is a burn of 100), so the
    # evaluator leaves this canary baking for the whole test, whatever a loaded machine does to a few of its
    # requests (a fresh-clone run once saw 2 of 23 past the 50 ms SLO and a rollback before the abort).
    options.locator('input[name="max_burn"]').fill("100")
    sre.locator('[data-role="publish"]').click()
    sre.locator(".ok-box", has_text="is baking as a canary").wait_for()
    generation = stack.api("GET", ROLLOUT)[1]["generation"]
    assert generation == before["latest_generation"] + 1

    sre.goto(FLEET)
    canary_row = sre.locator('[data-role="instances"] tr[data-canary="true"]')
    canary_row.wait_for()
    assert canary_row.get_attribute("data-instance") == f"{POOL}.0"
    screenshot(sre, "15-fleet-with-a-canary")

    viewer = Session(browser, stack, "pm")
    try:
        viewer.page.goto(LIVE)
        viewer.page.locator(f'{CANARY_CARD}[data-state="baking"]').wait_for()
        assert viewer.page.locator("[data-action]").count() == 0  # neither Promote nor Abort
        assert viewer.page_errors == []
    finally:
        viewer.close()

    sre.goto(LIVE)
    card = sre.locator(f'{CANARY_CARD}[data-state="baking"]')
    card.wait_for()
    assert card.locator('[data-role="countdown"]').inner_text().startswith("bake ends in")
    screenshot(sre, "16-canary-baking")
    sre.locator('[data-action="abort"]').click()
    sre.locator(f'{CANARY_CARD}[data-state="aborted"]').wait_for()
    rollout = stack.api("GET", ROLLOUT)[1]
    assert (rollout["state"], rollout["decided_by"]) == ("aborted", "sre")
    assert wait_all_on(stack, stable) == [stable, stable]


def test_history_offers_rollback_only_to_generations_that_once_ran_on_the_whole_pool(sre, stack, screenshot):
    _, page = stack.api("GET", f"/api/v1/pools/{POOL}/revisions/?limit=25")  # the rows the history shows
    rows = {r["generation"]: r for r in page["results"]}
    live = pool_state(stack)["desired_generation"]
    never = [g for g, r in rows.items() if not r["was_desired"]]
    once = [g for g, r in rows.items() if r["was_desired"] and g != live]
    rolled_back = [g for g, r in rows.items() if r["rollout_state"] == "rolled_back"]
    assert rolled_back and once and any(rows[g]["rollout_state"] is None for g in never)
    sre.goto(CONFIG)
    history = sre.locator('[data-role="history"]')
    history.locator(f'tr[data-generation="{min(rows)}"]').wait_for()
    for generation in never:
        row = history.locator(f'tr[data-generation="{generation}"]')
        assert row.locator('[data-role="rollback"]').count() == 0, generation
        assert row.get_attribute("data-past") == ("canary" if rows[generation]["rollout_state"] else "what-if")
    assert history.locator(f'tr[data-generation="{rolled_back[0]}"] [data-role="past"]').inner_text() == \
        "canary, rolled back: never live on the whole pool"
    for generation in once:
        assert history.locator(f'tr[data-generation="{generation}"] [data-role="rollback"]').count() == 1, generation
    screenshot(sre, "16b-config-history")


def test_a_decided_rollout_gives_way_to_one_line_after_ten_minutes(browser, stack, screenshot):
    rollout = stack.api("GET", ROLLOUT)[1]
    assert (rollout["state"], rollout["decided_by"]) == ("aborted", "sre")  # the canary aborted by hand above
    later = Session(browser, stack, "sre")
    try:
        page = later.page
        page.goto(LIVE)
        card = page.locator(f'{CANARY_CARD}[data-state="aborted"]')
        card.wait_for()
        assert card.locator('[data-role="reason"]').inner_text() == "aborted by sre"  # once, not twice
        p99 = page.evaluate("""() => {
            const plot = document.querySelector('[data-chart="rollout_p99"] .plot');
            return {lines: plot.layout.shapes.map((s) => s.y0), dtick: plot.layout.yaxis.dtick};
        }""")
        assert p99["lines"] == [pool_state(stack)["slo"]["ranking_p99_slo_ms"]] and p99["dtick"] >= 1
        screenshot(page, "16c-canary-aborted")
        page.clock.set_fixed_time(datetime.fromisoformat(rollout["decided_at"]) + timedelta(minutes=11))
        note = page.locator('[data-role="rollout-note"]')
        note.wait_for()
        assert page.locator(CANARY_CARD).is_hidden()
        assert note.inner_text().startswith(f"Last canary: generation {rollout['generation']} aborted by sre, 11 min")
        assert note.locator("a", has_text="audit log").get_attribute("href") == f"/audit/?pool={POOL}"
        assert later.page_errors == []
    finally:
        later.close()


def test_the_marks_labels_neither_overlap_nor_leave_their_chart_at_1400_px(operator_session, screenshot):
    """An hour of this session's publishes, rollbacks and canaries on every time chart."""
    page = operator_session.new_page()
    page.set_viewport_size({"width": 1400, "height": 900})
    try:
        page.goto(f"{LIVE}?window=1h")
        for chart in TIME_CHARTS:
            page.locator(f'[data-chart="{chart}"][data-has-data="true"] .main-svg').first.wait_for()
        hover = "\n".join(page.evaluate("""() => document.querySelector('[data-chart="latency"] .plot').layout
            .annotations.map((a) => a.hovertext || "")"""))
        for said in ("Pool created", "Canary of generation", "rolled back by rollout-evaluator",
                     "promoted by rollout-evaluator", "aborted by sre", "Rollback by sre"):
            assert said in hover, said
        # Measured in one go: the charts redraw every second.
        boxes = page.evaluate("""(charts) => Object.fromEntries(charts.map((name) => {
            const chart = document.querySelector(`[data-chart="${name}"]`);
            const labels = [...chart.querySelectorAll("g.annotation")]
                .filter((a) => !a.textContent.startsWith("SLO")).map((a) => a.getBoundingClientRect().toJSON());
            return [name, {box: chart.getBoundingClientRect().toJSON(), labels}];
        }))""", list(TIME_CHARTS))
        for chart, drawn in boxes.items():
            box, labels = drawn["box"], drawn["labels"]
            assert len(labels) >= 3, chart
            for i, label in enumerate(labels):
                assert box["x"] - 0.5 <= label["x"] and label["x"] + label["width"] <= box["x"] + box["width"] + 0.5, chart
                assert box["y"] - 0.5 <= label["y"] and label["y"] + label["height"] <= box["y"] + box["height"] + 0.5, chart
                assert not any(overlapping(label, other) for other in labels[i + 1:]), (chart, label)
        screenshot(page, "16d-live-view-marks-1400px")
        assert operator_session.page_errors == []
    finally:
        page.close()


@pytest.fixture(scope="module")
def large_pool(stack):
    """The load fleet's pool: 32 stand-in instances; every 8th (0, 8, …) ranks 4x slower, every 8th
    from 1 (1, 9, …) holds 95 % of its HBM budget (``workers.loadfleet``)."""
    stack.start_load_fleet()
    return [f"{LARGE_POOL}.{i}" for i in range(LARGE_POOL_SIZE)]


def worst_listed(page) -> list[str]:
    return page.locator('[data-role="worst-list"] li[data-instance]').evaluate_all(
        "items => items.map((li) => li.dataset.instance)")


def test_a_large_pool_shows_its_worst_instances_not_every_instance(sre, large_pool, screenshot):
    slow = {name for name in large_pool if int(name.rsplit(".", 1)[1]) % 8 == 0}
    hot = {name for name in large_pool if int(name.rsplit(".", 1)[1]) % 8 == 1}
    sre.goto(f"/pools/{LARGE_POOL}/?window=5m")
    sre.locator('[data-chart="instance_p99"][data-has-data="true"] .main-svg').first.wait_for(timeout=30_000)
    sre.wait_for_function("() => document.querySelectorAll('[data-role=\"worst-list\"] li[data-instance]').length === 8")
    sre.wait_for_function(f"""() => {{
        const names = [...document.querySelectorAll('[data-role="worst-list"] li[data-instance]')]
            .slice(0, 4).map((li) => li.dataset.instance).sort();
        return JSON.stringify(names) === '{json.dumps(sorted(slow)).replace(" ", "")}';
    }}""", timeout=20_000)
    assert f"of {LARGE_POOL_SIZE} reporting" in sre.locator('[data-role="reporting"]').inner_text()
    traces = sre.evaluate("document.querySelector('[data-chart=\"instance_p99\"] .plot').data.length")
    assert traces == 8  # the worst eight drawn, not all thirty-two
    screenshot(sre, "14-large-pool-worst-by-p99")
    sre.select_option('[data-role="worst-controls"] select[name="rank_by"]', "hbm")
    sre.locator('[data-role="worst-list"][data-by="hbm"]').wait_for()
    assert set(worst_listed(sre)[:4]) == hot
    sre.fill('[data-role="worst-controls"] input[name="top"]', "3")
    sre.dispatch_event('[data-role="worst-controls"] input[name="top"]', "change")
    sre.wait_for_function("() => document.querySelectorAll('[data-role=\"worst-list\"] li[data-instance]').length === 3")
    assert set(worst_listed(sre)) < hot
    screenshot(sre, "15-large-pool-worst-by-hbm")


def test_the_instance_table_of_a_large_pool_pages_and_sorts(sre, large_pool):
    sre.goto(f"/pools/{LARGE_POOL}/?window=5m")
    rows = sre.locator('[data-role="instances"] tbody tr[data-instance]')
    pager = sre.locator('[data-role="page"]')
    pager.filter(has_text=f"1–25 of {LARGE_POOL_SIZE}").wait_for(timeout=20_000)
    assert rows.count() == 25
    first = rows.first.get_attribute("data-instance")
    assert int(first.rsplit(".", 1)[1]) % 8 == 0  # worst P99 first: a slow instance
    sre.click('[data-role="next"]')
    pager.filter(has_text=f"26–{LARGE_POOL_SIZE} of {LARGE_POOL_SIZE}").wait_for()
    assert rows.count() == LARGE_POOL_SIZE - 25
    sre.click('[data-role="instances"] th[data-sort="instance"]')
    sre.locator('[data-role="instances"] th[data-sort="instance"][data-sorted="asc"]').wait_for()
    pager.filter(has_text="1–25 of").wait_for()
    names = rows.evaluate_all("rows => rows.map((r) => r.dataset.instance)")
    assert names == sorted(large_pool)[:25]


def test_drill_down_to_one_instance_of_a_large_pool(sre, large_pool, screenshot):
    sre.goto(f"/pools/{LARGE_POOL}/?window=5m")
    link = sre.locator(f'[data-role="worst-list"] li[data-instance="{LARGE_POOL}.8"] a')
    link.wait_for(timeout=20_000)
    link.click()
    sre.wait_for_url(f"**/pools/{LARGE_POOL}/instances/{LARGE_POOL}.8/?window=5m")
    for chart in ("latency", "throughput", "memory", "hits"):
        sre.locator(f'#instance [data-chart="{chart}"][data-has-data="true"] .main-svg').first.wait_for()
    sre.locator('[data-figure="live"]', has_text="live").wait_for()
    assert sre.locator('[data-figure="config"]').inner_text() == "ACK"
    assert sre.locator('[data-figure="device"]').inner_text() == "loadgen"
    assert re.match(r"[\d.]+ ms / [\d,]+", sre.locator('[data-figure="p99"]').inner_text())
    screenshot(sre, "16-instance-drill-down")


def test_the_fleet_page_of_a_large_pool_counts_every_instance(sre, large_pool, screenshot):
    sre.goto(f"/pools/{LARGE_POOL}/fleet/")
    sre.locator('[data-role="convergence"][data-state="converged"]').wait_for(timeout=CONVERGE_TIMEOUT_MS)
    summary = sre.locator('[data-role="summary"]').inner_text()
    assert f"{LARGE_POOL_SIZE} of {LARGE_POOL_SIZE} live instances ACKed generation 1" in summary
    assert sre.locator('[data-role="page"]').inner_text() == f"1–{LARGE_POOL_SIZE} of {LARGE_POOL_SIZE}"
    assert sre.locator('[data-role="instances"] tbody tr[data-instance][data-up-to-date="true"]').count() == \
        LARGE_POOL_SIZE
    screenshot(sre, "17-large-pool-fleet")


def test_a_heartbeat_that_is_no_time_shows_on_its_row_and_the_rest_of_the_fleet_page_answers(sre, stack):
    """Redis is untrusted: a members score that is no time (planted: +inf, which the workers' pruning of
    hour-old members leaves, unlike -inf) is that instance's problem, on its row only."""
    keys = stack.worker_settings.keys
    stack.redis.zadd(keys.members, {f"{POOL}.7": float("inf")})
    try:
        sre.goto(FLEET)
        odd = sre.locator(f'[data-role="instances"] tr[data-instance="{POOL}.7"][data-live="false"]')
        odd.wait_for()
        assert "unreadable heartbeat in Redis" in odd.inner_text() and "inf" in odd.inner_text()
        assert sre.locator('[data-role="instances"] tr[data-instance][data-live="true"]').count() == 2
        sre.goto(f"/pools/{POOL}/instances/{POOL}.0/")
        sre.locator('[data-figure="live"]', has_text="live").wait_for()
        assert sre.locator('[data-figure="capture"]').inner_text() == "on"  # the stack's workers have a secret
    finally:
        stack.redis.zrem(keys.members, f"{POOL}.7")


# Every page, and what shows it has finished drawing.
TOUR = {
    "/": '[data-chart="p99"] .js-plotly-plot',
    LIVE: '[data-chart="latency"] .js-plotly-plot',
    f"/pools/{POOL}/instances/{POOL}.0/": ".js-plotly-plot",
    CONFIG: 'input[data-path="trigger.max_preinfer_inflight"]',
    FLEET: '[data-role="instances"] tbody tr[data-instance]',
    "/audit/": '[data-role="filters"]',
    "/api/docs/": ".swagger-ui .opblock",
    "/api/redoc/": "[data-section-id]",
    "/api/v1/pools/": ".response-info",
    "/api/auth/login/": "form input[name=password]",
}
CHARTS = ("/", LIVE, f"/pools/{POOL}/instances/{POOL}.0/")


def test_every_page_has_a_content_security_policy_and_breaks_none_of_it(browser, stack):
    session = Session(browser, stack, "sre")
    anonymous = browser.new_context(base_url=stack.base_url)
    anonymous_violations: list[str] = []
    watch_csp(anonymous, anonymous_violations)
    try:
        login_page = anonymous.new_page()
        assert "script-src 'self'" in login_page.goto("/login/").headers["content-security-policy"]
        login_page.locator("input[name=password]").wait_for()
        assert anonymous_violations == []
        page = session.page
        for path, drawn in TOUR.items():
            session.csp_violations.clear()
            policy = page.goto(path).headers.get("content-security-policy", "")
            directives = dict(d.strip().split(" ", 1) for d in policy.split(";") if d.strip())
            assert directives.get("script-src") == "'self'", (path, policy)  # no inline script, no outside origin
            assert directives["default-src"] == "'self'" and directives["object-src"] == "'none'", (path, policy)
            page.locator(drawn).first.wait_for()
            if path in CHARTS:  # plotly.js's own rules (its modebar, hover labels) are in force
                assert page.evaluate("document.getElementById('plotly.js-style-global').sheet.cssRules.length") > 0
            page.evaluate("0")  # a round trip: every violation reported so far has arrived
            assert session.csp_violations == [], path  # ReDoc's too: it is served without Redocly's logo
        assert session.page_errors == []
    finally:
        anonymous.close()
        session.close()


# Every page, and what shows once its script has drawn it.
EVERY_PAGE = {
    "/": '.pool-card [data-chart="p99"][data-has-data="true"]',
    LIVE: '[data-chart="latency"][data-has-data="true"]',
    f"/pools/{POOL}/instances/{POOL}.0/": '#instance [data-chart="latency"][data-has-data="true"]',
    CONFIG: '[data-role="history"] tr[data-generation]',
    FLEET: '[data-role="instances"] tbody tr[data-instance]',
    "/audit/": "table.audit tbody tr",
    f"/api/v1/pools/{POOL}/": ".response-info",  # the browsable API
    "/api/docs/": ".swagger-ui .info .title",
    "/api/redoc/": 'redoc h1:has-text("RelayGR control plane API")',
}


def test_a_tour_of_every_page_has_no_console_error_and_asks_no_other_host(browser, stack):
    """The API docs too: ReDoc fetched Google Fonts, which fails on a network with no internet."""
    visitor = Session(browser, stack, "sre")
    errors: list[str] = []
    visitor.page.on("console", lambda message: errors.append(f"{visitor.page.url}: {message.text}")
                    if message.type == "error" else None)
    try:
        page = visitor.page
        nav = [page.locator("nav.mainnav a", has_text=text).get_attribute("href") for text in ("API docs", "API reference")]
        assert nav == ["/api/docs/", "/api/redoc/"]
        for path, drawn in EVERY_PAGE.items():
            page.goto(path)
            page.locator(drawn).first.wait_for()
        outside = [url for url in visitor.requested if not url.startswith((stack.base_url, "data:", "blob:", "about:"))]
        assert outside == [] and errors == [] and visitor.page_errors == []
    finally:
        visitor.close()


def test_the_pages_loaded_nothing_from_outside(operator_session, stack):
    assert operator_session.requested, "no request recorded"
    outside = [url for url in operator_session.requested
               if not url.startswith((stack.base_url, "data:", "blob:", "about:"))]
    assert outside == []
    assert any(url.startswith(f"{stack.base_url}/vendor/plotly.min.js") for url in operator_session.requested)


def _with_disk(directory) -> Callable[[dict], dict]:
    def change(spec: dict) -> dict:
        return {**spec, "cache": {**spec["cache"], "disk": {"path": str(directory / "kv"), "budget_mb": 64}}}

    return change


def _without_disk(spec: dict) -> dict:
    return {**spec, "cache": {key: value for key, value in spec["cache"].items() if key != "disk"}}


def _wait_or_say_why(locator, stack, shown) -> None:
    """``locator.wait_for`` up to the convergence timeout; on a timeout, what the page showed and what
    the pool's instances reported (generation, state, tiers), so a failure says which side lagged."""
    try:
        locator.wait_for(timeout=CONVERGE_TIMEOUT_MS)
    except PlaywrightTimeoutError:
        _, status = stack.api("GET", f"/api/v1/pools/{POOL}/status/")
        instances = [{key: row.get(key) for key in ("instance", "live", "applied_generation", "config_state",
                                                    "error", "tiers")} for row in status.get("instances", [])]
        page = shown.page
        connection = page.evaluate("(document.getElementById('connection') || {}).textContent || ''")
        raise AssertionError(f"not shown in {CONVERGE_TIMEOUT_MS / 1000:.0f} s; the page showed "
                             f"{shown.inner_text()!r} (connection {connection!r}); desired generation "
                             f"{status.get('desired_generation')}, instances {instances}") from None


def test_the_live_view_shows_the_disk_tier_a_revision_turns_on_and_drops_it_when_turned_off(sre, stack, tmp_path,
                                                                                           screenshot):
    """Generic per-tier figures: no page names the disk tier, yet it shows once the instances run it."""
    with_disk, without_disk = _with_disk(tmp_path), _without_disk

    sre.goto(f"{LIVE}?window=5m")
    occupancy = sre.locator('[data-role="tier-occupancy"]')
    occupancy.locator('li[data-tier="hbm"]').wait_for()
    assert occupancy.locator('li[data-tier="disk"]').count() == 0
    publish_spec_via_api(stack, with_disk)
    try:
        disk = occupancy.locator('li[data-tier="disk"]', has_text="of 128 MiB")  # two instances, 64 MiB each
        _wait_or_say_why(disk, stack, occupancy)
        names = sre.evaluate("document.querySelector('[data-chart=\"tiers\"] .plot').data.map((t) => t.name)")
        assert names == ["hbm", "dram", "disk"]
        lookups = sre.evaluate("document.querySelector('[data-chart=\"hits\"] .plot').data.map((t) => t.name)")
        assert "disk hit" in lookups and len(lookups) == len(set(lookups)) >= 5  # every outcome the server knows
        screenshot(sre, "40-live-view-disk-tier")
    finally:
        publish_spec_via_api(stack, without_disk)
    # Its line stays on the chart for the minutes it ran; the figures now list the tiers with a budget now.
    occupancy.locator('li[data-tier="disk"]').wait_for(state="detached", timeout=CONVERGE_TIMEOUT_MS)
    assert occupancy.locator('li[data-tier="hbm"]').count() == 1


def test_the_fleet_page_gets_a_disk_column_while_the_instances_run_the_disk_tier(sre, stack, tmp_path, screenshot):
    """One column per tier the pool's instances run, from their statuses: the page names no tier."""
    sre.goto(FLEET)
    head = sre.locator('[data-role="instances"] thead')
    head.locator('th[data-tier="dram"]').wait_for()
    assert [th.get_attribute("data-tier") for th in head.locator("th[data-tier]").all()] == ["hbm", "dram"]
    publish_spec_via_api(stack, _with_disk(tmp_path))
    try:
        disk = head.locator('th[data-tier="disk"]')
        disk.wait_for(timeout=CONVERGE_TIMEOUT_MS)
        assert disk.inner_text() == "local disk bytes / budget"
        assert [th.get_attribute("data-tier") for th in head.locator("th[data-tier]").all()] == ["hbm", "dram", "disk"]
        # Each of the two instances: its disk tier's bytes of its 64 MiB budget.
        cells = sre.locator('[data-role="instances"] tbody tr[data-instance] td[data-tier="disk"]', has_text="/ 64.0 MiB")
        cells.nth(1).wait_for(timeout=CONVERGE_TIMEOUT_MS)
        assert cells.count() == 2
        screenshot(sre, "41-fleet-disk-tier")
    finally:
        publish_spec_via_api(stack, _without_disk)
    head.locator('th[data-tier="disk"]').wait_for(state="detached", timeout=CONVERGE_TIMEOUT_MS)


MISS_POOL = "ranking-misses"


def test_the_live_view_draws_misses_by_reason_beside_the_hit_ratio_and_says_the_breakdown(sre, stack, screenshot):
    """An instance's snapshots with misses by reason (2/s evicted from HBM, 1/s from DRAM, 1/s first
    visits, none else) in a pool of its own: one bar per reason that has misses, the two evictions one
    legend group, the hit ratio on a 0–100 % axis of its own, and the window's breakdown in words; the
    instance's page says the same."""
    stack.create_pool(MISS_POOL)
    worker = FakeWorker(stack.redis, MISS_POOL, 0, prefix=stack.key_prefix)
    now = time.time()
    evicted_hbm, evicted_dram, first_visit = MissReason.EVICTED_HBM, MissReason.EVICTED_DRAM, MissReason.FIRST_VISIT
    for i in range(60):
        worker.publish_snapshot(snapshot(
            worker.name, now - 60 + i, now - 70, latencies_ms=[5.0] * i, rank_requests=10 * i, rank_ok=10 * i,
            rank_within_slo=10 * i, hbm_hits=6 * i, misses=4 * i,
            miss_reasons={evicted_hbm: 2 * i, evicted_dram: i, first_visit: i}))
    # 59 s of counts: 236 misses, 118 evicted from HBM, 59 each from DRAM and on a first visit.
    expected = (f"236 misses: 50% {evicted_hbm.label}, 25% {first_visit.label}, 25% {evicted_dram.label}.")
    sre.goto(f"/pools/{MISS_POOL}/?window=5m")
    chart = sre.locator('[data-chart="misses"][data-has-data="true"]')
    chart.locator(".main-svg").first.wait_for()
    breakdown = sre.locator('#live [data-role="miss-breakdown"]')
    breakdown.filter(has_text="236 misses").wait_for()
    assert breakdown.inner_text() == expected
    drawn = sre.evaluate("""() => {
        const plot = document.querySelector('[data-chart="misses"] .plot');
        return {traces: plot.data.map((t) => ({name: t.name, type: t.type, yaxis: t.yaxis || "y",
                                             group: t.legendgroup || null})),
                y2: plot._fullLayout.yaxis2.range, side: plot._fullLayout.yaxis2.side};
    }""")
    bars = [t for t in drawn["traces"] if t["type"] == "bar"]
    assert [t["name"] for t in bars] == [first_visit.label, evicted_hbm.label, evicted_dram.label]
    assert {t["group"] for t in bars if t["name"] != first_visit.label} == {evicted_hbm.family}
    [hit_ratio] = [t for t in drawn["traces"] if t["yaxis"] == "y2"]
    assert hit_ratio["type"] == "scatter" and drawn["y2"] == [0, 100] and drawn["side"] == "right"
    legend = sre.evaluate("""() => [...document.querySelectorAll('[data-chart="misses"] .legend .traces')]
        .map((t) => t.textContent)""")
    # The three reasons with misses (the evictions under their family's title) and the hit ratio; no other.
    assert sorted(legend) == sorted([first_visit.label, f"{evicted_hbm.family}:", evicted_hbm.label,
                                     evicted_dram.label, "hit ratio (no recompute)"])
    screenshot(sre, "42-live-view-misses-by-reason")
    sre.goto(f"/pools/{MISS_POOL}/instances/{worker.name}/?window=5m")
    sre.locator('#instance [data-chart="misses"][data-has-data="true"] .main-svg').first.wait_for()
    instance_breakdown = sre.locator('#instance [data-role="miss-breakdown"]')
    instance_breakdown.filter(has_text="236 misses").wait_for()
    assert instance_breakdown.inner_text() == expected
    screenshot(sre, "43-instance-misses-by-reason")
