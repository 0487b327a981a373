"""Round-trip overhead of ``rank`` through Celery and Redis, against the same call in-process.

    python -m workers.bench_roundtrip [--requests 1000] [--backlog 2000] [--json-out FILE]

Starts one instance (``RELAYGR_MODEL``, default small) against ``REDIS_URL`` or a private
embedded Redis, and times, one request at a time for the same user (HBM hits):

1. **in-process**: the task body (payload validation, features, ``engine.rank``) called directly
   on an engine built here;
2. **celery**: ``RelayClient.rank`` → Redis → the instance → result back, on loopback;
3. **celery + pre-infer backlog**: the same while the instance's pre-infer queue holds a backlog
   of signals that keeps growing (``--backlog`` sent at once, then more at 500/s), all admitted
   by the trigger, so its prefill thread is busy throughout.

Prints P50/P99 of each and the overhead (celery − in-process); a benchmark, not a test.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from contextlib import ExitStack

import numpy as np
import torch

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


def percentiles(values_ms: list[float]) -> dict[str, float]:
    p50, p99 = np.percentile(values_ms, [50, 99])
    return {"p50_ms": round(float(p50), 3), "p99_ms": round(float(p99), 3),
            "mean_ms": round(statistics.fmean(values_ms), 3), "n": len(values_ms)}


def time_in_process(settings: Settings, payload: dict, n: int) -> list[float]:
    torch.set_num_threads(settings.torch_threads or torch.get_num_threads())  # as the instance runs
    cpu = torch.device("cpu")
    engine = RelayEngine(model=settings.build_model(cpu), device=cpu, name="in-process")
    runtime = InstanceRuntime(engine, SyntheticFeatures(engine.model.config), WorkerCounts())
    out = []
    for i in range(n + 20):
        t0 = time.perf_counter()
        result = runtime.rank((payload,), {})
        elapsed = (time.perf_counter() - t0) * 1000
        if not result["ok"]:
            raise RuntimeError(result)
        if i >= 20:
            out.append(elapsed)
    return out


def time_celery(client: RelayClient, payload: dict, n: int, warmup: int = 20) -> tuple[list[float], list[float]]:
    round_trips, overheads = [], []
    for i in range(n + warmup):
        reply = client.rank(deadline_s=time.time() + 2.0, **payload)
        if i >= warmup:
            round_trips.append(reply.round_trip_ms)
            overheads.append(reply.round_trip_ms - reply.engine_ms)
    return round_trips, overheads


def keep_backlog(client: RelayClient, instance: str, initial: int, rate_per_s: float, seq_len: int,
                 stop: threading.Event) -> None:
    for i in range(initial):
        client.pre_infer(f"backlog-{i}", seq_len=seq_len, instance=instance)
    i = initial
    while not stop.wait(1 / rate_per_s):
        client.pre_infer(f"backlog-{i}", seq_len=seq_len, instance=instance)
        i += 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m workers.bench_roundtrip", description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=1000)
    parser.add_argument("--backlog", type=int, default=2000)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--short-len", type=int, default=16)
    parser.add_argument("--candidates", type=int, default=64)
    parser.add_argument("--json-out")
    args = parser.parse_args(argv)

    with ExitStack() as stack:
        redis_url = os.environ.get("REDIS_URL") or \
            stack.enter_context(EmbeddedRedis(tempfile.mkdtemp(prefix="relaygr-bench-"))).url
        settings = Settings.from_env(redis_url=redis_url, key_prefix=f"bench-{uuid.uuid4().hex[:8]}",
                                     pool="bench", model=os.environ.get("RELAYGR_MODEL", "small"), torch_threads=1,
                                     data_dir=tempfile.mkdtemp(prefix="relaygr-bench-"))
        name = instance_name(settings.pool, 0)
        log_path = os.path.join(tempfile.mkdtemp(prefix="relaygr-bench-"), f"{name}.log")
        proc = spawn_instance(settings, 0, stdout=subprocess.DEVNULL, stderr=open(log_path, "w"))  # noqa: SIM115
        print(f"instance {name} logging to {log_path}", file=sys.stderr)
        stack.callback(lambda: (proc.terminate(), proc.wait(15)))
        rc = redis_client(settings)
        spec = parse_policy(ADMIT_ALL_POLICY)
        rc.set(settings.keys.desired, DesiredRevision(1, spec.sha256(), spec.to_dict(), time.time()).to_json())
        wait_until_live(rc, settings, [name], procs=[proc])
        client = stack.enter_context(RelayClient(settings))
        payload = {"user_id": "bench-user", "seq_len": args.seq_len, "short_len": args.short_len,
                   "n_candidates": args.candidates, "query_index": 1}

        in_process = time_in_process(settings, payload, args.requests)
        celery_rt, celery_overhead = time_celery(client, payload, args.requests)

        stop = threading.Event()
        feeder = threading.Thread(target=keep_backlog, args=(client, name, args.backlog, 500.0, args.seq_len, stop))
        feeder.start()
        while rc.llen(settings.keys.preinfer_queue(name)) < args.backlog // 4 and feeder.is_alive():
            time.sleep(0.01)
        depth_before = rc.llen(settings.keys.preinfer_queue(name))
        backlog_rt, _ = time_celery(client, payload, args.requests, warmup=0)
        depth_after = rc.llen(settings.keys.preinfer_queue(name))
        stop.set()
        feeder.join()

    report = {
        "model": settings.model, "requests": args.requests,
        "payload": {k: v for k, v in payload.items() if k != "user_id"},
        "in_process": percentiles(in_process),
        "celery_round_trip": percentiles(celery_rt),
        "celery_overhead_per_request": percentiles(celery_overhead),
        "overhead_p50_ms": round(percentiles(celery_rt)["p50_ms"] - percentiles(in_process)["p50_ms"], 3),
        "overhead_p99_ms": round(percentiles(celery_rt)["p99_ms"] - percentiles(in_process)["p99_ms"], 3),
        "with_preinfer_backlog": {**percentiles(backlog_rt), "preinfer_queue_depth_before": depth_before,
                                  "preinfer_queue_depth_after": depth_after},
    }
    print(json.dumps(report, indent=2))
    if args.json_out:
        with open(args.json_out, "w", encoding="utf-8") as f:
            json.dump(report, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
