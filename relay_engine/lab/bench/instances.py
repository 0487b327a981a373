"""The real fleet: N engine instances as processes, each pinned to its own cores with the same seeded
weights, replaying the windows the driver sends them.

An instance replays a window open-loop on ``time.monotonic()`` (system-wide, so the driver's start
instant means the same everywhere): a dispatcher thread releases each event at its time — a pre-infer
signal goes to ``engine.submit_pre_infer`` (the trigger decides; the prefill runs on the engine's
pre-inference lane, at the policy's compute share), a ranking request to the queue that
``rank_threads`` ranking threads serve in arrival order. Latency is measured from the request's
scheduled arrival, so queueing counts; a request past its deadline fails fast and counts at its
latency. Every window starts on a fresh engine, primed (``warmup.prime``), with the previous
engine's lane drained, so no work leaks from one window into the next.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import queue
import threading
import time
from dataclasses import dataclass

import torch

from relay_engine.core import devices
from relay_engine.core.config import PolicySpec
from relay_engine.core.engine import DeadlineExceeded, PreInferRequest, RankRequest, RelayEngine
from relay_engine.core.features import SyntheticFeatures
from relay_engine.core.forward_times import ForwardTimes, TimedForwards, clock_for
from relay_engine.core.lifetime import follow_parent
from relay_engine.core.model import History, HSTUModel, PrefixKV
from relay_engine.lab.bench.host import cores_busy_s, cores_for, pin
from relay_engine.lab.bench.modes import FullInference
from relay_engine.lab.bench.settings import BenchSettings
from relay_engine.lab.bench.warmup import prime
from relay_engine.lab.bench.workload import Event, InstanceReport

START_MARGIN_S = 0.05  # between the start signal and a window's first event
PRIME_SETTLE_S = 120.0  # longest wait for a primed window's demotions to settle


@dataclass(frozen=True)
class WindowPlan:
    policy: PolicySpec | None  # None: the baseline
    cap: int
    primed: tuple[tuple[str, int], ...]  # (user_id, seq_len) to prime, in trace order
    events: tuple[Event, ...]
    deadline_ms: float


class Instance:
    """One engine instance inside its own process."""

    def __init__(self, name: str, model: HSTUModel, features: SyntheticFeatures, settings: BenchSettings,
                 cores: list[int] | None = None):
        self.name = name
        self.cores = cores  # the cores it is pinned to (None: not pinned), whose busy time a window reads
        self.model = model
        self.features = features
        self.rank_threads = settings.rank_threads
        self.forward_times = ForwardTimes()
        self.ranker: RelayEngine | FullInference = FullInference(model)
        self._prefixes: dict[tuple[str, int, int], History] = {}
        self._requests: dict[int, tuple] = {}
        c = model.config
        self._zeros = torch.zeros(c.num_layers, 2, c.num_heads, max(settings.caps), c.head_dim, device=model.device)

    def prefix(self, user_id: str, seq_len: int, cap: int) -> History:
        key = (user_id, seq_len, cap)
        if key not in self._prefixes:
            full = self.features.prefix(user_id, seq_len)
            keep = min(seq_len, cap)
            ts = None if full.timestamps is None else full.timestamps[-keep:]
            self._prefixes[key] = History(full.items[-keep:], full.actions[-keep:], ts)
        return self._prefixes[key]

    def _primed_kv(self, prefix: History) -> PrefixKV:
        """Zeros of the right shape: a view of one buffer, so priming costs no memory per entry."""
        return PrefixKV(self._zeros[:, :, :, :len(prefix)], prefix.timestamps, len(prefix), self.model.version, "none")

    def prepare(self, plan: WindowPlan) -> None:
        """A fresh engine in the plan's mode, primed; every request's token ids derived before the clock starts."""
        if isinstance(self.ranker, RelayEngine):
            self.ranker.close()
        if plan.policy is None:
            self.forward_times = ForwardTimes()
            self.ranker = FullInference(TimedForwards(self.model, self.forward_times, clock_for(self.model.device)[0]))
        else:
            # Deadlines are time.monotonic() instants, shared by the driver and every instance.
            self.ranker = RelayEngine(model=self.model, device=self.model.device, policy=plan.policy,
                                      name=self.name, wall_clock=time.monotonic)
            prime(self.ranker, ((u, self.prefix(u, n, plan.cap)) for u, n in plan.primed), self._primed_kv)
            # Priming demotes what HBM cannot hold; those copies and writes settle before the clock starts,
            # not inside the measured window.
            self.ranker.cache.flush(timeout_s=PRIME_SETTLE_S)
            self.forward_times = self.ranker.forward_times  # the fresh engine's: this window's forwards
        for ev in plan.events:
            self.prefix(ev.user_id, ev.seq_len, ev.cap)
            if ev.kind == "rank" and ev.query not in self._requests:
                self._requests[ev.query] = (
                    self.features.short_term(ev.user_id, ev.query, ev.short_len),
                    self.features.candidates(ev.query, ev.n_candidates))

    def run(self, plan: WindowPlan, start_s: float) -> InstanceReport:
        report = InstanceReport()
        wall, cpu, busy = time.monotonic(), time.process_time(), cores_busy_s(self.cores)
        ranks: queue.SimpleQueue[Event | None] = queue.SimpleQueue()
        workers = [threading.Thread(target=self._rank_loop, args=(plan, start_s, ranks, report), daemon=True)
                   for _ in range(self.rank_threads)]
        for t in workers:
            t.start()
        engine = self.ranker if isinstance(self.ranker, RelayEngine) else None
        for ev in plan.events:
            delay = start_s + ev.at_s - time.monotonic()
            if delay > 0:
                time.sleep(delay)
            if ev.kind == "rank":
                ranks.put(ev)
                report.dispatched_late[ev.query] = max(0.0, time.monotonic() - start_s - ev.at_s) * 1000
            elif engine is not None:
                result = engine.submit_pre_infer(PreInferRequest(ev.user_id, self.prefix(ev.user_id, ev.seq_len,
                                                                                         ev.cap)))
                report.preinfers.append((ev.query, result.admitted, result.reason, ev.measured))
        for _ in workers:
            ranks.put(None)
        for t in workers:
            t.join()
        if engine is not None:
            engine.close()  # the lane drains here, not into the next window
            report.record_tiers(engine.stats())
        report.cpu_ms = {"window": (time.monotonic() - wall) * 1000, "process": (time.process_time() - cpu) * 1000}
        busy_after = cores_busy_s(self.cores)
        if busy is not None and busy_after is not None:
            report.cpu_ms["cores_busy"] = (busy_after - busy) * 1000
        report.forward_times = self.forward_times.copy()
        return report

    def _rank_loop(self, plan: WindowPlan, start_s: float, ranks: queue.SimpleQueue, report: InstanceReport) -> None:
        while (ev := ranks.get()) is not None:
            arrival = start_s + ev.at_s
            short_term, candidates = self._requests[ev.query]
            request = RankRequest(ev.user_id, self.prefix(ev.user_id, ev.seq_len, ev.cap), short_term, candidates,
                                  deadline_s=arrival + plan.deadline_ms / 1000)
            taken, cpu = time.monotonic(), time.thread_time()
            reason = ""
            try:
                result = self.ranker.rank(request)
                outcome = result if isinstance(result, str) else result.source
                reason = "" if isinstance(result, str) else str(result.miss_reason or "")
            except DeadlineExceeded:
                outcome = "deadline"
            done = time.monotonic()
            report.ranks.append((ev.query, (done - arrival) * 1000, outcome, ev.measured))
            # As the simulator's (``InstanceReport.detail``): queued before this thread took it; the rank's
            # own CPU time (its forwards alone, near enough); its whole time taken (CPU + waits + sharing).
            report.detail.append((ev.query, max(0.0, taken - arrival) * 1000, (time.thread_time() - cpu) * 1000,
                                  (done - taken) * 1000, reason))


def _instance_main(conn, index: int, settings: BenchSettings, parent_pid: int) -> None:
    follow_parent(parent_pid)  # a killed benchmark leaves no instance behind (daemon=True covers only exits)
    cores = pin(cores_for(index, settings.threads_per_instance))
    devices.keep_freed_host_memory()
    torch.set_num_threads(settings.threads_per_instance)
    model = HSTUModel(settings.model)
    features = SyntheticFeatures(settings.model, with_timestamps=settings.with_timestamps, seed=settings.seed)
    instance = Instance(f"instance-{index}", model, features, settings, cores)
    conn.send((model.version, cores))
    while True:
        command, arg = conn.recv()
        if command == "window":
            instance.prepare(arg)
            conn.send("ready")
            conn.send(instance.run(arg, conn.recv()))
        elif command == "call":  # a function run here, on this instance's pinned cores (the profile)
            fn, args = arg
            conn.send(fn(*args))
        else:
            break


class Fleet:
    """N instance processes with the same weights, each pinned to its own cores."""

    def __init__(self, settings: BenchSettings):
        self.settings = settings
        self.names = [f"instance-{i}" for i in range(settings.instances)]
        ctx = mp.get_context("spawn")
        self._conns, self._procs = [], []
        os.environ["OMP_NUM_THREADS"] = str(settings.threads_per_instance)
        for i in range(settings.instances):
            parent, child = ctx.Pipe()
            proc = ctx.Process(target=_instance_main, args=(child, i, settings, os.getpid()), daemon=True)
            proc.start()
            self._conns.append(parent)
            self._procs.append(proc)
        hello = [conn.recv() for conn in self._conns]
        versions = {v for v, _ in hello}
        if len(versions) != 1:
            raise RuntimeError(f"instances disagree on the model version: {sorted(versions)}")
        self.model_version = versions.pop()
        self.cores = [c for _, c in hello]

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self._procs]

    def call(self, index: int, fn, *args):
        """fn(*args) inside instance `index` (pinned, with its torch threads); returns its result."""
        self._conns[index].send(("call", (fn, args)))
        return self._conns[index].recv()

    def window(self, plans: dict[str, WindowPlan]) -> list[InstanceReport]:
        for conn, name in zip(self._conns, self.names, strict=True):
            conn.send(("window", plans[name]))
        for conn in self._conns:
            conn.recv()  # "ready": fresh engine primed, inputs derived
        start = time.monotonic() + START_MARGIN_S
        for conn in self._conns:
            conn.send(start)
        return [conn.recv() for conn in self._conns]

    def close(self) -> None:
        for conn in self._conns:
            conn.send(("stop", None))
        for proc in self._procs:
            proc.join(10)
