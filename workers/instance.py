"""One worker process = one engine instance on one device, consuming only its own two queues.

    python -m workers.instance --pool NAME --index I [--device cpu|cuda:N|npu:N] [--model small|FILE]

Settings not given as flags come from the environment (``workers.settings``). The process builds
one ``RelayEngine``, applies the pool's desired revision, then runs a Celery worker on the
``threads`` pool (torch releases the GIL) that consumes ``P.{inst}.rank`` only (the Celery task, for
senders of that protocol). Beside it run: the rank threads that take the instance's ranking requests
from their own list (``workers.ranks``, what ``RelayClient`` sends by default), the
pre-infer signal reader (``workers.signals``: one thread on the instance's signal list, off Celery),
the engine's pre-inference lane, the reconciler, the telemetry publisher, the traffic
capture's writer (``workers.capture``), and the heartbeat,
which starts only once Celery consumes, so clients never route to an instance that is not serving.
On shutdown the instance leaves the live set first, so its users move at once.
"""

from __future__ import annotations

import argparse
import logging
import os
import socket
import sys
import time
from typing import Any

import torch
from celery import signals

from relay_engine.core import devices
from relay_engine.core.engine import RelayEngine
from relay_engine.core.features import SyntheticFeatures
from relay_engine.core.wire import HEARTBEAT_TIMEOUT_S, InstanceStatus, instance_name
from workers.app import make_app, redis_client
from workers.capture import TrafficCapture
from workers.loops import InstanceLoops
from workers.membership import IndexClaim
from workers.periodic import Periodic
from workers.ranks import RankConsumer
from workers.revision_store import RevisionStore
from workers.settings import CAPTURE_SECRET_ENV, MODELS, Settings
from workers.signals import SignalConsumer
from workers.tasks import InstanceRuntime, register_tasks
from workers.telemetry_publisher import WorkerCounts

log = logging.getLogger("workers.instance")

# Celery logs every task received, run and discarded at INFO: at serving rates that is a log line
# per request (with its scores) and real CPU. Per-request outcomes are in the telemetry instead.
PER_TASK_LOGGERS = ("celery.app.trace", "celery.worker.strategy", "celery.worker.request")


def engine_gauges(engine: RelayEngine) -> dict[str, Any]:
    stats = engine.stats()
    # On the CPU the "HBM" tier lives in host memory, which is then the device's memory.
    device_bytes = devices.device_memory_bytes(engine.device) or devices.host_memory_bytes()
    return {"tiers": stats.tier_levels(), "device_memory_bytes": device_bytes}


def model_dims(engine: RelayEngine) -> dict[str, int]:
    """The model's fingerprint as the status says it: what the control plane checks an edit against."""
    fingerprint = engine.model.config.fingerprint()
    return {"model_num_layers": fingerprint.num_layers, "model_num_heads": fingerprint.num_heads,
            "model_head_dim": fingerprint.head_dim}


def celery_argv(settings: Settings, name: str, loglevel: str) -> list[str]:
    keys = settings.keys
    return [
        "worker", "--pool=threads", f"--concurrency={settings.rank_threads}",
        f"--queues={keys.rank_queue(name)}", f"--hostname={name}@%h",
        # Membership is our own heartbeat in Redis; Celery's cluster chatter only slows start-up.
        "--without-mingle", "--without-gossip", "--without-heartbeat", f"--loglevel={loglevel}",
    ]


def run(settings: Settings, index: int, loglevel: str = "INFO") -> int:
    name = instance_name(settings.pool, index)
    devices.keep_freed_host_memory()
    if settings.torch_threads:
        torch.set_num_threads(settings.torch_threads)
    sys.setswitchinterval(settings.gil_switch_ms / 1000)
    device = devices.select_device(None if settings.device == "auto" else settings.device)
    engine = RelayEngine(model=settings.build_model(device), device=device, name=name,
                         prefill_process=settings.prefill_process == "on")
    client = redis_client(settings)
    keys = settings.keys
    started_at = time.time()
    counts = WorkerCounts()
    # No secret, no capture: nothing in Redis may stand in for it (whoever reads Redis could then
    # undo the hashes), and the status says why this instance records no traffic.
    capture = TrafficCapture(client, keys, name, secret=settings.capture_secret) if settings.capture_secret else None
    capture_off = "" if capture else f"no capture secret ({CAPTURE_SECRET_ENV} is not set): this instance records no traffic"
    if not capture:
        log.warning("%s: %s", name, capture_off)
    host, host_cpus = devices.host_identity()
    loops = InstanceLoops(engine, client, keys, InstanceStatus(
        instance=name, pool=settings.pool, device=str(engine.device), pid=os.getpid(),
        heartbeat_ts=started_at, started_at=started_at, capture_off=capture_off, **model_dims(engine),
        host=host, host_cpus=host_cpus, torch_threads=torch.get_num_threads(),
        **engine_gauges(engine),
    ), lambda: engine_gauges(engine), counts, settings.heartbeat_interval_s,
        RevisionStore(settings.revision_path(name)), settings.telemetry_tiers)
    if capture:
        capture.start()
    runtime = InstanceRuntime(engine, SyntheticFeatures(engine.model.config), counts, replies=client, keys=keys,
                              capture=capture)
    app = make_app(settings)
    register_tasks(app, runtime)
    # Its own connection: the reader blocks on BLPOP, which must not hold the loops' client.
    # Signals are pre-inference work: the reader yields to ranking before each, as the lane does.
    signal_reader = SignalConsumer(redis_client(settings), keys.preinfer_signals(name), runtime.pre_infer,
                                   yield_point=engine.yield_to_ranking)
    # Ranking requests off Celery's message protocol (``workers.ranks``); each thread blocks on BLPOP
    # on a connection of its own (the pool holds one per thread, and one for the answers).
    rank_reader = RankConsumer(redis_client(settings), keys, keys.rank_requests(name), runtime,
                               threads=settings.rank_threads)

    @signals.worker_ready.connect(weak=False)
    def _join(**_: Any) -> None:
        signal_reader.start()
        rank_reader.start()
        loops.join()
        log.info("%s serving on %s (model %s, %d rank threads, prefills %s)", name, engine.device, settings.model,
                 settings.rank_threads, engine.prefill_where)

    @signals.worker_shutting_down.connect(weak=False)
    def _leave(**_: Any) -> None:
        loops.leave()
        rank_reader.stop(timeout_s=0)  # take no more; those being ranked finish (joined below)

    loops.start()  # applies the desired revision (or the last applied one) before anything is consumed
    # Nothing known yet (no revision on disk, none in Redis): join no live set, serve no schema defaults.
    loops.reconciler.wait_until_known(on_wait=lambda: log.warning(
        "%s: no revision known (none at %s, none in Redis at %s): waiting before serving", name,
        settings.revision_path(name), keys.desired))
    try:
        return app.worker_main(celery_argv(settings, name, loglevel)) or 0
    finally:
        rank_reader.stop()
        signal_reader.stop()
        if capture:
            capture.stop()
        loops.stop()
        engine.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m workers.instance", description=__doc__.split("\n\n")[0])
    parser.add_argument("--pool", help="pool name (default $RELAYGR_POOL)")
    parser.add_argument("--index", required=True,
                        help="instance index in the pool, or 'auto': the lowest free one (scaled replicas)")
    parser.add_argument("--device", help="auto, cpu, cuda[:N], npu[:N] (default $RELAYGR_DEVICE)")
    parser.add_argument("--model", help=f"a model preset ({', '.join(MODELS)}) or a weights file from "
                                        f"python -m relay_engine.import_gr (default $RELAYGR_MODEL)")
    parser.add_argument("--rank-threads", type=int, help="Celery threads (default $RELAYGR_RANK_THREADS)")
    parser.add_argument("--loglevel", default="INFO")
    args = parser.parse_args(argv)
    if args.index != "auto" and (not args.index.isdigit() or int(args.index) > 1023):
        parser.error(f"--index must be an integer in [0, 1023] or 'auto', got {args.index!r}")
    settings = Settings.from_env(pool=args.pool, device=args.device, model=args.model,
                                 rank_threads=args.rank_threads)
    claim = None
    if args.index == "auto":
        claim = IndexClaim(redis_client(settings), settings.keys, owner=f"{socket.gethostname()}:{os.getpid()}")
        args.index = claim.claim()
    args.index = int(args.index)
    logging.basicConfig(level=args.loglevel.upper(), stream=sys.stderr,
                        format=f"%(asctime)s {instance_name(settings.pool, args.index)} %(levelname)s "
                               f"%(name)s: %(message)s")
    for name in PER_TASK_LOGGERS:
        logging.getLogger(name).setLevel(max(logging.WARNING, logging.getLogger().level))
    if claim is None:
        return run(settings, args.index, args.loglevel)
    renewal = Periodic("index-claim", HEARTBEAT_TIMEOUT_S, claim.renew).start()
    try:
        return run(settings, args.index, args.loglevel)
    finally:
        renewal.stop()
        claim.release()


if __name__ == "__main__":
    code = main()
    # Everything of ours is stopped (``run``'s finally). Interpreter teardown after torch takes
    # seconds here, which would only delay a restart; skip it.
    logging.shutdown()
    sys.stderr.flush()
    os._exit(code)
