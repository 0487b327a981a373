"""Where the control plane and the workers meet: Redis key names and message shapes.

``controlplane`` and ``workers`` never import each other; both import this module, which is plain
string formatting and JSON shapes (no Redis client here). Every name carries a key prefix so
several deployments, or several test runs, can share one Redis without colliding.

Keys (``P`` = prefix, ``pool`` = pool name, ``inst`` = instance name ``<pool>.<index>``):

| key | type | written by | content |
| --- | --- | --- | --- |
| ``P:pools`` | set | control plane | pool names known to the fleet |
| ``P:pool:{pool}:desired`` | string | control plane | JSON ``DesiredRevision`` |
| ``P:pool:{pool}:desired:{inst}`` | string | control plane | JSON ``DesiredRevision`` for one instance: a canary's, overriding the pool's while it bakes |
| ``P:pool:{pool}:rollout:fence`` | string | control plane | the newest rollout state written to the overrides (``rollout_fence``): an older writer's overrides are refused |
| ``P:pool:{pool}:poke`` | pub/sub channel | control plane | the desired generation, as text |
| ``P:pool:{pool}:members`` | sorted set | workers | inst → last heartbeat (unix s) |
| ``P:pool:{pool}:status:{inst}`` | string, TTL | workers | JSON ``InstanceStatus`` |
| ``P:pool:{pool}:telemetry:{tier}:{inst}`` | stream, MAXLEN | workers | field ``d``: a ``Snapshot``, packed (``Snapshot.to_entry``: ``z1:`` + base64 of its JSON deflated against a preset dictionary; older workers' plain JSON still reads, ``Snapshot.from_entry``) |
| ``P:pool:{pool}:rollup:{tier}:{t}`` | hash, TTL | workers (HINCRBY) | the pool's counts of tier period ``t`` (``telemetry.rollup_contribution``) |
| ``P:pool:{pool}:reporting`` | sorted set | workers | inst → time of its last telemetry snapshot (unix s) |
| ``P:pool:{pool}:claim:{index}`` | string, TTL | workers | owner of an instance index (scaled replicas) |
| ``P:pool:{pool}:reply:{token}`` | list, TTL | workers | the answer to one ranking request (JSON), for its sender's BLPOP |
| ``P:pool:{pool}:signals:{inst}`` | list, trimmed, TTL | clients | pre-infer signals ``{"p": payload, "t": sent}`` (``workers.signals``) |
| ``P:pool:{pool}:traffic`` | stream, MAXLEN ~ / MINID | workers | one ``capture.CaptureRecord`` per ranking request |
| ``P:pool:{pool}:traffic:dropped`` | hash | workers (HINCRBY) | inst → capture records dropped (queue full, Redis down) |

Celery queue: ``P.{inst}.rank`` only (pre-infer signals go on their own list, above, so ranking
never waits behind them nor shares Celery's threads with them);
the control plane's ``P.controlplane.periodic`` (the canary bake) and ``P.controlplane.previews``,
each consumed by a worker process of its own (``controlplane_queue``).

Both sides speak the same words from here: the status record (``InstanceStatus``), its config
states (``ACK``/``NACK``/``PENDING``), and the liveness rule (``is_live``/``live_since``/``live_until``). Redis is
untrusted input to either side, so every decoder here checks types and finiteness and raises
``WireError`` naming the field, never a bare ``KeyError`` or ``OverflowError``.

Canary rollouts: an instance with its own desired record (``PoolKeys.instance_desired``) runs that
one instead of the pool's. Generations only grow, so an instance refuses a desired generation older
than the one it applied (a stale Redis); the one exception is a canary rolled back: the pool's record
then lists the canary's generation in ``revoked``, and an instance running a revoked generation may
leave it for the pool's older one (``may_step_down``). A stale record, written before the rollback,
carries no such list and is still refused.

Revocation stays bounded however many canaries were rolled back: ``revoked`` holds inclusive ranges
``[lo, hi]`` of generations (a bare integer is the range of one, as older control planes wrote). Every
generation above the pool's desired one was either never sent to an instance, or sent to canaries
that were rolled back, or is the generation baking now (one per pool): so the control plane covers
the revoked ones with the fewest ranges that leave out only the baking one (``revoked_ranges``: at
most two), whatever the count of aborted canaries, and a record never fails for its length.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from typing import Any

from relay_engine.core.config import ModelFingerprint
from relay_engine.core.fields import json_value
from relay_engine.core.telemetry import TIER_LEVEL_GAUGES, TIER_LEVELS

DEFAULT_KEY_PREFIX = "relaygr"
KEY_PREFIX_ENV = "RELAYGR_KEY_PREFIX"

HEARTBEAT_INTERVAL_S = 1.0
HEARTBEAT_TIMEOUT_S = 5.0  # an instance silent this long leaves the live set; its users move
# A heartbeat may be this far ahead of the reader's clock (machines' clocks differ); one further
# ahead is not a time but a bad value, and would keep its instance live for ever.
HEARTBEAT_MAX_AHEAD_S = 60.0
STATUS_TTL_S = 3600  # a dead instance's last status stays readable for an hour
REPLY_TTL_S = 60  # an answer nobody waits for any more disappears with its list

# Telemetry tiers: name → (seconds between snapshots, snapshots kept). 1 s for the last 10 min,
# 10 s for 2 h, 60 s for 25 h: a 24 h chart of 8 instances merges ~12k small snapshots.
TELEMETRY_TIERS: dict[str, tuple[int, int]] = {"1s": (1, 600), "10s": (10, 720), "60s": (60, 1500)}
# The tier the live view and the canary bake read: Redis always holds it.
LIVE_TIER = "1s"
# Where the history past the live tier lives, and so which tiers the workers write: "redis" (every
# tier, the embedded default) or "prometheus" (it scrapes the control plane's /metrics and holds the
# history; Redis keeps only the live tier, a tenth of the memory at fleet scale).
HISTORY_TIERS: dict[str, tuple[str, ...]] = {"redis": tuple(TELEMETRY_TIERS), "prometheus": (LIVE_TIER,)}
# Where Prometheus holds the history, the live tier keeps 6 min, not 10: the live view's 5 min window and
# the sample before it, with a minute to spare (the control plane reads anything longer from Prometheus,
# ``controlplane.telemetry.sources.LIVE_WINDOW_S``). At 256 instances that is 33 MiB of Redis less.
PROMETHEUS_LIVE_KEPT = 360


def tier_kept(tier: str, history: str = "redis") -> int:
    """How many entries of ``tier`` a worker writing the tiers of ``history`` (``HISTORY_TIERS``) keeps."""
    return PROMETHEUS_LIVE_KEPT if history == "prometheus" and tier == LIVE_TIER else TELEMETRY_TIERS[tier][1]

# Each instance's forward times (``forward_times.ForwardTimesRecord``, cumulative): a record every 30 s
# into a short stream of its own, and one every 10 min into a long one. A window is two records'
# difference, so a reader needs a record at each end, not every one between: the short stream gives
# windows up to 2.5 min to the nearest 30 s, the long one windows up to an hour to the nearest 10 min.
# A busy instance's record is ~3.7 KB (83 length buckets of 7 sums, deflated): an hour of records at
# 30 s would be 120 of them, ~111 MiB at 256 instances, against 13 (~12 MiB; beside them the live
# telemetry tier, ~200 KiB an instance where Prometheus holds the history).
FORWARD_TIMES_EVERY_S = 30
FORWARD_TIMES_KEPT = 6
FORWARD_TIMES_COARSE_EVERY_S = 600
FORWARD_TIMES_COARSE_KEPT = 7
# The longest window the streams answer: the long stream's span back from its newest record.
FORWARD_TIMES_MAX_WINDOW_S = FORWARD_TIMES_COARSE_EVERY_S * (FORWARD_TIMES_COARSE_KEPT - 1)

# The longest any telemetry stays (the coarsest tier's span): how far back ``reporting`` is kept.
TELEMETRY_RETENTION_S = max(every_s * kept for every_s, kept in TELEMETRY_TIERS.values())


def rollup_period(tier: str, ts: float) -> int:
    """Start (unix s) of the ``tier`` period holding ``ts``: the rollup bucket a snapshot taken at
    ``ts`` adds to, and the time bucket a reader draws it in."""
    every_s = TELEMETRY_TIERS[tier][0]
    return int(ts // every_s) * every_s


NAME_RE = re.compile(r"^[a-z0-9][a-z0-9_-]{0,62}$")

# Config states an instance reports for the desired revision. ACK: applied; NACK: refused (the last
# good one keeps serving, ``error`` says why); PENDING: not reconciled yet. UNKNOWN is the control
# plane's word for an instance whose status it cannot read.
ACK, NACK, PENDING, UNKNOWN = "ACK", "NACK", "PENDING", "UNKNOWN"
CONFIG_STATES = (ACK, NACK, PENDING, UNKNOWN)


class WireError(ValueError):
    """A record read from Redis that breaks the contract; the message names the field."""


def live_since(now: float) -> float:
    """The oldest heartbeat time that still counts as live at ``now`` (a members score bound)."""
    return now - HEARTBEAT_TIMEOUT_S


def live_until(now: float) -> float:
    """The newest heartbeat time that counts at ``now`` (the other members score bound)."""
    return now + HEARTBEAT_MAX_AHEAD_S


def is_live(heartbeat_ts: float, now: float) -> bool:
    """The liveness rule both sides apply: a heartbeat at most ``HEARTBEAT_TIMEOUT_S`` old, and no
    more than ``HEARTBEAT_MAX_AHEAD_S`` ahead (NaN is neither)."""
    return live_since(now) <= heartbeat_ts <= live_until(now)


def key_prefix() -> str:
    return os.environ.get(KEY_PREFIX_ENV, DEFAULT_KEY_PREFIX)


MAX_INSTANCE_INDEX = 1023  # indices an instance may claim (workers.instance --index, scaled replicas)


def instance_name(pool: str, index: int) -> str:
    return f"{pool}.{index}"


def instance_index(name: object, pool: str) -> int:
    """The index of an instance of ``pool`` from its name (``<pool>.<index>``); WireError for anything
    else — a member set is written by the workers, and Redis is untrusted."""
    if not isinstance(name, str) or not name.startswith(f"{pool}."):
        raise WireError(f"member {repr(name)[:60]} is not an instance of pool {pool!r} (<pool>.<index>)")
    index = name[len(pool) + 1:]
    if not (index.isascii() and index.isdigit() and len(index) <= 4) or int(index) > MAX_INSTANCE_INDEX \
            or index != str(int(index)):
        raise WireError(f"member {name[:60]!r}: the index must be an integer in [0, {MAX_INSTANCE_INDEX}]")
    return int(index)


def live_members(client: Any, keys: PoolKeys, *, now: float) -> tuple[list[str], list[str]]:
    """The pool's live instances by the liveness rule, lowest index first, and the members whose names
    break the contract (reported, never served). ``client``: a Redis client (this module imports none)."""
    names = client.zrangebyscore(keys.members, live_since(now), live_until(now))
    good, bad = [], []
    for name in names:
        if isinstance(name, bytes):  # a client that does not decode replies
            name = name.decode("utf-8", errors="replace")
        try:
            good.append((instance_index(name, keys.pool), name))
        except WireError:
            bad.append(str(name)[:80])
    return [name for _, name in sorted(good)], bad


# The control plane's own Celery queues, by what consumes them: the canary bake's evaluation (the
# beat's periodic tasks) and the what-if previews, each with a worker process of its own so no
# preview ever delays a rollback.
CONTROLPLANE_QUEUES = ("periodic", "previews")


def controlplane_queue(kind: str, prefix: str | None = None) -> str:
    """The name of the control plane's queue ``kind`` (one of ``CONTROLPLANE_QUEUES``)."""
    if kind not in CONTROLPLANE_QUEUES:
        raise ValueError(f"no control-plane queue {kind!r}; there are {', '.join(CONTROLPLANE_QUEUES)}")
    return f"{prefix or key_prefix()}.controlplane.{kind}"


@dataclass(frozen=True)
class PoolKeys:
    pool: str
    prefix: str = field(default_factory=key_prefix)

    @property
    def base(self) -> str:
        return f"{self.prefix}:pool:{self.pool}"

    @property
    def desired(self) -> str:
        return f"{self.base}:desired"

    def instance_desired(self, instance: str) -> str:
        """One instance's own desired revision (a canary's), read before the pool's."""
        return f"{self.base}:desired:{instance}"

    @property
    def rollout_fence(self) -> str:
        """The token of the last rollout state whose overrides were written (see the control plane's
        ``rollouts.services.overrides_push``): writes carrying an older token change nothing."""
        return f"{self.base}:rollout:fence"

    @property
    def poke_channel(self) -> str:
        return f"{self.base}:poke"

    @property
    def members(self) -> str:
        return f"{self.base}:members"

    def status(self, instance: str) -> str:
        return f"{self.base}:status:{instance}"

    def telemetry(self, tier: str, instance: str) -> str:
        return f"{self.base}:telemetry:{tier}:{instance}"

    def forward_times(self, instance: str, coarse: bool = False) -> str:
        """The instance's stream of cumulative forward-time records (``forward_times.ForwardTimesRecord``):
        the short one (every ``FORWARD_TIMES_EVERY_S``) or the ``coarse`` long one."""
        return f"{self.base}:{'forwards-long' if coarse else 'forwards'}:{instance}"

    def rollup(self, tier: str, period_start: int) -> str:
        """The pool's rollup hash of one period of ``tier`` (``period_start`` from ``rollup_period``)."""
        return f"{self.base}:rollup:{tier}:{period_start}"

    @property
    def reporting(self) -> str:
        return f"{self.base}:reporting"

    def rank_queue(self, instance: str) -> str:
        return f"{self.prefix}.{instance}.rank"

    def rank_requests(self, instance: str) -> str:
        """The instance's list of ranking requests (``workers.ranks``), taken by its rank threads, not Celery;
        ``rank_queue`` is the Celery task's queue, kept for senders of the Celery protocol."""
        return f"{self.base}:ranks:{instance}"

    def preinfer_signals(self, instance: str) -> str:
        """The instance's list of pre-infer signals (``workers.signals``), read by its own thread, not Celery."""
        return f"{self.base}:signals:{instance}"

    def claim(self, index: int) -> str:
        return f"{self.base}:claim:{index}"

    def reply(self, token: str) -> str:
        """The private list one ranking request's answer is pushed to."""
        return f"{self.base}:reply:{token}"

    @property
    def traffic(self) -> str:
        """The pool's traffic capture: a bounded stream of ``capture.CaptureRecord`` fields."""
        return f"{self.base}:traffic"

    @property
    def traffic_dropped(self) -> str:
        return f"{self.base}:traffic:dropped"

    def is_reply(self, key: object) -> bool:
        return isinstance(key, str) and key.startswith(f"{self.base}:reply:") and len(key) <= len(self.base) + 80


def pools_key(prefix: str | None = None) -> str:
    return f"{prefix or key_prefix()}:pools"


def _json_object(raw: str | bytes, what: str) -> dict[str, Any]:
    data = json_value(raw, what, WireError)
    if not isinstance(data, dict):
        raise WireError(f"{what} must be a JSON object, got {type(data).__name__}")
    return data


def _typed(data: dict[str, Any], name: str, kind: type, what: str) -> Any:
    """data[name] as ``kind`` (int, float or str), or WireError naming the field."""
    value = data[name]
    if kind is str:
        ok = isinstance(value, str)
    elif isinstance(value, bool) or not isinstance(value, (int, float)):
        ok = False
    elif kind is int:
        ok = isinstance(value, int) and -(2**63) <= value < 2**63
    else:  # a float: finite, and an int only if a float can hold it
        ok = math.isfinite(value) if isinstance(value, float) else abs(value) < 1e300
    if not ok:
        shown = repr(value)[:40]
        raise WireError(f"{what}.{name} must be {'a finite number' if kind is float else kind.__name__}, "
                        f"got {shown}")
    return float(value) if kind is float else value


MAX_REVOKED = 64  # revoked ranges a desired record may list (the control plane writes at most two)
Ranges = tuple[tuple[int, int], ...]


def revoked_ranges(revoked: Iterable[int], *, above: int, keep: Iterable[int] = ()) -> Ranges:
    """The fewest inclusive ranges covering every generation in ``revoked`` above ``above`` and none in
    ``keep`` (a canary baking now); generations between revoked ones that no instance was sent are
    covered too, which is what keeps the count bounded."""
    gens = sorted({g for g in revoked if g > above})
    kept = set(keep) - set(gens)
    ranges: list[tuple[int, int]] = []
    for g in gens:
        if ranges and not any(ranges[-1][1] < k < g for k in kept):
            ranges[-1] = (ranges[-1][0], g)  # nothing an instance may keep lies between: one range
        else:
            ranges.append((g, g))
    return tuple(ranges)


@dataclass(frozen=True)
class DesiredRevision:
    generation: int
    sha256: str
    spec: dict[str, Any]
    published_at: float
    published_by: str = ""
    # Inclusive ranges of generations above this one that the control plane withdrew from canary
    # instances (rolled back): an instance running one of them may step down to this generation.
    revoked: Ranges = ()

    def may_step_down(self, applied_generation: int) -> bool:
        """Whether an instance that applied ``applied_generation`` may go down to this older one."""
        return any(lo <= applied_generation <= hi for lo, hi in self.revoked)

    def to_json(self) -> str:
        data = asdict(self)
        if not self.revoked:  # the record stays as it always was when nothing is revoked
            del data["revoked"]
        else:
            data["revoked"] = [lo if lo == hi else [lo, hi] for lo, hi in self.revoked]
        return json.dumps(data, sort_keys=True)

    @classmethod
    def from_json(cls, raw: str | bytes) -> DesiredRevision:
        """Decode and check the record's shape (the spec itself is judged by ``parse_policy``)."""
        data = _json_object(raw, "desired revision")
        for name in ("generation", "sha256", "spec"):
            if name not in data:
                raise WireError(f"desired revision.{name} is missing")
        generation = _typed(data, "generation", int, "desired revision")
        if generation < 1:
            raise WireError(f"desired revision.generation must be at least 1, got {generation}")
        if not isinstance(data["spec"], dict):
            raise WireError(f"desired revision.spec must be an object, got {type(data['spec']).__name__}")
        return cls(
            generation=generation,
            sha256=_typed(data, "sha256", str, "desired revision"),
            spec=data["spec"],
            published_at=_typed(data, "published_at", float, "desired revision") if "published_at" in data else 0.0,
            published_by=_typed(data, "published_by", str, "desired revision") if "published_by" in data else "",
            revoked=_revoked(data, generation),
        )


def _revoked(data: dict[str, Any], generation: int) -> Ranges:
    revoked = data.get("revoked", [])
    if not isinstance(revoked, list) or len(revoked) > MAX_REVOKED:
        raise WireError(f"desired revision.revoked must be a list of at most {MAX_REVOKED} generations or "
                        f"[first, last] ranges, got {repr(revoked)[:40]}")
    out = []
    for value in revoked:
        if isinstance(value, list):
            if len(value) != 2:
                raise WireError(f"desired revision.revoked ranges must be [first, last], got {repr(value)[:40]}")
            lo, hi = (_typed({"revoked": v}, "revoked", int, "desired revision") for v in value)
        else:
            lo = hi = _typed({"revoked": value}, "revoked", int, "desired revision")
        if lo > hi:
            raise WireError(f"desired revision.revoked range [{lo}, {hi}] is empty: first must be at most last")
        if lo <= generation:
            raise WireError(f"desired revision.revoked holds generation {lo}; only generations above the "
                            f"record's own, {generation}, can be revoked")
        out.append((lo, hi))
    return tuple(sorted(set(out)))


@dataclass
class InstanceStatus:
    instance: str
    pool: str
    device: str
    pid: int
    heartbeat_ts: float
    started_at: float
    applied_generation: int = 0
    applied_sha256: str = ""
    config_state: str = PENDING  # ACK, NACK or PENDING (see CONFIG_STATES)
    nacked_generation: int = 0
    error: str = ""
    # Every cache tier the instance runs, in the tier stack's lookup order: its levels by name
    # (``telemetry.TIER_LEVELS``: bytes used, budget_bytes), from the engine's per-tier figures.
    tiers: dict[str, dict[str, int]] = field(default_factory=dict)
    device_memory_bytes: int = 0
    capture_off: str = ""  # why this instance records no traffic (empty while it captures)
    # The model it serves, which an edit must target (``ModelConfig.fingerprint``); 0 where it says
    # none (an older worker, or a stand-in instance without a model).
    model_num_layers: int = 0
    model_num_heads: int = 0
    model_head_dim: int = 0
    # Where it runs (``devices.host_identity``): instances with one ``host`` share its ``host_cpus``
    # (what a preview's simulated fleet mirrors on a CPU); empty and 0 where it says none.
    host: str = ""
    host_cpus: int = 0
    torch_threads: int = 0

    def model_fingerprint(self) -> ModelFingerprint | None:
        dims = (self.model_num_layers, self.model_num_heads, self.model_head_dim)
        return ModelFingerprint(*dims) if all(d > 0 for d in dims) else None

    def to_json(self) -> str:
        return json.dumps(asdict(self))  # not sorted: ``tiers`` keeps the stack's lookup order

    @classmethod
    def from_json(cls, raw: str | bytes) -> InstanceStatus:
        """Decode and type-check a status; unknown fields are ignored (newer workers), a missing
        required one or a wrong type is a WireError naming it."""
        data = _json_object(raw, "status")
        values: dict[str, Any] = {"tiers": _status_tiers(data)}
        for f in dataclasses.fields(cls):
            if f.name == "tiers":
                continue
            if f.name not in data:
                if f.default is dataclasses.MISSING:
                    raise WireError(f"status.{f.name} is missing")
                continue
            values[f.name] = _typed(data, f.name, _STATUS_TYPES[f.type], "status")
        if values.get("config_state", PENDING) not in (ACK, NACK, PENDING):
            raise WireError(f"status.config_state must be one of ACK, NACK, PENDING, got {values['config_state']!r}")
        return cls(**values)

    @classmethod
    def unknown(cls, instance: str, pool: str) -> InstanceStatus:
        """What the control plane shows for an instance whose status it has none of (or cannot read)."""
        return cls(instance=instance, pool=pool, device="", pid=0, heartbeat_ts=0.0, started_at=0.0,
                   config_state=UNKNOWN)


_STATUS_TYPES = {"str": str, "int": int, "float": float}
MAX_STATUS_TIERS = 16
MAX_TIER_NAME = 32


def _status_tiers(data: dict[str, Any]) -> dict[str, dict[str, int]]:
    """status.tiers: at most 16 tiers named by identifiers, each with every level (``TIER_LEVELS``) as a
    count, 0 where it says none (a level this side does not know is dropped: a newer worker's extra one
    does not break the page).

    Rolling upgrade: a worker from before per-tier levels writes none, but one flat field per level of its
    fixed tiers, ``<tier>_<level>`` (``hbm_bytes``); those are read into the same shape. (An older control
    plane ignores ``tiers`` and shows no memory for a newer worker until it is upgraded too.)"""
    if "tiers" not in data:
        legacy: dict[str, dict[str, int]] = {}
        for name, (tier, level) in TIER_LEVEL_GAUGES.items():
            if name in data:
                legacy.setdefault(tier, dict.fromkeys(TIER_LEVELS, 0))[level] = _level(data, name, "status")
        return legacy
    tiers = data["tiers"]
    if not isinstance(tiers, dict) or len(tiers) > MAX_STATUS_TIERS:
        raise WireError(f"status.tiers must be an object of at most {MAX_STATUS_TIERS} tiers, got {repr(tiers)[:40]}")
    out = {}
    for name, levels in tiers.items():
        if not name.isidentifier() or len(name) > MAX_TIER_NAME:
            raise WireError(f"status.tiers: tier names are identifiers of at most {MAX_TIER_NAME} characters, "
                            f"got {name[:40]!r}")
        if not isinstance(levels, dict):
            raise WireError(f"status.tiers.{name} must be an object, got {type(levels).__name__}")
        out[name] = {level: _level(levels, level, f"status.tiers.{name}") if level in levels else 0
                     for level in TIER_LEVELS}
    return out


def _level(data: dict[str, Any], name: str, what: str) -> int:
    value = _typed(data, name, int, what)
    if value < 0:
        raise WireError(f"{what}.{name} must be at least 0, got {value}")
    return value
