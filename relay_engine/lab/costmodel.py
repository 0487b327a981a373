"""Cost models of the three forward passes, fitted to measured profiles, saved as files.

The fleet simulator runs the engine with these in place of the model, and the benchmark's
``--time-scale auto`` compares this machine's profile with a stated reference profile. Each
operation's time is a non-negative combination of the terms its arithmetic has:

* ``prefill(n)`` — n prefix tokens: 1, n, n² (projections per token; causal attention per pair);
* ``rank(n, s, c)`` — s short-term tokens and c candidates against a cached prefix of n:
  1, r = s + c, r·n (every new row reads the whole prefix), s² and c·s;
* ``rank_full(n, s, c)`` — the whole history T = n + s and the candidates: 1, T + c, T², c·T.

Times are standalone (one request alone on the instance's compute); contention is the simulator's.
A profile file is JSON: the device, threads and model it was measured with, the measured points
``{op, n, s, c, ms}``, and the fitted coefficients. A file holding only points (an accelerator's
measurements, say) is fitted when loaded.

    python -m relay_engine.profile --fit --out artifacts/profile-cpu.json    # measure and fit here
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from relay_engine.core.config import LatencyModel

OPS = ("prefill", "rank", "rank_full")
FORMAT = "relaygr-cost-model/1"

TERMS: dict[str, tuple[str, ...]] = {
    "prefill": ("1", "n", "n^2"),
    "rank": ("1", "s+c", "(s+c)*n", "s^2", "c*s"),
    "rank_full": ("1", "T+c", "T^2", "c*T"),
}


def _features(op: str, n: float, s: float, c: float) -> tuple[float, ...]:
    if op == "prefill":
        return 1.0, n, n * n
    if op == "rank":
        r = s + c
        return 1.0, r, r * n, s * s, c * s
    t = n + s
    return 1.0, t + c, t * t, c * t


@dataclass(frozen=True)
class ProfilePoint:
    op: str
    n: int  # long-term prefix tokens
    s: int  # short-term tokens
    c: int  # candidates
    ms: float  # standalone time of one call


class CostModelError(ValueError):
    pass


MAX_DRIFT_VARIANCE = 1.0
MAX_DRIFT_TAU_S = 3600.0


@dataclass(frozen=True)
class SpeedDrift:
    """A slow factor on every forward of an instance: exp(y), y an Ornstein-Uhlenbeck process of
    stationary ``variance`` and correlation time ``tau_s`` (cov(y(t), y(t + d)) = variance · e^(−d/tau))."""

    variance: float
    tau_s: float

    def to_dict(self) -> dict:
        return {"variance": round(self.variance, 6), "tau_s": round(self.tau_s, 4)}

    @classmethod
    def from_dict(cls, raw: object) -> SpeedDrift | None:
        if raw is None:
            return None
        if not isinstance(raw, dict):
            raise CostModelError(f"drift must be an object with variance and tau_s, got {str(raw)[:60]!r}")
        bounds = {"variance": (0.0, MAX_DRIFT_VARIANCE), "tau_s": (1e-3, MAX_DRIFT_TAU_S)}
        values = {}
        for name, (lo, hi) in bounds.items():
            x = raw.get(name)
            if isinstance(x, bool) or not isinstance(x, (int, float)) or not lo <= x <= hi:
                raise CostModelError(f"drift.{name} must be a number in [{lo:g}, {hi:g}], got {str(x)[:40]!r}")
            values[name] = float(x)
        return cls(**values)


@dataclass(frozen=True)
class CostModel:
    """Standalone times (ms) of prefill, cached rank and full rank on one instance's compute."""

    coefficients: dict[str, tuple[float, ...]]
    device: str = "unknown"
    threads: int = 1
    model: dict = field(default_factory=dict)
    points: tuple[ProfilePoint, ...] = ()
    note: str = ""
    # Per operation, the coefficient of variation of one forward's time about the fitted mean (what
    # the pool's own forwards measured); absent or 0: every forward takes exactly its mean.
    dispersion: dict[str, float] = field(default_factory=dict)
    # How an instance's speed drifts (``livefit.fit_drift``): the variance of the log of a slow factor
    # every forward of the instance shares, and its correlation time (s); the rest of each operation's
    # dispersion is drawn per forward. None: forward times are drawn independently.
    drift: SpeedDrift | None = None

    def prefill_ms(self, n: int) -> float:
        return self._eval("prefill", n, 0, 0)

    def rank_ms(self, n: int, s: int, c: int) -> float:
        return self._eval("rank", n, s, c)

    def rank_full_ms(self, n: int, s: int, c: int) -> float:
        return self._eval("rank_full", n, s, c)

    def op_ms(self, op: str, n: int, s: int, c: int) -> float:
        return self._eval(op, n, s, c)

    def _eval(self, op: str, n: float, s: float, c: float) -> float:
        return float(sum(a * f for a, f in zip(self.coefficients[op], _features(op, n, s, c), strict=True)))

    def scaled(self, factor: float, note: str = "") -> CostModel:
        """Every time × factor (a device `factor` times slower)."""
        return CostModel({op: tuple(a * factor for a in coef) for op, coef in self.coefficients.items()},
                         self.device, self.threads, self.model,
                         tuple(ProfilePoint(p.op, p.n, p.s, p.c, p.ms * factor) for p in self.points),
                         note or self.note, dict(self.dispersion), self.drift)

    def full_inference_model(self, short: int, candidates: int,
                             lengths: Sequence[int] = (128, 256, 512, 1024, 2048, 4096, 8192)) -> LatencyModel:
        """``rank_full`` as the trigger's latency model (base + a·n + b·n², n the prefix length), fitted
        to this cost model at the given short-term and candidate counts."""
        x = np.array(lengths, dtype=np.float64)
        y = np.array([self.rank_full_ms(n, short, candidates) for n in lengths])
        a = np.stack([np.ones_like(x), x, x * x], 1)
        scale = a.max(axis=0)
        coef = _nonnegative_lstsq(a / scale / y[:, None], np.ones_like(y)) / scale
        return LatencyModel(*(float(c) for c in coef))

    def fit_errors(self) -> dict[str, float]:
        """Largest relative error of the fit at the measured points, per operation."""
        out: dict[str, float] = {}
        for p in self.points:
            err = abs(self.op_ms(p.op, p.n, p.s, p.c) - p.ms) / p.ms
            out[p.op] = max(out.get(p.op, 0.0), err)
        return {op: round(e, 4) for op, e in out.items()}

    # --- files -------------------------------------------------------------------------------

    def to_dict(self) -> dict:
        return {"format": FORMAT, "device": self.device, "threads": self.threads, "model": self.model,
                "note": self.note,
                "terms": {op: list(TERMS[op]) for op in OPS},
                "coefficients": {op: list(self.coefficients[op]) for op in OPS},
                "fit_max_relative_error": self.fit_errors(),
                **({"dispersion": dict(self.dispersion)} if self.dispersion else {}),
                **({"drift": self.drift.to_dict()} if self.drift else {}),
                "points": [asdict(p) for p in self.points]}

    def save(self, path: str | Path) -> None:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(json.dumps(self.to_dict(), indent=1) + "\n", encoding="utf-8")

    @classmethod
    def load(cls, path: str | Path) -> CostModel:
        try:
            data = json.loads(Path(path).read_text(encoding="utf-8"))
        except (OSError, json.JSONDecodeError) as exc:
            raise CostModelError(f"{path}: cannot read a cost model ({exc})") from None
        try:
            return cls.from_dict(data)
        except CostModelError as exc:
            raise CostModelError(f"{path}: {exc}") from None

    @classmethod
    def from_dict(cls, data: dict) -> CostModel:
        if not isinstance(data, dict) or data.get("format") != FORMAT:
            raise CostModelError(f"not a cost model: 'format' must be {FORMAT!r}")
        points = tuple(_point(p, i) for i, p in enumerate(data.get("points") or []))
        meta = dict(device=str(data.get("device", "unknown")), threads=int(data.get("threads", 1)),
                    model=data.get("model") or {}, note=str(data.get("note", "")),
                    dispersion=_dispersion(data.get("dispersion")), drift=SpeedDrift.from_dict(data.get("drift")))
        coefficients = data.get("coefficients")
        if coefficients is None:
            return fit(points, **meta)
        out = {}
        for op in OPS:
            coef = coefficients.get(op) if isinstance(coefficients, dict) else None
            if not isinstance(coef, list) or len(coef) != len(TERMS[op]) or \
                    not all(isinstance(a, (int, float)) and math.isfinite(a) and a >= 0 for a in coef):
                raise CostModelError(f"coefficients.{op} must be {len(TERMS[op])} finite numbers ≥ 0 "
                                     f"for the terms {', '.join(TERMS[op])}")
            out[op] = tuple(float(a) for a in coef)
        return cls(out, points=points, **meta)


MAX_DISPERSION = 5.0


def _dispersion(raw: object) -> dict[str, float]:
    if raw is None:
        return {}
    if not isinstance(raw, dict):
        raise CostModelError(f"dispersion must be an object of operation → coefficient of variation, got {raw!r}")
    out = {}
    for op, cv in raw.items():
        if op not in OPS:
            raise CostModelError(f"dispersion.{op}: not an operation (one of {', '.join(OPS)})")
        if isinstance(cv, bool) or not isinstance(cv, (int, float)) or not 0 <= cv <= MAX_DISPERSION:
            raise CostModelError(f"dispersion.{op} must be a number in [0, {MAX_DISPERSION:g}], got {cv!r}")
        out[op] = float(cv)
    return out


def _point(raw: object, i: int) -> ProfilePoint:
    if not isinstance(raw, dict) or raw.get("op") not in OPS:
        raise CostModelError(f"points[{i}]: must be an object with 'op' one of {', '.join(OPS)}")
    try:
        p = ProfilePoint(raw["op"], int(raw["n"]), int(raw.get("s", 0)), int(raw.get("c", 0)), float(raw["ms"]))
    except (KeyError, TypeError, ValueError):
        raise CostModelError(f"points[{i}]: needs integers n, s, c and a number ms") from None
    if p.n < 1 or p.s < 0 or p.c < 0 or not (p.ms > 0 and math.isfinite(p.ms)):
        raise CostModelError(f"points[{i}]: n ≥ 1, s ≥ 0, c ≥ 0 and ms > 0 required")
    return p


def _nonnegative_lstsq(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Least squares with coefficients ≥ 0: drop the most negative term and refit until none is."""
    active = list(range(a.shape[1]))
    while True:
        coef = np.zeros(a.shape[1])
        if active:
            coef[active] = np.linalg.lstsq(a[:, active], b, rcond=None)[0]
        negative = [j for j in active if coef[j] < 0]
        if not negative:
            return coef
        active.remove(min(negative, key=lambda j: coef[j]))


def fit(points: Iterable[ProfilePoint], **meta) -> CostModel:
    """Fit each operation's terms to its points, minimising relative error, coefficients ≥ 0."""
    points = tuple(points)
    coefficients = {}
    for op in OPS:
        mine = [p for p in points if p.op == op]
        if not mine:
            raise CostModelError(f"no measured points for {op}")
        coefficients[op] = fit_op(op, mine)
    return CostModel(coefficients, points=points, **meta)


def fit_op(op: str, points: Sequence[ProfilePoint]) -> tuple[float, ...]:
    """One operation's coefficients from its points (relative error, coefficients ≥ 0)."""
    x = np.array([_features(op, p.n, p.s, p.c) for p in points], dtype=np.float64)
    y = np.array([p.ms for p in points], dtype=np.float64)
    scale = x.max(axis=0)  # columns of comparable size, so lstsq is well conditioned
    scale[scale == 0] = 1.0
    w = 1.0 / y  # relative error
    coef = _nonnegative_lstsq(x / scale * w[:, None], y * w) / scale
    return tuple(float(a) for a in coef)


# --- measuring -----------------------------------------------------------------------------------

# Prefix lengths, and (short, candidates) variations measured at two of them, so every term is pinned.
PROFILE_LENGTHS = (128, 256, 512, 1024, 2048, 4096)
PROFILE_SHAPES = ((32, 128), (8, 32), (32, 512), (128, 128))
PROFILE_SHAPE_LENGTHS = (512, 2048)


def profile_grid(lengths: Sequence[int] = PROFILE_LENGTHS, short: int = 32,
                 candidates: int = 128) -> list[tuple[int, int, int]]:
    """(n, s, c) to measure: every length at the default shape, plus the shape variations."""
    grid = [(n, short, candidates) for n in lengths]
    grid += [(n, s, c) for n in PROFILE_SHAPE_LENGTHS if n <= max(lengths)
             for s, c in PROFILE_SHAPES[1:]]
    return grid


def measure(time_ms: Callable[[str, int, int, int], float], grid: Iterable[tuple[int, int, int]],
            progress: Callable[[str], None] | None = None) -> list[ProfilePoint]:
    """Points for each (n, s, c): prefill once per n, rank and rank_full per shape."""
    points, prefilled = [], set()
    for n, s, c in grid:
        if progress:
            progress(f"n={n} s={s} c={c}")
        if n not in prefilled:
            prefilled.add(n)
            points.append(ProfilePoint("prefill", n, 0, 0, time_ms("prefill", n, s, c)))
        points.append(ProfilePoint("rank", n, s, c, time_ms("rank", n, s, c)))
        points.append(ProfilePoint("rank_full", n, s, c, time_ms("rank_full", n, s, c)))
    return points


def time_scale_against(measured: CostModel, reference: CostModel,
                       lengths: Sequence[int] = (512, 1024, 2048, 4096), short: int = 32,
                       candidates: int = 128) -> float:
    """K: how much slower this device runs the forwards than the reference — the geometric mean of
    measured ÷ reference over the three operations at the given lengths."""
    logs = [math.log(measured.op_ms(op, n, short, candidates) / reference.op_ms(op, n, short, candidates))
            for op in OPS for n in lengths]
    return math.exp(sum(logs) / len(logs))
