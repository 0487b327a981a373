"""The simulator against the real fleet: the same points (mode, cap, load) on the same paired windows
and the same regime; the relative error of the simulator at every point, as fractions: (simulated −
measured) ÷ measured, for P99, P50, within-SLO share, hit ratio and the HBM peak. The target is |P99
error| ≤ 15 % at every point.

Each point is simulated three ways. ``sim`` (its errors are the point's ``p99_error`` …; the median-P99
replay of ``REPLAYS``, the real P99's interval beside it: ``p99_within_real_interval``) replays with
the cost model fitted from the real instances' own forwards at that point (``livefit``: what a preview
does with a pool's forwards; a forward costs more CPU in service than alone) and the CPU their
processes spent outside the forwards, per ranking request (``stats.cpu_parts``: the dispatcher, handing
requests to rank threads, the interpreter lock changing hands; ``in_service_overhead``), with the cost
of interleaving forwards on a core made explicit (its slope, ``livefit.thrash_within``, from each
forward's deviation against its own interleaving, pooled over the points; the level at none by
``livefit.fit_thrash`` over every point's ``livefit.interleaving``: each point's fitted costs taken at no interleaving, each forward costing more
the more run with it — ``thrash``, per point ``interleaving``);
``sim_forwards_only`` (``p99_error_forwards_only`` …) with the fitted forwards alone; ``sim_profile``
(``p99_error_profile`` …) with the cost model measured inside instance 0 alone before the run. Both
sides say where their time went (``time_parts_ms``: queued before a rank thread, the forwards' own
time, the rest — sharing a core, waits on a computation in flight —, over all requests and over the
tail), so an error can be traced to its component."""

from __future__ import annotations

import sys
import time
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path

from tqdm import tqdm

from relay_engine.core.forward_times import Drift, ForwardTimes
from relay_engine.core.trace import TraceQuery
from relay_engine.lab.bench.instances import Fleet
from relay_engine.lab.bench.modes import MODES_BY_NAME
from relay_engine.lab.bench.report import write_json
from relay_engine.lab.bench.run import RealMeasure, SimMeasure, calibrate
from relay_engine.lab.bench.settings import BenchSettings
from relay_engine.lab.costmodel import CostModel
from relay_engine.lab.livefit import fit_live, fit_thrash, interleaving, thrash_within

P99_TARGET = 0.15
REPLAYS = 9  # replays of each point with the full model, forward times drawn anew in each
# (mode, cap, load × the reference load): both sides of the relay/baseline comparison, light and loaded.
DEFAULT_POINTS = (("baseline", 1024, 1.0), ("baseline", 2048, 0.5), ("relay", 2048, 1.0), ("relay", 4096, 0.5),
                  ("relay_cache_only", 2048, 1.0))


def relative_error(sim: float | None, real: float | None) -> float | None:
    if sim is None or real is None or real == 0:
        return None
    return round((sim - real) / real, 4)


def compare(real: dict, sim: dict) -> dict:
    return {
        "p99_error": relative_error(sim["p99_ms"], real["p99_ms"]),
        "p50_error": relative_error(sim["p50_ms"], real["p50_ms"]),
        "within_slo_error": relative_error(sim["within_slo_share"], real["within_slo_share"]),
        "hit_ratio_error": relative_error(sim["hit_ratio"], real["hit_ratio"]),
        "hbm_peak_error": relative_error(sim["hbm_peak_bytes"], real["hbm_peak_bytes"]),
    }


def validate(settings: BenchSettings, queries: Sequence[TraceQuery], out: Path,
             points: Sequence[tuple[str, int, float]] = DEFAULT_POINTS, cost: CostModel | None = None) -> dict:
    started = time.monotonic()
    fleet = Fleet(settings)
    progress = tqdm(unit="point", file=sys.stderr, dynamic_ncols=True)
    rows = []
    try:
        progress.set_description("profiling instance 0 (the cost model)")
        cal = calibrate(settings, queries, fleet, cost)
        real = RealMeasure(settings, fleet, queries, cal.windows, cal.regime, progress)
        sim = SimMeasure(settings, cal.cost, queries, cal.windows, cal.regime)
        measured_points = []
        for mode_name, cap, load in points:
            mode = MODES_BY_NAME[mode_name]
            qps = settings.ref_qps / cal.time_scale * load
            cap = min(cap, max(settings.caps))
            measured_points.append((mode, cap, qps, real(mode, cap, qps)))
        # What interleaving costs, from every point's ranking forwards at once: a point's own averages
        # cannot tell its load's part of the in-service cost from the part that is there at any load.
        # Its slope comes from within the points (each forward's deviation against its own interleaving):
        # across the points' averages, the modes' inflation (prefills beside ranks) reads as interleaving.
        pooled = Drift()
        for *_, p in measured_points:
            pooled.merge((p.forward_times or ForwardTimes()).drift)
        fitted = fit_thrash([interleaving(p.forward_times or ForwardTimes(), cal.cost) for *_, p in measured_points],
                            within=thrash_within(pooled))
        progress.set_description("simulating the points")
        for (mode, cap, qps, point), turns in zip(measured_points, fitted.points, strict=True):
            measured = point.summary()
            fit = fit_live(point.forward_times or ForwardTimes(), cal.cost)
            cpu = point.cpu_parts
            overhead_ms, background = cpu.get("outside_per_rank", 0.0), cpu.get("others_share", 0.0)
            # The fitted forwards cost what they did at this point's average interleaving; the simulator
            # takes them at none and makes each cost more the more forwards interleave with it.
            at_none = fit.cost.scaled(1 / (1 + fitted.thrash * (turns.sharing - 1)))
            # The forward times are drawn (their measured dispersion): the replay with the median P99 of
            # ``REPLAYS``, each with draws of its own, is the point's; the others' P99s are kept beside it.
            replays = SimMeasure(settings, at_none, queries, cal.windows, cal.regime, overhead_ms, background,
                                 fitted.thrash)
            summaries = sorted((replays(mode, cap, qps, forward_seed=settings.seed + k).summary()
                                for k in range(REPLAYS)), key=lambda r: (r["p99_ms"] is None, r["p99_ms"] or 0))
            simulated = {**summaries[len(summaries) // 2], "p99_replays_ms": [r["p99_ms"] for r in summaries]}
            lo, hi = measured["p99_ci_ms"] or (None, None)
            forwards_only = SimMeasure(settings, fit.cost, queries, cal.windows, cal.regime)(mode, cap, qps).summary()
            alone = sim(mode, cap, qps).summary()
            rows.append({"mode": mode.name, "cap": measured["cap"], "qps": measured["qps"], "n": measured["n"],
                         "real": measured, "sim": simulated, "sim_forwards_only": forwards_only, "sim_profile": alone,
                         "in_service_fit": fit.to_dict(),
                         "drift": None if fit.drift is None else fit.drift.to_dict(),
                         "in_service_overhead": {"rank_overhead_ms": round(overhead_ms, 3),
                                                 "background_share": round(background, 4)},
                         "interleaving": turns.to_dict(),
                         "p99_within_real_interval": (None if lo is None or simulated["p99_ms"] is None
                                                      else lo <= simulated["p99_ms"] <= hi),
                         **compare(measured, simulated),
                         **{f"{k}_forwards_only": v for k, v in compare(measured, forwards_only).items()},
                         **{f"{k}_profile": v for k, v in compare(measured, alone).items()}})
    finally:
        progress.close()
        fleet.close()
    p99_errors = [abs(r["p99_error"]) for r in rows if r["p99_error"] is not None]
    profile_errors = [abs(r["p99_error_profile"]) for r in rows if r["p99_error_profile"] is not None]
    forwards_errors = [abs(r["p99_error_forwards_only"]) for r in rows if r["p99_error_forwards_only"] is not None]
    result = {
        "points": rows,
        "max_abs_p99_error": max(p99_errors, default=None),
        "max_abs_p99_error_forwards_only": max(forwards_errors, default=None),
        "thrash": fitted.to_dict(),
        "max_abs_p99_error_profile": max(profile_errors, default=None),
        "p99_target": P99_TARGET,
        "within_target": bool(p99_errors) and max(p99_errors) <= P99_TARGET,
        "time_scale": cal.time_scale_how, "regime": {"slo_ms": cal.regime.slo_ms, "deadline_ms": cal.regime.deadline_ms},
        "cost_model": cal.cost.to_dict(),
        "settings": {k: (str(v) if isinstance(v, Path) else v) for k, v in asdict(settings).items() if k != "model"},
        "runtime_s": round(time.monotonic() - started, 1),
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    write_json(out, result)
    return result


def table(result: dict) -> str:
    lines = ["| mode | cap | QPS | n | P99 real (ms) [95 %] | P99 sim (ms) (replays) | P99 error | P50 error | within-SLO error | "
             "hit-ratio error | HBM-peak error | P99 sim, forwards only (error) | P99 sim, profile alone (error) |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]

    def pct(x):
        return "–" if x is None else f"{100 * x:+.1f} %"

    for r in result["points"]:
        alone, forwards_only = r.get("sim_profile") or {}, r.get("sim_forwards_only") or {}
        ci, replays = r["real"].get("p99_ci_ms"), r["sim"].get("p99_replays_ms") or []
        real_p99 = f"{r['real']['p99_ms']}" + (f" [{ci[0]:.0f}, {ci[1]:.0f}]" if ci else "")
        sim_p99 = f"{r['sim']['p99_ms']}" + (f" ({min(replays):.0f}–{max(replays):.0f})" if len(replays) > 1 else "")
        lines.append(f"| {r['mode']} | {r['cap']} | {r['qps']:g} | {r['n']} | {real_p99} | "
                     f"{sim_p99} | {pct(r['p99_error'])} | {pct(r.get('p50_error'))} | "
                     f"{pct(r['within_slo_error'])} | {pct(r['hit_ratio_error'])} | {pct(r['hbm_peak_error'])} | "
                     f"{forwards_only.get('p99_ms', '–')} ({pct(r.get('p99_error_forwards_only'))}) | "
                     f"{alone.get('p99_ms', '–')} ({pct(r.get('p99_error_profile'))}) |")
    lines += ["", "Where the real instances' CPU went (ms per ranking request; shares of the window): the ranks' own "
              "threads, the lane's prefills, the rest of the process (charged to each request in the simulator), "
              "other processes on the pinned cores; and the ranking forwards' interleaving (wall ÷ CPU time) and "
              "their CPU time ÷ the profile's alone:",
              "| mode | cap | ranks | prefills | rest of the process | others' share | interleaving | inflation |",
              "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for r in result["points"]:
        cpu = r["real"].get("cpu_ms") or {}
        n = cpu.get("rank_requests") or 0
        turns = r.get("interleaving") or {}
        shared = f"{turns['sharing']:.2f} | {turns['inflation']:.2f}" if turns else "– | –"
        if not n:
            lines.append(f"| {r['mode']} | {r['cap']} | – | – | – | – | {shared} |")
            continue
        others = cpu.get("others_share")
        lines.append(f"| {r['mode']} | {r['cap']} | {cpu['ranks'] / n:.2f} | {cpu['prefill'] / n:.2f} | "
                     f"{cpu['outside_per_rank']:.2f} | {'–' if others is None else f'{100 * others:.1f} %'} | "
                     f"{shared} |")
    drifts = [(r["mode"], r["cap"], r.get("drift")) for r in result["points"]]
    if any(d for *_, d in drifts):
        lines += ["", "How the real instances' speed drifted (the slow part of the forwards' dispersion, drawn as one "
                  "Ornstein-Uhlenbeck factor per instance: its log variance, correlation time, share of the "
                  "deviations' variance):", "| mode | cap | variance | tau (s) | share |", "|---|---:|---:|---:|---:|"]
        lines += [f"| {mode} | {cap} | {d['variance']:.4f} | {d['tau_s']:.2f} | {d['share_of_variance']} |"
                  if d else f"| {mode} | {cap} | – | – | – |" for mode, cap, d in drifts]
    thrash = result.get("thrash")
    if thrash:
        lines.append(f"\nInterleaving: each further forward on a core adds {thrash['thrash']:.3g} of a forward's CPU time "
                     f"(each forward's deviation against its own turns, pooled over the points) "
                     f"(level at none {thrash['level']:.2f}× the profile, largest miss {100 * thrash['error']:.1f} %).")
    lines += ["", "Where the time went (means, ms: queued — of it, on the real side, dispatched late — / forwards "
              "alone / the rest), all requests and the tail (≥ P99):", "| mode | cap | real, all | sim, all | real, tail | sim, tail |", "|---|---:|---|---|---|---|"]

    def parts(p: dict | None) -> str:
        if not p:
            return "–"
        late = f" ({p['dispatched_late']:.1f} late)" if "dispatched_late" in p else ""
        return f"{p['queued']:.1f}{late} / {p['work']:.1f} / {p['rest']:.1f}"

    for r in result["points"]:
        real, sim = r["real"].get("time_parts_ms") or {}, r["sim"].get("time_parts_ms") or {}
        lines.append(f"| {r['mode']} | {r['cap']} | {parts(real.get('all'))} | {parts(sim.get('all'))} | "
                     f"{parts(real.get('tail'))} | {parts(sim.get('tail'))} |")
    worst, alone = result["max_abs_p99_error"], result.get("max_abs_p99_error_profile")
    forwards_only = result.get("max_abs_p99_error_forwards_only")

    def worst_pct(x):
        return "–" if x is None else f"{100 * x:.1f} %"

    lines.append(f"\nLargest |P99 error|: {worst_pct(worst)} with the in-service fit and the process's own CPU, "
                 f"{worst_pct(forwards_only)} with the fit of the forwards only, {worst_pct(alone)} with the profile "
                 f"alone (target ≤ {100 * result['p99_target']:.0f} %).")
    return "\n".join(lines)
