"""The trigger admits only at-risk requests, within inflight, token-rate and cache budgets."""

from __future__ import annotations

import pytest

from relay_engine.core.config import TriggerPolicy, parse_policy
from relay_engine.core.trigger import CacheFootprint, RankingLoad, SequenceAwareTrigger

ROOMY = CacheFootprint(needed_bytes=100, pinned_bytes=0, budget_bytes=10_000)


def decide(trigger, seq_len=2000, *, cached=False, inflight=0, footprint=ROOMY, now=0.0):
    return trigger.decide(seq_len, already_cached=cached, inflight=inflight, footprint=footprint, now_s=now)


def test_short_prefixes_are_not_at_risk():
    t = SequenceAwareTrigger(TriggerPolicy(at_risk_seq_len=1000))
    assert decide(t, 999).reason == "not_at_risk"
    assert decide(t, 1000).admit


def test_admit_all_ignores_the_threshold():
    t = SequenceAwareTrigger(TriggerPolicy(at_risk_seq_len=1000, admit_all=True))
    assert decide(t, 10).admit


@pytest.mark.parametrize(("kwargs", "reason"), [
    ({"cached": True}, "already_cached"),
    ({"inflight": 4}, "inflight_limit"),
    ({"footprint": CacheFootprint(needed_bytes=600, pinned_bytes=500, budget_bytes=1000)}, "cache_budget"),
])
def test_each_budget_refuses_with_its_reason(kwargs, reason):
    t = SequenceAwareTrigger(TriggerPolicy(at_risk_seq_len=100, max_preinfer_inflight=4))
    d = decide(t, **kwargs)
    assert not d.admit and d.reason == reason
    assert t.refusals[reason] == 1


def test_token_rate_is_enforced_and_refills():
    t = SequenceAwareTrigger(TriggerPolicy(at_risk_seq_len=100, max_preinfer_tokens_per_s=3000), now_s=0.0)
    assert decide(t, 2000, now=0.0).admit
    assert decide(t, 2000, now=0.0).reason == "token_rate_limit"
    assert decide(t, 2000, now=1.0).admit  # one second refills 3000 tokens


def test_zero_inflight_disables_pre_inference():
    t = SequenceAwareTrigger(TriggerPolicy(max_preinfer_inflight=0))
    assert decide(t).reason == "disabled"


def test_threshold_can_come_from_a_latency_model():
    policy = parse_policy({"trigger": {"at_risk_seq_len": None, "ranking_p99_slo_ms": 50,
                                       "latency_model": {"base_ms": 2, "per_token_sq_ms": 1e-5}}}).trigger
    t = SequenceAwareTrigger(policy)
    # 2 + 1e-5·n² > 50  ⇔  n > 2190.9
    assert t.at_risk_seq_len == 2191
    assert decide(t, 2190).reason == "not_at_risk" and decide(t, 2191).admit


def test_every_refusal_is_counted():
    t = SequenceAwareTrigger(TriggerPolicy(at_risk_seq_len=100))
    for _ in range(3):
        decide(t, 10)
    decide(t, 500, cached=True)
    assert dict(t.refusals) == {"not_at_risk": 3, "already_cached": 1}


def test_under_load_a_derived_threshold_falls():
    policy = parse_policy({"trigger": {"at_risk_seq_len": None, "ranking_p99_slo_ms": 50,
                                       "latency_model": {"base_ms": 2, "per_token_sq_ms": 1e-5}}}).trigger
    t = SequenceAwareTrigger(policy)
    idle = t.decide(1500, already_cached=False, inflight=0, footprint=ROOMY, now_s=0.0)
    loaded = t.decide(1500, already_cached=False, inflight=0, footprint=ROOMY, now_s=0.0, ranking_wait_ms=40.0)
    assert idle.reason == "not_at_risk"  # 2 + 22.5 ms alone is within 50 ms
    assert loaded.admit  # after a 40 ms wait it is not


def test_ranking_load_sees_no_wait_when_idle_and_more_the_busier_ranking_is():
    load = RankingLoad(window_s=2.0)
    assert load.tail_wait_ms(10.0) == 0.0
    for i in range(20):  # 20 ranks of 50 ms in 2 s: utilisation 0.5
        load.record(8.0 + i * 0.1, 8.0 + i * 0.1 + 0.05)
    half = load.tail_wait_ms(10.0)
    for i in range(20):  # 20 more: 0.95 (capped)
        load.record(8.0 + i * 0.1 + 0.05, 8.0 + i * 0.1 + 0.09)
    busy = load.tail_wait_ms(10.0)
    assert 0 < half < busy
    assert load.tail_wait_ms(20.0) == 0.0  # the window moved past them
