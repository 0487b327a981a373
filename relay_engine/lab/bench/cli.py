"""``python -m relay_engine.bench``: the command line (see the package doc for what it measures)."""

from __future__ import annotations

import argparse
import os
import sys
from dataclasses import replace
from pathlib import Path

from relay_engine.core import fields
from relay_engine.core.trace import TraceError, read_trace
from relay_engine.lab.bench import __doc__ as PACKAGE_DOC
from relay_engine.lab.bench.modes import MODES, MODES_BY_NAME, Mode
from relay_engine.lab.bench.run import FLEETS, run
from relay_engine.lab.bench.settings import BenchSettings, quick_settings
from relay_engine.lab.traffic import TraceSpec, generate_trace

MAX_FLAG_VALUE = 1e9


def positive_number(text: str) -> float:
    """A positive finite number given on the command line (read by the schema's own field check)."""
    try:
        value = float(fields.number_text(text, 0.0, MAX_FLAG_VALUE))
    except fields.FieldValueError:
        value = 0.0
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be a number in (0, {MAX_FLAG_VALUE:g}], got {text!r}")
    return value


def time_scale_flag(text: str) -> float | None:
    """K, or None for 'auto'."""
    return None if text == "auto" else positive_number(text)


# Every run measures these: the headline ratios and the regime are theirs.
REQUIRED_MODES = ("baseline", "relay")


def modes_flag(text: str) -> tuple[Mode, ...]:
    """A comma-separated subset of the modes, in the benchmark's order."""
    names = [n.strip() for n in text.split(",") if n.strip()]
    unknown = [n for n in names if n not in MODES_BY_NAME]
    if unknown or not names:
        raise argparse.ArgumentTypeError(f"unknown mode(s) {', '.join(unknown) or '(none given)'}; "
                                         f"choose from {', '.join(MODES_BY_NAME)}")
    return tuple(m for m in MODES if m.name in names)


def with_required(modes: tuple[Mode, ...]) -> tuple[Mode, ...]:
    """modes with baseline and relay added (the ratios a full run reports are theirs), in the bench's order."""
    wanted = {m.name for m in modes} | set(REQUIRED_MODES)
    return tuple(m for m in MODES if m.name in wanted)


def fleet_flag(text: str) -> str:
    """Where the points are measured (``run.FLEETS``)."""
    if text not in FLEETS:
        raise argparse.ArgumentTypeError(f"unknown fleet {text!r}; choose lab (the lab's engine processes), product "
                                         "(RelayClient → Redis → worker instances) or both (side by side, the same "
                                         "windows; the product's ratio is the headline)")
    return text


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m relay_engine.bench", description=PACKAGE_DOC.split("\n\n")[0])
    d = BenchSettings()
    parser.add_argument("--trace", help="trace file (JSON Lines); default: the default generated trace")
    parser.add_argument("--slo-ms", type=positive_number, default=d.slo_ms,
                        help="ranking P99 SLO of the reference device (× K here)")
    parser.add_argument("--deadline-ms", type=positive_number, default=None,
                        help="ranking deadline after arrival, reference device (default: twice the SLO)")
    parser.add_argument("--time-scale", type=time_scale_flag, default=None, metavar="K|auto",
                        help="multiply every time constant of the trace by K; 'auto' (default) derives K from "
                             "this machine's forward times against the reference profile")
    parser.add_argument("--reference", type=Path, default=d.reference_profile,
                        help="the reference profile for --time-scale auto (a cost-model file)")
    parser.add_argument("--instances", type=int, default=None,
                        help="engine instances (processes, each pinned to its own cores); default 2, or 1 on one core")
    parser.add_argument("--rank-threads", type=int, default=d.rank_threads, help="ranking threads per instance")
    parser.add_argument("--ref-qps", type=positive_number, default=None,
                        help=f"reference load in the reference device's QPS, ÷ K here (default {d.ref_qps:g}); "
                             "the cap sweep runs at it, the load sweeps around it")
    parser.add_argument("--headline-cap", type=int, default=None,
                        help="prefix cap of the throughput ratio (default: the baseline's max sequence length)")
    parser.add_argument("--cap-sweep", action="store_true",
                        help="also measure SLO throughput at every cap of 512, 1024, 2048, 4096 (baseline, relay)")
    parser.add_argument("--no-ablations", action="store_true", help="skip the ablations' throughput sweeps")
    parser.add_argument("--throughput-only", action="store_true",
                        help="with --headline-cap: only the SLO-throughput sweeps at that cap, no max-sequence-"
                             "length sweeps (an ablation's figure in a fraction of the time)")
    parser.add_argument("--modes", type=modes_flag, default=MODES, metavar="A,B,…",
                        help=f"measure only these modes, side by side on the same windows (default: all of "
                             f"{', '.join(MODES_BY_NAME)}); {' and '.join(REQUIRED_MODES)} are always measured, "
                             "except with --throughput-only")
    parser.add_argument("--fleet", type=fleet_flag, default="lab", metavar="lab|product|both",
                        help="measure on the lab's engine processes (default), through the product's path "
                             "(RelayClient → Redis → worker instances started by the pool supervisor, each mode a "
                             "published policy; REDIS_URL or a private embedded Redis), or both side by side on the "
                             "same windows, the product's ratio being the headline")
    parser.add_argument("--no-sim-guide", action="store_true",
                        help="bisect every sweep instead of starting at the simulator's prediction")
    parser.add_argument("--timestamps", action="store_true", help="give tokens timestamps (time-bucket bias)")
    parser.add_argument("--out", default="artifacts/bench.json", help="output JSON (plots go beside it)")
    parser.add_argument("--quick", action="store_true",
                        help="small model, short points (a smoke run of a few minutes, not a measurement)")
    args = parser.parse_args(argv)

    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    instances = args.instances if args.instances is not None else min(2, cores)
    if instances < 1 or instances > cores:
        parser.error(f"--instances must be between 1 and the machine's {cores} cores, got {instances}")
    if args.rank_threads < 1:
        parser.error(f"--rank-threads must be ≥ 1, got {args.rank_threads}")
    if not args.reference.is_file():
        parser.error(f"--reference {args.reference}: no such file")
    settings = BenchSettings(slo_ms=args.slo_ms, deadline_ms=args.deadline_ms, time_scale=args.time_scale,
                             reference_profile=args.reference, instances=instances,
                             threads_per_instance=max(1, cores // instances), rank_threads=args.rank_threads,
                             with_timestamps=args.timestamps, headline_cap=args.headline_cap,
                             cap_sweep=args.cap_sweep, ablations=not args.no_ablations,
                             seq_len_sweeps=not args.throughput_only, sim_guided=not args.no_sim_guide)
    if args.throughput_only and args.headline_cap is None:
        parser.error("--throughput-only needs --headline-cap (the cap the throughput sweeps run at)")
    if args.quick:
        settings = quick_settings(settings)
    if args.ref_qps is not None:
        settings = replace(settings, ref_qps=args.ref_qps)
    if args.trace:
        try:
            queries = read_trace(args.trace)
        except (TraceError, OSError) as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
        if len(queries) < 2:
            print(f"error: {args.trace}: a trace needs at least 2 queries, got {len(queries)}", file=sys.stderr)
            return 2
        name = args.trace
    else:
        spec = TraceSpec(queries=3_000) if args.quick else TraceSpec()
        queries, name = generate_trace(spec), f"generated: {spec}"
    per_window = settings.warmup_queries + settings.measured_queries
    if per_window > len(queries):
        print(f"error: a window needs {per_window} queries; the trace has {len(queries)}", file=sys.stderr)
        return 2
    modes = args.modes if args.throughput_only else with_required(args.modes)
    result = run(settings, queries, name, Path(args.out), modes=modes, fleet=args.fleet)
    print(result["markdown"])
    print(f"\nwrote {args.out} and {', '.join(result['plots']) or 'no plots'} in {result['runtime_s']:.0f} s")
    return 0
