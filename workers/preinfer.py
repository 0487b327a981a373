"""Pre-inference off the Celery threads: one bounded queue, one thread.

The ``pre_infer`` task only validates its payload and hands the request here, so a backlog of
pre-infer signals never occupies the threads that ranking runs on. Requests queued plus running
are capped by the policy's ``trigger.max_preinfer_inflight``; a signal beyond the cap is refused
at once and counted as ``inflight_limit``, like the engine's trigger does for its own limit.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable

from relay_engine.core.engine import PreInferRequest, PreInferResult, RelayEngine

log = logging.getLogger(__name__)


class PreInferRunner:
    def __init__(self, engine: RelayEngine, on_refused: Callable[[], None]):
        self.engine = engine
        self.on_refused = on_refused
        self._queue: queue.SimpleQueue[PreInferRequest | None] = queue.SimpleQueue()
        self._pending = 0  # queued + running
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, name="preinfer", daemon=True)

    def start(self) -> PreInferRunner:
        self._thread.start()
        return self

    @property
    def pending(self) -> int:
        return self._pending

    def submit(self, request: PreInferRequest) -> bool:
        """Queue the request, or refuse it (False) when the in-flight cap is reached."""
        with self._lock:
            if self._pending >= self.engine.policy.trigger.max_preinfer_inflight:
                refused = True
            else:
                refused = False
                self._pending += 1
        if refused:
            self.on_refused()
            return False
        self._queue.put(request)
        return True

    def _run(self) -> None:
        while (request := self._queue.get()) is not None:
            try:
                self._pre_infer(request)
            finally:
                with self._lock:
                    self._pending -= 1

    def _pre_infer(self, request: PreInferRequest) -> PreInferResult | None:
        try:
            return self.engine.pre_infer(request)
        except Exception:  # noqa: BLE001 — best effort: a failed pre-inference is logged, never fatal
            log.exception("pre-inference for user %r failed", request.user_id)
            return None

    def stop(self, timeout_s: float = 5.0) -> None:
        self._queue.put(None)
        self._thread.join(timeout_s)
