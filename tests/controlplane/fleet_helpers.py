"""A stand-in for a worker's reconciler and telemetry publisher, speaking only the wire contract.

It reads the desired revision from Redis, validates it with the engine's own ``parse_policy``,
and reports ACK (or NACK with the error, keeping the last good generation) as ``InstanceStatus``,
with a heartbeat in the pool's members set; it also appends telemetry snapshots. Everything goes
through ``relay_engine.core.wire`` key names, exactly as the real workers do; snapshots are written
by the workers' own ``TelemetryWriter`` (streams, pool rollups, reporting set).
"""

from __future__ import annotations

import time

import redis

from relay_engine.core.config import PolicyError, parse_policy
from relay_engine.core.outcomes import Outcome
from relay_engine.core.telemetry import LatencyHistogram, Snapshot
from relay_engine.core.wire import DesiredRevision, InstanceStatus, PoolKeys, instance_name
from workers.telemetry_publisher import TelemetryWriter


class FakeWorker:
    def __init__(self, client: redis.Redis, pool: str, index: int = 0, *, prefix: str, device: str = "cpu"):
        self.client = client
        self.keys = PoolKeys(pool, prefix=prefix)
        self.status = InstanceStatus(
            instance=instance_name(pool, index), pool=pool, device=device, pid=10_000 + index,
            heartbeat_ts=time.time(), started_at=time.time(),
        )
        self.writer = TelemetryWriter(client, self.keys)

    @property
    def name(self) -> str:
        return self.status.instance

    def heartbeat(self, at: float | None = None) -> None:
        self.status.heartbeat_ts = time.time() if at is None else at
        self.client.zadd(self.keys.members, {self.name: self.status.heartbeat_ts})
        self.client.set(self.keys.status(self.name), self.status.to_json())

    def reconcile(self, at: float | None = None) -> InstanceStatus:
        """Its own desired record (a canary's) before the pool's; never down a generation unless revoked."""
        pool_raw, own_raw = self.client.mget(self.keys.desired, self.keys.instance_desired(self.name))
        raw = own_raw or pool_raw
        if raw is not None:
            desired = DesiredRevision.from_json(raw)
            older = desired.generation < self.status.applied_generation
            if older and (own_raw is not None or not desired.may_step_down(self.status.applied_generation)):
                self.status.config_state = "NACK"
                self.status.nacked_generation = desired.generation
                self.status.error = "older than the applied generation"
            elif desired.generation != self.status.applied_generation:
                try:
                    spec = parse_policy(desired.spec)
                except PolicyError as exc:
                    self.status.config_state = "NACK"
                    self.status.nacked_generation = desired.generation
                    self.status.error = str(exc)
                else:
                    self.status.applied_generation = desired.generation
                    self.status.applied_sha256 = spec.sha256()
                    self.status.tiers = {tier: {"bytes": 0, "budget_bytes": budget} for tier, budget in
                                         ((Outcome.HBM, spec.cache.hbm_budget_bytes),
                                          (Outcome.DRAM, spec.cache.dram_budget_bytes))}
                    self.status.config_state = "ACK"
                    self.status.error = ""
        self.heartbeat(at)
        return self.status

    def publish_snapshot(self, snapshot: Snapshot, tier: str = "1s") -> None:
        self.writer.write(snapshot, [tier])


def snapshot(instance: str, ts: float, started_at: float, *, latencies_ms=(), **counters) -> Snapshot:
    hist = LatencyHistogram()
    for value in latencies_ms:
        hist.record(value)
    refusals = counters.pop("refusals", {})
    misses = counters.pop("miss_reasons", {})  # ``misses`` itself is the counter
    gauges = {k: counters.pop(k) for k in ("hbm_bytes", "hbm_budget_bytes", "applied_generation", "slo_ms")
              if k in counters}
    return Snapshot(instance=instance, ts=ts, started_at=started_at, counters=dict(counters), refusals=refusals,
                    misses=misses, rank_latency=hist, **gauges)
