"""The real stack, smaller, for the browser tests: the control plane under gunicorn on a free port
(its own SQLite file, the test Redis under a unique key prefix), two real worker processes with the
small model, and a steady trickle of traffic through ``workers.client`` so telemetry exists.

Nothing is faked: the pages talk to the real API, which reads what the real workers write to Redis.
"""

from __future__ import annotations

import json
import os
import random
import secrets
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
import uuid
from pathlib import Path

from relay_engine.core.lifetime import die_with_parent
from relay_engine.core.wire import CONTROLPLANE_QUEUES, instance_name
from workers.app import redis_client
from workers.client import RelayClient, RelayError
from workers.embedded_redis import free_port
from workers.pool import spawn_instance, wait_until_live
from workers.settings import Settings
from workers.stack import controlplane_worker_argv

REPO = Path(__file__).resolve().parents[2]
POOL = "ranking-a"
LARGE_POOL = "ranking-large"  # stand-in instances of the load fleet (``workers.loadfleet``)
LARGE_POOL_SIZE = 32
PASSWORD = "correct horse battery staple"
USERS = {"sre": "operator", "pm": "viewer"}

# What the live view says of the pool's times, as ``make run`` describes its demo pool.
POOL_NOTE = ("browser-test pool: every latency ×1.0 of the reference accelerator's, SLO 50 ms × 1.0 = 50 ms "
             "(this stack's deadline is 2 s)")
# The schema, then users, tokens and the pool, made by the control plane's own services, in one
# process (each Django start costs seconds); prints the token keys.
_SETUP = """
import json
import django
django.setup()
from django.core.management import call_command
call_command("migrate", verbosity=0)
from controlplane.accounts import services as accounts
from controlplane.accounts.roles import Role
from controlplane.policies import services as policies
keys = {}
for username, role in %(users)r.items():
    user = accounts.user_create(username=username, role=Role.parse(role), password=%(password)r, actor="setup")
    keys[username] = accounts.token_create(user=user, actor="setup").key
policies.pool_create(name=%(pool)r, description=%(note)r, expected_instances=2, actor="setup")
policies.pool_create(name=%(large)r, description="load-fleet pool", expected_instances=%(size)d, actor="setup")
print(json.dumps(keys))
"""


class Stack:
    def __init__(self, redis_url: str, workdir: Path, *, instances: int = 2, env: dict[str, str] | None = None):
        self.workdir = workdir
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.key_prefix = f"test-{uuid.uuid4().hex[:10]}"
        self.env = {
            **os.environ,
            "DJANGO_SETTINGS_MODULE": "controlplane.settings.test",
            "DATABASE_URL": f"sqlite:///{workdir / 'controlplane.sqlite3'}",
            "REDIS_URL": redis_url,
            "RELAYGR_KEY_PREFIX": self.key_prefix,
            "RELAYGR_WRITE_THROTTLE_RATE": "1000/min",
            # The canary bake is judged every second, on at least 20 requests (the trickle's pace).
            "RELAYGR_ROLLOUT_EVAL_S": "1",
            "RELAYGR_ROLLOUT_MIN_REQUESTS": "20",
            **(env or {}),
        }
        self.worker_settings = Settings.from_env(
            {}, redis_url=redis_url, key_prefix=self.key_prefix, pool=POOL, pool_size=instances, device="cpu",
            model="small", rank_threads=2, torch_threads=1, data_dir=str(workdir / "worker-state"),
            capture_secret=secrets.token_hex(32),
        )
        self.redis = redis_client(self.worker_settings)
        self.server: subprocess.Popen | None = None
        self.workers: dict[str, subprocess.Popen] = {}
        self.load_fleet: subprocess.Popen | None = None
        self.controlplane_workers: dict[str, subprocess.Popen] = {}
        self.tokens: dict[str, str] = {}
        self.traffic = Traffic(self.worker_settings)

    # --- control plane --------------------------------------------------------------------------

    def set_up(self) -> None:
        script = _SETUP % {"users": USERS, "password": PASSWORD, "pool": POOL, "note": POOL_NOTE, "large": LARGE_POOL,
                           "size": LARGE_POOL_SIZE}
        done = subprocess.run([sys.executable, "-c", script], cwd=REPO, env=self.env, capture_output=True,
                              text=True, timeout=120)
        if done.returncode != 0:
            raise RuntimeError(f"setting up the control plane failed:\n{done.stderr[-3000:]}")
        self.tokens = json.loads(done.stdout.strip().splitlines()[-1])

    def create_pool(self, name: str, description: str = "") -> None:
        """One more pool, made by the control plane's own service (creating pools takes an admin, whom
        the browser tests have no session of)."""
        script = ("import django\ndjango.setup()\nfrom controlplane.policies import services\n"
                  f"services.pool_create(name={name!r}, description={description!r}, actor='setup')\n")
        done = subprocess.run([sys.executable, "-c", script], cwd=REPO, env=self.env, capture_output=True,
                              text=True, timeout=120)
        if done.returncode != 0:
            raise RuntimeError(f"creating pool {name} failed:\n{done.stderr[-3000:]}")

    def start_server(self) -> None:
        log = (self.workdir / "gunicorn.log").open("a")
        self.server = subprocess.Popen(
            [sys.executable, "-m", "gunicorn", "controlplane.wsgi", "--bind", f"127.0.0.1:{self.port}",
             "--workers", "1", "--threads", "8", "--timeout", "60", "--graceful-timeout", "2",
             "--access-logfile", "-"],
            # Its own process group, so ``kill_server`` takes gunicorn's worker down with the master.
            cwd=REPO, env=self.env, stdout=log, stderr=subprocess.STDOUT, process_group=0,
            preexec_fn=die_with_parent(),  # a killed test run leaves no server behind
        )
        deadline = time.monotonic() + 60
        while True:
            if self.server.poll() is not None:
                raise RuntimeError(f"gunicorn exited with {self.server.returncode}; see {self.workdir}/gunicorn.log")
            try:
                with urllib.request.urlopen(f"{self.base_url}/login/", timeout=2) as response:
                    if response.status == 200:
                        return
            except (urllib.error.URLError, OSError):
                pass
            if time.monotonic() > deadline:
                raise TimeoutError("the control plane did not answer within 60 s")
            time.sleep(0.1)

    def start_controlplane_worker(self) -> None:
        """The control plane's Celery workers as ``make run`` starts them: the canary bake's (with the
        beat) and the previews', one process each, by queue (``controlplane_workers``); each its own
        process group, so ``stop_controlplane_worker`` takes its threads and simulator runs down too."""
        for queue in CONTROLPLANE_QUEUES:
            log = (self.workdir / f"controlplane-{queue}.log").open("a")
            self.controlplane_workers[queue] = subprocess.Popen(
                controlplane_worker_argv(sys.executable, self.workdir, queue, self.key_prefix), cwd=REPO,
                env=self.env, stdout=log, stderr=subprocess.STDOUT, process_group=0, preexec_fn=die_with_parent())

    def stop_controlplane_worker(self, sig: int = signal.SIGTERM) -> None:
        self._signal_controlplane_workers(sig)
        self._await_controlplane_workers()

    def _signal_controlplane_workers(self, sig: int) -> None:
        for worker in self.controlplane_workers.values():
            if worker.poll() is None:
                os.killpg(worker.pid, sig)

    def _await_controlplane_workers(self) -> None:
        for worker in self.controlplane_workers.values():
            try:
                worker.wait(15)
            except subprocess.TimeoutExpired:
                os.killpg(worker.pid, signal.SIGKILL)
                worker.wait()
        self.controlplane_workers = {}

    def stop_server(self) -> None:
        self._signal_server()
        self._await_server()

    def _signal_server(self) -> None:
        if self.server is not None and self.server.poll() is None:
            self.server.send_signal(signal.SIGTERM)

    def _await_server(self) -> None:
        if self.server is not None:
            try:
                self.server.wait(10)
            except subprocess.TimeoutExpired:
                self.server.kill()
                self.server.wait()
        self.server = None

    def kill_server(self) -> None:
        """``kill -9`` of the web server: master and workers at once, nothing cleaned up."""
        if self.server is not None:
            os.killpg(self.server.pid, signal.SIGKILL)
            self.server.wait()
        self.server = None

    def api(self, method: str, path: str, body: dict | None = None, *, user: str = "sre") -> tuple[int, dict]:
        """A call to the REST API with a user's token (automation's view, not the browser's)."""
        request = urllib.request.Request(
            f"{self.base_url}{path}", method=method, data=None if body is None else json.dumps(body).encode(),
            headers={"Authorization": f"Token {self.tokens[user]}", "Content-Type": "application/json"},
        )
        try:
            with urllib.request.urlopen(request, timeout=10) as response:
                return response.status, json.loads(response.read() or b"{}")
        except urllib.error.HTTPError as exc:
            return exc.code, json.loads(exc.read() or b"{}")

    # --- workers ------------------------------------------------------------------------------------

    def spawn_workers(self) -> None:
        """Start the instances; they apply the pool's revision once the control plane publishes it."""
        for index in range(self.worker_settings.pool_size):
            self.spawn_worker(index)

    def spawn_worker(self, index: int) -> str:
        """Start (or restart) instance ``index``; its log is appended to."""
        name = instance_name(POOL, index)
        log = (self.workdir / f"{name}.log").open("a")
        self.workers[name] = spawn_instance(self.worker_settings, index, stdout=log, stderr=subprocess.STDOUT)
        return name

    def wait_for_workers(self) -> None:
        wait_until_live(self.redis, self.worker_settings, sorted(self.workers), 90, list(self.workers.values()))

    def start_load_fleet(self) -> None:
        """``LARGE_POOL_SIZE`` stand-in instances of ``LARGE_POOL`` (real loops, real Redis, no model);
        returns once every one heartbeats."""
        if self.load_fleet is not None:
            return
        env = {**self.env, **self.worker_settings.worker_env(), "RELAYGR_POOL": LARGE_POOL}
        log = (self.workdir / "loadfleet.log").open("a")
        self.load_fleet = subprocess.Popen(
            [sys.executable, "-m", "workers.loadfleet", "--instances", str(LARGE_POOL_SIZE), "--rank-per-s", "5"],
            cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=log, text=True, preexec_fn=die_with_parent())
        line = self.load_fleet.stdout.readline()
        if "live" not in line:
            raise RuntimeError(f"the load fleet did not start ({line!r}); see {self.workdir}/loadfleet.log")

    def start(self) -> Stack:
        """Everything, in the order that overlaps the slow parts: workers load torch while the control
        plane sets up; then the server, the control plane's workers, and traffic once workers are live."""
        self.spawn_workers()
        self.set_up()
        self.start_server()
        self.start_controlplane_worker()
        self.wait_for_workers()
        self.traffic.start()
        return self

    def stop(self) -> None:
        self.traffic.stop()
        # Every process is told first and awaited after, so their shutdowns overlap.
        if self.load_fleet is not None:
            self.load_fleet.terminate()
        for proc in self.workers.values():
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        self._signal_controlplane_workers(signal.SIGTERM)
        self._signal_server()
        if self.load_fleet is not None:
            self.load_fleet.wait(60)
        for proc in self.workers.values():
            try:
                proc.wait(15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        self._await_controlplane_workers()
        self._await_server()
        for pattern in (f"{self.key_prefix}*", f"_kombu.binding*{self.key_prefix}.*"):
            for key in self.redis.scan_iter(pattern):
                self.redis.delete(key)
        self.redis.close()


class Traffic:
    """Pre-infer signals and ranking requests at a modest steady rate, from a background thread.

    Half the users have long prefixes (at risk under the default threshold, so pre-inferred), half
    short ones (refused as not at risk), and users repeat, so HBM hits, misses and refusals all show.
    """

    def __init__(self, settings: Settings, *, rate_per_s: float = 12.0, users: int = 24):
        self.settings = settings
        self.rate_per_s = rate_per_s
        self.users = users
        self.sent = 0
        self.errors = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="browser-test-traffic", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(10)

    def __enter__(self) -> Traffic:
        self.start()
        return self

    def __exit__(self, *exc_info) -> None:
        self.stop()

    def _run(self) -> None:
        rng = random.Random(11)
        with RelayClient(self.settings) as client:
            query = 0
            while not self._stop.is_set():
                user = rng.randrange(self.users)
                seq_len = 640 + 8 * user if user % 2 == 0 else 48 + user
                fields = {"seq_len": seq_len}
                try:
                    client.pre_infer(f"user-{user}", **fields)
                    time.sleep(0.02)
                    client.rank(f"user-{user}", deadline_s=time.time() + 2.0, short_len=4, n_candidates=16,
                                query_index=query, **fields)
                    self.sent += 1
                except RelayError:
                    self.errors += 1
                query += 1
                self._stop.wait(max(0.0, 1.0 / self.rate_per_s - 0.02))
