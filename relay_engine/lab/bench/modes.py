"""The modes the benchmark and the simulator compare, and the regime (time constants, budgets) they
all run under.

``baseline`` ranks with ``rank_full`` and no cache. The relay modes run ``RelayEngine``:
``relay`` (trigger + affinity router + HBM tier + DRAM expander), and the ablations
``relay_cache_only`` (no pre-inference: a miss keeps its prefix for the user's next request, so
this is what caching alone buys), ``relay_no_dram`` (DRAM budget 0), ``relay_random_route``
(pre-infer signal and ranking routed independently at random), ``relay_preinfer_all`` (the
trigger admits every length; budgets still apply), and a pair that measures the local-disk tier side by
side: ``relay_small_dram`` (an eighth of the DRAM budget) and ``relay_disk`` (the same small DRAM with
the disk tier under it).
"""

from __future__ import annotations

import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

from relay_engine.core.config import CacheBudget, LatencyModel, PolicySpec, TriggerPolicy, tier_policy_type
from relay_engine.core.engine import DeadlineExceeded, Forwards, RankRequest

SMALL_DRAM_SHARE = 1 / 8


@dataclass(frozen=True)
class Mode:
    name: str
    relay: bool = True
    preinfer: bool = True  # pre-infer signals are sent
    dram: bool = True
    affinity: bool = True
    admit_all: bool = False
    dram_share: float = 1.0  # of the regime's DRAM budget
    disk: bool = False  # the local-disk tier under DRAM
    what: str = ""
    against: str | None = None  # the mode an ablation's SLO throughput is divided by, side by side


MODES: tuple[Mode, ...] = (
    Mode("baseline", relay=False, preinfer=False, what="no pre-inference, no cache; ranking runs rank_full"),
    Mode("relay", what="trigger + affinity router + HBM tier + DRAM expander"),
    Mode("relay_cache_only", preinfer=False, what="relay's caches without pre-inference (a miss keeps its prefix)"),
    Mode("relay_no_dram", dram=False, what="relay without the DRAM tier"),
    Mode("relay_random_route", affinity=False, what="relay, pre-infer signal and ranking routed at random"),
    Mode("relay_preinfer_all", admit_all=True, what="relay, the trigger admits every prefix"),
    Mode("relay_small_dram", dram_share=SMALL_DRAM_SHARE, what="relay with an eighth of the DRAM budget"),
    Mode("relay_disk", dram_share=SMALL_DRAM_SHARE, disk=True, against="relay_small_dram",
         what="relay with an eighth of the DRAM budget and the local-disk tier under it"),
)
MODES_BY_NAME = {m.name: m for m in MODES}


@dataclass(frozen=True)
class Regime:
    """What every mode runs under, in this device's milliseconds (already × the time scale K)."""

    slo_ms: float
    deadline_ms: float
    time_scale: float = 1.0  # K: every time constant of the trace (and the caches' TTLs) × K
    hbm_budget_mb: float = CacheBudget().hbm_budget_mb
    dram_budget_mb: float = CacheBudget().dram_budget_mb
    entry_ttl_ms: float = CacheBudget().entry_ttl_ms
    dram_ttl_ms: float = CacheBudget().dram_ttl_ms
    # Full inference on this device; the trigger derives its at-risk length from it, under load.
    latency_model: LatencyModel | None = None
    at_risk_seq_len: int | None = None  # a fixed threshold instead (None: derived)
    preinfer_compute_share: float = TriggerPolicy().preinfer_compute_share
    max_preinfer_inflight: int = TriggerPolicy().max_preinfer_inflight
    # The disk tier of the modes that have one: each instance keeps its files in its own subdirectory.
    disk_path: str = str(Path(tempfile.gettempdir()) / "relaygr-bench-disk")
    disk_budget_mb: float = CacheBudget().dram_budget_mb  # small DRAM + disk hold what relay's DRAM does

    def scaled(self, k: float) -> Regime:
        """The same regime on a device k times slower: every time constant × k."""
        return replace(self, slo_ms=self.slo_ms * k, deadline_ms=self.deadline_ms * k,
                       time_scale=self.time_scale * k, entry_ttl_ms=self.entry_ttl_ms * k,
                       dram_ttl_ms=self.dram_ttl_ms * k)


def mode_policy(mode: Mode, regime: Regime) -> PolicySpec | None:
    """The policy a relay mode's instances run (None for the baseline)."""
    if not mode.relay:
        return None
    derived = regime.at_risk_seq_len is None and regime.latency_model is not None
    trigger = TriggerPolicy(
        at_risk_seq_len=None if derived else (regime.at_risk_seq_len or TriggerPolicy().at_risk_seq_len),
        latency_model=regime.latency_model, admit_all=mode.admit_all,
        max_preinfer_inflight=regime.max_preinfer_inflight if mode.preinfer else 0,
        ranking_p99_slo_ms=regime.slo_ms, preinfer_compute_share=regime.preinfer_compute_share)
    dram_ttl_ms = max(1, round(regime.dram_ttl_ms))
    disk = tier_policy_type("disk")(regime.disk_path, regime.disk_budget_mb, dram_ttl_ms) if mode.disk else None
    cache = CacheBudget(hbm_budget_mb=regime.hbm_budget_mb,
                        dram_budget_mb=regime.dram_budget_mb * mode.dram_share if mode.dram else 0.0,
                        entry_ttl_ms=max(1, round(regime.entry_ttl_ms)), dram_ttl_ms=dram_ttl_ms, disk=disk)
    return PolicySpec(trigger=trigger, cache=cache)


def served_policy(mode: Mode, regime: Regime) -> PolicySpec:
    """The policy a worker pool runs for a mode (the product path): the relay modes' ``mode_policy``;
    the baseline's is no cache and no pre-inference (every ranking request a full forward), at the
    regime's SLO."""
    relay = mode_policy(mode, regime)
    if relay is not None:
        return relay
    return PolicySpec(trigger=TriggerPolicy(max_preinfer_inflight=0, ranking_p99_slo_ms=regime.slo_ms),
                      cache=CacheBudget(enabled=False))


class FullInference:
    """The baseline's ranking: ``rank_full`` with the engine's deadline semantics, and no cache."""

    def __init__(self, forwards: Forwards, wall_clock: Callable[[], float] = time.monotonic):
        self.forwards = forwards
        self.wall_clock = wall_clock

    def rank(self, request: RankRequest) -> str:
        if request.deadline_s is not None and self.wall_clock() > request.deadline_s:
            raise DeadlineExceeded("on arrival")
        scores = self.forwards.rank_full(request.prefix, request.short_term, request.candidates)
        scores.tolist()
        if request.deadline_s is not None and self.wall_clock() > request.deadline_s:
            raise DeadlineExceeded("after scoring")
        return "full"
