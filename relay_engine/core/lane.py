"""The pre-inference lane: admitted prefills run here, on their own thread with their own share of
the instance's compute, never on the threads ranking runs on.

A work-conserving priority, not a partition: alone, a prefill takes the whole device; while ranking
also runs, pre-inference gets ``share`` of it and ranking the rest, so a backlog of prefills slows
ranking by at most 1 / (1 − share). On the CPU the share is the lane thread's scheduling weight
against ranking's (Linux CFS weighs nice n as 1024 / 1.25ⁿ, nice 0 as 1024: a share of 0.25 is
nice 5); a thread may raise its own nice but not lower it, so a larger share starts a fresh thread.
On CUDA the lane queues on the lowest-priority stream (strict priority there: the share is not
exact). Where the lane and ranking do not share a core, the engine's ``RankingGate`` keeps the
share at the prefill's yield points instead: between its layers and a layer's steps, and before each
of its torch operations (``YieldEveryOp``), paid in whole quanta (``SharePacer``). The fleet simulator replaces the lane with one on its
virtual clock (``Lane`` protocol).
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import time
from collections.abc import Callable
from typing import Protocol

import torch
from torch.overrides import TorchFunctionMode

from relay_engine.core import devices

log = logging.getLogger(__name__)

# Linux CFS load weights of nice 0 … 19 (kernel/sched/core.c, sched_prio_to_weight).
_CFS_WEIGHTS = (1024, 820, 655, 526, 423, 335, 272, 215, 172, 137, 110, 87, 70, 56, 45, 36, 29, 23, 18, 15)


def share_of_nice(nice: int) -> float:
    """Compute share a thread at ``nice`` gets against one busy thread at nice 0."""
    w = _CFS_WEIGHTS[nice]
    return w / (w + _CFS_WEIGHTS[0])


def nice_for_share(share: float) -> int:
    """The nice value (0 … 19) whose share against a nice-0 thread is closest to ``share``; shares of
    a half or more are nice 0 (a lower nice would need privileges)."""
    return min(range(len(_CFS_WEIGHTS)), key=lambda n: abs(share_of_nice(n) - share))


# The least CPU a paced thread runs for, once its share lets it run while ranking is under way: it
# comes back in whole quanta, not a few microseconds at a time. In one process every resumption is an
# interpreter-lock hand-off that the rank thread pays for (a futex wake and a wait to be scheduled):
# paced op by op at a share of 0.25, a rank saw ~11 hand-offs and 2.2× its P99 (bench_roundtrip,
# steady backlog); a rank shorter than a quantum at the share now runs with pre-inference paused.
QUANTUM_S = 0.005


class ShareAccount:
    """The compute credit that all of one instance's pre-inference threads draw on: earned at ``share``
    of the wall time while requests are being ranked, spent by each thread's own CPU time, capped at a
    quantum. One account, not one per thread: the lane's prefills and the signal reader each paced at
    the share on their own took up to twice it between them (bench_roundtrip's steady backlog: the
    lane used its 25 %, the reader ~17 %, and ranking P99 rose by ~1 ÷ (1 − 0.42) ≈ 1.7×)."""

    def __init__(self, share: float, *, quantum_s: float = QUANTUM_S, now_s: float = 0.0):
        self.share, self.quantum_s = share, quantum_s
        self.credit_s = 0.0
        self._earned_to_s = now_s  # wall time up to which the share has been credited
        self._lock = threading.Lock()

    def spend(self, spent_s: float, ranking: bool, now_s: float, busy_since_s: float | None) -> float | None:
        """Debit ``spent_s`` of a thread's CPU time at wall time ``now_s``; returns how long that thread
        must wait for a quantum to be due again (``inf`` at share 0), or None when it may go on."""
        with self._lock:
            if not ranking:
                self.credit_s, self._earned_to_s = 0.0, now_s
                return None
            # Credit is earned in the busy period only (``busy_since_s``: when it began), not over time
            # before it, blocked or not.
            since_s = self._earned_to_s if busy_since_s is None else max(self._earned_to_s, busy_since_s)
            self.credit_s = min(self.quantum_s, self.credit_s + self.share * max(0.0, now_s - since_s) - spent_s)
            self._earned_to_s = max(self._earned_to_s, now_s)
            if self.credit_s >= 0:
                return None
            return (self.quantum_s - self.credit_s) / self.share if self.share > 0 else float("inf")

    def resumed(self, idle: bool, now_s: float) -> None:
        """A thread's wait is over: ranking ended (``idle``: the busy period's credit goes) or a quantum
        is due (it runs that quantum now; threads that wake together share it)."""
        with self._lock:
            self.credit_s = 0.0 if idle else self.quantum_s
            self._earned_to_s = max(self._earned_to_s, now_s)


class SharePacer:
    """The yield points of one pre-inference thread: call it often (between a prefill's layers and
    steps, before each of its torch operations, between signals). While ``ranking()`` says requests
    are being ranked, the thread's ``account`` earns ``share`` of the wall time as CPU credit and the
    thread spends its own CPU time (``cpu``: the calling thread's) from it; when the credit runs out
    it waits until ranking ends (``wait_idle(timeout_s)`` → True) or until the credit is back to a
    quantum (→ False), then runs that quantum at once. Alone, it never waits and earns nothing: a busy
    period starts from zero, so beside a rank pre-inference runs only as far as the share the busy
    period has earned it, and a long rank still leaves pre-inference its share (work-conserving
    priority). Pacers that share an account (an instance's lane and signal reader,
    ``RankingGate.pacer``) share the share; without one, a pacer has an account of its own."""

    def __init__(self, share: float, ranking: Callable[[], bool], wait_idle: Callable[[float | None], bool], *,
                 wall: Callable[[], float] = time.perf_counter, cpu: Callable[[], float] = time.thread_time,
                 busy_since: Callable[[], float] | None = None, quantum_s: float = QUANTUM_S,
                 account: ShareAccount | None = None):
        self.ranking, self.wait_idle = ranking, wait_idle
        self.wall, self.cpu, self.busy_since = wall, cpu, busy_since
        self.account = account if account is not None else ShareAccount(share, quantum_s=quantum_s, now_s=wall())
        self._cpu_s = cpu()

    @property
    def share(self) -> float:
        return self.account.share

    @property
    def credit_s(self) -> float:
        return self.account.credit_s

    def __call__(self) -> None:
        cpu_s = self.cpu()
        spent_s, self._cpu_s = cpu_s - self._cpu_s, cpu_s
        busy_since = None if self.busy_since is None else self.busy_since()
        wait_s = self.account.spend(spent_s, self.ranking(), self.wall(), busy_since)
        if wait_s is None:
            return
        idle = self.wait_idle(None if wait_s == float("inf") else wait_s)
        self.account.resumed(idle, self.wall())
        self._cpu_s = self.cpu()


class YieldEveryOp(TorchFunctionMode):
    """Inside it (on the thread that enters it: torch keeps function modes per thread), every torch
    operation is first a yield point of ``pacer`` while ``ranking()``: a prefill stops before its next
    operation when a rank starts, not at the end of its current step. Each operation costs one call
    and, while nothing ranks, one test."""

    def __init__(self, pacer: Callable[[], None], ranking: Callable[[], bool]):
        super().__init__()
        self.pacer, self.ranking = pacer, ranking

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if self.ranking():
            self.pacer()
        return func(*args, **(kwargs or {}))


class Lane(Protocol):
    def submit(self, job: Callable[[], None]) -> None:
        """Run job later, on the lane; job handles its own errors."""

    def set_share(self, share: float) -> None:
        """The compute share for jobs from now on."""

    def close(self) -> None:
        """Finish the queued jobs and stop."""


class PreInferLane:
    """One thread (started on the first job) running jobs in arrival order at the lane's share."""

    def __init__(self, device: torch.device, share: float, name: str = "preinfer"):
        self.device = device
        self.name = name
        self._share = share
        self._nice = nice_for_share(share)
        self._lock = threading.Lock()
        self._jobs: queue.SimpleQueue[Callable[[], None] | None] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._retired: list[threading.Thread] = []  # earlier threads finishing the jobs queued to them

    @property
    def share(self) -> float:
        return self._share

    def submit(self, job: Callable[[], None]) -> None:
        with self._lock:
            if self._thread is None:
                self._start()
            self._jobs.put(job)

    def set_share(self, share: float) -> None:
        with self._lock:
            self._share = share
            nice = nice_for_share(share)
            lowering = nice < self._nice
            self._nice = nice
            if self._thread is not None and lowering:
                # The running thread cannot lower its own nice: it finishes the jobs queued to it and
                # stops; a fresh one (created by this thread, at its priority) takes the new jobs.
                self._jobs.put(None)
                self._retired = [t for t in self._retired if t.is_alive()] + [self._thread]
                self._jobs = queue.SimpleQueue()
                self._start()

    def _start(self) -> None:
        self._thread = threading.Thread(target=self._run, args=(self._jobs, self._nice), name=self.name,
                                        daemon=True)
        self._thread.start()

    def _run(self, jobs: queue.SimpleQueue, nice: int) -> None:
        applied = self._apply_nice(nice)
        with devices.low_priority_stream(self.device):
            while (job := jobs.get()) is not None:
                if jobs is self._jobs and applied != self._nice:  # a retired thread keeps its nice
                    applied = self._apply_nice(self._nice)
                try:
                    job()
                except Exception:  # noqa: BLE001 — a failed job is the job's to report; the lane lives on
                    log.exception("%s: a pre-inference job failed", self.name)

    def _apply_nice(self, nice: int) -> int:
        """Set this thread's nice (tried once per value: a refusal is logged, not retried per job)."""
        if self.device.type == "cpu" and hasattr(os, "setpriority"):
            try:
                os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), nice)
            except OSError as exc:  # not permitted (lowering), or no per-thread priorities here
                log.warning("%s: cannot set nice %d (%s); pre-inference keeps its priority", self.name, nice, exc)
        return nice

    def close(self) -> None:
        """Finish every queued job and stop the lane's threads."""
        with self._lock:
            threads = self._retired + ([self._thread] if self._thread is not None else [])
            if self._thread is not None:
                self._jobs.put(None)
            self._thread, self._retired = None, []
            self._jobs = queue.SimpleQueue()
        for thread in threads:
            thread.join(30)
