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
whole rows are read only for the instances shown. Each instance's newest gauges over a window (and whether
it reported) are read from the recorded ten-minute blocks of its raw gauges and the raw scrapes at the
window's two edges (``Span``): a day is ~160 samples a series instead of 5,760, the same answer. Answers
over the recorded minutes (and those gauges up to the newest minute) are kept per pool and window until a
newer minute is recorded (``_kept``).
Prometheus is untrusted input, as Redis is: a value that is not a finite count in range costs its figure
that point, never the chart; unreachable, or an answer that is not one, is a 503 naming PROMETHEUS_URL.
"""

from __future__ import annotations

import json
import logging
import math
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from controlplane.common.errors import Unavailable
from relay_engine.core.telemetry import GAUGES, LATENCY_BUCKETS_MS, MAX_COUNT

from .cache import telemetry_cache
from .history import BUCKET_OFFSET, COUNTER_COLUMN, MISS_COLUMN, N_COLUMNS, REFUSAL_COLUMN, SUM_COLUMN
from .recording import (
    BLOCK_LAG_S,
    BLOCK_PROBE_RECORD,
    BLOCK_S,
    COUNTED,
    GAUGED,
    INSTANCE,
    POOL,
    PRESENT,
    PROBE_RECORD,
    RECORDED_STEP_S,
    ROLLED_BLOCKS,
    ROLLED_PROBE_RECORD,
    SUMS_PROBE_RECORD,
    block_sum_record,
    counted_record,
    gauged_record,
    last_block_record,
    rolled_record,
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
_recorded: dict[str, tuple[bool, float]] = {}
# (url, pool, the probe record) → (when its recorded blocks were stamped, the time they were read back to, when
# to ask again).
_block_stamps: dict[tuple[str, str, str], tuple[np.ndarray, float, float]] = {}
# A point is final (kept, never read again) once the server has recorded a minute this long after its end.
FINAL_AFTER_S = RECORDED_STEP_S
# A kept answer over a window's recorded minutes is given while a thread reads its successor for a poll at
# most this far past its minute: the minute or two a page polls across.
STALE_FOR_S = 2 * RECORDED_STEP_S
# One thread a process reads the successors of kept answers, one at a time: the reads a new minute sets off
# (each window's quantiles, its rows) queue there instead of all landing on the server at once, beside the
# polls.
_refresher = ThreadPoolExecutor(max_workers=1, thread_name_prefix="relaygr-history-refresh")
# Reads split in two and sent at once: the server evaluates a query on one core, so the fleet-wide quantile and
# a wide window's instance series take about the longer half's time on two. Only a request's (or the
# refresher's) thread waits on these; they never wait on each other, so the pool cannot starve itself.
_halves = ThreadPoolExecutor(max_workers=4, thread_name_prefix="relaygr-history-half")
# The two halves of a pool's instances, whatever their names: those whose name ends in an even digit, and the
# rest (instance names end in their index, so the halves are even).
_HALF = '".*[02468]"'
# The parts of one read (``counts_parts``, ``gauges_parts``), sent apart and at once: the server evaluates a chain
# of parts joined by ``or`` in about twice the time it takes for the parts alone (a day's pool series at 256
# instances, 25 parts: 100-112 ms as one query, 36-58 ms as 25 on 2 to 8 threads; measured 2026-12-07). Only
# other threads wait on these, which never wait themselves.
_parts = ThreadPoolExecutor(max_workers=4, thread_name_prefix="relaygr-history-part")
# A poll's reads (a point or two) are sent as one query instead: there each request's own cost is most of the
# time, and a day's poll of the live view sent apart (~35 requests) took a P95 of 136 ms against 93 joined.
PARTS_APART_FROM_POINTS = 60
# A request's reads started ahead of the one it makes itself (``ahead``): their threads may wait on ``_halves``,
# never the other way round.
_ahead = ThreadPoolExecutor(max_workers=4, thread_name_prefix="relaygr-history-ahead")
# The shortest window whose counts are read over the summed ten-minute blocks (``_summed_span``).
SUMS_FROM_S = 12 * 3600
# Runs of this many blocks or fewer are read as minutes with the edges beside them (``Span.pieces``).
FOLDED_BLOCKS = 2
MAX_KEPT_POINTS = 1500  # per series and point width: a day of minutes, and a margin


def forget_recorded() -> None:
    """Ask every server again on its next read (after its rules or data changed under it)."""
    _recorded.clear()
    _block_stamps.clear()


def _label(value: str) -> str:
    return json.dumps(value)  # a PromQL string literal: Go's escapes are JSON's


def _tagged(expr: str, column: str) -> str:
    return f'label_replace({expr}, "column", {_label(column)}, "", "")'


def _labels(by: tuple[str, ...], split: str | None) -> str:
    return ", ".join((*by, *((split,) if split else ())))


class Span(NamedTuple):
    """A window (``start``, ``end``] read as runs of recorded ten-minute blocks (each run's first and last
    stamps, oldest run first, every block of a run recorded and none other stamped within it) and the minutes
    (or raw samples) the runs leave: before the first, between two, after the last. A block stamped t holds
    what was recorded in (t - BLOCK_LAG_S - BLOCK_S, t - BLOCK_LAG_S] (``recording.py``). ``rolled``: stamps
    of rolled sums (the ``ROLLED_BLOCKS`` blocks up to each, every one recorded and none other) that a run
    long enough to hold one reads instead of those blocks (``pieces``)."""

    start: float
    end: float
    runs: tuple[tuple[float, float], ...]
    rolled: tuple[float, ...] = ()

    def pieces(self) -> list[tuple[str, float, float]]:
        """What the recorded parts read, oldest first: ("blocks", first stamp, last stamp) for a run of blocks,
        ("rolled", its first block's stamp, its stamp) for a rolled sum: in a run, the newest rolled sum it holds
        whole, and the blocks before and after it. Runs of ``FOLDED_BLOCKS`` or fewer (beside a rolled sum, or
        a server's own first blocks after a backfill's) are read as minutes with the edge beside them: each part
        is a selection of every series joined to the others by ``or``, which costs the server more than the
        minutes it saves (measured at 256 instances: the fifth part of a day's P99 ranking 0.48 s, its
        selection alone 0.11 s)."""
        span = (ROLLED_BLOCKS - 1) * BLOCK_S
        pieces: list[tuple[str, float, float]] = []
        for first, last in self.runs:
            held = [stamp for stamp in self.rolled if first - 0.5 <= stamp - span and stamp <= last + 0.5]
            if not held:
                pieces.append(("blocks", first, last))
                continue
            stamp = max(held)
            pieces += [("blocks", first, stamp - span - BLOCK_S), ("rolled", stamp - span, stamp),
                       ("blocks", stamp + BLOCK_S, last)]
        return [(kind, a, b) for kind, a, b in pieces
                if kind == "rolled" or (b - a) / BLOCK_S + 1 > FOLDED_BLOCKS + 0.5]

    def parts(self) -> list[tuple[str, str]]:
        """("edge", "blocks" or "rolled", the range or ``@`` that selects it): the newest first, the empty edges
        left out. Ranges are in milliseconds, each a millisecond short where a sample on its far edge belongs to
        its neighbour, so the parts tile the window whether the server's ranges are closed (2.x) or left-open."""
        parts = []
        after = self.end  # the end of what the parts so far leave, inclusive
        for kind, first, last in reversed(self.pieces()):
            if (edge := _ms(after - (last - BLOCK_LAG_S)) - 1) > 0:
                parts.append(("edge", f"[{edge}ms] @ {after:.3f}"))
            parts.append((kind, f" @ {last:.3f}" if kind == "rolled" else f"[{_ms(last - first) + 1}ms] @ {last:.3f}"))
            after = first - BLOCK_LAG_S - BLOCK_S
        if (head := _ms(after - self.start)) > 0:
            parts.append(("edge", f"[{head}ms] @ {after:.3f}"))
        return parts


def rolled_stamps(rolled: np.ndarray, blocks: np.ndarray) -> tuple[float, ...]:
    """The stamps of ``rolled`` (rolled sums') whose ``ROLLED_BLOCKS`` blocks are all in ``blocks`` (the summed
    blocks' stamps) with none other among them: a rolled sum at a phase change, or before its first day of
    blocks, holds other blocks than a run of them, and is not read."""
    span = (ROLLED_BLOCKS - 1) * BLOCK_S
    ordered = np.sort(blocks)
    out = []
    for stamp in np.sort(rolled).tolist():
        held = ordered[(ordered > stamp - span - BLOCK_S + 0.5) & (ordered <= stamp + 0.5)]
        if len(held) == ROLLED_BLOCKS and np.all(np.abs(np.diff(held) - BLOCK_S) < 0.5) \
                and abs(held[-1] - stamp) < 0.5:
            out.append(stamp)
    return tuple(out)


def _ms(seconds: float) -> int:
    return round(seconds * 1000)


def block_runs(stamps: np.ndarray, start: float, end: float) -> tuple[tuple[float, float], ...]:
    """Runs of the blocks stamped ``stamps`` (seconds) that lie whole in (``start``, ``end``] and overlap none
    kept before them, oldest first: each run's blocks ``BLOCK_S`` apart with no other block stamped among them.
    Blocks of another phase (a backfill's beside the server's own, a rules group evaluated anew) start a new
    run, and the one overlapping a kept block is left out: its minutes are read instead."""
    inside = np.sort(stamps[(stamps - BLOCK_LAG_S - BLOCK_S >= start - 1e-3) & (stamps - BLOCK_LAG_S <= end + 1e-3)])
    runs: list[list[float]] = []
    kept: float | None = None
    broken = True  # the next block kept starts a run
    for stamp in inside.tolist():
        if kept is not None and stamp - kept < BLOCK_S - 0.5:
            broken = True
            continue
        if broken or kept is None or stamp - kept > BLOCK_S + 0.5:
            runs.append([stamp, stamp])
        else:
            runs[-1][1] = stamp
        kept, broken = stamp, False
    return tuple((first, last) for first, last in runs)


def _newest_over(span: Span, raw: str, block: str, selector: str) -> str:
    """The newest value of the raw series ``raw`` over the span: the newest edge's, else its blocks' (``block``,
    every label of ``raw`` kept), else the oldest edge's (``or`` keeps its left side's series)."""
    return " or ".join(f"last_over_time({block if kind == 'blocks' else raw}{{{selector}}}{selected})"
                       for kind, selected in span.parts())


def _span_reads(span: Span, series: str, split: str | None, selector: str) -> list[str]:
    """The selections of ``series`` that the span's parts read (``Span.parts``): its blocks' sums (and rolled
    sums), and the minutes at its edges."""
    records = {"blocks": block_sum_record(series, split), "rolled": rolled_record(series, split),
               "edge": counted_record(series, split, INSTANCE)}

    def part(kind: str, selected: str) -> str:
        read = f"{records[kind]}{{{selector}}}{selected}"
        return read if kind == "rolled" else f"sum_over_time({read})"

    return [part(kind, selected) for kind, selected in span.parts()]


def _summed_over(span: Span, series: str, split: str | None, selector: str) -> str:
    """The recorded minutes of ``series`` per instance over the span: its parts (``_span_reads``), each tagged
    apart (``or`` keeps a left side's series only where the labels are the same) and then summed. Every
    instance with any part counts."""
    parts = " or ".join(f'label_replace({read}, "part", "{i}", "", "")'
                        for i, read in enumerate(_span_reads(span, series, split, selector)))
    return f"sum by ({_labels(('instance',), split)}) ({parts})"


def _matched_over(span: Span, series: str, split: str | None, selector: str) -> str:
    """``_summed_over`` for the instances with every part only (the others are left out): each part summed on
    its own and the parts added, which costs the server about half the tagged ``or`` of every selection (the
    day's P99 ranking at 256 instances, a half of the pool: 175-250 ms against 200-400 ms; measured
    2026-12-07)."""
    by = _labels(("instance",), split)
    return " + ".join(f"sum by ({by}) ({read})" for read in _span_reads(span, series, split, selector))


def _counted(series: str, split: str | None, selector: str, by: tuple[str, ...], range_s: int | str,
             recorded: bool, span: Span | None = None) -> str:
    """One part of ``counts_query``: ``series`` summed by ``by`` (and its ``split`` label) over ``range_s``
    (seconds, or a PromQL duration); with ``span`` (recorded, by the instance, an instant read) over the
    span's blocks and edges instead."""
    if span is not None:
        assert recorded and by == ("instance",), "the recorded blocks are summed by instance"
        return _summed_over(span, series, split, selector)
    duration = f"{range_s}s" if isinstance(range_s, int) else range_s
    if recorded:
        level = POOL if by == ("pool",) else INSTANCE
        counted = f"sum_over_time({counted_record(series, split, level)}{{{selector}}}[{duration}])"
    else:
        counted = f"increase({series}{{{selector}}}[{duration}])"
    return f"sum by ({_labels(by, split)}) ({counted})"


def counts_parts(selector: str, by: tuple[str, ...], range_s: int | str, recorded: bool = False,
                 columns: frozenset[str] | None = None, span: Span | None = None) -> list[str]:
    """Every count of ``history``'s layout (or only the parts whose ``column`` tag is in ``columns``) over the
    ``range_s`` before each evaluation, summed by ``by`` (``("pool",)`` or ``("instance",)``): ``increase()``
    of the raw series, or with ``recorded`` the sum of the recorded minutes of the same level (``range_s`` a
    multiple of ``RECORDED_STEP_S``), and with ``span`` too over its recorded blocks and edges. One query per
    part, each tagged with its ``column``: sent apart and at once (``_each``), or joined by ``or``
    (``counts_query``). A latency bucket's zero counts are left out (``> 0``): a reader's rows start at 0, and a
    bucket below every request of its point or window is most of a histogram's (a day's worst 8 instances:
    0.76 MB of buckets to send and parse instead of 1.38; measured 2026-12-07)."""
    return [_tagged(_counted(series, split, selector, by, range_s, recorded, span)
                    + (" > 0" if column == BUCKET_PART else ""), column)
            for series, split, column in COUNTED if columns is None or column in columns]


def counts_query(selector: str, by: tuple[str, ...], range_s: int | str, recorded: bool = False,
                 columns: frozenset[str] | None = None, span: Span | None = None) -> str:
    """``counts_parts`` as one query."""
    return " or ".join(counts_parts(selector, by, range_s, recorded, columns, span))


def quantile_query(q: float, selector: str, range_s: int | str, recorded: bool = False,
                   span: Span | None = None, matched: bool = False) -> str:
    """Each instance's latency quantile ``q`` (seconds) over the ``range_s`` before the evaluation (or the
    span), from its buckets summed over it as ``counts_query`` counts them. With ``matched`` (and a span), only
    of the instances with every part of the span (``_matched_over``), for less of the server's time."""
    [(series, split)] = [(series, split) for series, split, column in COUNTED if column == BUCKET_PART]
    if matched and span is not None:
        return f"histogram_quantile({q!r}, {_matched_over(span, series, split, selector)})"
    return f"histogram_quantile({q!r}, {_counted(series, split, selector, ('instance',), range_s, recorded, span)})"


def gauges_parts(selector: str, by: tuple[str, ...], range_s: int | str, recorded: bool = False,
                 columns: frozenset[str] | None = None, span: Span | None = None) -> list[str]:
    """Each tier level's newest value within ``range_s`` (summed by ``by``), the applied generation, and how
    many instances had a sample (``present``), or only the parts whose ``column`` tag is in ``columns``; with
    ``recorded`` (``by`` the pool only) the last recorded minute's; with ``span`` (``by`` the instance, an
    instant read) the newest raw sample in it, read from its blocks' records between its edges. One query per
    part, as ``counts_parts``."""
    duration = f"{range_s}s" if isinstance(range_s, int) else range_s

    def gauged(series: str, combine: str, split: str | None) -> str:
        if span is not None:
            return f"{combine} by ({_labels(by, split)}) ({_newest_over(span, series, last_block_record(series), selector)})"
        if recorded:
            return (f"{'max' if combine == 'max' else 'sum'} by ({_labels(by, split)}) "
                    f"(last_over_time({gauged_record(series, combine, split)}{{{selector}}}[{duration}]))")
        return f"{combine} by ({_labels(by, split)}) (last_over_time({series}{{{selector}}}[{duration}]))"

    return [_tagged(gauged(series, combine, split), column) for series, combine, split, column in GAUGED
            if columns is None or column in columns]


def gauges_query(selector: str, by: tuple[str, ...], range_s: int | str, recorded: bool = False,
                 columns: frozenset[str] | None = None, span: Span | None = None) -> str:
    """``gauges_parts`` as one query."""
    return " or ".join(gauges_parts(selector, by, range_s, recorded, columns, span))


def _count(raw) -> float | None:
    try:
        value = float(raw)
    except (TypeError, ValueError):
        return None
    return value if 0 <= value <= MAX_COUNT else None  # NaN is not


class Samples(NamedTuple):
    """One series' values: each one's row (a point's index, an instance's position) and the value, NaN where
    Prometheus sent something that is not a finite count in [0, ``MAX_COUNT``] (it costs that value only)."""

    index: np.ndarray
    value: np.ndarray

    @property
    def valid(self) -> tuple[np.ndarray, np.ndarray]:
        ok = ~np.isnan(self.value)
        return self.index[ok], self.value[ok]


def _counts_of(raws: list) -> np.ndarray:
    """Prometheus's sample values (decimal strings, "NaN", "+Inf") as counts, NaN where one is not a count:
    all at once, or one by one where the answer holds something else."""
    try:
        values = np.array(raws, dtype=float)
        if values.ndim != 1:
            raise ValueError("not one value per sample")
    except (TypeError, ValueError, OverflowError):
        values = np.array([np.nan if (value := _count(raw)) is None else value for raw in raws], dtype=float)
    with np.errstate(invalid="ignore"):
        values[~((values >= 0) & (values <= MAX_COUNT))] = np.nan
    return values


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


def _samples(item: dict, index_of: Callable[[np.ndarray], np.ndarray], n_points: int) -> Samples:
    """A matrix answer's series: its [time, value] pairs, each at ``index_of``'s point for its time (seconds:
    finite, positive, in range as counts are), those outside [0, ``n_points``) left out."""
    pairs = [pair for pair in (item.get("values") or ()) if isinstance(pair, list | tuple) and len(pair) == 2]
    index = index_of(_counts_of([pair[0] for pair in pairs]))
    ok = ~np.isnan(index) & (index >= 0) & (index < n_points)
    values = _counts_of([pair[1] for pair, keep in zip(pairs, ok.tolist(), strict=True) if keep])
    return Samples(index[ok].astype(int), values)


def _fill_counts(rows: np.ndarray, series: list[tuple[dict, Samples]], add: bool = False) -> None:
    """Counts of ``counts_query`` (or with ``add``, of recorded minutes: each row the sum of those at its index)
    into rows [rows, N_COLUMNS]: the latency sum in ms, the buckets from cumulative to each one's own
    (``history``'s layout)."""
    for labels, samples in series:
        column = _cell_of_counts(labels)
        if column is None:
            continue
        index, value = samples.valid
        value = value * 1000.0 if column == SUM_COLUMN else value
        if add:
            np.add.at(rows[:, column], index, value)
        else:
            rows[index, column] = value
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

    def _range(self, expr: str, start: float, step_s: int, n_points: int) -> list[tuple[dict, Samples]]:
        """Series of ``expr`` evaluated at each point's end: (labels, the points' indices and values)."""
        first_end = start + step_s
        result = self._get("/api/v1/query_range", query=expr, start=repr(first_end),
                           end=repr(start + n_points * step_s), step=str(step_s))
        series = []
        for item in result:
            series.append((item["metric"], _samples(item, lambda stamps: np.rint((stamps - first_end) / step_s),
                                                    n_points)))
        return series

    def _range_each(self, exprs: list[str], start: float, step_s: int, n_points: int) -> list[tuple[dict, Samples]]:
        """``_range`` of ``exprs`` (the parts of one read), their series together: each part apart for more than
        ``PARTS_APART_FROM_POINTS`` points, else as one query."""
        if n_points <= PARTS_APART_FROM_POINTS:
            exprs = _joined(exprs)
        return _each(lambda expr: self._range(expr, start, step_s, n_points), exprs)

    def _instant_each(self, exprs: list[str], at: float, apart: bool = True) -> list[tuple[dict, Samples]]:
        """``_instant`` of ``exprs`` (the parts of one read), their series together: each part apart, or with
        ``apart`` false (a poll's small read) as one query."""
        return _each(lambda expr: self._instant(expr, at), exprs if apart else _joined(exprs))

    def _recorded_counts(self, selector: str, level: tuple[str, ...], start: float, step_s: int, n_points: int,
                         columns: frozenset[str] | None = None) -> tuple[list[tuple[dict, Samples]], bool]:
        """The counts of ``level`` over the points from ``start`` from the recorded minutes, and whether
        ``_fill_counts`` adds them up (``add``). Points of one minute: the minutes as they were written
        (``_recorded_minutes``). Wider ones (a day's 4-minute points): each point's minutes summed by the server
        (``query_range``), a quarter of the samples to send and parse, and a third of the time at 8 instances
        of 256 (measured: 0.35 s against 1.03 s); each range a millisecond short of the point, so a minute on
        a point's edge counts in the one it ends, as ``_recorded_minutes`` places it."""
        if step_s == RECORDED_STEP_S:
            return self._recorded_minutes(selector, level, start, step_s, n_points, columns), True
        by = ("pool",) if level == POOL else ("instance",)
        exprs = counts_parts(selector, by, f"{step_s * 1000 - 1}ms", recorded=True, columns=columns)
        return self._range_each(exprs, start, step_s, n_points), False

    def _recorded_minutes(self, selector: str, level: tuple[str, ...], start: float, step_s: int, n_points: int,
                          columns: frozenset[str] | None = None) -> list[tuple[dict, Samples]]:
        """The recorded minutes of ``level`` (``POOL`` or ``INSTANCE``) in the points from ``start``, as they were
        written (one instant query of a range: the server only reads them out, where a ``query_range`` of
        ``counts_query`` evaluates every part at every point, ~10x the server's time at fleet scale): each
        series tagged as ``counts_query`` tags it, each minute at the index of the point it falls in, (end - step,
        end] as ``sum_over_time`` over the point counts it; ``_fill_counts(..., add=True)`` sums them."""
        records = {counted_record(series, split, level): column for series, split, column in COUNTED
                   if columns is None or column in columns}
        names = "|".join(sorted(records))
        end = start + n_points * step_s
        result = self._get("/api/v1/query", query=f"{{__name__=~{_label(names)}, {selector}}}[{n_points * step_s}s]",
                           time=repr(end))
        series = []
        for item in result:
            column = records.get(item["metric"].get("__name__"))
            if column is None:
                continue
            samples = _samples(item, lambda stamps: np.ceil((stamps - start) / step_s) - 1, n_points)
            series.append(({**item["metric"], "column": column}, samples))
        return series

    def _instant(self, expr: str, at: float) -> list[tuple[dict, Samples]]:
        result = self._get("/api/v1/query", query=expr, time=repr(at))
        values = [(item.get("value") or [None, None]) for item in result]
        raws = [value[1] if isinstance(value, list | tuple) and len(value) == 2 else None for value in values]
        counts = _counts_of(raws)
        return [(item["metric"], Samples(np.zeros(1, dtype=int), counts[i:i + 1])) for i, item in enumerate(result)]

    def ahead(self, read):
        """``read`` in a thread now (the server answers it on another core), its answer when asked."""
        return _ahead.submit(read).result

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
        recorded = self.reads_recorded(step_s)
        if recorded:  # the recorded minutes tile the window: its totals are its points' sums
            rows, gauges = self._kept_points(("pool", pool), pool, start, step_s, n_points, now,
                                             lambda first, n: self._pool_read(pool, first, step_s, n, True))
            return rows, gauges, rows.sum(axis=0)
        rows, gauges = self._pool_read(pool, start, step_s, n_points, False)
        # The window's totals from one increase() over all of it: per-point increases each lose a little at
        # their edges (Prometheus extrapolates within a range, never across two).
        window = np.zeros((1, N_COLUMNS))
        _fill_counts(window, self._instant_each(counts_parts(f"pool={_label(pool)}", ("pool",), n_points * step_s),
                                                start + n_points * step_s))
        return rows, gauges, window[0]

    def _pool_read(self, pool: str, start: float, step_s: int, n_points: int,
                   recorded: bool) -> tuple[np.ndarray, np.ndarray]:
        """The pool's counts [n_points, N_COLUMNS] and gauges [n_points, POOL_GAUGES] (NaN where no instance
        reported) over the points from ``start``."""
        selector = f"pool={_label(pool)}"
        # The gauges are read while the counts are (the server answers each on a core of its own).
        gauged = _halves.submit(self._range_each, gauges_parts(selector, ("pool",), step_s, recorded), start, step_s,
                                n_points)
        rows = np.zeros((n_points, N_COLUMNS))
        if recorded:
            _fill_counts(rows, *self._recorded_counts(selector, POOL, start, step_s, n_points))
        else:
            _fill_counts(rows, self._range_each(counts_parts(selector, ("pool",), step_s), start, step_s, n_points))
        gauges = np.zeros((n_points, len(POOL_GAUGES)))
        present = np.zeros(n_points, dtype=bool)
        for labels, samples in gauged.result():
            column = _gauge_column(labels, POOL_GAUGE_COLUMN, "instances")
            if column is None:
                continue
            index, value = samples.valid
            gauges[index, column] = value
            if column == POOL_GAUGE_COLUMN["instances"]:
                present[index[value > 0]] = True
        gauges[~present] = np.nan
        return rows, gauges

    def instance_points(self, *, pool, tier, instances, window_s, start, step_s, n_points, now, parts=None):
        if not instances:
            return []
        recorded = self.reads_recorded(step_s)
        if not recorded:
            return self._instances_read(pool, instances, start, step_s, n_points, False, parts)
        # Each instance's final points are kept on their own; those missing the same points are read together
        # (after a poll or two, all of them: the newest minute's).
        kept = [self._held_points(("instance", pool, name, parts), pool, start, step_s, n_points, now)
                for name in instances]
        by_first: dict[int, list[int]] = {}
        for i, (_, _, first) in enumerate(kept):
            by_first.setdefault(first, []).append(i)
        out: list[tuple[np.ndarray, np.ndarray] | None] = [None] * len(instances)
        for first, members in by_first.items():
            fresh = self._instances_read(pool, [instances[i] for i in members], start + first * step_s, step_s,
                                         n_points - first, True, parts) if first < n_points else [None] * len(members)
            for i, read in zip(members, fresh, strict=True):
                out[i] = self._merge_points(kept[i], read, start, step_s, n_points)
        return out

    def _instances_read(self, pool: str, instances: list[str], start: float, step_s: int, n_points: int,
                        recorded: bool, columns: frozenset[str] | None = None) -> list[tuple[np.ndarray, np.ndarray]]:
        """Per instance (in order): counts [n_points, N_COLUMNS] (only the parts whose ``column`` tag is in
        ``columns`` where given, the rest 0) and gauges [n_points, GAUGES] (NaN where none) over the points from
        ``start``."""
        selector = _selector(pool, instances)
        position = {name: i for i, name in enumerate(instances)}
        # The gauges are read while the counts are: after a day's ranking, the worst instances' gauges added
        # ~50 ms to the live view's cold read when read after their counts (256 instances, 2 cores).
        gauged = _halves.submit(self._range_each, gauges_parts(selector, ("instance",), step_s), start, step_s,
                                n_points)
        rows = np.zeros((len(instances), n_points, N_COLUMNS))
        add = False
        if recorded and len(instances) > 1 and step_s > RECORDED_STEP_S:  # the server's sums: two halves at once
            halves = [instances[: len(instances) // 2], instances[len(instances) // 2:]]
            other = _halves.submit(self._recorded_counts, _selector(pool, halves[0]), INSTANCE, start, step_s,
                                   n_points, columns)
            series, add = self._recorded_counts(_selector(pool, halves[1]), INSTANCE, start, step_s, n_points, columns)
            counted = _by_instance(other.result()[0] + series)
        elif recorded:
            series, add = self._recorded_counts(selector, INSTANCE, start, step_s, n_points, columns)
            counted = _by_instance(series)
        else:
            counted = _by_instance(self._range_each(counts_parts(selector, ("instance",), step_s, columns=columns),
                                                    start, step_s, n_points))
        for name, i in position.items():
            _fill_counts(rows[i], counted.get(name, []), add=add)
        gauges = np.zeros((len(instances), n_points, len(GAUGES)))
        present = np.zeros((len(instances), n_points), dtype=bool)
        for labels, samples in gauged.result():
            i, column = position.get(labels.get("instance")), _gauge_column(labels, _GAUGE_COLUMN, None)
            if i is None:
                continue
            index, value = samples.valid
            if labels.get("column") == PRESENT:
                present[i, index] = value > 0
            elif column is not None:
                gauges[i, index, column] = value
        gauges[~present] = np.nan
        return list(zip(rows, gauges, strict=True))

    def _kept_points(self, key: tuple, pool: str, start: float, step_s: int, n_points: int, now: float,
                     read: Callable[[float, int], tuple[np.ndarray, ...]]) -> tuple[np.ndarray, ...]:
        """``read(start, n_points)``'s arrays (each [n_points, ...]), the final points kept and only the others
        read (``_held_points``)."""
        held = self._held_points(key, pool, start, step_s, n_points, now)
        first = held[2]
        return self._merge_points(held, read(start + first * step_s, n_points - first) if first < n_points else None,
                                  start, step_s, n_points)

    def _held_points(self, key: tuple, pool: str, start: float, step_s: int, n_points: int,
                     now: float) -> tuple[KeptPoints | None, float, int]:
        """(the kept points of ``key``, the newest point end that is final, the index of the first point of the
        window not kept: every one from there on is read). A point is final once the server has recorded a
        minute ``FINAL_AFTER_S`` past its end: its recorded minutes are written once and never change, and the
        raw gauges it reads were scraped by then. Where the server records nothing, nothing is kept."""
        newest = self._newest_recorded_minute(pool, now) if self.records() else None
        if newest is None:
            return None, -math.inf, 0
        kept = telemetry_cache.get((self.url, "points", step_s, *key), KeptPoints)
        first = kept.first_missing(start, step_s, n_points)
        return kept, newest - FINAL_AFTER_S, first

    @staticmethod
    def _merge_points(held: tuple[KeptPoints | None, float, int], fresh: tuple[np.ndarray, ...] | None,
                      start: float, step_s: int, n_points: int) -> tuple[np.ndarray, ...]:
        """The window's points: the kept ones before ``first``, then ``fresh`` (those read), whose final ones are
        kept from now on."""
        kept, final_end, first = held
        if kept is None:
            assert fresh is not None
            return fresh
        return kept.merged(start, step_s, first, fresh, final_end)

    def window_totals(self, *, pool, tier, window_s, start, now, instances=None, counters=None):
        if instances is not None and not instances:
            return WindowTotals([], np.zeros((0, N_COLUMNS)), np.zeros((0, len(GAUGES))))
        gauged = self._gauges_over(_selector(pool, instances), pool, window_s, start, now)
        names = _present(gauged)
        position = {name: i for i, name in enumerate(names)}
        columns = None if counters is None else frozenset(f"counter:{name}" for name in counters)
        if columns is None or columns:
            sums = self._window_counts(pool, window_s, start, now, names, columns)
        else:
            sums = np.zeros((len(names), N_COLUMNS))
        gauges = np.zeros((len(names), len(GAUGES)))
        for labels, samples in gauged:
            i, column = position.get(labels.get("instance")), _gauge_column(labels, _GAUGE_COLUMN, None)
            value = float(samples.value[0])
            if i is not None and column is not None and not math.isnan(value):
                gauges[i, column] = value
        return WindowTotals(names, sums, gauges)

    def window_quantile(self, *, pool, tier, window_s, start, now, q):
        # Who reported is read while the quantiles are: only the instances a span's part lacks wait for it.
        present = _halves.submit(lambda: _present(self._gauges_over(_selector(pool, None), pool, window_s, start,
                                                                    now, frozenset((PRESENT,)))))
        by_instance, _ = self._kept(("quantiles", pool, window_s, q), start, now,
                                    lambda first, at, previous: self._quantiles_at(pool, first, at, q, present.result,
                                                                                   halves=not previous))
        names = present.result()
        return names, np.array([by_instance.get(name, np.nan) for name in names])

    def _window_counts(self, pool: str, window_s: int, start: float, now: float, names: list[str],
                       columns: frozenset[str] | None) -> np.ndarray:
        """The counts [names, N_COLUMNS] of ``names`` over the window (only ``columns`` where given): those already
        read for the window's recorded minutes kept (``_kept``), the others read over the same minutes."""
        held, (first, at) = self._kept(("counts", pool, window_s, columns), start, now,
                                       lambda first, at, previous: self._counts_at(pool, first, at, list(previous),
                                                                                   columns))
        missing = [name for name in names if name not in held]
        if missing:
            held.update(self._counts_at(pool, first, at, missing, columns))
        return np.array([held[name] for name in names]).reshape(len(names), N_COLUMNS)

    def _counts_at(self, pool: str, start: float, at: float, names: list[str],
                   columns: frozenset[str] | None) -> dict[str, np.ndarray]:
        """The counts of ``names`` over [start, at] (the recorded minutes evaluated in it, as the window's points
        count them), by name."""
        if not names:
            return {}
        position = {name: i for i, name in enumerate(names)}
        rows = np.zeros((len(names), N_COLUMNS))
        recorded = self.records()
        counts = counts_parts(_selector(pool, names), ("instance",), _since(start, at), recorded=recorded,
                              columns=columns, span=self._summed_span(pool, start, at) if recorded else None)
        _fill_counts(rows, _at_instance(self._instant_each(counts, at), position))
        return dict(zip(names, rows, strict=True))

    def _kept(self, key: tuple, start: float, now: float,
              read: Callable[[float, float, dict], dict]) -> tuple[dict, tuple[float, float]]:
        """``read(start, at, previous)``'s answer over [start, at] and that span: kept in this process for its
        window start and recorded minute (``at``), or read afresh at ``now`` where the server records none.

        When the server has recorded a newer minute since the kept answer (the window may have moved on a
        point with it), the kept one is still given, its minute up to ``STALE_FOR_S`` behind, while a thread
        reads the new one (``previous``, the kept answer, says what to read again): the poll just after a
        minute costs no more than any other, and a later one gets the new minute. Further behind, or with
        nothing kept, the read is made now."""
        newest = self._newest_recorded_minute(key[1], now) if self.records() else None
        if newest is None:
            return read(start, now, {}), (start, now)
        held = telemetry_cache.get((self.url, *key), KeptAnswer)
        answer = held.answer  # read once: another thread may replace it, never change it
        if answer is not None and answer[0] == (start, newest):
            return answer[1], answer[0]
        if answer is not None and answer[0][0] <= start and 0 < newest - answer[0][1] <= STALE_FOR_S:
            held.refresh(lambda: ((start, newest), read(start, newest, answer[1])))
            return answer[1], answer[0]
        answer = held.answer = ((start, newest), read(start, newest, {}))
        return answer[1], answer[0]

    def _quantiles_at(self, pool: str, start: float, at: float, q: float, names: Callable[[], list[str]],
                      halves: bool = True) -> dict[str, float]:
        """Each instance's latency quantile ``q`` in ms over [start, at], computed where the buckets are: one
        value per instance comes back, not its every bucket. With ``halves``, asked as two halves of the pool at
        once (``_HALF``): at 256 instances and a day, 0.38-0.42 s against 0.55 s as one query (measured, 2
        cores). A refresh of a kept answer asks it whole: it runs beside the polls, which then keep a core (the
        first polls after a new minute took 157-205 ms with the refresh in halves, 36-101 ms before). Over summed
        blocks, the instances with every part of the span are asked first (``quantile_query``'s ``matched``),
        then those of ``names()`` (the instances present) it left out, over whichever parts they have."""
        recorded = self.records()
        span = self._summed_span(pool, start, at) if recorded else None
        selector = _selector(pool, None)

        def read(selected: str, matched: bool) -> list[tuple[dict, Samples]]:
            return self._instant(quantile_query(q, selected, _since(start, at), recorded, span, matched), at)

        matched = span is not None
        if halves:
            half = _halves.submit(read, f"{selector}, instance=~{_HALF}", matched)
            rest = read(f"{selector}, instance!~{_HALF}", matched)
            answer = half.result() + rest
        else:
            answer = read(selector, matched)
        if matched:
            given = {labels.get("instance") for labels, _ in answer}
            if missing := [name for name in names() if name not in given]:
                answer += read(_selector(pool, missing), False)
        by_instance = {}
        for labels, samples in answer:
            value = float(samples.value[0])
            if isinstance(labels.get("instance"), str) and not math.isnan(value):
                by_instance[labels["instance"]] = value * 1000.0
        return by_instance

    def _gauges_over(self, selector: str, pool: str, window_s: int, start: float, now: float,
                     columns: frozenset[str] | None = None) -> list[tuple[dict, Samples]]:
        """Each instance's newest gauges in [start, now] (``gauges_query``'s, by instance). Where the server
        records the minutes: those up to the newest recorded minute read over its blocks and the raw samples
        at their edges, kept as the window's other answers are (``_kept``), and only the raw samples since
        that minute read on every poll, the newer value of each series winning. Otherwise the raw samples."""
        if not self.records():
            return self._instant_each(gauges_parts(selector, ("instance",), _since(start, now), columns=columns), now)

        def read(first: float, at: float, _previous: dict) -> dict:
            span = self._span(pool, first, at)
            answer = self._instant_each(gauges_parts(selector, ("instance",), _since(first, at), columns=columns,
                                                     span=span), at)
            return {tuple(sorted(labels.items())): (labels, samples) for labels, samples in answer}

        held, (_, at) = self._kept(("gauges", pool, window_s, selector, columns), start, now, read)
        if at >= now:  # nothing recorded yet: read whole, up to now
            return list(held.values())
        # The scrapes since the kept answer's minute (and one minute before it: a scrape lands after its time).
        recent = self._instant_each(gauges_parts(selector, ("instance",), _since(at - RECORDED_STEP_S, now),
                                                 columns=columns), now, apart=False)
        merged = dict(held)  # the kept label dicts are only read, never changed, by every caller
        merged.update((tuple(sorted(labels.items())), (labels, samples)) for labels, samples in recent)
        return list(merged.values())

    def _span(self, pool: str, start: float, end: float, probe: str = BLOCK_PROBE_RECORD) -> Span | None:
        """The window (start, end] as the pool's recorded blocks (of the group ``probe`` says were recorded: the
        gauges' or the summed minutes') and the edges they leave, or None where no whole block lies in it
        (then the minutes or raw samples are read alone)."""
        if end - start < 2 * BLOCK_S:
            return None
        runs = block_runs(self._block_stamps(pool, start, probe), start, end)
        return Span(start, end, runs) if runs else None

    def _summed_span(self, pool: str, start: float, end: float) -> Span | None:
        """The span of summed blocks a window's counts are read over, or None (its minutes are read) for a window
        shorter than ``SUMS_FROM_S``: three selections of every series (the blocks and two edges) cost the
        server more than a few hundred minutes each (measured at 256 instances, the P99 ranking on a server
        that compacted a day of history: 24 h, 0.55 s over the blocks against 0.92-1.00 s over the minutes;
        6 h, 0.49-0.55 s against 0.38)."""
        if end - start < SUMS_FROM_S:
            return None
        span = self._span(pool, start, end, SUMS_PROBE_RECORD)
        if span is None or end - start < ROLLED_BLOCKS * BLOCK_S:
            return span
        blocks = self._block_stamps(pool, start, SUMS_PROBE_RECORD)
        return span._replace(rolled=rolled_stamps(self._block_stamps(pool, start, ROLLED_PROBE_RECORD), blocks))

    def _block_stamps(self, pool: str, start: float, probe: str = BLOCK_PROBE_RECORD) -> np.ndarray:
        """When the pool's blocks since ``start`` were recorded (seconds): read once, then again only once a
        newer block may be there (``BLOCK_S`` after the newest) or for a window reaching further back. A
        block, once recorded, never changes, so any of them known is a block to read."""
        now = time.time()
        known = _block_stamps.get((self.url, pool, probe))
        if known is not None:
            stamps, since, due = known
            if since <= start and now < due:
                return stamps
        since = min(start, now - 25 * 3600)  # a day's window and a margin: one read serves every window
        answer = self._get("/api/v1/query", query=f"{probe}{{pool={_label(pool)}}}[{_ms(now - since)}ms]",
                           time=f"{now:.3f}")
        raws = [pair[0] for item in answer for pair in (item.get("values") or ())
                if isinstance(pair, list | tuple) and len(pair) == 2]
        stamps = _counts_of(raws)
        stamps = stamps[~np.isnan(stamps)]
        # Asked again once the next block is due (its evaluation a little after its stamp), or in a minute
        # where the pool has none yet.
        due = float(stamps.max()) + BLOCK_S + 5.0 if len(stamps) else now + RECORDED_STEP_S
        _block_stamps[self.url, pool, probe] = (stamps, since, max(due, now + 5.0))
        return stamps

    def _newest_recorded_minute(self, pool: str, now: float) -> float | None:
        """When the newest minute of the pool's instance-level counts was recorded (seconds), or None (none
        within Prometheus's lookback), asked once per read. The rules run in order, each one's minute written
        at once: the last one's minute is one every count holds."""
        if (pool, now) not in self._newest:
            record = counted_record(COUNTED[-1][0], COUNTED[-1][1], INSTANCE)
            answer = self._instant(f"max(timestamp({record}{{{_selector(pool, None)}}}))", now)
            newest = float(answer[0][1].value[0]) if answer else math.nan
            self._newest[pool, now] = None if math.isnan(newest) else newest
        return self._newest[pool, now]


class KeptPoints:
    """One series' final points (a pool's, an instance's), by the time their point ends (seconds) and width: a
    point's arrays (its counts, its gauges) never change once final, so a poll reads only the points after
    the kept ones. At most ``MAX_KEPT_POINTS`` are kept, the oldest dropped first."""

    def __init__(self):
        self._points: dict[float, tuple[np.ndarray, ...]] = {}
        self._lock = threading.Lock()
        self._nbytes = 0  # kept as points come and go: the cache sums every entry's on every read

    def first_missing(self, start: float, step_s: int, n_points: int) -> int:
        with self._lock:
            for i in range(n_points):
                if start + (i + 1) * step_s not in self._points:
                    return i
        return n_points

    def merged(self, start: float, step_s: int, first: int, fresh: tuple[np.ndarray, ...] | None,
               final_end: float) -> tuple[np.ndarray, ...]:
        with self._lock:
            held = [self._points[start + (i + 1) * step_s] for i in range(first)]
            if fresh is not None:
                for i in range(len(fresh[0])):
                    end = start + (first + i + 1) * step_s
                    if end <= final_end and end not in self._points:
                        point = self._points[end] = tuple(part[i].copy() for part in fresh)
                        self._nbytes += _point_nbytes(point)
                while len(self._points) > MAX_KEPT_POINTS:
                    self._nbytes -= _point_nbytes(self._points.pop(min(self._points)))
        if not held:
            assert fresh is not None
            return fresh
        parts = tuple(np.stack(column) for column in zip(*held, strict=True))
        return parts if fresh is None else tuple(np.concatenate(pair) for pair in zip(parts, fresh, strict=True))

    @property
    def nbytes(self) -> int:
        return self._nbytes


def _point_nbytes(point: tuple[np.ndarray, ...]) -> int:
    return sum(part.nbytes for part in point) + 100


@dataclass
class KeptAnswer:
    """An answer over a window's recorded minutes (by instance), and the (window start, newest recorded
    minute) it holds; ``refreshing``, the thread reading its successor (at most one at a time)."""

    answer: tuple[tuple[float, float], dict] | None = None
    refreshing: Future | None = None

    def refresh(self, read: Callable[[], tuple[tuple[float, float], dict]]) -> None:
        """Replace the answer by ``read()``'s on the refresh thread, unless it is queued or at it already."""
        if self.refreshing is not None and not self.refreshing.done():
            return

        def run():
            try:
                self.answer = read()
            except Unavailable as exc:  # the kept answer stays; the next poll past it reads again
                logger.warning("A history answer could not be brought up to date: %s", exc)

        self.refreshing = _refresher.submit(run)

    @property
    def nbytes(self) -> int:
        return 0 if self.answer is None else (N_COLUMNS * 8 + 100) * len(self.answer[1])


def _joined(exprs: list[str]) -> list[str]:
    """The parts of one read as one query (none for none)."""
    return [" or ".join(exprs)] if exprs else []


def _each(read: Callable[[str], list], exprs: list[str]) -> list:
    """``read`` of every expression, the first in this thread and the others at once on ``_parts``; their answers
    concatenated in order."""
    others = [_parts.submit(read, expr) for expr in exprs[1:]]
    answer = read(exprs[0]) if exprs else []
    for other in others:
        answer += other.result()
    return answer


def _selector(pool: str, instances: list[str] | None) -> str:
    """The pool's series, or only those of ``instances``."""
    if instances is None:
        return f"pool={_label(pool)}"
    return f"pool={_label(pool)}, instance=~{_label('|'.join(instances))}"


def _since(start: float, now: float) -> str:
    """The range back from ``now`` to ``start`` as a PromQL duration, to the millisecond: an answer over it
    depends on the window's start, not on the moment it is asked."""
    return f"{max(1, round((now - start) * 1000))}ms"


def _present(gauged: list[tuple[dict, Samples]]) -> list[str]:
    """The instances with a sample in a ``gauges_query`` answer, by name."""
    return sorted({labels["instance"] for labels, _ in gauged
                   if labels.get("column") == PRESENT and isinstance(labels.get("instance"), str)})


def _at_instance(series: list[tuple[dict, Samples]], position: dict[str, int]) -> list[tuple[dict, Samples]]:
    """An instant answer's series, each value at its instance's row (those of other instances left out)."""
    return [(labels, Samples(np.full(len(samples.index), position[labels["instance"]]), samples.value))
            for labels, samples in series
            if labels.get("instance") in position]


def _by_instance(series: list[tuple[dict, Samples]]) -> dict[str, list[tuple[dict, Samples]]]:
    grouped: dict[str, list[tuple[dict, Samples]]] = {}
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
