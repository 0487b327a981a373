"""``python -m relay_engine.lab.bench.curves``: how long miss-ratio curves take, and what sampling costs in
accuracy. Synthetic Zipf-like traffic on 2 instances: 180,000 requests exact; a 24 h window at 50 QPS
(4.32 M requests) sampled (``curves.sampling_plan``: the most requested entries whole, the rest SHARDS), against
the exact curve at a small, a medium and a large HBM budget, with the live DRAM tier and HBM alone. Prints
figures; asserts nothing."""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

from relay_engine.core import curves
from relay_engine.core.outcomes import Outcome

MIB = 2**20
LOWER = [curves.TierBudget(Outcome.DRAM, 4096 * MIB, 600_000)]


def zipf_traffic(n: int, users: int, qps: float, seed: int = 0) -> curves.Requests:
    rng = np.random.default_rng(seed)
    weights = 1.0 / np.arange(1, users + 1) ** 0.8
    user = rng.choice(users, size=n, p=weights / weights.sum())
    prefix_len = 256 + (user * 2654435761 % 1793)  # 256..2048 tokens, fixed per user
    nbytes = np.array([curves.prefix_nbytes(int(p), num_layers=4, num_heads=4, head_dim=32) for p in range(2049)])
    return curves.Requests(ts_ms=np.cumsum(rng.exponential(1000 / qps, n)), key=user.astype(np.int64),
                           nbytes=nbytes[prefix_len], instance=(user % 2).astype(np.int64),
                           preinferred=np.zeros(n, bool))


def timed(runs: int, fn) -> tuple[float, object]:
    times, out = [], None
    for _ in range(runs):
        t0 = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times), out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args(argv)

    small = zipf_traffic(180_000, 60_000, 50.0)
    seconds, _ = timed(args.runs, lambda: curves.curves(curves.profile(small), 1024 * MIB, 120_000, LOWER))
    print(f"180,000 requests, 2 instances, exact: {seconds:.2f} s (median of {args.runs}; every axis)")

    large = zipf_traffic(4_320_000, 1_500_000, 50.0, seed=1)
    seconds, sampled = timed(args.runs, lambda: (p := curves.profile(large), curves.curves(p, 1024 * MIB, 120_000,
                                                                                           LOWER))[0])
    print(f"4,320,000 requests (24 h at 50 QPS), sampled: {seconds:.2f} s (median of {args.runs}; every axis); "
          f"{sampled.requests_used:,} requests kept, {sampled.entries_whole} entries whole, the rest at rate "
          f"{sampled.rate:.4f}")
    exact = curves.profile(large, limit=len(large))
    for budget_mb in (256, 1024, 4096):
        line = []
        for label, lower in (("with DRAM", LOWER), ("HBM alone", [])):
            e = exact.split(budget_mb * MIB, 120_000, lower).hit_ratio
            s = sampled.split(budget_mb * MIB, 120_000, lower).hit_ratio
            line.append(f"{label}: exact {e:.4f}, sampled {s:.4f}, error {(s - e) * 100:+.2f} points")
        print(f"  HBM {budget_mb:5d} MiB: " + "; ".join(line))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
