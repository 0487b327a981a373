"""The engine's own overhead: ``RelayEngine.rank`` on an HBM hit against the bare cached forward
(``HSTUModel.rank``) on the same prefix KV. CPU time of the calling thread, best of
``overhead_repeats`` for each, summed over a sample of the trace's queries at one cap."""

from __future__ import annotations

import math
import random
import time
from collections.abc import Sequence

from relay_engine.core.engine import RankRequest, RelayEngine
from relay_engine.core.features import SyntheticFeatures
from relay_engine.core.model import History, HSTUModel
from relay_engine.core.outcomes import Outcome
from relay_engine.core.trace import TraceQuery
from relay_engine.lab.bench.modes import MODES_BY_NAME, Regime, mode_policy
from relay_engine.lab.bench.settings import BenchSettings


def measure_overhead(settings: BenchSettings, queries: Sequence[TraceQuery], cap: int, regime: Regime) -> dict:
    s = settings
    model = HSTUModel(s.model)
    engine = RelayEngine(model=model, device=model.device, policy=mode_policy(MODES_BY_NAME["relay"], regime),
                         name="overhead")
    features = SyntheticFeatures(s.model, with_timestamps=s.with_timestamps, seed=s.seed)
    sample = random.Random(s.seed).sample(range(len(queries)), min(s.overhead_queries, len(queries)))
    engine_ms = bare_ms = 0.0
    for i in sample:
        q = queries[i]
        full = features.prefix(q.user_id, q.seq_len)
        keep = min(q.seq_len, max(cap, 1))
        ts = None if full.timestamps is None else full.timestamps[-keep:]
        prefix = History(full.items[-keep:], full.actions[-keep:], ts)
        short = features.short_term(q.user_id, i, q.short_len)
        cands = features.candidates(i, q.n_candidates)
        kv = model.prefill(prefix)
        engine.cache.insert(engine.cache_key(q.user_id, prefix), kv)
        request = RankRequest(q.user_id, prefix, short, cands)
        best_engine = best_bare = math.inf
        for _ in range(s.overhead_repeats):
            t0 = time.thread_time()
            result = engine.rank(request)
            t1 = time.thread_time()
            model.rank(kv, short, cands)
            t2 = time.thread_time()
            if result.source is not Outcome.HBM:
                raise RuntimeError(f"overhead measurement expected an HBM hit, got {result.source}")
            best_engine, best_bare = min(best_engine, t1 - t0), min(best_bare, t2 - t1)
        engine_ms += best_engine * 1000
        bare_ms += best_bare * 1000
    engine.close()
    return {
        "queries": len(sample), "cap": cap,
        "engine_rank_ms": round(engine_ms, 3), "bare_cached_forward_ms": round(bare_ms, 3),
        "engine_over_bare_ratio": round(engine_ms / bare_ms, 4) if bare_ms else None,
    }
