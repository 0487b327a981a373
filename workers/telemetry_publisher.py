"""Telemetry publisher: the instance's cumulative ``Snapshot`` into the tier streams, every second.

Each tier the instance writes (every one of ``wire.TELEMETRY_TIERS``, or the live one only when
Prometheus holds the history: ``RELAYGR_HISTORY``, ``wire.HISTORY_TIERS``) gets a snapshot when the wall clock enters a new period of
that tier (1 s, 10 s, 60 s), appended with ``XADD … MAXLEN = kept count`` (exact trimming: at one
append per second its cost is nil, and the bound is then exact). Each stream also gets a TTL of
its window, so the streams of an instance that is gone for good disappear with their data.

Every 30 s (and at once when its first forwards are there) it also appends its cumulative forward
times (``forward_times.ForwardTimesRecord``) to a stream of their own: what previews fit the pool's
cost model from.

The same write adds the instance's counts since its previous write of that tier to the pool's
rollup hash of the period (``telemetry.rollup_contribution``, one atomic script call), so pool views
read one hash per point however many instances report; and it stamps the instance in the pool's
``reporting`` set, which readers use instead of scanning keys. Counts of a write that failed are
carried into the next one (the previous snapshot advances only when Redis took the write).
"""

from __future__ import annotations

import threading
import time
from collections import Counter

import redis

from relay_engine.core.engine import RelayEngine
from relay_engine.core.forward_times import ForwardTimes, ForwardTimesRecord
from relay_engine.core.telemetry import (
    COUNTERS,
    REFUSAL_REASONS,
    ROLLUP_SUM_FIELD,
    Snapshot,
    rollup_contribution,
)
from relay_engine.core.wire import (
    FORWARD_TIMES_COARSE_EVERY_S,
    FORWARD_TIMES_COARSE_KEPT,
    FORWARD_TIMES_EVERY_S,
    FORWARD_TIMES_KEPT,
    HISTORY_TIERS,
    TELEMETRY_RETENTION_S,
    TELEMETRY_TIERS,
    PoolKeys,
    rollup_period,
    tier_kept,
)
from workers.membership import StatusBoard

# KEYS[1]: a rollup hash; ARGV[1]: its TTL (s); then field, value pairs. One call adds them all
# atomically (HINCRBY, HINCRBYFLOAT for the latency sum) and renews the TTL.
_ROLLUP_ADD = f"""
for i = 2, #ARGV, 2 do
  if ARGV[i] == "{ROLLUP_SUM_FIELD}" then
    redis.call("HINCRBYFLOAT", KEYS[1], ARGV[i], ARGV[i + 1])
  else
    redis.call("HINCRBY", KEYS[1], ARGV[i], ARGV[i + 1])
  end
end
redis.call("EXPIRE", KEYS[1], ARGV[1])
return 1
"""


class WorkerCounts:
    """Counts the worker makes around the engine (requests that never reached it), by the shared
    names of ``relay_engine.core.telemetry`` so readers merge them with the engine's own."""

    def __init__(self) -> None:
        self._counters: Counter[str] = Counter()
        self._refusals: Counter[str] = Counter()
        self._lock = threading.Lock()

    def count(self, *names: str, refusal: str | None = None) -> None:
        unknown = [n for n in names if n not in COUNTERS] + \
            ([refusal] if refusal is not None and refusal not in REFUSAL_REASONS else [])
        if unknown:
            raise ValueError(f"not telemetry names: {unknown}")
        with self._lock:
            self._counters.update(names)
            if refusal is not None:
                self._refusals[refusal] += 1

    def added_to(self, counters: dict[str, int], refusals: dict[str, int]) -> tuple[dict[str, int], dict[str, int]]:
        with self._lock:
            return ({k: v + self._counters.get(k, 0) for k, v in counters.items()},
                    {k: v + self._refusals.get(k, 0) for k, v in refusals.items()})


class TelemetryWriter:
    """Writes an instance's snapshots: the tier streams, the pool rollups and the reporting set."""

    def __init__(self, client: redis.Redis, keys: PoolKeys, history: str = "redis"):
        self.client = client
        self.keys = keys
        self.history = history  # what the streams keep (``wire.tier_kept``)
        self._rolled: dict[str, Snapshot] = {}  # per tier: the snapshot its rollup counts run up to

    def write(self, snapshot: Snapshot, tiers: list[str]) -> None:
        """Append ``snapshot`` to each tier's stream and add its counts to the tier's pool rollup."""
        data = snapshot.to_entry()
        pipe = self.client.pipeline(transaction=False)
        for tier in tiers:
            every_s, kept = TELEMETRY_TIERS[tier][0], tier_kept(tier, self.history)
            key = self.keys.telemetry(tier, snapshot.instance)
            pipe.xadd(key, {"d": data}, maxlen=kept, approximate=False)
            pipe.expire(key, every_s * kept)
            added = rollup_contribution(snapshot, self._rolled.get(tier))
            # EVAL, not EVALSHA: one round trip, no NOSCRIPT retry (Redis caches the compiled script).
            pipe.eval(_ROLLUP_ADD, 1, self.keys.rollup(tier, rollup_period(tier, snapshot.ts)), every_s * kept,
                      *(item for pair in added.items() for item in pair))
        pipe.zadd(self.keys.reporting, {snapshot.instance: snapshot.ts})
        pipe.zremrangebyscore(self.keys.reporting, "-inf", snapshot.ts - TELEMETRY_RETENTION_S)
        pipe.execute()
        for tier in tiers:
            self._rolled[tier] = snapshot


class TelemetryPublisher:
    def __init__(self, engine: RelayEngine, client: redis.Redis, keys: PoolKeys, board: StatusBoard,
                 counts: WorkerCounts, started_at: float, tiers: tuple[str, ...] = tuple(TELEMETRY_TIERS)):
        self.engine = engine
        self.tiers = tiers
        self.client = client
        self.keys = keys
        self.board = board
        self.counts = counts
        self.started_at = started_at
        self._last_period: dict[str, int] = {}
        self._last_forwards: int | None = None
        self._last_coarse_forwards: int | None = None
        self._forwards_published = False
        self.writer = TelemetryWriter(client, keys, "prometheus" if tuple(tiers) == HISTORY_TIERS["prometheus"]
                                      else "redis")

    def snapshot(self, now: float) -> Snapshot:
        return self._snapshot(now, self.engine.stats())

    def _snapshot(self, now: float, stats) -> Snapshot:
        counters, refusals = self.counts.added_to(stats.counters, stats.refusals)
        return Snapshot(
            instance=self.engine.name, ts=now, started_at=self.started_at, counters=counters,
            refusals=refusals, rank_latency=stats.rank_latency, hbm_bytes=stats.hbm_bytes,
            hbm_budget_bytes=stats.hbm_budget_bytes,
            applied_generation=self.board.current().applied_generation,
            slo_ms=self.engine.policy.trigger.ranking_p99_slo_ms,
            tiers={name: figures.to_dict() for name, figures in stats.tiers.items()},
            misses=dict(stats.misses),
        )

    def publish(self) -> list[str]:
        """Append a snapshot to every tier whose period has turned; returns those tiers."""
        now = time.time()
        due = [tier for tier in self.tiers if self._last_period.get(tier) != int(now // TELEMETRY_TIERS[tier][0])]
        if not due:
            return []
        stats = self.engine.stats()
        snapshot = self._snapshot(now, stats)
        self.writer.write(snapshot, due)
        for tier in due:
            self._last_period[tier] = int(now // TELEMETRY_TIERS[tier][0])
        # Every FORWARD_TIMES_EVERY_S, and at once when the first forwards are there (a new instance's
        # times are not half a minute late); copied only then, not with every snapshot.
        period_turned = self._last_forwards != int(now // FORWARD_TIMES_EVERY_S)
        if self.engine.forward_clock != "none" and (period_turned or not self._forwards_published):
            times = self.engine.forward_times.copy()
            if period_turned or times.count:
                self._write_forward_times(now, stats, times)
        return due

    def _write_forward_times(self, now: float, stats, times: ForwardTimes) -> None:
        record = ForwardTimesRecord(instance=self.engine.name, ts=now, started_at=self.started_at,
                                    device=stats.device, model_version=stats.model_version,
                                    clock=self.engine.forward_clock, times=times)
        entry = record.to_entry()
        pipe = self.client.pipeline(transaction=False)
        streams = [(False, FORWARD_TIMES_EVERY_S, FORWARD_TIMES_KEPT)]
        coarse_period = int(now // FORWARD_TIMES_COARSE_EVERY_S)
        if self._last_coarse_forwards != coarse_period:  # the long stream: once a period, the first record in it
            streams.append((True, FORWARD_TIMES_COARSE_EVERY_S, FORWARD_TIMES_COARSE_KEPT))
        for coarse, every_s, kept in streams:
            key = self.keys.forward_times(self.engine.name, coarse=coarse)
            pipe.xadd(key, entry, maxlen=kept, approximate=False)
            pipe.expire(key, every_s * (kept + 1))
        pipe.execute()
        self._last_forwards = int(now // FORWARD_TIMES_EVERY_S)
        self._last_coarse_forwards = coarse_period
        self._forwards_published = times.count > 0
