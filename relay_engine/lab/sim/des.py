"""The discrete-event core: a virtual clock, processes, and each instance's shared compute.

Every request is a process (a greenlet) running the real engine code; the only places it gives up
control are the engine's seams: a forward pass (``SharedCompute.run``: the process sleeps until its
work is done) and a wait for a computation in flight (``Simulation.wait_future``). Between those, the
engine's code runs to completion at one virtual instant, exactly as written: one policy code, two
clocks. Processes never switch while holding one of the engine's locks (no seam is called under
one), so those locks never block.

``SharedCompute`` is one instance's device: work-conserving weighted processor sharing. Each running
job progresses at ``capacity × weight / Σ weights`` of standalone speed — what Linux's CFS does with
a nice-0 ranking thread and a lower-weighted pre-inference thread on one core, and what a priority
stream approximates on an accelerator. CPU instances that share a host share one ``SharedCompute``
of the host's cores instead, each job at most one core (``job_cap``).
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections.abc import Callable
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any

import greenlet

_WOKEN_BY_FUTURE = object()
_TIMED_OUT = object()


class Simulation:
    """An event heap on a virtual clock (seconds), and processes that block on it."""

    def __init__(self) -> None:
        self.now = 0.0
        self._heap: list[tuple[float, int, Callable[[], None]]] = []
        self._seq = itertools.count()
        self._loop = greenlet.getcurrent()
        self.events = 0

    def clock(self) -> float:
        return self.now

    def at(self, t: float, fn: Callable[[], None]) -> None:
        heapq.heappush(self._heap, (max(t, self.now), next(self._seq), fn))

    def spawn(self, fn: Callable[..., Any], *args: Any, weight: float = 1.0, group: object = None,
              paced: float | None = None) -> greenlet.greenlet:
        """Start fn(*args) as a process now (after the current event). ``weight``: its compute weight;
        ``group`` and ``paced``: see ``SharedCompute``."""
        g = greenlet.greenlet(lambda: fn(*args), parent=self._loop)
        g.weight, g.group, g.paced = weight, group, paced
        self.at(self.now, g.switch)
        return g

    def block(self) -> Any:
        """Suspend the calling process until ``wake`` resumes it; returns what wake passed."""
        if greenlet.getcurrent() is self._loop:
            raise RuntimeError("the simulation loop itself cannot block (call this from a process)")
        return self._loop.switch()

    def wake(self, g: greenlet.greenlet, value: Any = None) -> None:
        self.at(self.now, lambda: g.switch(value))

    def wait_future(self, future: Future, timeout_s: float | None) -> Any:
        """The engine's waiter on the virtual clock: the future's result, or FutureTimeout."""
        if not future.done():
            me = greenlet.getcurrent()
            woken = [False]

            def resume(token: object) -> None:
                if not woken[0]:
                    woken[0] = True
                    self.wake(me, token)

            future.add_done_callback(lambda _f: resume(_WOKEN_BY_FUTURE))
            if timeout_s is not None:
                self.at(self.now + max(0.0, timeout_s), lambda: resume(_TIMED_OUT))
            if self.block() is _TIMED_OUT:
                raise FutureTimeout()
        return future.result(timeout=0)

    def run(self, until: float = math.inf, progress: Callable[[float], None] | None = None) -> None:
        """Process events in time order until none is left (or the clock would pass ``until``)."""
        heap = self._heap
        while heap and heap[0][0] <= until:
            t, _, fn = heapq.heappop(heap)
            self.now = t
            fn()
            self.events += 1
            if progress is not None and not self.events % 4096:
                progress(t)


class SharedCompute:
    """Compute under weighted processor sharing (work-conserving), optionally with a cap per job.

    ``capacity``: standalone-speed units the compute has (1: one device, or one core); ``job_cap``: the
    most one job can use (None: all of it). A host of C cores whose instances each run single-threaded
    forwards is ``capacity=C, job_cap=1``: a job alone gets one core, never two, and jobs share the
    cores by weight once there are more of them than cores (what CFS does with the threads of every
    process on the host). With ``job_cap`` None every job gets ``capacity × weight / Σ weights``.

    A process spawned with ``paced`` = p (a share) and a ``group`` is the engine's paced prefill
    (``engine.RankingGate``): under a per-job cap, while another job of its group (its instance's
    ranking) runs on this compute, it gets at most p of one job's cap, as the real gate pauses it
    between layers even when a core is free. Alone with no ranking of its own, it runs at full speed.

    ``thrash``: what interleaving costs. With n jobs on c cores (c: ``capacity / job_cap``, or one
    compute without a per-job cap) and n > c, every job runs ``1 + thrash × (n / c − 1)`` times slower
    than its share alone would give: forwards that take turns on a core evict each other's working set,
    so a forward costs more CPU the more of them interleave (measured on a CPU instance: 1.1–1.9× its
    standalone time in service, more at higher load and longer prefixes).
    """

    def __init__(self, sim: Simulation, capacity: float = 1.0, job_cap: float | None = None, thrash: float = 0.0):
        self.sim = sim
        self.capacity = capacity
        self.job_cap = job_cap
        self.thrash = thrash
        self._jobs: dict[int, list] = {}  # id → [remaining standalone seconds, weight, process]
        self._rates: dict[int, float] = {}
        self._ids = itertools.count()
        self._updated = 0.0
        self._version = 0
        self.busy_s = 0.0

    def run(self, work_s: float, weight: float | None = None) -> None:
        """Take work_s seconds of standalone compute, sharing the device; returns when done."""
        if work_s <= 0:
            return
        me = greenlet.getcurrent()
        w = getattr(me, "weight", 1.0) if weight is None else weight
        self._advance()
        self._jobs[next(self._ids)] = [work_s, w, me, getattr(me, "group", None), getattr(me, "paced", None)]
        self._reschedule()
        self.sim.block()

    def _shares(self) -> dict[int, float]:
        """Each job's speed: by weight, water-filled under the per-job cap, slowed by interleaving."""
        rates = self._fair_shares()
        cores = self.capacity / self.job_cap if self.job_cap else 1.0
        if self.thrash > 0 and len(self._jobs) > cores:
            slower = 1.0 + self.thrash * (len(self._jobs) / cores - 1.0)
            rates = {i: rate / slower for i, rate in rates.items()}
        return rates

    def _fair_shares(self) -> dict[int, float]:
        if self.job_cap is None:
            total = sum(job[1] for job in self._jobs.values())
            return {i: self.capacity * job[1] / total for i, job in self._jobs.items()}
        ranking = {job[3] for job in self._jobs.values() if job[4] is None and job[3] is not None}
        caps = {i: self.job_cap * (job[4] if job[4] is not None and job[3] in ranking else 1.0)
                for i, job in self._jobs.items()}
        rates, left, weights = {}, self.capacity, sum(job[1] for job in self._jobs.values())
        # Water-filling: the jobs whose cap binds first (lowest cap per weight) take theirs.
        for i, job in sorted(self._jobs.items(), key=lambda kv: caps[kv[0]] / kv[1][1] if kv[1][1] > 0 else math.inf):
            rate = min(caps[i], left * job[1] / weights) if weights > 0 else 0.0
            rates[i] = rate
            left -= rate
            weights -= job[1]
        return rates

    def _advance(self) -> None:
        now = self.sim.now
        elapsed = now - self._updated
        self._updated = now
        if elapsed <= 0 or not self._jobs:
            return
        self.busy_s += elapsed
        for i, job in self._jobs.items():
            job[0] -= elapsed * self._rates.get(i, 0.0)

    def _reschedule(self) -> None:
        self._version += 1
        if not self._jobs:
            self._rates = {}
            return
        self._rates = rates = self._shares()
        job_id = min(self._jobs, key=lambda i: self._jobs[i][0] / rates[i] if rates[i] > 0 else math.inf)
        finish = self.sim.now + max(0.0, self._jobs[job_id][0]) / rates[job_id]
        version = self._version
        self.sim.at(finish, lambda: self._complete(job_id, version))

    def _complete(self, job_id: int, version: int) -> None:
        if version != self._version:
            return  # the job set changed since: a newer completion event stands
        self._advance()
        process = self._jobs.pop(job_id)[2]
        self._rates.pop(job_id, None)
        self._reschedule()
        process.switch()
