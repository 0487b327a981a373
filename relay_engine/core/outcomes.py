"""Where a ranking request's prefix came from, and the figures every cache tier keeps: the words, once.

``Outcome`` is the one spelling of "served from": ``RankResult.source``, the capture's outcome, the
telemetry counter each outcome is counted in (``OUTCOME_COUNTERS``) and the tier names of the stack
(a tier is named by the outcome of a prefix it served) all come from here. ``TierCounters`` is the
one counter type of every tier; ``TIER_COUNTERS`` and ``TIER_GAUGES`` name the per-tier figures that
flow, generically, to telemetry and Prometheus. Stdlib only, so the control plane reads these words
without loading torch.
"""

from __future__ import annotations

import dataclasses
import enum
from dataclasses import dataclass


class Outcome(enum.StrEnum):
    """Where a ranking request's prefix KV came from (a string: ``Outcome.HBM == "hbm"``)."""

    HBM = "hbm"  # resident in accelerator memory
    INFLIGHT = "inflight"  # joined a pre-inference, a recompute or a reload already running
    DRAM = "dram"  # promoted from host memory
    DISK = "disk"  # promoted from local disk
    MISS = "miss"  # recomputed by a full forward


# The telemetry counter each outcome is counted in: every ranking lookup is counted once, in one of them.
OUTCOME_COUNTERS: dict[Outcome, str] = {
    Outcome.HBM: "hbm_hits",
    Outcome.INFLIGHT: "inflight_joins",
    Outcome.DRAM: "dram_hits",
    Outcome.DISK: "disk_hits",
    Outcome.MISS: "misses",
}


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
