"""The read side of miss-ratio curves: a window of the pool's captured traffic, as the live revision's
tiers would have served it under other budgets and TTLs (``relay_engine.core.curves``), with the hit
ratio the instances measured over the same window beside the prediction at the live budgets.

Requests are grouped by the instance that served them (the capture's ``instance``); records older than
that field share one stack (the answer counts them). An entry's size is the model's prefix bytes for its
length, with the dimensions the pool's live instances report (the model's defaults when none does).
A request counts as pre-inferred when its pre-infer signal was seen and its prefix is at risk under the
live trigger, unless it missed for a reason that loses its pre-inference at any budget
(``curves.PREINFER_LOST``: the trigger's load limits, a computation too late). Only served, replayable requests are counted, in the prediction and the measurement alike.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import numpy as np

from controlplane.common.errors import Conflict
from controlplane.fleet import selectors as fleet_selectors
from controlplane.policies import selectors as policy_selectors
from controlplane.policies.models import Pool
from relay_engine.core import curves
from relay_engine.core.capture import SERVED_OUTCOMES, CaptureRecord, replayable
from relay_engine.core.config import BYTES_PER_MIB, ModelFingerprint, PolicySpec, parse_policy
from relay_engine.core.outcomes import TIER_LABELS, TIERS, Outcome

from . import traffic

# ``ModelConfig()``'s dimensions (a test holds them equal): the sizes assumed while no instance reports its model.
DEFAULT_FINGERPRINT = ModelFingerprint(num_layers=4, num_heads=4, head_dim=32)


def lower_budgets(spec: PolicySpec) -> list[curves.TierBudget]:
    """The live budget and TTL of every tier under HBM the policy runs, in lookup order."""
    out = []
    for name in TIERS[1:]:
        if name == Outcome.DRAM:
            out.append(curves.TierBudget(name, spec.cache.dram_budget_bytes, spec.cache.dram_ttl_ms))
            continue
        section = getattr(spec.cache, str(name), None)
        if section is not None:
            out.append(curves.TierBudget(name, section.budget_mb * BYTES_PER_MIB, section.ttl_ms))
    return out


def _fingerprint(pool: Pool) -> tuple[ModelFingerprint, bool]:
    for view in fleet_selectors.pool_status(pool=pool).instances:
        found = view.status.model_fingerprint()
        if view.live and found is not None:
            return found, True
    return DEFAULT_FINGERPRINT, False


def requests_of(records: Sequence[CaptureRecord], spec: PolicySpec, model: ModelFingerprint) -> curves.Requests:
    at_risk = spec.trigger.effective_at_risk_seq_len()
    keys: dict[tuple[str, int], int] = {}
    instances: dict[str, int] = {}
    key = [keys.setdefault((r.user, r.prefix_len), len(keys)) for r in records]
    instance = [instances.setdefault(r.instance, len(instances)) for r in records]
    size_of: dict[int, int] = {}
    nbytes = [size_of.setdefault(r.prefix_len, curves.prefix_nbytes(
        r.prefix_len, num_layers=model.num_layers, num_heads=model.num_heads, head_dim=model.head_dim))
        for r in records]
    return curves.Requests(
        ts_ms=np.fromiter((r.ts_ms for r in records), float, len(records)), key=np.asarray(key, dtype=np.int64),
        nbytes=np.asarray(nbytes, dtype=np.int64), instance=np.asarray(instance, dtype=np.int64),
        preinferred=np.fromiter((r.gap_ms is not None and r.prefix_len >= at_risk
                                 and r.miss_reason not in curves.PREINFER_LOST for r in records), bool, len(records)))


def _point(point: curves.Point, *, budget: bool) -> dict:
    value = {"budget_mb": round(point.value / BYTES_PER_MIB, 3)} if budget else {"ttl_ms": round(point.value)}
    return {**value, "hit_ratio": round(point.split.hit_ratio, 4),
            "tiers": {name: round(share, 4) for name, share in point.split.by_tier.items()}}


def pool_cache_curves(*, pool: Pool, window_s: int, now_s: float | None = None) -> dict:
    """The curves of the window ending now; Conflict when the window holds no served request."""
    t0 = time.perf_counter()
    end_s = time.time() if now_s is None else now_s
    window = traffic.read_window(pool=pool.name, window_s=window_s, end_s=end_s)
    records = [r for r in window.records if replayable(r) and r.outcome in SERVED_OUTCOMES]
    if not records:
        extent = traffic.capture_extent(pool=pool.name)
        raise Conflict(f"No captured traffic of pool {pool.name!r} in the last {traffic.window_label(window_s)}: "
                       f"{extent.describe(end_s)}. Cache curves are computed from captured ranking traffic; send "
                       f"traffic to the pool or choose a longer window.")
    spec = parse_policy(policy_selectors.revision_desired(pool=pool).spec) if pool.desired_generation else PolicySpec()
    model, reported = _fingerprint(pool)
    prof = curves.profile(requests_of(records, spec, model))
    lower = lower_budgets(spec)
    hbm_bytes, ttl_ms = spec.cache.hbm_budget_bytes, spec.cache.entry_ttl_ms
    axes = curves.curves(prof, hbm_bytes, ttl_ms, lower)
    live = prof.split(hbm_bytes, ttl_ms, lower)
    measured = sum(r.outcome != Outcome.MISS for r in records) / len(records)
    tiers = [Outcome.HBM, *(t.name for t in lower)]
    return {
        "pool": pool.name, "window": traffic.window_label(window_s), "from": window.start_s, "to": window.end_s,
        "requests": len(records), "requests_used": prof.requests_used, "sampling_rate": round(prof.rate, 6),
        "entries_whole": prof.entries_whole,
        "without_instance": sum(not r.instance for r in records),
        "tiers": [{"name": str(t), "label": TIER_LABELS.get(t, str(t))} for t in tiers],
        "live": {"hbm_budget_mb": spec.cache.hbm_budget_mb, "entry_ttl_ms": ttl_ms,
                 "lower": {str(t.name): {"budget_mb": round(t.budget_bytes / BYTES_PER_MIB, 3), "ttl_ms": t.ttl_ms}
                           for t in lower},
                 "hit_ratio": round(live.hit_ratio, 4),
                 "tiers": {name: round(share, 4) for name, share in live.by_tier.items()}},
        "axes": {name: [_point(p, budget=name != "entry_ttl") for p in points] for name, points in axes.items()},
        "measured_hit_ratio": round(measured, 4),
        "error_points": round((live.hit_ratio - measured) * 100, 2),
        "model": {"num_layers": model.num_layers, "num_heads": model.num_heads, "head_dim": model.head_dim,
                  "reported": reported},
        "elapsed_ms": round((time.perf_counter() - t0) * 1000, 1),
    }
