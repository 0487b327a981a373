"""Replaying a whole trace through the simulated fleet, and the what-if preview built on it.

``simulate_trace`` replays every query of a trace (a captured traffic window, a generated trace) at
its own times — or at an offered load — on N simulated instances under one policy, after priming the
caches with its first part. ``preview`` is the one call a configuration preview needs: the same
traffic under a given ``PolicySpec`` (run it for the live spec and for the proposed one), returning
the figures an operator compares.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass

from relay_engine.core.config import PolicySpec
from relay_engine.core.model import HSTUModel, ModelConfig
from relay_engine.core.trace import TraceQuery
from relay_engine.lab.bench.stats import PointResult, point_result, quantile
from relay_engine.lab.bench.workload import Window, schedule, trace_qps, window_rng
from relay_engine.lab.costmodel import CostModel
from relay_engine.lab.sim.fleet import FleetSpec, Tokens, replay_window

_MODELS: dict[ModelConfig, HSTUModel] = {}


def shared_model(config: ModelConfig) -> HSTUModel:
    """One model per configuration for every simulation in this process (used for its checks and
    sizes only: the cost model stands in for its forward passes)."""
    if config not in _MODELS:
        _MODELS[config] = HSTUModel(config)
    return _MODELS[config]


def model_config_of(cost: CostModel) -> ModelConfig:
    """The model the cost model was measured on (the default model when the file does not say)."""
    fields = {k: v for k, v in cost.model.items() if k in ModelConfig.__dataclass_fields__}
    return ModelConfig(**fields)


def whole_trace_window(n: int, prime_share: float, warmup_share: float) -> Window:
    start = min(n - 1, round(n * prime_share))
    first_measured = min(n - 1, start + round(n * warmup_share))
    return Window(0, start, first_measured, n)


def simulate_trace(queries: Sequence[TraceQuery], spec: FleetSpec, cost: CostModel, *, slo_ms: float,
                   cap: int | None = None, qps: float | None = None, prime_share: float = 0.0,
                   warmup_share: float = 0.05, seed: int = 0, model: HSTUModel | None = None,
                   progress: Callable[[float], None] | None = None, name: str = "simulated") -> PointResult:
    """Every query of the trace (arrivals at ``qps``, default the trace's own rate ÷ K); the first
    ``prime_share`` primes the caches, the next ``warmup_share`` is not measured."""
    model = model or shared_model(model_config_of(cost))
    cap = cap or model.config.max_seq_len
    rate = trace_qps(queries)
    window = whole_trace_window(len(queries), prime_share, warmup_share)
    started = time.monotonic()
    events = schedule(queries, window, cap=cap, qps=qps or rate / spec.time_scale, trace_rate=rate,
                      time_scale=spec.time_scale, with_preinfer=spec.preinfer)
    reports = replay_window(queries, window, events, cap=cap, spec=spec, model=model, cost=cost,
                            rng=window_rng(seed, window), tokens=Tokens(), progress=progress)
    return point_result(name, cap, qps or rate / spec.time_scale, spec.time_scale, slo_ms, [reports],
                        time.monotonic() - started)


@dataclass(frozen=True)
class PreviewFigures:
    p99_ms: float | None
    p50_ms: float | None
    within_slo_share: float | None
    slo_throughput_qps: float  # ranking requests answered within the SLO per second of the window
    hbm_peak_bytes: int  # the largest peak of any one instance (budgets are per instance)
    dram_peak_bytes: int
    hit_ratio: float | None  # ranked requests whose prefix was cached (HBM, DRAM or in flight)
    preinfer_admitted: int
    preinfer_refused: dict[str, int]  # by the trigger's reason
    requests: int  # measured ranking requests
    window_s: float  # the measured traffic's span
    sim_wall_s: float

    def to_dict(self) -> dict:
        return asdict(self)


def preview(queries: Sequence[TraceQuery], spec: PolicySpec, instances: int, cost: CostModel, *,
            rank_threads: int = 4, prime_share: float = 0.1, warmup_share: float = 0.05,
            seed: int = 0) -> PreviewFigures:
    """The figures of one policy on one traffic window (the what-if preview calls this twice: the live
    spec and the proposed one, on the same captured queries and cost model)."""
    fleet = FleetSpec(spec, instances, deadline_ms=2 * spec.trigger.ranking_p99_slo_ms, rank_threads=rank_threads,
                      device_type=cost.device if cost.device in ("cpu", "cuda", "npu") else "accelerator")
    point = simulate_trace(queries, fleet, cost, slo_ms=spec.trigger.ranking_p99_slo_ms, prime_share=prime_share,
                           warmup_share=warmup_share, seed=seed)
    window = whole_trace_window(len(queries), prime_share, warmup_share)
    span_s = max(1e-9, (queries[-1].t_ms - queries[window.first_measured].t_ms) / 1000)
    within = int((point.latencies_ms <= point.slo_ms).sum())
    return PreviewFigures(
        p99_ms=point.p99_ms, p50_ms=quantile(point.latencies_ms, 0.5), within_slo_share=point.within_slo_share,
        slo_throughput_qps=within / span_s, hbm_peak_bytes=point.instance_hbm_peak_bytes,
        dram_peak_bytes=point.instance_dram_peak_bytes,
        hit_ratio=point.hit_ratio, preinfer_admitted=point.preinfer_admitted,
        preinfer_refused=dict(point.preinfer_refused), requests=point.n, window_s=span_s, sim_wall_s=point.wall_s)

