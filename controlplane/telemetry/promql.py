"""The telemetry history from Prometheus: PromQL over the series ``/metrics`` exports (``prometheus.py``).

Every read is one HTTP request: the counts of every column of ``history``'s layout (counters, refusals
and misses by reason, latency buckets summed by ``le`` across the instances, the latency sum) over each
chart point, written as one PromQL expression whose parts a ``column`` label tells apart.
``/api/v1/query_range`` with the point's width as its step gives a series; ``/api/v1/query`` over the
whole window gives its totals. Where the server runs the recording rules (``recording.py``,
deploy/prometheus/relaygr-history-rules.yml) and the point is a whole number of their minutes, the counts
are the sums of the minutes recorded in it (and the pool's gauges the last minute's): a few samples of
one series per column. Otherwise (no rules on the server, checked once every ``RECORDED_RECHECK_S`` and
logged when the answer changes; a narrower point) they are ``increase()`` over the raw series of every
instance, far slower at fleet scale; the answer means the same either way (``recording.py`` says how
close the two are). The selectors compute every figure from those counts as they do from Redis
(quantiles from the summed buckets, as ``histogram_quantile`` does). Ranking every instance of a pool by
one column reads of each only that column's counts (``window_totals`` with ``counters``), or for a latency
quantile ``histogram_quantile`` itself (``window_quantile``: one value an instance, not its every bucket);
whole rows are read only for the instances shown. Answers over the recorded minutes are kept per pool and
window until a newer minute is recorded (``_kept``).
Prometheus is untrusted input, as Redis is: a value that is not a finite count in range costs its figure
that point, never the chart; unreachable, or an answer that is not one, is a 503 naming PROMETHEUS_URL.
"""

from __future__ import annotations

import json
import logging
import math
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from controlplane.common.errors import Unavailable
from relay_engine.core.telemetry import GAUGES, LATENCY_BUCKETS_MS, MAX_COUNT

from .cache import telemetry_cache
from .history import BUCKET_OFFSET, COUNTER_COLUMN, MISS_COLUMN, N_COLUMNS, REFUSAL_COLUMN, SUM_COLUMN
from .recording import (
    COUNTED,
    GAUGED,
    INSTANCE,
    POOL,
    PRESENT,
    PROBE_RECORD,
    RECORDED_STEP_S,
    counted_record,
    gauged_record,
)
from .rollups import POOL_GAUGE_COLUMN, POOL_GAUGES
from .summaries import WindowTotals

logger = logging.getLogger(__name__)

# A bucket's upper bound (seconds, as Prometheus's ``le`` reads) → its index; +Inf is the last.
_BUCKET_OF_LE = {bound / 1000.0: i for i, bound in enumerate(LATENCY_BUCKETS_MS)} | {math.inf: len(LATENCY_BUCKETS_MS)}
_GAUGE_COLUMN = {name: i for i, name in enumerate(GAUGES)}
BUCKET_PART = "bucket"  # the ``column`` tag of the latency buckets in ``counts_query`` (``recording.COUNTED``)
# How long an answer to "does this server run the recording rules?" is trusted, per PROMETHEUS_URL.
RECORDED_RECHECK_S = 300.0
_recorded: dict[str, tuple[bool, float]] = {}  # url → (the rules' series are there, when asked: monotonic s)


def forget_recorded() -> None:
    """Ask every server again on its next read (after its rules or data changed under it)."""
    _recorded.clear()


def _label(value: str) -> str:
    return json.dumps(value)  # a PromQL string literal: Go's escapes are JSON's


def _tagged(expr: str, column: str) -> str:
    return f'label_replace({expr}, "column", {_label(column)}, "", "")'


def _labels(by: tuple[str, ...], split: str | None) -> str:
    return ", ".join((*by, *((split,) if split else ())))


def _counted(series: str, split: str | None, selector: str, by: tuple[str, ...], range_s: int | str,
             recorded: bool) -> str:
    """One part of ``counts_query``: ``series`` summed by ``by`` (and its ``split`` label) over ``range_s``
    (seconds, or a PromQL duration)."""
    duration = f"{range_s}s" if isinstance(range_s, int) else range_s
    if recorded:
        level = POOL if by == ("pool",) else INSTANCE
        counted = f"sum_over_time({counted_record(series, split, level)}{{{selector}}}[{duration}])"
    else:
        counted = f"increase({series}{{{selector}}}[{duration}])"
    return f"sum by ({_labels(by, split)}) ({counted})"


def counts_query(selector: str, by: tuple[str, ...], range_s: int | str, recorded: bool = False,
                 columns: frozenset[str] | None = None) -> str:
    """Every count of ``history``'s layout (or only the parts whose ``column`` tag is in ``columns``) over the
    ``range_s`` before each evaluation, summed by ``by`` (``("pool",)`` or ``("instance",)``): ``increase()``
    of the raw series, or with ``recorded`` the sum of the recorded minutes of the same level (``range_s`` a
    multiple of ``RECORDED_STEP_S``)."""
    return " or ".join(_tagged(_counted(series, split, selector, by, range_s, recorded), column)
                       for series, split, column in COUNTED if columns is None or column in columns)


def quantile_query(q: float, selector: str, range_s: int | str, recorded: bool = False) -> str:
    """Each instance's latency quantile ``q`` (seconds) over the ``range_s`` before the evaluation, from its
    buckets summed over the range as ``counts_query`` counts them."""
    [(series, split)] = [(series, split) for series, split, column in COUNTED if column == BUCKET_PART]
    return f"histogram_quantile({q!r}, {_counted(series, split, selector, ('instance',), range_s, recorded)})"


def gauges_query(selector: str, by: tuple[str, ...], range_s: int | str, recorded: bool = False,
                 columns: frozenset[str] | None = None) -> str:
    """Each tier level's newest value within ``range_s`` (summed by ``by``), the applied generation, and how
    many instances had a sample (``present``), or only the parts whose ``column`` tag is in ``columns``; with
    ``recorded`` (``by`` the pool only) the last recorded minute's."""
    duration = f"{range_s}s" if isinstance(range_s, int) else range_s

    def gauged(series: str, combine: str, split: str | None) -> str:
        if recorded:
            return (f"{'max' if combine == 'max' else 'sum'} by ({_labels(by, split)}) "
                    f"(last_over_time({gauged_record(series, combine, split)}{{{selector}}}[{duration}]))")
        return f"{combine} by ({_labels(by, split)}) (last_over_time({series}{{{selector}}}[{duration}]))"

    return " or ".join(_tagged(gauged(series, combine, split), column) for series, combine, split, column in GAUGED
                       if columns is None or column in columns)


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
    if column == BUCKET_PART:
        try:
            index = _BUCKET_OF_LE.get(float(labels.get("le", "")))
        except ValueError:
            return None
        return None if index is None else BUCKET_OFFSET + index
    return None


def _fill_counts(rows: np.ndarray, series: list[tuple[dict, list[tuple[int, object]]]]) -> None:
    """Counts of ``counts_query`` into rows [rows, N_COLUMNS] (each value at its row index): the latency sum
    in ms, the buckets from cumulative to each one's own (``history``'s layout)."""
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
        self._newest: dict[tuple[str, float], float | None] = {}  # (pool, now) → its newest recorded minute

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

    def reads_recorded(self, step_s: int) -> bool:
        """Whether points ``step_s`` wide are read from the recording rules' series: a whole number of
        their minutes, on a server that records them."""
        return step_s % RECORDED_STEP_S == 0 and self.records()

    def records(self) -> bool:
        """Whether this server runs the recording rules (asked once every ``RECORDED_RECHECK_S``, and
        logged when the answer changes)."""
        known = _recorded.get(self.url)
        if known is not None and time.monotonic() - known[1] < RECORDED_RECHECK_S:
            return known[0]
        present = bool(self._instant(f"count(last_over_time({PROBE_RECORD}[1h]))", time.time()))
        if known is None or known[0] != present:
            if present:
                logger.info("Prometheus at PROMETHEUS_URL records %s: history reads use the recorded series",
                            PROBE_RECORD)
            else:
                logger.warning("Prometheus at PROMETHEUS_URL has no %s in the last hour: history reads use the raw "
                               "series, slow at fleet scale. Load deploy/prometheus/relaygr-history-rules.yml "
                               "into it (and backfill it: see that file's header).", PROBE_RECORD)
        _recorded[self.url] = (present, time.monotonic())
        return present

    def pool_points(self, *, pool, tier, start, step_s, n_points, now):
        selector = f"pool={_label(pool)}"
        recorded = self.reads_recorded(step_s)
        rows = np.zeros((n_points, N_COLUMNS))
        _fill_counts(rows, self._range(counts_query(selector, ("pool",), step_s, recorded), start, step_s, n_points))
        gauges = np.zeros((n_points, len(POOL_GAUGES)))
        present = np.zeros(n_points, dtype=bool)
        for labels, values in self._range(gauges_query(selector, ("pool",), step_s, recorded), start, step_s,
                                          n_points):
            column = _gauge_column(labels, POOL_GAUGE_COLUMN, "instances")
            for index, raw in values:
                value = _count(raw)
                if column is not None and value is not None:
                    gauges[index, column] = value
                    present[index] |= column == POOL_GAUGE_COLUMN["instances"] and value > 0
        gauges[~present] = np.nan
        if recorded:  # the recorded minutes tile the window: its totals are its points' sums
            return rows, gauges, rows.sum(axis=0)
        # The window's totals from one increase() over all of it: per-point increases each lose a little at
        # their edges (Prometheus extrapolates within a range, never across two).
        window = np.zeros((1, N_COLUMNS))
        _fill_counts(window, self._instant(counts_query(selector, ("pool",), n_points * step_s),
                                           start + n_points * step_s))
        return rows, gauges, window[0]

    def instance_points(self, *, pool, tier, instances, window_s, start, step_s, n_points, now):
        if not instances:
            return []
        selector = _selector(pool, instances)
        position = {name: i for i, name in enumerate(instances)}
        rows = np.zeros((len(instances), n_points, N_COLUMNS))
        counted = _by_instance(self._range(counts_query(selector, ("instance",), step_s,
                                                        self.reads_recorded(step_s)), start, step_s, n_points))
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
                if labels.get("column") == PRESENT:
                    present[i, index] = value > 0
                elif column is not None:
                    gauges[i, index, column] = value
        gauges[~present] = np.nan
        return list(zip(rows, gauges, strict=True))

    def window_totals(self, *, pool, tier, window_s, start, now, instances=None, counters=None):
        if instances is not None and not instances:
            return WindowTotals([], np.zeros((0, N_COLUMNS)), np.zeros((0, len(GAUGES))))
        gauged = self._instant(gauges_query(_selector(pool, instances), ("instance",), _since(start, now)), now)
        names = _present(gauged)
        position = {name: i for i, name in enumerate(names)}
        columns = None if counters is None else frozenset(f"counter:{name}" for name in counters)
        if columns is None or columns:
            sums = self._window_counts(pool, window_s, start, now, names, columns)
        else:
            sums = np.zeros((len(names), N_COLUMNS))
        gauges = np.zeros((len(names), len(GAUGES)))
        for labels, values in gauged:
            i, column = position.get(labels.get("instance")), _gauge_column(labels, _GAUGE_COLUMN, None)
            value = _count(values[0][1])
            if i is not None and column is not None and value is not None:
                gauges[i, column] = value
        return WindowTotals(names, sums, gauges)

    def window_quantile(self, *, pool, tier, window_s, start, now, q):
        names = _present(self._instant(gauges_query(_selector(pool, None), ("instance",), _since(start, now),
                                                    columns=frozenset((PRESENT,))), now))
        by_instance = self._kept(("quantiles", pool, window_s, q), start, now,
                                 lambda at: self._quantiles_at(pool, start, at, q))
        return names, np.array([by_instance.get(name, np.nan) for name in names])

    def _window_counts(self, pool: str, window_s: int, start: float, now: float, names: list[str],
                       columns: frozenset[str] | None) -> np.ndarray:
        """The counts [names, N_COLUMNS] of ``names`` over [start, now] (only ``columns`` where given), those
        already read for this window and its newest recorded minute kept, the others read."""
        held = self._kept(("counts", pool, window_s, columns), start, now, lambda at: {})
        missing = [name for name in names if name not in held]
        if missing:
            at = self._newest.get((pool, now)) or now  # the minute a kept answer holds, else now
            position = {name: i for i, name in enumerate(missing)}
            rows = np.zeros((len(missing), N_COLUMNS))
            # The recorded minutes evaluated since ``start``, as the window's points count them.
            counts = counts_query(_selector(pool, missing), ("instance",), _since(start, at), recorded=self.records(),
                                  columns=columns)
            _fill_counts(rows, _at_instance(self._instant(counts, at), position))
            held.update(zip(missing, rows, strict=True))
        return np.array([held[name] for name in names]).reshape(len(names), N_COLUMNS)

    def _kept(self, key: tuple, start: float, now: float, read: Callable[[float], dict]) -> dict:
        """``read(at)``'s answer over [start, at]: kept in this process while the window starts at ``start`` and
        no newer minute is recorded (``at`` that minute), or read afresh at ``now`` where the server records
        none. Every minute the server has evaluated is counted either way."""
        newest = self._newest_recorded_minute(key[1], now) if self.records() else None
        if newest is None:
            return read(now)
        held = telemetry_cache.get((self.url, *key), KeptAnswer)
        answer = held.answer  # read once: another thread may replace it, never change it
        if answer is None or answer[0] != (start, newest):
            answer = held.answer = ((start, newest), read(newest))
        return answer[1]

    def _quantiles_at(self, pool: str, start: float, at: float, q: float) -> dict[str, float]:
        """Each instance's latency quantile ``q`` in ms over [start, at], computed where the buckets are: one
        value per instance comes back, not its every bucket."""
        by_instance = {}
        query = quantile_query(q, _selector(pool, None), _since(start, at), self.records())
        for labels, [(_, raw)] in self._instant(query, at):
            value = _count(raw)
            if isinstance(labels.get("instance"), str) and value is not None:
                by_instance[labels["instance"]] = value * 1000.0
        return by_instance

    def _newest_recorded_minute(self, pool: str, now: float) -> float | None:
        """When the newest minute of the pool's instance-level counts was recorded (seconds), or None (none
        within Prometheus's lookback), asked once per read. The rules run in order, each one's minute written
        at once: the last one's minute is one every count holds."""
        if (pool, now) not in self._newest:
            record = counted_record(COUNTED[-1][0], COUNTED[-1][1], INSTANCE)
            answer = self._instant(f"max(timestamp({record}{{{_selector(pool, None)}}}))", now)
            self._newest[pool, now] = _count(answer[0][1][0][1]) if answer else None
        return self._newest[pool, now]


@dataclass
class KeptAnswer:
    """An answer over a window's recorded minutes (by instance), and the (window start, newest recorded
    minute) it holds."""

    answer: tuple[tuple[float, float], dict] | None = None

    @property
    def nbytes(self) -> int:
        return 0 if self.answer is None else (N_COLUMNS * 8 + 100) * len(self.answer[1])


def _selector(pool: str, instances: list[str] | None) -> str:
    """The pool's series, or only those of ``instances``."""
    if instances is None:
        return f"pool={_label(pool)}"
    return f"pool={_label(pool)}, instance=~{_label('|'.join(instances))}"


def _since(start: float, now: float) -> str:
    """The range back from ``now`` to ``start`` as a PromQL duration, to the millisecond: an answer over it
    depends on the window's start, not on the moment it is asked."""
    return f"{max(1, round((now - start) * 1000))}ms"


def _present(gauged: list[tuple[dict, list]]) -> list[str]:
    """The instances with a sample in a ``gauges_query`` answer, by name."""
    return sorted({labels["instance"] for labels, _ in gauged
                   if labels.get("column") == PRESENT and isinstance(labels.get("instance"), str)})


def _at_instance(series: list[tuple[dict, list]], position: dict[str, int]) -> list[tuple[dict, list]]:
    """An instant answer's series, each value at its instance's row (those of other instances left out)."""
    return [(labels, [(position[labels["instance"]], raw) for _, raw in values]) for labels, values in series
            if labels.get("instance") in position]


def _by_instance(series: list[tuple[dict, list]]) -> dict[str, list[tuple[dict, list]]]:
    grouped: dict[str, list[tuple[dict, list]]] = {}
    for labels, values in series:
        grouped.setdefault(labels.get("instance"), []).append((labels, values))
    return grouped


def _gauge_column(labels: dict, columns: dict[str, int], present_as: str | None) -> int | None:
    """The gauge column one series of ``gauges_query`` fills: ``<tier>_<level>``, the applied generation,
    or the count of instances present (as ``present_as``)."""
    column = labels.get("column", "")
    if column == PRESENT:
        return columns.get(present_as) if present_as else None
    if column.startswith("level:"):
        return columns.get(f"{labels.get('tier')}_{column.removeprefix('level:')}")
    return columns.get(column.removeprefix("gauge:"))
