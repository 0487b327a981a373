"""Dashboard series for one pool over a window, and the publishes in it as annotations."""

from __future__ import annotations

import math
import time
from datetime import UTC, datetime

import numpy as np

from controlplane.policies import selectors as policy_selectors
from controlplane.policies.models import Pool
from relay_engine.core.config import slo_of
from relay_engine.core.telemetry import REFUSAL_REASONS
from relay_engine.core.wire import TELEMETRY_TIERS

from .history import COUNTER_COLUMN, GAUGE_COLUMN, N_COLUMNS, REFUSAL_COLUMN, SUM_COLUMN, history_cache
from .merge import bucketed, latency_counts, quantiles

# Window → (seconds, telemetry tier read). Coarser tiers for longer windows keep reads small.
WINDOWS: dict[str, tuple[int, str]] = {"5m": (300, "1s"), "1h": (3600, "10s"), "6h": (21600, "60s"),
                                       "24h": (86400, "60s")}
# At most this many points per series: a 24 h window is drawn at 4-minute resolution.
MAX_POINTS = 360


def window_grid(window: str, now: float) -> tuple[str, int, float, int]:
    """(tier, step_s, start, n_points): aligned buckets covering the window up to now."""
    window_s, tier = WINDOWS[window]
    tier_step_s = TELEMETRY_TIERS[tier][0]
    step_s = tier_step_s * max(1, math.ceil(window_s / MAX_POINTS / tier_step_s))
    n_points = window_s // step_s
    end = (math.floor(now / step_s) + 1) * step_s
    return tier, step_s, end - n_points * step_s, n_points


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


# What the per-instance breakdown shows; the pool-wide view has every figure.
INSTANCE_FIGURES = ("p50_ms", "p99_ms", "rank_per_s", "rank_within_slo_per_s", "slo_compliance_ratio",
                    "hbm_hit_ratio", "miss_ratio", "preinfer_admitted_per_s")
INSTANCE_GAUGES = ("hbm_bytes", "hbm_budget_bytes", "dram_bytes", "dram_budget_bytes", "applied_generation")
_REFUSED = "preinfer_refused_per_s."


def _figures(sums: np.ndarray, step_s: float, names: tuple[str, ...] | None = None) -> dict[str, np.ndarray]:
    """The per-bucket figures of one set of summed differences (the pool's, or one instance's)."""
    counts = latency_counts(sums)
    lookups = sum(_counter(sums, name) for name in ("hbm_hits", "dram_hits", "inflight_joins", "misses"))
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
        "dram_hit_ratio": _ratio(_counter(sums, "dram_hits"), lookups),
        "inflight_join_ratio": _ratio(_counter(sums, "inflight_joins"), lookups),
        "miss_ratio": _ratio(_counter(sums, "misses"), lookups),
        "preinfer_signals_per_s": _counter(sums, "preinfer_signals") / step_s,
        "preinfer_admitted_per_s": _counter(sums, "preinfer_admitted") / step_s,
        **{_REFUSED + reason: sums[..., REFUSAL_COLUMN[reason]] / step_s for reason in REFUSAL_REASONS},
        "evictions_per_s": _counter(sums, "evictions") / step_s,
        "demotions_per_s": _counter(sums, "demotions") / step_s,
        "promotions_per_s": _counter(sums, "promotions") / step_s,
        "dedup_reloads_per_s": _counter(sums, "dedup_reloads") / step_s,
    }
    return figures if names is None else {name: figures[name] for name in names}


def _nest_refusals(rows: dict[str, list]) -> dict[str, object]:
    """``preinfer_refused_per_s.<reason>`` keys → one ``preinfer_refused_per_s: {reason: […]}``."""
    out: dict[str, object] = {k: v for k, v in rows.items() if not k.startswith(_REFUSED)}
    refused = {k[len(_REFUSED):]: v for k, v in rows.items() if k.startswith(_REFUSED)}
    if refused:
        out["preinfer_refused_per_s"] = refused
    return out


def _totals(sums: np.ndarray) -> dict[str, float | int | None]:
    """Whole-window figures of one set of bucketed sums (merged over time, then quantiles)."""
    window = sums.sum(axis=0)
    counts = latency_counts(window)
    lookups = sum(window[COUNTER_COLUMN[name]] for name in ("hbm_hits", "dram_hits", "inflight_joins", "misses"))

    def ratio(part: float, whole: float) -> float | None:
        return round(float(part / whole), 6) if whole > 0 else None

    p50, p99 = (float(v) for v in quantiles(counts, (0.5, 0.99)))
    return {
        "rank_requests": int(window[COUNTER_COLUMN["rank_requests"]]),
        "rank_within_slo": int(window[COUNTER_COLUMN["rank_within_slo"]]),
        "p50_ms": None if math.isnan(p50) else round(p50, 4),
        "p99_ms": None if math.isnan(p99) else round(p99, 4),
        "slo_compliance_ratio": ratio(window[COUNTER_COLUMN["rank_within_slo"]],
                                      window[COUNTER_COLUMN["rank_requests"]]),
        "hbm_hit_ratio": ratio(window[COUNTER_COLUMN["hbm_hits"]], lookups),
        "preinfer_admitted": int(window[COUNTER_COLUMN["preinfer_admitted"]]),
        "preinfer_refused": {reason: int(window[REFUSAL_COLUMN[reason]]) for reason in REFUSAL_REASONS},
    }


def pool_metrics(*, pool: Pool, window: str, now: float | None = None) -> dict:
    now = time.time() if now is None else now
    tier, step_s, start, n_points = window_grid(window, now)
    histories = history_cache.read(pool=pool.name, tier=tier, now=now)
    names, sums, gauges = [], [], []
    for history in histories:
        instance_sums, instance_gauges = bucketed(history, start, step_s, n_points)
        if np.isfinite(instance_gauges[:, 0]).any() or instance_sums.any():  # else: silent in this window
            names.append(history.instance)
            sums.append(instance_sums)
            gauges.append(instance_gauges)
    # [instances, points, columns]; every figure is computed for all instances at once.
    sums_all = np.stack(sums) if sums else np.zeros((0, n_points, N_COLUMNS))
    gauges_all = np.stack(gauges) if gauges else np.zeros((0, n_points, len(INSTANCE_GAUGES)))
    figures = _json_rows(_figures(sums_all, step_s, INSTANCE_FIGURES)) if names else {}
    levels = _json_rows({name: gauges_all[..., GAUGE_COLUMN[name]] for name in INSTANCE_GAUGES}, as_int=True) \
        if names else {}
    instances = {
        name: {**{k: v[i] for k, v in figures.items()}, **{k: v[i] for k, v in levels.items()},
               "totals": _totals(sums_all[i])}
        for i, name in enumerate(names)
    }
    pool_sums = sums_all.sum(axis=0)
    hbm = gauges_all[..., GAUGE_COLUMN["hbm_bytes"]]
    pool_hbm = np.where(np.isfinite(hbm).any(axis=0), np.nansum(hbm, axis=0), np.nan)
    spec = getattr(pool, "desired_spec", None) or policy_selectors.revision_desired(pool=pool).spec
    since = datetime.fromtimestamp(start, tz=UTC)
    annotations = [
        {
            "ts": round(entry.time.timestamp(), 3),
            "generation": (entry.after or {}).get("desired_generation"),
            "kind": "rollback" if (entry.after or {}).get("restored_from") else "publish",
            "actor": entry.actor,
            "sha256": (entry.after or {}).get("sha256"),
        }
        for entry in policy_selectors.publish_events(pool=pool.name, since=since)
    ]
    return {
        "pool": pool.name,
        "window": window,
        "tier": tier,
        "step_s": step_s,
        "start": start,
        "end": start + n_points * step_s,
        "slo_ms": slo_of(spec).p99_ms,
        "slo_target_ratio": slo_of(spec).target_ratio,
        "timestamps": [start + i * step_s for i in range(n_points)],
        "fleet": {**_nest_refusals(_json_rows(_figures(pool_sums, step_s))),
                  **_json_rows({"hbm_bytes": pool_hbm}, as_int=True), "totals": _totals(pool_sums)},
        "instances": dict(sorted(instances.items())),
        "annotations": annotations,
    }
