"""Each instance's newest gauges over a window, read from the recorded ten-minute blocks and the raw scrapes
at the window's edges, are ``last_over_time`` over the raw scrapes, and its counts (and latency quantile)
read from the blocks of summed minutes and the minutes at the edges are the window's minutes summed, on a
real Prometheus: a few instances' scrapes (every counted and gauged series the history reads, growing and
moving at random) backfilled through ``promtool``, the history rules backfilled over them, the last hour's
blocks at another phase beside them (as a server's own go on from a backfill's), and windows whose edges
fall anywhere in a minute. A window too short for a whole block, or a pool without blocks, reads the raw
scrapes (or the minutes) alone."""

from __future__ import annotations

import random
import subprocess
import time

import numpy as np
import pytest

from controlplane.telemetry import promql
from controlplane.telemetry.bench_prometheus import backfill_recorded, prometheus_server
from controlplane.telemetry.promql import (
    PrometheusHistory,
    block_runs,
    counts_query,
    gauges_query,
    quantile_query,
)
from controlplane.telemetry.recording import (
    BLOCK_GROUP,
    BLOCK_LAG_S,
    BLOCK_PROBE_RECORD,
    BLOCK_S,
    COUNTED,
    GAUGED,
    GROUP,
    SUMS_GROUP,
    SUMS_PROBE_RECORD,
    group_rules,
    rolled,
)
from relay_engine.core.lifetime import free_port
from relay_engine.core.telemetry import LATENCY_BUCKETS_MS, MISS_REASONS, REFUSAL_REASONS, TIER_LEVEL_GAUGES
from tests.promtool import prometheus_binary

pytestmark = [pytest.mark.integration, pytest.mark.slow]

POOL = "blocks"
INSTANCES = 3
HOURS = 2.2
SCRAPE_S = 15
LES = [*(f"{ms / 1000:g}" for ms in LATENCY_BUCKETS_MS), "+Inf"]
TIERS = sorted({tier for tier, _ in TIER_LEVEL_GAUGES.values()})


def _scrapes(first: float, last: float) -> str:
    """OpenMetrics for every counted and gauged series the history reads, of ``INSTANCES`` instances scraped
    every ``SCRAPE_S`` from ``first`` to ``last``: counters growing by random steps (one instance restarting
    halfway), gauges moving at random, latency buckets cumulative."""
    rng = random.Random(11)
    reasons = {"relaygr_preinfer_refusals_total": REFUSAL_REASONS, "relaygr_rank_misses_total": MISS_REASONS}
    names = [f"{POOL}-{i}" for i in range(INSTANCES)]
    counters = [series for series, split, _ in COUNTED if split is None and series.endswith("_total")]
    gauges = [(series, split) for series, _, split, _ in GAUGED if not series.endswith("_total")]
    totals: dict[tuple, float] = {}
    out = []

    def grow(key: tuple, step: float) -> float:
        totals[key] = totals.get(key, 0.0) + step
        return totals[key]

    for k in range(int((last - first) // SCRAPE_S) + 1):
        ts = first + k * SCRAPE_S
        lines: dict[str, list[str]] = {}  # a scrape: each family's header, then its samples
        for i, name in enumerate(names):
            if i == 1 and k == int((last - first) // SCRAPE_S) // 2:  # a restart: every counter from 0
                totals = {key: value for key, value in totals.items() if key[1] != name}
            labels = f'pool="{POOL}",instance="{name}"'
            for series in counters:
                family = series.removesuffix("_total")
                lines.setdefault(f"# TYPE {family} counter", []).append(
                    f"{series}{{{labels}}} {grow((series, name), rng.randint(0, 9))} {ts:.3f}")
            for series, values in reasons.items():
                family = series.removesuffix("_total")
                for reason in values:
                    lines.setdefault(f"# TYPE {family} counter", []).append(
                        f'{series}{{{labels},reason="{reason}"}} {grow((series, name, reason), rng.randint(0, 2))} '
                        f"{ts:.3f}")
            cumulative = 0.0
            family = "relaygr_rank_latency_seconds"
            for le in LES:
                cumulative += rng.randint(0, 3) if le != "+Inf" else 0
                count = grow((family, name, le), cumulative)
                lines.setdefault(f"# TYPE {family} histogram", []).append(
                    f'{family}_bucket{{{labels},le="{le}"}} {count} {ts:.3f}')
            lines[f"# TYPE {family} histogram"].append(f"{family}_count{{{labels}}} {count} {ts:.3f}")
            lines[f"# TYPE {family} histogram"].append(
                f"{family}_sum{{{labels}}} {grow((family, name, 'sum'), rng.random() * 5)} {ts:.3f}")
            for series, split in gauges:
                for tier in (TIERS if split == "tier" else [None]):
                    tagged = labels + (f',tier="{tier}"' if tier else "")
                    lines.setdefault(f"# TYPE {series} gauge", []).append(
                        f"{series}{{{tagged}}} {rng.randint(0, 1000)} {ts:.3f}")
        out.extend(header + "\n" + "\n".join(samples) + "\n" for header, samples in lines.items())
    return "".join(out) + "# EOF\n"


def _by_labels(answer) -> dict[tuple, float]:
    return {tuple(sorted(labels.items())): float(samples.value[0]) for labels, samples in answer}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    prometheus_binary("prometheus")
    work = tmp_path_factory.mktemp("blocks")
    data_dir = work / "data"
    data_dir.mkdir()
    now = float(int(time.time()) - 120)
    # The scrapes start 5 s before a two-hour TSDB block boundary: promtool's rule backfill found no aligned
    # evaluation of the ten-minute group in so short a first block and stopped there, leaving no blocks at all
    # (it failed CI once, by chance); the backfill must start at the boundary instead.
    first = float(int(now - HOURS * 3600) // 7200 * 7200 - 5)
    _backfill_openmetrics(_scrapes(first, now), work / "raw.om", data_dir)
    port = free_port()
    backfill_recorded(data_dir, first, now, port, work, groups=(GROUP,))
    backfill_recorded(data_dir, first, now - 3600, port, work, groups=(BLOCK_GROUP, SUMS_GROUP))
    # The last hour's blocks at another phase, 7 minutes after the backfill's (as the server's own go on from a
    # backfill's: a group's phase depends on its rules file's path), the first overlapping the backfill's last.
    blocks = []
    with prometheus_server(data_dir, port, work / "prometheus-phase.log") as url:
        for group, probe in ((BLOCK_GROUP, BLOCK_PROBE_RECORD), (SUMS_GROUP, SUMS_PROBE_RECORD)):
            stamps = _block_stamps(PrometheusHistory(url, timeout_s=30), first, now, probe)
            assert stamps.size and stamps[0] - BLOCK_LAG_S - BLOCK_S < first + BLOCK_S, (group, stamps)
            shifted = np.arange(stamps[-1] + 420, now - BLOCK_LAG_S, BLOCK_S)
            blocks.append(_blocks_at(PrometheusHistory(url, timeout_s=30), shifted, group))
    _backfill_openmetrics("".join(text.removesuffix("# EOF\n") for text in blocks) + "# EOF\n", work / "shifted.om",
                          data_dir)
    with prometheus_server(data_dir, port, work / "prometheus.log") as url:
        promql.forget_recorded()
        yield PrometheusHistory(url, timeout_s=30), now


def _backfill_openmetrics(text: str, path, data_dir) -> None:
    path.write_text(text)
    result = subprocess.run([prometheus_binary("promtool"), "tsdb", "create-blocks-from", "openmetrics", "--quiet",
                             str(path), str(data_dir)], capture_output=True, text=True, check=False, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]


def _block_stamps(history: PrometheusHistory, first: float, now: float, probe: str) -> np.ndarray:
    answer = history._get("/api/v1/query", query=f'{probe}{{pool="{POOL}"}}[{int(now - first) + 3600}s]',
                          time=f"{now:.3f}")
    return np.array(sorted(float(t) for item in answer for t, _ in item["values"]))


def _blocks_at(history: PrometheusHistory, stamps: np.ndarray, group: str) -> str:
    """Every rule of ``group`` evaluated at ``stamps`` (as the server would at another phase), as OpenMetrics."""
    samples: dict[str, list[tuple[tuple, float, float]]] = {}
    for rule in group_rules(group, lambda rule: not rolled(rule))["groups"][0]["rules"]:
        for stamp in stamps.tolist():
            for item in history._get("/api/v1/query", query=rule["expr"], time=f"{stamp:.3f}"):
                labels = tuple(sorted((k, v) for k, v in item["metric"].items() if k != "__name__"))
                samples.setdefault(rule["record"], []).append((labels, stamp, float(item["value"][1])))
    out = []
    for record, values in samples.items():
        out.append(f"# TYPE {record} gauge\n")
        for labels, stamp, value in sorted(values):
            tags = ",".join(f'{k}="{v}"' for k, v in labels)
            out.append(f"{record}{{{tags}}} {value!r} {stamp:.3f}\n")
    return "".join(out) + "# EOF\n"


def test_newest_gauges_over_blocks_equal_the_raw_samples_newest(server):
    history, now = server
    selector = promql._selector(POOL, [f"{POOL}-0", f"{POOL}-2"])
    for start in (now - 2 * 3600 + 3, now - 5400 + 0.5):
        span = history._span(POOL, start, now)
        assert span is not None
        whole_blocks = sum(round((last - first) / BLOCK_S) + 1 for first, last in span.runs)
        assert whole_blocks >= (now - start) // BLOCK_S - 3
        assert span.runs[0][0] - BLOCK_LAG_S - BLOCK_S >= start and span.runs[-1][1] - BLOCK_LAG_S <= now
        if start < now - 3600:  # the backfill's blocks, then the other phase's after a gap
            assert len(span.runs) > 1 and span.runs[1][0] - span.runs[0][1] > BLOCK_S
        since = promql._since(start, now)
        raw = _by_labels(history._instant(gauges_query(selector, ("instance",), since), now))
        spanned = _by_labels(history._instant(gauges_query(selector, ("instance",), since, span=span), now))
        assert len({dict(key)["instance"] for key in raw}) == 2 and len(raw) > 2 * len(TIERS)
        assert spanned == raw
    # Further back the blocks end before the window's: their raw head and tail alone, the newest still right.
    earlier = now - 3000
    span = history._span(POOL, earlier - 3600, earlier)
    since = promql._since(earlier - 3600, earlier)
    assert _by_labels(history._instant(gauges_query(selector, ("instance",), since, span=span), earlier)) == \
        _by_labels(history._instant(gauges_query(selector, ("instance",), since), earlier))


def test_a_window_without_whole_blocks_reads_the_raw_scrapes_alone(server):
    history, now = server
    at = history._newest_recorded_minute(POOL, now)
    for probe in (BLOCK_PROBE_RECORD, SUMS_PROBE_RECORD):
        assert history._span(POOL, at - 1100, at, probe) is None
        assert history._span("no-such-pool", at - 7200, at, probe) is None


def test_counts_over_summed_blocks_equal_the_recorded_minutes_summed(server):
    """Every count of every instance (and each one's latency P99) over a window read from the blocks of summed
    minutes and the minutes at its edges equals the window's minutes summed: each minute counted once, across
    the two phases' runs too."""
    history, now = server
    at = history._newest_recorded_minute(POOL, now)
    selector = promql._selector(POOL, None)
    for start in (at - 2 * 3600 + 3, at - 5400 + 0.5, at - 3000 - 17.25):
        span = history._span(POOL, start, at, SUMS_PROBE_RECORD)
        assert span is not None
        if start < at - 3600:
            assert len(span.runs) > 1, span
        since = promql._since(start, at)
        minutes = _by_labels(history._instant(counts_query(selector, ("instance",), since, recorded=True), at))
        spanned = _by_labels(history._instant(counts_query(selector, ("instance",), since, recorded=True, span=span),
                                              at))
        assert len(minutes) > INSTANCES * len(COUNTED) and spanned.keys() == minutes.keys()
        assert spanned == pytest.approx(minutes, rel=1e-9, abs=1e-9)
        assert sum(minutes.values()) > 0
        p99 = _by_labels(history._instant(quantile_query(0.99, selector, since, recorded=True), at))
        p99_spanned = _by_labels(history._instant(quantile_query(0.99, selector, since, recorded=True, span=span), at))
        assert len(p99) == INSTANCES and p99_spanned == pytest.approx(p99, rel=1e-9)


def test_blocks_of_two_phases_are_read_as_runs_that_neither_overlap_nor_leave_a_block_out_of_a_run():
    phase_a = [1000.0 + BLOCK_S * k for k in range(6)]  # 1000 .. 4000
    phase_b = [3420.0 + BLOCK_S * k for k in range(4)]  # 3420 .. 5220, 420 s after a's
    runs = block_runs(np.array(phase_a + phase_b), start=0.0, end=6000.0)
    # a's first five; b's 3420 overlaps a's 3400 (left out, and a's run ends); a's 4000 alone (b's 4020
    # overlaps it); b's 4620 is a block after 4000 and more: a run with b's 5220.
    assert runs == ((1000.0, 3400.0), (4000.0, 4000.0), (4620.0, 5220.0))
    kept = [stamp for first, last in runs for stamp in np.arange(first, last + 1, BLOCK_S)]
    assert all(b - a >= BLOCK_S for a, b in zip(kept, kept[1:], strict=False))
    # Whole in the window only: a block's minutes reach BLOCK_S + BLOCK_LAG_S back of its stamp.
    assert block_runs(np.array(phase_a), start=1000.0 - BLOCK_S - BLOCK_LAG_S + 1, end=2800.0 - BLOCK_LAG_S) == \
        ((1600.0, 2800.0),)
    assert block_runs(np.array([]), 0.0, 1e4) == ()
