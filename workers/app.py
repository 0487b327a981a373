"""The Celery app of the fleet and the Redis client the workers and the client use.

Both the worker (``workers.instance``) and the client (``workers.client``) build their app here
from the same ``Settings``, so they agree on the broker, the result backend and its key prefix.
The one task, ``RANK_TASK``, is addressed by name on the per-instance queue that
``relay_engine.core.wire.PoolKeys`` names; only the worker process registers its body. Pre-infer
signals do not go through Celery (``workers.signals``).

Reliability settings, each chosen on purpose:

- **Ack early** (``task_acks_late = False``): a ranking answer is worth nothing after its
  deadline (tens of ms), so redelivering the request of a crashed worker cannot help; the client
  stops waiting at deadline + grace and reports a deadline error, so a lost request surfaces, it
  is never silently dropped.
- **Prefetch 1 per thread** (``worker_prefetch_multiplier = 1``): each instance consumes only its
  own queues, so prefetching more cannot balance anything; it would only hide the queue depth and
  strand more reserved messages if the process dies.
- **No ack emulation** (``ack_emulation = False``): kombu's Redis transport would otherwise keep
  each delivered message in an "unacked" hash in Redis until acked, to put it back after a
  visibility timeout. With early acks that only ever covered prefetched messages of a dead worker,
  whose answers are worthless by then; and when Redis went away with a message delivered but not
  yet acked, the consumer's attempt to put it back on the lost connection crashed the worker
  ("Unrecoverable error", kombu) instead of letting it reconnect. A message is now taken off its
  queue when delivered, once.
- **No Celery time limits**: the threads pool cannot kill a thread, so they would not be enforced.
  The request deadline is the time limit instead: ``expires`` revokes a request that queued past
  it, the engine checks it at every stage, and the client never waits beyond it.
- **Results expire after 60 s**: a result is read within its deadline (+ grace) or never; the TTL
  bounds what abandoned results can hold in Redis (qps × 60 s × result size).
- **Broker and backend reconnect** with short socket timeouts, so a Redis restart is survived by
  both the worker and the client. The broker connection retries forever. The result store retries
  a lost connection once (``BACKEND_RETRY_POLICY``), not Celery's default 20 times a second apart:
  that retry runs inside the client's wait for an answer, where it held ranking requests for the
  whole outage, far past their deadlines; and an answer stored late is worth nothing. A request
  caught by an outage fails fast instead (``client.RelayUnavailable``); the next one reconnects.
"""

from __future__ import annotations

import redis
from celery import Celery
from redis.backoff import ExponentialBackoff
from redis.retry import Retry

from workers.settings import Settings

RANK_TASK = "relaygr.rank"

RESULT_EXPIRES_S = 60
SOCKET_TIMEOUT_S = 5.0
SOCKET_CONNECT_TIMEOUT_S = 2.0
BACKEND_RETRY_POLICY = {"max_retries": 1, "interval_start": 0, "interval_step": 0.2, "interval_max": 0.2}


def make_app(settings: Settings) -> Celery:
    app = Celery("relaygr", broker=settings.redis_url, backend=settings.redis_url, set_as_current=False)
    app.conf.update(
        # JSON only, for everything read back from Redis (tasks, results, events, remote control):
        # a pickle planted there must never be loaded.
        task_serializer="json",
        result_serializer="json",
        event_serializer="json",
        accept_content=["json"],
        result_accept_content=["json"],
        task_acks_late=False,
        worker_prefetch_multiplier=1,
        task_track_started=False,
        result_expires=RESULT_EXPIRES_S,
        # Result keys and their pub/sub channels live under the deployment's key prefix, like
        # every other key of the fleet (tests and deployments sharing one Redis stay apart).
        result_backend_transport_options={"global_keyprefix": f"{settings.key_prefix}:",
                                          "retry_policy": BACKEND_RETRY_POLICY},
        broker_transport_options={
            "ack_emulation": False,
            "socket_timeout": SOCKET_TIMEOUT_S,
            "socket_connect_timeout": SOCKET_CONNECT_TIMEOUT_S,
            "health_check_interval": 10,
        },
        broker_connection_retry_on_startup=True,
        broker_connection_max_retries=None,
        redis_socket_timeout=SOCKET_TIMEOUT_S,
        redis_socket_connect_timeout=SOCKET_CONNECT_TIMEOUT_S,
        redis_retry_on_timeout=True,
        redis_backend_health_check_interval=10,
        worker_send_task_events=False,
        worker_hijack_root_logger=False,
    )
    return app


def redis_client(settings: Settings) -> redis.Redis:
    """A client for the wire keys that retries through short outages (a Redis restart)."""
    return redis.Redis.from_url(
        settings.redis_url, decode_responses=True, encoding_errors="replace",  # not UTF-8: the decoder refuses it
        socket_timeout=SOCKET_TIMEOUT_S, socket_connect_timeout=SOCKET_CONNECT_TIMEOUT_S,
        retry=Retry(ExponentialBackoff(cap=1.0, base=0.05), retries=3),
        retry_on_error=[redis.ConnectionError, redis.TimeoutError], health_check_interval=10,
    )
