"""Every instance's counts over a window, from two stream entries each, not the whole stream.

Snapshots are cumulative, so an instance's counts over a window are its newest snapshot less the
last one before the window began (or, for an instance that began within the window, its first one
there). That costs one small read per instance when the window's start moves instead of decoding
every sample, and per poll the newest entry, decoded only if newer than the one already held.
Where the two entries belong to different runs (a restart within the window) or a count went down
(a reset), the difference would be wrong; that instance's window is then summed exactly from its
decoded stream (``history.stream_histories``). The window is cut at its start by the entries'
stream ids, which is Redis's clock.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np
import redis
from django.conf import settings

from relay_engine.core.telemetry import GAUGES
from relay_engine.core.wire import TELEMETRY_TIERS, PoolKeys

from .cache import telemetry_cache
from .history import N_COLUMNS, decode_snapshot, reporting_instances, stream_histories


@dataclass(frozen=True)
class Sample:
    """One decoded stream entry."""

    entry_id: str
    ts: float
    started_at: float
    row: np.ndarray  # cumulative counts [N_COLUMNS]
    gauges: np.ndarray  # [GAUGES]


_SAMPLE_BYTES = (N_COLUMNS + len(GAUGES) + 8) * 8


def _sample(entries: list) -> Sample | None:
    """The first of ``entries`` (an XRANGE answer) decoded, or None (none, or off-contract)."""
    if not entries:
        return None
    entry_id, fields = entries[0]
    try:
        ts, started_at, row, gauges = decode_snapshot(fields["d"])
    except (ValueError, KeyError):
        return None
    return Sample(entry_id, ts, started_at, np.array(row), np.array(gauges))


@dataclass
class Samples:
    """Samples by instance: the newest of each (``latest``), or the entries around a window's start
    (``before`` it and ``first`` in it, for the window beginning at ``start``)."""

    start: float = math.nan
    latest: dict[str, Sample] = field(default_factory=dict)
    before: dict[str, Sample | None] = field(default_factory=dict)
    first: dict[str, Sample | None] = field(default_factory=dict)

    @property
    def nbytes(self) -> int:
        return (len(self.latest) + len(self.before) + len(self.first)) * _SAMPLE_BYTES


@dataclass(frozen=True)
class WindowTotals:
    """Per instance (sorted by name): counts over the window and the newest gauges."""

    names: list[str]
    sums: np.ndarray  # [instances, N_COLUMNS]
    gauges: np.ndarray  # [instances, GAUGES]

    def of(self, instances: list[str]) -> WindowTotals:
        """Only those of ``instances`` held here, still by name."""
        wanted = set(instances)
        kept = [i for i, name in enumerate(self.names) if name in wanted]
        return WindowTotals([self.names[i] for i in kept], self.sums[kept], self.gauges[kept])


def _latest(client: redis.Redis, keys: PoolKeys, tier: str, names: list[str]) -> dict[str, Sample]:
    held = telemetry_cache.get(("latest", settings.REDIS_URL, keys.base, tier), Samples)
    pipe = client.pipeline(transaction=False)
    for name in names:
        known = held.latest.get(name)
        pipe.xrevrange(keys.telemetry(tier, name), max="+", min="-" if known is None else f"({known.entry_id}",
                       count=1)
    for name, entries in zip(names, pipe.execute() if names else [], strict=True):
        sample = _sample(entries)
        if sample is not None:
            held.latest[name] = sample
    for gone in set(held.latest) - set(names):
        del held.latest[gone]
    return held.latest


def _around_start(client: redis.Redis, keys: PoolKeys, tier: str, window_s: int, start: float,
                  names: list[str]) -> Samples:
    held = telemetry_cache.get(("around-start", settings.REDIS_URL, keys.base, tier, window_s), Samples)
    if held.start != start:
        held.start, held.before, held.first = start, {}, {}
    # An instance with no entry before the window is cut at its first entry in the window instead;
    # one with neither yet is asked again next time.
    wanted = [name for name in names if name not in held.before or
              (held.before[name] is None and held.first.get(name) is None)]
    start_ms = int(start * 1000)
    pipe = client.pipeline(transaction=False)
    for name in wanted:
        pipe.xrevrange(keys.telemetry(tier, name), max=str(start_ms - 1), min="-", count=1)
    for name, entries in zip(wanted, pipe.execute() if wanted else [], strict=True):
        held.before[name] = _sample(entries)
    newcomers = [name for name in wanted if held.before[name] is None]
    for name in newcomers:
        pipe.xrange(keys.telemetry(tier, name), min=str(start_ms), max="+", count=1)
    for name, entries in zip(newcomers, pipe.execute() if newcomers else [], strict=True):
        held.first[name] = _sample(entries)
    return held


def window_totals(client: redis.Redis, *, pool: str, tier: str, window_s: int, start: float,
                  now: float) -> WindowTotals:
    """Counts of every instance that reported since ``start``, over [start, now]. The caller holds
    ``telemetry_cache.lock``."""
    keys = PoolKeys(pool)
    step_s = TELEMETRY_TIERS[tier][0]
    names = reporting_instances(client, keys, start)
    latest = _latest(client, keys, tier, names)
    around = _around_start(client, keys, tier, window_s, start, names)
    kept, sums, gauges, exact_later = [], [], [], []
    for name in names:
        last = latest.get(name)
        if last is None:
            continue
        base, fresh_run = around.before.get(name), False
        if base is None:
            base = around.first.get(name)
            if base is None:
                continue  # nothing of this instance in the window yet
            # The window's first sample is itself counted when its run began within it.
            fresh_run = base.ts - base.started_at <= 2 * step_s
        difference = last.row - base.row
        if base.started_at != last.started_at or (difference < 0).any():
            exact_later.append(len(kept))  # a restart or a reset in the window
        kept.append(name)
        sums.append(difference + base.row if fresh_run else difference)
        gauges.append(last.gauges)
    sums_all = np.array(sums) if sums else np.zeros((0, N_COLUMNS))
    if exact_later:
        histories = stream_histories(client, pool=pool, tier=tier, instances=[kept[i] for i in exact_later],
                                     window_s=window_s, now=now)
        for i, history in zip(exact_later, histories, strict=True):
            first = int(np.searchsorted(history.ts, start))
            sums_all[i] = history.totals[-1] - history.totals[first]
    return WindowTotals(kept, sums_all, np.array(gauges) if gauges else np.zeros((0, len(GAUGES))))
