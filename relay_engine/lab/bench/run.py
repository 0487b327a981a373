"""One benchmark run: calibrate, derive K, measure the sweeps on the real fleet, report.

Order: the cost model is measured inside instance 0; K is derived from it (or given); the simulator,
on the same cost model, windows and regime, predicts where each sweep crosses the SLO, so the real
sweep starts there (two points when the prediction is right); then, on the real fleet, every mode's
points replay the same paired windows. Each point is checked for contention while it runs and
measured again when the host was busy.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

from relay_engine.core.model import HSTUModel
from relay_engine.core.trace import TraceQuery
from relay_engine.lab.bench import report
from relay_engine.lab.bench.bound import compute_bound
from relay_engine.lab.bench.calibration import profile_here, regime_for, time_scale
from relay_engine.lab.bench.host import HostMonitor
from relay_engine.lab.bench.instances import Fleet, WindowPlan
from relay_engine.lab.bench.modes import MODES, Mode, Regime, mode_policy
from relay_engine.lab.bench.overhead import measure_overhead
from relay_engine.lab.bench.settings import BenchSettings
from relay_engine.lab.bench.stats import PointResult, point_result, ratio_interval
from relay_engine.lab.bench.sweeps import Measure, Sweep, nearest_index, sweep
from relay_engine.lab.bench.workload import (
    Window,
    paired_windows,
    primed_routes,
    route,
    schedule,
    trace_qps,
    window_rng,
)
from relay_engine.lab.costmodel import PROFILE_LENGTHS, CostModel
from relay_engine.lab.sim.fleet import simulate_point
from relay_engine.lab.traffic import describe


class RealMeasure:
    """``sweeps.Measure`` on the real fleet: the paired windows, a contention check, redone if busy."""

    def __init__(self, settings: BenchSettings, fleet: Fleet, queries: Sequence[TraceQuery], windows: list[Window],
                 regime: Regime, progress: tqdm):
        self.s, self.fleet, self.queries, self.windows, self.regime = settings, fleet, queries, windows, regime
        self.rate = trace_qps(queries)
        self.progress = progress
        self.rng = np.random.default_rng(settings.seed)

    def __call__(self, mode: Mode, cap: int, qps: float) -> PointResult:
        s = self.s
        self.progress.set_description(f"{mode.name:<19} cap {cap:>5} @ {qps:6.2f} qps")
        for attempt in range(s.max_redo + 1):
            started = time.monotonic()
            with HostMonitor([os.getpid(), *self.fleet.pids], other_share=s.busy_other_share,
                             window_share=s.busy_window_share, steal_share=s.busy_steal_share) as monitor:
                reports = [self._window(mode, cap, qps, w) for w in self.windows]
            point = point_result(mode.name, cap, qps, self.regime.time_scale, self.regime.slo_ms, reports,
                                 time.monotonic() - started)
            point.host, point.redone = monitor.verdict.to_dict(), attempt
            if not monitor.verdict.busy or attempt == s.max_redo:
                break
            self.progress.write(f"busy host during {mode.name} cap {cap} @ {qps:.2f} qps "
                                f"({monitor.verdict.to_dict()}); measuring it again")
        point.bootstrap(s.bootstrap_replicates, self.rng)
        self.progress.update(1)
        return point

    def _window(self, mode: Mode, cap: int, qps: float, window: Window):
        names = self.fleet.names
        events = schedule(self.queries, window, cap=cap, qps=qps, trace_rate=self.rate,
                          time_scale=self.regime.time_scale, with_preinfer=mode.preinfer)
        rng = window_rng(self.s.seed, window)
        primed = primed_routes(self.queries, window, names, mode.affinity, rng) if mode.relay else {}
        routed = route(events, names, mode.affinity, rng, self.regime.time_scale)
        policy = mode_policy(mode, self.regime)
        plans = {n: WindowPlan(policy, cap, tuple((self.queries[i].user_id, self.queries[i].seq_len)
                                                  for i in primed.get(n, ())),
                               tuple(routed[n]), self.regime.deadline_ms) for n in names}
        return self.fleet.window(plans)


class SimMeasure:
    """``sweeps.Measure`` on the simulator, with the same windows, regime and instances."""

    def __init__(self, settings: BenchSettings, cost: CostModel, queries: Sequence[TraceQuery], windows: list[Window],
                 regime: Regime, rank_overhead_ms: float = 0.0, background_share: float = 0.0, thrash: float = 0.0):
        self.s, self.cost, self.queries, self.windows, self.regime = settings, cost, queries, windows, regime
        self.model = HSTUModel(settings.model)
        self.rate = trace_qps(queries)
        self.rank_overhead_ms, self.background_share, self.thrash = rank_overhead_ms, background_share, thrash

    def __call__(self, mode: Mode, cap: int, qps: float, forward_seed: int | None = None) -> PointResult:
        point = simulate_point(self.queries, self.windows, model=self.model, cost=self.cost, mode=mode,
                               regime=self.regime, cap=cap, qps=qps, instances=self.s.instances,
                               rank_threads=self.s.rank_threads, seed=self.s.seed, trace_rate=self.rate,
                               rank_overhead_ms=self.rank_overhead_ms, background_share=self.background_share,
                               thrash=self.thrash, forward_seed=forward_seed)
        point.bootstrap(self.s.bootstrap_replicates // 4, np.random.default_rng(self.s.seed))
        return point


def guided_sweep(measure: Measure, predict: Measure | None, mode: Mode, variable: str, grid: Sequence[float],
                 fixed: float, slo_ms: float) -> tuple[Sweep, dict | None]:
    """The real sweep, started where the simulator's sweep crossed (when there is a simulator)."""
    start, predicted = None, None
    if predict is not None:
        sim = sweep(predict, mode, variable, grid, fixed, slo_ms)
        start = nearest_index(grid, sim.crossing.value)
        predicted = {"crossing": round(sim.crossing.value, 3), "bound": sim.crossing.bound,
                     "points": [{"x": sim.x(p), "p99_ms": p.summary()["p99_ms"]} for p in sim.points]}
    return sweep(measure, mode, variable, grid, fixed, slo_ms, start), predicted


@dataclass(frozen=True)
class Calibrated:
    cost: CostModel
    time_scale: float
    time_scale_how: dict
    regime: Regime
    windows: list[Window]


def calibrate(settings: BenchSettings, queries: Sequence[TraceQuery], fleet: Fleet,
              cost: CostModel | None = None) -> Calibrated:
    """The cost model (measured in instance 0 unless given), K, the regime and the paired windows."""
    s = settings
    short = int(np.median([q.short_len for q in queries]))
    cands = int(np.median([q.n_candidates for q in queries]))
    if cost is None:
        lengths = tuple(n for n in PROFILE_LENGTHS if n <= max(s.caps))
        cost = CostModel.from_dict(fleet.call(0, profile_here, s, short, cands, lengths))
    k, k_how = time_scale(s, cost, short, cands)
    prime = round(s.entry_ttl_ms / 1000 * trace_qps(queries) * s.prime_ttls)
    windows = paired_windows(len(queries), s.windows, s.warmup_queries, s.measured_queries, prime)
    return Calibrated(cost, k, k_how, regime_for(s, cost, k, short, cands), windows)


def measure_sweeps(s: BenchSettings, measure: Measure, predict: Measure | None, regime: Regime,
                   modes: Sequence[Mode]) -> tuple[dict[str, dict[str, tuple[Sweep, dict | None]]], int]:
    """The run's sweeps: max sequence length (baseline, relay) at the reference load; SLO throughput at
    the headline cap (every mode, or baseline and relay without ablations); with ``cap_sweep``, SLO
    throughput at every throughput cap (baseline, relay). Returns them by mode and the headline cap."""
    by_name = {m.name: m for m in modes}
    sweeps: dict[str, dict[str, tuple[Sweep, dict | None]]] = {m.name: {} for m in modes}
    slo_ms, ref_qps = regime.slo_ms, s.ref_qps / regime.time_scale
    if s.seq_len_sweeps:
        baseline, relay = by_name["baseline"], by_name["relay"]
        for mode in (baseline, relay):
            sweeps[mode.name]["cap"] = guided_sweep(measure, predict, mode, "cap", s.caps, ref_qps, slo_ms)
        headline = s.headline_cap or int(sweeps["baseline"]["cap"][0].best_passing) or min(s.caps)
    else:
        assert s.headline_cap, "without the max-sequence-length sweeps the headline cap must be given"
        headline = s.headline_cap
    loads = [ref_qps * step for step in s.load_steps]
    for mode in modes:
        if s.ablations or mode.name in ("baseline", "relay"):
            sweeps[mode.name][f"qps@{headline}"] = guided_sweep(measure, predict, mode, "qps", loads, headline, slo_ms)
    if s.cap_sweep:
        for cap in s.throughput_caps:
            if cap != headline:
                for mode in (by_name["baseline"], by_name["relay"]):
                    sweeps[mode.name][f"qps@{cap}"] = guided_sweep(measure, predict, mode, "qps", loads, cap, slo_ms)
    return sweeps, headline


def run(settings: BenchSettings, queries: list[TraceQuery], trace_name: str, out: Path,
        modes: Sequence[Mode] = MODES) -> dict:
    s = settings
    started = time.monotonic()
    load_start = os.getloadavg()
    fleet = Fleet(s)
    progress = tqdm(unit="point", file=sys.stderr, dynamic_ncols=True)
    try:
        progress.set_description("profiling instance 0 (the cost model)")
        cal = calibrate(s, queries, fleet)
        cost, k, k_how, regime, windows = cal.cost, cal.time_scale, cal.time_scale_how, cal.regime, cal.windows
        measure = RealMeasure(s, fleet, queries, windows, regime, progress)
        predict = SimMeasure(s, cost, queries, windows, regime) if s.sim_guided else None
        sweeps, headline = measure_sweeps(s, measure, predict, regime, modes)
    finally:
        progress.close()
        fleet.close()
    overhead = measure_overhead(s, queries, headline, regime)
    result = summarize(s, sweeps, modes, headline, regime, k_how, cost, windows, queries)
    result.update({
        "trace": {"source": trace_name, "queries": len(queries), "qps": round(trace_qps(queries), 3),
                  "qps_scaled": round(trace_qps(queries) / k, 3), "summary": describe(queries, trace_name)},
        "host": {"cpus": os.cpu_count(), "cores_per_instance": fleet.cores, "torch": torch.__version__,
                 "load_avg_start": [round(x, 2) for x in load_start],
                 "load_avg_end": [round(x, 2) for x in os.getloadavg()]},
        "settings": {**{k_: (str(v) if isinstance(v, Path) else v) for k_, v in asdict(s).items() if k_ != "model"},
                     "model": asdict(s.model), "model_version": fleet.model_version},
        "overhead": overhead,
        "runtime_s": round(time.monotonic() - started, 1),
    })
    result["markdown"] = report.markdown(result)
    result["plots"] = report.plots(result, out.parent)
    out.parent.mkdir(parents=True, exist_ok=True)
    report.write_json(out, result)
    return result


def interval_keys(found: dict | None) -> dict:
    """A ratio's interval as the JSON carries it: ``ci`` [lo, hi] and ``ci_ends`` (each "exact", or
    "at most" / "at least" where replicates that never crossed leave that end a bound)."""
    return {"ci": found["ci"], "ci_ends": found["ends"]} if found else {"ci": None, "ci_ends": None}


def throughput_against(sweeps: dict, mode: Mode, headline: int) -> dict | None:
    """An ablation's SLO throughput ÷ that of the mode it is measured against (``Mode.against``), both
    at the headline cap on the same windows, with the bootstrap interval of the crossings' ratio."""
    name = f"qps@{headline}"
    mine, theirs = sweeps.get(mode.name, {}).get(name), sweeps.get(mode.against or "", {}).get(name)
    if mine is None or theirs is None:
        return None
    m, t = mine[0], theirs[0]
    return {"mode": mode.against,
            "ratio": round(m.crossing.value / t.crossing.value, 3) if t.crossing.value > 0 else None,
            **interval_keys(ratio_interval(m.crossing_replicates(), t.crossing_replicates())),
            "bounds": {mode.name: m.crossing.bound, mode.against: t.crossing.bound}}


def reference_point(sweep: Sweep | None) -> PointResult | None:
    """A throughput sweep's point at its SLO throughput (its highest passing load; else its lowest)."""
    if sweep is None or not sweep.points:
        return None
    passing = [p for p in sweep.points if p.passed]
    return max(passing, key=lambda p: p.qps) if passing else min(sweep.points, key=lambda p: p.qps)


def throughput_ratios(sweeps: dict, cost: CostModel, queries: Sequence[TraceQuery], windows: Sequence[Window]) -> dict:
    """relay ÷ baseline SLO throughput at every cap both were swept at, with its interval, the compute
    bound there and the efficiency against it (``bound``)."""
    out = {}
    for name, (r, _) in sorted(sweeps.get("relay", {}).items()):
        b = sweeps.get("baseline", {}).get(name, (None,))[0]
        if not name.startswith("qps@") or b is None:
            continue
        cap = int(name.split("@")[1])
        ratio = r.crossing.value / b.crossing.value if b.crossing.value > 0 else None
        ref = reference_point(r)
        out[str(cap)] = {"ratio": None if ratio is None else round(ratio, 3),
                         **interval_keys(ratio_interval(r.crossing_replicates(), b.crossing_replicates())),
                         **(compute_bound(cost, queries, windows, cap, ref and ref.summary(), ratio) or {})}
    return out


def summarize(s: BenchSettings, sweeps: dict, modes: Sequence[Mode], headline: int, regime: Regime, k_how: dict,
              cost: CostModel, windows: list[Window], queries: Sequence[TraceQuery]) -> dict:
    k = regime.time_scale
    modes_out: dict[str, dict] = {}
    for mode in modes:
        mine = sweeps[mode.name]
        cap_sweep = mine.get("cap", (None, None))[0]
        thr_sweep = mine.get(f"qps@{headline}", (None, None))[0]
        best_point = reference_point(thr_sweep)
        modes_out[mode.name] = {
            "what": mode.what,
            "max_seq_len_at_slo": int(cap_sweep.best_passing) if cap_sweep else None,
            "max_seq_len_crossing": round(cap_sweep.crossing.value, 1) if cap_sweep else None,
            "slo_throughput_qps": round(thr_sweep.best_passing, 3) if thr_sweep else None,
            "slo_throughput_qps_unscaled": round(thr_sweep.best_passing * k, 3) if thr_sweep else None,
            "slo_throughput_crossing_qps": round(thr_sweep.crossing.value, 3) if thr_sweep else None,
            "throughput_cap": headline,
            "reference": best_point.summary() if best_point else None,
            "throughput_by_cap": {name.split("@")[1]: sw.summary(k) for name, (sw, _) in mine.items()
                                  if name.startswith("qps@")},
            "sweeps": {name: {**sw.summary(k), "sim_predicted": pred} for name, (sw, pred) in mine.items()},
            "throughput_vs": throughput_against(sweeps, mode, headline),
        }
    ratios = {}
    for key, name in (("max_seq_len", "cap"), ("slo_throughput", f"qps@{headline}")):
        b, r = sweeps.get("baseline", {}).get(name, (None,))[0], sweeps.get("relay", {}).get(name, (None,))[0]
        if b is None or r is None:
            ratios[key], ratios[f"{key}_ci"] = None, None
            continue
        bc, rc = b.crossing, r.crossing
        ratios[key] = round(rc.value / bc.value, 3) if bc.value > 0 else None
        iv = interval_keys(ratio_interval(r.crossing_replicates(), b.crossing_replicates()))
        ratios[f"{key}_ci"], ratios[f"{key}_ci_ends"] = iv["ci"], iv["ci_ends"]
        ratios[f"{key}_bounds"] = {"relay": rc.bound, "baseline": bc.bound}
        ratios[f"{key}_grid"] = round(r.best_passing / b.best_passing, 3) if b.best_passing else None
    ratios["by_cap"] = throughput_ratios(sweeps, cost, queries, windows)
    at_headline = ratios["by_cap"].get(str(headline), {})
    ratios["bound"], ratios["efficiency"] = at_headline.get("bound"), at_headline.get("efficiency")
    return {
        "time_scale": {**k_how, "meaning": "every time constant of the trace (arrival gaps, retrieval→ranking gap), "
                       "the SLO, the deadline and the caches' TTLs are × K on this machine; figures marked "
                       "'unscaled' are the reference device's (loads × K, latencies ÷ K)"},
        "regime": {"slo_ms": regime.slo_ms, "slo_ms_unscaled": s.slo_ms, "deadline_ms": regime.deadline_ms,
                   "entry_ttl_ms": regime.entry_ttl_ms, "dram_ttl_ms": regime.dram_ttl_ms,
                   "hbm_budget_mb": regime.hbm_budget_mb, "dram_budget_mb": regime.dram_budget_mb,
                   "preinfer_compute_share": regime.preinfer_compute_share,
                   "latency_model": asdict(regime.latency_model) if regime.latency_model else None,
                   "ref_qps": round(s.ref_qps / k, 3), "ref_qps_unscaled": s.ref_qps},
        "windows": {"count": len(windows), "measured_per_point": sum(w.measured for w in windows),
                    "warmup_per_window": s.warmup_queries, "primed_per_window": [w.primed for w in windows],
                    "starts": [w.start for w in windows]},
        "cost_model": cost.to_dict(),
        "common_cap": headline,
        "modes": modes_out,
        "ratios": ratios,
    }
