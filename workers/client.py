"""The client upstream services and the traffic replayer use: route, send, await with a timeout.

    client = RelayClient(Settings.from_env())
    client.pre_infer("u42", seq_len=2048)                      # at retrieval; fire and forget
    reply = client.rank("u42", seq_len=2048, short_len=32, n_candidates=128,
                        query_index=7, deadline_s=time.time() + 0.05)   # tens of ms later

Both calls route the user with the affinity router over the pool's live members, so the pre-infer
signal and the ranking request meet on one instance. ``rank`` never waits past the deadline (plus
a small grace for the answer in flight): it returns a ``RankReply`` or raises ``RankDeadlineExceeded``
(a ``relay_engine.core.engine.DeadlineExceeded``), ``RankError`` (with ``kind`` and ``field``), or
``RelayUnavailable`` (Redis cannot be reached; ``NoLiveInstances`` is one), never a transport error.
A ranking request goes on the instance's own request list (``workers.ranks``: one pipelined
``RPUSH``), carrying its deadline, so one that sat in the list past it is answered with a deadline
error, not run; ``Settings.rank_transport = "celery"`` sends the Celery task instead (with Celery
``expires`` at the deadline), which every instance still serves.

The answer comes back on a private reply list (``PoolKeys.reply``, named in the message's
``reply_to``): the worker pushes it, the client is blocked on ``BLPOP`` — one Redis round trip each
way, where Celery's result store costs a subscription, a stored result and a notification per
request. The result store is skipped for these requests (``ignore_result``).

Thread-safe: one client serves many threads (the replayer's pool).
"""

from __future__ import annotations

import contextlib
import json
import math
import threading
import time
import uuid
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

import redis
from celery.exceptions import TaskRevokedError
from celery.exceptions import TimeoutError as CeleryTimeout
from celery.result import AsyncResult
from kombu.exceptions import OperationalError as KombuOperationalError
from redis.backoff import NoBackoff
from redis.retry import Retry

from relay_engine.core import fields
from relay_engine.core.engine import DeadlineExceeded
from relay_engine.core.router import AffinityRouter
from workers import ranks, signals
from workers.app import (
    RANK_TASK,
    SOCKET_CONNECT_TIMEOUT_S,
    SOCKET_TIMEOUT_S,
    make_app,
    redis_client,
)
from workers.membership import live_members
from workers.payloads import DEADLINE_EXCEEDED, INTERNAL, PreInferPayload, RankPayload
from workers.settings import Settings

MEMBERSHIP_REFRESH_S = 0.5
# Time allowed past the deadline for an answer already on its way (scores computed just in time).
ANSWER_GRACE_S = 0.25
DEFAULT_RANK_TIMEOUT_S = 1.0


class RelayError(Exception):
    """Base of the client's errors."""


class RelayUnavailable(RelayError):
    """Redis (broker and result store) cannot be reached: the request was not sent, or its answer
    cannot arrive. Raised at once, not retried past the deadline: a late ranking answer is worthless."""


class NoLiveInstances(RelayUnavailable):
    pass


# What a lost Redis looks like from the client: kombu's error when publishing, redis-py's and the
# socket's while waiting, and Celery's RuntimeError when its result store cannot reconnect.
_TRANSPORT_ERRORS = (redis.RedisError, KombuOperationalError, OSError)


def _unreachable(exc: BaseException) -> bool:
    return isinstance(exc, _TRANSPORT_ERRORS) or isinstance(exc.__cause__, _TRANSPORT_ERRORS)


class RankError(RelayError):
    """A ranking request that failed; ``kind`` is a ``payloads.ERROR_KINDS`` value."""

    def __init__(self, kind: str, message: str, *, field: str | None = None, instance: str | None = None):
        self.kind = kind
        self.field = field
        self.instance = instance
        super().__init__(message)


class RankDeadlineExceeded(RankError, DeadlineExceeded):
    def __init__(self, message: str, *, instance: str | None = None):
        super().__init__(DEADLINE_EXCEEDED, message, instance=instance)


@dataclass(frozen=True)
class RankReply:
    scores: list[float]
    source: str  # an ``Outcome`` value: where the instance found the prefix
    prefix_len: int
    engine_ms: float  # time inside the engine, on the instance
    round_trip_ms: float  # send → answer, at the client
    instance: str
    # The round trip's legs (ms, by the host clocks): send → task body starts ("to_worker"), the task
    # body ("in_worker", engine_ms within it), its end → the answer at the client ("back").
    legs_ms: dict[str, float] | None = None


class ReplyList:
    """Where one ranking request's answer arrives: a private Redis list the worker pushes to."""

    # A BLPOP longer than the socket timeout would be cut by it: wait in slices below it.
    SLICE_S = SOCKET_TIMEOUT_S - 1.0

    def __init__(self, client: redis.Redis, key: str):
        self.client = client
        self.key = key

    def pop(self, timeout_s: float) -> dict | None:
        """The answer, or None after timeout_s. Raises redis errors (no retries: fail fast)."""
        end = time.monotonic() + timeout_s
        while True:
            remaining = end - time.monotonic()
            if remaining <= 0:
                raw = self.client.lpop(self.key)
            else:
                popped = self.client.blpop([self.key], timeout=min(self.SLICE_S, max(0.001, remaining)))
                raw = popped[1] if popped else None
            if raw is not None:
                return json.loads(raw)
            if remaining <= self.SLICE_S:
                return None


class PendingRank:
    """A ranking request on its way; ``wait()`` returns its reply or raises, by the deadline.
    ``result`` is the request's reply list, or (sent without one) its Celery ``AsyncResult``."""

    def __init__(self, result: ReplyList | AsyncResult, instance: str, deadline_s: float, sent_at: float,
                 grace_s: float, sent_s: float | None = None):
        self.result = result
        self.instance = instance
        self.deadline_s = deadline_s
        self.sent_at = sent_at
        self.grace_s = grace_s
        self.sent_s = time.time() if sent_s is None else sent_s  # wall clock, for the legs

    def _late(self) -> RankDeadlineExceeded:
        return RankDeadlineExceeded(f"no answer from {self.instance} by the deadline (+{self.grace_s * 1000:.0f} ms "
                                    f"grace): the instance may be overloaded or gone", instance=self.instance)

    def _lost(self, exc: BaseException) -> RelayUnavailable:
        return RelayUnavailable(f"lost Redis while waiting for {self.instance}'s answer: {type(exc).__name__}: {exc}")

    def _receive(self, timeout_s: float):
        if isinstance(self.result, ReplyList):
            try:
                data = self.result.pop(timeout_s)
            except (redis.RedisError, OSError) as exc:
                raise self._lost(exc) from None
            if data is None:
                raise self._late()
            return data
        result = self.result
        try:
            return result.get(timeout=timeout_s, propagate=True)
        except CeleryTimeout:
            _stop_waiting(result)
            raise self._late() from None
        except TaskRevokedError:
            raise RankDeadlineExceeded(f"the request expired in {self.instance}'s queue before it was picked up",
                                       instance=self.instance) from None
        except Exception as exc:  # noqa: BLE001 — Redis lost, or the task itself failed (not our tasks' contract)
            if _unreachable(exc):
                _stop_waiting(result)
                raise self._lost(exc) from None
            raise RankError(INTERNAL, f"rank task failed on {self.instance}: {type(exc).__name__}: {exc}",
                            instance=self.instance) from None

    def wait(self) -> RankReply:
        data = self._receive(max(0.0, self.deadline_s - time.time()) + self.grace_s)
        round_trip_ms = (time.perf_counter() - self.sent_at) * 1000
        received_s = time.time()
        if not isinstance(data, dict) or not data.get("ok"):
            data = data if isinstance(data, dict) else {"error": INTERNAL, "message": f"unexpected result {data!r}"}
            if data.get("error") == DEADLINE_EXCEEDED:
                raise RankDeadlineExceeded(data.get("message", "deadline exceeded"), instance=self.instance)
            raise RankError(data.get("error", INTERNAL), data.get("message", ""), field=data.get("field"),
                            instance=self.instance)
        return RankReply(data["scores"], data["source"], data["prefix_len"], data["latency_ms"], round_trip_ms,
                         data["instance"], _legs(self.sent_s, data.get("worker_s"), received_s))


def _legs(sent_s: float, worker_s: object, received_s: float) -> dict[str, float] | None:
    if not (isinstance(worker_s, list) and len(worker_s) == 2 and all(fields.is_number(t) for t in worker_s)):
        return None
    start, end = worker_s
    return {"to_worker": (start - sent_s) * 1000, "in_worker": (end - start) * 1000, "back": (received_s - end) * 1000}


def _stop_waiting(result: AsyncResult) -> None:
    """Forget a result we gave up on: Celery's backend would otherwise keep it, and its pub/sub
    subscription, for the life of the thread (one per lost request)."""
    with contextlib.suppress(Exception):  # Redis gone: the subscription went with the connection
        result.backend.remove_pending_result(result)


def _closed_under_us(exc: BaseException) -> bool:
    """An AttributeError raised inside kombu's transport: a pooled channel that another thread closed
    while recovering from a lost Redis, used by this send (its ``connection`` is None by then). Seen
    once in the fault tests while Redis restarted empty; it is an outage, not a bug of the caller's."""
    if not isinstance(exc, AttributeError):
        return False
    tb = exc.__traceback__
    while tb is not None and tb.tb_next is not None:
        tb = tb.tb_next
    return tb is not None and tb.tb_frame.f_globals.get("__name__", "").startswith("kombu.")


@contextlib.contextmanager
def _sending(instance: str):
    try:
        yield
    except Exception as exc:
        if _unreachable(exc) or _closed_under_us(exc):
            raise RelayUnavailable(f"cannot send to {instance}: Redis cannot be reached "
                                   f"({type(exc).__name__}: {exc})") from None
        raise


class RelayClient:
    def __init__(self, settings: Settings, *, refresh_s: float = MEMBERSHIP_REFRESH_S,
                 grace_s: float = ANSWER_GRACE_S, epsilon: float = 0.25):
        self.settings = settings
        self.keys = settings.keys
        self.app = make_app(settings)
        self.redis = redis_client(settings)
        # Blocking waits for answers, on their own connections, without retries: a lost Redis fails
        # the waiting request at once rather than holding it past its deadline.
        self.replies = redis.Redis.from_url(settings.redis_url, decode_responses=True, encoding_errors="replace",
                                            socket_timeout=SOCKET_TIMEOUT_S,
                                            socket_connect_timeout=SOCKET_CONNECT_TIMEOUT_S,
                                            retry=Retry(NoBackoff(), 0))
        self.refresh_s = refresh_s
        self.grace_s = grace_s
        self.epsilon = epsilon
        self._router: AffinityRouter | None = None
        self._refreshed_at = -math.inf
        self._refresh_lock = threading.Lock()  # held while a member read is under way
        self._first_read = threading.Event()  # set when the first member read ended, either way
        self._read_error: str | None = None

    # --- membership and routing --------------------------------------------------------------

    def live_instances(self, *, deadline_s: float | None = None) -> tuple[str, ...]:
        """The pool's live members, re-read from Redis at most every ``refresh_s``.

        One background read at a time; callers route on the list they have meanwhile. Before any
        list is in, a caller waits for the read, never past ``deadline_s`` (default
        ``DEFAULT_RANK_TIMEOUT_S`` from now): then, or when the read failed, ``NoLiveInstances``."""
        if time.monotonic() - self._refreshed_at >= self.refresh_s and self._refresh_lock.acquire(blocking=False):
            threading.Thread(target=self._read_members, name="relaygr-members", daemon=True).start()
        router = self._router
        if router is None:
            deadline_s = time.time() + DEFAULT_RANK_TIMEOUT_S if deadline_s is None else deadline_s
            self._first_read.wait(max(0.0, deadline_s - time.time()))
            router = self._router
            if router is None:
                raise NoLiveInstances(f"no member list of pool {self.keys.pool!r} by the deadline: "
                                      f"{self._read_error or 'Redis has not answered yet'}")
        return router.instances

    def _read_members(self) -> None:
        """Read the live members (holding the refresh lock, taken by the caller) and swap in a new router."""
        try:
            members = tuple(live_members(self.redis, self.keys))
            # A new router only when the members changed (its remembered routes stay valid until then),
            # swapped in whole: routing threads never see a half update.
            if self._router is None or members != self._router.instances:
                self._router = AffinityRouter(members, self.epsilon)
            self._read_error = None
        except Exception as exc:  # noqa: BLE001 — Redis down, or the client closed under the read: callers hear why
            self._read_error = f"cannot read the members from Redis ({type(exc).__name__}: {exc})"
        finally:
            self._refreshed_at = time.monotonic()  # failed or not: the next read is refresh_s away
            self._refresh_lock.release()
            self._first_read.set()

    def refresh(self) -> tuple[str, ...]:
        """Re-read the members now and wait for them (tests, tools; routing uses ``live_instances``)."""
        self._refresh_lock.acquire()
        self._read_members()
        if self._router is None:
            raise NoLiveInstances(f"pool {self.keys.pool!r}: {self._read_error}")
        return self._router.instances

    def route(self, user_id: str, *, deadline_s: float | None = None) -> str:
        """The instance for user_id: rendezvous hashing over the live members. The bounded-load
        fallback is not used: a per-client load is not the pool's, and a route that flips between a
        user's pre-infer signal and ranking request would lose the cache it exists to reuse."""
        self.live_instances(deadline_s=deadline_s)
        assert self._router is not None
        try:
            return self._router.route(str(user_id))
        except LookupError:
            raise NoLiveInstances(f"pool {self.keys.pool!r} has no live instance "
                                  f"(heartbeat within {self.settings.heartbeat_timeout_s:g} s)") from None

    # --- requests ----------------------------------------------------------------------------

    def pre_infer(self, user_id: str, *, instance: str | None = None, **fields: Any) -> str:
        """Send the pre-infer signal (fire and forget, one pipelined Redis call: ``workers.signals``);
        returns the instance it went to. The instance drops it unread after ``signals.SIGNAL_TTL_S``."""
        payload = PreInferPayload.parse({"user_id": user_id, **fields}).to_dict()
        instance = instance or self.route(user_id)
        with _sending(instance):
            signals.send(self.redis, self.keys, instance, payload)
        return instance

    def send_rank(self, payload: RankPayload | dict[str, Any], *, instance: str | None = None) -> PendingRank:
        """Send a ranking request without waiting. A dict payload is sent as it is (the worker
        validates it); its ``deadline_s`` sets the wait, else ``DEFAULT_RANK_TIMEOUT_S``."""
        data = payload.to_dict() if isinstance(payload, RankPayload) else payload
        deadline_s = data.get("deadline_s") if isinstance(data, dict) else None
        if not fields.is_number(deadline_s) or not fields.is_finite(deadline_s):
            deadline_s = time.time() + DEFAULT_RANK_TIMEOUT_S
        user_id = data.get("user_id") if isinstance(data, dict) else None
        instance = instance or self.route(str(user_id), deadline_s=deadline_s)
        if time.time() >= deadline_s:
            raise RankDeadlineExceeded(f"the deadline passed {(time.time() - deadline_s) * 1000:.1f} ms before "
                                       f"the request could be sent", instance=instance)
        reply = ReplyList(self.replies, self.keys.reply(uuid.uuid4().hex))
        sent_at, sent_s = time.perf_counter(), time.time()
        with _sending(instance):
            if self.settings.rank_transport == "direct":
                ranks.send(self.redis, self.keys, instance, data, reply.key, deadline_s, sent_s)
            else:
                self.app.send_task(RANK_TASK, args=[data], queue=self.keys.rank_queue(instance), reply_to=reply.key,
                                   ignore_result=True, expires=datetime.fromtimestamp(deadline_s, tz=UTC))
        return PendingRank(reply, instance, deadline_s, sent_at, self.grace_s, sent_s)

    def rank(self, user_id: str, *, deadline_s: float | None = None, **fields: Any) -> RankReply:
        """Rank and wait: a reply by the deadline (default: ``DEFAULT_RANK_TIMEOUT_S`` from now) or an error."""
        if deadline_s is None:
            deadline_s = time.time() + DEFAULT_RANK_TIMEOUT_S
        payload = RankPayload.parse({"user_id": user_id, "deadline_s": deadline_s, **fields})
        return self.send_rank(payload).wait()

    def close(self) -> None:
        self.app.close()
        self.redis.close()
        self.replies.close()

    def __enter__(self) -> RelayClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
