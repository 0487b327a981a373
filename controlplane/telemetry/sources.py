"""Where a telemetry read's history comes from: the one seam between the read side's figures and their store.

A ``HistorySource`` hands the selectors counts summed per chart point ([points, N_COLUMNS], the column
layout of ``history``) and gauges, whatever holds them; every figure is computed from those by one
code (``selectors``), so the two backends cannot drift apart in what a figure means.

- ``RedisHistory``: the tier streams and pool rollups. The embedded default, and always the live window
  (``LIVE_WINDOW_S``) and the canary bake.
- ``promql.PrometheusHistory``: PromQL over the series ``/metrics`` exports, for windows longer than the
  live one when ``PROMETHEUS_URL`` is set. The workers then write only the live tier
  (``RELAYGR_HISTORY=prometheus``), and nothing here reads a coarser one.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Protocol, TypeVar

import numpy as np
import redis
from django.conf import settings

from controlplane.common.redis import get_redis, redis_unreachable
from relay_engine.core.wire import HISTORY_TIERS, LIVE_TIER, TELEMETRY_TIERS, tier_kept

from .cache import telemetry_cache
from .history import N_COLUMNS, stream_histories
from .merge import bucketed, latency_counts, quantiles
from .promql import PrometheusHistory
from .recording import RECORDED_STEP_S
from .rollups import POOL_GAUGE_COLUMN, read_rollup
from .summaries import WindowTotals, window_totals

T = TypeVar("T")

# The live window where Prometheus holds the history: what the live tier then spans (6 min at 1 s,
# ``wire.tier_kept``). Longer windows are history, read from Prometheus. (Without Prometheus, Redis holds
# every tier and every window.)
LIVE_WINDOW_S = TELEMETRY_TIERS[LIVE_TIER][0] * tier_kept(LIVE_TIER, "prometheus")


def prometheus_holds_history() -> bool:
    return bool(settings.PROMETHEUS_URL)


def history_point_s(window_s: int) -> int:
    """The narrowest point a ``window_s`` window is read at (beside its tier's step): from Prometheus,
    the recording rules' minute. Its raw series cannot do narrower either: a point's ``increase()`` needs
    two scrapes in it, and at the shipped 15 s interval a 10 s point holds one at most."""
    return RECORDED_STEP_S if prometheus_holds_history() and window_s > LIVE_WINDOW_S else 1


def redis_tiers() -> tuple[str, ...]:
    """The tiers Redis holds: every one, or only the live one when Prometheus holds the history."""
    return HISTORY_TIERS["prometheus" if prometheus_holds_history() else "redis"]


class HistorySource(Protocol):
    def pool_points(self, *, pool: str, tier: str, start: float, step_s: int, n_points: int,
                    now: float) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The pool's counts [n_points, N_COLUMNS] summed over each point, its gauges [n_points, POOL_GAUGES]
        at the point's end (summed over the instances reporting; NaN where none), and its counts over the
        whole window [N_COLUMNS]."""

    def instance_points(self, *, pool: str, tier: str, instances: list[str], window_s: int, start: float,
                        step_s: int, n_points: int, now: float,
                        parts: frozenset[str] | None = None) -> list[tuple[np.ndarray, np.ndarray]]:
        """Per instance (in order): counts [n_points, N_COLUMNS] and gauges [n_points, GAUGES] (NaN where
        none). With ``parts`` (``promql.counts_query``'s ``column`` tags), only those counts need be read (the
        rest may read 0): what a figure shown needs."""

    def window_totals(self, *, pool: str, tier: str, window_s: int, start: float, now: float,
                      instances: list[str] | None = None, counters: tuple[str, ...] | None = None) -> WindowTotals:
        """Every instance that reported since ``start`` (or those of ``instances`` that did): its counts over
        [start, now], its newest gauges. With ``counters``, only those counters' columns need be counted
        (the rest may read 0): what a ranking by one figure needs of every instance."""

    def window_quantile(self, *, pool: str, tier: str, window_s: int, start: float, now: float,
                        q: float) -> tuple[list[str], np.ndarray]:
        """Every instance that reported since ``start`` (by name) and its latency quantile ``q`` in ms over
        [start, now], from its merged buckets (NaN where it counted none)."""

    def ahead(self, read: Callable[[], T]) -> Callable[[], T]:
        """``read`` started now, its answer given by the callable returned: in a thread of its own where the
        source's reads may overlap (a server that answers each on a core), or at once."""


def _per_point_gauges(gauges: np.ndarray, per_point: int, filled: np.ndarray) -> np.ndarray:
    """[periods, G] → [points, G]: the last period of each point that has data (NaN where none)."""
    n_points = gauges.shape[0] // per_point
    gauges = gauges.reshape(n_points, per_point, -1)
    filled = filled.reshape(n_points, per_point)
    last = per_point - 1 - np.argmax(filled[:, ::-1], axis=1)
    out = gauges[np.arange(n_points), last].astype(float)
    out[~filled.any(axis=1)] = np.nan
    return out


class RedisHistory:
    """The tier streams and pool rollups. Used under ``telemetry_cache.lock`` (``history_source``)."""

    def __init__(self, client: redis.Redis):
        self.client = client
        self._totals: dict[tuple, WindowTotals] = {}  # this read's, by window: a ranking and its rows share them

    def pool_points(self, *, pool, tier, start, step_s, n_points, now):
        per_point = step_s // TELEMETRY_TIERS[tier][0]
        rows, gauges = read_rollup(self.client, pool=pool, tier=tier, start=start, n_periods=n_points * per_point,
                                   now=now)
        reported = gauges[:, POOL_GAUGE_COLUMN["instances"]] > 0
        sums = rows.reshape(n_points, per_point, N_COLUMNS).sum(axis=1)
        return sums, _per_point_gauges(gauges, per_point, reported), sums.sum(axis=0)

    def instance_points(self, *, pool, tier, instances, window_s, start, step_s, n_points, now, parts=None):
        histories = stream_histories(self.client, pool=pool, tier=tier, instances=instances, window_s=window_s,
                                     now=now, point_s=step_s)
        return [bucketed(history, start, step_s, n_points) for history in histories]

    def window_totals(self, *, pool, tier, window_s, start, now, instances=None, counters=None):
        key = (pool, tier, window_s, start, now)
        if key not in self._totals:
            self._totals[key] = window_totals(self.client, pool=pool, tier=tier, window_s=window_s, start=start,
                                              now=now)
        totals = self._totals[key]
        return totals if instances is None else totals.of(instances)

    def window_quantile(self, *, pool, tier, window_s, start, now, q):
        totals = self.window_totals(pool=pool, tier=tier, window_s=window_s, start=start, now=now)
        return totals.names, quantiles(latency_counts(totals.sums), (q,))[0]

    def ahead(self, read):  # one window read under the cache lock: nothing to overlap
        answer = read()
        return lambda: answer


@contextmanager
def history_source(window_s: int) -> Iterator[HistorySource]:
    """The source of a read of a ``window_s`` window: Prometheus for history when there is one, else
    Redis (under the cache lock, its errors as 503s naming REDIS_URL); the cache trimmed after either."""
    if prometheus_holds_history() and window_s > LIVE_WINDOW_S:
        try:
            yield PrometheusHistory(settings.PROMETHEUS_URL, timeout_s=settings.PROMETHEUS_TIMEOUT_S)
        finally:
            telemetry_cache.trim()  # what it keeps (its quantiles) counts against the same budget
        return
    with telemetry_cache.lock:
        try:
            yield RedisHistory(get_redis())
        except redis.RedisError as exc:
            raise redis_unreachable(exc) from exc
        finally:
            telemetry_cache.trim()
