"""A simulated fleet: N instances, each the real engine (or the baseline's full inference) on its own
shared compute, replaying events on the virtual clock.

An instance serves ranking requests in arrival order on ``rank_threads`` threads and pre-infer
signals as the engine does: the trigger decides on arrival, an admitted prefill runs on the
pre-inference lane. Token ids are not needed: a prefix of n tokens is n zeros (the cache key still
tells users and lengths apart), so memory stays flat at any fleet size.
"""

from __future__ import annotations

import random
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

import torch

from relay_engine.core.config import PolicySpec
from relay_engine.core.engine import DeadlineExceeded, PreInferRequest, RankRequest, RelayEngine
from relay_engine.core.model import History, HSTUModel
from relay_engine.core.trace import TraceQuery
from relay_engine.lab.bench.modes import FullInference, Mode, Regime, mode_policy
from relay_engine.lab.bench.stats import PointResult, point_result
from relay_engine.lab.bench.warmup import prime
from relay_engine.lab.bench.workload import (
    Event,
    InstanceReport,
    Window,
    captured_names,
    primed_routes,
    route,
    schedule,
    trace_qps,
    window_rng,
)
from relay_engine.lab.costmodel import CostModel
from relay_engine.lab.sim.des import SharedCompute, Simulation
from relay_engine.lab.sim.virtual import CostForwards, VirtualLane


@dataclass(frozen=True)
class FleetSpec:
    """What every simulated instance runs."""

    policy: PolicySpec | None  # None: the baseline (full inference, no cache)
    instances: int
    deadline_ms: float
    time_scale: float = 1.0  # the router's load window × K
    affinity: bool = True
    preinfer: bool = True  # pre-infer signals are sent
    rank_threads: int = 4
    device_type: str = "cpu"  # how the lane's share maps to a weight (``virtual.lane_weight``)
    # CPU instances that share a host: this many to a host of ``host_cores`` cores, each forward on one
    # core at most (1, 1.0: every instance on a compute of its own, one core or one device).
    instances_per_host: int = 1
    host_cores: float = 1.0
    # How requests find instances: "bounded" (the rendezvous router with its bounded-load fallback, as
    # the benchmark's fleet routes), "rendezvous" (the pure rendezvous choice, as the product's
    # ``RelayClient`` routes) or "captured" (where the trace says each request was served, the rest by
    # rendezvous: a preview replaying a pool's own traffic on its own members).
    routing: str = "bounded"
    # CPU a ranking request costs its instance outside its forwards (ms, on the instance's compute, before
    # the forwards): handing it to a rank thread, the dispatcher, the interpreter lock changing hands — what
    # a real instance's process spends beyond its forwards, per request (``stats.cpu_parts``).
    rank_overhead_ms: float = 0.0
    # The share of each instance's compute (or each core of its host) other processes take
    # (``stats.cpu_parts``'s ``others_share``; a preview's ``host_background``).
    background_share: float = 0.0
    # What interleaving forwards on a core costs (``des.SharedCompute``'s ``thrash``; 0: nothing).
    thrash: float = 0.0

    @classmethod
    def of_mode(cls, mode: Mode, regime: Regime, instances: int, rank_threads: int = 4,
                device_type: str = "cpu") -> FleetSpec:
        return cls(mode_policy(mode, regime), instances, regime.deadline_ms, regime.time_scale, mode.affinity,
                   mode.preinfer, rank_threads, device_type)


class Tokens:
    """Zero-token histories and candidate lists by length, shared by every simulated request."""

    def __init__(self) -> None:
        self._histories: dict[int, History] = {}
        self._candidates: dict[int, torch.Tensor] = {}

    def history(self, n: int) -> History:
        h = self._histories.get(n)
        if h is None:
            zeros = torch.zeros(n, dtype=torch.int64)
            h = self._histories[n] = History(zeros, zeros)
        return h

    def candidates(self, n: int) -> torch.Tensor:
        c = self._candidates.get(n)
        if c is None:
            c = self._candidates[n] = torch.zeros(n, dtype=torch.int64)
        return c


class SimInstance:
    def __init__(self, sim: Simulation, name: str, model: HSTUModel, cost: CostModel, spec: FleetSpec,
                 tokens: Tokens, compute: SharedCompute | None = None, forward_seed: int = 0):
        self.sim = sim
        self.name = name
        self.tokens = tokens
        self.deadline_s = spec.deadline_ms / 1000
        self.compute = compute if compute is not None else SharedCompute(sim)
        # Each instance's forward times drawn from a stream of its own (one per seed: a replay repeats).
        self.forwards = forwards = CostForwards(cost, self.compute, model.config, model.version,
                                                random.Random(f"forward-times:{forward_seed}:{name}"))
        self.engine: RelayEngine | None = None
        if spec.policy is None:
            self.ranker = FullInference(forwards, wall_clock=sim.clock)
        else:
            lane = VirtualLane(sim, spec.device_type, spec.policy.trigger.preinfer_compute_share, group=name)
            self.engine = self.ranker = RelayEngine(
                model=model, device=model.device, policy=spec.policy, name=name, clock=sim.clock,
                wall_clock=sim.clock, forwards=forwards, waiter=sim.wait_future, preinfer_lane=lane)
        self.report = InstanceReport()
        self._queue: deque[tuple[Event, float]] = deque()
        self._idle_threads = spec.rank_threads
        self.overhead_s = spec.rank_overhead_ms / 1000

    def prime(self, queries: Sequence[TraceQuery], indices: Sequence[int], cap: int) -> None:
        if self.engine is not None:
            prime(self.engine, ((queries[i].user_id, self.tokens.history(min(queries[i].seq_len, cap))) for i in indices),
                  lambda prefix: self.forwards.virtual_kv(len(prefix)))

    def on_event(self, ev: Event) -> None:
        if ev.kind == "rank":
            self._queue.append((ev, self.sim.now))
            if self._idle_threads:
                self._idle_threads -= 1
                self.sim.spawn(self._serve, group=self.name)
        elif self.engine is not None:
            result = self.engine.submit_pre_infer(PreInferRequest(ev.user_id, self.tokens.history(ev.prefix_len)))
            self.report.preinfers.append((ev.query, result.admitted, result.reason, ev.measured))

    def _serve(self) -> None:
        while self._queue:
            ev, arrival = self._queue.popleft()
            request = RankRequest(ev.user_id, self.tokens.history(ev.prefix_len), self.tokens.history(ev.short_len),
                                  self.tokens.candidates(ev.n_candidates), deadline_s=arrival + self.deadline_s)
            started = self.sim.now
            if self.overhead_s > 0:
                self.compute.run(self.overhead_s)
            spent = self.forwards.watch()
            reason = ""
            try:
                result = self.ranker.rank(request)
                outcome = result if isinstance(result, str) else result.source
                reason = "" if isinstance(result, str) else (result.miss_reason or "")
            except DeadlineExceeded:
                outcome = "deadline"
            finally:
                self.forwards.unwatch()
            self.report.ranks.append((ev.query, (self.sim.now - arrival) * 1000, outcome, ev.measured))
            self.report.detail.append((ev.query, (started - arrival) * 1000, spent[0] * 1000, spent[1] * 1000,
                                       str(reason)))
        self._idle_threads += 1

    def finish(self) -> InstanceReport:
        if self.engine is not None:
            self.report.record_tiers(self.engine.stats())
        return self.report


def instance_names(n: int) -> list[str]:
    return [f"instance-{i}" for i in range(n)]


def computes(sim: Simulation, spec: FleetSpec) -> list[SharedCompute]:
    """Each instance's compute: its own, or its host's (``instances_per_host`` to a host)."""
    if spec.instances_per_host <= 1 and spec.host_cores == 1.0:
        return [SharedCompute(sim, capacity=1.0 - spec.background_share, thrash=spec.thrash)
                for _ in range(spec.instances)]
    # Other processes of the host take the same share of every core: a forward alone runs at the rest.
    per_host, left = max(1, spec.instances_per_host), 1.0 - spec.background_share
    hosts = [SharedCompute(sim, capacity=spec.host_cores * left, job_cap=left, thrash=spec.thrash)
             for _ in range(-(-spec.instances // per_host))]
    return [hosts[i // per_host] for i in range(spec.instances)]


def replay_window(queries: Sequence[TraceQuery], window: Window, events: Sequence[Event], *, cap: int,
                  spec: FleetSpec, model: HSTUModel, cost: CostModel, rng: random.Random,
                  tokens: Tokens | None = None, progress: Callable[[float], None] | None = None,
                  forward_seed: int = 0) -> list[InstanceReport]:
    """Replay one window on fresh simulated instances (primed, then its events); a report per instance.
    ``forward_seed`` seeds the draws of forward times where the cost model states their dispersion."""
    sim = Simulation()
    tokens = tokens or Tokens()
    names = instance_names(spec.instances)
    fleet = {n: SimInstance(sim, n, model, cost, spec, tokens, compute, forward_seed)
             for n, compute in zip(names, computes(sim, spec), strict=True)}
    captured = captured_names(queries[window.prime_start:window.end], names) if spec.routing == "captured" else None
    if spec.policy is not None:
        for name, indices in primed_routes(queries, window, names, spec.affinity, rng, captured).items():
            fleet[name].prime(queries, indices, cap)
    for name, evs in route(events, names, spec.affinity, rng, spec.time_scale, bounded=spec.routing == "bounded",
                           captured=captured).items():
        handle = fleet[name].on_event
        for ev in evs:
            sim.at(ev.at_s, lambda ev=ev, handle=handle: handle(ev))
    sim.run(progress=progress)
    return [inst.finish() for inst in fleet.values()]


def simulate_point(queries: Sequence[TraceQuery], windows: Sequence[Window], *, model: HSTUModel, cost: CostModel,
                   mode: Mode, regime: Regime, cap: int, qps: float, instances: int, device_type: str = "cpu",
                   seed: int = 0, rank_threads: int = 4, trace_rate: float | None = None,
                   progress: Callable[[float], None] | None = None, rank_overhead_ms: float = 0.0,
                   background_share: float = 0.0, thrash: float = 0.0, forward_seed: int | None = None) -> PointResult:
    """One point (mode, cap, offered qps) over the paired windows, as the benchmark measures it. ``seed``
    routes as the benchmark's fleet does; ``forward_seed`` (default ``seed``) draws the forward times."""
    started = time.monotonic()
    rate = trace_rate or trace_qps(queries)
    spec = replace(FleetSpec.of_mode(mode, regime, instances, rank_threads, device_type),
                   rank_overhead_ms=rank_overhead_ms, background_share=min(0.9, max(0.0, background_share)),
                   thrash=max(0.0, thrash))
    tokens = Tokens()
    reports = []
    for window in windows:
        events = schedule(queries, window, cap=cap, qps=qps, trace_rate=rate, time_scale=regime.time_scale,
                          with_preinfer=mode.preinfer)
        reports.append(replay_window(queries, window, events, cap=cap, spec=spec, model=model, cost=cost,
                                     rng=window_rng(seed, window), tokens=tokens, progress=progress,
                                     forward_seed=seed if forward_seed is None else forward_seed))
    return point_result(mode.name, cap, qps, regime.time_scale, regime.slo_ms, reports, time.monotonic() - started)
