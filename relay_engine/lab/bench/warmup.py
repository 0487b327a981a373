"""Priming the cache tiers to the steady state a fleet reaches after serving a stretch of traffic.

Serving a query leaves its prefix resident (a pre-inference or a miss's recompute both keep it):
``prime`` takes the queries in order and does to the tiers what serving them would — an HBM hit
refreshes the entry, an entry of a lower tier is promoted, anything else is inserted (demoting down the tiers as the
budgets demand) — without running a forward pass. The KV put in has the right shape and size but
no meaningful values (``kv_for(prefix)``: zeros in the benchmark, a sizeless stand-in in the simulator):
ranking on it costs exactly what ranking on a real one does. Requests of the measured windows
compute every prefix they produce for real.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from relay_engine.core.engine import RelayEngine
from relay_engine.core.model import History, PrefixKV


def prime(engine: RelayEngine, prefixes: Iterable[tuple[str, History]], kv_for: Callable[[History], PrefixKV]) -> int:
    """Run (user, prefix) pairs through the engine's tiers in order; returns how many were inserted."""
    inserted = 0
    for user_id, prefix in prefixes:
        key = engine.cache_key(user_id, prefix)
        if not engine.cache.lookup(key).found:
            engine.cache.insert(key, kv_for(prefix), consumed=True)
            inserted += 1
    return inserted
