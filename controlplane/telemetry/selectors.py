"""Dashboard data for one pool over a window: what the browser draws, computed where the data is.

- ``pool_metrics``: the pool's series from the pool rollups (merged histograms, summed counters),
  the window's totals, the ``top`` worst instances (by window P99 or by HBM pressure) with their
  own series, and the publishes as annotations. Polls are incremental: with ``since`` (the start of
  the last point the client holds) only points from there on are sent, and a top instance's series
  too if the client says it holds it (``known``).
- ``instance_table``: every instance's window figures, sorted and paged.
- ``instance_metrics``: one instance's series (the drill-down), incremental in the same way.
"""

from __future__ import annotations

import math
import time
from datetime import UTC, datetime

import numpy as np

from controlplane.audit import selectors as audit_selectors
from controlplane.audit.models import AuditEntry
from controlplane.policies import selectors as policy_selectors
from controlplane.policies.models import Pool
from relay_engine.core.config import slo_of
from relay_engine.core.outcomes import OUTCOME_COUNTERS, TIER_LABELS, TIERS, Outcome
from relay_engine.core.telemetry import GAUGES, MISS_REASONS, REFUSAL_REASONS, TIER_LEVEL_GAUGES
from relay_engine.core.wire import LIVE_TIER, TELEMETRY_TIERS

from .history import (
    COUNTER_COLUMN,
    GAUGE_COLUMN,
    MISS_COLUMN,
    N_COLUMNS,
    REFUSAL_COLUMN,
    SUM_COLUMN,
)
from .merge import latency_counts, quantiles
from .promql import BUCKET_PART
from .rollups import POOL_GAUGE_COLUMN, POOL_GAUGES
from .sources import history_point_s, history_source, redis_tiers

# Window → (seconds, telemetry tier read). Coarser tiers for longer windows keep reads small.
WINDOWS: dict[str, tuple[int, str]] = {"5m": (300, "1s"), "1h": (3600, "10s"), "6h": (21600, "60s"),
                                       "24h": (86400, "60s")}
# At most this many points per series: a 24 h window is drawn at 4-minute resolution.
MAX_POINTS = 360


def window_grid(window: str, now: float) -> tuple[str, int, float, int]:
    """(tier, step_s, start, n_points): aligned buckets covering the window up to now, each a whole number
    of the tier's steps (and of the recording rules' minutes where Prometheus holds the window)."""
    window_s, tier = WINDOWS[window]
    point_s = max(TELEMETRY_TIERS[tier][0], history_point_s(window_s))
    step_s = point_s * max(1, math.ceil(window_s / MAX_POINTS / point_s))
    n_points = window_s // step_s
    end = (math.floor(now / step_s) + 1) * step_s
    return tier, step_s, end - n_points * step_s, n_points


def refusal_reasons() -> list[dict]:
    """The pre-infer refusal reasons in the core's order, as the browser names them: ``reason`` (the
    key of ``preinfer_refused``), ``label``, and ``refusal`` (``RefusalReason.is_refusal``)."""
    return [{"reason": reason.value, "label": reason.label, "refusal": reason.is_refusal}
            for reason in REFUSAL_REASONS]


def miss_reasons() -> list[dict]:
    """Why a ranking request found its prefix in no tier, in the core's order, as the browser names it:
    ``reason`` (the key of ``misses_by_reason`` and ``misses_per_s``), ``label``, ``family`` (what the
    reason is one case of: ``MissReason.family``) with ``family_label``, and ``detail`` (the tier or the
    refusal reason it names; "" for none)."""
    return [{"reason": reason.value, "label": reason.label, "family": reason.family,
             "family_label": reason.family.replace("_", " "), "detail": reason.detail}
            for reason in MISS_REASONS]


def lookup_outcomes() -> list[dict]:
    """Where a lookup can be served from, in the core's order, as the browser names it: ``outcome`` (the
    key of ``lookup_ratio``) and ``label``."""
    return [{"outcome": outcome.value, "label": outcome.label} for outcome in Outcome]


def cache_tiers() -> list[dict]:
    """Every cache tier the core can run, in lookup order, as the browser reads it: ``tier``, ``label``
    and the names of its level gauges in the series answers (``bytes``: used, ``budget_bytes``)."""
    gauge_of = {levels: name for name, levels in TIER_LEVEL_GAUGES.items()}
    return [{"tier": tier.value, "label": TIER_LABELS.get(tier, tier.value), "bytes": gauge_of[tier.value, "bytes"],
             "budget_bytes": gauge_of[tier.value, "budget_bytes"]} for tier in TIERS]


def _json_rows(series: dict[str, np.ndarray], as_int: bool = False) -> dict[str, list]:
    """Series (any shape) → JSON-ready nested lists in one conversion: rounded (or integers), no data
    (NaN) as null."""
    if not series:
        return {}
    matrix = np.stack(list(series.values()))
    finite = np.isfinite(matrix)
    if as_int:
        values = np.where(finite, matrix, 0).astype(np.int64).astype(object)
    else:
        values = np.round(matrix, 4).astype(object)
    values[~finite] = None
    return dict(zip(series, values.tolist(), strict=True))


def _ratio(part: np.ndarray, whole: np.ndarray) -> np.ndarray:
    return np.divide(part, whole, out=np.full(np.shape(whole), np.nan), where=whole > 0)


def _counter(sums: np.ndarray, name: str) -> np.ndarray:
    return sums[..., COUNTER_COLUMN[name]]


# The worst instances of a pool view: how many by default and at most, and what ranks them.
TOP_DEFAULT = 8
TOP_MAX = 64
RANKINGS = ("p99", "hbm")  # window P99 (merged buckets); newest HBM bytes / HBM budget
STICKINESS = 0.05  # the head start of an instance already listed (``_ranked``)
# What a top instance's series carry (the drill-down has every figure).
TOP_FIGURES = ("p50_ms", "p99_ms", "rank_per_s", "slo_compliance_ratio")
TOP_GAUGES = ("hbm_bytes", "hbm_budget_bytes")
# The counts those figures are made of (``promql.counts_query``'s tags): only these are read of the instances.
TOP_PARTS = frozenset((BUCKET_PART, "counter:rank_requests", "counter:rank_within_slo"))
# The per-instance table: its columns, each one a sort key (``-`` first: descending).
TABLE_COLUMNS = ("instance", "rank_requests", "rank_per_s", "p50_ms", "p99_ms", "slo_compliance_ratio",
                 "hbm_hit_ratio", "miss_ratio", "preinfer_admitted", "hbm_bytes", "hbm_budget_bytes",
                 "hbm_pressure", "applied_generation")
TABLE_DEFAULT_SORT = "-p99_ms"
TABLE_COUNT_COLUMNS = frozenset(("rank_requests", "preinfer_admitted", "hbm_bytes", "hbm_budget_bytes",
                                 "applied_generation"))  # whole numbers; the others are figures or null
# What ranking every instance by one column reads of each: a latency quantile (computed where the buckets
# are), or the counters the column is a figure of (the gauges come with any read; ``instance`` needs none).
_QUANTILE_COLUMNS = {"p50_ms": 0.50, "p99_ms": 0.99}
_COLUMN_COUNTERS: dict[str, tuple[str, ...]] = {
    "rank_requests": ("rank_requests",),
    "rank_per_s": ("rank_requests",),
    "slo_compliance_ratio": ("rank_within_slo", "rank_requests"),
    "hbm_hit_ratio": tuple(OUTCOME_COUNTERS.values()),
    "miss_ratio": tuple(OUTCOME_COUNTERS.values()),
    "preinfer_admitted": ("preinfer_admitted",),
}
_RANKING_COLUMN = {"p99": "p99_ms", "hbm": "hbm_pressure"}  # each of ``RANKINGS`` as a table column
# Figures by a word of the core, sent nested (``{"preinfer_refused_per_s": {reason: […]}}``).
_REFUSED = "preinfer_refused_per_s."
_MISSED = "misses_per_s."  # misses by reason (``MISS_REASONS``)
_LOOKUPS = "lookup_ratio."  # the share of lookups served each way, by outcome (every one the core knows)
_NESTED = (_REFUSED, _MISSED, _LOOKUPS)


def _figures(sums: np.ndarray, step_s: float, names: tuple[str, ...] | None = None) -> dict[str, np.ndarray]:
    """The per-bucket figures of one set of summed differences (the pool's, or one instance's)."""
    counts = latency_counts(sums)
    lookups = sum(_counter(sums, name) for name in OUTCOME_COUNTERS.values())  # every rank, once
    rank_requests = _counter(sums, "rank_requests")
    p50, p99 = quantiles(counts, (0.50, 0.99))
    figures = {
        "p50_ms": p50,
        "p99_ms": p99,
        "mean_ms": _ratio(sums[..., SUM_COLUMN], counts.sum(axis=-1)),
        "rank_per_s": rank_requests / step_s,
        "rank_ok_per_s": _counter(sums, "rank_ok") / step_s,
        "rank_within_slo_per_s": _counter(sums, "rank_within_slo") / step_s,
        "rank_errors_per_s": _counter(sums, "rank_errors") / step_s,
        "rank_deadline_exceeded_per_s": _counter(sums, "rank_deadline_exceeded") / step_s,
        "slo_compliance_ratio": _ratio(_counter(sums, "rank_within_slo"), rank_requests),
        "hbm_hit_ratio": _ratio(_counter(sums, "hbm_hits"), lookups),
        "hit_ratio": _ratio(lookups - _counter(sums, "misses"), lookups),  # served without a recompute
        **{_LOOKUPS + outcome: _ratio(_counter(sums, counter), lookups) for outcome, counter in OUTCOME_COUNTERS.items()},
        "preinfer_signals_per_s": _counter(sums, "preinfer_signals") / step_s,
        "preinfer_admitted_per_s": _counter(sums, "preinfer_admitted") / step_s,
        **{_REFUSED + reason: sums[..., REFUSAL_COLUMN[reason]] / step_s for reason in REFUSAL_REASONS},
        **{_MISSED + reason: sums[..., MISS_COLUMN[reason]] / step_s for reason in MISS_REASONS},
        "evictions_per_s": _counter(sums, "evictions") / step_s,
        "demotions_per_s": _counter(sums, "demotions") / step_s,
        "promotions_per_s": _counter(sums, "promotions") / step_s,
        "dedup_reloads_per_s": _counter(sums, "dedup_reloads") / step_s,
    }
    return figures if names is None else {name: figures[name] for name in names}


# The per-point figures every series answer may carry, named where they are computed (the API's schema
# lists them); the figures by a word of the core nest apart (``_nest``).
SERIES_FIGURES = tuple(name for name in _figures(np.zeros((1, N_COLUMNS)), 1.0)
                       if not name.startswith(_NESTED))


def _nest(rows: dict[str, list]) -> dict[str, object]:
    """``<figure>.<word>`` keys (``lookup_ratio.disk``) → one ``<figure>: {word: […]}`` each."""
    out: dict[str, object] = {k: v for k, v in rows.items() if not k.startswith(_NESTED)}
    for prefix in _NESTED:
        nested = {k[len(prefix):]: v for k, v in rows.items() if k.startswith(prefix)}
        if nested:
            out[prefix.rstrip(".")] = nested
    return out


def _window_figures(window: np.ndarray) -> dict[str, np.ndarray]:
    """Whole-window figures of summed counts [..., N_COLUMNS] (quantiles from the merged buckets)."""
    lookups = sum(window[..., COUNTER_COLUMN[name]] for name in OUTCOME_COUNTERS.values())
    p50, p99 = quantiles(latency_counts(window), (0.5, 0.99))
    requests = window[..., COUNTER_COLUMN["rank_requests"]]
    return {
        "rank_requests": requests,
        "rank_within_slo": window[..., COUNTER_COLUMN["rank_within_slo"]],
        "p50_ms": p50,
        "p99_ms": p99,
        "slo_compliance_ratio": _ratio(window[..., COUNTER_COLUMN["rank_within_slo"]], requests),
        "hbm_hit_ratio": _ratio(window[..., COUNTER_COLUMN["hbm_hits"]], lookups),
        "hit_ratio": _ratio(lookups - window[..., COUNTER_COLUMN["misses"]], lookups),
        "miss_ratio": _ratio(window[..., COUNTER_COLUMN["misses"]], lookups),
        "preinfer_admitted": window[..., COUNTER_COLUMN["preinfer_admitted"]],
    }


def _number(value: float, digits: int, as_int: bool = False) -> float | int | None:
    if not math.isfinite(value):
        return None
    return int(value) if as_int else round(float(value), digits)


def _totals(window: np.ndarray) -> dict[str, float | int | None]:
    """Whole-window figures of the window's summed counts [N_COLUMNS] (quantiles from the merged buckets)."""
    figures = _window_figures(window)
    return {
        "rank_requests": int(window[COUNTER_COLUMN["rank_requests"]]),
        "rank_within_slo": int(window[COUNTER_COLUMN["rank_within_slo"]]),
        "p50_ms": _number(figures["p50_ms"], 4),
        "p99_ms": _number(figures["p99_ms"], 4),
        "slo_compliance_ratio": _number(figures["slo_compliance_ratio"], 6),
        "hbm_hit_ratio": _number(figures["hbm_hit_ratio"], 6),
        "hit_ratio": _number(figures["hit_ratio"], 6),
        "preinfer_admitted": int(window[COUNTER_COLUMN["preinfer_admitted"]]),
        "preinfer_refused": {reason: int(window[REFUSAL_COLUMN[reason]]) for reason in REFUSAL_REASONS},
        "misses": int(window[COUNTER_COLUMN["misses"]]),
        "misses_by_reason": {reason: int(window[MISS_COLUMN[reason]]) for reason in MISS_REASONS},
    }


_Action = AuditEntry.Action
_CANARY_ENDS = {_Action.ROLLOUT_PROMOTE: ("promoted", "promoted"), _Action.ROLLOUT_ROLLBACK: ("rolled_back", "rolled back"),
                _Action.ROLLOUT_ABORT: ("aborted", "aborted")}


def _annotation(entry: AuditEntry) -> dict | None:
    """One mark of the charts: ``kind``, the ``generation`` it is about, a short ``label`` and the
    ``detail`` its hover text says; None for an entry that names no generation."""
    after = entry.after if isinstance(entry.after, dict) else {}
    actor = entry.actor
    if entry.action == _Action.POOL_CREATE:
        generation, kind, label = 1, "created", "gen 1"
        detail = f"Pool created by {actor}: generation 1 desired"
    elif entry.action == _Action.REVISION_PUBLISH:
        generation, restored = after.get("desired_generation"), after.get("restored_from")
        kind = "rollback" if restored else "publish"
        label = f"rollback gen {generation}" if restored else f"gen {generation}"
        detail = (f"Rollback by {actor}: generation {generation} restores generation {restored}" if restored
                  else f"Generation {generation} published by {actor}")
    elif entry.action == _Action.ROLLOUT_START:
        generation, kind, label = after.get("generation"), "canary", f"canary gen {after.get('generation')}"
        detail = (f"Canary of generation {generation} started by {actor} on {', '.join(map(str, after.get('canary', [])))}"
                  f" (bake {after.get('bake_s')} s, max burn {after.get('max_burn')})")
    else:
        kind, word = _CANARY_ENDS[entry.action]
        generation, label = after.get("generation"), f"{word} gen {after.get('generation')}"
        reason = str(after.get("reason", ""))
        # A decision by hand gives "aborted by sre" as its reason: said already.
        detail = f"Canary of generation {generation} {word} by {actor}" + (
            f": {reason}" if reason and not reason.startswith(f"{word} by") else "")
    if not isinstance(generation, int) or isinstance(generation, bool):
        return None
    return {"ts": round(entry.time.timestamp(), 3), "generation": generation, "kind": kind, "actor": actor,
            "sha256": after.get("sha256"), "label": label, "detail": detail}


def _annotations(pool: Pool, start: float) -> list[dict]:
    """The window's marks, oldest first. A promotion publishes its generation: the promotion's mark
    says it, so that publish gets none of its own."""
    entries = list(audit_selectors.timeline_events(pool=pool.name, since=datetime.fromtimestamp(start, tz=UTC)))
    promoted = {(entry.after or {}).get("generation") for entry in entries if entry.action == _Action.ROLLOUT_PROMOTE}
    marks = [_annotation(entry) for entry in entries]
    return [mark for mark in marks if mark is not None
            and not (mark["kind"] == "publish" and mark["generation"] in promoted)]


def _frame(pool: Pool, window: str, now: float) -> dict:
    """What every answer about a window says: its grid, the SLO, the publishes in it."""
    tier, step_s, start, n_points = window_grid(window, now)
    spec = getattr(pool, "desired_spec", None) or policy_selectors.revision_desired(pool=pool).spec
    return {"pool": pool.name, "window": window, "tier": tier, "step_s": step_s, "start": start,
            "end": start + n_points * step_s, "slo_ms": slo_of(spec).p99_ms,
            "slo_target_ratio": slo_of(spec).target_ratio, "annotations": _annotations(pool, start)}


def first_point(since: float | None, start: float, step_s: int, n_points: int) -> int:
    """Index of the first point an incremental poll gets: the one starting at ``since`` (which may
    have grown since), or the whole window when ``since`` is absent or outside it."""
    if since is None or since < start:
        return 0
    return min(n_points - 1, int((since - start) // step_s))


def _table_columns(totals, elapsed_s: float) -> dict[str, np.ndarray]:
    """Every number column of the table, per instance of ``totals``."""
    figures = _window_figures(totals.sums)
    return {
        **figures,
        "rank_per_s": figures["rank_requests"] / elapsed_s,
        **{name: totals.gauges[:, GAUGE_COLUMN[name]] for name in ("hbm_bytes", "hbm_budget_bytes",
                                                                   "applied_generation")},
        "hbm_pressure": _ratio(totals.gauges[:, GAUGE_COLUMN["hbm_bytes"]],
                               totals.gauges[:, GAUGE_COLUMN["hbm_budget_bytes"]]),
    }


def _column_values(source, column: str, *, pool: str, tier: str, window_s: int, start: float,
                   now: float) -> tuple[list[str], np.ndarray]:
    """Every instance that reported in the window (by name) and its value of one number column of the table,
    reading of each only what that column needs."""
    window = {"pool": pool, "tier": tier, "window_s": window_s, "start": start, "now": now}
    if column in _QUANTILE_COLUMNS:
        return source.window_quantile(**window, q=_QUANTILE_COLUMNS[column])
    totals = source.window_totals(**window, counters=_COLUMN_COUNTERS.get(column, ()))
    return totals.names, _table_columns(totals, max(1.0, now - start))[column]


def _ranked(names: list[str], values: np.ndarray, known: tuple[str, ...] = ()) -> list[tuple[str, float | None]]:
    """(instance, ranking value), worst first; instances without a value last, by name. An instance
    the client already shows (``known``) is ranked as if ``STICKINESS`` worse: a newcomer displaces it
    only by being clearly worse, so near-equal instances do not take turns in the list every poll."""
    shown = set(known)
    ranked = np.nan_to_num(values) * np.array([1 + STICKINESS if name in shown else 1.0 for name in names])
    order = sorted(range(len(names)), key=lambda i: (math.isnan(values[i]), -ranked[i], names[i]))
    return [(names[i], _number(values[i], 6)) for i in order]


def _instance_series(points: tuple[np.ndarray, np.ndarray], first: int, step_s: int,
                     figures: tuple[str, ...] | None, gauges: tuple[str, ...]) -> dict:
    sums, levels = points
    series = _json_rows({name: values[first:] for name, values in _figures(sums, step_s, figures).items()})
    series.update(_json_rows({name: levels[first:, GAUGE_COLUMN[name]] for name in gauges}, as_int=True))
    return _nest(series)


def pool_metrics(*, pool: Pool, window: str, since: float | None = None, top: int = TOP_DEFAULT,
                 rank_by: str = "p99", known: tuple[str, ...] = (), now: float | None = None) -> dict:
    now = time.time() if now is None else now
    tier, step_s, start, n_points = window_grid(window, now)
    window_s = WINDOWS[window][0]
    first = first_point(since, start, step_s, n_points)
    with history_source(window_s) as source:
        # The ranking of every instance is read while the pool's series are (the longest two reads of a cold
        # window, at once where the source allows it).
        ranking = source.ahead(lambda: _column_values(source, _RANKING_COLUMN[rank_by], pool=pool.name, tier=tier,
                                                      window_s=window_s, start=start, now=now)) if top > 0 else None
        sums, levels, window_sums = source.pool_points(pool=pool.name, tier=tier, start=start, step_s=step_s, n_points=n_points,
                                          now=now)
        fleet = _nest(_json_rows({name: values[first:] for name, values in _figures(sums, step_s).items()}))
        fleet.update(_json_rows({name: levels[first:, POOL_GAUGE_COLUMN[name]] for name in POOL_GAUGES},
                                as_int=True))
        fleet["totals"] = _totals(window_sums)
        answer = {**_frame(pool, window, now), "from": start + first * step_s,
                  "timestamps": [start + i * step_s for i in range(first, n_points)], "fleet": fleet}
        if ranking is None:
            return answer
        names, values = ranking()
        # The list shows the chosen ones worst first by their own values.
        chosen = sorted(_ranked(names, values, known)[:top], key=lambda item: (item[1] is None, -(item[1] or 0)))
        # Only the points a poll sends are read: from ``first`` for an instance the client holds, all for a newcomer.
        points: dict[str, tuple[np.ndarray, np.ndarray]] = {}
        for held in {first if name in known else 0 for name, _ in chosen}:
            names_held = [name for name, _ in chosen if (first if name in known else 0) == held]
            points.update(zip(names_held, source.instance_points(
                pool=pool.name, tier=tier, instances=names_held, window_s=window_s, start=start + held * step_s,
                step_s=step_s, n_points=n_points - held, now=now, parts=TOP_PARTS), strict=True))
    worst = []
    for name, value in chosen:
        held = first if name in known else 0
        series = _instance_series(points[name], 0, step_s, TOP_FIGURES, TOP_GAUGES)
        worst.append({"instance": name, "value": value, "from": start + held * step_s, **series})
    answer["top"] = {"by": rank_by, "n": top, "reporting": len(names), "instances": worst}
    return answer


def instance_table(*, pool: Pool, window: str, sort: str = TABLE_DEFAULT_SORT, limit: int = 25,
                   offset: int = 0, now: float | None = None) -> dict:
    """Every instance that reported in the window with its window figures, sorted by ``sort`` (a
    ``TABLE_COLUMNS`` name, ``-`` first for descending; no value sorts last either way), paged."""
    now = time.time() if now is None else now
    tier, _, start, _ = window_grid(window, now)
    window_s = WINDOWS[window][0]
    elapsed_s = max(1.0, now - start)
    key = sort.lstrip("-")
    # Every instance is ordered by the sort column alone; only the page's rows are read whole.
    with history_source(window_s) as source:
        if key == "instance":
            names = source.window_totals(pool=pool.name, tier=tier, window_s=window_s, start=start, now=now,
                                         counters=()).names
            values = list(names)
        else:
            names, raw = _column_values(source, key, pool=pool.name, tier=tier, window_s=window_s, start=start,
                                        now=now)
            values = [_table_number(key, value) for value in raw]
        keyed = sorted(zip(names, values, strict=True))
        with_value = [item for item in keyed if item[1] is not None]
        with_value.sort(key=lambda item: item[1], reverse=sort.startswith("-"))
        ordered = [name for name, _ in with_value + [item for item in keyed if item[1] is None]]
        page = ordered[offset:offset + limit]
        totals = source.window_totals(pool=pool.name, tier=tier, window_s=window_s, start=start, now=now,
                                      instances=page)
    columns = _table_columns(totals, elapsed_s)
    rows = {name: {"instance": name, **{column: _table_number(column, columns[column][i])
                                        for column in TABLE_COLUMNS[1:]}}
            for i, name in enumerate(totals.names)}
    return {"pool": pool.name, "window": window, "start": start, "sort": sort, "count": len(ordered),
            "limit": limit, "offset": offset, "results": [rows[name] for name in page if name in rows]}


def _table_number(column: str, value: float) -> float | int | None:
    """One cell of the table as it is sent (and sorted): rounded, or a whole number, or null."""
    return _number(value, 4 if column.endswith("_ms") else 6, column in TABLE_COUNT_COLUMNS)


def instance_metrics(*, pool: Pool, instance: str, window: str, since: float | None = None,
                     now: float | None = None) -> dict:
    """One instance's series over the window (every figure), its window totals, the publishes."""
    now = time.time() if now is None else now
    tier, step_s, start, n_points = window_grid(window, now)
    first = first_point(since, start, step_s, n_points)
    window_s = WINDOWS[window][0]
    with history_source(window_s) as source:
        [points] = source.instance_points(pool=pool.name, tier=tier, instances=[instance], window_s=window_s,
                                          start=start, step_s=step_s, n_points=n_points, now=now)
    series, sums = _instance_series(points, first, step_s, None, GAUGES), points[0]
    return {**_frame(pool, window, now), "instance": instance, "from": start + first * step_s,
            "timestamps": [start + i * step_s for i in range(first, n_points)],
            "series": series, "totals": _totals(sums.sum(axis=0))}


def pool_counts(*, pool: Pool, start_s: float, end_s: float, now: float | None = None) -> dict | None:
    """The pool's ranking requests and admitted pre-infers over the whole periods (10 s; a minute where
    Prometheus holds the span) within [start, end]; None where no instance reported in any of them."""
    now = time.time() if now is None else now
    # 10 s periods, or where Prometheus holds the span the recording rules' minutes: a 10 s point of
    # its raw series holds one scrape at most, and an increase() of one scrape is nothing.
    span_s = math.ceil(now - start_s)
    step_s = max(TELEMETRY_TIERS["10s"][0], history_point_s(span_s))
    first = math.ceil(start_s / step_s) * step_s
    n_periods = int((end_s - first) // step_s)
    if n_periods <= 0:
        return None
    # From Redis, the 10 s rollups, or the live tier's where Redis holds only that one.
    tier = "10s" if "10s" in redis_tiers() else LIVE_TIER
    with history_source(span_s) as source:
        rows, gauges, _ = source.pool_points(pool=pool.name, tier=tier, start=first, step_s=step_s, n_points=n_periods,
                                          now=now)
    if not (gauges[:, POOL_GAUGE_COLUMN["instances"]] > 0).any():
        return None
    return {"rank_requests": int(rows[:, COUNTER_COLUMN["rank_requests"]].sum()),
            "preinfer_admitted": int(rows[:, COUNTER_COLUMN["preinfer_admitted"]].sum()),
            "from": first, "to": first + n_periods * step_s}
