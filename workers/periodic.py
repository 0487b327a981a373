"""Background loops of a worker: run a step every interval until stopped, surviving Redis outages."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

import redis

log = logging.getLogger(__name__)


class Periodic:
    """Calls ``step`` every ``interval_s`` on its own thread. A Redis error is logged once per outage
    (and once when it ends) and the loop carries on, so a Redis restart is ridden out.

    ``wait(timeout_s)`` sleeps between steps; a custom one may return early (a poke) to step sooner.
    """

    def __init__(self, name: str, interval_s: float, step: Callable[[], object],
                 wait: Callable[[float], object] | None = None):
        self.name = name
        self.interval_s = interval_s
        self.step = step
        self.stopped = threading.Event()
        self._wait = wait or self.stopped.wait
        self._failing = False
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)

    def start(self) -> Periodic:
        self._thread.start()
        return self

    def _run(self) -> None:
        while not self.stopped.is_set():
            started = time.monotonic()
            self.run_step()
            if not self.stopped.is_set():
                self._wait(max(0.0, started + self.interval_s - time.monotonic()))

    def run_step(self) -> None:
        try:
            self.step()
        except redis.RedisError as exc:
            if not self._failing:
                log.warning("%s: Redis unavailable (%s); retrying every %.1f s", self.name, exc, self.interval_s)
            self._failing = True
            return
        except Exception:  # noqa: BLE001 — a bug in one step must not stop the instance's heartbeat
            log.exception("%s: step failed", self.name)
            return
        if self._failing:
            log.warning("%s: Redis reachable again", self.name)
        self._failing = False

    def stop(self, timeout_s: float = 5.0) -> None:
        self.stopped.set()
        if self._thread.is_alive():
            self._thread.join(timeout_s)


class ReadBackoff:
    """How a blocking reader of a Redis list rides out an outage: after a failed read it logs and waits
    0.1 s, doubling up to 2 s, until a read succeeds (or ``stop`` is set)."""

    FIRST_S = 0.1
    MAX_S = 2.0

    def __init__(self, stop: threading.Event, what: str):
        self.stop = stop
        self.what = what
        self.wait_s = self.FIRST_S

    def succeeded(self) -> None:
        self.wait_s = self.FIRST_S

    def failed(self, key: str, exc: BaseException) -> None:
        log.warning("%s: cannot read %s (%s); retrying in %.1f s", self.what, key, exc, self.wait_s)
        self.stop.wait(self.wait_s)
        self.wait_s = min(self.MAX_S, self.wait_s * 2)
