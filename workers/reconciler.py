"""The config reconciler: converge the engine on the pool's desired revision, level-based.

On a poke (``PoolKeys.poke_channel``) *and* every ``period_s`` it reads ``PoolKeys.desired``, so
a missed poke delays convergence by at most one period. A new generation is validated with the
engine's own schema (``parse_policy``) and its sha256 checked, then applied with
``RelayEngine.apply_policy`` (atomic, between requests). The outcome goes straight into the
instance's status: ACK with ``applied_generation``, or NACK with ``nacked_generation`` and the
error while the last good configuration keeps serving. A refused generation is not retried; the
next one published is.
"""

from __future__ import annotations

import logging
import threading

import redis

from relay_engine.core.config import PolicyError, parse_policy
from relay_engine.core.engine import PolicyApplyError, RelayEngine
from relay_engine.core.wire import ACK, NACK, DesiredRevision, InstanceStatus, PoolKeys, WireError
from workers.membership import StatusBoard
from workers.periodic import Periodic

log = logging.getLogger(__name__)

RECONCILE_PERIOD_S = 1.0


class Reconciler:
    def __init__(self, engine: RelayEngine, client: redis.Redis, keys: PoolKeys, board: StatusBoard,
                 period_s: float = RECONCILE_PERIOD_S):
        self.engine = engine
        self.client = client
        self.keys = keys
        self.board = board
        self.period_s = period_s
        self._pubsub: redis.client.PubSub | None = None
        self._loop = Periodic("reconciler", period_s, self.reconcile, wait=self._wait_for_poke)
        self._lock = threading.Lock()  # a poke and the initial reconcile never apply concurrently

    def reconcile(self) -> InstanceStatus:
        """One level-based pass: read the desired revision, apply it if it is new, report."""
        raw = self.client.get(self.keys.desired)
        with self._lock:
            current = self.board.current()
            if raw is None:
                return current
            try:
                desired = DesiredRevision.from_json(raw)
            except WireError as exc:
                return self._refuse(current, 0, f"desired revision in Redis is malformed: {exc}")
            if desired.generation == current.applied_generation and desired.sha256 == current.applied_sha256:
                return current
            if desired.generation == current.nacked_generation:
                return current
            return self._apply(current, desired)

    def _apply(self, current: InstanceStatus, desired: DesiredRevision) -> InstanceStatus:
        try:
            spec = parse_policy(desired.spec)
            if spec.sha256() != desired.sha256:
                return self._refuse(current, desired.generation,
                                    f"sha256: the revision says {desired.sha256}, its spec hashes to {spec.sha256()}")
            self.engine.apply_policy(spec)
        except (PolicyError, PolicyApplyError) as exc:
            return self._refuse(current, desired.generation, str(exc))
        log.info("applied generation %d (sha256 %s)", desired.generation, desired.sha256[:12])
        stats = self.engine.stats()
        return self.board.publish(
            applied_generation=desired.generation, applied_sha256=desired.sha256, config_state=ACK,
            nacked_generation=0, error="", hbm_budget_bytes=stats.hbm_budget_bytes,
            dram_budget_bytes=stats.dram_budget_bytes,
        )

    def _refuse(self, current: InstanceStatus, generation: int, error: str) -> InstanceStatus:
        if (current.config_state, current.nacked_generation, current.error) != (NACK, generation, error):
            log.warning("refused generation %d, keeping generation %d: %s",
                        generation, current.applied_generation, error)
        return self.board.publish(config_state=NACK, nacked_generation=generation, error=error)

    # --- the loop ----------------------------------------------------------------------------

    def start(self) -> Reconciler:
        """A first pass now (the desired revision applies before serving), then the loop."""
        self._loop.run_step()
        self._loop.start()
        return self

    def stop(self, timeout_s: float = 5.0) -> None:
        self._loop.stop(timeout_s)
        if self._pubsub is not None:
            self._pubsub.close()

    def _wait_for_poke(self, timeout_s: float) -> None:
        """Sleep up to ``timeout_s``; a poke on the pool's channel ends the wait early."""
        try:
            if self._pubsub is None:
                self._pubsub = self.client.pubsub(ignore_subscribe_messages=True)
                self._pubsub.subscribe(self.keys.poke_channel)
            self._pubsub.get_message(timeout=timeout_s)
        except redis.RedisError:
            # Subscription lost: the periodic pass still converges; resubscribe on the next wait.
            if self._pubsub is not None:
                self._pubsub.close()
            self._pubsub = None
            self._loop.stopped.wait(timeout_s)
