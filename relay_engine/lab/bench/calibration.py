"""Calibration at the start of a run: this machine's cost model, the time scale K against the stated
reference profile, and the regime every mode runs under.

The cost model is measured inside instance 0 (pinned, with the instances' torch threads), so it
describes the compute the instances have. K compares it with the reference profile
(``relay_engine/lab/profiles/reference.json``, see its note): K = 3 means this machine runs the
forwards three times slower than the reference, and the benchmark then runs the trace with every
time constant tripled — the same ratios of compute to time budget as the reference device.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from relay_engine.core.model import HSTUModel
from relay_engine.lab.bench.modes import Regime
from relay_engine.lab.bench.settings import BenchSettings
from relay_engine.lab.costmodel import CostModel, time_scale_against
from relay_engine.lab.profile import fit_profile


def profile_here(settings: BenchSettings, short: int, candidates: int, lengths: tuple[int, ...]) -> dict:
    """The cost model of this process's compute (run inside a pinned instance): as a plain dict."""
    model = HSTUModel(settings.model)
    cost = fit_profile(model, settings.model, model.device, lengths, short, candidates, settings.profile_repeats,
                       settings.with_timestamps, quiet=True)
    return cost.to_dict() | {"torch_threads": torch.get_num_threads()}


def time_scale(settings: BenchSettings, cost: CostModel, short: int, candidates: int) -> tuple[float, dict]:
    """K and how it was obtained."""
    if settings.time_scale is not None:
        return settings.time_scale, {"time_scale": settings.time_scale, "how": "given (--time-scale)"}
    reference = CostModel.load(settings.reference_profile)
    k = time_scale_against(cost, reference, short=short, candidates=candidates)
    return k, {"time_scale": round(k, 4), "how": "auto: geometric mean of measured ÷ reference forward times "
               "(prefill, cached rank, full rank at 512…4096 tokens)",
               "reference_profile": str(settings.reference_profile), "reference_note": reference.note}


def regime_for(settings: BenchSettings, cost: CostModel, k: float, short: int, candidates: int) -> Regime:
    """The reference regime (SLO, deadline, TTLs of the reference device) × K, with this machine's
    full-inference latency model for the trigger."""
    s = settings
    base = Regime(slo_ms=s.slo_ms, deadline_ms=s.deadline_ms or 2 * s.slo_ms, hbm_budget_mb=s.hbm_budget_mb,
                  dram_budget_mb=s.dram_budget_mb, entry_ttl_ms=s.entry_ttl_ms, dram_ttl_ms=s.dram_ttl_ms,
                  preinfer_compute_share=s.preinfer_compute_share, max_preinfer_inflight=s.max_preinfer_inflight,
                  disk_budget_mb=s.dram_budget_mb)
    return replace(base.scaled(k), latency_model=cost.full_inference_model(short, candidates))
