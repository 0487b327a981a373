"""The engine's seams on the virtual clock: forward passes that cost time instead of computing, a KV
that has a size but no storage, and a pre-inference lane that runs on the instance's shared compute.
"""

from __future__ import annotations

import math
import random
from collections import deque
from collections.abc import Callable

import greenlet
import torch

from relay_engine.core.lane import nice_for_share, share_of_nice
from relay_engine.core.model import EditTensors, History, ModelConfig, PrefixKV
from relay_engine.lab.costmodel import CostModel
from relay_engine.lab.sim.des import SharedCompute, Simulation


class VirtualPrefixKV(PrefixKV):
    """A prefix KV with the real shape and byte size but no storage (a ``meta`` tensor): the tiers
    account for it exactly; moving it between tiers is free."""

    def to(self, device: torch.device, *, pin: bool = False, non_blocking: bool = False) -> PrefixKV:
        return self


def lane_weight(share: float, device_type: str) -> float:
    """The pre-inference lane's processor-sharing weight against a ranking job of weight 1. On a CPU
    the share the lane really gets is its nice value's (``lane.nice_for_share``)."""
    if device_type == "cpu":
        share = share_of_nice(nice_for_share(share))
    return 1e9 if share >= 1 else share / (1 - share)


class CostForwards:
    """``engine.Forwards`` from a cost model: each pass takes its modelled time on the instance's
    compute (at the calling process's weight) and returns placeholder scores / a virtual KV.

    Where the cost model states an operation's dispersion (the coefficient of variation its forwards
    measured), each pass's time is its mean × a log-normal factor of mean 1 and that coefficient of
    variation, drawn from ``rng`` (seeded: a replay is repeatable); else exactly its mean. Where it also
    states a drift (``CostModel.drift``), part of that factor's log variance is this instance's slow
    speed, an Ornstein-Uhlenbeck process on the virtual clock that all its forwards share (so slow
    forwards come in runs, as on a real host), and only the rest is drawn per forward."""

    def __init__(self, cost: CostModel, compute: SharedCompute, config: ModelConfig, model_version: str,
                 rng: random.Random | None = None):
        self.cost = cost
        self.compute = compute
        self.config = config
        self.model_version = model_version
        self._scores: dict[int, torch.Tensor] = {}
        self._rng = rng or random.Random(0)
        # op → (mu, sigma) of the log of the factor
        self._lognormal = {op: (-math.log1p(cv * cv) / 2, math.sqrt(math.log1p(cv * cv)))
                           for op, cv in cost.dispersion.items() if cv > 0}
        # A process's forwards while something watches it (``watch``): [standalone s, elapsed s].
        self._spent: dict[greenlet.greenlet, list[float]] = {}
        self._drift = cost.drift
        self._slow: tuple[float, float] | None = None  # (virtual time, log speed) of the last draw

    def _factor(self, op: str) -> float:
        """One forward's time factor (mean 1): slow drift × its own dispersion."""
        spread = self._lognormal.get(op)
        if spread is None:
            return 1.0
        if self._drift is None:
            return self._rng.lognormvariate(*spread)
        total = spread[1] ** 2  # the log variance the operation's CV states
        slow_var = min(self._drift.variance, total)
        now = self.compute.sim.now
        if self._slow is None:
            y = self._rng.gauss(0.0, math.sqrt(self._drift.variance))
        else:
            keep = math.exp(-max(0.0, now - self._slow[0]) / self._drift.tau_s)
            y = self._slow[1] * keep + self._rng.gauss(0.0, math.sqrt(self._drift.variance * (1 - keep * keep)))
        self._slow = (now, y)
        # This operation's share of the slow factor: scaled so it never exceeds the operation's own spread.
        slow = y * math.sqrt(slow_var / self._drift.variance) if self._drift.variance > 0 else 0.0
        fast_var = total - slow_var
        return math.exp(slow + self._rng.gauss(0.0, math.sqrt(fast_var)) - (slow_var + fast_var) / 2)

    def watch(self) -> list[float]:
        """From now on, the calling process's forwards add their standalone time and the time they took
        on the shared compute to the returned pair (until ``unwatch``)."""
        spent = self._spent[greenlet.getcurrent()] = [0.0, 0.0]
        return spent

    def unwatch(self) -> None:
        self._spent.pop(greenlet.getcurrent(), None)

    def _run(self, op: str, ms: float) -> None:
        ms *= self._factor(op)
        spent = self._spent.get(greenlet.getcurrent())
        if spent is None:
            self.compute.run(ms / 1000)
            return
        started = self.compute.sim.now
        self.compute.run(ms / 1000)
        spent[0] += ms / 1000
        spent[1] += self.compute.sim.now - started

    def virtual_kv(self, length: int, edit: EditTensors | None = None) -> VirtualPrefixKV:
        c = self.config
        kv = torch.empty((c.num_layers, 2, c.num_heads, length, c.head_dim), device="meta")
        return VirtualPrefixKV(kv, None, length, self.model_version, "none" if edit is None else edit.content_hash)

    def _placeholder_scores(self, n: int) -> torch.Tensor:
        if n not in self._scores:
            self._scores[n] = torch.zeros(n)
        return self._scores[n]

    def prefill(self, prefix: History, edit: EditTensors | None = None, *,
                between_layers: Callable[[], None] | None = None) -> PrefixKV:
        self._run("prefill", self.cost.prefill_ms(len(prefix)))
        return self.virtual_kv(len(prefix), edit)

    def rank(self, prefix_kv: PrefixKV, short_term: History, candidates: torch.Tensor,
             query_timestamp: int | None = None, edit: EditTensors | None = None) -> torch.Tensor:
        c = int(torch.as_tensor(candidates).numel())
        self._run("rank", self.cost.rank_ms(prefix_kv.length, len(short_term), c))
        return self._placeholder_scores(c)

    def rank_full(self, prefix: History, short_term: History, candidates: torch.Tensor,
                  query_timestamp: int | None = None, edit: EditTensors | None = None) -> torch.Tensor:
        c = int(torch.as_tensor(candidates).numel())
        self._run("rank_full", self.cost.rank_full_ms(len(prefix), len(short_term), c))
        return self._placeholder_scores(c)

    def rank_full_keeping_prefix(self, prefix: History, short_term: History, candidates: torch.Tensor,
                                 query_timestamp: int | None = None,
                                 edit: EditTensors | None = None) -> tuple[torch.Tensor, PrefixKV]:
        return self.rank_full(prefix, short_term, candidates, query_timestamp, edit), self.virtual_kv(len(prefix), edit)


class VirtualLane:
    """``lane.Lane`` on the virtual clock: one process runs the jobs in order at the lane's weight,
    paced to its share while its instance (``group``) ranks, as ``engine.RankingGate`` paces it."""

    def __init__(self, sim: Simulation, device_type: str, share: float, group: object = None):
        self.sim = sim
        self.device_type = device_type
        self.group = group
        self.share = share
        self.weight = lane_weight(share, device_type)
        self._jobs: deque[Callable[[], None]] = deque()
        self._running = False
        self._process = None

    def submit(self, job: Callable[[], None]) -> None:
        self._jobs.append(job)
        if not self._running:
            self._running = True
            self._process = self.sim.spawn(self._drain, weight=self.weight, group=self.group,
                                           paced=self.share if self.share < 1 else None)

    def _drain(self) -> None:
        while self._jobs:
            self._jobs.popleft()()
        self._running = False

    def set_share(self, share: float) -> None:
        self.share = share
        self.weight = lane_weight(share, self.device_type)
        if self._running and self._process is not None:  # from the running drain's next forward on
            self._process.weight, self._process.paced = self.weight, share if share < 1 else None

    def close(self) -> None:
        pass

    @property
    def queued(self) -> int:
        return len(self._jobs)
