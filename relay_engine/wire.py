"""Where the control plane and the workers meet: Redis key names and message shapes.

``controlplane`` and ``workers`` never import each other; both import this module, which is plain
string formatting and JSON shapes (no Redis client here). Every name carries a key prefix so
several deployments, or several test runs, can share one Redis without colliding.

Keys (``P`` = prefix, ``pool`` = pool name, ``inst`` = instance name ``<pool>.<index>``):

| key | type | written by | content |
| --- | --- | --- | --- |
| ``P:pools`` | set | control plane | pool names known to the fleet |
| ``P:pool:{pool}:desired`` | string | control plane | JSON ``DesiredRevision`` |
| ``P:pool:{pool}:poke`` | pub/sub channel | control plane | the desired generation, as text |
| ``P:pool:{pool}:members`` | sorted set | workers | inst → last heartbeat (unix s) |
| ``P:pool:{pool}:status:{inst}`` | string, TTL | workers | JSON ``InstanceStatus`` |
| ``P:pool:{pool}:telemetry:{tier}:{inst}`` | stream, MAXLEN | workers | field ``d``: JSON ``Snapshot`` |

Celery queues: ``P.{inst}.rank`` and ``P.{inst}.preinfer`` (ranking never waits behind pre-infer).
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import asdict, dataclass, field
from typing import Any

DEFAULT_KEY_PREFIX = "relaygr"
KEY_PREFIX_ENV = "RELAYGR_KEY_PREFIX"

HEARTBEAT_INTERVAL_S = 1.0
HEARTBEAT_TIMEOUT_S = 5.0  # an instance silent this long leaves the live set; its users move
STATUS_TTL_S = 3600  # a dead instance's last status stays readable for an hour

# Telemetry tiers: name → (seconds between snapshots, snapshots kept). 1 s for the last 10 min,
# 10 s for 2 h, 60 s for 25 h: a 24 h chart of 8 instances merges ~12k small snapshots.
TELEMETRY_TIERS: dict[str, tuple[int, int]] = {"1s": (1, 600), "10s": (10, 720), "60s": (60, 1500)}

NAME_RE = re.compile(r"^[a-z0-9][a-z0-9_-]{0,62}$")


def key_prefix() -> str:
    return os.environ.get(KEY_PREFIX_ENV, DEFAULT_KEY_PREFIX)


def instance_name(pool: str, index: int) -> str:
    return f"{pool}.{index}"


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

    def rank_queue(self, instance: str) -> str:
        return f"{self.prefix}.{instance}.rank"

    def preinfer_queue(self, instance: str) -> str:
        return f"{self.prefix}.{instance}.preinfer"


def pools_key(prefix: str | None = None) -> str:
    return f"{prefix or key_prefix()}:pools"


@dataclass(frozen=True)
class DesiredRevision:
    generation: int
    sha256: str
    spec: dict[str, Any]
    published_at: float
    published_by: str = ""

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, raw: str | bytes) -> DesiredRevision:
        data = json.loads(raw)
        return cls(
            generation=int(data["generation"]),
            sha256=str(data["sha256"]),
            spec=dict(data["spec"]),
            published_at=float(data.get("published_at", 0.0)),
            published_by=str(data.get("published_by", "")),
        )


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
    # "ACK" when the last desired revision seen was applied; "NACK" when it was refused (the last
    # good one keeps running and ``error`` says why); "PENDING" before the first reconcile.
    config_state: str = "PENDING"
    nacked_generation: int = 0
    error: str = ""
    hbm_bytes: int = 0
    hbm_budget_bytes: int = 0
    dram_bytes: int = 0
    dram_budget_bytes: int = 0
    device_memory_bytes: int = 0

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, raw: str | bytes) -> InstanceStatus:
        data = json.loads(raw)
        known = {f for f in cls.__dataclass_fields__}
        return cls(**{k: v for k, v in data.items() if k in known})
