"""Where a ranking request's prefix came from, and the figures every cache tier keeps: the words, once.

``Outcome`` is the one spelling of "served from": ``RankResult.source``, the capture's outcome, the
telemetry counter each outcome is counted in (``OUTCOME_COUNTERS``) and the tier names of the stack
(a tier is named by the outcome of a prefix it served) all come from here; the outcome of a tier under
HBM follows from its registration (``lower_tiers.LOWER_TIERS``), as does ``LOWER_TIER_MODULES``, its
name and the core module that builds it, in lookup order. ``TierCounters`` is the one counter type of
every tier; ``TIER_COUNTERS`` and ``TIER_GAUGES`` name the per-tier figures that flow, generically, to
telemetry and Prometheus. Stdlib only, so the control plane reads these words without loading torch.
"""

from __future__ import annotations

import dataclasses
import enum
from dataclasses import dataclass

from relay_engine.core.lower_tiers import LOWER_TIERS


class _LabelledOutcome(enum.StrEnum):
    """An outcome is a string (``Outcome.HBM == "hbm"``) with how people read it (``label``; the
    browser gets both from the server)."""

    def __new__(cls, value: str, label: str) -> _LabelledOutcome:
        member = str.__new__(cls, value)
        member._value_ = value
        member.label = label
        return member


# Where a ranking request's prefix KV came from: resident in accelerator memory; a pre-inference, a
# recompute or a reload running, joined; each registered lower tier (``Outcome.DRAM``: promoted from host
# memory, ``Outcome.DISK``: from local disk), in lookup order; recomputed by a full forward. A lower tier's
# member follows from its registration, so a new tier adds no line here.
Outcome = _LabelledOutcome("Outcome", [
    ("HBM", ("hbm", "HBM hit")),
    ("INFLIGHT", ("inflight", "joined a computation in flight")),
    *((tier.name.upper(), (tier.name, tier.label)) for tier in LOWER_TIERS),
    ("MISS", ("miss", "miss (recompute)")),
], module=__name__, qualname="Outcome")

# The telemetry counter each outcome is counted in: every ranking lookup is counted once, in one of them.
OUTCOME_COUNTERS: dict[Outcome, str] = {
    Outcome.HBM: "hbm_hits",
    Outcome.INFLIGHT: "inflight_joins",
    **{Outcome(tier.name): f"{tier.name}_hits" for tier in LOWER_TIERS},
    Outcome.MISS: "misses",
}

# The tiers under HBM, in lookup order, each with the core module that builds it from a policy (its
# ``LOWER_TIER``, a ``tiers.LowerTier``); registered in ``lower_tiers.LOWER_TIERS``.
LOWER_TIER_MODULES: dict[Outcome, str] = {Outcome(tier.name): tier.module for tier in LOWER_TIERS}
# Every tier the core can run, in lookup order (HBM, the top tier, is always there).
TIERS: tuple[Outcome, ...] = (Outcome.HBM, *LOWER_TIER_MODULES)
# How people name a tier (a page's column, a chart's legend); one left out is shown by its name.
TIER_LABELS: dict[Outcome, str] = {Outcome.HBM: "HBM", Outcome.DRAM: "DRAM", Outcome.DISK: "local disk"}


@dataclass
class TierCounters:
    """What one cache tier counts (cumulative). Every tier keeps the same type; a figure that does not
    apply to a tier stays 0."""

    hits: int = 0  # lookups that found a live entry
    admissions: int = 0  # entries stored (for a lower tier: demotions into it)
    evictions: int = 0  # entries dropped for space (by the bottom tier: gone for good)
    expirations: int = 0  # entries dropped past their TTL
    rejected: int = 0  # entries that could not fit even after evicting
    failed_writes: int = 0  # stores that failed on the way in (a full disk, pinned memory exhausted)
    corrupt_reads: int = 0  # stored entries that failed their checksum when read back: served as a miss
    peak_bytes: int = 0


# Per-tier figures as telemetry carries them: the counters (cumulative) and the gauges (now).
TIER_COUNTERS: tuple[str, ...] = tuple(f.name for f in dataclasses.fields(TierCounters) if f.name != "peak_bytes")
TIER_GAUGES: tuple[str, ...] = ("bytes", "budget_bytes", "peak_bytes", "entries")
