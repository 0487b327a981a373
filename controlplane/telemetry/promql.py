"""The telemetry history from Prometheus: PromQL over the series ``/metrics`` exports (``prometheus.py``).

Every read is one HTTP request: the counts of every column of ``history``'s layout (counters, refusals
and misses by reason, latency buckets summed by ``le`` across the instances, the latency sum), each
``increase()`` over one chart point, written as one PromQL expression whose parts a ``column`` label
tells apart. ``/api/v1/query_range`` with the point's width as its step gives a series;
``/api/v1/query`` over the whole window gives its totals. The selectors compute every figure from those
counts as they do from Redis (quantiles from the summed buckets, as ``histogram_quantile`` does), so the
answer is the same either way. Prometheus is untrusted input, as Redis is: a value that is not a finite
count in range costs its figure that point, never the chart; unreachable, or an answer that is not one,
is a 503 naming PROMETHEUS_URL.
"""

from __future__ import annotations

import json
import math
import urllib.error
import urllib.parse
import urllib.request

import numpy as np

from controlplane.common.errors import Unavailable
from relay_engine.core.telemetry import (
    COUNTERS,
    GAUGES,
    LATENCY_BUCKETS_MS,
    MAX_COUNT,
    TIER_LEVEL_GAUGES,
)

from .history import BUCKET_OFFSET, COUNTER_COLUMN, MISS_COLUMN, N_COLUMNS, REFUSAL_COLUMN, SUM_COLUMN
from .rollups import POOL_GAUGE_COLUMN, POOL_GAUGES
from .summaries import WindowTotals

# A bucket's upper bound (seconds, as Prometheus's ``le`` reads) → its index; +Inf is the last.
_BUCKET_OF_LE = {bound / 1000.0: i for i, bound in enumerate(LATENCY_BUCKETS_MS)} | {math.inf: len(LATENCY_BUCKETS_MS)}
_GAUGE_COLUMN = {name: i for i, name in enumerate(GAUGES)}
_PRESENT = "present"  # how many instances had a sample in the point (a pool's ``instances``)


def _label(value: str) -> str:
    return json.dumps(value)  # a PromQL string literal: Go's escapes are JSON's


def _tagged(expr: str, column: str) -> str:
    return f'label_replace({expr}, "column", {_label(column)}, "", "")'


def counts_query(selector: str, by: tuple[str, ...], range_s: int) -> str:
    """Every count of ``history``'s layout over the ``range_s`` before each evaluation, summed by ``by``."""
    def summed(metric: str, extra: tuple[str, ...] = ()) -> str:
        return f"sum by ({', '.join((*by, *extra))}) (increase({metric}{{{selector}}}[{range_s}s]))"

    parts = [_tagged(summed(f"relaygr_{name}_total"), f"counter:{name}") for name in COUNTERS]
    parts.append(_tagged(summed("relaygr_preinfer_refusals_total", ("reason",)), "refused"))
    parts.append(_tagged(summed("relaygr_rank_misses_total", ("reason",)), "missed"))
    parts.append(_tagged(summed("relaygr_rank_latency_seconds_bucket", ("le",)), "bucket"))
    parts.append(_tagged(summed("relaygr_rank_latency_seconds_sum"), "sum"))
    return " or ".join(parts)


def gauges_query(selector: str, by: tuple[str, ...], range_s: int) -> str:
    """Each tier level's newest value within ``range_s`` (summed by ``by``), the applied generation, and how
    many instances had a sample (``present``)."""
    group = ", ".join(by)
    levels = sorted({level for _, level in TIER_LEVEL_GAUGES.values()})
    parts = [_tagged(f"sum by ({group}, tier) (last_over_time(relaygr_tier_{level}{{{selector}}}[{range_s}s]))",
                     f"level:{level}") for level in levels]
    parts.append(_tagged(f"max by ({group}) (last_over_time(relaygr_instance_applied_generation{{{selector}}}"
                         f"[{range_s}s]))", "gauge:applied_generation"))
    parts.append(_tagged(f"count by ({group}) (last_over_time(relaygr_rank_requests_total{{{selector}}}"
                         f"[{range_s}s]))", _PRESENT))
    return " or ".join(parts)


def _count(raw) -> float | None:
    try:
        value = float(raw)
    except (TypeError, ValueError):
        return None
    return value if 0 <= value <= MAX_COUNT else None  # NaN is not


def _cell_of_counts(labels: dict) -> int | None:
    """The column of ``history``'s layout one series of ``counts_query`` fills (a bucket's is its
    cumulative count's, differenced after), or None for one this code does not know."""
    column = labels.get("column", "")
    if column.startswith("counter:"):
        return COUNTER_COLUMN.get(column.removeprefix("counter:"))
    if column == "refused":
        return REFUSAL_COLUMN.get(labels.get("reason"))
    if column == "missed":
        return MISS_COLUMN.get(labels.get("reason"))
    if column == "sum":
        return SUM_COLUMN
    if column == "bucket":
        try:
            index = _BUCKET_OF_LE.get(float(labels.get("le", "")))
        except ValueError:
            return None
        return None if index is None else BUCKET_OFFSET + index
    return None


def _fill_counts(rows: np.ndarray, series: list[tuple[dict, list[tuple[int, object]]]]) -> None:
    """Counts of ``counts_query`` into rows [..., N_COLUMNS]: the latency sum in ms, the buckets from
    cumulative to each one's own (``history``'s layout)."""
    for labels, values in series:
        column = _cell_of_counts(labels)
        if column is None:
            continue
        for index, raw in values:
            value = _count(raw)
            if value is not None:
                rows[index, column] = value * 1000.0 if column == SUM_COLUMN else value
    buckets = rows[..., BUCKET_OFFSET:SUM_COLUMN]
    # Cumulative counts from increase() are each extrapolated on their own: a bucket never counts below 0.
    buckets[..., 1:] = np.maximum(np.diff(buckets, axis=-1), 0.0)


class PrometheusHistory:
    """Reads of one Prometheus server's HTTP API, each under ``timeout_s``."""

    def __init__(self, url: str, *, timeout_s: float):
        self.url = url
        self.timeout_s = timeout_s

    def _get(self, path: str, **params: str) -> list[dict]:
        address = f"{self.url}{path}?{urllib.parse.urlencode(params)}"
        try:
            with urllib.request.urlopen(address, timeout=self.timeout_s) as response:
                body = json.load(response)
        except urllib.error.HTTPError as exc:
            raise Unavailable(f"Prometheus at PROMETHEUS_URL answered HTTP {exc.code} to a history read.") from exc
        except (OSError, ValueError) as exc:  # unreachable, timed out, or not JSON
            raise Unavailable(f"Prometheus at PROMETHEUS_URL cannot be reached ({type(exc).__name__}).") from exc
        data = body.get("data") if isinstance(body, dict) and body.get("status") == "success" else None
        result = data.get("result") if isinstance(data, dict) else None
        if not isinstance(result, list):
            error = body.get("error") if isinstance(body, dict) else None
            raise Unavailable(f"Prometheus at PROMETHEUS_URL did not answer a history read: {str(error)[:200]}")
        return [item for item in result if isinstance(item, dict) and isinstance(item.get("metric"), dict)]

    def _range(self, expr: str, start: float, step_s: int, n_points: int) -> list[tuple[dict, list]]:
        """Series of ``expr`` evaluated at each point's end: (labels, [(point index, raw value)])."""
        first_end = start + step_s
        result = self._get("/api/v1/query_range", query=expr, start=repr(first_end),
                           end=repr(start + n_points * step_s), step=str(step_s))
        series = []
        for item in result:
            points = []
            for pair in item.get("values") or ():
                try:
                    index = round((float(pair[0]) - first_end) / step_s)
                except (TypeError, ValueError, IndexError):
                    continue
                if 0 <= index < n_points:
                    points.append((index, pair[1]))
            series.append((item["metric"], points))
        return series

    def _instant(self, expr: str, at: float) -> list[tuple[dict, list]]:
        result = self._get("/api/v1/query", query=expr, time=repr(at))
        return [(item["metric"], [(0, (item.get("value") or [None, None])[1])]) for item in result]

    def pool_points(self, *, pool, tier, start, step_s, n_points, now):
        selector = f"pool={_label(pool)}"
        rows = np.zeros((n_points, N_COLUMNS))
        _fill_counts(rows, self._range(counts_query(selector, ("pool",), step_s), start, step_s, n_points))
        gauges = np.zeros((n_points, len(POOL_GAUGES)))
        present = np.zeros(n_points, dtype=bool)
        for labels, values in self._range(gauges_query(selector, ("pool",), step_s), start, step_s, n_points):
            column = _gauge_column(labels, POOL_GAUGE_COLUMN, "instances")
            for index, raw in values:
                value = _count(raw)
                if column is not None and value is not None:
                    gauges[index, column] = value
                    present[index] |= column == POOL_GAUGE_COLUMN["instances"] and value > 0
        gauges[~present] = np.nan
        # The window's totals from one increase() over all of it: per-point increases each lose a little at
        # their edges (Prometheus extrapolates within a range, never across two).
        window = np.zeros((1, N_COLUMNS))
        _fill_counts(window, self._instant(counts_query(selector, ("pool",), n_points * step_s),
                                           start + n_points * step_s))
        return rows, gauges, window[0]

    def instance_points(self, *, pool, tier, instances, window_s, start, step_s, n_points, now):
        if not instances:
            return []
        selector = f"pool={_label(pool)}, instance=~{_label('|'.join(instances))}"
        position = {name: i for i, name in enumerate(instances)}
        rows = np.zeros((len(instances), n_points, N_COLUMNS))
        counted = _by_instance(self._range(counts_query(selector, ("instance",), step_s), start, step_s, n_points))
        for name, i in position.items():
            _fill_counts(rows[i], counted.get(name, []))
        gauges = np.zeros((len(instances), n_points, len(GAUGES)))
        present = np.zeros((len(instances), n_points), dtype=bool)
        for labels, values in self._range(gauges_query(selector, ("instance",), step_s), start, step_s, n_points):
            i, column = position.get(labels.get("instance")), _gauge_column(labels, _GAUGE_COLUMN, None)
            for index, raw in values:
                value = _count(raw)
                if i is None or value is None:
                    continue
                if labels.get("column") == _PRESENT:
                    present[i, index] = value > 0
                elif column is not None:
                    gauges[i, index, column] = value
        gauges[~present] = np.nan
        return list(zip(rows, gauges, strict=True))

    def window_totals(self, *, pool, tier, window_s, start, now):
        selector = f"pool={_label(pool)}"
        range_s = max(1, math.ceil(now - start))
        counted = _by_instance(self._instant(counts_query(selector, ("instance",), range_s), now))
        gauged = self._instant(gauges_query(selector, ("instance",), range_s), now)
        names = sorted({labels["instance"] for labels, values in gauged
                        if labels.get("column") == _PRESENT and isinstance(labels.get("instance"), str)})
        position = {name: i for i, name in enumerate(names)}
        sums = np.zeros((len(names), N_COLUMNS))
        for name, i in position.items():
            _fill_counts(sums[i:i + 1], counted.get(name, []))
        gauges = np.zeros((len(names), len(GAUGES)))
        for labels, values in gauged:
            i, column = position.get(labels.get("instance")), _gauge_column(labels, _GAUGE_COLUMN, None)
            value = _count(values[0][1])
            if i is not None and column is not None and value is not None:
                gauges[i, column] = value
        return WindowTotals(names, sums, gauges)


def _by_instance(series: list[tuple[dict, list]]) -> dict[str, list[tuple[dict, list]]]:
    grouped: dict[str, list[tuple[dict, list]]] = {}
    for labels, values in series:
        grouped.setdefault(labels.get("instance"), []).append((labels, values))
    return grouped


def _gauge_column(labels: dict, columns: dict[str, int], present_as: str | None) -> int | None:
    """The gauge column one series of ``gauges_query`` fills: ``<tier>_<level>``, the applied generation,
    or the count of instances present (as ``present_as``)."""
    column = labels.get("column", "")
    if column == _PRESENT:
        return columns.get(present_as) if present_as else None
    if column.startswith("level:"):
        return columns.get(f"{labels.get('tier')}_{column.removeprefix('level:')}")
    return columns.get(column.removeprefix("gauge:"))
