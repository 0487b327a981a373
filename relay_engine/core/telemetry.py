"""Telemetry types shared by the workers (write side) and the control plane (read side).

Latency histograms use one fixed set of log-spaced bucket bounds everywhere, so histograms from
different instances and different seconds merge by adding counts; quantiles are taken only after
merging (never by averaging per-instance percentiles).
"""

from __future__ import annotations

import base64
import bisect
import json
import math
import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from enum import StrEnum

from relay_engine.core.fields import inflated, json_value
from relay_engine.core.outcomes import (
    LOWER_TIER_MODULES,
    OUTCOME_COUNTERS,
    TIER_COUNTERS,
    TIER_GAUGES,
    TIER_LABELS,
    TIERS,
)

# Upper bounds (ms) of the latency buckets: 0.05 ms … ~60 s, 8 buckets per decade (×1.334 each),
# followed by an implicit +Inf bucket. Fixed forever: changing them breaks merging with old data.
_BUCKETS_PER_DECADE = 8
_LOWEST_MS = 0.05
_DECADES = 6.1
LATENCY_BUCKETS_MS: tuple[float, ...] = tuple(
    round(_LOWEST_MS * 10 ** (i / _BUCKETS_PER_DECADE), 6)
    for i in range(int(_DECADES * _BUCKETS_PER_DECADE) + 1)
)
N_BUCKETS = len(LATENCY_BUCKETS_MS) + 1  # + the +Inf bucket

# The counter of the evictions of each tier under HBM (``evictions`` counts HBM's): named for the tier, so
# a new tier's counter comes with its registration.
LOWER_TIER_EVICTIONS: dict[str, str] = {str(tier): f"{tier}_evictions" for tier in LOWER_TIER_MODULES}

# Counter names, in one place, so the publisher, the merge and the dashboard agree.
COUNTERS: tuple[str, ...] = (
    "rank_requests",
    "rank_ok",
    "rank_errors",
    "rank_deadline_exceeded",
    "rank_within_slo",
    "preinfer_signals",
    "preinfer_admitted",
    "preinfer_completed",
    "preinfer_stale_edit",  # completed after the edit it ran under was replaced: its KV is not kept
    *OUTCOME_COUNTERS.values(),  # where each ranking lookup was served from: each counted once, in one
    "evictions",
    "demotions",
    "promotions",
    "expirations",
    *LOWER_TIER_EVICTIONS.values(),
    "dedup_reloads",  # reloads from a lower tier that concurrent ranks joined (the ranks: inflight_joins)
)


class RefusalReason(StrEnum):
    """Why a pre-infer signal was not admitted: the one spelling of each reason, with how people read
    it. The value is the key in telemetry (counters, rollups, Prometheus's ``reason`` label) and in the
    API; the browser gets values and labels from the server. Order: the wire's column order."""

    NOT_AT_RISK = "not_at_risk", "not at risk"
    ALREADY_CACHED = "already_cached", "already cached"
    INFLIGHT_LIMIT = "inflight_limit", "in-flight limit"
    TOKEN_RATE_LIMIT = "token_rate_limit", "token rate limit"
    CACHE_BUDGET = "cache_budget", "cache budget"
    DISABLED = "disabled", "pre-infer disabled"

    def __new__(cls, value: str, label: str) -> RefusalReason:
        member = str.__new__(cls, value)
        member._value_ = value
        member.label = label
        return member

    @property
    def is_refusal(self) -> bool:
        """False for ``already_cached``: its KV is resident already, there is nothing to pre-infer and
        nothing for an operator to act on."""
        return self is not RefusalReason.ALREADY_CACHED


REFUSAL_REASONS: tuple[RefusalReason, ...] = tuple(RefusalReason)


class _MissReasonBase(StrEnum):
    """A miss reason is a string (``MissReason.EXPIRED == "expired"``) with how people read it
    (``label``), its ``family`` (``evicted``, ``not_admitted`` or the reason itself) and ``detail``
    (the tier that evicted it, the trigger's refusal reason; "" for the others)."""

    def __new__(cls, value: str, meaning: tuple[str, str, str]) -> _MissReasonBase:
        member = str.__new__(cls, value)
        member._value_ = value
        member.label, member.family, member.detail = meaning
        return member


# Why a ranking request found its prefix in no tier and recomputed it (``Outcome.MISS``): every miss is
# counted under exactly one reason, decided where the engine knows it. ``evicted_<tier>``: pushed out
# of that tier for space and out of every tier under it (an HBM eviction with a tier under it is a
# demotion, not a loss); ``not_admitted_<refusal>``: the trigger refused its pre-inference for that
# reason (``already_cached`` is no refusal, so it has no member). Order: the wire's column order.
MissReason = _MissReasonBase("MissReason", [
    ("FIRST_VISIT", ("first_visit", ("first visit", "first_visit", ""))),
    ("PREFIX_CHANGED", ("prefix_changed", ("prefix changed since the last visit", "prefix_changed", ""))),
    ("EXPIRED", ("expired", ("expired (past its TTL)", "expired", ""))),
    *((f"EVICTED_{tier.upper()}", (f"evicted_{tier}", (f"evicted from {TIER_LABELS.get(tier, tier)}",
                                                       "evicted", str(tier))))
      for tier in TIERS),
    *((f"NOT_ADMITTED_{reason.name}", (f"not_admitted_{reason.value}", (f"not admitted: {reason.label}",
                                                                         "not_admitted", reason.value)))
      for reason in RefusalReason if reason.is_refusal),
    ("TOO_LATE", ("too_late", ("a computation in flight would finish too late", "too_late", ""))),
    ("EDIT_CHANGED", ("edit_changed", ("cached under the previous edit", "edit_changed", ""))),
    ("REROUTED", ("rerouted", ("routed here by a membership change", "rerouted", ""))),
    ("FAILED", ("failed", ("the computation it joined failed", "failed", ""))),
    ("UNREADABLE", ("unreadable", ("a lower tier's copy failed its checksum", "unreadable", ""))),
], module=__name__, qualname="MissReason")

MISS_REASONS: tuple[MissReason, ...] = tuple(MissReason)
# The reason of a loss by the tier that dropped it, and by the trigger's refusal: what the engine names
# instead of building a member's value.
EVICTED_FROM: dict[str, MissReason] = {tier: MissReason[f"EVICTED_{tier.upper()}"] for tier in TIERS}
NOT_ADMITTED: dict[RefusalReason, MissReason] = {reason: MissReason[f"NOT_ADMITTED_{reason.name}"]
                                                 for reason in RefusalReason if reason.is_refusal}


def bucket_index(value_ms: float) -> int:
    """Index of the bucket holding value_ms (le-semantics: value ≤ bound)."""
    return bisect.bisect_left(LATENCY_BUCKETS_MS, value_ms)


@dataclass
class LatencyHistogram:
    counts: list[int] = field(default_factory=lambda: [0] * N_BUCKETS)
    sum_ms: float = 0.0

    def record(self, value_ms: float) -> None:
        if not math.isfinite(value_ms) or value_ms < 0:
            return
        self.counts[bucket_index(value_ms)] += 1
        self.sum_ms += value_ms

    @property
    def count(self) -> int:
        return sum(self.counts)

    def merge(self, other: LatencyHistogram) -> None:
        for i, c in enumerate(other.counts):
            self.counts[i] += c
        self.sum_ms += other.sum_ms

    def copy(self) -> LatencyHistogram:
        return LatencyHistogram(list(self.counts), self.sum_ms)

    def quantile(self, q: float) -> float | None:
        return quantile_from_counts(self.counts, q)

    def to_dict(self) -> dict:
        return {"counts": list(self.counts), "sum_ms": self.sum_ms}

    @classmethod
    def from_dict(cls, data: dict) -> LatencyHistogram:
        counts = [int(c) for c in data.get("counts", [])]
        if len(counts) != N_BUCKETS:
            raise ValueError(f"histogram has {len(counts)} buckets, expected {N_BUCKETS}")
        return cls(counts, float(data.get("sum_ms", 0.0)))


def quantile_from_counts(counts: Sequence[int], q: float) -> float | None:
    """q-quantile by linear interpolation inside the bucket (Prometheus histogram_quantile)."""
    total = sum(counts)
    if total == 0:
        return None
    rank = q * total
    cumulative = 0
    for i, c in enumerate(counts):
        if c and cumulative + c >= rank:
            lower = LATENCY_BUCKETS_MS[i - 1] if i > 0 else 0.0
            if i >= len(LATENCY_BUCKETS_MS):  # +Inf bucket: report its lower bound
                return LATENCY_BUCKETS_MS[-1]
            upper = LATENCY_BUCKETS_MS[i]
            return lower + (upper - lower) * ((rank - cumulative) / c)
        cumulative += c
    return LATENCY_BUCKETS_MS[-1]


# --- snapshots: what a worker publishes each second -------------------------------------------

# Snapshots are *cumulative* since the instance started (``started_at`` identifies the run), so a
# reader takes differences between consecutive snapshots; a lost sample loses resolution, never
# counts, and a restart shows as a new ``started_at`` (the reader restarts its differences there).


@dataclass
class Snapshot:
    instance: str
    ts: float  # unix seconds
    started_at: float
    counters: dict[str, int] = field(default_factory=dict)
    refusals: dict[str, int] = field(default_factory=dict)
    rank_latency: LatencyHistogram = field(default_factory=LatencyHistogram)
    hbm_bytes: int = 0
    hbm_budget_bytes: int = 0
    applied_generation: int = 0
    slo_ms: float = 0.0
    # Every cache tier's figures by tier name (``outcomes.TIER_GAUGES`` + ``TIER_COUNTERS``): the one
    # generic path per-tier figures take, whatever tiers an instance runs.
    tiers: dict[str, dict[str, int]] = field(default_factory=dict)
    # Misses by reason (``MISS_REASONS``; cumulative): they sum to ``counters["misses"]``.
    misses: dict[str, int] = field(default_factory=dict)

    def to_dict(self) -> dict:
        # Sparse buckets keep 24 h of snapshots small enough to merge on read quickly.
        sparse = {str(i): c for i, c in enumerate(self.rank_latency.counts) if c}
        return {
            "instance": self.instance,
            "ts": self.ts,
            "started_at": self.started_at,
            "counters": self.counters,
            "refusals": self.refusals,
            "misses": self.misses,
            "rank_latency": {"buckets": sparse, "sum_ms": self.rank_latency.sum_ms},
            "hbm_bytes": self.hbm_bytes,
            "hbm_budget_bytes": self.hbm_budget_bytes,
            "applied_generation": self.applied_generation,
            "slo_ms": self.slo_ms,
            "tiers": self.tiers,
        }

    @classmethod
    def from_dict(cls, data: dict) -> Snapshot:
        """Decode a published snapshot; ValueError (naming the field) when it breaks the contract."""
        if not isinstance(data, dict):
            raise ValueError(f"snapshot must be an object, got {type(data).__name__}")
        hist = LatencyHistogram()
        lat = _mapping(data, "rank_latency")
        for key, count in _mapping(lat, "buckets").items():
            index = _finite(key, "rank_latency.buckets", int)
            if 0 <= index < N_BUCKETS:
                hist.counts[index] = _count(count, "rank_latency.buckets", int, key)
        hist.sum_ms = _count(lat.get("sum_ms", 0.0), "rank_latency.sum_ms", float)
        if "instance" not in data or "ts" not in data:
            raise ValueError("snapshot needs instance and ts")
        return cls(
            instance=str(data["instance"]),
            ts=_finite(data["ts"], "ts", float),
            started_at=_finite(data.get("started_at", 0.0), "started_at", float),
            counters={str(k): _count(v, "counters", int, k) for k, v in _mapping(data, "counters").items()},
            refusals={str(k): _count(v, "refusals", int, k) for k, v in _mapping(data, "refusals").items()},
            rank_latency=hist,
            misses={str(k): _count(v, "misses", int, k) for k, v in _mapping(data, "misses").items()},
            **{name: _count(data.get(name, 0), name, int) for name in GAUGES if name in _GAUGE_FIELDS},
            slo_ms=_finite(data.get("slo_ms", 0.0), "slo_ms", float),
            tiers=_tiers(data),
        )

    def gauges(self) -> dict[str, int]:
        """Every gauge by name (``GAUGES``): the tiers' levels from ``tiers``, the others its fields."""
        return dict(zip(GAUGES, gauges_of(self.tiers, lambda name: getattr(self, name, 0)), strict=True))

    def to_entry(self) -> str:
        """The one encoder of a telemetry stream entry (field ``d``): ``to_dict``, packed (``pack_entry``)."""
        return pack_entry(self.to_dict())

    @classmethod
    def from_entry(cls, raw: str | bytes) -> Snapshot:
        """The one decoder of a telemetry stream entry (field ``d``): packed or plain JSON (``entry_json``)."""
        return cls.from_dict(json_value(entry_json(raw), "snapshot", ValueError))


_EXACT_INT = 2**53  # the largest integer a float holds exactly
# Counts, byte gauges and the latency sum are at most this (and never negative): a reader sums their
# differences over thousands of samples and instances, which then stays finite and exact.
MAX_COUNT = _EXACT_INT
# The levels of a tier the readers keep as gauges, for every tier the core can run (``outcomes.TIERS``),
# named ``<tier>_<level>`` (``disk_bytes``): two per tier, so what a reader holds per instance and a rollup
# per period stays bounded whatever tiers the instances run.
TIER_LEVELS: tuple[str, ...] = ("bytes", "budget_bytes")
TIER_LEVEL_GAUGES: dict[str, tuple[str, str]] = {f"{tier}_{level}": (str(tier), level)
                                                 for tier in TIERS for level in TIER_LEVELS}
# A snapshot's gauges, kept as sampled (never differenced): the one list the readers use.
GAUGES: tuple[str, ...] = (*TIER_LEVEL_GAUGES, "applied_generation")


def gauges_of(tiers: dict, own: Callable[[str], object]) -> list[object]:
    """The value of every gauge (``GAUGES``), in order: a tier's level from a snapshot's ``tiers`` (the
    generic path), else ``own(name)`` (the snapshot's own field of that name; a tier it does not run
    reads 0). One reading for a decoded ``Snapshot`` and for a stream entry's raw JSON alike."""
    values = []
    for name in GAUGES:
        tier, level = TIER_LEVEL_GAUGES.get(name, ("", ""))
        figures = tiers.get(tier) if tier else None
        values.append(figures[level] if isinstance(figures, dict) and level in figures else own(name))
    return values


# The gauges a snapshot keeps as its own fields (from before per-tier figures, and applied_generation).
_GAUGE_FIELDS = frozenset(name for name in GAUGES if name in Snapshot.__dataclass_fields__)

TIER_FIGURES: tuple[str, ...] = TIER_GAUGES + TIER_COUNTERS
_MAX_TIERS = 16
_MAX_TIER_NAME = 32


def _tiers(data: dict) -> dict[str, dict[str, int]]:
    """snapshot.tiers: at most 16 tiers named by identifiers, each figure a count (unknown figures
    are dropped, so a newer worker's extra figure does not break an older reader)."""
    tiers = _mapping(data, "tiers")
    if len(tiers) > _MAX_TIERS:
        raise ValueError(f"snapshot.tiers has {len(tiers)} tiers, at most {_MAX_TIERS}")
    out = {}
    for name, figures in tiers.items():
        if not isinstance(name, str) or not name.isidentifier() or len(name) > _MAX_TIER_NAME:
            raise ValueError(f"snapshot.tiers: tier names are identifiers of at most {_MAX_TIER_NAME} "
                             f"characters, got {str(name)[:40]!r}")
        figures = tiers[name]
        if not isinstance(figures, dict):
            raise ValueError(f"snapshot.tiers.{name} must be an object, got {type(figures).__name__}")
        out[name] = {f: _count(figures[f], f"tiers.{name}", int, f) for f in TIER_FIGURES if f in figures}
    return out


def _mapping(data: dict, key: str) -> dict:
    value = data.get(key) or {}
    if not isinstance(value, dict):
        raise ValueError(f"snapshot.{key} must be an object, got {type(value).__name__}")
    return value


def _finite(value: object, name: str, kind: type, key: object = None) -> int | float:
    """value as a finite int or float (numeric strings accepted for dict keys), else ValueError naming
    the field (``name``, or ``name.key`` for an entry of a mapping)."""
    # Fast paths for what workers write (a 24 h chart decodes thousands of snapshots per instance).
    if type(value) is int and -_EXACT_INT <= value <= _EXACT_INT:
        return value if kind is int else float(value)
    if type(value) is float and math.isfinite(value):
        return int(value) if kind is int else value
    if key is not None:
        name = f"{name}.{key}"
    try:
        number = float(value)  # type: ignore[arg-type]
    except (TypeError, ValueError, OverflowError):
        raise ValueError(f"snapshot.{name} must be a number, got {str(value)[:40]!r}") from None
    if isinstance(value, bool) or not math.isfinite(number):
        raise ValueError(f"snapshot.{name} must be a finite number, got {str(value)[:40]!r}")
    return int(number) if kind is int else number


def _count(value: object, name: str, kind: type, key: object = None) -> int | float:
    """A count (or byte gauge, or latency sum) in [0, ``MAX_COUNT``], else ValueError naming the field."""
    number = _finite(value, name, kind, key)
    if not 0 <= number <= MAX_COUNT:
        shown = f"{name}.{key}" if key is not None else name
        raise ValueError(f"snapshot.{shown} must be in [0, 2**53], got {str(value)[:40]}")
    return number


# --- the stream entry: field ``d`` of a telemetry stream --------------------------------------

# A snapshot's JSON is ~1.5 KB, and Redis packs a stream's entries into nodes of at most 4 KB
# (``stream-node-max-bytes``): two to a node, so the nodes' overhead doubles what a live tier costs.
# Packed, an entry is its JSON deflated against a preset dictionary (a snapshot's field names, at zero
# and at typical values: what is left to code is mostly the digits), then base64, so the field stays
# ASCII text for every reader (the control plane reads with ``decode_responses`` and replaces bytes
# that are not UTF-8): ~440 bytes, nine or more to a node. The prefix names the dictionary, which is
# frozen: an entry packed with it inflates only with it. A new dictionary takes a new prefix, and the
# decoder keeps the old one as long as streams may hold its entries.
PACKED_ENTRY_PREFIX = "z1:"
_PACKED_ZDICT_V1 = (
    b'{"instance":"ranking-a.0","ts":1700000000.0,"started_at":1700000000.0,"counters":{"rank_requests":0,'
    b'"rank_ok":0,"rank_errors":0,"rank_deadline_exceeded":0,"rank_within_slo":0,"preinfer_signals":0,"pre'
    b'infer_admitted":0,"preinfer_completed":0,"preinfer_stale_edit":0,"hbm_hits":0,"inflight_joins":0,"dr'
    b'am_hits":0,"disk_hits":0,"misses":0,"evictions":0,"demotions":0,"promotions":0,"expirations":0,"dram'
    b'_evictions":0,"disk_evictions":0,"dedup_reloads":0},"refusals":{"not_at_risk":0,"already_cached":0,"'
    b'inflight_limit":0,"token_rate_limit":0,"cache_budget":0,"disabled":0},"misses":{"first_visit":0,"pre'
    b'fix_changed":0,"expired":0,"evicted_hbm":0,"evicted_dram":0,"evicted_disk":0,"not_admitted_not_at_ri'
    b'sk":0,"not_admitted_inflight_limit":0,"not_admitted_token_rate_limit":0,"not_admitted_cache_budget":'
    b'0,"not_admitted_disabled":0,"too_late":0,"edit_changed":0,"rerouted":0,"failed":0,"unreadable":0},"r'
    b'ank_latency":{"buckets":{},"sum_ms":0.0},"hbm_bytes":0,"hbm_budget_bytes":0,"applied_generation":0,"'
    b'slo_ms":0.0,"tiers":{"hbm":{"bytes":0,"budget_bytes":0},"dram":{"bytes":0,"budget_bytes":0},"disk":{'
    b'"bytes":0,"budget_bytes":0}}}{"instance":"ranking-a.1","ts":1700090000.123456,"started_at":170000000'
    b'0.654321,"counters":{"rank_requests":23399861,"rank_ok":23165862,"rank_errors":116999,"rank_deadline'
    b'_exceeded":116999,"rank_within_slo":22697865,"preinfer_signals":11699930,"preinfer_admitted":1169993'
    b'0,"preinfer_completed":11699930,"preinfer_stale_edit":11699930,"hbm_hits":11699930,"inflight_joins":'
    b'11699930,"dram_hits":11699930,"disk_hits":11699930,"misses":11699930,"evictions":11699930,"demotions'
    b'":11699930,"promotions":11699930,"expirations":11699930,"dram_evictions":11699930,"disk_evictions":1'
    b'1699930,"dedup_reloads":11699930},"refusals":{"not_at_risk":233998,"already_cached":467997,"inflight'
    b'_limit":701995,"token_rate_limit":935994,"cache_budget":1169993,"disabled":1403991},"misses":{"first'
    b'_visit":86028,"prefix_changed":172057,"expired":258086,"evicted_hbm":344115,"evicted_dram":430144,"e'
    b'victed_disk":516173,"not_admitted_not_at_risk":602202,"not_admitted_inflight_limit":688231,"not_admi'
    b'tted_token_rate_limit":774260,"not_admitted_cache_budget":860288,"not_admitted_disabled":946317,"too'
    b'_late":1032346,"edit_changed":1118375,"rerouted":1204404,"failed":1290433,"unreadable":1376462},"ran'
    b'k_latency":{"buckets":{"23":233998,"24":467997,"25":1169993,"26":1871988,"27":2807983,"28":3509979,"'
    b'29":3743977,"30":3509979,"31":2807983,"32":1871988,"33":935994,"34":350997,"35":116999},"sum_ms":222'
    b'298679.5},"hbm_bytes":0,"hbm_budget_bytes":0,"applied_generation":1,"slo_ms":50.0,"tiers":{"hbm":{"b'
    b'ytes":697303040,"budget_bytes":1073741824},"dram":{"bytes":3083862016,"budget_bytes":4294967296}}}'
)
_PACKED_WBITS = -12  # raw deflate (no header or checksum), 4 KiB window: the dictionary and a snapshot
# What a packed entry may inflate to: snapshots are ~2 KB, so anything past this is no snapshot but a
# bomb, refused after inflating this much (it costs one sample, not the reader's memory).
MAX_ENTRY_JSON_BYTES = 64 * 1024


def pack_entry(data: dict) -> str:
    """Field ``d`` of a stream entry holding ``data`` (a snapshot's ``to_dict``): its JSON, packed."""
    deflater = zlib.compressobj(9, zlib.DEFLATED, _PACKED_WBITS, zdict=_PACKED_ZDICT_V1)
    text = json.dumps(data, separators=(",", ":")).encode()
    return PACKED_ENTRY_PREFIX + base64.b64encode(deflater.compress(text) + deflater.flush()).decode("ascii")


def entry_json(raw: str | bytes) -> str | bytes:
    """The JSON text of a stream entry's field ``d``: a packed entry inflated, anything else as it is (an
    older worker's plain JSON: one stream holds both during a rolling upgrade). ValueError when a packed
    entry is not base64, is truncated or corrupt, or inflates past ``MAX_ENTRY_JSON_BYTES``."""
    prefix = PACKED_ENTRY_PREFIX if isinstance(raw, str) else PACKED_ENTRY_PREFIX.encode()
    if not raw.startswith(prefix):
        return raw
    try:
        packed = base64.b64decode(raw[len(prefix):], validate=True)
    except ValueError as exc:  # binascii.Error is a ValueError
        raise ValueError(f"snapshot entry is not packed JSON: {exc}") from None
    try:
        return inflated(packed, MAX_ENTRY_JSON_BYTES, wbits=_PACKED_WBITS, zdict=_PACKED_ZDICT_V1)
    except ValueError as exc:
        what = "snapshot entry" if str(exc).startswith("inflates past") else "snapshot entry is not packed JSON:"
        raise ValueError(f"{what} {exc}") from None


# --- pool rollups: what every instance adds to its pool's per-tier buckets --------------------

# Each telemetry tier also has a pool-level rollup: one Redis hash per tier period (``wire.PoolKeys.
# rollup``) to which every instance adds, with HINCRBY, the counts it made since its previous write
# of that tier, and its gauges once. A pool view then reads one small hash per point however many
# instances the pool has: aggregation happens where the data is, as Prometheus recording rules do.
# Field names of a rollup hash:
ROLLUP_SUM_FIELD = "sum_ms"  # latency sum (the one float field)
ROLLUP_INSTANCES_FIELD = "instances"  # instances that reported into the bucket
# The byte gauges (a pool has no one applied generation: each instance reports its own).
ROLLUP_GAUGES: tuple[str, ...] = tuple(name for name in GAUGES if name != "applied_generation")


def rollup_refusal_field(reason: str) -> str:
    return f"refused.{reason}"


def rollup_miss_field(reason: str) -> str:
    return f"missed.{reason}"


def rollup_bucket_field(index: int) -> str:
    return f"le.{index}"


def rollup_contribution(current: Snapshot, previous: Snapshot | None) -> dict[str, int | float]:
    """What one instance adds to its pool's rollup bucket at one write of a tier: the counts since
    its ``previous`` write of that tier (all of them when there is none or it belongs to another run),
    and its gauges once with ``instances: 1``. Zero fields are left out (HINCRBY by 0 is a no-op)."""
    same_run = previous is not None and previous.started_at == current.started_at

    def delta(now: int | float, before: int | float) -> int | float:
        # A count that went down within a run was reset: its new value is the difference.
        return now - before if same_run and now >= before else now

    fields: dict[str, int | float] = {}
    for name in COUNTERS:
        fields[name] = delta(current.counters.get(name, 0), previous.counters.get(name, 0) if same_run else 0)
    for reason in REFUSAL_REASONS:
        fields[rollup_refusal_field(reason)] = delta(current.refusals.get(reason, 0),
                                                     previous.refusals.get(reason, 0) if same_run else 0)
    for reason in MISS_REASONS:
        fields[rollup_miss_field(reason)] = delta(current.misses.get(reason, 0),
                                                  previous.misses.get(reason, 0) if same_run else 0)
    before = previous.rank_latency.counts if same_run else [0] * N_BUCKETS
    for i, (now, was) in enumerate(zip(current.rank_latency.counts, before, strict=True)):
        fields[rollup_bucket_field(i)] = delta(now, was)
    fields[ROLLUP_SUM_FIELD] = round(delta(current.rank_latency.sum_ms,
                                           previous.rank_latency.sum_ms if same_run else 0.0), 6)
    gauges = current.gauges()
    for name in ROLLUP_GAUGES:
        fields[name] = gauges[name]
    fields[ROLLUP_INSTANCES_FIELD] = 1
    return {name: value for name, value in fields.items() if value}
