"""The one-command stack, end to end: real Redis, real workers, real web server, real traffic.

Started as ``make run`` starts it (smaller: the small model, a fast trace). Through the REST API
the at-risk threshold is raised above every request's length: every instance ACKs and pre-infer
admissions stop while ranking goes on; a rollback brings them back. A server error shows no debug page
(no settings, no traceback: the plain JSON error and its request id), and ``--debug`` is refused on an
address beyond loopback. Then SIGINT stops everything: no process the stack started is left.
"""

from __future__ import annotations

import json
import os
import signal
import sqlite3
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from relay_engine.core.lifetime import die_with_parent
from workers.embedded_redis import free_port

ROOT = Path(__file__).resolve().parents[2]
pytestmark = [pytest.mark.integration, pytest.mark.slow]


def descendants(pid: int) -> set[int]:
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    found, todo = set(), [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            if child not in found:
                found.add(child)
                todo.append(child)
    return found


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


class Api:
    def __init__(self, url: str, token: str):
        self.url, self.token = url, token

    def call(self, method: str, path: str, body: dict | None = None):
        request = urllib.request.Request(self.url + path, method=method,
                                         data=None if body is None else json.dumps(body).encode(),
                                         headers={"Authorization": f"Token {self.token}",
                                                  "Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=10) as response:
            raw = response.read().decode()
            return json.loads(raw) if response.headers.get_content_type() == "application/json" else raw

    def counters(self) -> dict[str, float]:
        """Pool-wide totals of the Prometheus counters, summed over instances."""
        totals: dict[str, float] = {}
        for family in text_string_to_metric_families(self.call("GET", "/metrics")):
            for sample in family.samples:
                if sample.name.endswith("_total"):
                    key = sample.name + (f"{{{sample.labels['reason']}}}" if "reason" in sample.labels else "")
                    totals[key] = totals.get(key, 0.0) + sample.value
        return totals


def wait_for(condition, timeout_s: float, what: str):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(0.5)
    raise AssertionError(f"timed out after {timeout_s:.0f} s waiting for {what}")


def converged_at(api: Api, generation: int) -> bool:
    status = api.call("GET", "/api/v1/pools/main/status/")
    return status["converged"] and status["desired_generation"] == generation and status["live_instances"] == 2


def deltas_over(api: Api, seconds: float) -> dict[str, float]:
    before = api.counters()
    time.sleep(seconds)
    after = api.counters()
    return {k: after[k] - before.get(k, 0.0) for k in after}


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    data_dir = tmp_path_factory.mktemp("stack")
    status_file = data_dir / "status.json"
    env = {k: v for k, v in os.environ.items() if k not in ("REDIS_URL", "DATABASE_URL", "DJANGO_SETTINGS_MODULE")}
    env["RELAYGR_KEY_PREFIX"] = f"e2e-{os.getpid()}"
    process = subprocess.Popen(
        [sys.executable, "-m", "workers.stack", "--instances", "2", "--model", "small", "--rate", "15",
         "--port", str(free_port()), "--data-dir", str(data_dir), "--status-file", str(status_file)],
        cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True,
        preexec_fn=die_with_parent(),
    )
    try:
        wait_for(lambda: status_file.exists() or process.poll() is not None, 300, "the stack to start")
        if process.poll() is not None:
            pytest.fail(f"the stack exited with {process.returncode}:\n{process.stdout.read()}")
        status = json.loads(status_file.read_text())
        yield process, Api(status["url"], status["token"]), data_dir
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)


def test_the_demo_pool_runs_on_the_stacks_time_scale_and_says_so(stack):
    """On a CPU the stack measures K once (this machine's forwards ÷ the reference accelerator's)
    and gives the demo pool the reference's SLO × K, in a revision of its own, with the reason in
    the pool's description; previews get this machine's profile, not the reference one."""
    _, api, data_dir = stack
    calibration = json.loads((data_dir / "calibration.json").read_text())
    k = round(calibration["time_scale"], 1)
    assert k > 0 and (data_dir / "profile-cpu.json").is_file()
    pool = api.call("GET", "/api/v1/pools/main/")
    assert pool["slo"]["ranking_p99_slo_ms"] == round(50 * k, 1)
    assert f"×{k:g} of the reference accelerator's" in pool["description"]
    calibrated = api.call("GET", f"/api/v1/pools/main/revisions/{pool['desired_generation']}/")
    assert calibrated["author"] == "cli:relaygr_demo" and "time scale" in calibrated["comment"]
    # and a rank that joined a prefill in flight gives up while a recompute on this CPU still fits
    assert calibrated["spec"]["trigger"]["latency_model"] == calibration["latency_model"]


def test_raising_the_threshold_stops_pre_inference_and_a_rollback_restores_it(stack):
    _, api, _ = stack
    first = api.call("GET", "/api/v1/pools/main/")["desired_generation"]
    wait_for(lambda: converged_at(api, first), 60, f"generation {first} to converge")
    wait_for(lambda: api.counters().get("relaygr_preinfer_admitted_total", 0) > 0, 90, "pre-inferences")
    running = deltas_over(api, 4)
    assert running["relaygr_rank_ok_total"] > 0 and running["relaygr_preinfer_admitted_total"] > 0

    revision = api.call("GET", f"/api/v1/pools/main/revisions/{first}/")
    spec = revision["spec"]
    spec["trigger"]["at_risk_seq_len"] = 1_000_000  # above every request (the trace's max is 8192)
    created = api.call("POST", "/api/v1/pools/main/revisions/",
                       {"parent_generation": first, "spec": spec, "comment": "e2e: no pre-inference"})
    api.call("POST", f"/api/v1/pools/main/revisions/{created['generation']}/publish/")
    wait_for(lambda: converged_at(api, created["generation"]), 30, "every instance to ACK the new generation")

    time.sleep(1.5)  # pre-inferences admitted just before the ACK finish
    quiet = deltas_over(api, 6)
    assert quiet["relaygr_preinfer_admitted_total"] == 0
    assert quiet["relaygr_rank_ok_total"] > 0  # ranking continues
    assert quiet["relaygr_preinfer_refusals_total{not_at_risk}"] > 0

    rolled = api.call("POST", "/api/v1/pools/main/rollback/", {"to_generation": first, "parent_generation": created["generation"], "comment": "e2e: restore"})
    wait_for(lambda: converged_at(api, rolled["generation"]), 30, "the rollback to converge")
    back = wait_for(lambda: (d := deltas_over(api, 4))["relaygr_preinfer_admitted_total"] > 0 and d, 60,
                    "pre-inferences to resume")
    assert back["relaygr_rank_ok_total"] > 0


def get(url: str, headers: dict[str, str]) -> tuple[int, dict[str, str], str]:
    try:
        with urllib.request.urlopen(urllib.request.Request(url, headers=headers), timeout=10) as response:
            return response.status, dict(response.headers), response.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, dict(exc.headers), exc.read().decode()


def test_a_server_error_shows_no_settings_and_no_traceback(stack):
    _, api, data_dir = stack
    # A real fault: the sessions table gone, so loading a visitor's session fails inside Django.
    database = sqlite3.connect(data_dir / "relaygr.sqlite3", timeout=30)
    try:
        database.execute("ALTER TABLE django_session RENAME TO django_session_hidden")
        status, headers, body = get(f"{api.url}/login/", {"Cookie": f"sessionid={'a' * 32}"})
    finally:
        database.execute("ALTER TABLE django_session_hidden RENAME TO django_session")
        database.close()
    assert status == 500
    for leak in ("Traceback", "SECRET_KEY", "settings", "django_session", "OperationalError", str(ROOT)):
        assert leak not in body, f"the 500 shows {leak!r}"
    assert json.loads(body) == {"detail": f"Internal error; the request id {headers['X-Request-ID']} identifies it "
                                          "in the logs.", "request_id": headers["X-Request-ID"]}
    assert f"[request {headers['X-Request-ID']}]" in (data_dir / "logs" / "web.log").read_text()


def test_debug_pages_are_refused_beyond_loopback():
    done = subprocess.run([sys.executable, "-m", "workers.stack", "--debug", "--host", "0.0.0.0"], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    assert "--debug" in done.stderr and "loopback --host" in done.stderr and "got --host 0.0.0.0" in done.stderr


def test_ctrl_c_stops_every_process_the_stack_started(stack):
    process, api, data_dir = stack
    started = descendants(process.pid)
    assert len(started) >= 7  # redis, gunicorn ×3, sync, pool + 2 instances, replayer
    process.send_signal(signal.SIGINT)
    process.wait(timeout=90)
    assert process.returncode == 0
    time.sleep(0.5)
    left = sorted(pid for pid in started if alive(pid))
    assert left == [], f"processes left after Ctrl-C: {left}"
