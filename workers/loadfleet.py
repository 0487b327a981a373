"""A load fleet: many instances that speak the real wire protocol through real Redis, without a model.

    python -m workers.loadfleet --instances 256 [--pool NAME] [--processes 2] [--duration S]

Load for the control plane, not a mock of it: each instance runs the workers' own background side
(``workers.loops.InstanceLoops``: status board and heartbeat, the reconciler with its poke
subscription, ACK/NACK, the telemetry publisher with its streams and pool rollups) around a
``LoadEngine``, a stand-in that applies policies with the engine's checks and reports plausible
traffic. Nothing serves requests (no Celery queues), so 256 instances fit on a laptop: instances are
threads, spread over ``--processes`` processes. Every ``--slow-every``-th instance ranks slower and
every ``--hot-every``-th one runs its HBM near its budget, so the worst instances of a pool view are
known in advance. Settings come from the environment like any worker's (``REDIS_URL``,
``RELAYGR_KEY_PREFIX``, ``RELAYGR_POOL``); it prints one line when every instance is live and runs
until ``--duration`` passes or it is interrupted, then leaves the live set.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import multiprocessing
import os
import signal
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np

from relay_engine.core.config import PolicySpec, default_policy
from relay_engine.core.engine import EngineStats, PolicyApplyError
from relay_engine.core.fields import argument
from relay_engine.core.lifetime import follow_parent
from relay_engine.core.outcomes import OUTCOME_COUNTERS, Outcome, TierCounters
from relay_engine.core.telemetry import (
    COUNTERS,
    LATENCY_BUCKETS_MS,
    MISS_REASONS,
    N_BUCKETS,
    REFUSAL_REASONS,
    LatencyHistogram,
    MissReason,
    RefusalReason,
)
from relay_engine.core.tiers import TierFigures
from relay_engine.core.wire import InstanceStatus, instance_name
from workers.app import redis_client
from workers.loops import TELEMETRY_CHECK_S, InstanceLoops
from workers.periodic import Periodic
from workers.pool import wait_until_live
from workers.revision_store import RevisionStore
from workers.settings import Settings
from workers.telemetry_publisher import WorkerCounts

DEVICE = "loadgen"
DEVICE_MEMORY_BYTES = 16 * 2**30  # what the stand-in's "device" holds: larger HBM budgets are NACKed
# Where the stand-in's lookups are served from: its HBM, the tier under it, a reload in flight, a miss.
LOOKUP_SHARES: dict[Outcome, float] = {Outcome.HBM: 0.7, Outcome.DRAM: 0.1, Outcome.INFLIGHT: 0.05, Outcome.MISS: 0.15}
LOWER_FILL = 0.3  # the share of its budget the tier under HBM holds


@dataclass(frozen=True)
class Profile:
    """How one stand-in instance behaves: its traffic, latency and HBM fill."""

    rank_per_s: float = 20.0
    median_ms: float = 8.0
    hbm_fill: float = 0.5  # share of the HBM budget held by caches


def profile_of(index: int, *, rank_per_s: float, slow_every: int, hot_every: int) -> Profile:
    """Every ``slow_every``-th instance (0, k, 2k, …) ranks 4× slower, every ``hot_every``-th one
    (1, k+1, …) fills its HBM to 95 %; 0 turns either off."""
    slow = slow_every > 0 and index % slow_every == 0
    hot = hot_every > 0 and index % hot_every == min(1, hot_every - 1)
    return Profile(rank_per_s=rank_per_s, median_ms=32.0 if slow else 8.0, hbm_fill=0.95 if hot else 0.5)


class LoadEngine:
    """Stands in for ``RelayEngine`` where only the control plane's load matters: it applies a
    policy with the engine's own applicability check (an HBM budget larger than the device is refused,
    so the reconciler NACKs), and its stats advance with simulated traffic: Poisson arrivals,
    log-normal latencies, cache hits and pre-infer refusals in fixed shares."""

    device = DEVICE

    def __init__(self, name: str, profile: Profile, *, seed: int, clock=time.monotonic):
        self.name = name
        self.profile = profile
        self._policy = default_policy()
        self._policy_sha256 = self._policy.sha256()
        self._rng = np.random.default_rng(seed)
        self._clock = clock
        self._last = clock()
        self._lock = threading.Lock()
        self._counters = dict.fromkeys(COUNTERS, 0)
        self._refusals = dict.fromkeys(REFUSAL_REASONS, 0)
        self._misses = dict.fromkeys(MISS_REASONS, 0)
        self._latency = LatencyHistogram()

    @property
    def policy(self) -> PolicySpec:
        return self._policy

    def apply_policy(self, policy: PolicySpec) -> None:
        if policy.cache.hbm_budget_bytes > DEVICE_MEMORY_BYTES:
            raise PolicyApplyError("cache.hbm_budget_mb", f"{policy.cache.hbm_budget_mb:.10g} MiB exceeds the load "
                                                          f"generator's device, {DEVICE_MEMORY_BYTES / 2**20:.0f} MiB")
        self._policy, self._policy_sha256 = policy, policy.sha256()

    def _advance(self) -> None:
        now = self._clock()
        elapsed_s, self._last = max(0.0, now - self._last), now
        n = int(self._rng.poisson(self.profile.rank_per_s * elapsed_s))
        if not n:
            return
        latencies_ms = self._rng.lognormal(math.log(self.profile.median_ms), 0.35, n)
        buckets = np.bincount(np.searchsorted(LATENCY_BUCKETS_MS, latencies_ms), minlength=N_BUCKETS)
        self._latency.counts = [a + int(b) for a, b in zip(self._latency.counts, buckets, strict=True)]
        self._latency.sum_ms += float(latencies_ms.sum())
        within = int((latencies_ms <= self._policy.trigger.ranking_p99_slo_ms).sum())
        served = dict(zip(LOOKUP_SHARES, (int(c) for c in self._rng.multinomial(n, list(LOOKUP_SHARES.values()))),
                          strict=True))
        for outcome, count in served.items():
            self._counters[OUTCOME_COUNTERS[outcome]] += count
        # A miss is mostly an eviction, the rest refusals: fixed shares, summing to the misses.
        evicted = served[Outcome.MISS] // 2
        self._misses[MissReason.EVICTED_DRAM] += evicted
        self._misses[MissReason.NOT_ADMITTED_NOT_AT_RISK] += served[Outcome.MISS] - evicted
        for name, count in (("rank_requests", n), ("rank_ok", n), ("rank_within_slo", within),
                            ("preinfer_signals", n), ("preinfer_admitted", n // 2), ("preinfer_completed", n // 2),
                            ("evictions", n // 10), ("demotions", n // 10), ("promotions", served[Outcome.DRAM])):
            self._counters[name] += count
        self._refusals[RefusalReason.NOT_AT_RISK] += n - n // 2

    def set_rerouted_check(self, was_elsewhere: Any) -> None:
        """A stand-in routes no real users: nothing to count as rerouted."""

    def stats(self) -> EngineStats:
        with self._lock:
            self._advance()
            cache = self._policy.cache
            hbm_bytes = int(cache.hbm_budget_bytes * self.profile.hbm_fill * self._rng.uniform(0.97, 1.0))
            hbm = _figures(hbm_bytes, cache.hbm_budget_bytes)
            return EngineStats(
                name=self.name, device=DEVICE, model_version="loadgen", policy_sha256=self._policy_sha256,
                edit_hash="", counters=dict(self._counters), refusals=dict(self._refusals),
                rank_latency=self._latency.copy(), hbm_bytes=hbm.bytes, hbm_budget_bytes=hbm.budget_bytes,
                hbm_peak_bytes=hbm.peak_bytes, hbm_entries=hbm.entries,
                tiers={Outcome.HBM: hbm, Outcome.DRAM: _figures(int(cache.dram_budget_bytes * LOWER_FILL),
                                                                cache.dram_budget_bytes)},
                misses=dict(self._misses),
            )

    def gauges(self) -> dict[str, Any]:
        return {"tiers": self.stats().tier_levels(), "device_memory_bytes": DEVICE_MEMORY_BYTES}


def _figures(used_bytes: int, budget_bytes: int) -> TierFigures:
    """A stand-in tier holding used_bytes, its peak, in entries of 2 MiB."""
    return TierFigures(used_bytes, budget_bytes, used_bytes, used_bytes // 2**21, TierCounters(peak_bytes=used_bytes))


def start_instance(settings: Settings, index: int, profile: Profile) -> InstanceLoops:
    """One stand-in instance, with its own Redis connections as a real instance has (its poke
    subscription holds one): reconciling on its own thread, as a real one does, and joined; its
    telemetry and heartbeat run on the caller's ``tick`` (hundreds of timer threads would spend the
    processes' time waking each other)."""
    name = instance_name(settings.pool, index)
    client = redis_client(settings)
    engine = LoadEngine(name, profile, seed=index)
    now = time.time()
    loops = InstanceLoops(engine, client, settings.keys, InstanceStatus(
        instance=name, pool=settings.pool, device=DEVICE, pid=os.getpid(), heartbeat_ts=now, started_at=now,
        **engine.gauges(),
    ), engine.gauges, WorkerCounts(), settings.heartbeat_interval_s, RevisionStore(settings.revision_path(name)),
        settings.telemetry_tiers)
    loops.start(timers=False)
    loops.join(timers=False)
    return loops


def _run_slice(settings: Settings, indices: list[int], options: dict[str, Any], stop, parent_pid: int) -> None:
    """A child process: instances ``indices`` until ``stop`` is set (also while they start), or its
    parent dies."""
    follow_parent(parent_pid)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent stops us through ``stop``
    running: list[InstanceLoops] = []
    ticker = Periodic("ticker", TELEMETRY_CHECK_S, lambda: [loops.tick() for loops in list(running)]).start()
    for index in indices:
        if stop.is_set():
            break
        running.append(start_instance(settings, index, profile_of(index, **options)))
    stop.wait()
    ticker.stop()
    for loops in running:
        loops.leave()
    # Stopped side by side: each reconciler may be waiting up to a second for a poke.
    with ThreadPoolExecutor(max_workers=32) as pool:
        list(pool.map(InstanceLoops.stop, running))


class LoadFleet:
    """``instances`` stand-in instances of ``settings.pool`` over ``processes`` processes."""

    def __init__(self, settings: Settings, instances: int, *, processes: int = 2, rank_per_s: float = 20.0,
                 slow_every: int = 8, hot_every: int = 8):
        # Stand-ins keep their last applied revision like real instances, in a folder of this run's
        # own unless one is set: hundreds of state files do not belong in the user's home.
        self._state_dir = None if settings.data_dir else tempfile.TemporaryDirectory(prefix="relaygr-loadfleet-")
        if self._state_dir is not None:
            settings = dataclasses.replace(settings, data_dir=self._state_dir.name)
        self.settings = settings
        self.instances = instances
        self.options = {"rank_per_s": rank_per_s, "slow_every": slow_every, "hot_every": hot_every}
        context = multiprocessing.get_context("spawn")
        self._stop = context.Event()
        slices = [list(range(instances))[i::processes] for i in range(min(processes, instances))]
        self._procs = [context.Process(target=_run_slice, args=(settings, part, self.options, self._stop, os.getpid()),
                                       name=f"loadfleet-{i}", daemon=True) for i, part in enumerate(slices)]

    @property
    def names(self) -> list[str]:
        return [instance_name(self.settings.pool, i) for i in range(self.instances)]

    def start(self, timeout_s: float = 120.0) -> LoadFleet:
        """Start the processes; returns once every instance heartbeats (RuntimeError if one dies)."""
        for proc in self._procs:
            proc.start()
        client = redis_client(self.settings)
        try:
            wait_until_live(client, self.settings, self.names, timeout_s, self._procs)
        except BaseException:
            self.stop()
            raise
        finally:
            client.close()
        return self

    def stop(self, timeout_s: float = 30.0) -> None:
        self._stop.set()
        for proc in self._procs:
            proc.join(timeout_s)
            if proc.is_alive():
                proc.kill()
                proc.join()
        if self._state_dir is not None:
            self._state_dir.cleanup()

    def __enter__(self) -> LoadFleet:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m workers.loadfleet", description=__doc__.split("\n\n")[0])
    parser.add_argument("--instances", type=argument(1, 1024, as_int=True), default=32, help="stand-in instances (1 to 1024; default 32)")
    parser.add_argument("--pool", help="pool name (default $RELAYGR_POOL)")
    parser.add_argument("--processes", type=argument(1, 64, as_int=True), default=2, help="processes to spread them over (default 2)")
    parser.add_argument("--rank-per-s", type=argument(0, 100_000), default=20.0, help="simulated ranking requests/s per instance")
    parser.add_argument("--slow-every", type=int, default=8, help="every k-th instance ranks 4x slower (0: none)")
    parser.add_argument("--hot-every", type=int, default=8, help="every k-th instance fills 95%% of its HBM (0: none)")
    parser.add_argument("--duration", type=float, default=0.0, help="seconds to run (default: until interrupted)")
    args = parser.parse_args(argv)
    settings = Settings.from_env(pool=args.pool)
    fleet = LoadFleet(settings, args.instances, processes=args.processes, rank_per_s=args.rank_per_s,
                      slow_every=max(0, args.slow_every), hot_every=max(0, args.hot_every))
    signal.signal(signal.SIGTERM, _interrupt)
    started = time.monotonic()
    try:
        fleet.start()
        print(f"{args.instances} instances of pool {settings.pool!r} live after {time.monotonic() - started:.1f} s "
              f"({args.processes} processes)", flush=True)
        threading.Event().wait(args.duration or None)
    except KeyboardInterrupt:
        pass
    finally:
        fleet.stop()
    return 0


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


if __name__ == "__main__":
    sys.exit(main())
