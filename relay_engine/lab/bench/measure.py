"""The real and the simulated ``sweeps.Measure``: a point of a mode at a cap and a load, replayed on the
lab's fleet (``instances.Fleet``) or on the simulator, over the same paired windows."""

from __future__ import annotations

import os
import time
from collections.abc import Sequence

import numpy as np
from tqdm import tqdm

from relay_engine.core.model import HSTUModel
from relay_engine.core.trace import TraceQuery
from relay_engine.lab.bench.host import HostMonitor
from relay_engine.lab.bench.instances import Fleet, WindowPlan
from relay_engine.lab.bench.modes import Mode, Regime, mode_policy
from relay_engine.lab.bench.settings import BenchSettings
from relay_engine.lab.bench.stats import PointResult, point_result
from relay_engine.lab.bench.workload import Window, primed_routes, route, schedule, trace_qps, window_rng
from relay_engine.lab.costmodel import CostModel
from relay_engine.lab.sim.fleet import simulate_point


class RealMeasure:
    """``sweeps.Measure`` on the real fleet: the paired windows, a contention check, redone if busy."""

    def __init__(self, settings: BenchSettings, fleet: Fleet, queries: Sequence[TraceQuery], windows: list[Window],
                 regime: Regime, progress: tqdm):
        self.s, self.fleet, self.queries, self.windows, self.regime = settings, fleet, queries, windows, regime
        self.rate = trace_qps(queries)
        self.progress = progress
        self.rng = np.random.default_rng(settings.seed)

    def __call__(self, mode: Mode, cap: int, qps: float) -> PointResult:
        s = self.s
        self.progress.set_description(f"{mode.name:<19} cap {cap:>5} @ {qps:6.2f} qps")
        for attempt in range(s.max_redo + 1):
            started = time.monotonic()
            with HostMonitor([os.getpid(), *self.fleet.pids], other_share=s.busy_other_share,
                             window_share=s.busy_window_share, steal_share=s.busy_steal_share) as monitor:
                reports = [self._window(mode, cap, qps, w) for w in self.windows]
            point = point_result(mode.name, cap, qps, self.regime.time_scale, self.regime.slo_ms, reports,
                                 time.monotonic() - started)
            point.host, point.redone = monitor.verdict.to_dict(), attempt
            if not monitor.verdict.busy or attempt == s.max_redo:
                break
            self.progress.write(f"busy host during {mode.name} cap {cap} @ {qps:.2f} qps "
                                f"({monitor.verdict.to_dict()}); measuring it again")
        point.bootstrap(s.bootstrap_replicates, self.rng)
        self.progress.update(1)
        return point

    def _window(self, mode: Mode, cap: int, qps: float, window: Window):
        names = self.fleet.names
        events = schedule(self.queries, window, cap=cap, qps=qps, trace_rate=self.rate,
                          time_scale=self.regime.time_scale, with_preinfer=mode.preinfer)
        rng = window_rng(self.s.seed, window)
        primed = primed_routes(self.queries, window, names, mode.affinity, rng) if mode.relay else {}
        routed = route(events, names, mode.affinity, rng, self.regime.time_scale)
        policy = mode_policy(mode, self.regime)
        plans = {n: WindowPlan(policy, cap, tuple((self.queries[i].user_id, self.queries[i].seq_len)
                                                  for i in primed.get(n, ())),
                               tuple(routed[n]), self.regime.deadline_ms) for n in names}
        return self.fleet.window(plans)


class SimMeasure:
    """``sweeps.Measure`` on the simulator, with the same windows, regime and instances."""

    def __init__(self, settings: BenchSettings, cost: CostModel, queries: Sequence[TraceQuery], windows: list[Window],
                 regime: Regime, rank_overhead_ms: float = 0.0, background_share: float = 0.0, thrash: float = 0.0):
        self.s, self.cost, self.queries, self.windows, self.regime = settings, cost, queries, windows, regime
        self.model = HSTUModel(settings.model)
        self.rate = trace_qps(queries)
        self.rank_overhead_ms, self.background_share, self.thrash = rank_overhead_ms, background_share, thrash

    def __call__(self, mode: Mode, cap: int, qps: float, forward_seed: int | None = None) -> PointResult:
        point = simulate_point(self.queries, self.windows, model=self.model, cost=self.cost, mode=mode,
                               regime=self.regime, cap=cap, qps=qps, instances=self.s.instances,
                               rank_threads=self.s.rank_threads, seed=self.s.seed, trace_rate=self.rate,
                               rank_overhead_ms=self.rank_overhead_ms, background_share=self.background_share,
                               thrash=self.thrash, forward_seed=forward_seed)
        point.bootstrap(self.s.bootstrap_replicates // 4, np.random.default_rng(self.s.seed))
        return point
