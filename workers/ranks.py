"""Ranking requests on a plain Redis list per instance, taken by the instance's own rank threads.

    ranks.send(redis, keys, instance, payload, reply_key, deadline_s)   # the client: one pipelined RPUSH
    RankConsumer(redis, keys.rank_requests(inst), runtime, threads=4).start()   # the instance

The instance is still a Celery worker (Celery runs its life: start, warm shutdown, the compatibility
task ``RANK_TASK`` for senders of the Celery protocol), but a ranking request no longer goes through
Celery's message protocol. Through it, a request cost the client ~0.8 ms to publish (kombu's
envelope) and the worker a wake-up of Celery's event loop, a ``Request`` object, a hand-off to a pool
thread and the task tracer, all under one GIL with the prefill lane and the signal reader: on a quiet
2-core machine the send → task start leg alone had a P99 of 5.7–6.7 ms (``bench_roundtrip``), where
the goal for the whole overhead is 3 ms. Here each rank thread blocks in ``BLPOP`` on the instance's
list on its own connection: the one the request wakes takes it, runs it and pushes the answer to the
sender's reply list — one Redis round trip each way, nothing in between.

An entry is ``{"p": payload, "r": reply key, "d": deadline unix s, "t": sent unix s}``. One picked up
past its deadline is answered with a deadline error at once, never run (what Celery's ``expires``
did); one that is not an entry of ours is answered with an error where it names a reply list of
this pool, and otherwise dropped. The list expires ``LIST_TTL_S`` after its last request, so a stopped
instance's list never lingers. Entries are untrusted input: nothing in one can crash a thread.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from typing import TYPE_CHECKING, Any

import redis

from relay_engine.core import fields
from relay_engine.core.wire import PoolKeys
from workers.payloads import INVALID_INPUT, error_result
from workers.periodic import ReadBackoff

if TYPE_CHECKING:
    from workers.tasks import InstanceRuntime

log = logging.getLogger(__name__)

LIST_TTL_S = 60
BLOCK_S = 1.0  # how long one BLPOP waits (also how soon ``stop`` is seen)


def entry(payload: Any, reply_key: str, deadline_s: float, sent_s: float | None = None) -> str:
    return json.dumps({"p": payload, "r": reply_key, "d": deadline_s, "t": time.time() if sent_s is None else sent_s},
                      separators=(",", ":"))


def send(client: redis.Redis, keys: PoolKeys, instance: str, payload: Any, reply_key: str, deadline_s: float,
         sent_s: float | None = None) -> None:
    """Queue one ranking request for ``instance`` (raises ``redis.RedisError`` when Redis cannot be reached)."""
    key = keys.rank_requests(instance)
    pipe = client.pipeline(transaction=False)
    pipe.rpush(key, entry(payload, reply_key, deadline_s, sent_s))
    pipe.expire(key, LIST_TTL_S)
    pipe.execute()


def decode(raw: str) -> tuple[dict[str, Any] | None, object]:
    """(the entry, with ``p``, ``r`` a string and ``d`` a finite number, or None when it is not one;
    the reply key it names, if any, so that even an entry that is not ours can be answered)."""
    try:
        data = json.loads(raw)
    except (ValueError, RecursionError):
        return None, None
    if not isinstance(data, dict):
        return None, None
    reply_to = data.get("r")
    deadline = data.get("d")
    if "p" not in data or not isinstance(reply_to, str) or not fields.is_number(deadline) \
            or not fields.is_finite(deadline):
        return None, reply_to
    return data, reply_to


class RankConsumer:
    """One instance's ranking readers: ``threads`` daemon threads, each blocked on the request list."""

    def __init__(self, client: redis.Redis, keys: PoolKeys, key: str, runtime: InstanceRuntime, *, threads: int):
        self.client = client
        self.keys = keys
        self.key = key
        self.runtime = runtime
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._run, name=f"rank-{i}", daemon=True) for i in range(threads)]

    def start(self) -> RankConsumer:
        for thread in self._threads:
            thread.start()
        return self

    def stop(self, timeout_s: float = BLOCK_S + 5) -> None:
        """Take no more requests; wait for those being ranked (a warm shutdown)."""
        self._stop.set()
        end = time.monotonic() + timeout_s
        for thread in self._threads:
            if thread.is_alive():
                thread.join(max(0.0, end - time.monotonic()))

    def handle(self, raw: str) -> None:
        """Rank one raw entry and answer its sender (every outcome answered where it can be)."""
        data, reply_to = decode(raw)
        if data is None:  # answered where it names a reply list of this pool (``reply`` checks)
            self.runtime.reply(reply_to, error_result(
                INVALID_INPUT, "not a ranking request: expected a JSON object with p (the payload), r (the reply "
                               "list) and d (the deadline, unix seconds)", instance=self.runtime.name))
            return
        if time.time() > data["d"]:  # queued past its deadline: answered, never run
            self.runtime.expired_in_queue(data["p"], data["r"])
            return
        started_s = time.time()
        result = self.runtime.rank((data["p"],), {})
        if result.get("ok"):  # when the body ran, for the sender's split of its round trip
            result["worker_s"] = [started_s, time.time()]
        self.runtime.reply(data["r"], result)

    def _run(self) -> None:
        backoff = ReadBackoff(self._stop, "ranking requests")
        while not self._stop.is_set():
            try:
                popped = self.client.blpop([self.key], timeout=BLOCK_S)
                backoff.succeeded()
            except redis.RedisError as exc:  # Redis restarting: wait, then read on
                backoff.failed(self.key, exc)
                continue
            if popped is None:
                continue
            try:
                # Ranking from here to the answer: pre-inference yields to all of it (``RankingGate``).
                with self.runtime.engine.ranking_gate.running():
                    self.handle(popped[1])
            except Exception:  # noqa: BLE001 — a bug in one request never stops a rank thread
                log.exception("ranking requests: one request failed outside the engine")

