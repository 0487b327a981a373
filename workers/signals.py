"""Pre-infer signals on a plain Redis list per instance, off Celery.

    signals.send(redis, keys, instance, payload)      # the client: one pipelined RPUSH, fire and forget
    SignalConsumer(redis, keys.preinfer_signals(inst), handle).start()   # the instance: one thread

A signal only asks the instance to think about a prefix; the trigger answers at once and an admitted
prefill runs on the engine's own lane. Through Celery each signal cost a task message, a consumer
wake-up and a worker thread's time for the whole task protocol (py-spy under a backlog: 46 % of the
process's GIL time in Celery's pool and main threads, against 6 % in the pre-infer bodies), all on
the threads that ranking requests need. Here one thread takes signals in batches (``LRANGE``/``LTRIM``
of up to ``BATCH`` in one transaction, ``BLPOP`` when the list is empty, ``COALESCE_S`` between
batches), yields to ranking before each read and each signal (the engine's ``yield_to_ranking``: the lane's
share and nice), and Celery consumes only the ranking queue.

An entry is ``{"p": payload, "t": unix seconds sent}``. One older than ``SIGNAL_TTL_S`` is dropped
unread (its ranking request has come and gone); the list is trimmed to its newest ``MAX_QUEUED``
entries at every send and expires ``LIST_TTL_S`` after the last one, so a stopped instance's list
never grows without bound. Entries are untrusted input: one that is not JSON, not an object, or
whose payload fails validation is counted and skipped, never raised.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

import redis

from relay_engine.core.wire import PoolKeys
from workers.periodic import ReadBackoff

log = logging.getLogger(__name__)

SIGNAL_TTL_S = 2.0  # a signal is useful until its ranking request arrives (tens of ms)
MAX_QUEUED = 10_000
LIST_TTL_S = 60
BATCH = 64
BLOCK_S = 1.0  # how long one BLPOP waits (also how soon ``stop`` is seen)
# After a batch, the reader waits this long for more to gather. Under a stream of signals, a read per
# signal (two Redis round trips, their parsing under the GIL) took a third of the instance's GIL time
# (py-spy --gil, 500 signals/s), more than its ranking threads; a signal waits at most this much more,
# where its ranking request comes tens of milliseconds later.
COALESCE_S = 0.005
REPORT_EVERY_S = 60.0


def entry(payload: dict[str, Any], sent_s: float | None = None) -> str:
    return json.dumps({"p": payload, "t": time.time() if sent_s is None else sent_s}, separators=(",", ":"))


def send(client: redis.Redis, keys: PoolKeys, instance: str, payload: dict[str, Any]) -> None:
    """Queue one signal for ``instance`` (raises ``redis.RedisError`` when Redis cannot be reached)."""
    key = keys.preinfer_signals(instance)
    pipe = client.pipeline(transaction=False)
    pipe.rpush(key, entry(payload))
    pipe.ltrim(key, -MAX_QUEUED, -1)
    pipe.expire(key, LIST_TTL_S)
    pipe.execute()


def decode(raw: str) -> tuple[dict[str, Any] | None, float]:
    """(payload, sent unix s) of one entry; (None, nan) when it is not one."""
    try:
        data = json.loads(raw)
    except (ValueError, RecursionError):
        return None, float("nan")
    if not isinstance(data, dict) or not isinstance(data.get("p"), dict):
        return None, float("nan")
    sent = data.get("t")
    if not isinstance(sent, (int, float)) or isinstance(sent, bool) or sent != sent:
        return None, float("nan")
    return data["p"], float(sent)


class SignalConsumer:
    """One instance's signal reader: a daemon thread calling ``handle(payload, sent_s)`` for each fresh signal."""

    def __init__(self, client: redis.Redis, key: str, handle: Callable[[dict[str, Any], float], Any],
                 *, ttl_s: float = SIGNAL_TTL_S, clock: Callable[[], float] = time.time,
                 yield_point: Callable[[], None] | None = None):
        self.client = client
        self.key = key
        self.handle = handle
        self.ttl_s = ttl_s
        self.clock = clock
        self.yield_point = yield_point  # before each signal: the engine's ``yield_to_ranking``, or none
        self.handled = 0
        self.expired = 0  # older than ttl_s when read: dropped unread
        self.invalid = 0  # not an entry of ours, or a payload the instance refused
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="preinfer-signals", daemon=True)
        self._reported = time.monotonic()

    def start(self) -> SignalConsumer:
        self._thread.start()
        return self

    def stop(self, timeout_s: float = BLOCK_S + 2) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout_s)

    def take(self, block_s: float = BLOCK_S) -> list[str]:
        """The next batch of raw entries: up to ``BATCH`` queued ones in one round trip, else the
        first to arrive within ``block_s`` (empty when none does)."""
        pipe = self.client.pipeline(transaction=True)
        pipe.lrange(self.key, 0, BATCH - 1)
        pipe.ltrim(self.key, BATCH, -1)
        batch, _ = pipe.execute()
        if batch:
            return batch
        first = self.client.blpop([self.key], timeout=block_s)
        return [] if first is None else [first[1]]

    def process(self, raws: list[str]) -> None:
        now = self.clock()
        for raw in raws:
            if self.yield_point is not None:
                self.yield_point()
            payload, sent_s = decode(raw)
            if payload is None:
                self.invalid += 1
            elif now - sent_s > self.ttl_s:
                self.expired += 1
            else:
                result = self.handle(payload, sent_s)
                if isinstance(result, dict) and result.get("ok") is False:
                    self.invalid += 1
                else:
                    self.handled += 1
            if self.yield_point is None:
                time.sleep(0)  # let a ranking thread in between signals (the yield point does, where there is one)

    def _run(self) -> None:
        backoff = ReadBackoff(self._stop, "pre-infer signals")
        while not self._stop.is_set():
            if self.yield_point is not None:
                self.yield_point()  # the next read, and its parsing, waits for a gap in ranking (or a quantum)
            try:
                raws = self.take()
                backoff.succeeded()
            except redis.RedisError as exc:  # Redis restarting: wait, then read on
                backoff.failed(self.key, exc)
                continue
            try:
                self.process(raws)
            except Exception:  # noqa: BLE001 — a bug in one signal never stops the reader
                log.exception("pre-infer signals: a batch of %d failed", len(raws))
            self._report()
            if raws:  # let the next ones gather: one round trip per batch, not per signal
                self._stop.wait(COALESCE_S)

    def _report(self) -> None:
        if time.monotonic() - self._reported < REPORT_EVERY_S or not (self.expired or self.invalid):
            return
        self._reported = time.monotonic()
        log.warning("pre-infer signals so far: %d handled, %d dropped as older than %.1f s, %d invalid",
                    self.handled, self.expired, self.ttl_s, self.invalid)
