"""Round-trip overhead of ``rank`` through Redis to a real instance, against the same call in-process,
and ranking beside a pre-inference backlog.

    python -m workers.bench_roundtrip [--requests 1000] [--backlog 100] [--blocks 10] [--json-out FILE]

Starts one instance (``RELAYGR_MODEL``, default small) against ``REDIS_URL`` or a private
embedded Redis, and times, one request at a time for the same user (HBM hits), four modes:

1. **in_process**: the task body (payload validation, features, ``engine.rank``) called directly
   on an engine built here;
2. **direct**: ``RelayClient.rank`` → the instance's request list (``workers.ranks``, the client's
   default) → a rank thread → the answer back, on loopback;
3. **celery**: the same through the Celery task (``RELAYGR_RANK_TRANSPORT=celery``);
4. **backlog**: as *direct* while pre-infer signals keep arriving for other users (``--backlog`` at
   once, then 500/s), all admitted by the trigger, so the instance's prefill lane is busy throughout.

With ``--compare-prefill`` (the default), a second instance, in a pool of its own, runs its prefills
the other way (``RELAYGR_PREFILL_PROCESS``: in a child process where the first runs them on its lane
thread, the default, or the reverse), and two more modes, **direct_process** and **backlog_process**
(or ``_lane``), time it the same way in the same blocks: the two designs' backlog ratios side by side.

A block of a mode without a backlog starts with one untimed request: a backlog block before it may
have evicted the user's prefix to DRAM (unread prefixes are kept before read ones), and that one
reload is the backlog's cost, not the mode's. A backlog block ends when the instance is quiet again (under a fifth of a core, its and its prefill
process's CPU time read from /proc): a mode timed next never runs beside the prefills it admitted.

The modes are interleaved: ``--blocks`` rounds, each timing ``--requests / --blocks`` requests of
every mode in a rotated order, so a noisy minute of a shared machine falls on all of them alike.
Prints P50/P99 of each, the overhead (direct P99 − in-process P99, and Celery's), and the backlog
ratio (backlog P99 ÷ direct P99), each with a 95 % bootstrap interval; a benchmark, not a test.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections import Counter
from contextlib import ExitStack

import numpy as np
import torch

from relay_engine.core import devices
from relay_engine.core.config import parse_policy
from relay_engine.core.engine import RelayEngine
from relay_engine.core.features import SyntheticFeatures
from relay_engine.core.wire import DesiredRevision, instance_name
from workers.app import redis_client
from workers.client import RelayClient
from workers.embedded_redis import EmbeddedRedis
from workers.pool import spawn_instance, wait_until_live
from workers.settings import Settings
from workers.tasks import InstanceRuntime
from workers.telemetry_publisher import WorkerCounts

# Every pre-infer signal admitted (budgets permitting), so the backlog is real prefill work.
ADMIT_ALL_POLICY = {"trigger": {"admit_all": True, "max_preinfer_inflight": 64}}
BACKLOG_LEAD_S = 0.5
# After a backlog block, the instance is quiet again (its lane drained) when it uses under this share of
# a core over a window; an idle instance (heartbeat, telemetry) uses ~1-2 %.
QUIET_SHARE = 0.2
QUIET_WINDOW_S = 0.25
QUIET_TIMEOUT_S = 30.0
WARMUP = 20


def percentiles(values_ms: list[float]) -> dict[str, float]:
    p50, p99 = np.percentile(values_ms, [50, 99])
    return {"p50_ms": round(float(p50), 3), "p99_ms": round(float(p99), 3),
            "mean_ms": round(statistics.fmean(values_ms), 3), "n": len(values_ms)}


def in_process_runtime(settings: Settings) -> InstanceRuntime:
    devices.keep_freed_host_memory()  # as the instance does
    torch.set_num_threads(settings.torch_threads or torch.get_num_threads())  # as the instance runs
    cpu = torch.device("cpu")
    engine = RelayEngine(model=settings.build_model(cpu), device=cpu, name="in-process")
    return InstanceRuntime(engine, SyntheticFeatures(engine.model.config), WorkerCounts())


def time_in_process(runtime: InstanceRuntime, payload: dict, n: int) -> list[float]:
    out = []
    for _ in range(n):
        t0 = time.perf_counter()
        result = runtime.rank((payload,), {})
        out.append((time.perf_counter() - t0) * 1000)
        if not result["ok"]:
            raise RuntimeError(result)
    return out


def time_client(client: RelayClient, payload: dict, n: int, legs: list[dict] | None = None) -> list[float]:
    out = []
    for _ in range(n):
        reply = client.rank(deadline_s=time.time() + 2.0, **payload)
        out.append(reply.round_trip_ms)
        if legs is not None and reply.legs_ms:
            legs.append({**reply.legs_ms, "engine": reply.engine_ms, "source": reply.source,
                         "round_trip": reply.round_trip_ms})
    return out


def leg_percentiles(legs: list[dict]) -> dict[str, dict[str, float]]:
    """P50/P99 of each leg of the round trip; ``in_worker`` less the engine is the task's own work."""
    if not legs:
        return {}
    names = [*(k for k in legs[0] if k not in ("source", "round_trip")), "task_not_engine"]
    values = {k: [leg[k] if k != "task_not_engine" else leg["in_worker"] - leg["engine"] for leg in legs]
              for k in names}
    return {k: {"p50_ms": round(float(np.percentile(v, 50)), 3), "p99_ms": round(float(np.percentile(v, 99)), 3)}
            for k, v in values.items()}


def process_cpu_s(pid: int) -> float:
    """CPU seconds used so far by process ``pid`` and its children (a prefill process), from /proc."""
    pids = [pid]
    try:
        for tid in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{tid}/children", encoding="ascii") as f:
                pids += [int(child) for child in f.read().split()]
    except OSError:  # gone, or no /proc
        pass
    total = 0
    for p in pids:
        try:
            with open(f"/proc/{p}/stat", encoding="ascii") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:  # gone
            continue
        total += int(fields[11]) + int(fields[12])  # utime, stime (clock ticks)
    return total / os.sysconf("SC_CLK_TCK")


def wait_until_quiet(pid: int, *, window_s: float = QUIET_WINDOW_S, timeout_s: float = QUIET_TIMEOUT_S) -> float:
    """Wait until the instance ``pid`` uses less than ``QUIET_SHARE`` of a core over a window: the
    prefills a backlog block admitted have run, and the next mode is not timed beside them. Returns
    the seconds waited (``timeout_s`` when it never got quiet)."""
    started = time.monotonic()
    while time.monotonic() - started < timeout_s:
        before = process_cpu_s(pid)
        time.sleep(window_s)
        if process_cpu_s(pid) - before < QUIET_SHARE * window_s:
            break
    return time.monotonic() - started


class Backlog:
    """Pre-infer signals for other users, sent while it is on: a burst, then ``rate_per_s``; on exit,
    it waits until the instance (``pid``) has run the prefills it admitted."""

    def __init__(self, client: RelayClient, instance: str, burst: int, rate_per_s: float, seq_len: int,
                 lead_s: float = BACKLOG_LEAD_S, pid: int | None = None):
        self.client, self.instance, self.burst, self.rate_per_s, self.seq_len, self.lead_s = \
            client, instance, burst, rate_per_s, seq_len, lead_s
        self.pid = pid
        self.drain_s: list[float] = []
        self.sent = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _send(self) -> None:
        self.client.pre_infer(f"backlog-{self.sent}", seq_len=self.seq_len, instance=self.instance)
        self.sent += 1

    def _run(self) -> None:
        for _ in range(self.burst):
            self._send()
        while not self._stop.wait(1 / self.rate_per_s):
            self._send()

    def __enter__(self) -> Backlog:
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, name="backlog", daemon=True)
        self._thread.start()
        time.sleep(self.lead_s)  # the lane busy (and, given long enough, the tiers full) before the first timed request
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        assert self._thread is not None
        self._thread.join()
        if self.pid is None:
            time.sleep(BACKLOG_LEAD_S)
        else:  # admitted prefills finish before the next mode
            self.drain_s.append(wait_until_quiet(self.pid))


def bootstrap(samples: dict[str, list[float]], statistic, reps: int = 2000, seed: int = 0) -> list[float]:
    """95 % percentile-bootstrap interval of ``statistic(samples)``, resampling each mode on its own."""
    rng = np.random.default_rng(seed)
    arrays = {k: np.asarray(v) for k, v in samples.items()}
    values = [statistic({k: a[rng.integers(0, len(a), len(a))] for k, a in arrays.items()}) for _ in range(reps)]
    lo, hi = np.percentile(values, [2.5, 97.5])
    return [round(float(lo), 3), round(float(hi), 3)]


def p99(values) -> float:
    return float(np.percentile(values, 99))


def overhead_p99(s: dict) -> float:
    return p99(s["direct"]) - p99(s["in_process"])


def celery_overhead_p99(s: dict) -> float:
    return p99(s["celery"]) - p99(s["in_process"])


def backlog_ratio(s: dict) -> float:
    return p99(s["backlog"]) / p99(s["direct"])


def unread_ratio(s: dict) -> float:
    return p99(s["unread"]) / p99(s["direct"])


def other_backlog_ratio(suffix: str):
    return lambda s: p99(s["backlog" + suffix]) / p99(s["direct" + suffix])


def start_instance(stack: ExitStack, settings: Settings) -> tuple[str, int]:
    """Instance 0 of ``settings.pool``, live under the admit-all policy (stopped when ``stack`` closes):
    its name and process id."""
    name = instance_name(settings.pool, 0)
    log_path = os.path.join(tempfile.mkdtemp(prefix="relaygr-bench-"), f"{name}.log")
    proc = spawn_instance(settings, 0, stdout=subprocess.DEVNULL, stderr=open(log_path, "w"))  # noqa: SIM115
    print(f"instance {name} (prefills: process {settings.prefill_process}) logging to {log_path}", file=sys.stderr)
    stack.callback(lambda: (proc.terminate(), proc.wait(15)))
    rc = redis_client(settings)
    spec = parse_policy(ADMIT_ALL_POLICY)
    rc.set(settings.keys.desired, DesiredRevision(1, spec.sha256(), spec.to_dict(), time.time()).to_json())
    wait_until_live(rc, settings, [name], procs=[proc])
    return name, proc.pid


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m workers.bench_roundtrip", description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=1000, help="timed requests per mode (default 1000)")
    parser.add_argument("--backlog", type=int, default=100, help="signals sent at once when a backlog block starts")
    parser.add_argument("--blocks", type=int, default=10, help="interleaved rounds of the four modes (default 10)")
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--short-len", type=int, default=16)
    parser.add_argument("--candidates", type=int, default=64)
    parser.add_argument("--backlog-lead-s", type=float, default=BACKLOG_LEAD_S,
                        help=f"how long the signals flow before a backlog block's first timed request (default "
                             f"{BACKLOG_LEAD_S:g} s; ~20 s fills the default HBM budget: the steady state)")
    parser.add_argument("--compare-prefill", action=argparse.BooleanOptionalAction, default=True,
                        help="also time an instance whose prefills run the other way: in a child process, or "
                             "on the lane thread (default: on)")
    parser.add_argument("--unread-control", action=argparse.BooleanOptionalAction, default=False,
                        help="also time 'unread': direct while the same signal stream goes to a list no instance "
                             "reads (what sending it and Redis cost this host, without the instance's part)")
    parser.add_argument("--json-out")
    args = parser.parse_args(argv)
    if args.requests < 10 * args.blocks or args.blocks < 1:
        parser.error(f"--requests ({args.requests}) must be at least 10 per block (--blocks {args.blocks})")
    per_block = args.requests // args.blocks

    with ExitStack() as stack:
        redis_url = os.environ.get("REDIS_URL") or \
            stack.enter_context(EmbeddedRedis(tempfile.mkdtemp(prefix="relaygr-bench-"))).url
        settings = Settings.from_env(redis_url=redis_url, key_prefix=f"bench-{uuid.uuid4().hex[:8]}",
                                     pool="bench", model=os.environ.get("RELAYGR_MODEL", "small"), torch_threads=1,
                                     data_dir=tempfile.mkdtemp(prefix="relaygr-bench-"))
        name, pid = start_instance(stack, settings)
        other = "off" if settings.prefill_process == "on" else "on"
        suffix = {"on": "_process", "off": "_lane"}[other]
        other_settings = dataclasses.replace(settings, pool="bench-other", prefill_process=other)
        other_name, other_pid = start_instance(stack, other_settings) if args.compare_prefill else (None, None)
        rc = redis_client(settings)
        client = stack.enter_context(RelayClient(settings))
        via_celery = stack.enter_context(RelayClient(dataclasses.replace(settings, rank_transport="celery")))
        payload = {"user_id": "bench-user", "seq_len": args.seq_len, "short_len": args.short_len,
                   "n_candidates": args.candidates, "query_index": 1}
        runtime = in_process_runtime(settings)
        backlog = Backlog(client, name, args.backlog, 500.0, args.seq_len, args.backlog_lead_s, pid)
        legs: dict[str, list[dict]] = {"direct": [], "celery": [], "backlog": []}
        timing = [False]  # legs are kept for timed requests only, not the warm-up

        def timed(on: RelayClient, leg: str | None):
            return lambda n: time_client(on, payload, n, legs[leg] if leg and timing[0] else None)

        modes = {
            "in_process": lambda n: time_in_process(runtime, payload, n),
            "direct": timed(client, "direct"),
            "celery": timed(via_celery, "celery"),
            "backlog": lambda n: _with(backlog, lambda: timed(client, "backlog")(n)),
        }
        if other_name is not None:
            other_client = stack.enter_context(RelayClient(other_settings))
            other_backlog = Backlog(other_client, other_name, args.backlog, 500.0, args.seq_len, args.backlog_lead_s,
                                    other_pid)
            legs["backlog" + suffix] = []
            modes["direct" + suffix] = timed(other_client, None)
            modes["backlog" + suffix] = lambda n: _with(other_backlog,
                                                        lambda: timed(other_client, "backlog" + suffix)(n))
        if args.unread_control:
            nobody = instance_name(settings.pool, 999)  # a list no instance reads
            unread = Backlog(client, nobody, args.backlog, 500.0, args.seq_len, args.backlog_lead_s, None)
            legs["unread"] = []

            def unread_mode(n: int) -> list[float]:
                try:
                    return _with(unread, lambda: timed(client, "unread")(n))
                finally:
                    rc.delete(settings.keys.preinfer_signals(nobody))

            modes["unread"] = unread_mode
        for run in modes.values():  # warm-up: caches, allocator, connections
            run(WARMUP)
        timing[0] = True
        samples: dict[str, list[float]] = {mode: [] for mode in modes}
        order = list(modes)
        for block in range(args.blocks):
            for mode in order[block % len(order):] + order[:block % len(order)]:
                if not mode.startswith("backlog"):  # one untimed request first: the user's prefix back in HBM
                    timing[0] = False
                    modes[mode](1)
                    timing[0] = True
                samples[mode] += modes[mode](per_block)
            print(f"block {block + 1}/{args.blocks}: P99 " + ", ".join(
                f"{m} {p99(v):.2f} ms" for m, v in samples.items()), file=sys.stderr)
        depth = rc.llen(settings.keys.preinfer_signals(name))

    report = {
        "model": settings.model, "prefill_process": settings.prefill_process, "requests_per_mode": per_block * args.blocks, "blocks": args.blocks,
        "gil_switch_ms": settings.gil_switch_ms, "backlog_lead_s": args.backlog_lead_s,
        "payload": {k: v for k, v in payload.items() if k != "user_id"},
        **{mode: percentiles(values) for mode, values in samples.items()},
        "overhead_p99_ms": round(overhead_p99(samples), 3),
        "overhead_p99_ms_95ci": bootstrap(samples, overhead_p99),
        "celery_overhead_p99_ms": round(celery_overhead_p99(samples), 3),
        "celery_overhead_p99_ms_95ci": bootstrap(samples, celery_overhead_p99),
        "backlog_p99_ratio": round(backlog_ratio(samples), 3),
        "backlog_p99_ratio_95ci": bootstrap(samples, backlog_ratio),
        **({"unread_p99_ratio": round(unread_ratio(samples), 3),
            "unread_p99_ratio_95ci": bootstrap(samples, unread_ratio)} if "unread" in samples else {}),
        **({f"backlog_p99_ratio{suffix}": round(other_backlog_ratio(suffix)(samples), 3),
            f"backlog_p99_ratio{suffix}_95ci": bootstrap(samples, other_backlog_ratio(suffix))} if other_name else {}),
        "legs_ms": {mode: leg_percentiles(v) for mode, v in legs.items()},
        # Where each mode's timed ranks found the prefix: a backlog that fills HBM demotes the timed user's
        # (read) prefix, and its next rank reads it back from DRAM.
        "sources": {mode: dict(Counter(leg.get("source", "?") for leg in v)) for mode, v in legs.items()},
        # The backlog's ranks the flood left in HBM against direct's: ranking beside the backlog without the
        # DRAM reloads its demotions cost (what isolation alone leaves).
        **_hbm_only(legs, samples),
        "backlog_signals_sent": backlog.sent, "signal_list_depth_at_end": depth,
        "backlog_drain_s": {"max": round(max(backlog.drain_s, default=0.0), 2),
                            "mean": round(statistics.fmean(backlog.drain_s), 2) if backlog.drain_s else 0.0},
        "goals": {"overhead_p99_ms": 3.0, "backlog_p99_ratio": 1.5},
    }
    print(json.dumps(report, indent=2))
    if args.json_out:
        with open(args.json_out, "w", encoding="utf-8") as f:
            json.dump(report, f, indent=2)
    return 0


def _hbm_only(legs: dict[str, list[dict]], samples: dict[str, list[float]]) -> dict:
    hbm = [leg["round_trip"] for leg in legs.get("backlog", []) if leg.get("source") == "hbm"]
    if len(hbm) < 100:  # a P99 needs a hundred
        return {}
    ratio = p99(hbm) / p99(samples["direct"])
    interval = bootstrap({"hbm": hbm, "direct": samples["direct"]}, lambda s: p99(s["hbm"]) / p99(s["direct"]))
    return {"backlog_hbm_hits": len(hbm), "backlog_hbm_p99_ms": round(p99(hbm), 3),
            "backlog_hbm_p99_ratio": round(ratio, 3), "backlog_hbm_p99_ratio_95ci": interval}


def _with(context, body):
    with context:
        return body()


if __name__ == "__main__":
    sys.exit(main())
