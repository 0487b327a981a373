"""The product path: the benchmark's paired windows replayed through ``workers.client.RelayClient`` →
Redis → real worker instances (``python -m workers.instance``, started by ``workers.pool``'s
supervisor), each mode a published policy.

What a user gets is what the workers deliver, so this is the headline fleet (``--fleet product``).
Every mode is a ``modes.served_policy`` published as the control plane publishes one: a new
generation of the pool's desired revision in Redis and a poke; a point waits until every instance
has ACKed it. The instances serve the bench's model (its seeded weights written to a file, as
``python -m relay_engine.import_gr`` writes one), on the CPU, with the bench's rank and torch threads.

A window replays the same events as the lab fleet's (``workload.schedule``: same queries, same
arrival schedule, same deadlines): pre-infer signals and ranking requests are sent by one dispatcher
at their scheduled instants, the client routing each user (rendezvous over the live members) unless
the mode routes at random (``workload.route``'s choice, then sent to that instance). A ranking
request's latency runs from its scheduled arrival to its answer at the client, so the dispatcher's
lateness and every Redis hop count; a deadline error counts at its latency, as on the lab fleet.

Priming: the lab fleet starts a relay mode's window with its tiers as serving the window's primed
part (one entry TTL of the trace before it) would leave them, inserted without a forward pass. The
workers have no such door, and should not: here the primed part's prefixes are left behind the way
serving leaves them, by a ranking request each (a miss keeps the prefix it computed), one token of
short-term history and one candidate, sent to the instance its router picks (``prime``). Only the
newest distinct prefixes that fill an instance's HBM and DRAM budgets are sent: older ones would be
evicted by these anyway. Without it every window started cold, and 17 points fewer of the measured
requests found their user's prefix seen before (the default trace: 45 % against 62 % primed).

What differs from the lab fleet, by design or not yet done: instances are long-lived, so each window
starts by publishing the baseline policy (no cache: the tiers are freed) and then the mode's, instead
of a fresh engine; priming fills HBM and DRAM, never the disk tier below them; instances are not
pinned to cores; the tiers' peaks stay in the workers' telemetry. Pre-infer admissions and refusals
are read back from it (``admissions_between``): the difference of each instance's cumulative counters
between its last one-second snapshot before the window's first measured event and its first after the
last answer, so they count to within a second of the measured part (the lab fleet counts each
measured signal).
"""

from __future__ import annotations

import contextlib
import functools
import os
import shutil
import subprocess
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from pathlib import Path

from relay_engine.core.config import PolicySpec
from relay_engine.core.model import HSTUModel
from relay_engine.core.telemetry import Snapshot
from relay_engine.core.wire import ACK, LIVE_TIER, NACK, DesiredRevision, InstanceStatus, instance_name
from relay_engine.lab.bench.instances import START_MARGIN_S
from relay_engine.lab.bench.measure import RealMeasure
from relay_engine.lab.bench.modes import MODES_BY_NAME, Mode, served_policy
from relay_engine.lab.bench.settings import BenchSettings
from relay_engine.lab.bench.workload import (
    Event,
    InstanceReport,
    Window,
    primed_routes,
    route,
    schedule,
    window_rng,
)
from workers.app import redis_client
from workers.client import PendingRank, RankDeadlineExceeded, RelayClient, RelayError
from workers.embedded_redis import EmbeddedRedis
from workers.payloads import RankPayload
from workers.pool import PoolSupervisor, wait_until_live
from workers.settings import Settings

START_TIMEOUT_S = 120.0
PRIME_DEADLINE_S = 120.0  # a priming request's deadline: it must leave its prefix, not be fast
PRIME_SETTLE_S = 1.0  # after the last priming answer: demotions down the tiers finish in the background
SNAPSHOT_WAIT_S = 5.0  # for each instance's first telemetry snapshot after a window (one a second)
CONVERGE_TIMEOUT_S = 30.0
PUBLISHED_BY = "relay_engine.bench"
WAITERS = 64  # threads awaiting answers: ranking requests in flight at once
ERROR = "error"  # the outcome of a ranking request the product answered with an error other than a deadline
BASELINE = MODES_BY_NAME["baseline"]


class ProductFleet:
    """A pool of real worker instances on a Redis (``REDIS_URL``, else a private embedded one), with
    the control plane's side of the wire: publish a policy and wait for every instance's ACK."""

    def __init__(self, settings: BenchSettings, *, redis_url: str | None = None):
        self.settings = settings
        self.workdir = Path(tempfile.mkdtemp(prefix="relaygr-product-"))
        self._stack = ExitStack()
        try:
            self._start(settings, redis_url or os.environ.get("REDIS_URL"))
        except BaseException:
            self.close()
            raise

    def _start(self, s: BenchSettings, redis_url: str | None) -> None:
        self._redis_pids: list[int] = []  # a private server's, watched with the instances (host.HostMonitor)
        if not redis_url:
            server = self._stack.enter_context(EmbeddedRedis(self.workdir / "redis"))
            redis_url, self._redis_pids = server.url, [server.process.pid]
        model = HSTUModel(s.model)
        weights = self.workdir / "model.pt"
        model.save(weights, source={"written_by": PUBLISHED_BY})
        self.model_version = model.version
        self.prefix_nbytes = functools.partial(model.prefix_nbytes, with_timestamps=s.with_timestamps)
        self.worker = Settings.from_env(
            {}, redis_url=redis_url, key_prefix=f"bench-{uuid.uuid4().hex[:10]}", pool="bench",
            pool_size=s.instances, device="cpu", model=str(weights), rank_threads=s.rank_threads,
            torch_threads=s.threads_per_instance, data_dir=str(self.workdir / "state"))
        self.keys = self.worker.keys
        self.names = [instance_name(self.worker.pool, i) for i in range(s.instances)]
        self.redis = redis_client(self.worker)
        self._stack.callback(self._forget_keys)
        self.generation = 0
        self.publish(PolicySpec(), wait=False)  # a new pool's first revision: the schema's defaults
        self.log_path = self.workdir / "instances.log"
        log = self._stack.enter_context(self.log_path.open("w"))
        self.supervisor = PoolSupervisor(self.worker, stdout=log, stderr=subprocess.STDOUT)
        self._stack.callback(self.supervisor.stop)
        for index in range(s.instances):
            self.supervisor.start(index)
        wait_until_live(self.redis, self.worker, self.names, START_TIMEOUT_S, list(self.supervisor.procs.values()))
        self.client = self._stack.enter_context(RelayClient(self.worker))
        self.client.refresh()

    @property
    def pids(self) -> list[int]:
        """The processes a point runs in: the instances, and the private Redis when there is one."""
        return [*(p.pid for p in self.supervisor.procs.values()), *self._redis_pids]

    # --- the control plane's side of the wire --------------------------------------------------

    def publish(self, policy: PolicySpec, *, wait: bool = True) -> int:
        """Publish ``policy`` as the pool's next generation (desired revision + poke); with ``wait``,
        return once every instance has ACKed it (RuntimeError naming a NACK)."""
        self.generation += 1
        revision = DesiredRevision(self.generation, policy.sha256(), policy.to_dict(), time.time(), PUBLISHED_BY)
        pipe = self.redis.pipeline(transaction=False)
        pipe.set(self.keys.desired, revision.to_json())
        pipe.publish(self.keys.poke_channel, str(revision.generation))
        pipe.execute()
        if wait:
            self._converge(revision)
        return revision.generation

    def statuses(self) -> dict[str, InstanceStatus]:
        raw = self.redis.mget([self.keys.status(n) for n in self.names])
        return {n: InstanceStatus.from_json(r) for n, r in zip(self.names, raw, strict=True) if r is not None}

    def _converge(self, revision: DesiredRevision) -> None:
        deadline = time.monotonic() + CONVERGE_TIMEOUT_S
        while True:
            statuses = self.statuses()
            nacked = [st for st in statuses.values()
                      if st.config_state == NACK and st.nacked_generation == revision.generation]
            if nacked:
                raise RuntimeError(f"{nacked[0].instance} refused generation {revision.generation}: {nacked[0].error}")
            if len(statuses) == len(self.names) and all(
                    (st.applied_generation, st.applied_sha256, st.config_state) == (revision.generation, revision.sha256,
                                                                                   ACK) for st in statuses.values()):
                return
            if time.monotonic() > deadline:
                raise TimeoutError(f"generation {revision.generation} not ACKed by every instance within "
                                   f"{CONVERGE_TIMEOUT_S:g} s (instances' log: {self.log_path})")
            time.sleep(0.01)

    def _snapshot_at(self, instance: str, *, before_ms: int | None = None, after_ms: int | None = None
                     ) -> Snapshot | None:
        """The instance's last one-second telemetry snapshot at or before ``before_ms``, or its first at
        or after ``after_ms`` (stream ids are the publishing time, as the control plane reads them)."""
        key = self.keys.telemetry(LIVE_TIER, instance)
        entries = self.redis.xrevrange(key, max=str(before_ms), min="-", count=1) if before_ms is not None \
            else self.redis.xrange(key, min=str(after_ms), max="+", count=1)
        try:
            return Snapshot.from_entry(entries[0][1]["d"]) if entries else None
        except (KeyError, ValueError):
            return None

    def admissions_between(self, since_s: float, until_s: float) -> dict[str, tuple[int, dict[str, int]]]:
        """Per instance: pre-inferences admitted and refusals by reason between its last snapshot at or
        before ``since_s`` and its first at or after ``until_s`` (unix s; waits for that one up to
        ``SNAPSHOT_WAIT_S``). An instance without both, or whose counters went back (a restart), is left out."""
        found: dict[str, tuple[int, dict[str, int]]] = {}
        deadline = time.monotonic() + SNAPSHOT_WAIT_S
        for name in self.names:
            a = self._snapshot_at(name, before_ms=int(since_s * 1000))
            b = self._snapshot_at(name, after_ms=int(until_s * 1000))
            while a is not None and b is None and time.monotonic() < deadline:
                time.sleep(0.2)
                b = self._snapshot_at(name, after_ms=int(until_s * 1000))
            if a is None or b is None:
                continue
            admitted = b.counters.get("preinfer_admitted", 0) - a.counters.get("preinfer_admitted", 0)
            refused = {r: b.refusals.get(r, 0) - a.refusals.get(r, 0) for r in b.refusals}
            if admitted < 0 or any(n < 0 for n in refused.values()):
                continue
            found[name] = (admitted, {r: n for r, n in refused.items() if n})
        return found

    # --- a window ------------------------------------------------------------------------------

    def replay(self, events: Sequence[Event], deadline_ms: float,
               instances: dict[tuple[str, int], str] | None = None) -> list[InstanceReport]:
        """Send every event at its instant through the client (to ``instances[(kind, query)]`` where
        given, else where the client routes it); one report per instance, of the answers it gave."""
        reports = {n: InstanceReport() for n in self.names}
        lock = threading.Lock()

        def record(ev: Event, arrival: float, outcome: str, instance: str | None) -> None:
            latency_ms = (time.monotonic() - arrival) * 1000
            with lock:
                reports.setdefault(instance or "unrouted", InstanceReport()).ranks.append(
                    (ev.query, latency_ms, outcome, ev.measured))

        def answer(pending: PendingRank, ev: Event, arrival: float) -> None:
            try:
                reply = pending.wait()
                record(ev, arrival, reply.source, reply.instance)
            except RankDeadlineExceeded:
                record(ev, arrival, "deadline", pending.instance)
            except RelayError:
                record(ev, arrival, ERROR, pending.instance)

        start = time.monotonic() + START_MARGIN_S
        wall_start = time.time() + (start - time.monotonic())  # deadlines travel as unix seconds
        with ThreadPoolExecutor(max_workers=WAITERS, thread_name_prefix="bench-answers") as waiters:
            for ev in events:
                delay = start + ev.at_s - time.monotonic()
                if delay > 0:
                    time.sleep(delay)
                where = (instances or {}).get((ev.kind, ev.query))
                if ev.kind == "preinfer":
                    # Best effort, as upstream sends it; the ranking request says what a lost one cost.
                    with contextlib.suppress(RelayError):
                        self.client.pre_infer(ev.user_id, seq_len=ev.prefix_len, instance=where)
                    continue
                arrival = start + ev.at_s
                payload = RankPayload(ev.user_id, deadline_s=wall_start + ev.at_s + deadline_ms / 1000,
                                      query_index=ev.query, seq_len=ev.prefix_len, short_len=ev.short_len,
                                      n_candidates=ev.n_candidates)
                try:
                    waiters.submit(answer, self.client.send_rank(payload, instance=where), ev, arrival)
                except RankDeadlineExceeded as exc:
                    record(ev, arrival, "deadline", exc.instance)
                except RelayError:
                    record(ev, arrival, ERROR, where)
        measured_at = next((ev.at_s for ev in events if ev.measured), None)
        if measured_at is not None:  # the measured part's admissions, from the workers' own counters
            for name, (admitted, refused) in self.admissions_between(wall_start + measured_at, time.time()).items():
                # as the lab fleet records a signal: (query, admitted, reason, measured); the query is unknown here
                reports[name].preinfers += [(-1, True, None, True)] * admitted + \
                    [(-1, False, reason, True) for reason, n in refused.items() for _ in range(n)]
        return list(reports.values())

    def prime(self, prefixes: dict[str, Sequence[tuple[str, int]]]) -> int:
        """Leave each (user, prefix tokens) in its instance's tiers, in order, the way serving it does:
        a ranking request each, answered as a miss that keeps its prefix (at most the instance's rank
        threads at once, so the order holds). Returns how many were answered; waits for all of them."""
        deadline_s = time.time() + PRIME_DEADLINE_S

        def rank(instance: str, user_id: str, n: int) -> bool:
            payload = RankPayload(user_id, deadline_s=deadline_s, seq_len=n, short_len=1, n_candidates=1)
            try:
                self.client.send_rank(payload, instance=instance).wait()
            except RelayError:
                return False
            return True

        def prime_one(instance: str) -> int:
            with ThreadPoolExecutor(max_workers=self.settings.rank_threads) as pool:
                return sum(pool.map(lambda un: rank(instance, *un), prefixes.get(instance, ())))

        with ThreadPoolExecutor(max_workers=max(1, len(prefixes))) as per_instance:
            answered = sum(per_instance.map(prime_one, list(prefixes)))
        if answered:
            time.sleep(PRIME_SETTLE_S)
        return answered

    # --- teardown ------------------------------------------------------------------------------

    def _forget_keys(self) -> None:
        """Our keys, and kombu's bindings of our queues: a shared Redis stays clean."""
        for pattern in (f"{self.worker.key_prefix}*", f"_kombu.binding*{self.worker.key_prefix}.*"):
            for key in self.redis.scan_iter(pattern):
                self.redis.delete(key)
        self.redis.close()

    def close(self) -> None:
        try:
            self._stack.close()
        finally:
            shutil.rmtree(self.workdir, ignore_errors=True)


def newest_that_fit(prefixes: Sequence[tuple[str, int]], budget_bytes: int, nbytes: Callable[[int], int]
                    ) -> list[tuple[str, int]]:
    """Of (user, prefix tokens) in trace order, the newest distinct ones whose caches fill
    ``budget_bytes`` (the one that crosses it included), oldest first: what an LRU tier stack of
    that size holds after serving them all, in the order that leaves it so."""
    seen: set[tuple[str, int]] = set()
    kept: list[tuple[str, int]] = []
    used = 0
    for prefix in reversed(prefixes):
        if used >= budget_bytes:
            break
        if prefix not in seen:
            seen.add(prefix)
            kept.append(prefix)
            used += nbytes(prefix[1])
    return kept[::-1]


class ProductMeasure(RealMeasure):
    """``sweeps.Measure`` through the product's path: ``RealMeasure``'s points (windows, contention
    check, redo), each window replayed on ``ProductFleet`` under the mode's published policy."""

    fleet: ProductFleet

    def primed_prefixes(self, mode: Mode, policy: PolicySpec, cap: int, window: Window) -> dict[str, list]:
        """Each instance's share of the window's primed part, as its router sends it (the client's for
        affinity, the lab's random choices otherwise), cut to what its HBM and DRAM budgets hold."""
        names = self.fleet.names
        if mode.affinity:
            by_instance: dict[str, list[tuple[str, int]]] = {n: [] for n in names}
            for i in range(window.prime_start, window.start):
                q = self.queries[i]
                by_instance[self.fleet.client.route(q.user_id)].append((q.user_id, min(q.seq_len, cap)))
        else:
            routes = primed_routes(self.queries, window, names, False, window_rng(self.s.seed, window))
            by_instance = {n: [(self.queries[i].user_id, min(self.queries[i].seq_len, cap)) for i in idx]
                           for n, idx in routes.items()}
        budget = policy.cache.hbm_budget_bytes + policy.cache.dram_budget_bytes
        return {n: newest_that_fit(p, budget, self.fleet.prefix_nbytes) for n, p in by_instance.items()}

    def _window(self, mode: Mode, cap: int, qps: float, window: Window) -> list[InstanceReport]:
        # Long-lived instances: the baseline (no cache) frees every tier, then the primed part refills them.
        self.fleet.publish(served_policy(BASELINE, self.regime))
        policy = served_policy(mode, self.regime)
        self.fleet.publish(policy)
        if mode.relay and window.primed:
            self.fleet.prime(self.primed_prefixes(mode, policy, cap, window))
        events = schedule(self.queries, window, cap=cap, qps=qps, trace_rate=self.rate,
                          time_scale=self.regime.time_scale, with_preinfer=mode.preinfer)
        instances = None
        if not mode.affinity:  # routed at random, as the lab fleet routes it: sent to the instance chosen
            routed = route(events, self.fleet.names, False, window_rng(self.s.seed, window), self.regime.time_scale)
            instances = {(ev.kind, ev.query): name for name, evs in routed.items() for ev in evs}
        return self.fleet.replay(events, self.regime.deadline_ms, instances)
