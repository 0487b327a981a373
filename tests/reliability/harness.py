"""What the fault tests stand on: the real stack on a private Redis they may stop, and replayed load
whose every ranking request is accounted for.

- ``FaultStack``: ``tests.frontend.stack.Stack`` (gunicorn, real worker processes, the control
  plane's own services for set-up) on an ``EmbeddedRedis`` of its own, on a fixed port, so a test can
  stop, pause and restart it; plus the config sync loop ``manage.py relaygr_sync --interval`` that a
  deployment runs (the database is the source of truth, the loop repairs Redis).
- ``ReplayLoad``: ``workers.replay.Replayer`` playing a generated trace, chunk after chunk, until
  stopped, through a client that records every ranking request's outcome and how long it took.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sqlite3
import subprocess
import sys
import threading
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from relay_engine.core.lifetime import die_with_parent
from relay_engine.lab.traffic import TraceSpec, generate_trace
from tests.frontend.stack import POOL, REPO, Stack
from tests.workers.fleet import wait_for
from workers.client import RankDeadlineExceeded, RankError, RelayClient, RelayUnavailable
from workers.embedded_redis import EmbeddedRedis
from workers.membership import live_members
from workers.replay import Replayer

SYNC_INTERVAL_S = 1.0
# Time a ranking call may take past its deadline and the client's grace before it counts as hung:
# scheduling slack on a loaded 2-core machine, nothing more.
HANG_SLACK_S = 2.0

OK, DEADLINE, UNAVAILABLE = "ok", "deadline", "unavailable"


@dataclass(frozen=True)
class Outcome:
    user: str
    kind: str  # OK, DEADLINE, UNAVAILABLE, "error:<kind>" (a RankError), "exception:<type>" (a bug)
    instance: str | None
    started: float  # time.monotonic() when the call began
    elapsed_s: float
    budget_s: float  # deadline − start: what the caller allowed

    @property
    def clear(self) -> bool:
        """An answer, or an error the caller can act on: never an unexpected exception."""
        return self.kind in (OK, DEADLINE, UNAVAILABLE) or self.kind.startswith("error:")


class RecordingClient:
    """The client the replayer calls, passing through to ``RelayClient`` and recording each ranking
    request's outcome (the replayer only counts them)."""

    def __init__(self, client: RelayClient):
        self.client = client
        self.outcomes: list[Outcome] = []
        self._lock = threading.Lock()

    def pre_infer(self, user_id: str, **fields: Any) -> str:
        return self.client.pre_infer(user_id, **fields)

    def rank(self, user_id: str, *, deadline_s: float, **fields: Any):
        started, budget_s = time.monotonic(), deadline_s - time.time()
        instance, kind = None, OK
        try:
            reply = self.client.rank(user_id, deadline_s=deadline_s, **fields)
            instance = reply.instance
            return reply
        except RankDeadlineExceeded as exc:
            kind, instance = DEADLINE, exc.instance
            raise
        except RelayUnavailable:
            kind = UNAVAILABLE
            raise
        except RankError as exc:
            kind, instance = f"error:{exc.kind}", exc.instance
            raise
        except Exception as exc:
            kind = f"exception:{type(exc).__name__}: {exc}"
            raise
        finally:
            outcome = Outcome(user_id, kind, instance, started, time.monotonic() - started, budget_s)
            with self._lock:
                self.outcomes.append(outcome)

    def between(self, start: float, end: float = float("inf")) -> list[Outcome]:
        with self._lock:
            return [o for o in self.outcomes if start <= o.started < end]


class ReplayLoad:
    """Replays a generated trace against the pool until stopped (``workers.replay.Replayer`` on
    consecutive chunks of it), from a background thread."""

    CHUNK_S = 2.0

    def __init__(self, client: RelayClient, *, qps: float = 12.0, deadline_ms: float = 1000.0, seed: int = 9):
        self.client = RecordingClient(client)
        self.qps = qps
        self.deadline_ms = deadline_ms
        # Small users (a few hundred tokens at most) and a few dozen of them: repeats hit the cache,
        # and a CPU keeps up at this rate with three instances on two cores.
        self.queries = generate_trace(TraceSpec(
            queries=int(qps * 600), qps=qps, users=48, seq_len_median=64, seq_len_p99=384, seq_len_min=16,
            seq_len_max=512, short_len=4, n_candidates=16, seed=seed))
        self.summaries: list[dict] = []
        self.started_at = 0.0
        self.stopped_at = 0.0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> ReplayLoad:
        self.started_at = time.monotonic()
        self._thread = threading.Thread(target=self._run, name="replay-load", daemon=True)
        self._thread.start()
        return self

    def _run(self) -> None:
        chunk = max(1, int(self.qps * self.CHUNK_S))
        position = 0
        while not self._stop.is_set():
            queries = self.queries[position:position + chunk]
            position = (position + chunk) % (len(self.queries) - chunk)
            replayer = Replayer(self.client, queries, speed=1.0, deadline_ms=self.deadline_ms, threads=16,
                                progress=False)
            self.summaries.append(replayer.run().to_dict())

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(self.CHUNK_S + self.deadline_ms / 1000 + 10)
            assert not self._thread.is_alive(), "the replayer did not finish its last chunk: a request hung"
        self.stopped_at = time.monotonic()

    @property
    def outcomes(self) -> list[Outcome]:
        return self.client.between(0.0)

    def requests_per_s(self) -> float:
        end = self.stopped_at or time.monotonic()
        return len(self.outcomes) / max(1e-9, end - self.started_at)

    def lost(self, outcomes: list[Outcome] | None = None) -> list[Outcome]:
        """Requests that hung past deadline + grace (+ slack) or ended in an unexpected exception."""
        grace_s = self.client.client.grace_s
        outcomes = self.outcomes if outcomes is None else outcomes
        return [o for o in outcomes if not o.clear or o.elapsed_s > max(0.0, o.budget_s) + grace_s + HANG_SLACK_S]

    def kinds(self, outcomes: list[Outcome] | None = None) -> Counter:
        return Counter(o.kind for o in (self.outcomes if outcomes is None else outcomes))


class FaultStack(Stack):
    """The stack on a private Redis, with the sync loop; every part can be killed and restarted."""

    def __init__(self, workdir: Path, *, instances: int = 3):
        self.private_redis = EmbeddedRedis(workdir / "redis")
        self.private_redis.start()
        super().__init__(self.private_redis.url, workdir, instances=instances)
        self.sync: subprocess.Popen | None = None
        self.database = workdir / "controlplane.sqlite3"

    # --- Redis ------------------------------------------------------------------------------------

    def stop_redis(self) -> None:
        self.private_redis.stop()

    def start_redis(self) -> None:
        """The same server again on the same port: empty (no persistence), as after a crash."""
        self.private_redis.start()

    @contextlib.contextmanager
    def redis_paused(self):
        """Redis frozen (SIGSTOP): connections stay open, nothing answers; thawed on exit."""
        pid = self.private_redis.process.pid
        os.kill(pid, signal.SIGSTOP)
        try:
            yield
        finally:
            os.kill(pid, signal.SIGCONT)

    # --- the sync loop --------------------------------------------------------------------------

    def start_sync(self) -> None:
        log = (self.workdir / "sync.log").open("a")
        self.sync = subprocess.Popen([sys.executable, "manage.py", "relaygr_sync", "--interval", str(SYNC_INTERVAL_S)],
                                     cwd=REPO, env=self.env, stdout=log, stderr=subprocess.STDOUT,
                                     preexec_fn=die_with_parent())

    # --- workers ------------------------------------------------------------------------------------

    def kill_worker(self, name: str, sig: int = signal.SIGKILL) -> None:
        self.workers[name].send_signal(sig)
        self.workers[name].wait(30)

    def live(self) -> list[str]:
        return live_members(self.redis, self.worker_settings.keys)

    # --- the control plane's state ------------------------------------------------------------

    def db_pool(self) -> dict[str, int]:
        """The pool's row, read straight from the database file (whatever the web server is doing)."""
        with contextlib.closing(sqlite3.connect(self.database, timeout=10)) as db:
            row = db.execute("SELECT desired_generation, published_generation FROM policies_pool WHERE name = ?",
                             (POOL,)).fetchone()
        return {"desired_generation": row[0], "published_generation": row[1]}

    def publish(self, spec_changes: dict[str, dict], comment: str) -> int:
        """A new revision on the latest (the desired spec with ``spec_changes`` merged), published."""
        status, pool = self.api("GET", f"/api/v1/pools/{POOL}/")
        assert status == 200, pool
        status, live = self.api("GET", f"/api/v1/pools/{POOL}/revisions/{pool['desired_generation']}/")
        assert status == 200, live
        spec = {section: {**live["spec"].get(section, {}), **changes} for section, changes in spec_changes.items()}
        status, revision = self.api("POST", f"/api/v1/pools/{POOL}/revisions/", {
            "parent_generation": pool["latest_generation"], "spec": {**live["spec"], **spec}, "comment": comment})
        assert status == 201, revision
        status, published = self.api("POST", f"/api/v1/pools/{POOL}/revisions/{revision['generation']}/publish/")
        assert status == 200, published
        return revision["generation"]

    def pool_status(self) -> dict:
        status, body = self.api("GET", f"/api/v1/pools/{POOL}/status/")
        assert status == 200, body
        return body

    def converged_at(self, generation: int, instances: int) -> dict | None:
        status = self.pool_status()
        ok = (status["converged"] and status["desired_generation"] == generation
              and status["live_instances"] == instances)
        return status if ok else None

    def wait_converged(self, generation: int, instances: int, timeout_s: float = 60.0) -> dict:
        return wait_for(lambda: self.converged_at(generation, instances), timeout_s, interval_s=0.25,
                        what=f"{instances} live instance(s) ACKing generation {generation}")

    def stop(self) -> None:
        try:
            if self.sync is not None and self.sync.poll() is None:
                self.sync.terminate()
                self.sync.wait(10)
            if self.private_redis.process is None:
                self.private_redis.start()  # a test failed with Redis down: bring it back to clean up
            super().stop()
        finally:
            self.private_redis.stop()
