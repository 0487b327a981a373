"""The config editor's cache curves (issue 25 §2) in real headless Chromium against the real stack: beside
the HBM budget, DRAM budget and HBM entry TTL, the hit ratio the pool's captured traffic predicts, the live
and the form's value marked, and a sentence; fetched once, the form's value interpolated in the page."""

from __future__ import annotations

import contextlib
import math
import re
from collections.abc import Iterator

import pytest

from .conftest import SCREENSHOTS, Session
from .stack import POOL
from .test_browser import CONFIG, field, wait_for_captured_traffic

pytestmark = [pytest.mark.browser, pytest.mark.integration, pytest.mark.slow]

IDLE_POOL = "ranking-idle"  # a pool no instance serves: its capture is empty
CURVES = {"cache.hbm_budget_mb": "hbm", "cache.dram_budget_mb": "dram", "cache.entry_ttl_ms": "entry_ttl"}
AXIS_TITLES = {"hbm": "HBM budget per instance (MiB)", "dram": "DRAM budget per instance (MiB)",
               "entry_ttl": "HBM entry TTL (ms)"}


def curve(page, axis: str):
    return page.locator(f'[data-role="curve-{axis}"]')


def traces(page, axis: str) -> dict[str, dict]:
    """The chart's traces by name, as plotly.js holds them: {name: {x, y}}."""
    return page.evaluate("""(axis) => Object.fromEntries(document.querySelector(`[data-role="curve-${axis}"] .plot`)
        .data.map((t) => [t.name, {x: [...t.x], y: [...t.y]}]))""", axis)


def interpolated(points: list[dict], key: str, x: float) -> float:
    """The hit ratio at x on the curve as drawn: linear in log x between two points (from 0, linear)."""
    for a, b in zip(points, points[1:], strict=False):
        if a[key] <= x <= b[key]:
            at = math.log(x / a[key]) / math.log(b[key] / a[key]) if a[key] > 0 else (x - a[key]) / (b[key] - a[key])
            return a["hit_ratio"] + (b["hit_ratio"] - a["hit_ratio"]) * at
    raise AssertionError(f"{x} is outside the curve")


def said_percent(sentence: str) -> float:
    match = re.search(r"about (\d+)% hits", sentence)
    assert match, sentence
    return float(match.group(1))


@contextlib.contextmanager
def console_errors(page, *, refused: str = "") -> Iterator[list[str]]:
    """The page's console errors; Chromium's own line for a non-2xx answer of a URL containing ``refused``
    (the page reads that answer) is no error of the page."""
    errors: list[str] = []

    def record(message):
        answered = refused and message.text.startswith("Failed to load resource") and refused in message.location["url"]
        if message.type == "error" and not answered:
            errors.append(f"{message.text} ({message.location['url']})")

    page.on("console", record)
    try:
        yield errors
    finally:
        page.remove_listener("console", record)


def open_curves(page) -> dict:
    """The editor, scrolled to the cache budgets; the answer of its one cache-curves request."""
    with page.expect_response(lambda r: "/cache-curves/" in r.url, timeout=30_000) as answer:
        page.goto(CONFIG)
        page.locator('[data-field="cache.hbm_budget_mb"]').scroll_into_view_if_needed()
    assert answer.value.status == 200, answer.value.text()
    for axis in CURVES.values():
        curve(page, axis).locator('.chart[data-has-data="true"]').wait_for()
    return answer.value.json()


def outside_requests(session: Session) -> list[str]:
    return [url for url in session.requested if not url.startswith((session.stack.base_url, "data:", "blob:", "about:"))]


@pytest.fixture(scope="module")
def captured(stack) -> None:
    summary = wait_for_captured_traffic(stack, "1m", at_least=30)
    assert summary["requests"] >= 30, summary


def test_the_curves_show_beside_each_budget_with_live_and_proposed_and_the_form_moves_them_without_a_request(
        sre, operator_session, captured):
    with console_errors(sre) as errors:
        asked_before = len(operator_session.requested)
        body = open_curves(sre)
        live = body["live"]
        for path, axis in CURVES.items():
            drawn = traces(sre, axis)
            assert set(drawn) == {"predicted", "live", "proposed"}, axis
            assert len(drawn["predicted"]["x"]) == len(body["axes"][axis]) >= 3
            live_x = {"hbm": live["hbm_budget_mb"], "dram": live["lower"]["dram"]["budget_mb"],
                      "entry_ttl": live["entry_ttl_ms"]}[axis]
            assert drawn["live"] == {"x": [live_x], "y": [live["hit_ratio"]]}, axis
            assert drawn["proposed"]["x"] == [float(field(sre, path).input_value())], axis  # the form holds the live
            said = curve(sre, axis).locator('[data-role="curve-sentence"]').inner_text()
            assert "(live): about" in said and "Measured over the last 15 min: " in said, said

        # A budget between two computed points where the curve rises: the sentence interpolates it.
        points = body["axes"]["hbm"]
        rising = [(a, b) for a, b in zip(points, points[1:], strict=False)
                  if b["budget_mb"] - a["budget_mb"] >= 0.2 and b["hit_ratio"] > a["hit_ratio"]]
        assert rising, points
        a, b = rising[-1]  # with this stack's small prefixes, often the step from 0 to the first budget
        proposed = round(math.sqrt(a["budget_mb"] * b["budget_mb"]) if a["budget_mb"] else b["budget_mb"] / 2, 1)
        assert a["budget_mb"] < proposed < b["budget_mb"]
        shown = f"{proposed:,.3f}".rstrip("0").rstrip(".")
        sentence = curve(sre, "hbm").locator('[data-role="curve-sentence"]')
        field(sre, "cache.hbm_budget_mb").fill(shown)
        sre.wait_for_function("(x) => document.querySelector('[data-role=\"curve-hbm\"]').dataset.proposed === x",
                              arg=shown)
        text = sentence.inner_text()
        assert text.startswith(f"{shown} MiB per instance: about "), text
        assert re.search(rf"\(now \d+% at {live['hbm_budget_mb']:,.0f} MiB\)", text), text
        assert abs(said_percent(text) - 100 * interpolated(points, "budget_mb", proposed)) <= 0.5 + 1e-9, text
        drawn = traces(sre, "hbm")
        assert drawn["proposed"]["x"] == [proposed]
        assert drawn["proposed"]["y"][0] == pytest.approx(interpolated(points, "budget_mb", proposed))
        assert drawn["live"]["x"] == [live["hbm_budget_mb"]]  # the live marker stays

        # Past the last computed point: said so, no extrapolated marker.
        last = points[-1]["budget_mb"]
        field(sre, "cache.hbm_budget_mb").fill(str(int(last * 10)))
        sentence.filter(has_text="past the computed curve").wait_for()
        assert f"which ends at {last:,.0f} MiB: no prediction" in sentence.inner_text()
        assert traces(sre, "hbm")["proposed"]["x"] == []

        # Discarding the changes puts the proposed marker back on the live value.
        sre.click('[data-role="reset"]')
        sentence.filter(has_text="(live): about").wait_for()
        assert traces(sre, "hbm")["proposed"]["x"] == [live["hbm_budget_mb"]]

        asked = [url for url in operator_session.requested[asked_before:] if "/cache-curves/" in url]
        assert len(asked) == 1, asked
        assert asked[0].endswith(f"/api/v1/pools/{POOL}/cache-curves/?window=15m")
    assert errors == []
    assert outside_requests(operator_session) == []


def test_a_viewer_sees_the_curves_in_the_read_only_editor(browser, stack, captured):
    viewer = Session(browser, stack, "pm")
    try:
        page = viewer.page
        with console_errors(page) as errors:
            body = open_curves(page)
            for path, axis in CURVES.items():
                assert page.locator(f'output[data-path="{path}"]').count() == 1
                drawn = traces(page, axis)
                assert drawn["live"]["x"] == drawn["proposed"]["x"] and drawn["live"]["x"][0] > 0, axis
                said = curve(page, axis).locator('[data-role="curve-sentence"]').inner_text()
                assert "(live): about" in said and f"{round(body['measured_hit_ratio'] * 100)}%" in said, said
            assert page.locator("input[data-path]").count() == 0
        assert errors == [] and viewer.page_errors == [] and viewer.csp_violations == []
        assert outside_requests(viewer) == []
    finally:
        viewer.close()


@pytest.fixture(scope="module")
def idle_pool(stack) -> str:
    stack.create_pool(IDLE_POOL, "no instance serves it")
    return IDLE_POOL


def test_with_no_captured_traffic_the_panel_says_so_in_the_409s_sentence(sre, operator_session, stack, idle_pool):
    status, refusal = stack.api("GET", f"/api/v1/pools/{idle_pool}/cache-curves/?window=15m")
    assert status == 409, refusal
    with console_errors(sre, refused="/cache-curves/") as errors:
        with sre.expect_response(lambda r: "/cache-curves/" in r.url) as answer:
            sre.goto(f"/pools/{idle_pool}/config/")
            sre.locator('[data-field="cache.hbm_budget_mb"]').scroll_into_view_if_needed()
        assert answer.value.status == 409
        said = curve(sre, "hbm").locator('[data-role="curve-sentence"]')
        said.filter(has_text="No captured traffic").wait_for()
        assert said.inner_text().startswith(f"No captured traffic of pool '{idle_pool}' in the last 15m")
        assert "send traffic to the pool" in said.inner_text()
        # Said once, beside the first field; no empty chart anywhere.
        assert curve(sre, "dram").count() == 0 and curve(sre, "entry_ttl").count() == 0
        assert sre.locator(".cache-curve .chart").count() == 0
    assert errors == []
    assert outside_requests(operator_session) == []


def test_the_curves_are_legible_at_1400_px(operator_session, captured):
    operator_session.page_errors.clear()
    operator_session.csp_violations.clear()
    page = operator_session.new_page()
    page.set_viewport_size({"width": 1400, "height": 900})
    try:
        open_curves(page)
        field(page, "cache.hbm_budget_mb").fill("24")
        page.wait_for_function("() => document.querySelector('[data-role=\"curve-hbm\"]').dataset.proposed === '24'")
        for axis, title in AXIS_TITLES.items():
            chart = curve(page, axis)
            assert chart.locator(".g-xtitle").text_content() == title
            assert chart.locator(".g-ytitle").text_content() == "hit ratio"
            assert chart.locator(".legend .legendtext").all_text_contents() == ["predicted", "live", "proposed"]
            legend, plot = (chart.locator(selector).bounding_box() for selector in (".legend", ".nsewdrag"))
            assert legend["y"] + legend["height"] <= plot["y"] + 0.5, axis  # above the plot, not over the curve
            box = chart.bounding_box()
            assert box["x"] <= legend["x"] and legend["x"] + legend["width"] <= box["x"] + box["width"], axis
        page.locator('[data-field="cache.hbm_budget_mb"]').evaluate(
            "(node) => { node.closest('fieldset').scrollIntoView(); window.scrollBy(0, -60); }")
        SCREENSHOTS.mkdir(parents=True, exist_ok=True)
        page.screenshot(path=str(SCREENSHOTS / "03c-config-cache-curves-1400px.png"))
        assert operator_session.page_errors == [] and operator_session.csp_violations == []
    finally:
        page.close()
