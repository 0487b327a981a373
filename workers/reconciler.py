"""The config reconciler: converge the engine on the pool's desired revision, level-based.

On a poke (``PoolKeys.poke_channel``) *and* every ``period_s`` it reads ``PoolKeys.desired`` and the
instance's own ``PoolKeys.instance_desired`` (one MGET), so a missed poke delays convergence by at most
one period. The instance's own record, when there is one (a canary baking), is the one it runs. A new record is decoded strictly, its spec
validated with the engine's own schema (``parse_policy``) and its sha256 checked, then applied with
``RelayEngine.apply_policy`` (atomic, between requests) and kept on local disk (``RevisionStore``).
The outcome goes straight into the instance's status (``config_state``):

- **ACK**: the desired revision is applied (``applied_generation``/``applied_sha256``).
- **NACK**: the desired record was refused (``nacked_generation``, ``error``); the last applied
  revision keeps serving. A refusal is remembered by (generation, digest of the record), so the same
  record is not judged again every second, while a record rewritten under the same generation (a
  repaired spec) is. A generation older than the applied one is refused and reported, never applied
  silently: generations only grow, so an older one means a stale Redis or a reset database — except
  when the pool's record lists the applied generation as ``revoked`` (a canary rolled back, see
  ``wire``): then the instance steps down to the pool's generation.
- **PENDING**: the desired revision is not known yet. ``error`` then says what the engine serves
  meanwhile: the revision restored from disk, or nothing (see below).

What the engine serves before the desired revision is read: the last applied revision from disk when
there is one (PENDING, "serving generation N from local disk"); with none, nothing — ``known`` stays
unset and the instance does not join the live set (``workers.instance`` waits for it), so no request
meets schema defaults standing in for a revision the instance has not seen. Once it has seen the
desired revision it serves, even if it refused it: then the last applied, or, if it never applied
one, the schema's defaults, with the NACK and its reason showing on the pool status.
"""

from __future__ import annotations

import hashlib
import logging
import threading

import redis

from relay_engine.core.config import DigestMismatch, PolicyError, revision_policy
from relay_engine.core.engine import PolicyApplyError, RelayEngine
from relay_engine.core.wire import ACK, NACK, PENDING, DesiredRevision, InstanceStatus, PoolKeys, WireError
from workers.membership import StatusBoard
from workers.periodic import Periodic
from workers.revision_store import RevisionStore

log = logging.getLogger(__name__)

RECONCILE_PERIOD_S = 1.0


class Reconciler:
    def __init__(self, engine: RelayEngine, client: redis.Redis, keys: PoolKeys, board: StatusBoard,
                 store: RevisionStore, period_s: float = RECONCILE_PERIOD_S):
        self.engine = engine
        self.client = client
        self.keys = keys
        self.board = board
        self.store = store
        self.period_s = period_s
        # Set once the engine serves a revision it may serve: restored from disk, or the desired one seen.
        self.known = threading.Event()
        self._refused: tuple[int, str, str] | None = None  # (generation, record digest, error) of the last refusal
        self._pubsub: redis.client.PubSub | None = None
        self._loop = Periodic("reconciler", period_s, self.reconcile, wait=self._wait_for_poke)
        self._lock = threading.Lock()  # a poke and the initial reconcile never apply concurrently

    def reconcile(self) -> InstanceStatus:
        """One level-based pass: read the desired revision, apply it if it is new, report."""
        instance = self.board.current().instance
        pool_raw, own_raw = self.client.mget(self.keys.desired, self.keys.instance_desired(instance))
        raw = pool_raw if own_raw is None else own_raw
        with self._lock:
            current = self.board.current()
            if raw is None:
                return self._report(current, config_state=PENDING, nacked_generation=0,
                                    error=self._waiting_note(current))
            digest = hashlib.sha256(raw if isinstance(raw, bytes) else raw.encode()).hexdigest()
            which = "desired revision" if own_raw is None else f"desired revision of {instance}"
            try:
                desired = DesiredRevision.from_json(raw)
            except WireError as exc:
                return self._refuse(current, 0, digest, f"{which} in Redis is malformed: {exc}")
            if (desired.generation, desired.sha256) == (current.applied_generation, current.applied_sha256):
                self.known.set()
                return self._report(current, config_state=ACK, nacked_generation=0, error="")
            if self._refused is not None and self._refused[:2] == (desired.generation, digest):
                return self._report(current, config_state=NACK, nacked_generation=desired.generation,
                                    error=self._refused[2])
            stepping_down = own_raw is None and desired.may_step_down(current.applied_generation)
            if desired.generation < current.applied_generation and not stepping_down:
                return self._refuse(current, desired.generation, digest, (
                    f"generation {desired.generation} is older than the applied generation "
                    f"{current.applied_generation}; generations only grow, so this is a stale Redis or a reset "
                    f"database. Not applied: publish a newer generation, or remove {self.store.path} and restart "
                    "the instance to accept it."))
            return self._apply(current, desired, digest)

    def _apply(self, current: InstanceStatus, desired: DesiredRevision, digest: str) -> InstanceStatus:
        try:
            spec = revision_policy(desired.spec, desired.sha256)
            self.engine.apply_policy(spec)
        except (PolicyError, PolicyApplyError, DigestMismatch) as exc:
            return self._refuse(current, desired.generation, digest, str(exc))
        log.info("applied generation %d (sha256 %s)", desired.generation, desired.sha256[:12])
        self.store.save(desired)
        self._refused = None
        self.known.set()
        stats = self.engine.stats()
        return self.board.publish(
            applied_generation=desired.generation, applied_sha256=desired.sha256, config_state=ACK,
            nacked_generation=0, error="", tiers=stats.tier_levels(),
        )

    def _refuse(self, current: InstanceStatus, generation: int, digest: str, error: str) -> InstanceStatus:
        if self._refused != (generation, digest, error):
            log.warning("refused generation %d, keeping generation %d: %s",
                        generation, current.applied_generation, error)
        self._refused = (generation, digest, error)
        if generation:  # a decodable desired revision was seen: the instance may serve (see the module doc)
            self.known.set()
        return self._report(current, config_state=NACK, nacked_generation=generation, error=error)

    def _waiting_note(self, current: InstanceStatus) -> str:
        where = f"no desired revision in Redis ({self.keys.desired}); "
        if current.applied_generation:
            return where + f"serving generation {current.applied_generation}, the last applied, until there is one"
        return where + "not serving until there is one"

    def _report(self, current: InstanceStatus, **fields) -> InstanceStatus:
        """Write the status when something in it changes (the heartbeat rewrites it anyway)."""
        if all(getattr(current, name) == value for name, value in fields.items()):
            return current
        return self.board.publish(**fields)

    # --- start-up ------------------------------------------------------------------------------

    def restore(self) -> None:
        """Apply the last applied revision from disk, if there is a usable one (before Redis is read)."""
        revision = self.store.load()
        try:
            if revision is not None:
                self.engine.apply_policy(revision_policy(revision.spec, revision.sha256))
        except (PolicyError, PolicyApplyError, DigestMismatch) as exc:
            log.warning("the last applied revision in %s cannot be applied: %s", self.store.path, exc)
            revision = None
        if revision is None:
            self.board.update(config_state=PENDING, error="no revision known yet: not serving until there is one")
            return
        log.info("restored generation %d from %s", revision.generation, self.store.path)
        stats = self.engine.stats()
        self.board.update(
            applied_generation=revision.generation, applied_sha256=revision.sha256, config_state=PENDING,
            error=f"serving generation {revision.generation} from local disk until the desired revision is read",
            tiers=stats.tier_levels())
        self.known.set()

    # --- the loop ----------------------------------------------------------------------------

    def start(self) -> Reconciler:
        """Restore from disk, a first pass now (the desired revision applies before serving), then the loop."""
        self.restore()
        self._loop.run_step()
        self._loop.start()
        return self

    def wait_until_known(self, on_wait=None, every_s: float = 10.0) -> None:
        """Block until the instance has a revision it may serve; ``on_wait()`` every ``every_s`` meanwhile."""
        while not self.known.wait(every_s):
            if on_wait is not None:
                on_wait()

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
