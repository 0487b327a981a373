"""``/metrics``: the fleet's figures in Prometheus text format, one series per pool and instance.

Counters and the latency histogram are each instance's latest cumulative snapshot (the ``1s``
tier), so Prometheus sees counters that only grow within a run and reset at a restart, exactly
as it expects; each carries its run's start as ``_created`` (as ``relaygr_instance_start_time_seconds``
does), so a consumer that reads it tells a restart from growth even when the new run has counted
past the old value by the next scrape. Aggregate across instances in
PromQL with ``sum by (le)`` before ``histogram_quantile``. Latency is in seconds, as Prometheus
convention has it. Labels are ``pool``, ``instance``, ``tier``, ``reason`` and a rollout's
``state``: each bounded by the fleet's shape, none by its users. The rules and dashboards built
on these series: ``deploy/prometheus/`` and ``deploy/grafana/``.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable

import redis
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
)
from prometheus_client.exposition import generate_latest
from prometheus_client.registry import CollectorRegistry
from prometheus_client.utils import floatToGoString

from controlplane.common.errors import Unavailable
from controlplane.common.redis import get_redis
from controlplane.fleet.selectors import PoolStatus, pool_status
from controlplane.policies.models import Pool
from controlplane.policies.selectors import pool_list
from controlplane.rollouts.models import Rollout
from controlplane.rollouts.selectors import rollout_counts
from relay_engine.core.config import slo_of
from relay_engine.core.outcomes import TIER_COUNTERS, TIER_GAUGES
from relay_engine.core.telemetry import (
    COUNTERS,
    LATENCY_BUCKETS_MS,
    MISS_REASONS,
    REFUSAL_REASONS,
    TIER_LEVEL_GAUGES,
    Snapshot,
)
from relay_engine.core.wire import ACK, NACK, TELEMETRY_TIERS, PoolKeys

from .history import reporting_instances

LATEST_TIER = "1s"
_LE = [floatToGoString(bound / 1000.0) for bound in LATENCY_BUCKETS_MS] + ["+Inf"]
# The decided states a rollout ends in: a counter each (a baking rollout is the gauge).
ROLLOUT_DECISIONS = tuple(state for state in Rollout.State.values if state != Rollout.State.BAKING)


def _latest_snapshots(pool: str, now: float) -> list[Snapshot]:
    client = get_redis()
    keys = PoolKeys(pool)
    every_s, kept = TELEMETRY_TIERS[LATEST_TIER]
    names = reporting_instances(client, keys, since=now - every_s * kept)
    pipe = client.pipeline(transaction=False)
    for name in names:
        pipe.xrevrange(keys.telemetry(LATEST_TIER, name), max="+", min="-", count=1)
    snapshots = []
    for entries in pipe.execute() if names else []:
        if not entries:
            continue
        try:
            snapshots.append(Snapshot.from_entry(entries[0][1]["d"]))
        except (ValueError, KeyError):
            continue
    return snapshots


def fleet_state(pool: Pool, now: float) -> tuple[PoolStatus, list[Snapshot]]:
    """A pool's status and each reporting instance's latest snapshot, from Redis."""
    return pool_status(pool=pool, now=now), _latest_snapshots(pool.name, now)


class FleetCollector:
    """``state``: where each pool's status and snapshots come from (Redis's by default; the Prometheus
    benchmark hands in the ones it generates for each past scrape)."""

    def __init__(self, now: float | None = None,
                 state: Callable[[Pool, float], tuple[PoolStatus, list[Snapshot]]] = fleet_state):
        self.now = time.time() if now is None else now
        self.state = state

    def collect(self):
        pool_labels = ["pool"]
        inst_labels = ["pool", "instance"]
        desired = GaugeMetricFamily("relaygr_pool_desired_generation", "Desired config generation", labels=pool_labels)
        published = GaugeMetricFamily("relaygr_pool_published_generation",
                                      "Last generation written to Redis", labels=pool_labels)
        expected = GaugeMetricFamily("relaygr_pool_expected_instances", "Instances the pool should have",
                                     labels=pool_labels)
        live = GaugeMetricFamily("relaygr_pool_live_instances", "Instances with a fresh heartbeat", labels=pool_labels)
        converged = GaugeMetricFamily("relaygr_pool_converged", "1 when every live instance ACKed the desired "
                                      "generation", labels=pool_labels)
        slo = GaugeMetricFamily("relaygr_pool_slo_seconds", "Ranking P99 objective of the desired revision",
                                labels=pool_labels)
        slo_target = GaugeMetricFamily("relaygr_pool_slo_target_ratio", "Share of requests that must meet the "
                                       "objective (the error budget is 1 minus this)", labels=pool_labels)
        baking = GaugeMetricFamily("relaygr_pool_rollout_baking", "1 while a canary bakes", labels=pool_labels)
        decided = CounterMetricFamily("relaygr_pool_rollouts_decided", "Canary rollouts ended, by the state "
                                      "they ended in", labels=[*pool_labels, "state"])
        up = GaugeMetricFamily("relaygr_instance_up", "1 while the heartbeat is fresh", labels=inst_labels)
        heartbeat = GaugeMetricFamily("relaygr_instance_heartbeat_age_seconds", "Seconds since the last heartbeat",
                                      labels=inst_labels)
        applied = GaugeMetricFamily("relaygr_instance_applied_generation", "Config generation applied",
                                    labels=inst_labels)
        acked = GaugeMetricFamily("relaygr_instance_config_acked", "1 when the last config was ACKed",
                                  labels=inst_labels)
        nacked = GaugeMetricFamily("relaygr_instance_config_nacked", "1 when the last config was refused (NACK)",
                                   labels=inst_labels)
        # Each tier's levels as its status says them, ``relaygr_instance_<tier>_<level>`` (``…_hbm_bytes``).
        memory = {
            name: GaugeMetricFamily(f"relaygr_instance_{name}", f"{tier} cache tier {level.replace('_', ' ')}",
                                    labels=inst_labels)
            for name, (tier, level) in TIER_LEVEL_GAUGES.items()
        }
        started = GaugeMetricFamily("relaygr_instance_start_time_seconds", "Start of the run the counters count",
                                    labels=inst_labels)
        counters = {name: CounterMetricFamily(f"relaygr_{name}", f"{name.replace('_', ' ')}", labels=inst_labels)
                    for name in COUNTERS}
        # Every cache tier's figures, one series per tier: a new tier shows here with no code of its own.
        tier_labels = [*inst_labels, "tier"]
        tier_gauges = {name: GaugeMetricFamily(f"relaygr_tier_{name}", f"cache tier {name.replace('_', ' ')}",
                                               labels=tier_labels) for name in TIER_GAUGES}
        tier_counters = {name: CounterMetricFamily(f"relaygr_tier_{name}", f"cache tier {name.replace('_', ' ')}",
                                                   labels=tier_labels) for name in TIER_COUNTERS}
        refusals = CounterMetricFamily("relaygr_preinfer_refusals", "Pre-infer signals refused, by reason",
                                       labels=[*inst_labels, "reason"])
        # Every miss under one reason: they sum to ``relaygr_misses_total``.
        misses = CounterMetricFamily("relaygr_rank_misses", "Ranking requests whose prefix was in no cache tier, "
                                     "by reason", labels=[*inst_labels, "reason"])
        latency = HistogramMetricFamily("relaygr_rank_latency_seconds", "Ranking latency", labels=inst_labels)
        redis_up = GaugeMetricFamily("relaygr_redis_up", "1 when the control plane reaches Redis")

        reachable = 1
        rollouts = rollout_counts()
        for pool in pool_list():
            desired.add_metric([pool.name], pool.desired_generation)
            published.add_metric([pool.name], pool.published_generation)
            expected.add_metric([pool.name], pool.expected_instances)
            objective = slo_of(pool.desired_spec)
            if objective.p99_ms is not None:
                slo.add_metric([pool.name], objective.p99_ms / 1000.0)
            if objective.target_ratio is not None:
                slo_target.add_metric([pool.name], objective.target_ratio)
            states = rollouts.get(pool.name, {})
            baking.add_metric([pool.name], states.get(Rollout.State.BAKING, 0))
            for state in ROLLOUT_DECISIONS:
                decided.add_metric([pool.name, state], states.get(state, 0), created=pool.created_at.timestamp())
            if not reachable:
                continue
            try:
                status, snapshots = self.state(pool, self.now)
            except (Unavailable, redis.RedisError):
                reachable = 0
                continue
            live.add_metric([pool.name], status.live_instances)
            converged.add_metric([pool.name], int(status.converged))
            for view in status.instances:
                labels = [pool.name, view.instance]
                up.add_metric(labels, int(view.live))
                if view.heartbeat_age_s is not None:
                    heartbeat.add_metric(labels, view.heartbeat_age_s)
                applied.add_metric(labels, view.status.applied_generation)
                acked.add_metric(labels, int(view.status.config_state == ACK))
                nacked.add_metric(labels, int(view.status.config_state == NACK))
                for name, (tier, level) in TIER_LEVEL_GAUGES.items():
                    if level in view.status.tiers.get(tier, {}):
                        memory[name].add_metric(labels, view.status.tiers[tier][level])
            for snap in snapshots:
                labels = [pool.name, snap.instance]
                run = snap.started_at
                started.add_metric(labels, run)
                for name in COUNTERS:
                    counters[name].add_metric(labels, snap.counters.get(name, 0), created=run)
                for reason in REFUSAL_REASONS:
                    refusals.add_metric([*labels, reason], snap.refusals.get(reason, 0), created=run)
                for reason in MISS_REASONS:
                    misses.add_metric([*labels, reason], snap.misses.get(reason, 0), created=run)
                for tier, figures in snap.tiers.items():
                    for name, family in tier_gauges.items():
                        family.add_metric([*labels, tier], figures.get(name, 0))
                    for name, family in tier_counters.items():
                        family.add_metric([*labels, tier], figures.get(name, 0), created=run)
                cumulative, buckets = 0, []
                for le, count in zip(_LE, snap.rank_latency.counts, strict=True):
                    cumulative += count
                    buckets.append((le, cumulative))
                latency_sum = snap.rank_latency.sum_ms / 1000.0
                latency.add_metric(labels, buckets, latency_sum if math.isfinite(latency_sum) else 0.0)
                # HistogramMetricFamily.add_metric takes no ``created``; the sample is what it would add.
                latency.add_sample(f"{latency.name}_created", dict(zip(inst_labels, labels, strict=True)), run)
        redis_up.add_metric([], reachable)
        yield from (desired, published, expected, live, converged, slo, slo_target, baking, decided, up, heartbeat,
                    applied, acked, nacked,
                    *memory.values(), started, *counters.values(), *tier_gauges.values(), *tier_counters.values(),
                    refusals, misses, latency, redis_up)


def exposition(now: float | None = None) -> bytes:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(FleetCollector(now))
    return generate_latest(registry)
