"""The two tasks, thin: validate the payload, call the engine, return plain data.

``rank`` runs on the Celery threads and returns scores or an error result (``payloads``);
``pre_infer`` validates and hands the prefill to the instance's ``PreInferRunner``, returning at
once, so a backlog of pre-infer signals never holds a thread that ranking needs. Neither task
raises for bad input or a missed deadline: every outcome is a result the client can act on, and
the worker stays up whatever arrives on its queues.
"""

from __future__ import annotations

import logging
from typing import Any

from celery import Celery, signals

from relay_engine.core.engine import DeadlineExceeded, EngineInputError, RelayEngine
from relay_engine.core.features import SyntheticFeatures
from workers.app import PRE_INFER_TASK, RANK_TASK
from workers.payloads import (
    DEADLINE_EXCEEDED,
    INTERNAL,
    INVALID_INPUT,
    REFUSED,
    PayloadError,
    PreInferPayload,
    RankPayload,
    error_result,
)
from workers.preinfer import PreInferRunner
from workers.telemetry_publisher import WorkerCounts

log = logging.getLogger(__name__)


class InstanceRuntime:
    """What the tasks of one worker process call into: its engine and the work around it."""

    def __init__(self, engine: RelayEngine, features: SyntheticFeatures, counts: WorkerCounts):
        self.engine = engine
        self.features = features
        self.counts = counts
        self.runner = PreInferRunner(engine, on_refused=lambda: counts.count("preinfer_signals",
                                                                            refusal="inflight_limit"))

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
        try:
            result = self.engine.rank(request)
        except DeadlineExceeded as exc:
            return error_result(DEADLINE_EXCEEDED, str(exc), instance=self.name)
        except EngineInputError as exc:
            return error_result(INVALID_INPUT, str(exc), field=exc.field, instance=self.name)
        except Exception as exc:  # noqa: BLE001 — report, log, keep serving
            log.exception("rank for user %r failed", payload.user_id)
            return error_result(INTERNAL, f"{type(exc).__name__}: {exc}", instance=self.name)
        return {"ok": True, "instance": self.name, "scores": result.scores, "source": result.source,
                "prefix_len": result.prefix_len, "latency_ms": result.latency_ms}

    def pre_infer(self, args: tuple, kwargs: dict) -> dict[str, Any]:
        try:
            payload = PreInferPayload.parse(_single_payload(args, kwargs))
            request = payload.request(self.features)
            self.engine.model.check_history(request.prefix, "prefix", allow_empty=False)
        except PayloadError as exc:
            return error_result(INVALID_INPUT, str(exc), field=exc.field, errors=exc.errors, instance=self.name)
        except EngineInputError as exc:
            return error_result(INVALID_INPUT, str(exc), field=exc.field, instance=self.name)
        if not self.runner.submit(request):
            return error_result(REFUSED, f"{self.runner.pending} pre-inferences already queued or running "
                                         f"(trigger.max_preinfer_inflight)", reason="inflight_limit",
                                instance=self.name)
        return {"ok": True, "instance": self.name, "queued": True}

    def on_revoked(self, task_name: str, expired: bool) -> None:
        """A ranking request that expired in the queue never reaches the engine: count it here."""
        if task_name == RANK_TASK:
            self.counts.count("rank_requests", "rank_errors", *(("rank_deadline_exceeded",) if expired else ()))


def _single_payload(args: tuple, kwargs: dict) -> Any:
    if len(args) != 1 or kwargs:
        raise PayloadError({"payload": f"the task takes exactly one positional argument, the payload object; "
                                       f"got {len(args)} positional and {sorted(kwargs)} keyword arguments"})
    return args[0]


def register_tasks(app: Celery, runtime: InstanceRuntime) -> None:
    """Bind the task names to this process's runtime (the worker calls this once at start)."""

    @app.task(name=RANK_TASK, ignore_result=False)
    def rank(*args: Any, **kwargs: Any) -> dict[str, Any]:
        return runtime.rank(args, kwargs)

    # Fire-and-forget: no result is stored unless the sender asks (apply_async(ignore_result=False)).
    @app.task(name=PRE_INFER_TASK, ignore_result=True)
    def pre_infer(*args: Any, **kwargs: Any) -> dict[str, Any]:
        return runtime.pre_infer(args, kwargs)

    @signals.task_revoked.connect(weak=False)
    def _count_revoked(sender=None, request=None, expired=False, **_: Any) -> None:
        runtime.on_revoked(getattr(sender, "name", ""), bool(expired))
