"""A real pool for the tests: worker processes on a real Redis, each test module with its own prefix.

Nothing here fakes Redis or Celery: instances are ``python -m workers.instance`` processes (the
small model unless told otherwise, one torch thread), revisions are published the way the control
plane does (desired JSON + poke), and the client is ``workers.client.RelayClient``.
"""

from __future__ import annotations

import dataclasses
import secrets
import subprocess
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import redis

from relay_engine.core.config import parse_policy
from relay_engine.core.wire import DesiredRevision, InstanceStatus, instance_name
from workers.app import redis_client
from workers.client import RelayClient
from workers.pool import spawn_instance, wait_until_live
from workers.settings import Settings

START_TIMEOUT_S = 60.0


def wait_for(predicate: Callable[[], Any], timeout_s: float, interval_s: float = 0.02, what: str = "condition"):
    deadline = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")
        time.sleep(interval_s)


class Fleet:
    def __init__(self, redis_url: str, logdir: Path, *, pool: str = "test", size: int = 2, rank_threads: int = 2,
                 model: str = "small"):
        self.settings = Settings.from_env(
            {}, redis_url=redis_url, key_prefix=f"test-{uuid.uuid4().hex[:10]}", pool=pool, pool_size=size,
            device="cpu", model=model, rank_threads=rank_threads, torch_threads=1,
            capture_secret=secrets.token_hex(32),
        )
        # Each instance's last applied revision goes to this test's folder, not the user's.
        self.settings = dataclasses.replace(self.settings, data_dir=str(logdir / "state"))
        self.keys = self.settings.keys
        self.logdir = logdir
        self.redis: redis.Redis = redis_client(self.settings)
        self.procs: dict[str, subprocess.Popen] = {}
        self.generation = 0
        self._client: RelayClient | None = None

    @property
    def names(self) -> list[str]:
        return sorted(self.procs)

    @property
    def client(self) -> RelayClient:
        if self._client is None:
            self._client = RelayClient(self.settings)
        return self._client

    def start(self) -> Fleet:
        self.publish({})  # generation 1: the schema's defaults, as a new pool in the control plane
        for index in range(self.settings.pool_size):
            self._spawn(index)
        wait_until_live(self.redis, self.settings, self.names, START_TIMEOUT_S, list(self.procs.values()))
        self.client.refresh()
        return self

    def add_instance(self) -> str:
        """Start the next instance of the pool (an instance joining a running pool); returns its name
        once it is live and the client routes to it."""
        name = self._spawn(len(self.procs))
        wait_until_live(self.redis, self.settings, [name], START_TIMEOUT_S, [self.procs[name]])
        self.client.refresh()
        return name

    def _spawn(self, index: int) -> str:
        name = instance_name(self.settings.pool, index)
        log = (self.logdir / f"{name}.log").open("w")
        self.procs[name] = spawn_instance(self.settings, index, stdout=log, stderr=subprocess.STDOUT)
        return name

    def stop(self) -> None:
        if self._client is not None:
            self._client.close()
        # The test is done with them: a graceful stop would wait out every reader's BLPOP (~2.6 s a fleet) and
        # check nothing; the tests of a clean stop send their own SIGTERM. Their keys go below either way.
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.kill()
        for proc in self.procs.values():
            proc.wait()
        # Our keys, queues and result keys, and kombu's bindings of our queues: a shared Redis stays clean.
        for pattern in (f"{self.settings.key_prefix}*", f"_kombu.binding*{self.settings.key_prefix}.*"):
            for key in self.redis.scan_iter(pattern):
                self.redis.delete(key)
        self.redis.close()

    # --- the control plane's side of the wire --------------------------------------------------

    def desired_revision(self, spec: dict, *, sha256: str | None = None) -> DesiredRevision:
        self.generation += 1
        try:
            digest = parse_policy(spec).sha256()
        except ValueError:
            digest = "0" * 64  # an invalid spec cannot be hashed by the schema; the worker NACKs it first
        return DesiredRevision(self.generation, sha256 or digest, spec, time.time(), "tests")

    def publish(self, spec: dict, *, poke: bool = True) -> int:
        revision = self.desired_revision(spec)
        self.redis.set(self.keys.desired, revision.to_json())
        if poke:
            self.redis.publish(self.keys.poke_channel, str(revision.generation))
        return revision.generation

    def status(self, name: str) -> InstanceStatus:
        return InstanceStatus.from_json(self.redis.get(self.keys.status(name)))

    def statuses(self) -> dict[str, InstanceStatus]:
        return {name: self.status(name) for name in self.names if self.procs[name].poll() is None}

    def running_statuses(self) -> list[InstanceStatus]:
        """Statuses of the running instances; fails when none runs, so an ``all()`` over it can fail."""
        statuses = list(self.statuses().values())
        assert statuses, f"no instance of {self.names} is running"
        return statuses

    def log_tail(self, name: str, lines: int = 30) -> str:
        return "\n".join((self.logdir / f"{name}.log").read_text().splitlines()[-lines:])
