"""Traffic replayer: play a trace through the client against a live pool.

    python -m workers.replay --trace FILE [--speed X] [--deadline-ms 100] [--threads 32] [--json-out F]

Each query's pre-infer signal is sent at ``t_ms / speed`` and its ranking request at
``(t_ms + rank_delay_ms) / speed`` with a deadline ``--deadline-ms`` after it is sent; requests run
concurrently on a thread pool. Tokens come from the trace as the workers derive them
(``SyntheticFeatures`` from user, lengths and the query's position). Pool, Redis and key prefix come
from the environment (``workers.settings``) or the flags. Ends with a summary: sent, ok, deadline
errors, other errors, round-trip P50/P99 of the successful ones, the source mix and how late the
schedule ran.
"""

from __future__ import annotations

import argparse
import heapq
import json
import sys
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from tqdm import tqdm

from relay_engine.core.trace import TraceError, TraceQuery, read_trace
from workers.client import NoLiveInstances, RankDeadlineExceeded, RelayClient, RelayError
from workers.settings import Settings

PRE_INFER, RANK = 0, 1  # at equal times the signal goes first


@dataclass
class Summary:
    queries: int = 0
    sent: int = 0
    ok: int = 0
    deadline_errors: int = 0
    other_errors: int = 0
    preinfer_sent: int = 0
    preinfer_failed: int = 0
    round_trips_ms: list[float] = field(default_factory=list)
    sources: Counter = field(default_factory=Counter)
    instances: Counter = field(default_factory=Counter)
    errors: Counter = field(default_factory=Counter)
    max_lag_ms: float = 0.0
    elapsed_s: float = 0.0

    def to_dict(self) -> dict:
        ordered = sorted(self.round_trips_ms)

        def pick(q: float) -> float | None:
            return round(ordered[min(len(ordered) - 1, int(q * len(ordered)))], 3) if ordered else None

        return {
            "queries": self.queries, "sent": self.sent, "ok": self.ok, "deadline_errors": self.deadline_errors,
            "other_errors": self.other_errors, "preinfer_sent": self.preinfer_sent,
            "preinfer_failed": self.preinfer_failed, "p50_ms": pick(0.50), "p99_ms": pick(0.99),
            "sources": dict(self.sources), "instances": dict(self.instances), "errors": dict(self.errors),
            "max_schedule_lag_ms": round(self.max_lag_ms, 3), "elapsed_s": round(self.elapsed_s, 3),
        }

    def text(self) -> str:
        d = self.to_dict()
        mix = ", ".join(f"{k} {v / max(1, self.ok):.0%}" for k, v in sorted(self.sources.items())) or "-"
        lines = [
            f"ranking requests: {d['sent']} sent, {d['ok']} ok, {d['deadline_errors']} deadline errors, "
            f"{d['other_errors']} other errors",
            f"round trip (ok): P50 {d['p50_ms']} ms, P99 {d['p99_ms']} ms; sources: {mix}",
            f"pre-infer signals: {d['preinfer_sent']} sent, {d['preinfer_failed']} not sent",
            f"instances: {dict(sorted(self.instances.items()))}; schedule lag max {d['max_schedule_lag_ms']} ms; "
            f"{d['elapsed_s']} s",
        ]
        if self.errors:
            lines.append(f"errors: {dict(self.errors.most_common(5))}")
        return "\n".join(lines)


class Replayer:
    def __init__(self, client: RelayClient, queries: list[TraceQuery], *, speed: float, deadline_ms: float,
                 threads: int, progress: bool = True):
        self.client = client
        self.queries = queries
        self.speed = speed
        self.deadline_s = deadline_ms / 1000
        self.summary = Summary(queries=len(queries))
        self._lock = threading.Lock()
        self._pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="replay")
        self._bar = tqdm(total=len(queries), unit="rank", disable=not progress, file=sys.stderr)

    def _pre_infer(self, index: int) -> None:
        q = self.queries[index]
        try:
            self.client.pre_infer(q.user_id, seq_len=q.seq_len)
            ok = True
        except Exception:  # noqa: BLE001 — best effort, counted
            ok = False
        with self._lock:
            self.summary.preinfer_sent += ok
            self.summary.preinfer_failed += not ok

    def _rank(self, index: int) -> None:
        q = self.queries[index]
        error = None
        try:
            reply = self.client.rank(q.user_id, seq_len=q.seq_len, short_len=q.short_len,
                                     n_candidates=q.n_candidates, query_index=index,
                                     deadline_s=time.time() + self.deadline_s)
        except RankDeadlineExceeded:
            error = "deadline_exceeded"
        except (RelayError, ValueError) as exc:
            error = getattr(exc, "kind", type(exc).__name__)
        except Exception as exc:  # noqa: BLE001 — count it, keep replaying
            error = type(exc).__name__
        with self._lock:
            s = self.summary
            s.sent += 1
            if error is None:
                s.ok += 1
                s.round_trips_ms.append(reply.round_trip_ms)
                s.sources[reply.source] += 1
                s.instances[reply.instance] += 1
            elif error == "deadline_exceeded":
                s.deadline_errors += 1
            else:
                s.other_errors += 1
                s.errors[error] += 1
        self._bar.update(1)

    def run(self) -> Summary:
        events = [(q.t_ms / self.speed, PRE_INFER, i) for i, q in enumerate(self.queries)]
        events += [((q.t_ms + q.rank_delay_ms) / self.speed, RANK, i) for i, q in enumerate(self.queries)]
        heapq.heapify(events)
        t0_ms = self.queries[0].t_ms / self.speed if self.queries else 0.0
        start = time.perf_counter()
        while events:
            at_ms, kind, index = heapq.heappop(events)
            wait_s = (at_ms - t0_ms) / 1000 - (time.perf_counter() - start)
            if wait_s > 0:
                time.sleep(wait_s)
            else:
                self.summary.max_lag_ms = max(self.summary.max_lag_ms, -wait_s * 1000)
            self._pool.submit(self._pre_infer if kind == PRE_INFER else self._rank, index)
        self._pool.shutdown(wait=True)
        self._bar.close()
        self.summary.elapsed_s = time.perf_counter() - start
        return self.summary


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m workers.replay", description=__doc__.split("\n\n")[0])
    parser.add_argument("--trace", required=True, help="trace file (JSON Lines, see relay_engine.core.trace)")
    parser.add_argument("--speed", type=float, default=1.0, help="time compression: 2 plays twice as fast")
    parser.add_argument("--deadline-ms", type=float, default=100.0, help="ranking deadline after sending")
    parser.add_argument("--threads", type=int, default=32)
    parser.add_argument("--limit", type=int, help="play only the first N queries")
    parser.add_argument("--pool", help="pool name (default $RELAYGR_POOL)")
    parser.add_argument("--json-out", help="also write the summary as JSON here")
    parser.add_argument("--no-progress", action="store_true")
    args = parser.parse_args(argv)
    if not (args.speed > 0 and args.deadline_ms > 0 and args.threads > 0):
        parser.error("--speed, --deadline-ms and --threads must be positive")
    try:
        queries = read_trace(args.trace)
    except (TraceError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    queries = queries[: args.limit] if args.limit else queries
    settings = Settings.from_env(pool=args.pool)
    with RelayClient(settings) as client:
        try:
            live = client.live_instances()
        except NoLiveInstances as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 3
        if not live:
            print(f"error: pool {settings.pool!r} has no live instance under prefix {settings.key_prefix!r}",
                  file=sys.stderr)
            return 3
        print(f"replaying {len(queries)} queries at {args.speed:g}x against {settings.pool} {list(live)}",
              file=sys.stderr)
        summary = Replayer(client, queries, speed=args.speed, deadline_ms=args.deadline_ms, threads=args.threads,
                           progress=not args.no_progress).run()
    print(summary.text())
    if args.json_out:
        with open(args.json_out, "w", encoding="utf-8") as f:
            json.dump(summary.to_dict(), f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
