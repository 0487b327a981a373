"""What the instances served during a bake, from the telemetry that already exists.

Each instance's cumulative snapshots are differenced as every telemetry reader does
(``telemetry.history.InstanceHistory``: restarts and resets handled), and only the differences of
samples taken after the bake started *while the instance ran the generation of its side* count (the
snapshot's ``applied_generation`` gauge, at both ends of the difference): a canary instance's
seconds on the stable revision are not the canary's, and a stable instance's are judged against the
stable revision only.

Where Prometheus holds the history (``PROMETHEUS_URL``; Redis then keeps only the live tier), a bake
longer than ``REDIS_SPAN_S`` is read in two parts: its last ``REDIS_SPAN_S`` or so from Redis, and
everything before from Prometheus (``promql.PrometheusHistory``: per instance, the counts of each
``PROMETHEUS_STEP_S`` point and the generation at its end, gated by the same rule), so a bake of any
length is judged on all of it. Prometheus unreachable: the bake is judged on what Redis holds, and
``Served.history`` says so.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import numpy as np
import redis
from django.conf import settings

from controlplane.common.errors import Unavailable
from controlplane.telemetry.history import (
    BUCKET_OFFSET,
    COUNTER_COLUMN,
    GAUGE_COLUMN,
    MAX_ENTRIES_PER_READ,
    N_COLUMNS,
    InstanceHistory,
    reporting_instances,
)
from controlplane.telemetry.promql import PrometheusHistory
from controlplane.telemetry.sources import LIVE_WINDOW_S, prometheus_holds_history, redis_tiers
from relay_engine.core.telemetry import GAUGES, MAX_COUNT, N_BUCKETS, quantile_from_counts
from relay_engine.core.wire import TELEMETRY_TIERS, PoolKeys

# Where Prometheus holds the history: how much of a bake's end Redis serves (well inside the live tier,
# whatever the scrape lag), and the width of the points read from Prometheus before it (four scrapes at
# the shipped 15 s interval: an increase() needs two samples in its point).
REDIS_SPAN_S = LIVE_WINDOW_S // 2
PROMETHEUS_STEP_S = 60
_GENERATION = GAUGES.index("applied_generation")


@dataclass(frozen=True)
class Served:
    """Requests, bad requests and the latency histogram of a set of instances over the bake."""

    requests: int
    bad: int
    buckets: np.ndarray
    # Where the figures came from: "redis", "prometheus+redis", or Redis alone with why not Prometheus.
    history: str = "redis"
    judged_since: float | None = None  # the start of what they cover, when not the bake's own

    @property
    def p99_ms(self) -> float | None:
        return quantile_from_counts([int(c) for c in self.buckets], 0.99)


def _tier_for(span_s: float) -> str:
    """The finest telemetry tier Redis holds that still holds ``span_s`` seconds (and a baseline sample).
    Where Prometheus holds the history Redis has only the live tier (``served`` reads a bake's start from
    Prometheus)."""
    held = sorted(redis_tiers(), key=lambda tier: TELEMETRY_TIERS[tier][0])
    for tier in held:
        every_s, kept = TELEMETRY_TIERS[tier]
        if every_s * kept >= span_s + 2 * every_s:
            return tier
    return held[-1]


def _row_during(client: redis.Redis, keys: PoolKeys, tier: str, instance: str, generation: int,
                since: float) -> np.ndarray:
    every_s = TELEMETRY_TIERS[tier][0]
    entries = client.xrange(keys.telemetry(tier, instance), min=str(int((since - 2 * every_s) * 1000)), max="+",
                            count=MAX_ENTRIES_PER_READ)
    history = InstanceHistory(instance=instance, step_s=every_s)
    history.extend(entries, keep_since=since - 2 * every_s)
    if not history.ts.size:
        return np.zeros(N_COLUMNS)
    # A difference covers the interval since the sample before: it counts only when the instance ran the
    # generation at both ends (requests in flight across a change of revision belong to neither side).
    running = history.gauges[:, GAUGE_COLUMN["applied_generation"]] == generation
    before = np.concatenate([running[:1], running[:-1]])
    counted = (history.ts > since) & running & before
    return history.deltas[counted].sum(axis=0)


@dataclass
class _Read:
    """The Prometheus points of one bake side read so far: how many, their counts, and whether each
    instance ran the generation at the last one's end (the next point's start)."""

    n_points: int
    row: np.ndarray
    running_at_end: dict[str, bool]


# The points each bake has read, kept between its evaluation ticks: they end ``REDIS_SPAN_S`` before
# now, settled, so a tick reads only the points added since the last, not the whole bake again (for the
# stable side of a 256-instance pool the whole read is ~1 s; the bake re-evaluates every few seconds).
_reads: dict[tuple, _Read] = {}
_reads_lock = threading.Lock()
MAX_READS_KEPT = 64  # bake sides at once, far more than a control plane runs


def forget_reads() -> None:
    """Read every bake's points again on its next tick (tests; Prometheus's data replaced under it)."""
    with _reads_lock:
        _reads.clear()


def _prometheus_during(*, pool: str, instances: list[str], generation: int, since: float,
                       n_points: int) -> np.ndarray:
    """The counts of ``n_points`` Prometheus points from ``since``, summed over the points at whose both
    ends the instance ran ``generation`` (the first point's start taken as its end, as in Redis); the
    points read at an earlier tick of the same bake are not read again."""
    key = (settings.PROMETHEUS_URL, pool, tuple(instances), generation, since)
    with _reads_lock:
        held = _reads.get(key)
    if held is not None and held.n_points == n_points:
        return held.row.copy()
    done = held.n_points if held is not None and held.n_points < n_points else 0
    row = held.row.copy() if done else np.zeros(N_COLUMNS)
    running_at_end = dict(held.running_at_end) if done else {}
    source = PrometheusHistory(settings.PROMETHEUS_URL, timeout_s=settings.PROMETHEUS_TIMEOUT_S)
    start, new = since + done * PROMETHEUS_STEP_S, n_points - done
    span_s = new * PROMETHEUS_STEP_S
    points = source.instance_points(pool=pool, tier="", instances=instances, window_s=span_s, start=start,
                                    step_s=PROMETHEUS_STEP_S, n_points=new, now=start + span_s)
    for name, (rows, gauges) in zip(instances, points, strict=True):
        running = gauges[:, _GENERATION] == generation  # NaN (no sample in the point) never equals
        first = running_at_end.get(name, bool(running[0])) if done else bool(running[0])
        before = np.concatenate([[first], running[:-1]])
        row += rows[running & before].sum(axis=0)
        running_at_end[name] = bool(running[-1])
    with _reads_lock:
        _reads.pop(key, None)
        _reads[key] = _Read(n_points, row.copy(), running_at_end)
        while len(_reads) > MAX_READS_KEPT:
            del _reads[next(iter(_reads))]
    return row


def served(client: redis.Redis, *, pool: str, instances: list[str], generation: int, since: float,
           now: float) -> Served:
    """What ``instances`` served while running ``generation`` between ``since`` and ``now``."""
    keys = PoolKeys(pool)
    row = np.zeros(N_COLUMNS)
    history, redis_since, judged_since = "redis", since, None
    n_points = int((now - since - REDIS_SPAN_S) // PROMETHEUS_STEP_S) if prometheus_holds_history() else 0
    if n_points > 0 and instances:
        try:
            row += _prometheus_during(pool=pool, instances=instances, generation=generation, since=since,
                                      n_points=n_points)
            history, redis_since = "prometheus+redis", since + n_points * PROMETHEUS_STEP_S
        except Unavailable as exc:
            history = f"redis: {exc.detail}"
            redis_since = judged_since = max(since, now - LIVE_WINDOW_S + 2 * TELEMETRY_TIERS[redis_tiers()[0]][0])
    tier = _tier_for(now - redis_since)
    for instance in instances:
        row += _row_during(client, keys, tier, instance, generation, redis_since)
    # Each difference is at most MAX_COUNT, but hostile snapshots' differences can sum past it (a count a
    # float no longer holds exactly): held at the most a count can be.
    np.clip(row, 0, MAX_COUNT, out=row)
    requests = int(row[COUNTER_COLUMN["rank_requests"]])
    within = int(row[COUNTER_COLUMN["rank_within_slo"]])
    return Served(requests=requests, bad=max(0, requests - within), buckets=row[BUCKET_OFFSET:BUCKET_OFFSET + N_BUCKETS],
                  history=history, judged_since=judged_since)


def stable_instances(client: redis.Redis, *, pool: str, canary: list[str], since: float) -> list[str]:
    """The pool's instances that reported telemetry during the bake, less the canary ones."""
    return [name for name in reporting_instances(client, PoolKeys(pool), since) if name not in canary]
