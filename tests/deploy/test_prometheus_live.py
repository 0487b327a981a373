"""The shipped rules and dashboards against Debian's real ``prometheus``: it scrapes a live control
plane's ``/metrics`` (the example configuration of deploy/prometheus/, a read-only viewer's token,
``honor_labels``) while three instances publish growing telemetry into the test Redis every second;
then every dashboard query (read from the committed JSON) and every recording rule returns data
through Prometheus's HTTP API, and the pool P99 Prometheus computes from the summed buckets matches
the control plane's own figure within one latency bucket.

Every wait is for a condition Prometheus reports (its readiness, samples that grew, a rule evaluation
after them), under a deadline; Prometheus's log is printed at teardown (shown when a test fails)."""

from __future__ import annotations

import bisect
import json
import re
import subprocess
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterator
from datetime import UTC, datetime
from pathlib import Path

import pytest
import yaml

from controlplane.accounts import services as account_services
from controlplane.accounts.roles import Role
from controlplane.policies import services as policy_services
from controlplane.policies.models import Pool
from controlplane.rollouts.models import Rollout
from controlplane.telemetry import grafana
from relay_engine.core.config import default_policy
from relay_engine.core.lifetime import die_with_parent
from relay_engine.core.outcomes import OUTCOME_COUNTERS, TIER_COUNTERS, TIERS
from relay_engine.core.telemetry import (
    COUNTERS,
    LATENCY_BUCKETS_MS,
    MISS_REASONS,
    REFUSAL_REASONS,
    LatencyHistogram,
)
from relay_engine.core.wire import TELEMETRY_TIERS
from tests.controlplane.fleet_helpers import FakeWorker, snapshot
from tests.deploy.test_grafana_dashboards import GRAFANA_VARIABLES, concrete
from tests.promtool import prometheus_binary
from workers.embedded_redis import free_port

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.django_db(transaction=True)]

ROOT = Path(__file__).resolve().parents[2]
PROMETHEUS_DIR = ROOT / "deploy" / "prometheus"
RULES = PROMETHEUS_DIR / "relaygr-rules.yml"
POOL = GRAFANA_VARIABLES["$pool"]
INSTANCES = 3
PUBLISH_EVERY_S = 1.0
DEADLINE_S = 45.0


# --- the fleet: instances publishing growing snapshots every second ------------------------------------------------

class Traffic:
    """Each instance's cumulative counters and latency buckets, grown by the same mix every tick (so any
    window sees one distribution), published with a heartbeat every ``PUBLISH_EVERY_S`` into each of
    ``tiers`` whose period turned (as the workers' publisher does)."""

    def __init__(self, pool: Pool, workers: list[FakeWorker], tiers: tuple[str, ...] = ("1s",)):
        self.pool = pool
        self.workers = workers
        self.telemetry_tiers = tiers
        self._last_period: dict[str, int] = {}
        self.started_at = time.time()
        self.counts = [dict.fromkeys(COUNTERS, 0) for _ in workers]
        self.refusals = [dict.fromkeys(REFUSAL_REASONS, 0) for _ in workers]
        self.misses = [dict.fromkeys(MISS_REASONS, 0) for _ in workers]
        self.tiers = [{tier.value: dict.fromkeys(TIER_COUNTERS, 0) for tier in TIERS} for _ in workers]
        self.latency = [LatencyHistogram() for _ in workers]
        self.ticks = 0
        self.errors: list[BaseException] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="telemetry-traffic", daemon=True)

    def _grow(self, i: int) -> None:
        # 50 requests a tick: 40 fast, 8 middling, 2 slow (the slow ones differ by instance), so the
        # pool's P99 lies in the slow tail, where only summed buckets get it right.
        for value_ms, n in ((2.0 + i, 40), (20.0, 8), (80.0 + 40.0 * i, 2)):
            for _ in range(n):
                self.latency[i].record(value_ms)
        grown = {"rank_requests": 50, "rank_ok": 49, "rank_errors": 1, "rank_within_slo": 48,
                 "preinfer_signals": 10, "preinfer_admitted": 4, "preinfer_completed": 4,
                 "evictions": 1, "demotions": 1, "misses": len(MISS_REASONS),
                 **dict.fromkeys(OUTCOME_COUNTERS.values(), 10)}
        for name, n in grown.items():
            self.counts[i][name] += n
        for reason in self.refusals[i]:
            self.refusals[i][reason] += 1
        for reason in self.misses[i]:
            self.misses[i][reason] += 1
        for figures in self.tiers[i].values():
            for name in figures:
                figures[name] += 1

    def tick(self) -> None:
        now = time.time()
        due = [tier for tier in self.telemetry_tiers if self._last_period.get(tier) != int(now // TELEMETRY_TIERS[tier][0])]
        for i, worker in enumerate(self.workers):
            if self.ticks:
                self._grow(i)
            snap = snapshot(worker.name, now, self.started_at, refusals=dict(self.refusals[i]),
                            miss_reasons=dict(self.misses[i]), hbm_bytes=1000 * (i + 1), hbm_budget_bytes=10_000,
                            applied_generation=worker.status.applied_generation, **self.counts[i])
            snap.rank_latency = self.latency[i].copy()
            snap.tiers = {tier: {**figures, "bytes": 300 * (i + 1), "budget_bytes": 10_000, "peak_bytes": 400,
                                 "entries": 3} for tier, figures in self.tiers[i].items()}
            worker.writer.write(snap, due)
            worker.reconcile(now)
        for tier in due:
            self._last_period[tier] = int(now // TELEMETRY_TIERS[tier][0])
        self.ticks += 1

    def _run(self) -> None:
        while not self._stop.wait(PUBLISH_EVERY_S):
            try:
                self.tick()
            except BaseException as exc:  # noqa: BLE001 - re-raised in the test by stop()
                self.errors.append(exc)
                return

    def start(self) -> Traffic:
        self.tick()
        return self.run()

    def run(self) -> Traffic:
        """Grow and publish every ``PUBLISH_EVERY_S`` from now on (``start`` publishes the first first)."""
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=10)
        if self.errors:
            raise self.errors[0]


# --- Prometheus, started on a temporary folder and a free port --------------------------------------------------

class Prometheus:
    """The real server on ``data_dir`` at a free port, started and stopped by the test's fixture (and
    restarted on the same data by a test that adds blocks under it)."""

    def __init__(self, config: Path, data_dir: Path, log: Path):
        self.config, self.data_dir, self.log = config, data_dir, log
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.process: subprocess.Popen | None = None

    def start(self) -> None:
        with self.log.open("ab") as out:
            self.process = subprocess.Popen(
                [prometheus_binary("prometheus"), f"--config.file={self.config}",
                 f"--storage.tsdb.path={self.data_dir}", f"--web.listen-address=127.0.0.1:{self.port}",
                 "--web.enable-admin-api"],
                stdout=out, stderr=subprocess.STDOUT, preexec_fn=die_with_parent())
        self.wait_for("readiness", lambda: self.process.poll() is not None or _ready(self.url))
        assert self.process.poll() is None, f"prometheus exited {self.process.returncode}:\n{self.log_text()}"

    def snapshot(self) -> str:
        """Every block and the head as blocks under ``data_dir/snapshots/``: the snapshot's name."""
        request = urllib.request.Request(f"{self.url}/api/v1/admin/tsdb/snapshot", method="POST")
        with urllib.request.urlopen(request, timeout=30) as response:
            return json.load(response)["data"]["name"]

    def stop(self) -> None:
        if self.process is None:
            return
        self.process.terminate()
        try:
            self.process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        self.process = None

    def log_text(self) -> str:
        return self.log.read_text(errors="replace")

    def get(self, path: str, **params: str) -> dict:
        query = f"?{urllib.parse.urlencode(params)}" if params else ""
        try:
            with urllib.request.urlopen(f"{self.url}{path}{query}", timeout=10) as response:
                body = json.load(response)
        except urllib.error.HTTPError as exc:
            raise AssertionError(f"{path} {params}: HTTP {exc.code} {exc.read().decode(errors='replace')}") from None
        assert body["status"] == "success", body
        return body["data"]

    def query(self, expr: str) -> list[dict]:
        return self.get("/api/v1/query", query=expr)["result"]

    def wait_for(self, what: str, condition: Callable[[], object]):
        deadline = time.monotonic() + DEADLINE_S
        while True:
            value = condition()
            if value:
                return value
            if time.monotonic() > deadline:
                pytest.fail(f"Prometheus: no {what} within {DEADLINE_S:g} s")
            time.sleep(0.2)

    def last_evaluations(self) -> list[float]:
        """Unix time of each rule group's last evaluation (0 before its first)."""
        return [_unix(group["lastEvaluation"]) for group in self.get("/api/v1/rules")["groups"]]

    def wait_for_rules_after(self, moment: float) -> None:
        self.wait_for("evaluation of every rule group after the data",
                      lambda: all(t > moment for t in self.last_evaluations()))


def _unix(rfc3339: str) -> float:
    """Prometheus's RFC 3339 times carry nanoseconds; datetime takes microseconds."""
    trimmed = re.sub(r"(\.\d{6})\d*", r"\1", rfc3339).replace("Z", "+00:00")
    return datetime.fromisoformat(trimmed).timestamp()


@pytest.fixture
def scrape_token(db) -> str:
    """A read-only viewer's token, as deploy/prometheus/prometheus.yml asks for."""
    user = account_services.user_create(username="prometheus", role=Role.VIEWER, actor="fixture")
    return account_services.token_create(user=user, actor="fixture", name="prometheus", read_only=True).key


@pytest.fixture
def fleet(redis_on, worker_factory) -> Iterator[Traffic]:
    pool = policy_services.pool_create(name=POOL, expected_instances=INSTANCES, actor="fixture")
    traffic = Traffic(pool, [worker_factory(POOL, i) for i in range(INSTANCES)]).start()
    yield traffic
    traffic.stop()


@pytest.fixture
def prometheus(tmp_path, live_server, scrape_token, fleet) -> Iterator[Prometheus]:
    """The example configuration with a test's intervals, this token and the live server as target."""
    prometheus_binary("prometheus")
    token = tmp_path / "relaygr.token"
    token.write_text(scrape_token + "\n")
    config = yaml.safe_load((PROMETHEUS_DIR / "prometheus.yml").read_text())
    config["global"] = {"scrape_interval": "1s", "scrape_timeout": "1s", "evaluation_interval": "1s"}
    # The history rules record each minute: a test that reads them backfills them (promtool), so the live
    # server does not evaluate them on top.
    config["rule_files"] = [str(RULES)]
    (job,) = config["scrape_configs"]
    job["authorization"]["credentials_file"] = str(token)
    job["static_configs"] = [{"targets": [f"127.0.0.1:{urllib.parse.urlsplit(live_server.url).port}"]}]
    (tmp_path / "prometheus.yml").write_text(yaml.safe_dump(config))
    server = Prometheus(tmp_path / "prometheus.yml", tmp_path / "data", tmp_path / "prometheus.log")
    try:
        server.start()
        yield server
    finally:
        server.stop()
        print(f"--- prometheus log ---\n{server.log_text()}")


def _ready(url: str) -> bool:
    try:
        with urllib.request.urlopen(f"{url}/-/ready", timeout=2) as response:
            return response.status == 200
    except OSError:
        return False


def _wait_for_growth(prometheus: Prometheus) -> float:
    """Every instance scraped with its counters grown (rate() has two samples); the time of that answer."""
    prometheus.wait_for("scrape of every instance's grown counters", lambda: prometheus.query(
        f'count(changes(relaygr_rank_requests_total{{pool="{POOL}"}}[1m]) > 0) == {INSTANCES}'))
    return time.time()


def _recording_rules() -> dict[str, str]:
    return {rule["record"]: rule["expr"] for group in yaml.safe_load(RULES.read_text())["groups"]
            for rule in group["rules"] if "record" in rule}


def _dashboard_queries() -> dict[str, str]:
    """Every query of the committed dashboards, Grafana's variables put in (tests/deploy/test_grafana_dashboards)."""
    return {f"{path.name} {where}": concrete(expr) for path in sorted(grafana.OUT_DIR.glob("*.json"))
            for where, expr in grafana.expressions(json.loads(path.read_text())).items()}


# --- the behaviours ---------------------------------------------------------------------------------------------

def test_every_dashboard_query_and_recording_rule_returns_data(prometheus, fleet):
    _wait_for_growth(prometheus)
    # What the annotations mark, while Prometheus watches: a publish, a canary decided, one baking.
    pool = fleet.pool
    spec = default_policy().to_dict()
    spec["trigger"]["max_preinfer_inflight"] += 1
    policy_services.revision_create(pool=pool, spec=spec, parent_generation=1, author="fixture")
    policy_services.revision_publish(pool=pool, generation=2, actor="fixture")
    now = datetime.now(tz=UTC)
    for state, canary in ((Rollout.State.ROLLED_BACK, 1), (Rollout.State.BAKING, 0)):
        Rollout.objects.create(pool=pool, generation=2, stable_generation=1, canary_instances=[f"{POOL}.{canary}"],
                               bake_s=600, max_burn=1.0, state=state, started_by="fixture", started_at=now,
                               bake_ends_at=now, decided_at=None if state == Rollout.State.BAKING else now,
                               decided_by="" if state == Rollout.State.BAKING else "fixture")
    prometheus.wait_for("scrape of the publish, the decided canary and the baking one", lambda: prometheus.query(
        f'relaygr_pool_desired_generation{{pool="{POOL}"}} == 2 '
        f'and on (pool) relaygr_pool_rollouts_decided_total{{pool="{POOL}",state="rolled_back"}} == 1 '
        f'and on (pool) relaygr_pool_rollout_baking{{pool="{POOL}"}} == 1'))
    prometheus.wait_for_rules_after(time.time())

    queries = _dashboard_queries()
    rules = _recording_rules()
    assert len(queries) > 30 and len(rules) > 20
    empty = [f"{where}: {expr}" for where, expr in queries.items() if not prometheus.query(expr)]
    empty += [f"rule {record}: {expr}" for record, expr in rules.items() if not prometheus.query(expr)]
    empty += [f"recorded series {record}" for record in rules if not prometheus.query(record)]
    assert empty == []


def test_the_pool_p99_rule_matches_the_control_planes_p99_within_a_bucket(prometheus, fleet, live_server,
                                                                         scrape_token):
    grown = _wait_for_growth(prometheus)
    prometheus.wait_for_rules_after(grown)
    (recorded,) = prometheus.query(f'pool:relaygr_rank_latency_seconds:p99_5m{{pool="{POOL}"}}')
    prometheus_p99_ms = float(recorded["value"][1]) * 1000
    request = urllib.request.Request(f"{live_server.url}/api/v1/pools/{POOL}/metrics/?window=5m&top=0",
                                     headers={"Authorization": f"Token {scrape_token}"})
    with urllib.request.urlopen(request, timeout=10) as response:
        controlplane_p99_ms = json.load(response)["fleet"]["totals"]["p99_ms"]

    # The slowest instance's 160 ms (1.3 % of the pool's requests) holds the P99: the control plane sees
    # the mix too, so the comparison is of two quantiles of one tail, not of two empty windows.
    i = bisect.bisect_left(LATENCY_BUCKETS_MS, controlplane_p99_ms)
    assert i == bisect.bisect_left(LATENCY_BUCKETS_MS, 160.0)
    bucket_width_ms = LATENCY_BUCKETS_MS[i] - LATENCY_BUCKETS_MS[i - 1]
    assert abs(prometheus_p99_ms - controlplane_p99_ms) <= bucket_width_ms, \
        (prometheus_p99_ms, controlplane_p99_ms, bucket_width_ms)
