"""One benchmark run: calibrate, derive K, measure the sweeps on the real fleet(s), report.

Order: the cost model is measured inside the lab fleet's instance 0 (in this process when only the
product path runs); K is derived from it (or given); the simulator, on the same cost model, windows and
regime, predicts where each sweep crosses the SLO, so the real sweep starts there (two points when the
prediction is right); then, on each fleet asked for (``FLEETS``: the lab's engine processes, the
product's path through the workers, or both), every mode's points replay the same paired windows.
Each point is checked for contention while it runs and measured again when the host was busy.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

from relay_engine.core import devices
from relay_engine.core.model import HSTUModel
from relay_engine.core.trace import TraceQuery
from relay_engine.lab.bench import report
from relay_engine.lab.bench.bound import compute_bound
from relay_engine.lab.bench.calibration import profile_here, regime_for, time_scale
from relay_engine.lab.bench.instances import Fleet
from relay_engine.lab.bench.measure import RealMeasure, SimMeasure
from relay_engine.lab.bench.modes import MODES, Mode, Regime
from relay_engine.lab.bench.overhead import measure_overhead
from relay_engine.lab.bench.product import ProductFleet, ProductMeasure
from relay_engine.lab.bench.settings import BenchSettings
from relay_engine.lab.bench.stats import PointResult, ratio_interval
from relay_engine.lab.bench.sweeps import Measure, Sweep, nearest_index, sweep
from relay_engine.lab.bench.workload import (
    Window,
    paired_windows,
    trace_qps,
)
from relay_engine.lab.costmodel import PROFILE_LENGTHS, CostModel
from relay_engine.lab.traffic import describe


def guided_sweep(measure: Measure, predict: Measure | None, mode: Mode, variable: str, grid: Sequence[float],
                 fixed: float, slo_ms: float, refine: bool = False) -> tuple[Sweep, dict | None]:
    """The real sweep, started where the simulator's sweep crossed (when there is a simulator);
    with ``refine``, one more point between its crossing's pair (``sweeps.refine_crossing``)."""
    start, predicted = None, None
    if predict is not None:
        sim = sweep(predict, mode, variable, grid, fixed, slo_ms)
        start = nearest_index(grid, sim.crossing.value)
        predicted = {"crossing": round(sim.crossing.value, 3), "bound": sim.crossing.bound,
                     "points": [{"x": sim.x(p), "p99_ms": p.summary()["p99_ms"]} for p in sim.points]}
    return sweep(measure, mode, variable, grid, fixed, slo_ms, start, refine=refine), predicted


@dataclass(frozen=True)
class Calibrated:
    cost: CostModel
    time_scale: float
    time_scale_how: dict
    regime: Regime
    windows: list[Window]


def calibrate(settings: BenchSettings, queries: Sequence[TraceQuery], fleet: Fleet | None,
              cost: CostModel | None = None) -> Calibrated:
    """The cost model (unless given: measured in the lab fleet's instance 0, or in this process, on the
    instances' torch threads, without one), K, the regime and the paired windows."""
    s = settings
    short = int(np.median([q.short_len for q in queries]))
    cands = int(np.median([q.n_candidates for q in queries]))
    if cost is None:
        lengths = tuple(n for n in PROFILE_LENGTHS if n <= max(s.caps))
        if fleet is not None:
            cost = CostModel.from_dict(fleet.call(0, profile_here, s, short, cands, lengths))
        else:
            devices.keep_freed_host_memory()  # as the instances do
            torch.set_num_threads(s.threads_per_instance)
            cost = CostModel.from_dict(profile_here(s, short, cands, lengths))
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
            sweeps[mode.name]["cap"] = guided_sweep(measure, predict, mode, "cap", s.caps, ref_qps, slo_ms,
                                                    s.refine_crossings)
        headline = s.headline_cap or int(sweeps["baseline"]["cap"][0].best_passing) or min(s.caps)
    else:
        assert s.headline_cap, "without the max-sequence-length sweeps the headline cap must be given"
        headline = s.headline_cap
    loads = [ref_qps * step for step in s.load_steps]
    for mode in modes:
        if s.ablations or mode.name in ("baseline", "relay"):
            sweeps[mode.name][f"qps@{headline}"] = guided_sweep(measure, predict, mode, "qps", loads, headline,
                                                                slo_ms, s.refine_crossings)
    if s.cap_sweep:
        for cap in s.throughput_caps:
            if cap != headline:
                for mode in (by_name["baseline"], by_name["relay"]):
                    sweeps[mode.name][f"qps@{cap}"] = guided_sweep(measure, predict, mode, "qps", loads, cap,
                                                                   slo_ms, s.refine_crossings)
    return sweeps, headline


# Where the points are measured: the lab's own engine processes, the product's path (client → Redis →
# workers), or both in one run on the same windows (the product's ratio is then the headline).
FLEETS = ("lab", "product", "both")
FLEET_WHAT = {"lab": "the lab's engine processes (instances.Fleet)",
              "product": "the product's path: RelayClient → Redis → worker instances (product.ProductFleet)"}


def measure_fleets(s: BenchSettings, queries: Sequence[TraceQuery], fleet: str, modes: Sequence[Mode],
                   progress: tqdm) -> tuple[Calibrated, dict[str, tuple[dict, int]], dict]:
    """Calibrate (in the lab fleet's instance 0, or here without one), then measure every sweep on each
    fleet asked for: the product first, and the lab at the product's headline cap, so both ratios are
    taken at one cap. Returns the calibration, each fleet's (sweeps, headline cap), and the model version
    and the lab instances' pinned cores (None without the lab fleet)."""
    lab = Fleet(s) if fleet in ("lab", "both") else None
    runs: dict[str, tuple[dict, int]] = {}
    try:
        progress.set_description("profiling the cost model")
        cal = calibrate(s, queries, lab)
        predict = SimMeasure(s, cal.cost, queries, cal.windows, cal.regime) if s.sim_guided else None
        served = {"model_version": lab.model_version if lab is not None else HSTUModel(s.model).version,
                  "cores_per_instance": lab.cores if lab is not None else None}
        if fleet in ("product", "both"):
            product = ProductFleet(s)
            try:
                runs["product"] = measure_sweeps(
                    s, ProductMeasure(s, product, queries, cal.windows, cal.regime, progress), predict, cal.regime,
                    modes)
            finally:
                product.close()
        if lab is not None:
            at = replace(s, headline_cap=runs["product"][1]) if "product" in runs else s
            runs["lab"] = measure_sweeps(at, RealMeasure(at, lab, queries, cal.windows, cal.regime, progress), predict,
                                         cal.regime, modes)
    finally:
        if lab is not None:
            lab.close()
    return cal, runs, served


def run(settings: BenchSettings, queries: list[TraceQuery], trace_name: str, out: Path,
        modes: Sequence[Mode] = MODES, fleet: str = "lab") -> dict:
    s = settings
    started = time.monotonic()
    load_start = os.getloadavg()
    progress = tqdm(unit="point", file=sys.stderr, dynamic_ncols=True)
    try:
        cal, runs, served = measure_fleets(s, queries, fleet, modes, progress)
    finally:
        progress.close()
    cost, k, regime, windows = cal.cost, cal.time_scale, cal.regime, cal.windows
    headline_fleet = "product" if "product" in runs else "lab"
    summaries = {name: summarize(s, sweeps, modes, cap, regime, cal.time_scale_how, cost, windows, queries)
                 for name, (sweeps, cap) in runs.items()}
    result = {**summaries[headline_fleet], "fleet": headline_fleet, "fleet_what": FLEET_WHAT[headline_fleet]}
    if len(summaries) > 1:
        result["fleets"] = {name: {"what": FLEET_WHAT[name], "headline": name == headline_fleet,
                                   **{key: summary[key] for key in ("common_cap", "modes", "ratios")}}
                            for name, summary in summaries.items()}
    overhead = measure_overhead(s, queries, result["common_cap"], regime)
    result.update({
        "trace": {"source": trace_name, "queries": len(queries), "qps": round(trace_qps(queries), 3),
                  "qps_scaled": round(trace_qps(queries) / k, 3), "summary": describe(queries, trace_name)},
        "host": {"cpus": os.cpu_count(), "cores_per_instance": served["cores_per_instance"], "torch": torch.__version__,
                 "load_avg_start": [round(x, 2) for x in load_start],
                 "load_avg_end": [round(x, 2) for x in os.getloadavg()]},
        "settings": {**{k_: (str(v) if isinstance(v, Path) else v) for k_, v in asdict(s).items() if k_ != "model"},
                     "model": asdict(s.model), "model_version": served["model_version"]},
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
