"""Real faults against the real stack, under replayed load: what the fleet and the control plane promise.

One stack for the module (it costs seconds to start): a private Redis, the control plane under
gunicorn with its SQLite database, the config sync loop, three worker processes (small model), and
``workers.replay.Replayer`` playing a trace at a steady rate the whole time. The tests run in order,
each injecting one fault and asserting the outcome once the stack has settled; every ranking request
sent meanwhile must end as an answer or a clear error within its deadline (+ grace): none is lost.
"""

from __future__ import annotations

import secrets
import signal
import threading
import time
import urllib.error

import pytest

from relay_engine.core.telemetry import Snapshot
from relay_engine.core.wire import HEARTBEAT_TIMEOUT_S, DesiredRevision, InstanceStatus
from tests.frontend.conftest import LAUNCH_ARGS, chromium_path, login
from tests.frontend.stack import POOL
from tests.reliability.figures import FIGURES
from tests.reliability.harness import DEADLINE, OK, FaultStack, ReplayLoad
from tests.workers.fleet import wait_for
from workers import signals
from workers.app import make_app, redis_client
from workers.client import RelayClient
from workers.payloads import INVALID_INPUT

pytestmark = [pytest.mark.integration, pytest.mark.slow]

CONVERGE_S = 60.0
RESTART_S = 90.0  # a restarted worker imports torch and builds its engine first: seconds on a busy CPU
OUTAGE_S = 10.0
TOO_BIG_HBM_MB = 16.0 * 2**20  # 16 TiB: valid by the schema, more than any device here
DISTINCT_HBM_MB = 333.0  # a budget the schema's defaults never have


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    running = FaultStack(tmp_path_factory.mktemp("faults"), instances=3)
    try:
        running.spawn_workers()  # they load torch while the control plane sets up
        running.set_up()
        running.start_sync()
        running.start_server()
        running.wait_for_workers()
        running.wait_converged(1, 3)
        yield running
    finally:
        running.stop()


@pytest.fixture(scope="module")
def load(stack):
    client = RelayClient(stack.worker_settings)
    replay = ReplayLoad(client).start()
    try:
        yield replay
    finally:
        replay.stop()
        client.close()
        FIGURES.load(outcomes=replay.kinds(), lost=len(replay.lost()), seconds=replay.stopped_at - replay.started_at)


@pytest.fixture
def during(load):
    """The outcomes of the ranking requests sent during this test (and its fault); none may be lost."""
    started, faults = time.monotonic(), len(FIGURES.faults_injected)
    yield lambda: load.client.between(started)
    outcomes = load.client.between(started)
    if len(FIGURES.faults_injected) > faults:
        FIGURES.fault_requests(FIGURES.faults_injected[-1], outcomes=load.kinds(outcomes),
                               lost=len(load.lost(outcomes)))
    assert outcomes, "no load was replayed during the test"
    assert load.lost(outcomes) == []


@pytest.fixture(scope="module")
def sre_page(stack):
    """The operator's browser page (real Chromium), when the machine has one."""
    path = chromium_path()
    if path is None:
        yield None
        return
    from playwright.sync_api import sync_playwright

    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=path, headless=True, args=LAUNCH_ARGS)
        context = browser.new_context(base_url=stack.base_url)
        context.set_default_timeout(20_000)
        page = context.new_page()
        errors: list[str] = []
        page.on("pageerror", lambda error: errors.append(str(error)))
        login(page, "sre")
        yield page
        assert errors == []
        browser.close()


def desired_in_redis(stack) -> int | None:
    raw = stack.redis.get(stack.worker_settings.keys.desired)
    return DesiredRevision.from_json(raw).generation if raw else None


def ok_users(outcomes, instance: str) -> set[str]:
    return {o.user for o in outcomes if o.kind == OK and o.instance == instance}


def test_killed_worker_under_load_moves_its_users_and_rejoins_at_the_desired_generation(stack, load, during):
    fault = FIGURES.fault("kill -9 of a worker under load")
    victim = f"{POOL}.1"
    wait_for(lambda: ok_users(during(), victim), 30, what=f"{victim} to serve some users")
    its_users = ok_users(during(), victim)

    stack.kill_worker(victim)
    killed_at = time.monotonic()
    wait_for(lambda: victim not in stack.live(), HEARTBEAT_TIMEOUT_S + 5, what=f"{victim} to leave the live set")
    dropped_at = time.monotonic()
    assert dropped_at - killed_at <= HEARTBEAT_TIMEOUT_S + 5
    generation = stack.publish({"trigger": {"max_preinfer_inflight": 7}}, f"published while {victim} is dead")
    stack.wait_converged(generation, 2, CONVERGE_S)  # the pool reconverges on the survivors

    settle_at = dropped_at + load.deadline_ms / 1000 + 1.0
    wait_for(lambda: [o for o in load.client.between(settle_at) if o.kind == OK and o.user in its_users], 30,
             what="the victim's users to be answered elsewhere")
    moved = [o for o in load.client.between(settle_at) if o.user in its_users and o.kind == OK]
    assert moved and all(o.instance != victim for o in moved)
    # What was sent to the dead instance failed fast and said so; it was not silently dropped.
    assert any(o.kind == DEADLINE and o.instance == victim for o in load.client.between(killed_at, dropped_at))

    stack.spawn_worker(1)  # the poke for `generation` was sent while it was dead: only reconciling finds it
    status = stack.wait_converged(generation, 3, RESTART_S)
    restarted = next(i for i in status["instances"] if i["instance"] == victim)
    assert restarted["applied_generation"] == generation and restarted["config_state"] == "ACK"
    fault.survived()


def test_publish_while_half_the_pool_is_down_converges_when_it_returns(stack, load, during):
    fault = FIGURES.fault("publish with 2 of 3 workers down")
    before = stack.pool_status()["desired_generation"]
    down = [f"{POOL}.1", f"{POOL}.2"]
    for name in down:
        stack.kill_worker(name, signal.SIGTERM)  # a clean stop leaves the live set at once
    wait_for(lambda: set(stack.live()) == {f"{POOL}.0"}, 15, what="only one live instance")

    generation = stack.publish({"trigger": {"max_preinfer_inflight": 9}}, "published with two instances down")
    stack.wait_converged(generation, 1, CONVERGE_S)  # the live part ACKs
    keys = stack.worker_settings.keys
    for name in down:  # the stopped ones' last words: still on the generation before
        assert InstanceStatus.from_json(stack.redis.get(keys.status(name))).applied_generation == before

    for name in down:
        stack.spawn_worker(int(name.rsplit(".", 1)[1]))
    stack.wait_converged(generation, 3, RESTART_S)  # the rest converge when they return
    fault.survived()


def test_a_revision_the_devices_cannot_hold_is_nacked_and_the_last_good_keeps_serving(stack, load, during,
                                                                                       sre_page):
    fault = FIGURES.fault("revision valid for the API, too big for the device")
    good = stack.pool_status()["desired_generation"]
    bad = stack.publish({"cache": {"hbm_budget_mb": TOO_BIG_HBM_MB}}, "more HBM than the device has")

    def all_nacked():
        status = stack.pool_status()
        live = [i for i in status["instances"] if i["live"]]
        return status if len(live) == 3 and all(i["config_state"] == "NACK" and i["nacked_generation"] == bad
                                                for i in live) else None

    status = wait_for(all_nacked, CONVERGE_S, interval_s=0.25, what=f"every instance to NACK generation {bad}")
    assert not status["converged"]
    for instance in (i for i in status["instances"] if i["live"]):
        assert instance["applied_generation"] == good
        assert "cache.hbm_budget_mb" in instance["error"] and "exceeds" in instance["error"]
    nacked_at = time.monotonic()
    wait_for(lambda: len({o.instance for o in load.client.between(nacked_at) if o.kind == OK}) == 3, 30,
             what="every instance to answer on its last good configuration")

    if sre_page is not None:  # the UI shows it: the fleet page names the refusal and its reason
        sre_page.goto(f"/pools/{POOL}/fleet/")
        sre_page.locator('[data-role="summary"]', has_text="refused it (NACK)").wait_for()
        assert "cache.hbm_budget_mb" in sre_page.locator('[data-role="instances"]').inner_text()

    status, rollback = stack.api("POST", f"/api/v1/pools/{POOL}/rollback/", {"to_generation": good, "parent_generation": bad})
    assert status == 201, rollback
    stack.wait_converged(rollback["generation"], 3, CONVERGE_S)
    fault.survived()


def test_redis_restart_is_ridden_out_and_the_desired_configuration_is_restored(stack, load, during, sre_page):
    fault = FIGURES.fault(f"Redis stopped for {OUTAGE_S:g} s and restarted empty")
    desired = stack.pool_status()["desired_generation"]
    if sre_page is not None:
        sre_page.goto(f"/pools/{POOL}/?window=5m")
        sre_page.locator('#connection[data-state="live"]').wait_for()

    stack.stop_redis()
    stopped_at = time.time()
    try:
        status, body = stack.api("GET", f"/api/v1/pools/{POOL}/status/")
        assert status == 503 and "Redis" in body["detail"]  # a clear answer, not an error page
        status, pool = stack.api("GET", f"/api/v1/pools/{POOL}/")  # the database side still answers
        assert status == 200 and pool["desired_generation"] == desired
        if sre_page is not None:
            sre_page.locator('#connection[data-state="reconnecting"]').wait_for()
        time.sleep(max(0.0, OUTAGE_S - (time.time() - stopped_at)))
    finally:
        stack.start_redis()
    restarted_at, restarted_mono = time.time(), time.monotonic()

    # Workers rejoin by themselves; the sync loop writes the database's desired revision back.
    wait_for(lambda: len(stack.live()) == 3, 30, interval_s=0.25, what="the workers to heartbeat again")
    wait_for(lambda: desired_in_redis(stack) == desired, 30, interval_s=0.25, what="the sync loop to restore desired")
    stack.wait_converged(desired, 3, CONVERGE_S)
    wait_for(lambda: len({o.instance for o in load.client.between(restarted_mono) if o.kind == OK}) == 3, 60,
             what="every instance to answer ranking requests again")

    # Telemetry resumes, and the dashboard draws the outage as a gap in the series, not an error.
    keys = stack.worker_settings.keys
    for name in stack.workers:
        wait_for(lambda name=name: stack.redis.xrevrange(keys.telemetry("1s", name), count=1), 15,
                 what=f"{name} to publish telemetry again")
        snapshot = Snapshot.from_entry(stack.redis.xrevrange(keys.telemetry("1s", name), count=1)[0][1]["d"])
        assert snapshot.ts >= restarted_at
    time.sleep(2)
    status, metrics = stack.api("GET", f"/api/v1/pools/{POOL}/metrics/?window=5m")
    assert status == 200, metrics
    fleet = metrics["fleet"]
    points = list(zip(metrics["timestamps"], fleet["rank_per_s"], fleet["p99_ms"], strict=True))
    outage = [(rate, p99) for t, rate, p99 in points if stopped_at + 1 <= t <= restarted_at - 1]
    after = [(rate, p99) for t, rate, p99 in points if t >= restarted_at + 1]
    debug = f"stopped {stopped_at:.1f} restarted {restarted_at:.1f}: {[p for p in points if p[0] >= stopped_at - 3]}"
    # The gap: no figures for the outage. (A snapshot taken just before Redis came back may land after
    # it, carrying the counts since the last one that got through: one bucket, not a gap's worth.)
    empty = [rate for rate, p99 in outage if not rate and p99 is None]
    assert len(empty) >= len(outage) - 2 >= OUTAGE_S / 2, debug
    assert any(rate and p99 is not None for rate, p99 in after), debug  # and traffic after it
    if sre_page is not None:
        sre_page.locator('#connection[data-state="live"]').wait_for(timeout=30_000)
    fault.survived()


def test_a_worker_restarted_while_redis_is_empty_serves_its_last_revision_not_the_defaults(stack, load, during):
    fault = FIGURES.fault("worker restarted while Redis is empty (sync loop held)")
    generation = stack.publish({"cache": {"hbm_budget_mb": DISTINCT_HBM_MB}}, "a budget no default has")
    stack.wait_converged(generation, 3, CONVERGE_S)
    victim, keys = f"{POOL}.2", stack.worker_settings.keys
    stack.sync.send_signal(signal.SIGSTOP)  # no repair of Redis until released: the window a restart may hit
    try:
        stack.kill_worker(victim)
        stack.stop_redis()
        stack.start_redis()  # empty, as after a crash
        stack.spawn_worker(2)
        wait_for(lambda: victim in stack.live(), RESTART_S, interval_s=0.25, what=f"{victim} to serve again")
        status = InstanceStatus.from_json(stack.redis.get(keys.status(victim)))
        assert (status.config_state, status.applied_generation) == ("PENDING", generation)
        assert status.tiers["hbm"]["budget_bytes"] == DISTINCT_HBM_MB * 2**20 and "serving generation" in status.error
        assert stack.redis.get(keys.desired) is None
        back = time.monotonic()
        wait_for(lambda: any(o.kind == OK and o.instance == victim for o in load.client.between(back)), 60,
                 what=f"{victim} to answer on its last applied revision")
    finally:
        stack.sync.send_signal(signal.SIGCONT)
    stack.wait_converged(generation, 3, CONVERGE_S)  # the sync loop writes desired back; everyone ACKs it
    fault.survived()


def test_web_server_killed_mid_publish_leaves_the_revision_fully_published(stack, load, during):
    fault = FIGURES.fault("kill -9 of the web server between the database commit and the Redis write")
    before = stack.db_pool()["desired_generation"]
    status, pool = stack.api("GET", f"/api/v1/pools/{POOL}/")
    status, revision = stack.api("POST", f"/api/v1/pools/{POOL}/revisions/", {
        "parent_generation": pool["latest_generation"], "spec": {"trigger": {"max_preinfer_inflight": 5}},
        "comment": "published as the web server dies"})
    assert status == 201, revision
    generation = revision["generation"]
    outcome: dict[str, object] = {}

    def publish() -> None:
        try:
            outcome["response"] = stack.api("POST", f"/api/v1/pools/{POOL}/revisions/{generation}/publish/")
        except (urllib.error.URLError, ConnectionError) as exc:
            outcome["error"] = exc

    with stack.redis_paused():  # the Redis write blocks, so the request is held right after its commit
        caller = threading.Thread(target=publish)
        caller.start()
        wait_for(lambda: stack.db_pool()["desired_generation"] == generation, 10, interval_s=0.05,
                 what="the publish to commit")
        stack.kill_server()
    caller.join(30)
    assert "error" in outcome, outcome  # the caller saw the server die: no answer, no false success
    half = stack.db_pool()  # committed; Redis not written by the request (the sync loop may be at it already)
    assert half["desired_generation"] == generation and half["published_generation"] in (before, generation)

    # The database is the truth: the sync loop delivers the committed generation; the fleet converges.
    stack.start_server()
    stack.wait_converged(generation, 3, CONVERGE_S)
    assert desired_in_redis(stack) == generation
    wait_for(lambda: stack.db_pool()["published_generation"] == generation, 15, what="published_generation")
    status, audit = stack.api("GET", f"/api/v1/audit/?action=revision.publish&pool={POOL}")
    entry = next(e for e in audit["results"] if e["after"]["desired_generation"] == generation)
    assert entry["actor"] == "sre" and entry["request_id"]
    # Retrying the call the caller never got an answer to is harmless: nothing changes.
    status, retried = stack.api("POST", f"/api/v1/pools/{POOL}/revisions/{generation}/publish/")
    assert status == 200 and retried["changed"] is False
    fault.survived()


MALFORMED_RANK_PAYLOADS = [
    ("not an object", ["user", 1], "payload"),
    ("no user", {"seq_len": 8, "short_len": 1, "n_candidates": 2}, "user_id"),
    ("user is a list", {"user_id": ["u"], "seq_len": 8, "short_len": 1, "n_candidates": 2}, "user_id"),
    ("user too long", {"user_id": "u" * 10_000, "seq_len": 8, "short_len": 1, "n_candidates": 2}, "user_id"),
    ("seq_len a string", {"user_id": "u", "seq_len": "8", "short_len": 1, "n_candidates": 2}, "seq_len"),
    ("seq_len negative", {"user_id": "u", "seq_len": -1, "short_len": 1, "n_candidates": 2}, "seq_len"),
    ("seq_len huge", {"user_id": "u", "seq_len": 10**30, "short_len": 1, "n_candidates": 2}, "seq_len"),
    ("seq_len a bool", {"user_id": "u", "seq_len": True, "short_len": 1, "n_candidates": 2}, "seq_len"),
    ("no candidates", {"user_id": "u", "seq_len": 8, "short_len": 1}, "n_candidates"),
    ("candidates zero", {"user_id": "u", "seq_len": 8, "short_len": 1, "n_candidates": 0}, "n_candidates"),
    ("item ids not integers", {"user_id": "u", "prefix_items": [1, "x"], "prefix_actions": [0, 0],
                               "short_len": 1, "n_candidates": 2}, "prefix_items"),
    ("lists of unequal length", {"user_id": "u", "prefix_items": [1, 2], "prefix_actions": [0],
                                 "short_len": 1, "n_candidates": 2}, "prefix_actions"),
    ("item id beyond int64", {"user_id": "u", "prefix_items": [2**70], "prefix_actions": [0],
                              "short_len": 1, "n_candidates": 2}, "prefix_items"),
    ("unknown field", {"user_id": "u", "seq_len": 8, "short_len": 1, "n_candidates": 2, "sql": "1;DROP"}, "sql"),
    ("query index negative", {"user_id": "u", "seq_len": 8, "short_len": 1, "n_candidates": 2,
                              "query_index": -3}, "query_index"),
]


def test_malformed_task_payloads_get_clear_errors_and_the_workers_stay_up(stack, load, during):
    fault = FIGURES.fault("malformed task payloads on a serving worker's queues")
    target = f"{POOL}.0"
    pid = stack.workers[target].pid
    client = load.client.client
    for _, payload, field in MALFORMED_RANK_PAYLOADS:
        try:
            reply = client.send_rank(payload, instance=target).wait()
        except Exception as exc:  # noqa: BLE001 — the assertion names it
            assert getattr(exc, "kind", None) == INVALID_INPUT and getattr(exc, "field", None) == field, exc
        else:
            raise AssertionError(f"{payload!r} was ranked: {reply}")
    # Pre-infer signals are fire and forget; written raw to the signal list (the client would refuse
    # them), with an entry that is no JSON at all, they must not harm.
    signal_list = stack.worker_settings.keys.preinfer_signals(target)
    raw = redis_client(stack.worker_settings)
    try:
        raw.rpush(signal_list, *(signals.entry(payload) for _, payload, _ in MALFORMED_RANK_PAYLOADS), "{not json")
        # And on the ranking request list, entries that are not requests at all (no reply list, no deadline).
        raw.rpush(stack.worker_settings.keys.rank_requests(target), "{not json", '{"p": 1}', '{"p": {}, "r": 7, "d": 0}')
    finally:
        raw.close()
    app = make_app(stack.worker_settings)
    try:
        app.send_task("relaygr.rank", args=[], kwargs={"x": 1}, queue=stack.worker_settings.keys.rank_queue(target))
    finally:
        app.close()
    FIGURES.hostile("task payloads", 2 * len(MALFORMED_RANK_PAYLOADS) + 5)
    time.sleep(1)
    assert stack.workers[target].poll() is None and stack.workers[target].pid == pid
    answered = client.send_rank({"user_id": "after-the-garbage", "seq_len": 16, "short_len": 1, "n_candidates": 4,
                                 "deadline_s": time.time() + 5}, instance=target).wait()
    assert answered.instance == target and len(answered.scores) == 4
    fault.survived()


def test_no_token_appears_in_any_log(stack, load):
    """Tokens travel in headers only; nothing the stack logs (gunicorn's access log included) has one."""
    status, _ = stack.api("GET", f"/api/v1/pools/{POOL}/?token=probe")  # a failed and a good call are both logged
    assert status == 200
    stack.tokens["forged"] = "rgr_" + secrets.token_urlsafe(32)  # well-formed, never issued
    try:
        assert stack.api("GET", "/api/v1/me/", user="forged")[0] == 401
    finally:
        forged = stack.tokens.pop("forged")
    time.sleep(0.5)
    logs = {path.name: path.read_text(errors="replace") for path in stack.workdir.rglob("*.log")}
    assert "gunicorn.log" in logs and "GET /api/v1/me/" in logs["gunicorn.log"]  # the access log is on
    for key in [*stack.tokens.values(), forged]:
        leaked = [name for name, text in logs.items() if key in text or key[4:] in text]
        assert leaked == [], f"a token appears in {leaked}"
