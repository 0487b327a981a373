"""Start a pool: ``RELAYGR_POOL_SIZE`` instance processes (``workers.instance``), kept running.

    python -m workers.pool [--pool NAME] [--size N] [--device auto|cpu|cuda|npu] [--model small|FILE]

Instance ``i`` gets index ``i``; with an accelerator kind and no index (``cuda``), instance ``i``
is bound to device ``i mod count``. An instance that exits unexpectedly is restarted after a
short pause; SIGINT/SIGTERM stop them all (warm shutdown: each leaves the live set first).
"""

from __future__ import annotations

import argparse
import logging
import multiprocessing
import os
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from typing import Any

import redis
import torch

from relay_engine.core import devices
from relay_engine.core.lifetime import die_with_parent
from workers.membership import live_members
from workers.settings import MODELS, Settings

log = logging.getLogger("workers.pool")
RESTART_PAUSE_S = 1.0
STOP_TIMEOUT_S = 10.0


def instance_device(device: str, index: int) -> str:
    """``cuda``/``npu`` without an index spread over the visible devices; anything else as given."""
    if device == "cuda" and torch.cuda.is_available():
        return f"cuda:{index % torch.cuda.device_count()}"
    if device == "npu" and devices.npu_available():
        return f"npu:{index % torch.npu.device_count()}"
    return device


def spawn_instance(settings: Settings, index: int, *, module: str = "workers.instance",
                   **popen: Any) -> subprocess.Popen:
    """Start instance ``index`` of ``settings.pool`` as a child process with these settings (``module``:
    another entry point taking ``workers.instance``'s arguments, e.g. a build under test)."""
    env = {**os.environ, **settings.worker_env(), "RELAYGR_DEVICE": instance_device(settings.device, index)}
    return subprocess.Popen([sys.executable, "-m", module, "--index", str(index)], env=env,
                            preexec_fn=die_with_parent(), **popen)


def _exit_code(proc: subprocess.Popen | multiprocessing.Process) -> int | None:
    return proc.poll() if isinstance(proc, subprocess.Popen) else proc.exitcode


def wait_until_live(client: redis.Redis, settings: Settings, names: list[str], timeout_s: float = 60.0,
                    procs: Sequence[subprocess.Popen | multiprocessing.Process] = ()) -> None:
    """Block until every named instance heartbeats; RuntimeError if one of ``procs`` dies first."""
    deadline = time.monotonic() + timeout_s
    while set(names) - set(live_members(client, settings.keys)):
        dead = [p for p in procs if _exit_code(p) is not None]
        if dead:
            raise RuntimeError(f"instance process {dead[0].pid} exited with {_exit_code(dead[0])} before joining")
        if time.monotonic() > deadline:
            raise TimeoutError(f"instances {sorted(names)} not live within {timeout_s:g} s")
        time.sleep(0.05)


class PoolSupervisor:
    """The pool's instances as child processes (``popen``: passed to each, e.g. where its output goes)."""

    def __init__(self, settings: Settings, **popen: Any):
        self.settings = settings
        self.popen = popen
        self.procs: dict[int, subprocess.Popen] = {}
        self.stopping = False

    def start(self, index: int) -> None:
        self.procs[index] = spawn_instance(self.settings, index, **self.popen)
        log.info("started %s.%d (pid %d)", self.settings.pool, index, self.procs[index].pid)

    def run(self) -> int:
        for index in range(self.settings.pool_size):
            self.start(index)
        while not self.stopping:
            time.sleep(0.5)
            for index, proc in list(self.procs.items()):
                if proc.poll() is not None and not self.stopping:
                    log.warning("%s.%d exited with %s; restarting", self.settings.pool, index, proc.returncode)
                    time.sleep(RESTART_PAUSE_S)
                    self.start(index)
        return self.stop()

    def stop(self) -> int:
        self.stopping = True
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.terminate()
        deadline = time.monotonic() + STOP_TIMEOUT_S
        for proc in self.procs.values():
            try:
                proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m workers.pool", description=__doc__.split("\n\n")[0])
    parser.add_argument("--pool")
    parser.add_argument("--size", type=int)
    parser.add_argument("--device")
    parser.add_argument("--model", help=f"a preset ({', '.join(MODELS)}) or a weights file (default $RELAYGR_MODEL)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s pool %(levelname)s: %(message)s")
    settings = Settings.from_env(pool=args.pool, pool_size=args.size, device=args.device, model=args.model)
    supervisor = PoolSupervisor(settings)

    def _stop(signum: int, _frame: object) -> None:
        supervisor.stopping = True

    signal.signal(signal.SIGTERM, _stop)
    signal.signal(signal.SIGINT, _stop)
    return supervisor.run()


if __name__ == "__main__":
    sys.exit(main())
