"""The sequence-aware trigger: pre-infer only requests at risk, within cache and load budgets.

Pure decision logic over plain numbers (no torch): the engine passes the cache's byte figures and
the in-flight count; the trigger keeps its own token bucket for the pre-inference token rate and
counts every refusal by reason.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

from relay_engine.core.config import TriggerPolicy

NOT_AT_RISK = "not_at_risk"
ALREADY_CACHED = "already_cached"
INFLIGHT_LIMIT = "inflight_limit"
TOKEN_RATE_LIMIT = "token_rate_limit"
CACHE_BUDGET = "cache_budget"
DISABLED = "disabled"


@dataclass(frozen=True)
class Decision:
    admit: bool
    reason: str | None = None  # why not, when refused


@dataclass(frozen=True)
class CacheFootprint:
    """What the cache holds, in bytes, when a pre-infer signal arrives."""

    needed_bytes: int  # the new entry's size: seq_len × the model's bytes per prefix token
    pinned_bytes: int  # reserved for pre-inferences in flight + resident entries not yet read
    budget_bytes: int


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
               now_s: float) -> Decision:
        """Admit or refuse one pre-infer signal; an admission consumes seq_len tokens of the rate."""
        p = self.policy
        self._refill(now_s)
        if p.max_preinfer_inflight == 0 or p.max_preinfer_tokens_per_s == 0:
            return self._refuse(DISABLED)
        if not p.admit_all and seq_len < self.at_risk_seq_len:
            return self._refuse(NOT_AT_RISK)
        if already_cached:
            return self._refuse(ALREADY_CACHED)
        if inflight >= p.max_preinfer_inflight:
            return self._refuse(INFLIGHT_LIMIT)
        if footprint.pinned_bytes + footprint.needed_bytes > footprint.budget_bytes:
            return self._refuse(CACHE_BUDGET)
        # A prefix longer than the burst may pass only with a full bucket, taking the bucket to zero.
        cost = min(float(seq_len), self._burst)
        if self._tokens < cost:
            return self._refuse(TOKEN_RATE_LIMIT)
        self._tokens -= cost
        return Decision(True)

    def overrule(self, reason: str) -> Decision:
        """Turn the last admission into a refusal (the cache could not reserve after all)."""
        return self._refuse(reason)

    def _refuse(self, reason: str) -> Decision:
        self.refusals[reason] += 1
        return Decision(False, reason)
