"""Per-instance telemetry history, decoded once and kept in memory as running totals of differences.

Workers append cumulative ``Snapshot``s to one Redis stream per (tier, instance). The per-instance
detail of a pool view (its worst instances, a drill-down) reads those streams, so each web process
keeps the decoded histories it drew last in its bounded cache (``cache.telemetry_cache``) and on
each read fetches only entries newer than the last one it saw. Differences follow the snapshot
contract: a new ``started_at`` (restart) begins a new run whose counts are all new; a counter that
went down without one is treated as reset (its new value is the difference), as Prometheus does.
Pool-wide figures never come from here: they are the pool rollups (``rollups.py``).
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass, field

import numpy as np
import redis
from django.conf import settings

from controlplane.common.redis import get_redis, redis_unreachable
from relay_engine.core.telemetry import (
    COUNTERS,
    GAUGES,
    MAX_COUNT,
    MISS_REASONS,
    N_BUCKETS,
    REFUSAL_REASONS,
    Snapshot,
    entry_json,
    gauges_of,
)
from relay_engine.core.wire import TELEMETRY_TIERS, PoolKeys

from .cache import telemetry_cache

# Column layout of a difference row: counters, refusals by reason, misses by reason, latency buckets,
# latency sum.
COUNTER_COLUMN = {name: i for i, name in enumerate(COUNTERS)}
REFUSAL_OFFSET = len(COUNTERS)
REFUSAL_COLUMN = {name: REFUSAL_OFFSET + i for i, name in enumerate(REFUSAL_REASONS)}
MISS_OFFSET = REFUSAL_OFFSET + len(REFUSAL_REASONS)
MISS_COLUMN = {name: MISS_OFFSET + i for i, name in enumerate(MISS_REASONS)}
BUCKET_OFFSET = MISS_OFFSET + len(MISS_REASONS)
SUM_COLUMN = BUCKET_OFFSET + N_BUCKETS
N_COLUMNS = SUM_COLUMN + 1
# Gauges (the core's list), kept as sampled (not differenced).
GAUGE_COLUMN = {name: i for i, name in enumerate(GAUGES)}

# Entries fetched per stream per read; the workers cap streams far below this.
MAX_ENTRIES_PER_READ = 5000


_PLAIN_NUMBERS = frozenset((int, float))
_NO_MISSES: dict[str, int] = {}


def _fast_values(raw: str) -> np.ndarray | None:
    """[row, gauges, ts, started_at] of an entry written as workers write it (packed or plain JSON, plain
    numbers, bucket indices in range, counts and gauges in [0, ``MAX_COUNT``]), checked all at once; None
    for anything else."""
    try:
        data = json.loads(entry_json(raw))
        counters, refusals, latency = data["counters"], data["refusals"], data["rank_latency"]
        misses = data.get("misses", _NO_MISSES)  # absent before miss reasons: none counted
        values = [counters.get(name, 0) for name in COUNTERS]
        values += [refusals.get(reason, 0) for reason in REFUSAL_REASONS]
        values += [misses.get(reason, 0) for reason in MISS_REASONS]
        buckets = [0] * N_BUCKETS
        for key, count in latency["buckets"].items():
            index = int(key)
            if not 0 <= index < N_BUCKETS or str(index) != key:
                return None
            buckets[index] = count
        values += buckets
        values.append(latency.get("sum_ms", 0.0))
        values += gauges_of(data.get("tiers") or {}, lambda name: data.get(name, 0))
        values += [data["ts"], data.get("started_at", 0.0)]
        if "instance" not in data or not _PLAIN_NUMBERS.issuperset(map(type, values)):
            return None
        array = np.array(values, dtype=float)
    except (ValueError, KeyError, TypeError, AttributeError, OverflowError, RecursionError):
        return None
    counts = array[:-2]
    return array if np.isfinite(array).all() and (counts >= 0).all() and (counts <= MAX_COUNT).all() else None


def _decoded(fields: dict) -> tuple[float, float, np.ndarray, np.ndarray] | None:
    """A stream entry's sample, or None when it breaks the contract (it costs one sample, never the
    chart)."""
    try:
        return decode_snapshot(fields["d"])
    except (ValueError, KeyError):
        return None


def decode_snapshot(raw: str) -> tuple[float, float, np.ndarray, np.ndarray]:
    """(ts, started_at, cumulative row, gauge row) of a stream entry; ValueError when the entry
    breaks the contract. What workers write takes a fast path; anything else is judged by the one
    decoder, ``Snapshot.from_entry``, which accepts it or names the field."""
    values = _fast_values(raw)
    if values is not None:
        return float(values[-2]), float(values[-1]), values[:N_COLUMNS], values[N_COLUMNS:N_COLUMNS + len(GAUGES)]
    snap = Snapshot.from_entry(raw)
    row = [float(snap.counters.get(name, 0)) for name in COUNTERS]
    row += [float(snap.refusals.get(reason, 0)) for reason in REFUSAL_REASONS]
    row += [float(snap.misses.get(reason, 0)) for reason in MISS_REASONS]
    row += [float(c) for c in snap.rank_latency.counts]
    row.append(snap.rank_latency.sum_ms)
    gauges = [float(value) for value in snap.gauges().values()]
    return snap.ts, snap.started_at, np.array(row), np.array(gauges)


@dataclass
class InstanceHistory:
    """Differences of one instance's snapshots in one tier, oldest first."""

    instance: str
    step_s: int
    last_id: str = "-"
    prev_started_at: float | None = None
    prev_row: np.ndarray | None = None
    ts: np.ndarray = field(default_factory=lambda: np.zeros(0))
    # Running totals of the differences: row i is the sum of the differences before sample i (one
    # row more than samples), so any time range sums as one subtraction, however many it spans.
    totals: np.ndarray = field(default_factory=lambda: np.zeros((1, N_COLUMNS)))
    gauges: np.ndarray = field(default_factory=lambda: np.zeros((0, len(GAUGES))))

    @property
    def deltas(self) -> np.ndarray:
        """Per-sample differences [samples, N_COLUMNS]."""
        return np.diff(self.totals, axis=0)

    @property
    def nbytes(self) -> int:
        return self.ts.nbytes + self.totals.nbytes + self.gauges.nbytes + \
            (0 if self.prev_row is None else self.prev_row.nbytes)

    def extend(self, entries: list[tuple[str, dict]], keep_since: float, point_s: int | None = None) -> None:
        """Add stream entries (oldest first) and drop samples older than ``keep_since``.

        With ``point_s`` (the width of a chart's points, a multiple of the tier's step) only the last
        entry of each point is decoded: snapshots are cumulative, so the differences between the
        points' last samples are the points' sums. Where two of those belong to different runs (a
        restart) or an entry's time and its stream id disagree on the point, every entry between
        them is decoded, so no count is lost."""
        if not entries:
            return
        self.last_id = entries[-1][0]
        if point_s and point_s > self.step_s:
            samples = self._last_of_each_point(entries, point_s)
        else:
            samples = [s for s in (_decoded(fields) for _, fields in entries) if s is not None]
        if samples:
            self._append(*(np.array(column) for column in zip(*samples, strict=True)))
        if self.ts.size and self.ts[0] < keep_since:
            first = int(np.searchsorted(self.ts, keep_since))
            self.ts, self.gauges, self.totals = self.ts[first:], self.gauges[first:], self.totals[first:]

    def _last_of_each_point(self, entries: list[tuple[str, dict]], point_s: int) -> list[tuple]:
        points = [int(entry_id.split("-", 1)[0]) // (point_s * 1000) for entry_id, _ in entries]
        samples, done, run = [], 0, self.prev_started_at
        if self.prev_row is None:  # the very first sample is the baseline of every difference after it
            first = _decoded(entries[0][1])
            samples, done, run = ([first], 1, first[1]) if first is not None else ([], 1, run)
        for i, point in enumerate(points):
            if i < done or (i + 1 < len(points) and points[i + 1] == point):
                continue  # the baseline, or not the last of its point
            sample = _decoded(entries[i][1])
            if sample is None or int(sample[0] // point_s) != point or (run is not None and sample[1] != run):
                between = (_decoded(fields) for _, fields in entries[done:i + 1])
                samples.extend(s for s in between if s is not None)
            else:
                samples.append(sample)
            done = i + 1
            run = samples[-1][1] if samples else run
        return samples

    def _append(self, ts: np.ndarray, started: np.ndarray, rows: np.ndarray, gauges: np.ndarray) -> None:
        if self.prev_row is None:
            # No earlier sample: the first one's counts are new only if its run began within one interval.
            prev_rows = np.vstack([np.zeros((1, N_COLUMNS)), rows[:-1]])
            prev_started = np.concatenate([[started[0]], started[:-1]])
            first_is_baseline = ts[0] - started[0] > 2 * self.step_s
        else:
            prev_rows = np.vstack([self.prev_row[None, :], rows[:-1]])
            prev_started = np.concatenate([[self.prev_started_at], started[:-1]])
            first_is_baseline = False
        deltas = rows - prev_rows
        # A new run (started_at changed): all its counts are new. A counter that went down
        # without one was reset: its new value is the difference.
        new_run = started != prev_started
        deltas[new_run] = rows[new_run]
        reset = deltas < 0
        deltas[reset] = rows[reset]
        if first_is_baseline:
            deltas[0] = 0.0
        self.prev_row, self.prev_started_at = rows[-1], float(started[-1])
        self.ts = np.concatenate([self.ts, ts])
        self.totals = np.vstack([self.totals, self.totals[-1] + np.cumsum(deltas, axis=0)])
        self.gauges = np.vstack([self.gauges, gauges])


def reporting_instances(client: redis.Redis, keys: PoolKeys, since: float) -> list[str]:
    """Instances that published telemetry at or after ``since``, sorted by name (the pool's
    ``reporting`` set: one read, however many keys Redis holds)."""
    return sorted(client.zrangebyscore(keys.reporting, since, "+inf"))


def stream_histories(client: redis.Redis, *, pool: str, tier: str, instances: list[str], window_s: int,
                     now: float, point_s: int | None = None) -> list[InstanceHistory]:
    """The histories of ``instances`` in ``tier`` over the last ``window_s`` (and a sample or two
    before, the first difference's baseline), brought up to date with Redis: only entries newer than
    each one's last are fetched, and with ``point_s`` only the last of each chart point is decoded
    (``InstanceHistory.extend``). The caller holds ``telemetry_cache.lock``."""
    step_s = TELEMETRY_TIERS[tier][0]
    keep_since = now - window_s - 2 * step_s
    keys = PoolKeys(pool)
    url = settings.REDIS_URL
    histories = [telemetry_cache.get(("stream", url, keys.telemetry(tier, name), window_s),
                                     lambda name=name: InstanceHistory(instance=name, step_s=step_s))
                 for name in instances]
    pipe = client.pipeline(transaction=False)
    for name, history in zip(instances, histories, strict=True):
        low = str(int(keep_since * 1000)) if history.last_id == "-" else f"({history.last_id}"
        pipe.xrange(keys.telemetry(tier, name), min=low, max="+", count=MAX_ENTRIES_PER_READ)
    for history, entries in zip(histories, pipe.execute() if instances else [], strict=True):
        history.extend(entries, keep_since, point_s)
    return histories


def redis_reads(function):
    """A read of telemetry under the cache lock, with Redis errors as 503s and the cache trimmed after."""

    @functools.wraps(function)
    def read(*args, **kwargs):
        with telemetry_cache.lock:
            try:
                return function(get_redis(), *args, **kwargs)
            except redis.RedisError as exc:
                raise redis_unreachable(exc) from exc
            finally:
                telemetry_cache.trim()

    return read
