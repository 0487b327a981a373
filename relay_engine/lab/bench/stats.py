"""The statistics of a measured point and of a sweep: P99 with a bootstrap 95 % interval, the point's
verdict on its estimate, and where a sweep crosses the SLO, with intervals for ratios of crossings.

A point passes when its P99 estimate is within the SLO (no worst-k rule, no early abort). A sweep's
crossing is where P99 reaches the SLO, interpolated (in log of the swept value) between the last
passing and the first failing point; bootstrap replicates of every point's P99 give replicates of
the crossing and of a ratio of two crossings, whose 2.5th and 97.5th percentiles are the interval.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from relay_engine.core.forward_times import ForwardTimes, merged
from relay_engine.core.outcomes import TIERS, Outcome
from relay_engine.lab.bench.workload import InstanceReport

SLO_QUANTILE = 0.99
BOOTSTRAP_REPLICATES = 1000
FULL = "full"  # the baseline's outcome: ranked by a full forward, no cache asked
RANKED: tuple[str, ...] = (*Outcome, FULL)
CACHED: tuple[str, ...] = tuple(o for o in Outcome if o is not Outcome.MISS)
TIER_OUTCOMES: tuple[str, ...] = tuple(o for o in CACHED if o is not Outcome.INFLIGHT)  # served from a tier


def quantile(values: np.ndarray, q: float) -> float | None:
    return float(np.quantile(values, q, method="inverted_cdf")) if values.size else None


def bootstrap_quantiles(values: np.ndarray, q: float, replicates: int, rng: np.random.Generator) -> np.ndarray:
    """``replicates`` bootstrap replicates of the q-quantile of values (resampled with replacement)."""
    if values.size == 0:
        return np.full(replicates, np.nan)
    idx = rng.integers(0, values.size, size=(replicates, values.size))
    return np.quantile(values[idx], q, axis=1, method="inverted_cdf")


def interval(replicates: np.ndarray) -> list[float] | None:
    finite = replicates[np.isfinite(replicates)]
    if finite.size < replicates.size * 0.9:  # mostly undefined (a ratio over zero): no interval
        return None
    lo, hi = np.percentile(finite, [2.5, 97.5])
    return [round(float(lo), 3), round(float(hi), 3)]


@dataclass
class PointResult:
    """One measured point: a mode at a prefix cap and an offered load, over the paired windows."""

    mode: str
    cap: int
    qps: float  # offered, on this machine's (scaled) clock
    time_scale: float
    slo_ms: float
    latencies_ms: np.ndarray  # measured ranking requests (a missed deadline counts at its latency)
    outcomes: dict[str, int]
    preinfer_signals: int
    preinfer_admitted: int
    preinfer_refused: dict[str, int]
    # Each cache tier's peak and budget by tier name: the largest window's sum over the instances.
    peak_bytes: dict[str, int]
    budget_bytes: dict[str, int]
    wall_s: float = 0.0
    host: dict = field(default_factory=dict)  # contention check (real runs)
    redone: int = 0
    p99_replicates: np.ndarray = field(default_factory=lambda: np.empty(0))
    # Each tier's largest peak of any one instance in any window, by tier name.
    instance_peak_bytes: dict[str, int] = field(default_factory=dict)
    # The ranked ones (not past their deadline): what a dashboard's P99 is of (``telemetry``: the engine
    # records the latency of a served request only; a missed deadline counts against the SLO share).
    served_ms: np.ndarray = field(default_factory=lambda: np.empty(0))
    time_parts: dict = field(default_factory=dict)  # ``time_parts``: where the time went
    cpu_parts: dict = field(default_factory=dict)  # ``cpu_parts``: where a real point's CPU went
    forward_times: ForwardTimes | None = None  # a real point's forwards, all its windows and instances

    @property
    def n(self) -> int:
        return int(self.latencies_ms.size)

    @property
    def p99_ms(self) -> float | None:
        return quantile(self.latencies_ms, SLO_QUANTILE)

    @property
    def passed(self) -> bool:
        p99 = self.p99_ms
        return p99 is not None and p99 <= self.slo_ms

    @property
    def within_slo_share(self) -> float | None:
        return float((self.latencies_ms <= self.slo_ms).mean()) if self.n else None

    def bootstrap(self, replicates: int, rng: np.random.Generator) -> None:
        self.p99_replicates = bootstrap_quantiles(self.latencies_ms, SLO_QUANTILE, replicates, rng)

    def rate(self, kind: str) -> float | None:
        ranked = sum(n for k, n in self.outcomes.items() if k in RANKED)
        return None if not ranked else round(self.outcomes.get(kind, 0) / ranked, 4)

    @property
    def hit_ratio(self) -> float | None:
        """Share of ranked requests that found their prefix cached (in any tier, or in flight)."""
        ranked = sum(n for k, n in self.outcomes.items() if k in RANKED)
        hits = sum(self.outcomes.get(k, 0) for k in CACHED)
        return None if not ranked else round(hits / ranked, 4)

    def summary(self) -> dict:
        k = self.time_scale

        def ms(x: float | None) -> float | None:
            return None if x is None else round(x, 2)

        p99 = self.p99_ms
        ci = interval(self.p99_replicates) if self.p99_replicates.size else None
        return {
            "mode": self.mode, "cap": self.cap, "qps": round(self.qps, 3), "qps_unscaled": round(self.qps * k, 3),
            "n": self.n, "passed": self.passed,
            "p50_ms": ms(quantile(self.latencies_ms, 0.5)), "p99_ms": ms(p99), "p99_ci_ms": ci,
            "p999_ms": ms(quantile(self.latencies_ms, 0.999)),
            "p99_ms_unscaled": ms(None if p99 is None else p99 / k),
            "p99_ci_ms_unscaled": None if ci is None else [round(x / k, 3) for x in ci],
            "within_slo_share": None if self.within_slo_share is None else round(self.within_slo_share, 4),
            "deadline_missed": self.outcomes.get("deadline", 0),
            "hit_ratio": self.hit_ratio, **{f"{tier}_hit_rate": self.rate(tier) for tier in TIER_OUTCOMES},
            "inflight_join_rate": self.rate(Outcome.INFLIGHT), "miss_rate": self.rate(Outcome.MISS),
            "outcomes": dict(self.outcomes),
            "preinfer": {"signals": self.preinfer_signals, "admitted": self.preinfer_admitted,
                         "refused": dict(self.preinfer_refused)},
            **per_tier(self.peak_bytes, "peak_bytes"), **per_tier(self.budget_bytes, "budget_bytes"),
            "within_budget": all(peak <= self.budget_bytes.get(tier, 0) for tier, peak in self.peak_bytes.items()),
            "wall_s": round(self.wall_s, 2), "host": self.host, "redone": self.redone,
            "time_parts_ms": {side: {k: round(v, 2) for k, v in parts.items()} for side, parts in self.time_parts.items()},
            **({"cpu_ms": {k: round(v, 4 if k.endswith("share") else 2) for k, v in self.cpu_parts.items()}}
               if self.cpu_parts else {}),
        }


def per_tier(values: dict[str, int], figure: str) -> dict[str, int]:
    """A per-tier figure in the plain form of results, ``<tier>_<figure>`` (``hbm_peak_bytes``): one for
    every tier the core can run (0 where none ran, as with the relay off), then any other tier named."""
    return {f"{tier}_{figure}": values.get(tier, 0) for tier in dict.fromkeys([*TIERS, *values])}


def time_parts(reports: Sequence[InstanceReport]) -> dict[str, dict[str, float]]:
    """Where the measured ranked requests' time went, as means in ms: ``queued`` before a rank thread took
    them (on a real instance, ``dispatched_late`` of it before its dispatcher had handed them on), ``work`` (their forwards alone: simulated, or a real rank's CPU time) and ``rest`` (the
    remainder: sharing the compute, waits on a computation in flight), over ``all`` of them and over the
    ``tail`` (at or past their P99). Empty where no report has the detail."""
    latency = {(id(r), q): ms for r in reports for q, ms, o, m in r.ranks if m and o in RANKED}
    rows = [(latency[(id(r), q)], queued, work, r.dispatched_late.get(q)) for r in reports
            for q, queued, work, *_ in r.detail if (id(r), q) in latency]
    if not rows:
        return {}
    p99 = quantile(np.array([row[0] for row in rows]), SLO_QUANTILE)
    dispatched = all(row[3] is not None for row in rows)

    def means(group: list[tuple[float, float, float, float | None]]) -> dict[str, float]:
        n = len(group)
        parts = {"requests": n, "latency": sum(g[0] for g in group) / n, "queued": sum(g[1] for g in group) / n,
                 "work": sum(g[2] for g in group) / n,
                 "rest": sum(max(0.0, g[0] - g[1] - g[2]) for g in group) / n}
        if dispatched:  # a real instance's: of the queued time, how much before its dispatcher handed it on
            parts["dispatched_late"] = sum(min(g[3], g[1]) for g in group) / n
        return parts

    return {"all": means(rows), "tail": means([g for g in rows if g[0] >= p99])}


def cpu_parts(reports: Sequence[InstanceReport]) -> dict[str, float]:
    """Where the real instances' CPU went over their windows (summed over instances and windows, ms):
    ``process`` (every thread of the instance processes), ``ranks`` (the ranking requests' own threads,
    forwards and engine code), ``prefill`` (the pre-inference lane's forwards), ``outside`` (the rest of
    the process: the dispatcher, waking the rank threads, the lane's own code, the allocator and the
    collector), ``others`` (what other processes ran on the pinned cores); with ``outside_per_rank``
    and the ``others_share`` of the window. Empty where no report has the figures (the simulator's)."""
    timed = [r for r in reports if r.cpu_ms]
    if not timed:
        return {}
    window = sum(r.cpu_ms["window"] for r in timed)
    process = sum(r.cpu_ms["process"] for r in timed)
    ranks = sum(d[2] for r in timed for d in r.detail)
    prefill = sum(row[1] for r in timed if r.forward_times is not None
                  for row in r.forward_times.sums.get("prefill", {}).values())
    n_ranks = sum(len(r.detail) for r in timed)
    parts = {"window": window, "process": process, "ranks": ranks, "prefill": prefill,
             "outside": max(0.0, process - ranks - prefill), "rank_requests": n_ranks}
    parts["outside_per_rank"] = parts["outside"] / n_ranks if n_ranks else 0.0
    if all("cores_busy" in r.cpu_ms for r in timed):
        busy = sum(r.cpu_ms["cores_busy"] for r in timed)
        parts.update(cores_busy=busy, others=max(0.0, busy - process),
                     others_share=max(0.0, busy - process) / window if window > 0 else 0.0)
    return parts


def point_result(mode: str, cap: int, qps: float, time_scale: float, slo_ms: float,
                 windows: Sequence[Sequence[InstanceReport]], wall_s: float = 0.0) -> PointResult:
    """Merge every instance's report of every window into one point (peaks: the largest window's sum)."""
    reports = [r for window in windows for r in window]
    latencies = np.array([lat for r in reports for (_, lat, _, m) in r.ranks if m], dtype=np.float64)
    served = np.array([lat for r in reports for (_, lat, o, m) in r.ranks if m and o in RANKED], dtype=np.float64)
    outcomes = Counter(o for r in reports for (_, _, o, m) in r.ranks if m)
    pre = [(a, reason) for r in reports for (_, a, reason, m) in r.preinfers if m]

    tiers = list(dict.fromkeys(tier for r in reports for tier in r.peak_bytes))

    def peak(attr: str) -> dict[str, int]:
        return {tier: max(sum(getattr(r, attr).get(tier, 0) for r in window) for window in windows) for tier in tiers}

    return PointResult(
        mode, cap, qps, time_scale, slo_ms, latencies, dict(outcomes), len(pre), sum(1 for a, _ in pre if a),
        dict(Counter(reason for a, reason in pre if not a)), peak("peak_bytes"), peak("budget_bytes"), wall_s,
        instance_peak_bytes={tier: max(r.peak_bytes.get(tier, 0) for r in reports) for tier in tiers},
        served_ms=served, time_parts=time_parts(reports), cpu_parts=cpu_parts(reports),
        forward_times=merged(r.forward_times for r in reports) if any(r.forward_times for r in reports) else None)


# --- sweeps ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Crossing:
    """Where a sweep's P99 reaches the SLO. ``bound``: "exact" (bracketed), "above" (every point
    passed: at least value, the largest x measured) or "below" (none passed: less than value, the
    smallest x measured; 0 only for a sweep with no points)."""

    value: float
    bound: str


def crossing(xs: Sequence[float], p99s: Sequence[float | None], slo_ms: float) -> Crossing:
    """Interpolated crossing of a sweep whose P99 rises with x (passing assumed monotone: the first
    failing point ends the passing run)."""
    pts = sorted((x, p) for x, p in zip(xs, p99s, strict=True))
    last_pass = None
    for x, p in pts:
        if p is not None and p <= slo_ms:
            last_pass = (x, p)
            continue
        if last_pass is None:
            return Crossing(pts[0][0], "below")
        (x0, p0), x1, p1 = last_pass, x, (math.inf if p is None else p)
        if not math.isfinite(p1) or p1 <= p0:
            return Crossing(x0, "exact")
        frac = (slo_ms - p0) / (p1 - p0)
        return Crossing(math.exp(math.log(x0) + frac * (math.log(x1) - math.log(x0))), "exact")
    return Crossing(last_pass[0], "above") if last_pass else Crossing(pts[0][0] if pts else 0.0, "below")


# A crossing that is a bound, as a sign: the true crossing is below (-1) or above (+1) the value.
CENSORED = {"exact": 0, "below": -1, "above": 1}


@dataclass(frozen=True)
class Replicates:
    """A crossing recomputed from each bootstrap replicate of the points' P99s, and for each whether it
    is a bound (``CENSORED``) because that replicate's sweep never crossed."""

    values: np.ndarray
    censored: np.ndarray  # int8: -1 the true crossing is below the value, +1 above it, 0 exact


def crossing_replicates(points: Sequence[PointResult], x_of, slo_ms: float) -> Replicates:
    if not points:
        return Replicates(np.empty(0), np.empty(0, dtype=np.int8))
    reps = np.stack([p.p99_replicates for p in points])  # [points, replicates]
    xs = [x_of(p) for p in points]
    found = [crossing(xs, list(reps[:, b]), slo_ms) for b in range(reps.shape[1])]
    return Replicates(np.array([c.value for c in found]), np.array([CENSORED[c.bound] for c in found], dtype=np.int8))


def ratio_interval(num: Replicates, den: Replicates) -> dict | None:
    """The bootstrap 95 % interval of num ÷ den, and what each end is: "exact", or "at most" / "at
    least" where 2.5 % or more of the replicates are bounds that could lie beyond it (a replicate whose
    sweep never crossed is its bound, never a 0)."""
    with np.errstate(divide="ignore", invalid="ignore"):
        ratios = np.where(den.values > 0, num.values / np.where(den.values > 0, den.values, 1.0), np.nan)
    ends = interval(ratios)
    if ends is None:
        return None
    # num below its bound, or den above it: the ratio is at most the replicate's; the reverse, at least.
    direction = np.sign(num.censored.astype(int) - den.censored.astype(int))
    share = 0.025 * ratios.size
    return {"ci": ends, "ends": ["at most" if np.count_nonzero(direction < 0) >= share else "exact",
                                 "at least" if np.count_nonzero(direction > 0) >= share else "exact"]}
