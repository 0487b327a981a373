"""The sweeps: the longest prefix cap that meets the SLO at the reference load, and the highest
offered load that meets it at a fixed cap. ``measure(mode, cap, qps)`` is the real fleet in the
benchmark and the simulated one in ``relay_engine.sim``; the sweeps are the same code for both.

Each sweep searches a fixed grid for the adjacent pair (last passing, first failing), assuming
passing is monotone along the grid: bisection, or — given a start (the simulator's prediction) — a
walk from it, which needs two points when the prediction is right. Every measured point is kept
(``points``) with its interval; the crossing between the pair is interpolated (``stats.crossing``).

A load sweep's grid is √2 apart, and P99 is far from linear in the load near saturation: interpolated
between two such points, one point's P99 moved a throughput ratio by a third. With ``refine`` the
sweep measures once more, at the pair's geometric midpoint (2^¼ from each), and the crossing is
interpolated across half the distance.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from relay_engine.lab.bench.modes import Mode
from relay_engine.lab.bench.stats import (
    Crossing,
    PointResult,
    Replicates,
    crossing,
    crossing_replicates,
    interval,
)

Measure = Callable[[Mode, int, float], PointResult]

CAPS = (256, 512, 768, 1024, 1536, 2048, 3072, 4096, 6144, 8192)
THROUGHPUT_CAPS = (512, 1024, 2048, 4096)
LOAD_STEPS = tuple(round(2 ** (k / 2), 4) for k in range(-6, 9))  # × the reference load, ×√2 apart


@dataclass
class Sweep:
    """One mode's sweep of one variable ("cap" at a fixed load, or "qps" at a fixed cap)."""

    mode: str
    variable: str
    fixed: float
    slo_ms: float
    points: list[PointResult] = field(default_factory=list)

    def x(self, p: PointResult) -> float:
        return float(p.cap if self.variable == "cap" else p.qps)

    @property
    def best_passing(self) -> float:
        """The largest grid value that passed with every smaller measured value passing too."""
        best = 0.0
        for p in sorted(self.points, key=self.x):
            if not p.passed:
                break
            best = self.x(p)
        return best

    @property
    def crossing(self) -> Crossing:
        return crossing([self.x(p) for p in self.points], [p.p99_ms for p in self.points], self.slo_ms)

    def crossing_replicates(self) -> Replicates:
        return crossing_replicates(self.points, self.x, self.slo_ms)

    def summary(self, time_scale: float) -> dict:
        c = self.crossing
        reps = self.crossing_replicates().values
        per_unit = time_scale if self.variable == "qps" else 1.0  # loads also read unscaled (× K)
        ci = interval(reps) if reps.size else None
        return {
            "variable": self.variable, "fixed": self.fixed,
            "best_passing": self.best_passing, "crossing": round(c.value, 3), "crossing_bound": c.bound,
            "crossing_ci": ci,
            "best_passing_unscaled": round(self.best_passing * per_unit, 3),
            "crossing_unscaled": round(c.value * per_unit, 3),
            "crossing_ci_unscaled": None if ci is None else [round(v * per_unit, 3) for v in ci],
            "points": [p.summary() for p in sorted(self.points, key=self.x)],
        }


def search_grid(grid: Sequence[float], passes: Callable[[float], bool], start: int | None = None) -> None:
    """Measure grid values until an adjacent (passing, failing) pair is found, or an end is reached.
    From ``start`` it walks up while passing and down while failing; without, it bisects."""
    if start is not None:
        i = max(0, min(len(grid) - 1, start))
        if passes(grid[i]):
            while i + 1 < len(grid) and passes(grid[i + 1]):
                i += 1
        else:
            while i > 0 and not passes(grid[i - 1]):
                i -= 1
        return
    lo, hi = -1, len(grid)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if passes(grid[mid]):
            lo = mid
        else:
            hi = mid


def sweep(measure: Measure, mode: Mode, variable: str, grid: Sequence[float], fixed: float, slo_ms: float,
          start: int | None = None, *, refine: bool = False) -> Sweep:
    """A cap sweep at load ``fixed`` or a load sweep at cap ``fixed``, on ``grid``; with ``refine``,
    one more point between the crossing's pair (``refine_crossing``)."""
    result = Sweep(mode.name, variable, fixed, slo_ms)
    done: dict[float, PointResult] = {}

    def passes(x: float) -> bool:
        if x not in done:
            point = measure(mode, int(x), fixed) if variable == "cap" else measure(mode, int(fixed), x)
            done[x] = point
            result.points.append(point)
        return done[x].passed

    search_grid(grid, passes, start)
    if refine:
        refine_crossing(result, passes)
    return result


def refine_crossing(result: Sweep, passes: Callable[[float], bool]) -> float | None:
    """Measure the geometric midpoint of the sweep's (last passing, first failing) pair; the value
    measured, or None where the sweep never crossed. A cap is rounded to a multiple of 64 tokens
    (and not measured where the pair is closer than that)."""
    pts = sorted(result.points, key=result.x)
    for lo, hi in zip(pts, pts[1:], strict=False):
        if lo.passed and not hi.passed:
            mid = (result.x(lo) * result.x(hi)) ** 0.5
            if result.variable == "cap":
                mid = round(mid / 64) * 64
                if not result.x(lo) < mid < result.x(hi):
                    return None
            passes(mid)
            return mid
    return None


def nearest_index(grid: Sequence[float], value: float) -> int:
    """The grid index just below value (the last that should pass), for a predicted crossing."""
    below = [i for i, g in enumerate(grid) if g <= value]
    return below[-1] if below else 0
