"""Per-instance telemetry history, decoded once and kept in memory as per-sample differences.

Workers append cumulative ``Snapshot``s to one Redis stream per (tier, instance). Decoding 24 h of
them for 8 instances on every dashboard poll would cost far more than the 100 ms the live view
allows, so each process keeps, per stream, the differences it already decoded and on each read
fetches only entries newer than the last one it saw. Differences follow the snapshot contract: a new
``started_at`` (restart) begins a new run whose counts are all new; a counter that went down
without one is treated as reset (its new value is the difference), as Prometheus does.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

import numpy as np
import redis
from django.conf import settings

from controlplane.common.redis import get_redis, redis_unreachable
from relay_engine.core.telemetry import COUNTERS, N_BUCKETS, REFUSAL_REASONS, Snapshot
from relay_engine.core.wire import TELEMETRY_TIERS, PoolKeys

# Column layout of a difference row: counters, refusals by reason, latency buckets, latency sum.
COUNTER_COLUMN = {name: i for i, name in enumerate(COUNTERS)}
REFUSAL_OFFSET = len(COUNTERS)
REFUSAL_COLUMN = {name: REFUSAL_OFFSET + i for i, name in enumerate(REFUSAL_REASONS)}
BUCKET_OFFSET = REFUSAL_OFFSET + len(REFUSAL_REASONS)
SUM_COLUMN = BUCKET_OFFSET + N_BUCKETS
N_COLUMNS = SUM_COLUMN + 1
# Gauges, kept as sampled (not differenced).
GAUGES = ("hbm_bytes", "hbm_budget_bytes", "dram_bytes", "dram_budget_bytes", "applied_generation")
GAUGE_COLUMN = {name: i for i, name in enumerate(GAUGES)}

# How long newly appeared instances may stay unnoticed; a key scan per poll would be wasted work.
DISCOVERY_TTL_S = 5.0
# Entries fetched per stream per read; the workers cap streams far below this.
MAX_ENTRIES_PER_READ = 5000


def decode_snapshot(raw: str) -> tuple[float, float, list[float], list[float]]:
    """(ts, started_at, cumulative row, gauge row) of a stream entry, by the one decoder
    (``Snapshot.from_json``); ValueError when the entry breaks the contract."""
    snap = Snapshot.from_json(raw)
    row = [float(snap.counters.get(name, 0)) for name in COUNTERS]
    row += [float(snap.refusals.get(reason, 0)) for reason in REFUSAL_REASONS]
    row += [float(c) for c in snap.rank_latency.counts]
    row.append(snap.rank_latency.sum_ms)
    gauges = [float(getattr(snap, name)) for name in GAUGES]
    return snap.ts, snap.started_at, row, gauges


@dataclass
class InstanceHistory:
    """Differences of one instance's snapshots in one tier, oldest first."""

    instance: str
    step_s: int
    last_id: str = "-"
    prev_started_at: float | None = None
    prev_row: np.ndarray | None = None
    ts: np.ndarray = field(default_factory=lambda: np.zeros(0))
    deltas: np.ndarray = field(default_factory=lambda: np.zeros((0, N_COLUMNS)))
    # Running totals of ``deltas``: row i is the sum of rows before i (one more row than deltas), so
    # any time range sums as one subtraction, however many samples it spans.
    totals: np.ndarray = field(default_factory=lambda: np.zeros((1, N_COLUMNS)))
    gauges: np.ndarray = field(default_factory=lambda: np.zeros((0, len(GAUGES))))

    def extend(self, entries: list[tuple[str, dict]], keep_since: float) -> None:
        ts, started, rows, gauges = [], [], [], []
        for entry_id, fields in entries:
            self.last_id = entry_id
            try:
                sample = decode_snapshot(fields["d"])
            except (ValueError, KeyError):
                continue  # an off-contract entry costs one sample, never the chart
            ts.append(sample[0])
            started.append(sample[1])
            rows.append(sample[2])
            gauges.append(sample[3])
        if ts:
            self._append(np.array(ts), np.array(started), np.array(rows), np.array(gauges))
        if self.ts.size and self.ts[0] < keep_since:
            first = int(np.searchsorted(self.ts, keep_since))
            self.ts, self.deltas, self.gauges = self.ts[first:], self.deltas[first:], self.gauges[first:]
            self.totals = self.totals[first:]

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
        self.deltas = np.vstack([self.deltas, deltas])
        self.totals = np.vstack([self.totals, self.totals[-1] + np.cumsum(deltas, axis=0)])
        self.gauges = np.vstack([self.gauges, gauges])


class HistoryCache:
    """Every stream's InstanceHistory in this process, refreshed incrementally on read."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._histories: dict[tuple[str, str], InstanceHistory] = {}
        self._discovered: dict[tuple[str, str, str, str], tuple[float, list[str]]] = {}

    def clear(self) -> None:
        with self._lock:
            self._histories.clear()
            self._discovered.clear()

    def _instances(self, client: redis.Redis, url: str, keys: PoolKeys, tier: str, now: float) -> list[str]:
        cache_key = (url, keys.prefix, keys.pool, tier)
        found = self._discovered.get(cache_key)
        if found is not None and now - found[0] < DISCOVERY_TTL_S:
            return found[1]
        stem = keys.telemetry(tier, "")
        pattern = stem.replace("[", "\\[").replace("?", "\\?").replace("*", "\\*") + "*"
        names = sorted({key[len(stem):] for key in client.scan_iter(match=pattern, count=1000)})
        self._discovered[cache_key] = (now, names)
        return names

    def instances(self, *, pool: str, tier: str, now: float | None = None) -> list[str]:
        """Instances with a stream in ``tier`` (rediscovered every few seconds)."""
        client = get_redis()
        with self._lock:
            try:
                return self._instances(client, settings.REDIS_URL, PoolKeys(pool), tier,
                                       time.time() if now is None else now)
            except redis.RedisError as exc:
                raise redis_unreachable(exc) from exc

    def read(self, *, pool: str, tier: str, now: float | None = None) -> list[InstanceHistory]:
        """Every instance's history in ``tier``, brought up to date with Redis."""
        now = time.time() if now is None else now
        step_s, kept = TELEMETRY_TIERS[tier]
        keep_since = now - step_s * (kept + 2)
        keys = PoolKeys(pool)
        client = get_redis()
        url = settings.REDIS_URL
        with self._lock:
            try:
                names = self._instances(client, url, keys, tier, now)
                histories = []
                pipe = client.pipeline(transaction=False)
                for name in names:
                    history = self._histories.setdefault((url, keys.telemetry(tier, name)),
                                                         InstanceHistory(instance=name, step_s=step_s))
                    histories.append(history)
                    low = "-" if history.last_id == "-" else f"({history.last_id}"
                    pipe.xrange(keys.telemetry(tier, name), min=low, max="+", count=MAX_ENTRIES_PER_READ)
                results = pipe.execute() if names else []
            except redis.RedisError as exc:
                raise redis_unreachable(exc) from exc
            for history, entries in zip(histories, results, strict=True):
                history.extend(entries, keep_since)
            return histories


history_cache = HistoryCache()
