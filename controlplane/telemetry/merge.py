"""Time-bucketed merge of instance histories: sums of differences, quantiles from merged buckets.

Latency quantiles are taken only after adding bucket counts (across instances and across samples
within a time bucket), never by averaging per-instance percentiles.
"""

from __future__ import annotations

import numpy as np

from relay_engine.core.telemetry import LATENCY_BUCKETS_MS, N_BUCKETS

from .history import BUCKET_OFFSET, GAUGES, InstanceHistory

_UPPER = np.array(LATENCY_BUCKETS_MS + (LATENCY_BUCKETS_MS[-1],))
_LOWER = np.concatenate([[0.0], np.array(LATENCY_BUCKETS_MS)])


def quantiles(counts: np.ndarray, qs: tuple[float, ...]) -> list[np.ndarray]:
    """``relay_engine.core.telemetry.quantile_from_counts`` over the last axis of counts [..., N_BUCKETS],
    for each q; NaN where there are no counts."""
    shape = counts.shape[:-1]
    counts = counts.reshape(-1, counts.shape[-1])
    total = counts.sum(axis=1)
    cumulative = np.cumsum(counts, axis=1)
    rows = np.arange(counts.shape[0])
    out = []
    for q in qs:
        rank = q * total
        index = np.argmax(cumulative >= rank[:, None], axis=1)
        in_bucket = counts[rows, index]
        below = cumulative[rows, index] - in_bucket
        with np.errstate(invalid="ignore", divide="ignore"):
            value = _LOWER[index] + (_UPPER[index] - _LOWER[index]) * ((rank - below) / in_bucket)
        value = np.where(index >= len(LATENCY_BUCKETS_MS), LATENCY_BUCKETS_MS[-1], value)
        out.append(np.where(total > 0, value, np.nan).reshape(shape))
    return out


def latency_counts(deltas: np.ndarray) -> np.ndarray:
    return deltas[..., BUCKET_OFFSET:BUCKET_OFFSET + N_BUCKETS]


def bucketed(history: InstanceHistory, start: float, step_s: int, n_points: int) -> tuple[np.ndarray, np.ndarray]:
    """(sum of differences [n_points, N_COLUMNS], last gauges [n_points, len(GAUGES)], NaN where none)."""
    edges = np.searchsorted(history.ts, start + step_s * np.arange(n_points + 1))
    sums = history.totals[edges[1:]] - history.totals[edges[:-1]]
    gauges = np.full((n_points, len(GAUGES)), np.nan)
    filled = edges[1:] > edges[:-1]
    gauges[filled] = history.gauges[edges[1:][filled] - 1]  # the last sample in each bucket
    return sums, gauges
