"""The pool's cost model fitted from its own instances' forward times (``core.forward_times``).

Each bucket with enough forwards gives one point: its mean shape and mean time. An operation with
points in at least ``MIN_BUCKETS`` length buckets gets its own coefficients (the same terms and the
same non-negative relative-error fit as an offline profile, ``costmodel.fit``); one with fewer keeps
the offline profile's terms scaled by the geometric mean of measured ÷ profile over its points
(the level of this pool's devices, the shape of the profile); one with none keeps the profile's.
The result says, per operation, which it is, how many forwards it rests on, its largest relative
error at its points, the dispersion of its forwards (mean coefficient of variation, which the
simulator then draws each forward's time with: ``CostModel.dispersion``) and how it compares with
the offline profile at 512–4096 tokens. ``fit_drift`` takes the slow part of that dispersion from how
the forwards' deviations correlate with each other over lags of 0.1-4 s (``core.forward_times.Drift``):
a speed factor every forward of an instance shares, which the simulator draws as an Ornstein-Uhlenbeck
process (``CostModel.drift``) so that slow stretches come in runs, as they do on a shared host.

    python -m relay_engine.sim fit --forward-times pool-forwards.json [--profile FILE] [--out cost.json]
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path

from relay_engine.core.forward_times import BucketMean, Drift, ForwardTimes, ForwardTimesError
from relay_engine.lab.costmodel import MAX_DISPERSION, OPS, CostModel, ProfilePoint, SpeedDrift, fit_op

MIN_FORWARDS = 5  # forwards a bucket needs to count as a point
MIN_BUCKETS = 3  # points an operation needs to be fitted on its own
COMPARE_LENGTHS = (512, 1024, 2048, 4096)
COMPARE_SHAPE = (32, 128)  # short-term tokens, candidates: the profile's default shape


@dataclass(frozen=True)
class OpFit:
    op: str
    how: str  # "fitted", "scaled" or "profile"
    forwards: int
    buckets: int
    max_error: float | None  # largest |fit − mean| ÷ mean over its points
    cv: float | None  # mean coefficient of variation of its buckets, by forwards
    scale: float | None  # "scaled": measured ÷ profile
    vs_profile: dict[int, float] = field(default_factory=dict)  # n → fitted ÷ profile at COMPARE_SHAPE


MIN_DRIFT_PAIRS = 30  # pairs a lag bin needs to count
MIN_DRIFT_BINS = 3  # lag bins the drift fit needs
DRIFT_TAU_GRID_S = tuple(0.02 * 1.15 ** i for i in range(60))  # 20 ms … ~90 s


@dataclass(frozen=True)
class DriftFit:
    """The slow part of the forwards' dispersion (``SpeedDrift``) fitted to their lag covariances, with
    what it rests on: ``variance`` of all deviations, ``covariances`` (mean lag s, covariance, pairs) per
    lag bin, and ``error``, the fit's largest miss at a bin as a share of ``variance``."""

    drift: SpeedDrift
    variance: float
    covariances: tuple[tuple[float, float, int], ...]
    error: float

    def to_dict(self) -> dict:
        return {**self.drift.to_dict(), "share_of_variance": round(self.drift.variance / self.variance, 3)
                if self.variance > 0 else None, "deviation_variance": round(self.variance, 5),
                "covariances": [[round(lag, 3), round(cov, 5), n] for lag, cov, n in self.covariances],
                "error": round(self.error, 3)}


MIN_TURNS_FORWARDS = 100  # forwards the within-window interleaving slope needs
MIN_TURNS_VARIANCE = 0.01  # and the spread of their turns (none on an accelerator's wall clock)


def thrash_within(drift: Drift) -> float | None:
    """What each further forward interleaved on a core adds to a forward's time, from the forwards of one
    window: the slope of their log deviation on their turns (wall ÷ own time − 1), in [0, MAX_THRASH].
    Across points, inflation also differs by mode (prefills beside the ranks, longer prefixes), which a
    fit across the points' averages takes for interleaving; within a window the mode is fixed. None
    when the forwards are too few or their turns do not vary."""
    count, total, _, turns, turns_sq, product = drift.dev[:6]
    if count < MIN_TURNS_FORWARDS:
        return None
    variance = turns_sq / count - (turns / count) ** 2
    if variance < MIN_TURNS_VARIANCE:
        return None
    slope = (product / count - total / count * turns / count) / variance
    return min(MAX_THRASH, max(0.0, slope))


def fit_drift(drift: Drift) -> DriftFit | None:
    """``SpeedDrift`` from ``core.forward_times.Drift`` sums: cov(d) = variance · e^(−d/tau) fitted by
    weighted least squares (weights: pairs) over the lag bins with ``MIN_DRIFT_PAIRS`` or more, tau on a
    grid, the variance in closed form for each and capped at the deviations' own. None when the sums
    are too few or the covariances show no correlation (every forward then drawn on its own)."""
    count, total, squares = drift.dev[:3]
    if count < 2:
        return None
    mean = total / count
    variance = max(0.0, squares / count - mean * mean)
    bins = [(row[2] / row[0], row[1] / row[0] - mean * mean, int(row[0])) for row in drift.pairs
            if row[0] >= MIN_DRIFT_PAIRS]
    if len(bins) < MIN_DRIFT_BINS or variance <= 0:
        return None
    best: tuple[float, float, float] | None = None  # (weighted squared error, variance, tau)
    for tau in DRIFT_TAU_GRID_S:
        shape = [math.exp(-lag / tau) for lag, _, _ in bins]
        den = sum(n * e * e for (_, _, n), e in zip(bins, shape, strict=True))
        v = min(variance, max(0.0, sum(n * c * e for (_, c, n), e in zip(bins, shape, strict=True)) / den))
        sse = sum(n * (c - v * e) ** 2 for (_, c, n), e in zip(bins, shape, strict=True))
        if best is None or sse < best[0]:
            best = (sse, v, tau)
    _, v, tau = best
    if v <= 0:
        return None
    error = max(abs(c - v * math.exp(-lag / tau)) for lag, c, _ in bins) / variance
    return DriftFit(SpeedDrift(v, tau), variance, tuple(bins), error)


@dataclass(frozen=True)
class LiveFit:
    cost: CostModel
    ops: dict[str, OpFit]
    drift: DriftFit | None = None

    @property
    def live_ops(self) -> list[str]:
        return [op for op, f in self.ops.items() if f.how != "profile"]

    @property
    def forwards(self) -> int:
        return sum(f.forwards for f in self.ops.values())

    def to_dict(self) -> dict:
        return {op: {"how": f.how, "forwards": f.forwards, "buckets": f.buckets,
                     "max_error": None if f.max_error is None else round(f.max_error, 4),
                     "cv": None if f.cv is None else round(f.cv, 3),
                     "scale": None if f.scale is None else round(f.scale, 4),
                     "vs_profile": {str(n): round(r, 4) for n, r in f.vs_profile.items()}}
                for op, f in self.ops.items()}

    def sentence(self) -> str:
        if not self.live_ops:
            return "no forwards of this pool's own in the window"
        parts = []
        for op in OPS:
            f = self.ops[op]
            if f.how == "fitted":
                parts.append(f"{op} fitted ({f.forwards} forwards, error ≤ {100 * (f.max_error or 0):.0f} %)")
            elif f.how == "scaled":
                parts.append(f"{op} the profile's × {f.scale:.2f} ({f.forwards} forwards)")
            else:
                parts.append(f"{op} the profile's (no forwards)")
        if self.drift is not None:
            d = self.drift
            parts.append(f"speed drifting in runs of ~{d.drift.tau_s:.2g} s "
                         f"({100 * d.drift.variance / d.variance:.0f} % of the forwards' log variance)")
        return "; ".join(parts)


def _points(means: list[BucketMean]) -> list[ProfilePoint]:
    # A bucket's mean shape, rounded to whole tokens (what a profile point holds).
    return [ProfilePoint(m.op, max(1, round(m.n)), round(m.s), round(m.c), m.mean_ms) for m in means
            if m.mean_ms > 0]


def fit_live(times: ForwardTimes, base: CostModel, *, min_forwards: int = MIN_FORWARDS,
             min_buckets: int = MIN_BUCKETS, note: str = "") -> LiveFit:
    """The pool's cost model from its forwards, ``base`` (the offline profile) where they are too few."""
    means = times.means(min_forwards)
    coefficients: dict[str, tuple[float, ...]] = {}
    ops: dict[str, OpFit] = {}
    kept_points: list[ProfilePoint] = []
    dispersion = dict(base.dispersion)
    for op in OPS:
        mine = [m for m in means if m.op == op]
        points = _points(mine)
        forwards = sum(m.count for m in mine)
        cv = sum(m.cv * m.count for m in mine) / forwards if forwards else None
        if cv is not None and points:
            dispersion[op] = min(cv, MAX_DISPERSION)
        scale = None
        if len(points) >= min_buckets:
            coefficients[op] = fit_op(op, points)
            how = "fitted"
        elif points:
            scale = math.exp(sum(math.log(p.ms / base.op_ms(op, p.n, p.s, p.c)) for p in points) / len(points))
            coefficients[op] = tuple(a * scale for a in base.coefficients[op])
            how = "scaled"
        else:
            coefficients[op] = base.coefficients[op]
            how = "profile"
        candidate = CostModel({**base.coefficients, op: coefficients[op]})
        error = max((abs(candidate.op_ms(op, p.n, p.s, p.c) - p.ms) / p.ms for p in points), default=None)
        s, c = COMPARE_SHAPE
        vs = {n: candidate.op_ms(op, n, s, c) / base.op_ms(op, n, s, c) for n in COMPARE_LENGTHS}
        ops[op] = OpFit(op, how, forwards, len(points), error, cv, scale, vs)
        kept_points += points
    drift = fit_drift(times.drift)
    cost = CostModel(coefficients, device=base.device, threads=base.threads, model=base.model,
                     points=tuple(kept_points), note=note or "fitted from the pool's own forward times",
                     dispersion=dispersion, drift=drift.drift if drift else base.drift)
    return LiveFit(cost, ops, drift)


def read_pool_forwards(path: str | Path) -> tuple[ForwardTimes, dict]:
    """A pool's forwards as the control plane writes them (``GET /api/v1/pools/<pool>/forwards/``):
    the merged buckets, and what they were measured on (window, instances, model, device, clock)."""
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise ForwardTimesError(f"{path}: cannot read the pool's forward times ({exc})") from None
    if not isinstance(data, dict):
        raise ForwardTimesError(f"{path}: the pool's forward times must be an object")
    times = ForwardTimes.from_dict(data.get("ops") or {}, f"{path}: ops")
    times.drift = Drift.from_dict(data.get("drift"), f"{path}: drift")  # absent in an older answer
    meta = {k: data.get(k) for k in ("pool", "window_s", "to", "instances", "model_version", "device_kind", "clock")}
    return times, meta


def window_words(meta: dict) -> str:
    """"the last 15 min on 2 instances": where the forwards came from."""
    window_s, instances = meta.get("window_s"), meta.get("instances") or []
    span = f"the last {window_s / 60:g} min" if isinstance(window_s, (int, float)) else "the window"
    return f"{span} on {len(instances)} instance{'s' if len(instances) != 1 else ''}"


__all__ = ["COMPARE_LENGTHS", "DriftFit", "LiveFit", "OpFit", "fit_drift", "fit_live", "read_pool_forwards",
           "thrash_within", "window_words", "wall_over_cpu"]


@dataclass(frozen=True)
class Interleaving:
    """What taking turns on a core did to a point's ranking forwards: ``sharing``, their wall time ÷ their
    CPU time (about how many forwards ran interleaved on the core, on average, while one did), and
    ``inflation``, their CPU time ÷ the same forwards' time alone (the offline profile)."""

    sharing: float
    inflation: float

    def to_dict(self) -> dict:
        return {"sharing": round(self.sharing, 3), "inflation": round(self.inflation, 4)}


def interleaving(times: ForwardTimes, alone: CostModel, ops: tuple[str, ...] = ("rank", "rank_full")) -> Interleaving:
    """``Interleaving`` of the ``ops`` forwards in ``times`` (a CPU instance's: CPU and wall time both),
    against ``alone``'s time for each bucket's mean shape (1, 1 where there are none)."""
    timed = [m for m in times.means() if m.op in ops and m.mean_ms > 0]
    cpu = sum(m.mean_ms * m.count for m in timed)
    expected = sum(alone.op_ms(m.op, max(1, round(m.n)), round(m.s), round(m.c)) * m.count for m in timed)
    if cpu <= 0 or expected <= 0:
        return Interleaving(1.0, 1.0)
    return Interleaving(wall_over_cpu(times, ops), cpu / expected)


def wall_over_cpu(times: ForwardTimes, ops: tuple[str, ...] = ("rank", "rank_full")) -> float:
    """The ``ops`` forwards' wall time ÷ their CPU time in ``times`` (at least 1; 1 where there are none)."""
    timed = [m for m in times.means() if m.op in ops and m.mean_ms > 0]
    cpu = sum(m.mean_ms * m.count for m in timed)
    return max(1.0, sum(m.mean_wall_ms * m.count for m in timed) / cpu) if cpu > 0 else 1.0


MAX_THRASH = 2.0
THRASH_GRID = tuple(i / 1000 for i in range(0, int(MAX_THRASH * 1000) + 1, 5))


@dataclass(frozen=True)
class Thrash:
    """What each further forward interleaved on a core adds to a forward's CPU time, fitted over points at
    different loads: inflation = level × (1 + thrash × (sharing − 1)) — ``level`` the in-service cost at
    no interleaving (÷ the profile's), the same at every load; ``error`` the largest relative miss."""

    thrash: float
    level: float
    error: float
    points: tuple[Interleaving, ...]

    def to_dict(self) -> dict:
        return {"thrash": self.thrash, "level": round(self.level, 4), "error": round(self.error, 4),
                "points": [p.to_dict() for p in self.points]}


MIN_SHARING_SPREAD = 0.25  # the least spread of the points' sharing that can tell thrash from level


def fit_thrash(points: list[Interleaving], within: float | None = None) -> Thrash:
    """``Thrash`` by least squares in log space over a grid of 0–``MAX_THRASH``. Points whose sharing
    spans less than ``MIN_SHARING_SPREAD`` (all lightly loaded, or all alike) cannot tell the two
    apart: thrash 0, the level their mean inflation. ``within`` (``thrash_within`` of the points'
    forwards): the thrash is that, and only the level is fitted."""
    usable = [p for p in points if p.inflation > 0]
    if within is not None:
        logs = [math.log(p.inflation) - math.log(1 + within * (p.sharing - 1)) for p in usable]
        level = math.exp(sum(logs) / len(logs)) if logs else 1.0
        return Thrash(within, level, _miss(usable, within, level), tuple(points))
    if not usable or max(p.sharing for p in usable) - min(p.sharing for p in usable) < MIN_SHARING_SPREAD:
        level = math.exp(sum(math.log(p.inflation) for p in usable) / len(usable)) if usable else 1.0
        return Thrash(0.0, level, _miss(usable, 0.0, level), tuple(points))
    best = None
    for thrash in THRASH_GRID:
        logs = [math.log(p.inflation) - math.log(1 + thrash * (p.sharing - 1)) for p in usable]
        level = sum(logs) / len(logs)
        loss = sum((x - level) ** 2 for x in logs)
        if best is None or loss < best[0] - 1e-12:
            best = (loss, thrash, math.exp(level))
    _, thrash, level = best
    return Thrash(thrash, level, _miss(usable, thrash, level), tuple(points))


def _miss(points: list[Interleaving], thrash: float, level: float) -> float:
    return max((abs(level * (1 + thrash * (p.sharing - 1)) / p.inflation - 1) for p in points), default=0.0)
