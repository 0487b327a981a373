"""Traffic capture, off the ranking path: a bounded in-memory queue drained by one background thread.

The ranking task only calls ``record`` (a ``put_nowait`` of a small tuple); a full queue drops the
record and counts it, so capture never blocks nor slows ranking. The drain thread hashes the user
id under the pool's capture key (``capture.capture_key`` of the deployment's capture secret: the same
on every instance, so a user hashes alike everywhere, and never written to Redis), and appends
batches to the pool's stream in one pipeline: ``XADD … MAXLEN ~ CAPTURE_MAX_RECORDS`` per record, then ``XTRIM MINID ~`` the age bound.
Records lost to a full queue or to an unreachable Redis are added to ``PoolKeys.traffic_dropped``
(instance → count) once Redis answers again. Every capture key expires an hour (the age bound)
after its last write, so a pool gone quiet leaves nothing behind.

The retrieval→ranking gap: ``signal`` notes when a user's pre-infer signal was sent and how long it
took to reach the trigger here (the router sends a user's signal and ranking to one instance);
``record`` uses the latest such note of the user younger than ``MAX_GAP_S``.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import OrderedDict

import redis

from relay_engine.core.capture import (
    CAPTURE_MAX_AGE_S,
    CAPTURE_MAX_RECORDS,
    CaptureRecord,
    capture_key,
    user_hash,
)
from relay_engine.core.wire import PoolKeys

log = logging.getLogger(__name__)

QUEUE_SIZE = 20_000  # records waiting for the drain thread (seconds of traffic at any real rate)
BATCH_SIZE = 500
FLUSH_INTERVAL_S = 0.25
MAX_GAP_S = 60.0  # a pre-infer signal older than this says nothing about the ranking request
MAX_SIGNALS = 50_000  # users whose last signal time is kept (least recently signalled out)
KEY_TTL_S = int(CAPTURE_MAX_AGE_S)  # every capture key outlives its last write by the age bound only


class TrafficCapture:
    def __init__(self, client: redis.Redis, keys: PoolKeys, instance: str, *, secret: str,
                 queue_size: int = QUEUE_SIZE, batch_size: int = BATCH_SIZE,
                 flush_interval_s: float = FLUSH_INTERVAL_S, max_records: int = CAPTURE_MAX_RECORDS,
                 clock=time.time):
        self.client = client
        self.keys = keys
        self.instance = instance
        self._key = capture_key(secret, keys.pool)
        self.batch_size = batch_size
        self.flush_interval_s = flush_interval_s
        self.max_records = max_records
        self.clock = clock
        self.dropped = 0  # records never written (queue full, or Redis refused the batch)
        self.written = 0
        self._reported_drops = 0
        self._queue: queue.Queue = queue.Queue(maxsize=queue_size)
        self._signals: OrderedDict[str, float] = OrderedDict()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # --- the request path: constant time, never blocks ------------------------------------------

    def signal(self, user_id: str, sent_s: float | None = None) -> None:
        """Note a pre-infer signal for ``user_id`` the trigger has just decided on: sent at ``sent_s`` (the
        client's clock), else now."""
        now = self.clock()
        sent = now if sent_s is None else sent_s
        with self._lock:
            self._signals[user_id] = (sent, max(0.0, now - sent))
            self._signals.move_to_end(user_id)
            if len(self._signals) > MAX_SIGNALS:
                self._signals.popitem(last=False)

    def record(self, user_id: str, *, arrived_s: float, prefix_len: int, short_len: int, candidates: int,
               outcome: str, latency_ms: float, miss_reason: str = "", cpu_ms: float | None = None) -> bool:
        """Queue one ranking request's shape; False (and counted) when the queue is full."""
        with self._lock:
            signalled = self._signals.pop(user_id, None)
        gap_ms = delay_ms = None
        if signalled is not None and 0 <= arrived_s - signalled[0] <= MAX_GAP_S:
            gap_ms = (arrived_s - signalled[0]) * 1000
            delay_ms = min(gap_ms, signalled[1] * 1000)
        try:
            self._queue.put_nowait((arrived_s * 1000, user_id, prefix_len, short_len, candidates, gap_ms,
                                    outcome, latency_ms, miss_reason, cpu_ms, delay_ms))
        except queue.Full:
            with self._lock:
                self.dropped += 1
            return False
        return True

    # --- the drain thread -----------------------------------------------------------------------

    def start(self) -> TrafficCapture:
        self._thread = threading.Thread(target=self._run, name=f"capture-{self.instance}", daemon=True)
        self._thread.start()
        return self

    def stop(self, timeout_s: float = 2.0) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout_s)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.drain()

    def drain(self, wait_s: float | None = None) -> int:
        """Write what is queued (waiting up to ``wait_s`` for the first record); records written."""
        batch = []
        try:
            batch.append(self._queue.get(timeout=self.flush_interval_s if wait_s is None else wait_s))
            while len(batch) < self.batch_size:
                batch.append(self._queue.get_nowait())
        except queue.Empty:
            pass
        if not batch and self.dropped == self._reported_drops:
            return 0
        try:
            self._write(batch)
        except redis.RedisError as exc:
            with self._lock:
                self.dropped += len(batch)
            log.warning("%s: traffic capture could not write %d records: %s", self.instance, len(batch), exc)
            self._stop.wait(1.0)  # Redis is down: do not spin on it
            return 0
        self.written += len(batch)
        return len(batch)

    def _write(self, batch: list[tuple]) -> None:
        pipe = self.client.pipeline(transaction=False)
        for (ts_ms, user_id, prefix_len, short_len, candidates, gap_ms, outcome, latency_ms, miss_reason, cpu_ms,
             delay_ms) in batch:
            record = CaptureRecord(ts_ms=ts_ms, user=user_hash(self._key, user_id), prefix_len=prefix_len,
                                   short_len=short_len, candidates=candidates, gap_ms=gap_ms, outcome=outcome,
                                   latency_ms=latency_ms, miss_reason=miss_reason, instance=self.instance,
                                   cpu_ms=cpu_ms, signal_delay_ms=delay_ms)
            pipe.xadd(self.keys.traffic, record.to_fields(), maxlen=self.max_records, approximate=True)
        if batch:
            oldest_ms = int((self.clock() - CAPTURE_MAX_AGE_S) * 1000)
            pipe.xtrim(self.keys.traffic, minid=f"{oldest_ms}-0", approximate=True)
            pipe.expire(self.keys.traffic, KEY_TTL_S)  # a pool gone quiet for that long keeps nothing
        with self._lock:
            unreported = self.dropped - self._reported_drops
        if unreported:
            pipe.hincrby(self.keys.traffic_dropped, self.instance, unreported)
            pipe.expire(self.keys.traffic_dropped, KEY_TTL_S)
        pipe.execute()
        with self._lock:
            self._reported_drops += unreported
