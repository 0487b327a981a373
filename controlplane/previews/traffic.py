"""The read side of the traffic capture: a window of the pool's stream, its summary, its trace.

The workers append one ``capture.CaptureRecord`` per ranking request to ``PoolKeys.traffic`` (entry
ids are their unix ms, so a time window is an ``XRANGE``). Redis is untrusted input: a record that
breaks the contract (a field ``CaptureRecord.from_fields`` refuses, or a time of its own far from
its entry's) is skipped and counted (``CaptureWindow.bad``), and a count in the dropped-records hash
that is not one is reported for its instance (``CaptureExtent.unreadable``); never a 500.
"""

from __future__ import annotations

import math
import re
import statistics
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field

import redis

from controlplane.common.errors import InvalidInput
from controlplane.common.redis import get_redis, redis_unreachable
from controlplane.fleet import selectors as fleet_selectors
from controlplane.policies.models import Pool
from relay_engine.core import fields
from relay_engine.core.capture import (
    CAPTURE_MAX_AGE_S,
    SERVED_OUTCOMES,
    CaptureError,
    CaptureRecord,
    to_trace,
)
from relay_engine.core.outcomes import Outcome
from relay_engine.core.wire import PoolKeys

MIN_WINDOW_S = 60
MAX_WINDOW_S = int(CAPTURE_MAX_AGE_S)  # the capture keeps no more
DEFAULT_WINDOW = "15m"
_WINDOW_RE = re.compile(r"^\s*(\d{1,6})\s*([smh])\s*$")
_UNIT_S = {"s": 1, "m": 60, "h": 3600}
_READ_BATCH = 10_000
# A record is written moments after its request arrived (the capture's queue, a batch): one whose own
# time is further than this from its stream entry's is off-contract, and would stretch a trace
# exported from the window beyond what a trace can hold.
MAX_RECORD_SKEW_S = 60.0
MAX_DROPPED = 2**53  # a count of dropped records, per instance (HINCRBY's range, exact in a float)
MAX_REPORTED = 10  # unreadable dropped counts named in a summary (the rest are counted)
_SHOW_NAME_CHARS = 80


def parse_window(text: object, field_name: str = "window") -> int:
    """"15m", "90s", "1h" → seconds, within 1m..1h; InvalidInput naming the field and the range."""
    match = _WINDOW_RE.match(text) if isinstance(text, str) else None
    seconds = int(match.group(1)) * _UNIT_S[match.group(2)] if match else None
    if seconds is None or not MIN_WINDOW_S <= seconds <= MAX_WINDOW_S:
        message = (f"must be a duration from 1m to 1h (a number and s, m or h, e.g. 15m or 90s), "
                   f"got {str(text)[:40]!r}")
        raise InvalidInput(f"{field_name}: {message}", {field_name: [message]})
    return seconds


def window_label(seconds: int) -> str:
    if seconds % 3600 == 0:
        return f"{seconds // 3600}h"
    return f"{seconds // 60}m" if seconds % 60 == 0 else f"{seconds}s"


@dataclass
class CaptureWindow:
    start_s: float
    end_s: float
    records: list[CaptureRecord] = field(default_factory=list)
    bad: int = 0  # entries that broke the record contract (skipped)


def _entries(client: redis.Redis, key: str, start_ms: int, end_ms: int) -> Iterator[tuple[str, dict]]:
    lower = f"{start_ms}-0"
    while True:
        batch = client.xrange(key, min=lower, max=f"{end_ms}-18446744073709551615", count=_READ_BATCH)
        yield from batch
        if len(batch) < _READ_BATCH:
            return
        lower = f"({batch[-1][0]}"


def read_window(*, pool: str, window_s: int, end_s: float | None = None) -> CaptureWindow:
    """The records of the pool's capture in (end − window, end]."""
    end_s = time.time() if end_s is None else end_s
    window = CaptureWindow(start_s=end_s - window_s, end_s=end_s)
    try:
        for entry_id, data in _entries(get_redis(), PoolKeys(pool).traffic, int(window.start_s * 1000),
                                       int(end_s * 1000)):
            try:
                record = CaptureRecord.from_fields(data)
            except CaptureError:
                window.bad += 1
                continue
            if abs(record.ts_ms - int(entry_id.split("-", 1)[0])) > MAX_RECORD_SKEW_S * 1000:
                window.bad += 1
                continue
            window.records.append(record)
    except redis.RedisError as exc:
        raise redis_unreachable(exc) from exc
    return window


def has_traffic(*, pool: str, start_s: float, end_s: float) -> bool:
    try:
        return bool(get_redis().xrange(PoolKeys(pool).traffic, min=f"{int(start_s * 1000)}-0",
                                       max=f"{int(end_s * 1000)}-18446744073709551615", count=1))
    except redis.RedisError as exc:
        raise redis_unreachable(exc) from exc


@dataclass(frozen=True)
class CaptureExtent:
    """What the pool's capture holds at all: how many records, from when to when (unix s), and how many
    its instances dropped; ``unreadable``: instance → why its dropped count could not be read."""

    records: int
    oldest_s: float | None
    newest_s: float | None
    dropped: int
    unreadable: dict[str, str] = field(default_factory=dict)

    def describe(self, now: float) -> str:
        if not self.records:
            return "the capture holds no traffic of this pool at all"
        return (f"the capture holds {self.records} requests, from {now - self.oldest_s:.0f} s to "
                f"{now - self.newest_s:.0f} s ago")


def capture_extent(*, pool: str) -> CaptureExtent:
    keys = PoolKeys(pool)
    try:
        pipe = get_redis().pipeline(transaction=False)
        pipe.xlen(keys.traffic)
        pipe.xrange(keys.traffic, count=1)
        pipe.xrevrange(keys.traffic, count=1)
        pipe.hgetall(keys.traffic_dropped)
        length, first, last, dropped = pipe.execute()
    except redis.RedisError as exc:
        raise redis_unreachable(exc) from exc

    def entry_s(entries: list) -> float | None:
        return int(entries[0][0].split("-")[0]) / 1000 if entries else None

    total, unreadable = _dropped_counts(dropped)
    return CaptureExtent(records=int(length), oldest_s=entry_s(first), newest_s=entry_s(last), dropped=total,
                         unreadable=unreadable)


def _dropped_counts(by_instance: dict[str, str]) -> tuple[int, dict[str, str]]:
    """The sum of the readable counts of the dropped-records hash, and why the others are not (for at
    most ``MAX_REPORTED`` instances, then how many more)."""
    total, unreadable, more = 0, {}, 0
    for instance, raw in by_instance.items():
        try:
            total += int(fields.number_text(raw, 0, MAX_DROPPED, as_int=True))
        except fields.FieldValueError as exc:
            if len(unreadable) < MAX_REPORTED:
                unreadable[instance[:_SHOW_NAME_CHARS]] = f"dropped count {exc}"
            else:
                more += 1
    if more:
        unreadable["…"] = f"{more} more instances with an unreadable dropped count"
    return total, unreadable


def capture_off(*, pool: Pool) -> dict[str, str]:
    """Live instances that record no traffic, and why (their own status says: no capture secret)."""
    return {view.instance: view.status.capture_off for view in fleet_selectors.pool_status(pool=pool).instances
            if view.live and view.status.capture_off}


def _percentile(sorted_values: list[float], q: float) -> float | None:
    """Nearest-rank percentile of sorted values (None when there are none)."""
    if not sorted_values:
        return None
    rank = max(1, -(-len(sorted_values) * q // 1))
    return sorted_values[int(rank) - 1]


def _percentile_interval(sorted_values: list[float], q: float, z: float = 1.96) -> list[float] | None:
    """A distribution-free 95 % interval of the q-quantile of sorted values: the order statistics at
    ranks n·q ∓ z·√(n·q·(1 − q)) (the binomial count of values below the quantile); None when one end
    falls outside the sample (too few values for the quantile)."""
    n = len(sorted_values)
    half = z * math.sqrt(n * q * (1 - q))
    lo, hi = math.floor(n * q - half), math.ceil(n * q + half)
    if n == 0 or lo < 1 or hi > n:
        return None
    return [sorted_values[lo - 1], sorted_values[hi - 1]]


def summary(window: CaptureWindow, window_s: int, extent: CaptureExtent | None = None,
            slo_ms: float | None = None, off: dict[str, str] | None = None) -> dict:
    """The window's shape: volume and rate, length percentiles, repeat users, outcomes; and what the
    instances measured: latency percentiles, the share within ``slo_ms`` (a failed request is not
    within it) and the hit ratio (served from HBM, DRAM or a computation in flight); ``off``: the
    live instances that capture nothing, and why (``capture_off``)."""
    records = window.records
    prefix = sorted(r.prefix_len for r in records)
    users = Counter(r.user for r in records)
    repeats = sum(n for n in users.values() if n > 1)
    gaps = [r.gap_ms for r in records if r.gap_ms is not None]
    out = {
        "requests": len(records),
        "rate_qps": round(len(records) / window_s, 3),
        "window": window_label(window_s),
        "from": window.start_s,
        "to": window.end_s,
        "prefix_len": {"p50": _percentile(prefix, 0.5), "p90": _percentile(prefix, 0.9),
                       "p99": _percentile(prefix, 0.99)},
        "short_len_median": statistics.median(r.short_len for r in records) if records else None,
        "candidates_median": statistics.median(r.candidates for r in records) if records else None,
        "gap_ms_median": round(statistics.median(gaps), 3) if gaps else None,
        "users": len(users),
        # requests whose user asked more than once in the window (what a cache can reuse)
        "repeat_user_share": round(repeats / len(records), 4) if records else None,
        "outcomes": dict(sorted(Counter(r.outcome for r in records).items())),
        "skipped_records": window.bad,
    }
    served = [r for r in records if r.outcome in SERVED_OUTCOMES]
    latency = sorted(r.latency_ms for r in served)
    # The P99's own 95 % interval from the window's requests alone (the sampling error a prediction
    # is measured against: ~±15-25 % for 7,000 requests of a long-tailed window).
    out["latency_ms"] = {"p50": _percentile(latency, 0.5), "p99": _percentile(latency, 0.99),
                         "p99_interval": _percentile_interval(latency, 0.99)}
    out["slo_ms"] = slo_ms
    out["within_slo_share"] = (round(sum(r.latency_ms <= slo_ms for r in served) / len(records), 4)
                               if records and slo_ms else None)
    out["hit_ratio"] = round(sum(r.outcome != Outcome.MISS for r in served) / len(served), 4) if served else None
    if extent is not None:
        out["captured_total"] = extent.records
        out["dropped_total"] = extent.dropped
        out["dropped_unreadable"] = extent.unreadable
    if off is not None:
        out["capture_off"] = off
    return out


def trace_lines(window: CaptureWindow) -> Iterator[str]:
    """The window in the trace format (``relay_engine.core.trace``), one JSON line per query."""
    for query in to_trace(window.records):
        yield query.to_json() + "\n"
