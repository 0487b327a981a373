"""The ranking task and the pre-infer handler, thin: validate the payload, call the engine, return plain data.

``rank`` runs on the Celery threads and returns scores or an error result (``payloads``). When the
sender named a reply list (the message's ``reply_to``, a ``PoolKeys.reply`` key), the answer is
pushed there too — one ``RPUSH`` + ``EXPIRE`` the sender is blocked on with ``BLPOP`` — instead of
going through Celery's result store; a request revoked in the queue (past its deadline) gets a
deadline error there at once. ``pre_infer`` is no Celery task: the instance's signal reader
(``workers.signals``) calls it for each signal. It validates and calls ``engine.submit_pre_infer``:
the trigger decides at once and an admitted prefill runs on the engine's pre-inference lane (its own
thread, at the policy's compute share), so a backlog of pre-infer signals never holds a thread that
ranking needs nor takes more than its share of the compute. Neither raises for bad input or a
missed deadline: every outcome is a result the client can act on, and the worker stays up whatever
arrives on its queue or its signal list.
"""

from __future__ import annotations

import json
import logging
import time
from typing import Any

import redis
from celery import Celery, signals

from relay_engine.core.engine import DeadlineExceeded, RelayEngine
from relay_engine.core.features import SyntheticFeatures
from relay_engine.core.model import ModelInputError
from relay_engine.core.wire import REPLY_TTL_S, PoolKeys
from workers.app import RANK_TASK
from workers.capture import TrafficCapture
from workers.payloads import (
    DEADLINE_EXCEEDED,
    INTERNAL,
    INVALID_INPUT,
    PayloadError,
    PreInferPayload,
    RankPayload,
    error_result,
)
from workers.telemetry_publisher import WorkerCounts

log = logging.getLogger(__name__)


class InstanceRuntime:
    """What the tasks of one worker process call into: its engine and the work around it."""

    def __init__(self, engine: RelayEngine, features: SyntheticFeatures, counts: WorkerCounts,
                 replies: redis.Redis | None = None, keys: PoolKeys | None = None,
                 capture: TrafficCapture | None = None):
        self.engine = engine
        self.features = features
        self.counts = counts
        self.replies = replies  # where answers are pushed for senders blocked on a reply list
        self.keys = keys
        self.capture = capture  # the pool's traffic capture (queued here, written off the ranking path)

    @property
    def name(self) -> str:
        return self.engine.name

    def rank(self, args: tuple, kwargs: dict) -> dict[str, Any]:
        try:
            payload = RankPayload.parse(_single_payload(args, kwargs))
            request = payload.request(self.features)
        except PayloadError as exc:
            self.counts.count("rank_requests", "rank_errors")
            return error_result(INVALID_INPUT, str(exc), field=exc.field, errors=exc.errors, instance=self.name)
        arrived_s, cpu_s = time.time(), time.thread_time()
        try:
            result = self.engine.rank(request)
        except DeadlineExceeded as exc:
            self._capture(request, arrived_s, DEADLINE_EXCEEDED)
            return error_result(DEADLINE_EXCEEDED, str(exc), instance=self.name)
        except ModelInputError as exc:
            self._capture(request, arrived_s, INVALID_INPUT)
            return error_result(INVALID_INPUT, str(exc), field=exc.field, instance=self.name)
        except Exception as exc:  # noqa: BLE001 — report, log, keep serving
            log.exception("rank for user %r failed", payload.user_id)
            self._capture(request, arrived_s, INTERNAL)
            return error_result(INTERNAL, f"{type(exc).__name__}: {exc}", instance=self.name)
        self._capture(request, arrived_s, result.source, result.latency_ms, result.miss_reason or "",
                      cpu_ms=(time.thread_time() - cpu_s) * 1000)
        return {"ok": True, "instance": self.name, "scores": result.scores, "source": result.source,
                "prefix_len": result.prefix_len, "latency_ms": result.latency_ms}

    def _capture(self, request, arrived_s: float, outcome: str, latency_ms: float | None = None,
                 miss_reason: str = "", cpu_ms: float | None = None) -> None:
        if self.capture is None:
            return
        if latency_ms is None:
            latency_ms = (time.time() - arrived_s) * 1000
        self.capture.record(request.user_id, arrived_s=arrived_s, prefix_len=len(request.prefix),
                            short_len=len(request.short_term), candidates=len(request.candidates),
                            outcome=outcome, latency_ms=latency_ms, miss_reason=miss_reason, cpu_ms=cpu_ms)

    def pre_infer(self, data: Any, sent_s: float | None = None) -> dict[str, Any]:
        """One pre-infer signal (``sent_s``: when its sender sent it; the capture's gap starts there)."""
        try:
            payload = PreInferPayload.parse(data)
            request = payload.request(self.features)
        except PayloadError as exc:
            return error_result(INVALID_INPUT, str(exc), field=exc.field, errors=exc.errors, instance=self.name)
        try:  # the engine checks the prefix first: an invalid one is neither decided on nor captured
            decision = self.engine.submit_pre_infer(request)
        except ModelInputError as exc:
            return error_result(INVALID_INPUT, str(exc), field=exc.field, instance=self.name)
        if self.capture is not None:
            self.capture.signal(request.user_id, sent_s)
        return {"ok": True, "instance": self.name, "admitted": decision.admitted, "reason": decision.reason}

    def reply(self, reply_to: object, result: dict[str, Any]) -> None:
        """Push a ranking answer to its sender's reply list (when it named one of ours)."""
        if self.replies is None or self.keys is None or not self.keys.is_reply(reply_to):
            return
        try:
            pipe = self.replies.pipeline(transaction=True)
            pipe.rpush(reply_to, json.dumps(result, separators=(",", ":")))
            pipe.expire(reply_to, REPLY_TTL_S)
            pipe.execute()
        except redis.RedisError as exc:  # Redis gone: the sender's wait fails fast on its side too
            log.warning("could not push the answer to %s: %s", reply_to, exc)

    def on_revoked(self, task_name: str, expired: bool, reply_to: object = None, args: tuple = (),
                   kwargs: dict | None = None) -> None:
        """A Celery ranking task revoked in the queue (``expires``: past its deadline)."""
        if task_name == RANK_TASK:
            try:
                data = _single_payload(args, kwargs or {})
            except PayloadError:
                data = None
            self.expired_in_queue(data, reply_to, expired=expired)

    def expired_in_queue(self, data: Any, reply_to: object, *, expired: bool = True) -> None:
        """A ranking request that queued past its deadline never reaches the engine: count it here, tell a
        sender waiting on a reply list at once, and capture it (it is traffic the pool received;
        its latency is unknown, recorded as 0 — only served requests carry one)."""
        if self.capture is not None and expired:
            try:
                payload = RankPayload.parse(data)
            except PayloadError:
                payload = None
            if payload is not None:
                prefix_len, short_len, candidates = payload.shape()
                self.capture.record(payload.user_id, arrived_s=time.time(), prefix_len=prefix_len,
                                    short_len=short_len, candidates=candidates, outcome=DEADLINE_EXCEEDED,
                                    latency_ms=0.0)
        self.counts.count("rank_requests", "rank_errors", *(("rank_deadline_exceeded",) if expired else ()))
        self.reply(reply_to, error_result(DEADLINE_EXCEEDED, f"the request expired in {self.name}'s queue "
                                                             f"before it was picked up", instance=self.name,
                                          expired_in_queue=True))


def _single_payload(args: tuple, kwargs: dict) -> Any:
    if len(args) != 1 or kwargs:
        raise PayloadError({"payload": f"the task takes exactly one positional argument, the payload object; "
                                       f"got {len(args)} positional and {sorted(kwargs)} keyword arguments"})
    return args[0]


def register_tasks(app: Celery, runtime: InstanceRuntime) -> None:
    """Bind the task names to this process's runtime (the worker calls this once at start)."""

    @app.task(name=RANK_TASK, ignore_result=False, bind=True)
    def rank(task, *args: Any, **kwargs: Any) -> dict[str, Any]:
        started_s = time.time()
        result = runtime.rank(args, kwargs)
        if result.get("ok"):  # when the task body ran, for the sender's split of its round trip
            result["worker_s"] = [started_s, time.time()]
        runtime.reply(task.request.reply_to, result)
        return result

    @signals.task_revoked.connect(weak=False)
    def _count_revoked(sender=None, request=None, expired=False, **_: Any) -> None:
        runtime.on_revoked(getattr(sender, "name", ""), bool(expired), getattr(request, "reply_to", None),
                           tuple(getattr(request, "args", None) or ()), getattr(request, "kwargs", None) or {})
