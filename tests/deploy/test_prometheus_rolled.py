"""A day's counts read from a rolled sum (the last ``ROLLED_BLOCKS`` blocks of summed minutes, recorded after
each block) and the minutes at the window's edges equal the window's minutes summed, on a real Prometheus:
26 hours of two instances' recorded minutes (the first rules group's records, at a phase of their own)
backfilled through ``promtool``, the summed blocks and the rolled sums backfilled over them by the shipped
rules in their two passes, and day-long windows whose edges fall anywhere in a minute; a third instance stopped
reporting half a day ago, so the window's newest minutes do not hold it. A rolled sum whose blocks are not one
run of the window's is never read."""

from __future__ import annotations

import random
import subprocess
import time

import numpy as np
import pytest

from controlplane.telemetry import promql
from controlplane.telemetry.bench_prometheus import backfill_recorded, prometheus_server
from controlplane.telemetry.promql import PrometheusHistory, Span, counts_query, quantile_query, rolled_stamps
from controlplane.telemetry.recording import (
    BLOCK_LAG_S,
    BLOCK_S,
    COUNTED,
    INSTANCE,
    POOL,
    ROLLED_BLOCKS,
    SUMS_GROUP,
    counted_record,
)
from relay_engine.core.lifetime import free_port
from relay_engine.core.telemetry import LATENCY_BUCKETS_MS
from tests.promtool import prometheus_binary

pytestmark = [pytest.mark.integration, pytest.mark.slow]

POOL_NAME = "rolled"
INSTANCES = 2
GONE = f"{POOL_NAME}-gone"  # reports only until GONE_FOR_H before now
GONE_FOR_H = 12
HOURS = 26
PHASE_S = 17.25  # the minutes' evaluation phase: anywhere in the minute
LES = [*(f"{ms / 1000:g}" for ms in LATENCY_BUCKETS_MS), "+Inf"]
# What the windows read: the requests (the pool's too: the blocks' probe records sum it), the latency buckets
# and sum. The other counts are the same rules on other names.
READ = {column for _, _, column in COUNTED if column in ("counter:rank_requests", "bucket", "sum")}


def _minutes(first: float, last: float) -> str:
    """OpenMetrics of the recorded minutes of ``READ``'s counts, per instance and for the pool, every minute
    from ``first`` to ``last`` (``GONE``'s to ``GONE_FOR_H`` before it): random counts, the buckets cumulative."""
    rng = random.Random(5)
    names = [*(f"{POOL_NAME}-{i}" for i in range(INSTANCES)), GONE]
    lines: dict[str, list[str]] = {}
    [requests] = [(s, split) for s, split, column in COUNTED if column == "counter:rank_requests"]
    [bucket] = [(s, split) for s, split, column in COUNTED if column == "bucket"]
    [latency_sum] = [(s, split) for s, split, column in COUNTED if column == "sum"]
    for ts in np.arange(first, last, 60.0).tolist():
        pool_requests = 0.0
        for name in names:
            if name == GONE and ts > last - GONE_FOR_H * 3600:
                continue
            labels = f'pool="{POOL_NAME}",instance="{name}"'
            count = rng.randint(0, 40) + rng.random()
            pool_requests += count
            lines.setdefault(counted_record(*requests, INSTANCE), []).append(f"{{{labels}}} {count!r} {ts:.3f}")
            cumulative = 0.0
            for le in LES:
                cumulative += rng.randint(0, 3) + rng.random() / 4 if le != "+Inf" else 0.0
                lines.setdefault(counted_record(*bucket, INSTANCE), []).append(
                    f'{{{labels},le="{le}"}} {cumulative!r} {ts:.3f}')
            lines.setdefault(counted_record(*latency_sum, INSTANCE), []).append(
                f"{{{labels}}} {rng.random() * 5!r} {ts:.3f}")
        lines.setdefault(counted_record(*requests, POOL), []).append(
            f'{{pool="{POOL_NAME}"}} {pool_requests!r} {ts:.3f}')
    out = []
    for record, samples in lines.items():
        out.append(f"# TYPE {record} gauge\n")
        out.extend(f"{record}{sample}\n" for sample in samples)
    return "".join(out) + "# EOF\n"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    prometheus_binary("prometheus")
    work = tmp_path_factory.mktemp("rolled")
    data_dir = work / "data"
    data_dir.mkdir()
    now = float(int(time.time()) - 120)
    first = float(int(now - HOURS * 3600) // 7200 * 7200 + PHASE_S)  # from a two-hour TSDB block boundary
    (work / "minutes.om").write_text(_minutes(first, now))
    result = subprocess.run([prometheus_binary("promtool"), "tsdb", "create-blocks-from", "openmetrics", "--quiet",
                             str(work / "minutes.om"), str(data_dir)], capture_output=True, text=True, check=False,
                            timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    port = free_port()
    backfill_recorded(data_dir, first, now, port, work, groups=(SUMS_GROUP,))
    with prometheus_server(data_dir, port, work / "prometheus.log") as url:
        promql.forget_recorded()
        history = PrometheusHistory(url, timeout_s=60)
        at = history._newest_recorded_minute(POOL_NAME, now)
        assert at is not None and now - at < 120
        yield history, at


def _by_labels(answer) -> dict[tuple, float]:
    return {tuple(sorted(labels.items())): float(samples.value[0]) for labels, samples in answer}


def test_a_days_counts_over_a_rolled_sum_equal_the_recorded_minutes_summed(server):
    history, at = server
    selector = promql._selector(POOL_NAME, None)
    kinds_seen = set()
    # 24 h with its edges anywhere in a minute; 23 h 55 min (a rolled sum and no block left); 25 h (a rolled
    # sum and a run of blocks before it).
    for start in (at - 86400 + 0.5, at - 86400 - 31.125, at - 86100 + 3.0, at - 90000 - 7.75):
        span = history._summed_span(POOL_NAME, start, at)
        assert span is not None and span.rolled, span
        kinds = [kind for kind, _, _ in span.pieces()]
        assert kinds.count("rolled") == 1, span
        kinds_seen.update(kinds)
        since = promql._since(start, at)
        minutes = _by_labels(history._instant(counts_query(selector, ("instance",), since, recorded=True,
                                                           columns=frozenset(READ)), at))
        rolled = _by_labels(history._instant(counts_query(selector, ("instance",), since, recorded=True,
                                                          columns=frozenset(READ), span=span), at))
        assert len(minutes) == (INSTANCES + 1) * (2 + len(LES)) and rolled.keys() == minutes.keys()
        assert rolled == pytest.approx(minutes, rel=1e-9, abs=1e-6)
        p99 = _by_labels(history._instant(quantile_query(0.99, selector, since, recorded=True), at))
        p99_rolled = _by_labels(history._instant(quantile_query(0.99, selector, since, recorded=True, span=span), at))
        assert len(p99) == INSTANCES + 1 and p99_rolled == pytest.approx(p99, rel=1e-9)
        # Added part by part, the instances with every part are the same; the one gone lacks the newest edge.
        matched = _by_labels(history._instant(quantile_query(0.99, selector, since, recorded=True, span=span,
                                                             matched=True), at))
        assert {dict(key)["instance"] for key in matched} == {f"{POOL_NAME}-{i}" for i in range(INSTANCES)}
        assert matched == pytest.approx({key: value for key, value in p99.items()
                                         if dict(key)["instance"] != GONE}, rel=1e-9)
        # The ranking asks those left out over whichever parts they have: every instance, as the minutes give it.
        names = sorted(dict(key)["instance"] for key in p99)
        ranked = history._quantiles_at(POOL_NAME, start, at, 0.99, names.copy)
        assert ranked == pytest.approx({dict(key)["instance"]: value * 1000 for key, value in p99.items()}, rel=1e-9)
    assert kinds_seen == {"rolled", "blocks"}


def test_a_window_shorter_than_a_rolled_sum_reads_the_blocks(server):
    history, at = server
    span = history._summed_span(POOL_NAME, at - 20 * 3600, at)
    assert span is not None and span.rolled == () and {kind for kind, _, _ in span.pieces()} == {"blocks"}


def test_only_rolled_sums_over_one_run_of_blocks_are_read():
    blocks = np.array([1000.0 + BLOCK_S * k for k in range(ROLLED_BLOCKS + 3)])
    newest = float(blocks[-1])
    assert rolled_stamps(np.array([newest, newest - BLOCK_S]), blocks) == (newest - BLOCK_S, newest)
    # Before its first day of blocks a rolled sum holds fewer than ROLLED_BLOCKS; at a phase change, another
    # phase's block among them; a block missing in the middle: none of them is read.
    assert rolled_stamps(np.array([float(blocks[ROLLED_BLOCKS - 2])]), blocks) == ()
    assert rolled_stamps(np.array([newest]), np.append(blocks, newest - 5 * BLOCK_S + 420)) == ()
    assert rolled_stamps(np.array([newest]), np.delete(blocks, -7)) == ()
    # A span reads the rolled sum and the blocks it leaves: none folded into the edges here, since the three
    # blocks before it are more than FOLDED_BLOCKS.
    span = Span(0.0, newest, ((float(blocks[0]), newest),), (newest,))
    assert span.pieces() == [("blocks", float(blocks[0]), float(blocks[2])),
                             ("rolled", float(blocks[3]), newest)]
    assert [kind for kind, _ in span.parts()] == ["edge", "rolled", "blocks", "edge"]
    # With one block before it, that block's minutes are read with the head edge.
    span = Span(0.0, newest, ((float(blocks[2]), newest),), (newest,))
    assert [kind for kind, _ in span.parts()] == ["edge", "rolled", "edge"]
    assert span.parts()[-1][1] == f"[{promql._ms(float(blocks[3]) - BLOCK_LAG_S - BLOCK_S)}ms] @ " \
                                  f"{float(blocks[3]) - BLOCK_LAG_S - BLOCK_S:.3f}"
