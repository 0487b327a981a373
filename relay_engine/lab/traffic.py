"""Trace generation: seeded, reproducible ranking traffic in the trace format.

Arrivals are Poisson, users Zipf-distributed, each user's long-term prefix length log-normal and
fixed per user. The format itself (reading, writing, validation) is the core's
``relay_engine.core.trace``.

    python -m relay_engine.traffic generate --out trace.jsonl [--queries N] [--qps Q] [--seed S]
    python -m relay_engine.traffic check trace.jsonl
"""

from __future__ import annotations

import argparse
import math
import sys
from dataclasses import dataclass

import numpy as np

from relay_engine.core.trace import TraceError, TraceQuery, read_trace, write_trace


@dataclass(frozen=True)
class TraceSpec:
    queries: int = 20_000
    qps: float = 50.0  # Poisson arrivals
    users: int = 100_000
    zipf_s: float = 1.0
    seq_len_median: float = 512.0
    seq_len_p99: float = 4096.0
    seq_len_min: int = 32
    seq_len_max: int = 8192
    short_len: int = 32
    n_candidates: int = 128
    rank_delay_min_ms: float = 20.0
    rank_delay_max_ms: float = 60.0
    seed: int = 0


def user_seq_len(user_index: int, spec: TraceSpec) -> int:
    """A user's long-term prefix length: log-normal (median, P99 from spec), clipped; fixed per user."""
    rng = np.random.default_rng([spec.seed, 7919, user_index])
    mu = math.log(spec.seq_len_median)
    sigma = (math.log(spec.seq_len_p99) - mu) / 2.3263478740408408  # z of the 99th percentile
    length = round(math.exp(mu + sigma * rng.standard_normal()))
    return int(np.clip(length, spec.seq_len_min, spec.seq_len_max))


def generate_trace(spec: TraceSpec = TraceSpec()) -> list[TraceQuery]:
    rng = np.random.default_rng(spec.seed)
    gaps_ms = rng.exponential(1000.0 / spec.qps, size=spec.queries)
    t_ms = np.cumsum(gaps_ms) - gaps_ms[0]
    ranks = np.arange(1, spec.users + 1, dtype=np.float64)
    weights = ranks ** (-spec.zipf_s)
    users = rng.choice(spec.users, size=spec.queries, p=weights / weights.sum())
    delays = rng.uniform(spec.rank_delay_min_ms, spec.rank_delay_max_ms, size=spec.queries)
    seq_len_cache: dict[int, int] = {}
    out = []
    for i in range(spec.queries):
        u = int(users[i])
        if u not in seq_len_cache:
            seq_len_cache[u] = user_seq_len(u, spec)
        out.append(TraceQuery(round(float(t_ms[i]), 3), f"u{u:06d}", seq_len_cache[u], spec.short_len,
                              spec.n_candidates, round(float(delays[i]), 3)))
    return out



def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m relay_engine.traffic", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="write a seeded, reproducible trace")
    gen.add_argument("--out", required=True, help="output file (JSON Lines)")
    d = TraceSpec()
    for name in ("queries", "users", "seq_len_min", "seq_len_max", "short_len", "n_candidates", "seed"):
        gen.add_argument("--" + name.replace("_", "-"), type=int, default=getattr(d, name))
    for name in ("qps", "zipf_s", "seq_len_median", "seq_len_p99", "rank_delay_min_ms", "rank_delay_max_ms"):
        gen.add_argument("--" + name.replace("_", "-"), type=float, default=getattr(d, name))
    chk = sub.add_parser("check", help="validate a trace and print its shape")
    chk.add_argument("trace")
    args = parser.parse_args(argv)

    if args.command == "generate":
        spec = TraceSpec(**{k: v for k, v in vars(args).items() if k in TraceSpec.__dataclass_fields__})
        queries = generate_trace(spec)
        write_trace(args.out, queries)
        print(describe(queries, args.out))
        return 0
    try:
        queries = read_trace(args.trace)
    except (TraceError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(describe(queries, args.trace))
    return 0


def describe(queries: list[TraceQuery], name: str) -> str:
    if not queries:
        return f"{name}: empty trace"
    lens = np.array([q.seq_len for q in queries])
    span_s = (queries[-1].t_ms - queries[0].t_ms) / 1000
    users = len({q.user_id for q in queries})
    return (f"{name}: {len(queries)} queries over {span_s:.1f} s ({len(queries) / max(span_s, 1e-9):.1f} qps), "
            f"{users} distinct users; seq_len median {np.median(lens):.0f}, P99 {np.percentile(lens, 99):.0f}, "
            f"max {lens.max()}")
