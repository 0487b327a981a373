"""The benchmark's product path: a tiny point replayed through ``RelayClient`` → Redis → real worker
instances started by the pool supervisor, each mode a published policy.

Shapes and invariants only (no timing): every measured request is answered or counted, the relay finds
prefixes the baseline never looks for, admissions come back from the workers' counters, priming leaves
prefixes where serving would, and the instances run the policy the bench published.
"""

from __future__ import annotations

import pytest
from tqdm import tqdm

from relay_engine.core.model import ModelConfig
from relay_engine.core.outcomes import Outcome
from relay_engine.core.wire import ACK
from relay_engine.lab.bench.modes import MODES_BY_NAME, Regime, served_policy
from relay_engine.lab.bench.product import ERROR, ProductFleet, ProductMeasure, newest_that_fit
from relay_engine.lab.bench.settings import BenchSettings
from relay_engine.lab.bench.stats import CACHED
from relay_engine.lab.bench.workload import paired_windows
from relay_engine.lab.traffic import TraceSpec, generate_trace

SETTINGS = BenchSettings(instances=2, threads_per_instance=1, rank_threads=2, windows=1, warmup_queries=10,
                         measured_queries=30, bootstrap_replicates=50, max_redo=0,
                         model=ModelConfig(embed_dim=32, num_layers=2, num_heads=2, head_dim=16))
# Generous time: on a shared machine the point must answer, not meet an SLO. Every prefix is at risk, so
# every signal the budgets allow is pre-inferred.
REGIME = Regime(slo_ms=2_000.0, deadline_ms=4_000.0, at_risk_seq_len=1, hbm_budget_mb=16.0, dram_budget_mb=64.0)
CAP, QPS = 256, 20.0
pytestmark = pytest.mark.slow  # starts two worker processes: ~15 s
ANSWERED = {*Outcome, "deadline", ERROR}


@pytest.fixture(scope="module")
def product(redis_url):
    queries = generate_trace(TraceSpec(queries=120, users=20, seq_len_median=128, seq_len_p99=512, seed=3))
    windows = paired_windows(len(queries), SETTINGS.windows, SETTINGS.warmup_queries, SETTINGS.measured_queries)
    fleet = ProductFleet(SETTINGS, redis_url=redis_url)
    try:
        yield fleet, ProductMeasure(SETTINGS, fleet, queries, windows, REGIME, tqdm(disable=True))
    finally:
        fleet.close()


def test_every_measured_request_of_the_baseline_is_answered_and_none_from_a_cache(product):
    _, measure = product
    point = measure(MODES_BY_NAME["baseline"], CAP, QPS)
    assert point.n == SETTINGS.measured_queries
    assert sum(point.outcomes.values()) == point.n and set(point.outcomes) <= ANSWERED
    assert point.outcomes.get(Outcome.MISS, 0) > 0
    assert not any(point.outcomes.get(o, 0) for o in CACHED)
    assert point.preinfer_signals == 0  # read back from the workers' counters: the baseline sends none


def test_the_relay_finds_prefixes_its_signals_pre_inferred(product):
    _, measure = product
    point = measure(MODES_BY_NAME["relay"], CAP, QPS)
    assert point.n == SETTINGS.measured_queries
    assert sum(point.outcomes.values()) == point.n and set(point.outcomes) <= ANSWERED
    assert sum(point.outcomes.get(o, 0) for o in CACHED) > 0
    # admissions read back from the workers' counters: every prefix is at risk, so signals are admitted
    assert point.preinfer_admitted > 0
    assert point.preinfer_signals == point.preinfer_admitted + sum(point.preinfer_refused.values())


def test_every_instance_runs_the_policy_the_bench_published_last(product):
    fleet, measure = product
    mode = MODES_BY_NAME["relay_cache_only"]
    measure(mode, CAP, QPS)
    statuses = fleet.statuses()
    assert sorted(statuses) == fleet.names
    expected = served_policy(mode, REGIME).sha256()
    assert {(s.applied_generation, s.applied_sha256, s.config_state) for s in statuses.values()} == \
        {(fleet.generation, expected, ACK)}


def test_priming_keeps_the_newest_distinct_prefixes_that_fill_the_budget_oldest_first():
    seen = [("a", 10), ("b", 10), ("a", 10), ("c", 20), ("b", 10), ("d", 10)]
    # newest first: d (10), b (10), c (20) reaches 40; the older a is left out
    assert newest_that_fit(seen, 40, lambda n: n) == [("c", 20), ("b", 10), ("d", 10)]
    assert newest_that_fit(seen, 35, lambda n: n) == [("c", 20), ("b", 10), ("d", 10)]  # c crosses it: kept
    assert newest_that_fit(seen, 0, lambda n: n) == []
    assert newest_that_fit(seen, 10**6, lambda n: n) == [("a", 10), ("c", 20), ("b", 10), ("d", 10)]  # by last use


def test_a_primed_window_finds_prefixes_of_users_it_has_not_served_yet(product):
    # Without pre-inference (relay_cache_only) a user's first request in a window can only be served
    # from a cache if priming left the user's prefix there, as serving the primed part would have.
    fleet, measure = product
    primed = paired_windows(len(measure.queries), 1, SETTINGS.warmup_queries, SETTINGS.measured_queries, 40)[0]
    assert primed.primed == 40
    reports = measure._window(MODES_BY_NAME["relay_cache_only"], CAP, QPS, primed)
    outcome = {query: out for r in reports for (query, _, out, measured) in r.ranks if measured}
    firsts = [i for i in range(primed.first_measured, primed.end)
              if measure.queries[i].user_id not in {measure.queries[j].user_id for j in range(primed.start, i)}]
    assert firsts and len(outcome) == SETTINGS.measured_queries
    assert sum(outcome[i] in CACHED for i in firsts) > 0
