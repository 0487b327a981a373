"""The background side of one instance, around its engine: status and heartbeat, the config
reconciler, the telemetry publisher. ``workers.instance`` runs one beside its Celery worker;
``workers.loadfleet`` runs many around stand-in engines, so the control plane sees the same wire
traffic from either.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from typing import Any

import redis

from relay_engine.core.wire import TELEMETRY_TIERS, InstanceStatus, PoolKeys
from workers.membership import MembershipWatch, StatusBoard
from workers.periodic import Periodic
from workers.reconciler import Reconciler
from workers.revision_store import RevisionStore
from workers.telemetry_publisher import TelemetryPublisher, WorkerCounts

log = logging.getLogger(__name__)

# The publisher checks this often whether a telemetry period turned (it appends once per period).
TELEMETRY_CHECK_S = 0.2


class InstanceLoops:
    def __init__(self, engine: Any, client: redis.Redis, keys: PoolKeys, status: InstanceStatus,
                 gauges: Callable[[], dict[str, Any]], counts: WorkerCounts, heartbeat_interval_s: float,
                 store: RevisionStore, telemetry_tiers: tuple[str, ...] = tuple(TELEMETRY_TIERS)):
        self.board = StatusBoard(client, keys, status, gauges=gauges)
        self.reconciler = Reconciler(engine, client, keys, self.board, store)
        self.publisher = TelemetryPublisher(engine, client, keys, self.board, counts, status.started_at,
                                            telemetry_tiers)
        self.telemetry = Periodic("telemetry", TELEMETRY_CHECK_S, self.publisher.publish)
        self.membership = MembershipWatch(client, keys, status.instance, engine.set_rerouted_check)
        self.heartbeat = Periodic("heartbeat", heartbeat_interval_s, self._beat)
        self._next_heartbeat = math.inf  # when ``tick`` heartbeats next (after ``join(timers=False)``)

    def start(self, *, timers: bool = True) -> InstanceLoops:
        """Reconcile once (the desired revision applies before serving), then keep reconciling and
        publishing telemetry: on a timer thread of its own, or, with ``timers=False``, on each
        ``tick`` (one thread drives a load fleet's hundreds). Membership waits for ``join``."""
        self.reconciler.start()
        self._watch_membership()  # the baseline: the live set before this instance joins it
        if timers:
            self.telemetry.start()
        return self

    def join(self, *, timers: bool = True) -> None:
        """Start heartbeating: from now on clients route to this instance."""
        if timers:
            self.heartbeat.start()
        else:
            self.heartbeat.run_step()
            self._next_heartbeat = time.monotonic() + self.heartbeat.interval_s

    def tick(self) -> None:
        """What the timers do, once: telemetry if a period turned, the heartbeat if it is due."""
        self.telemetry.run_step()
        now = time.monotonic()
        if now >= self._next_heartbeat:
            self.heartbeat.run_step()
            self._next_heartbeat += self.heartbeat.interval_s
            if self._next_heartbeat <= now:  # after a stall: the beat again from now, no burst
                self._next_heartbeat = now + self.heartbeat.interval_s

    def _beat(self) -> None:
        self.board.heartbeat()
        self._watch_membership()

    def _watch_membership(self) -> None:
        try:
            self.membership.refresh()
        except redis.RedisError as exc:  # read again at the next beat; only the miss reasons wait
            log.warning("could not read the live set: %s", exc)

    def leave(self) -> None:
        """Leave the live set now (clean shutdown), so clients move this instance's users at once."""
        self.heartbeat.stop()
        try:
            self.board.leave()
        except redis.RedisError as exc:  # it drops out after the heartbeat timeout instead
            log.warning("could not leave the live set: %s", exc)

    def stop(self) -> None:
        self.leave()
        for loop in (self.telemetry, self.reconciler):
            loop.stop()
