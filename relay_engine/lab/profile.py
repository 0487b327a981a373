"""Per-operation timings of the model at its default size: full recompute vs cached ranking.

    python -m relay_engine.profile [--lengths 512,1024,2048,4096,8192] [--candidates 128]
                                   [--short 32] [--repeats 5] [--device auto]

Prints a Markdown table: for each long-term prefix length, the median time of ``rank_full``
(the baseline), ``prefill`` (pre-inference) and ``rank`` against the cached prefix, the speed-up
of cached ranking at the ranking step, and the prefix cache's size.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from relay_engine.core import devices
from relay_engine.core.features import SyntheticFeatures
from relay_engine.core.model import HSTUModel, ModelConfig


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


def profile_length(model: HSTUModel, features: SyntheticFeatures, length: int, n_short: int, n_cands: int,
                   repeats: int) -> dict[str, float]:
    prefix = features.prefix("profile-user", length)
    short = features.short_term("profile-user", 0, n_short)
    cands = features.candidates(0, n_cands)
    kv = model.prefill(prefix)
    return {
        "rank_full_ms": median_ms(lambda: model.rank_full(prefix, short, cands), repeats, model.device),
        "prefill_ms": median_ms(lambda: model.prefill(prefix), repeats, model.device),
        "rank_ms": median_ms(lambda: model.rank(kv, short, cands), repeats, model.device),
        "cache_mib": kv.nbytes / 2**20,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m relay_engine.profile", description=__doc__.split("\n\n")[0])
    parser.add_argument("--lengths", default="512,1024,2048,4096,8192")
    parser.add_argument("--candidates", type=int, default=128)
    parser.add_argument("--short", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--device", default="auto")
    parser.add_argument("--timestamps", action="store_true", help="use timestamps (time-bucket bias)")
    args = parser.parse_args(argv)
    try:
        lengths = [int(x) for x in args.lengths.split(",")]
    except ValueError:
        parser.error(f"--lengths must be comma-separated integers, got {args.lengths!r}")

    device = devices.select_device(args.device)
    config = ModelConfig()
    model = HSTUModel(config, device)
    features = SyntheticFeatures(config, with_timestamps=args.timestamps)
    print(f"model {model.version}: {config.num_layers} layers, {config.num_heads} heads × {config.head_dim}, "
          f"embed {config.embed_dim}; device {device}; torch threads {torch.get_num_threads()}; "
          f"{args.candidates} candidates, {args.short} short-term tokens; median of {args.repeats}\n")
    print("| prefix tokens | rank_full (ms) | prefill (ms) | rank, cached (ms) | speed-up at ranking | cache (MiB) |")
    print("|---:|---:|---:|---:|---:|---:|")
    for length in lengths:
        t = profile_length(model, features, length, args.short, args.candidates, args.repeats)
        print(f"| {length} | {t['rank_full_ms']:.1f} | {t['prefill_ms']:.1f} | {t['rank_ms']:.1f} "
              f"| {t['rank_full_ms'] / t['rank_ms']:.1f}× | {t['cache_mib']:.1f} |", flush=True)
    return 0
