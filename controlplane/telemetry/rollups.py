"""The pool rollups, read: one hash per tier period holding the sum of every instance's counts.

Workers add to them as they publish (``relay_engine.core.telemetry.rollup_contribution``), so a pool
chart costs one small read per point whatever the pool's size. A period is settled once no write
can land in it any more (its end plus ``SETTLE_S``); settled periods are kept decoded in the bounded
cache, so a poll reads only the open ones.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import redis
from django.conf import settings

from relay_engine.core.telemetry import (
    COUNTERS,
    MAX_COUNT,
    MISS_REASONS,
    N_BUCKETS,
    REFUSAL_REASONS,
    ROLLUP_GAUGES,
    ROLLUP_INSTANCES_FIELD,
    ROLLUP_SUM_FIELD,
    rollup_bucket_field,
    rollup_miss_field,
    rollup_refusal_field,
)
from relay_engine.core.wire import TELEMETRY_TIERS, PoolKeys

from .cache import telemetry_cache
from .history import BUCKET_OFFSET, COUNTER_COLUMN, MISS_COLUMN, N_COLUMNS, REFUSAL_COLUMN, SUM_COLUMN

# Pool gauges per period: the sums over the instances that reported, and how many did.
POOL_GAUGES = (*ROLLUP_GAUGES, ROLLUP_INSTANCES_FIELD)
POOL_GAUGE_COLUMN = {name: i for i, name in enumerate(POOL_GAUGES)}
# A write lands in the period of its snapshot's time, within moments of it; past this margin after
# a period's end nothing more can arrive.
SETTLE_S = 10.0

_FIELD_COLUMN: dict[str, int] = {
    **{name: COUNTER_COLUMN[name] for name in COUNTERS},
    **{rollup_refusal_field(reason): REFUSAL_COLUMN[reason] for reason in REFUSAL_REASONS},
    **{rollup_miss_field(reason): MISS_COLUMN[reason] for reason in MISS_REASONS},
    **{rollup_bucket_field(i): BUCKET_OFFSET + i for i in range(N_BUCKETS)},
    ROLLUP_SUM_FIELD: SUM_COLUMN,
}


def decode_rollup(fields: dict[str, str]) -> tuple[np.ndarray, np.ndarray]:
    """(counts row [N_COLUMNS], gauges [POOL_GAUGES]) of a rollup hash. Redis is untrusted input:
    a field that is not a number in [0, ``MAX_COUNT``] is left out (it costs that figure one point,
    never the chart: sums over a window's periods stay finite); unknown fields (newer workers) are
    ignored."""
    row = np.zeros(N_COLUMNS)
    gauges = np.zeros(len(POOL_GAUGES))
    for name, raw in fields.items():
        column, target = _FIELD_COLUMN.get(name), row
        if column is None:
            column, target = POOL_GAUGE_COLUMN.get(name), gauges
            if column is None:
                continue
        try:
            value = float(raw)
        except (TypeError, ValueError):
            continue
        if 0 <= value <= MAX_COUNT:  # NaN is not
            target[column] = value
    return row, gauges


@dataclass
class PoolRollup:
    """The settled periods of one pool's rollup in one tier, decoded."""

    settled: dict[int, tuple[np.ndarray, np.ndarray]] = field(default_factory=dict)

    @property
    def nbytes(self) -> int:
        return len(self.settled) * (N_COLUMNS + len(POOL_GAUGES) + 4) * 8


def read_rollup(client: redis.Redis, *, pool: str, tier: str, start: int, n_periods: int,
                now: float) -> tuple[np.ndarray, np.ndarray]:
    """Counts [n_periods, N_COLUMNS] and gauges [n_periods, POOL_GAUGES] of the tier periods from
    ``start`` on. The caller holds ``telemetry_cache.lock``."""
    step_s, kept = TELEMETRY_TIERS[tier]
    keys = PoolKeys(pool)
    rollup = telemetry_cache.get(("rollup", settings.REDIS_URL, keys.base, tier), PoolRollup)
    periods = [start + i * step_s for i in range(n_periods)]
    missing = [p for p in periods if p not in rollup.settled]
    pipe = client.pipeline(transaction=False)
    for period in missing:
        pipe.hgetall(keys.rollup(tier, period))
    fetched = dict(zip(missing, (decode_rollup(f) for f in pipe.execute()), strict=True)) if missing else {}
    for period, decoded in fetched.items():
        if period + step_s + SETTLE_S <= now:
            rollup.settled[period] = decoded
    oldest = now - step_s * (kept + 2)
    for period in [p for p in rollup.settled if p < oldest]:
        del rollup.settled[period]
    rows = np.zeros((n_periods, N_COLUMNS))
    gauges = np.zeros((n_periods, len(POOL_GAUGES)))
    for i, period in enumerate(periods):
        rows[i], gauges[i] = rollup.settled.get(period) or fetched[period]
    return rows, gauges
