"""How close a measured relay ÷ baseline throughput ratio is to what the compute allows.

At a prefix cap L the baseline runs one full rank per request, ``c_full``; the relay at best runs one
cached rank, ``c_cached``, plus a prefill for each request whose prefix had to be computed for it (a
pre-inference admitted, or a miss recomputed): a share ``m`` of the requests. On a compute-bound
instance the throughput ratio is then at most

    bound(L) = c_full ÷ (c_cached + m × c_prefill)

with every cost the mean over the measured requests at their own lengths (``min(seq_len, L)``,
short-term tokens, candidates) from the run's fitted cost model, and ``m`` from the relay's point at
its SLO throughput. ``efficiency`` = measured ratio ÷ bound: what queueing, the SLO's tail, the
trigger's choices and the engine's own overhead leave of the compute saved.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from relay_engine.core.outcomes import Outcome
from relay_engine.core.trace import TraceQuery
from relay_engine.lab.bench.stats import RANKED
from relay_engine.lab.bench.workload import Window
from relay_engine.lab.costmodel import CostModel


def mean_costs(cost: CostModel, queries: Sequence[TraceQuery], windows: Sequence[Window], cap: int) -> dict:
    """Mean full rank, cached rank and prefill (ms, this machine) over the windows' measured requests."""
    measured = [queries[i] for w in windows for i in range(w.first_measured, w.end)]
    if not measured:
        raise ValueError("no measured requests in the windows")
    full, cached, prefill = (np.mean([fn(q) for q in measured]) for fn in (
        lambda q: cost.rank_full_ms(min(q.seq_len, cap), q.short_len, q.n_candidates),
        lambda q: cost.rank_ms(min(q.seq_len, cap), q.short_len, q.n_candidates),
        lambda q: cost.prefill_ms(min(q.seq_len, cap))))
    return {"full_ms": float(full), "cached_ms": float(cached), "prefill_ms": float(prefill)}


def prefill_share(point: dict) -> float | None:
    """Share of a relay point's ranked requests whose prefix was computed for them (pre-inferences
    admitted plus misses recomputed), from its summary; None without ranked requests."""
    ranked = sum(n for k, n in point.get("outcomes", {}).items() if k in RANKED)
    if not ranked:
        return None
    computed = point.get("preinfer", {}).get("admitted", 0) + point["outcomes"].get(Outcome.MISS, 0)
    return min(1.0, computed / ranked)


def compute_bound(cost: CostModel, queries: Sequence[TraceQuery], windows: Sequence[Window], cap: int,
                  relay_point: dict | None, measured_ratio: float | None) -> dict | None:
    """The bound at ``cap`` and the efficiency of ``measured_ratio`` against it; None without a relay
    point to take the prefill share from."""
    if relay_point is None or (m := prefill_share(relay_point)) is None:
        return None
    c = mean_costs(cost, queries, windows, cap)
    bound = c["full_ms"] / (c["cached_ms"] + m * c["prefill_ms"])
    return {"bound": round(bound, 3), "prefill_share": round(m, 4), **{k: round(v, 3) for k, v in c.items()},
            "efficiency": None if measured_ratio is None else round(measured_ratio / bound, 3)}
