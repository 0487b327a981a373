"""Traces of ranking traffic (JSON Lines) and the synthetic features derived from them.

A trace line is one query: ``t_ms`` (arrival of the pre-infer signal, ms from trace start),
``user_id``, ``seq_len`` (long-term prefix tokens), ``short_len``, ``n_candidates`` and
``rank_delay_ms`` (pre-infer signal → ranking request). Unknown fields are ignored; a malformed
line is an error naming its line number.

A trace carries no token ids. ``SyntheticFeatures`` derives them deterministically: a user's
long-term prefix from (user_id, seq_len) — the same user with the same length is the same prefix,
so repeats can hit the cache — and the short-term tokens and candidates from the query's index.

    python -m relay_engine.traffic generate --out trace.jsonl [--queries N] [--qps Q] [--seed S]
    python -m relay_engine.traffic check trace.jsonl
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import sys
from collections.abc import Iterable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch

from relay_engine.model import History, ModelConfig

FIELDS = ("t_ms", "user_id", "seq_len", "short_len", "n_candidates", "rank_delay_ms")
MAX_TRACE_SEQ_LEN = 1 << 20
MAX_CANDIDATES = 100_000


class TraceError(ValueError):
    def __init__(self, line_no: int, message: str, source: str = "trace"):
        self.line_no = line_no
        super().__init__(f"{source}, line {line_no}: {message}")


@dataclass(frozen=True)
class TraceQuery:
    t_ms: float
    user_id: str
    seq_len: int
    short_len: int
    n_candidates: int
    rank_delay_ms: float

    def to_json(self) -> str:
        return json.dumps(asdict(self), separators=(",", ":"))


def _field_number(data: dict, key: str, *, integer: bool, lo: float, hi: float) -> float | int:
    if key not in data:
        raise ValueError(f"missing field {key!r}")
    value = data[key]
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"field {key!r} must be a finite number, got {value!r}")
    if integer:
        if isinstance(value, float) and not value.is_integer():
            raise ValueError(f"field {key!r} must be an integer, got {value!r}")
        value = int(value)
    if not lo <= value <= hi:
        raise ValueError(f"field {key!r} must be in [{lo:g}, {hi:g}], got {value}")
    return value


def parse_query(line: str) -> TraceQuery:
    """One trace line → TraceQuery; ValueError naming the field when it is malformed."""
    try:
        data = json.loads(line)
    except json.JSONDecodeError as exc:
        raise ValueError(f"not valid JSON ({exc.msg} at column {exc.colno})") from None
    except RecursionError:  # a line of thousands of nested brackets: no query, and no crash either
        raise ValueError("not a trace query: JSON nested too deeply") from None
    if not isinstance(data, dict):
        raise ValueError(f"must be a JSON object, got {type(data).__name__}")
    user = data.get("user_id")
    if isinstance(user, bool) or not isinstance(user, (str, int)) or str(user) == "":
        raise ValueError(f"field 'user_id' must be a non-empty string, got {user!r}")
    if len(str(user)) > 256:
        raise ValueError("field 'user_id' is longer than 256 characters")
    return TraceQuery(
        t_ms=float(_field_number(data, "t_ms", integer=False, lo=0, hi=1e12)),
        user_id=str(user),
        seq_len=int(_field_number(data, "seq_len", integer=True, lo=1, hi=MAX_TRACE_SEQ_LEN)),
        short_len=int(_field_number(data, "short_len", integer=True, lo=0, hi=MAX_TRACE_SEQ_LEN)),
        n_candidates=int(_field_number(data, "n_candidates", integer=True, lo=1, hi=MAX_CANDIDATES)),
        rank_delay_ms=float(_field_number(data, "rank_delay_ms", integer=False, lo=0, hi=3.6e6)),
    )


def iter_trace(lines: Iterable[str], source: str = "trace") -> Iterator[TraceQuery]:
    for line_no, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            yield parse_query(line)
        except ValueError as exc:
            raise TraceError(line_no, str(exc), source) from None


def read_trace(path: str | Path) -> list[TraceQuery]:
    """All queries of a trace file, sorted by arrival; TraceError names the bad line."""
    path = Path(path)
    lines = []
    with path.open("rb") as f:
        for line_no, raw in enumerate(f, start=1):
            try:
                lines.append(raw.decode("utf-8"))
            except UnicodeDecodeError as exc:
                raise TraceError(line_no, f"not UTF-8 text (byte {exc.start + 1} of the line)", str(path)) from None
    queries = list(iter_trace(lines, str(path)))
    queries.sort(key=lambda q: q.t_ms)
    return queries


def write_trace(path: str | Path, queries: Iterable[TraceQuery]) -> int:
    n = 0
    with Path(path).open("w", encoding="utf-8") as f:
        for q in queries:
            f.write(q.to_json() + "\n")
            n += 1
    return n


# --- generation ------------------------------------------------------------------------------


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


# --- synthetic features ----------------------------------------------------------------------


def _seed(*parts: object) -> int:
    text = "\x1f".join(str(p) for p in parts).encode()
    return int.from_bytes(hashlib.blake2b(text, digest_size=8).digest(), "big") & ((1 << 63) - 1)


class SyntheticFeatures:
    """Token ids for trace queries, deterministic in (user_id, seq_len) and the query index."""

    def __init__(self, config: ModelConfig, *, with_timestamps: bool = False, seed: int = 0,
                 start_ts: int = 1_700_000_000):
        self.config = config
        self.with_timestamps = with_timestamps
        self.seed = seed
        self.start_ts = start_ts

    def _history(self, seed: int, length: int, t0: int) -> History:
        g = torch.Generator().manual_seed(seed)
        items = torch.randint(0, self.config.num_items, (length,), generator=g)
        actions = torch.randint(1, self.config.num_actions, (length,), generator=g)
        ts = None
        if self.with_timestamps:
            gaps = torch.randint(1, 3600, (length,), generator=g)
            ts = t0 + torch.cumsum(gaps, 0)
        return History(items, actions, ts)

    def prefix(self, user_id: str, seq_len: int) -> History:
        return self._history(_seed(self.seed, "prefix", user_id, seq_len), seq_len, self.start_ts)

    def short_term(self, user_id: str, query_index: int, short_len: int) -> History:
        # Short-term events happen after the whole long-term history (~1 h per event above).
        t0 = self.start_ts + 3600 * (MAX_TRACE_SEQ_LEN // 1024) * 1024
        return self._history(_seed(self.seed, "short", user_id, query_index), short_len, t0)

    def candidates(self, query_index: int, n: int) -> torch.Tensor:
        g = torch.Generator().manual_seed(_seed(self.seed, "cands", query_index))
        return torch.randint(0, self.config.num_items, (n,), generator=g)


# --- CLI -------------------------------------------------------------------------------------


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


if __name__ == "__main__":
    sys.exit(main())
