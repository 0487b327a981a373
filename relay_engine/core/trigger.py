"""The sequence-aware trigger: pre-infer only requests at risk, within cache and load budgets.

Pure decision logic over plain numbers (no torch): the engine passes the cache's byte figures, the
in-flight count and the ranking wait it measures (``RankingLoad``); the trigger keeps its own token
bucket for the pre-inference token rate and counts every refusal by reason.

"At risk" is judged under load: with a latency model, a prefix is at risk when its full inference
*after the wait ranking sees at its tail now* would break the P99 SLO. An idle instance pre-infers
only prefixes whose full inference alone is too slow; a loaded one, where requests queue, more.
"""

from __future__ import annotations

import math
import threading
from collections import Counter, deque
from dataclasses import dataclass

from relay_engine.core.config import TriggerPolicy
from relay_engine.core.telemetry import RefusalReason


@dataclass(frozen=True)
class Decision:
    admit: bool
    reason: RefusalReason | None = None  # why not, when refused


@dataclass(frozen=True)
class CacheFootprint:
    """What the cache holds, in bytes, when a pre-infer signal arrives."""

    needed_bytes: int  # the new entry's size: seq_len × the model's bytes per prefix token
    pinned_bytes: int  # reserved for pre-inferences in flight + resident entries not yet read
    budget_bytes: int


class RankingLoad:
    """The ranking lane's recent load on the engine's clock: the utilisation u and mean service time
    S of the ranks that ended in the last ``window_s``, and from them the wait a ranking request sees
    at the P99 of waits, S·ln(100·u)/(1 − u) (the M/M/1 queue's waiting-time tail). Thread-safe."""

    MAX_UTILISATION = 0.95  # the formula's pole: beyond it, "saturated" is all it says
    TAIL = 0.99

    def __init__(self, window_s: float = 2.0):
        self.window_s = window_s
        self._ended: deque[tuple[float, float]] = deque()  # (end instant, service seconds)
        self._busy_s = 0.0
        self._lock = threading.Lock()

    def record(self, started_s: float, ended_s: float) -> None:
        with self._lock:
            service = max(0.0, ended_s - started_s)
            self._ended.append((ended_s, service))
            self._busy_s += service
            self._trim(ended_s)

    def _trim(self, now_s: float) -> None:
        while self._ended and self._ended[0][0] < now_s - self.window_s:
            self._busy_s -= self._ended.popleft()[1]

    def tail_wait_ms(self, now_s: float) -> float:
        with self._lock:
            self._trim(now_s)
            if not self._ended:
                return 0.0
            u = min(self.MAX_UTILISATION, self._busy_s / self.window_s)
            if u <= 1.0 - self.TAIL:  # a request waits at all with probability u: not at the tail
                return 0.0
            mean_service_s = self._busy_s / len(self._ended)
            return 1000.0 * mean_service_s * math.log(u / (1.0 - self.TAIL)) / (1.0 - u)


class SequenceAwareTrigger:
    def __init__(self, policy: TriggerPolicy, now_s: float = 0.0):
        self.refusals: Counter[str] = Counter()
        self._tokens = 0.0
        self._last_s = now_s
        self.update_policy(policy)

    def update_policy(self, policy: TriggerPolicy) -> None:
        self.policy = policy
        self.at_risk_seq_len = policy.effective_at_risk_seq_len()
        # A one-second burst: admits one long prefix at a time even when the rate is below its length.
        self._burst = policy.max_preinfer_tokens_per_s
        self._tokens = min(self._tokens, self._burst) if self._tokens else self._burst

    def _refill(self, now_s: float) -> None:
        elapsed = max(0.0, now_s - self._last_s)
        self._last_s = now_s
        self._tokens = min(self._burst, self._tokens + elapsed * self.policy.max_preinfer_tokens_per_s)

    def decide(self, seq_len: int, *, already_cached: bool, inflight: int, footprint: CacheFootprint,
               now_s: float, ranking_wait_ms: float = 0.0) -> Decision:
        """Admit or refuse one pre-infer signal; an admission consumes seq_len tokens of the rate.
        ``ranking_wait_ms``: the wait ranking sees now, which lowers a derived at-risk length."""
        p = self.policy
        self._refill(now_s)
        if p.max_preinfer_inflight == 0 or p.max_preinfer_tokens_per_s == 0:
            return self._refuse(RefusalReason.DISABLED)
        at_risk = self.at_risk_seq_len if ranking_wait_ms <= 0 else p.effective_at_risk_seq_len(ranking_wait_ms)
        if not p.admit_all and seq_len < at_risk:
            return self._refuse(RefusalReason.NOT_AT_RISK)
        if already_cached:
            return self._refuse(RefusalReason.ALREADY_CACHED)
        if inflight >= p.max_preinfer_inflight:
            return self._refuse(RefusalReason.INFLIGHT_LIMIT)
        if footprint.pinned_bytes + footprint.needed_bytes > footprint.budget_bytes:
            return self._refuse(RefusalReason.CACHE_BUDGET)
        # A prefix longer than the burst may pass only with a full bucket, taking the bucket to zero.
        cost = min(float(seq_len), self._burst)
        if self._tokens < cost:
            return self._refuse(RefusalReason.TOKEN_RATE_LIMIT)
        self._tokens -= cost
        return Decision(True)

    def overrule(self, reason: RefusalReason) -> Decision:
        """Turn the last admission into a refusal (the cache could not reserve after all)."""
        return self._refuse(reason)

    def _refuse(self, reason: RefusalReason) -> Decision:
        self.refusals[reason] += 1
        return Decision(False, reason)
