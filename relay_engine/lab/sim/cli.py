"""``python -m relay_engine.sim``: the calibrated fleet simulator (see ``relay_engine.lab.sim``).

    python -m relay_engine.sim run [--trace FILE] [--profile FILE] [--instances 64] [--load 40] [--modes …]
    python -m relay_engine.sim project [--profile FILE] [--instances 2] [--cap-sweep] [--out FILE]
    python -m relay_engine.sim validate --out v.json [--profile FILE] [--quick]
    python -m relay_engine.sim preview --trace FILE --live SPEC --proposed SPEC --instances N
        [--device-kind cpu|cuda|npu] [--profile FILE] [--forward-times FILE] [--max-requests 15000]
        [--validation FILE] --out FILE
    python -m relay_engine.sim fit --forward-times FILE [--profile FILE] [--out cost.json]
    python -m relay_engine.sim decompose KEPT_DIR [--seed 0] [--slowest 15] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import asdict, replace
from pathlib import Path

import numpy as np
from tqdm import tqdm

from relay_engine.core.capture import to_trace
from relay_engine.core.config import PolicyError, parse_policy
from relay_engine.core.forward_times import ForwardTimes, ForwardTimesError
from relay_engine.core.trace import TraceError, TraceQuery, read_trace
from relay_engine.lab.bench import report
from relay_engine.lab.bench.calibration import regime_for
from relay_engine.lab.bench.cli import positive_number, time_scale_flag
from relay_engine.lab.bench.modes import MODES, MODES_BY_NAME
from relay_engine.lab.bench.run import SimMeasure, measure_sweeps, summarize
from relay_engine.lab.bench.settings import REFERENCE_PROFILE, BenchSettings, quick_settings
from relay_engine.lab.bench.workload import paired_windows, trace_qps
from relay_engine.lab.costmodel import CostModel, CostModelError, time_scale_against
from relay_engine.lab.livefit import (
    COMPARE_LENGTHS,
    fit_live,
    read_pool_forwards,
    wall_over_cpu,
    window_words,
)
from relay_engine.lab.sim import decompose
from relay_engine.lab.sim.fleet import FleetSpec
from relay_engine.lab.sim.preview import (
    DEFAULT_MAX_REQUESTS,
    DEFAULT_VALIDATION,
    model_error_of,
    profile_for,
    run_preview,
    simulate_trace,
)
from relay_engine.lab.sim.validate import table, validate
from relay_engine.lab.traffic import TraceSpec, describe, generate_trace


def _queries(args: argparse.Namespace, default: TraceSpec) -> tuple[list[TraceQuery], str]:
    if args.trace:
        queries = read_trace(args.trace)
        if len(queries) < 2:
            raise TraceError(0, f"a trace needs at least 2 queries, got {len(queries)}", args.trace)
        return queries, args.trace
    spec = replace(default, **{k: v for k, v in (("queries", args.queries), ("qps", args.trace_qps)) if v})
    return generate_trace(spec), f"generated: {spec}"


def _cost(path: Path | None, fallback: Path | None) -> CostModel | None:
    chosen = path or fallback
    return None if chosen is None else CostModel.load(chosen)


def cmd_run(args: argparse.Namespace) -> int:
    """Every query of the trace through N simulated instances, once per mode."""
    queries, name = _queries(args, TraceSpec())
    cost = _cost(args.profile, REFERENCE_PROFILE)
    short, cands = int(np.median([q.short_len for q in queries])), int(np.median([q.n_candidates for q in queries]))
    k = args.time_scale if args.time_scale is not None else \
        time_scale_against(cost, CostModel.load(REFERENCE_PROFILE), short=short, candidates=cands)
    settings = BenchSettings(slo_ms=args.slo_ms, instances=args.instances, rank_threads=args.rank_threads)
    regime = regime_for(settings, cost, k, short, cands)
    rate = trace_qps(queries)
    qps = rate * args.load / k
    rows = {}
    print(f"{describe(queries, name)}\n{args.instances} instances, K = {k:g}, offered {qps:g} QPS here "
          f"({qps * k:g} unscaled), SLO {regime.slo_ms:g} ms; cost model: {cost.device} ({cost.note[:80]}…)",
          file=sys.stderr)
    for mode_name in args.modes.split(","):
        mode = MODES_BY_NAME[mode_name]
        spec = FleetSpec.of_mode(mode, regime, args.instances, args.rank_threads, cost.device)
        span_s = (queries[-1].t_ms - queries[0].t_ms) / 1000 * k / args.load
        with tqdm(total=round(span_s, 1), unit="virtual s", desc=mode_name, file=sys.stderr, dynamic_ncols=True) as bar:
            def progress(t: float, bar=bar) -> None:
                bar.update(round(t, 1) - bar.n)

            started = time.monotonic()
            point = simulate_trace(queries, spec, cost, slo_ms=regime.slo_ms, cap=args.cap, qps=qps,
                                   prime_share=args.prime_share, warmup_share=args.warmup_share, seed=args.seed,
                                   progress=progress, name=mode_name)
        point.bootstrap(500, np.random.default_rng(args.seed))
        rows[mode_name] = {**point.summary(), "sim_wall_s": round(time.monotonic() - started, 1)}
    print("| mode | n | P50 ms | P99 ms [95 % CI] | within SLO | hit ratio | pre-infer admitted | peak HBM / "
          "instance (MiB) | sim wall (s) |\n|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for mode_name, r in rows.items():
        ci = r["p99_ci_ms"] or ["–", "–"]
        print(f"| {mode_name} | {r['n']} | {r['p50_ms']} | {r['p99_ms']} [{ci[0]}, {ci[1]}] | "
              f"{r['within_slo_share']} | {r['hit_ratio']} | {r['preinfer']['admitted']} | "
              f"{r['hbm_peak_bytes'] / 2**20 / args.instances:.0f} | {r['sim_wall_s']} |")
    if args.out:
        report.write_json(Path(args.out), {"trace": name, "instances": args.instances, "time_scale": k,
                                           "qps": qps, "modes": rows, "cost_model": cost.to_dict()})
    return 0


def cmd_project(args: argparse.Namespace) -> int:
    """The benchmark's sweeps, modes and ablations, in the simulator, on any device's cost model."""
    queries, name = _queries(args, TraceSpec())
    cost = _cost(args.profile, REFERENCE_PROFILE)
    settings = BenchSettings(slo_ms=args.slo_ms, instances=args.instances, rank_threads=args.rank_threads,
                             cap_sweep=args.cap_sweep, ref_qps=args.ref_qps or BenchSettings.ref_qps)
    if args.quick:
        settings = quick_settings(settings)
    short, cands = int(np.median([q.short_len for q in queries])), int(np.median([q.n_candidates for q in queries]))
    k = args.time_scale if args.time_scale is not None else \
        time_scale_against(cost, CostModel.load(REFERENCE_PROFILE), short=short, candidates=cands)
    regime = regime_for(settings, cost, k, short, cands)
    prime = round(settings.entry_ttl_ms / 1000 * trace_qps(queries) * settings.prime_ttls)
    windows = paired_windows(len(queries), settings.windows, settings.warmup_queries, settings.measured_queries,
                             prime)
    started = time.monotonic()
    sim = SimMeasure(settings, cost, queries, windows, regime)
    progress = tqdm(unit="point", file=sys.stderr, dynamic_ncols=True)

    def measure(mode, cap, qps):
        progress.set_description(f"{mode.name:<19} cap {cap:>5} @ {qps:7.2f} qps")
        progress.update(1)
        return sim(mode, cap, qps)

    with progress:
        sweeps, headline = measure_sweeps(settings, measure, None, regime, MODES)
    result = summarize(settings, sweeps, MODES, headline, regime,
                       {"time_scale": k, "how": "--time-scale (1: the profile's own device, no scaling)"},
                       cost, windows, queries)
    replayed = sum(w.end - w.start for w in windows)
    points = [p for m in sweeps.values() for sw, _ in m.values() for p in sw.points]
    result.update({"trace": {"source": name, "queries": len(queries)}, "overhead": {"engine_over_bare_ratio": None},
                   "points_measured": len(points),
                   # what the real benchmark would spend replaying these points on its own clock
                   "real_replay_estimate_s": round(sum(replayed / p.qps for p in points), 1),
                   "settings": {"instances": settings.instances, "rank_threads": settings.rank_threads,
                                "max_redo": 0, "projected": True, "profile": str(args.profile or REFERENCE_PROFILE)},
                   "runtime_s": round(time.monotonic() - started, 1)})
    result["markdown"] = report.markdown(result)
    out = Path(args.out)
    result["plots"] = report.plots(result, out.parent / "projection")
    report.write_json(out, result)
    print(result["markdown"])
    print(f"\nwrote {out} in {result['runtime_s']:.0f} s (simulated, not measured)")
    return 0


def cmd_validate(args: argparse.Namespace) -> int:
    """Simulator against the real fleet on the same points and windows."""
    queries, _ = _queries(args, TraceSpec(queries=3_000) if args.quick else TraceSpec())
    settings = BenchSettings(time_scale=args.time_scale, instances=args.instances, rank_threads=args.rank_threads)
    if args.quick:
        settings = quick_settings(settings)
    if args.ref_qps:
        settings = replace(settings, ref_qps=args.ref_qps)
    result = validate(settings, queries, Path(args.out), cost=_cost(args.profile, None))
    print(table(result))
    print(f"\nwrote {args.out} in {result['runtime_s']:.0f} s")
    return 0


class SpecFileError(ValueError):
    pass


def _spec_file(path: str, what: str):
    try:
        return parse_policy(json.loads(Path(path).read_text()))
    except (PolicyError, json.JSONDecodeError) as exc:
        raise SpecFileError(f"the {what} spec {path}: {exc}") from None


def preview_cost(profile: Path | None, device_kind: str, forward_times: Path | None) -> tuple[CostModel, dict]:
    """The cost model a preview replays with: fitted from the pool's own forwards where it has them, the
    rest from ``profile`` (default: its device kind's); and what it is, in words and figures."""
    if profile:
        profile_note = "the profile given with --profile"
    else:
        profile, profile_note = profile_for(device_kind)
    cost = CostModel.load(profile)
    pools_own = not Path(profile).samefile(REFERENCE_PROFILE)
    live_fit, pool_sharing = None, None
    if forward_times:
        times, meta = read_pool_forwards(forward_times)
        live_fit = fit_live(times, cost)
        pool_sharing = ranking_sharing(times, meta)
        if live_fit.live_ops:
            cost = live_fit.cost
            # The pool's own times when every operation is, or the rest come from its own device's profile.
            pools_own = pools_own or len(live_fit.live_ops) == len(live_fit.ops)
            profile_note = (f"fitted from this pool's own forwards over {window_words(meta)} "
                            f"({live_fit.sentence()}; the rest: {profile_note})")
        else:
            profile_note = f"{profile_note}: no forwards of this pool's own in {window_words(meta)} yet"
    return cost, {"path": str(profile), "device": cost.device, "note": profile_note,
                  # whether the times are this pool's devices' own, or a stand-in's
                  "pools_own": pools_own, "live_fit": None if live_fit is None else live_fit.to_dict(),
                  "pool_sharing": pool_sharing}


# Ranking forwards a window needs before its wall ÷ CPU time stands for the host's other processes.
MIN_SHARING_FORWARDS = 100


def ranking_sharing(times: ForwardTimes, meta: dict) -> float | None:
    """The pool's ranking forwards' wall time ÷ CPU time (``livefit.wall_over_cpu``), where its instances
    time their forwards on the CPU clock (wall time beside it) and ran enough of them; else None."""
    ranks = sum(m.count for m in times.means() if m.op in ("rank", "rank_full"))
    if meta.get("clock") != "thread_cpu" or ranks < MIN_SHARING_FORWARDS:
        return None
    return wall_over_cpu(times)


def cmd_preview(args: argparse.Namespace) -> int:
    """The what-if preview: a captured window under the live spec and under the proposed one."""
    queries = read_trace(args.trace)
    if len(queries) < 2:
        raise TraceError(0, f"a preview needs at least 2 captured requests, got {len(queries)}", args.trace)
    live, proposed = _spec_file(args.live, "live"), _spec_file(args.proposed, "proposed")
    cost, profile_info = preview_cost(args.profile, args.device_kind, args.forward_times)
    model_error, model_error_note = model_error_of(Path(args.validation))
    result = run_preview(queries, live, proposed, instances=args.instances, cost=cost,
                         rank_threads=args.rank_threads, max_requests=args.max_requests, jobs=args.jobs,
                         host=(args.instances_per_host, args.host_cores), warmup_requests=args.warmup_requests,
                         pool_sharing=profile_info["pool_sharing"])
    result.update({"model_error": model_error, "model_error_note": model_error_note, "profile": profile_info})
    report.write_json(Path(args.out), result)
    print(f"previewed {result['requests']} requests on {args.instances} instances in {result['sim_wall_s']} s "
          f"({profile_info['note']}); wrote {args.out}", file=sys.stderr)
    return 0


def cmd_fit(args: argparse.Namespace) -> int:
    """The pool's cost model from its own forwards, beside the offline profile."""
    times, meta = read_pool_forwards(args.forward_times)
    profile = args.profile or profile_for(meta.get("device_kind") or "cpu")[0]
    base = CostModel.load(profile)
    live = fit_live(times, base)
    print(f"{times.count} forwards over {window_words(meta)}; offline profile {profile}")
    print(f"{'op':<10} {'how':<8} {'forwards':>8} {'buckets':>7} {'fit err':>8} {'cv':>6}  "
          + "  ".join(f"{n:>6}" for n in COMPARE_LENGTHS) + "   (fitted ÷ profile at n tokens)")
    for op, f in live.ops.items():
        err = "–" if f.max_error is None else f"{100 * f.max_error:.1f} %"
        cv = "–" if f.cv is None else f"{f.cv:.2f}"
        print(f"{op:<10} {f.how:<8} {f.forwards:>8} {f.buckets:>7} {err:>8} {cv:>6}  "
              + "  ".join(f"{f.vs_profile[n]:>6.3f}" for n in COMPARE_LENGTHS))
    if args.out:
        live.cost.save(args.out)
        report.write_json(Path(args.out).with_suffix(".fit.json"),
                          {"meta": meta, "profile": str(profile), "ops": live.to_dict()})
        print(f"wrote {args.out}", file=sys.stderr)
    return 0


def cmd_decompose(args: argparse.Namespace) -> int:
    """A kept preview replayed request by request against the capture (``sim.decompose``)."""
    folder = Path(args.folder)
    try:
        kept = json.loads((folder / "command.json").read_text(encoding="utf-8"))
        argv = [str(a) for a in kept["argv"]]
    except (KeyError, TypeError) as exc:
        raise SpecFileError(f"{folder / 'command.json'} is not a kept preview's command ({exc})") from None
    original = build_parser().parse_args(argv)
    # The files the preview ran on, under the names the control plane kept them by.
    local = {k: folder / Path(getattr(original, k)).name for k in ("trace", "live", "forward_times")
             if getattr(original, k)}
    records = decompose.read_capture(folder / "capture.jsonl")
    kept_trace = read_trace(local["trace"])
    # The trace again from the records (the same queries in the same order; with each one's instance
    # where the kept trace predates that field), checked against the kept one.
    queries = to_trace(records)
    if len(queries) != len(kept_trace) or any(
            (a.user_id, a.seq_len) != (b.user_id, b.seq_len) or abs(a.rank_delay_ms - b.rank_delay_ms) > 0.01
            for a, b in zip(queries, kept_trace, strict=False)):
        raise decompose.KeptError(f"{local['trace']} and {folder / 'capture.jsonl'} are not the same requests "
                                  f"in the same order")
    live = _spec_file(str(local["live"]), "live")
    kept_profile = folder / "profile.json"  # the profile the preview started from, where it was kept
    profile = original.profile or (kept_profile if kept_profile.is_file() else None)
    forwards = None if args.profile_alone else local.get("forward_times")
    cost, profile_info = preview_cost(profile, original.device_kind, forwards)
    rows, background = decompose.replay_rows(queries, records, live, cost, instances=original.instances,
                                 rank_threads=original.rank_threads,
                                 host=(original.instances_per_host, original.host_cores),
                                 max_requests=original.max_requests, warmup_requests=original.warmup_requests,
                                 seed=args.seed, routing=args.routing, pool_sharing=profile_info["pool_sharing"])
    result = decompose.summarize(rows, live.trigger.ranking_p99_slo_ms, slowest=args.slowest)
    result["profile"] = profile_info["note"]
    result["host_background"] = background.to_dict()
    print(f"Preview {folder.name} of pool {kept.get('pool')}, replayed with seed {args.seed}; cost model: "
          f"{profile_info['note']}; {background.sentence()}\n")
    print(decompose.table(result))
    if args.out:
        report.write_json(Path(args.out), result | {"rows": [asdict(r) for r in rows]})
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command == "preview" and args.warmup_requests < 0:
        parser.error(f"--warmup-requests must be ≥ 0, got {args.warmup_requests}")
    if args.command == "preview" and args.max_requests < 100:
        parser.error(f"--max-requests must be at least 100, got {args.max_requests}")
    if args.command not in ("fit", "decompose") and not 1 <= args.instances <= 256:
        parser.error(f"--instances must be between 1 and 256, got {args.instances}")
    if args.command not in ("fit", "decompose") and args.rank_threads < 1:
        parser.error(f"--rank-threads must be ≥ 1, got {args.rank_threads}")
    if args.command == "run":
        unknown = [m for m in args.modes.split(",") if m not in MODES_BY_NAME]
        if unknown:
            parser.error(f"--modes: unknown {unknown}; choose from {', '.join(MODES_BY_NAME)}")
    try:
        return {"run": cmd_run, "project": cmd_project, "validate": cmd_validate,
                "preview": cmd_preview, "fit": cmd_fit, "decompose": cmd_decompose}[args.command](args)
    except (TraceError, OSError, CostModelError, SpecFileError, json.JSONDecodeError, ForwardTimesError,
            decompose.KeptError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m relay_engine.sim", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--trace", help="trace file (JSON Lines); default: a generated trace")
    common.add_argument("--queries", type=int, help="queries of the generated trace")
    common.add_argument("--trace-qps", type=positive_number, help="arrival rate of the generated trace")
    common.add_argument("--profile", type=Path, help="cost-model file (relay_engine.profile --fit, or an "
                        "accelerator's); default: the reference profile (run, project) or measured here (validate)")
    common.add_argument("--instances", type=int, default=2)
    common.add_argument("--rank-threads", type=int, default=BenchSettings.rank_threads)
    common.add_argument("--slo-ms", type=positive_number, default=BenchSettings.slo_ms)
    common.add_argument("--seed", type=int, default=0)
    run = sub.add_parser("run", parents=[common], help="replay a whole trace through N simulated instances")
    run.add_argument("--modes", default="baseline,relay", help=f"comma-separated, of {', '.join(MODES_BY_NAME)}")
    run.add_argument("--load", type=positive_number, default=1.0, help="× the trace's own arrival rate")
    run.add_argument("--cap", type=int, default=None, help="prefix cap (default: none)")
    run.add_argument("--prime-share", type=float, default=0.1, help="share of the trace that primes the caches")
    run.add_argument("--warmup-share", type=float, default=0.05, help="next share, replayed and not measured")
    run.add_argument("--time-scale", type=time_scale_flag, default=1.0, metavar="K|auto",
                     help="× every time constant (default 1: the profile's device runs the trace as it is)")
    run.add_argument("--out", help="JSON file")
    project = sub.add_parser("project", parents=[common], help="the benchmark's sweeps in the simulator")
    project.add_argument("--ref-qps", type=positive_number, help="reference load (the reference device's QPS)")
    project.add_argument("--cap-sweep", action="store_true")
    project.add_argument("--quick", action="store_true")
    project.add_argument("--time-scale", type=time_scale_flag, default=1.0, metavar="K|auto")
    project.add_argument("--out", default="artifacts/projection.json")
    val = sub.add_parser("validate", parents=[common], help="simulator vs the real fleet, error per point")
    val.add_argument("--ref-qps", type=positive_number)
    val.add_argument("--quick", action="store_true", help="small model, short points (a smoke run)")
    val.add_argument("--time-scale", type=time_scale_flag, default=None, metavar="K|auto",
                     help="default auto, as the benchmark")
    val.add_argument("--out", required=True)
    pre = sub.add_parser("preview", help="what-if preview: a captured trace under the live and a proposed spec")
    pre.add_argument("--trace", required=True, help="the captured window (trace format)")
    pre.add_argument("--live", required=True, help="the live revision's spec (JSON file)")
    pre.add_argument("--proposed", required=True, help="the proposed revision's spec (JSON file)")
    pre.add_argument("--instances", type=int, default=1, help="the pool's live instances")
    pre.add_argument("--rank-threads", type=int, default=BenchSettings.rank_threads)
    pre.add_argument("--instances-per-host", type=int, default=1,
                     help="CPU instances that share a host: this many to a host (default 1: each its own compute)")
    pre.add_argument("--host-cores", type=positive_number, default=1.0,
                     help="with --instances-per-host: the cores each host has (a forward uses one at most)")
    pre.add_argument("--device-kind", default="auto", help="the pool's device kind: picks the cost profile")
    pre.add_argument("--profile", type=Path, help="cost-model file (default: by --device-kind)")
    pre.add_argument("--max-requests", type=int, default=DEFAULT_MAX_REQUESTS,
                     help="replay at most the most recent N requests of the window")
    pre.add_argument("--warmup-requests", type=int, default=0,
                     help="the trace's first N requests are the traffic before the window: replayed to warm the "
                          "caches, not measured (default 0: the window's first tenth primes the caches)")
    pre.add_argument("--jobs", type=int, choices=(1, 2), default=2, help="2: both specs in parallel processes")
    pre.add_argument("--validation", default=str(DEFAULT_VALIDATION),
                     help="the simulator's validation output (sim validate --out), for model_error")
    pre.add_argument("--forward-times", type=Path,
                     help="the pool's own forward times (the control plane's …/forwards/ answer): fit the cost "
                          "model from them, the profile where they are too few")
    pre.add_argument("--out", required=True)
    fitp = sub.add_parser("fit", help="the pool's cost model from its own forward times, beside the profile")
    fitp.add_argument("--forward-times", type=Path, required=True,
                      help="GET /api/v1/pools/<pool>/forwards/ saved as a file")
    fitp.add_argument("--profile", type=Path, help="the offline profile (default: by the pool's device kind)")
    fitp.add_argument("--out", help="write the fitted cost model here (and its report beside it)")
    dec = sub.add_parser("decompose", help="a kept preview (RELAYGR_PREVIEW_KEEP_DIR) replayed request by request "
                                           "against what the instances measured")
    dec.add_argument("folder", help="the preview's folder (…/preview-<id>)")
    dec.add_argument("--seed", type=int, default=0, help="the replay's seed (forward times drawn from it)")
    dec.add_argument("--slowest", type=int, default=15, help="requests listed from each side's tail")
    dec.add_argument("--routing", choices=("captured", "rendezvous", "bounded"),
                     help="route as given instead of as the preview does (what-if: how much routing explains)")
    dec.add_argument("--profile-alone", action="store_true",
                     help="replay with the cost profile alone, not the pool's own forward times (what-if)")
    dec.add_argument("--out", help="JSON file: the figures and every request's row")
    return parser
