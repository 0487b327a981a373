"""What the instances served during a bake, from the telemetry streams that already exist.

Each instance's cumulative snapshots are differenced as every telemetry reader does
(``telemetry.history.InstanceHistory``: restarts and resets handled), and only the differences of
samples taken after the bake started *while the instance ran the generation of its side* count (the
snapshot's ``applied_generation`` gauge, at both ends of the difference): a canary instance's
seconds on the stable revision are not the canary's, and a stable instance's are judged against the
stable revision only.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import redis

from controlplane.telemetry.history import (
    BUCKET_OFFSET,
    COUNTER_COLUMN,
    GAUGE_COLUMN,
    MAX_ENTRIES_PER_READ,
    N_COLUMNS,
    InstanceHistory,
    reporting_instances,
)
from controlplane.telemetry.sources import redis_tiers
from relay_engine.core.telemetry import N_BUCKETS, quantile_from_counts
from relay_engine.core.wire import TELEMETRY_TIERS, PoolKeys


@dataclass(frozen=True)
class Served:
    """Requests, bad requests and the latency histogram of a set of instances over the bake."""

    requests: int
    bad: int
    buckets: np.ndarray

    @property
    def p99_ms(self) -> float | None:
        return quantile_from_counts([int(c) for c in self.buckets], 0.99)


def _tier_for(span_s: float) -> str:
    """The finest telemetry tier Redis holds that still holds ``span_s`` seconds (and a baseline sample).
    Where Prometheus holds the history Redis has only the live tier: a longer bake is judged on its last
    ``LIVE_WINDOW_S``."""
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


def served(client: redis.Redis, *, pool: str, instances: list[str], generation: int, since: float,
           now: float) -> Served:
    """What ``instances`` served while running ``generation`` between ``since`` and ``now``."""
    keys = PoolKeys(pool)
    tier = _tier_for(now - since)
    row = np.zeros(N_COLUMNS)
    for instance in instances:
        row += _row_during(client, keys, tier, instance, generation, since)
    requests = int(row[COUNTER_COLUMN["rank_requests"]])
    within = int(row[COUNTER_COLUMN["rank_within_slo"]])
    return Served(requests=requests, bad=max(0, requests - within), buckets=row[BUCKET_OFFSET:BUCKET_OFFSET + N_BUCKETS])


def stable_instances(client: redis.Redis, *, pool: str, canary: list[str], since: float) -> list[str]:
    """The pool's instances that reported telemetry during the bake, less the canary ones."""
    return [name for name in reporting_instances(client, PoolKeys(pool), since) if name not in canary]
