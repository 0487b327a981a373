"""Per-operation timings of the model: full recompute vs cached ranking, and the fitted cost model.

    python -m relay_engine.profile [--lengths 512,1024,2048,4096,8192] [--candidates 128]
                                   [--short 32] [--repeats 5] [--device auto] [--threads N]
    python -m relay_engine.profile --fit --out artifacts/profile-cpu.json [--threads 1]
    python -m relay_engine.profile --floors [--threads 1] [--lengths 512,2048]

The table: for each long-term prefix length, the median time of ``rank_full`` (the baseline),
``prefill`` (pre-inference) and ``rank`` against the cached prefix, the speed-up of cached ranking
at the ranking step, and the prefix cache's size. ``--fit`` measures the cost model's grid instead
(prefix lengths × short-term and candidate counts, ``relay_engine.lab.costmodel``), fits it and
writes it as a file: what the fleet simulator and ``bench --time-scale auto`` read. ``--floors``
adds, per operation and length, its arithmetic floor (``relay_engine.lab.floors``: its FLOPs at this
device's measured matmul peak or its unavoidable bytes at the measured bandwidth) and how many times
the floor the measured median is.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from dataclasses import asdict

import torch

from relay_engine.core import devices
from relay_engine.core.features import SyntheticFeatures
from relay_engine.core.model import HSTUModel, ModelConfig
from relay_engine.lab import floors
from relay_engine.lab.costmodel import PROFILE_LENGTHS, CostModel, fit, measure, profile_grid


def median_ms(fn, repeats: int, device: torch.device) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        devices.synchronize(device)
        t0 = time.perf_counter()
        fn()
        devices.synchronize(device)
        times.append((time.perf_counter() - t0) * 1000)
    return statistics.median(times)


def standalone_ms(fn, repeats: int, device: torch.device) -> float:
    """One call's own cost, robust to other work on a shared machine: on a CPU with one torch thread the
    median CPU time of the calling thread (it does all the work; preemption does not count), else the
    fastest of the repeats in wall time."""
    if device.type == "cpu" and torch.get_num_threads() == 1:
        fn()
        times = []
        for _ in range(repeats):
            t0 = time.thread_time()
            fn()
            times.append((time.thread_time() - t0) * 1000)
        return statistics.median(times)
    return floors.fastest_s(fn, device, repeats) * 1000


def profile_length(model: HSTUModel, features: SyntheticFeatures, length: int, n_short: int, n_cands: int,
                   repeats: int) -> dict[str, float]:
    prefix = features.prefix("profile-user", length)
    short = features.short_term("profile-user", 0, n_short)
    cands = features.candidates(0, n_cands)
    kv = model.prefill(prefix)
    ops = operations(model, prefix, short, cands, kv)
    return {**{f"{op}_ms": median_ms(fn, repeats, model.device) for op, fn in ops.items()},
            "cache_mib": kv.nbytes / 2**20}


def operations(model: HSTUModel, prefix, short, cands, kv) -> dict[str, object]:
    """The three forwards of one request, as calls: the baseline, the pre-inference, the cached rank."""
    return {"rank_full": lambda: model.rank_full(prefix, short, cands),
            "prefill": lambda: model.prefill(prefix),
            "rank": lambda: model.rank(kv, short, cands)}


def floor_rows(model: HSTUModel, features: SyntheticFeatures, lengths, n_short: int, n_cands: int,
               repeats: int, roofline: floors.Roofline) -> list[floors.FloorRow]:
    """Each forward at each length beside its floor. Bytes no forward avoids: the layers' weights, and
    the prefix KV that ``prefill`` writes and ``rank`` reads (``rank_full`` keeps no KV)."""
    weights = floors.layer_weight_bytes(model)
    rows = []
    for length in lengths:
        prefix = features.prefix("profile-user", length)
        short, cands = features.short_term("profile-user", 0, n_short), features.candidates(0, n_cands)
        kv = model.prefill(prefix)
        kv_bytes = {"rank_full": 0, "prefill": kv.nbytes, "rank": kv.nbytes}
        for op, fn in operations(model, prefix, short, cands, kv).items():
            rows.append(floors.floor_row(op, length, fn, weights + kv_bytes[op], roofline,
                                         median_ms(fn, repeats, model.device), model.device))
    return rows


def op_timer(model: HSTUModel, features: SyntheticFeatures, repeats: int):
    """time_ms(op, n, s, c): the median standalone time of one operation (the cost model's input)."""
    cache: dict[int, tuple] = {}

    def time_ms(op: str, n: int, s: int, c: int) -> float:
        if n not in cache:
            prefix = features.prefix("profile-user", n)
            cache.clear()
            cache[n] = (prefix, model.prefill(prefix))
        prefix, kv = cache[n]
        short, cands = features.short_term("profile-user", 0, s), features.candidates(0, c)
        fn = {"prefill": lambda: model.prefill(prefix),
              "rank": lambda: model.rank(kv, short, cands),
              "rank_full": lambda: model.rank_full(prefix, short, cands)}[op]
        return standalone_ms(fn, repeats, model.device)

    return time_ms


def fit_profile(model: HSTUModel, config: ModelConfig, device: torch.device, lengths, short: int,
                candidates: int, repeats: int, with_timestamps: bool = False, quiet: bool = False) -> CostModel:
    features = SyntheticFeatures(config, with_timestamps=with_timestamps)
    log = None if quiet else (lambda what: print(f"  measuring {what}", file=sys.stderr, flush=True))
    points = measure(op_timer(model, features, repeats), profile_grid(lengths, short, candidates), log)
    return fit(points, device=str(device), threads=torch.get_num_threads(),
               model={**asdict(config), "version": model.version},
               note=f"measured by relay_engine.profile --fit: {repeats} repeats, torch threads "
                    f"{torch.get_num_threads()} (one thread on a CPU: median thread CPU time; else fastest wall time)")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m relay_engine.profile", description=__doc__.split("\n\n")[0])
    parser.add_argument("--lengths", default=None, help="prefix lengths, comma-separated "
                        "(default 512,…,8192; with --fit " + ",".join(map(str, PROFILE_LENGTHS)) + ")")
    parser.add_argument("--candidates", type=int, default=128)
    parser.add_argument("--short", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--device", default="auto")
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    parser.add_argument("--timestamps", action="store_true", help="use timestamps (time-bucket bias)")
    parser.add_argument("--fit", action="store_true", help="measure the cost model's grid and fit it")
    parser.add_argument("--out", help="with --fit: the cost model file to write")
    parser.add_argument("--floors", action="store_true",
                        help="each forward beside its arithmetic floor (FLOPs at the measured matmul peak, "
                             "bytes at the measured bandwidth)")
    args = parser.parse_args(argv)
    default_lengths = PROFILE_LENGTHS if args.fit else (512, 1024, 2048, 4096, 8192)
    try:
        lengths = [int(x) for x in args.lengths.split(",")] if args.lengths else list(default_lengths)
    except ValueError:
        parser.error(f"--lengths must be comma-separated integers, got {args.lengths!r}")
    if args.fit and not args.out:
        parser.error("--fit needs --out FILE")
    if args.fit and args.floors:
        parser.error("--floors and --fit are separate runs: choose one")
    if args.threads is not None:
        if args.threads < 1:
            parser.error(f"--threads must be ≥ 1, got {args.threads}")
        torch.set_num_threads(args.threads)

    devices.keep_freed_host_memory()
    device = devices.select_device(args.device)
    config = ModelConfig()
    model = HSTUModel(config, device)
    print(f"model {model.version}: {config.num_layers} layers, {config.num_heads} heads × {config.head_dim}, "
          f"embed {config.embed_dim}; device {device}; torch threads {torch.get_num_threads()}; "
          f"{args.candidates} candidates, {args.short} short-term tokens; median of {args.repeats}\n")
    if args.fit:
        cost = fit_profile(model, config, device, lengths, args.short, args.candidates, args.repeats,
                           args.timestamps)
        cost.save(args.out)
        print(f"wrote {args.out}; largest relative error of the fit: {cost.fit_errors()}")
        return 0
    features = SyntheticFeatures(config, with_timestamps=args.timestamps)
    if args.floors:
        roofline = floors.measure_roofline(device)
        rows = floor_rows(model, features, lengths, args.short, args.candidates, args.repeats, roofline)
        print(floors.markdown(rows, roofline))
        return 0
    print("| prefix tokens | rank_full (ms) | prefill (ms) | rank, cached (ms) | speed-up at ranking | cache (MiB) |")
    print("|---:|---:|---:|---:|---:|---:|")
    for length in lengths:
        t = profile_length(model, features, length, args.short, args.candidates, args.repeats)
        print(f"| {length} | {t['rank_full_ms']:.1f} | {t['prefill_ms']:.1f} | {t['rank_ms']:.1f} "
              f"| {t['rank_full_ms'] / t['rank_ms']:.1f}× | {t['cache_mib']:.1f} |", flush=True)
    return 0
