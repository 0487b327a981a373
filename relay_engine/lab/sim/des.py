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
stream approximates on an accelerator.
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

    def spawn(self, fn: Callable[..., Any], *args: Any, weight: float = 1.0) -> greenlet.greenlet:
        """Start fn(*args) as a process now (after the current event). ``weight``: its compute weight."""
        g = greenlet.greenlet(lambda: fn(*args), parent=self._loop)
        g.weight = weight
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
    """One instance's compute under weighted processor sharing (work-conserving)."""

    def __init__(self, sim: Simulation, capacity: float = 1.0):
        self.sim = sim
        self.capacity = capacity
        self._jobs: dict[int, list] = {}  # id → [remaining standalone seconds, weight, process]
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
        self._jobs[next(self._ids)] = [work_s, w, me]
        self._reschedule()
        self.sim.block()

    def _advance(self) -> None:
        now = self.sim.now
        elapsed = now - self._updated
        self._updated = now
        if elapsed <= 0 or not self._jobs:
            return
        self.busy_s += elapsed
        total = sum(job[1] for job in self._jobs.values())
        for job in self._jobs.values():
            job[0] -= elapsed * self.capacity * job[1] / total

    def _reschedule(self) -> None:
        self._version += 1
        if not self._jobs:
            return
        total = sum(job[1] for job in self._jobs.values())
        job_id, job = min(self._jobs.items(), key=lambda kv: kv[1][0] / kv[1][1])
        finish = self.sim.now + max(0.0, job[0]) * total / (job[1] * self.capacity)
        version = self._version
        self.sim.at(finish, lambda: self._complete(job_id, version))

    def _complete(self, job_id: int, version: int) -> None:
        if version != self._version:
            return  # the job set changed since: a newer completion event stands
        self._advance()
        _, _, process = self._jobs.pop(job_id)
        self._reschedule()
        process.switch()
