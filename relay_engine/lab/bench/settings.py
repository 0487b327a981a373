"""The benchmark's settings: what a default run measures, and the small ``--quick`` run."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from pathlib import Path

from relay_engine.core.config import TriggerPolicy
from relay_engine.core.model import ModelConfig
from relay_engine.lab.bench.sweeps import CAPS, LOAD_STEPS, THROUGHPUT_CAPS

REFERENCE_PROFILE = Path(__file__).resolve().parents[1] / "profiles" / "reference.json"


@dataclass(frozen=True)
class BenchSettings:
    slo_ms: float = 50.0  # the reference device's ranking P99 SLO (× K on this machine)
    deadline_ms: float | None = None  # default: twice the SLO (× K)
    time_scale: float | None = None  # K; None: derived from the profile against the reference ("auto")
    reference_profile: Path = REFERENCE_PROFILE
    instances: int = 2
    threads_per_instance: int = 1  # torch intra-op threads, and cores pinned, per instance
    rank_threads: int = 4  # ranking threads per instance (a worker's RELAYGR_RANK_THREADS default)
    ref_qps: float = 240.0  # the reference load, in the reference device's QPS (÷ K on this machine)
    caps: tuple[int, ...] = CAPS
    throughput_caps: tuple[int, ...] = THROUGHPUT_CAPS  # the cap sweep of SLO throughput
    headline_cap: int | None = None  # where ratios.slo_throughput is taken; None: the baseline's max seq len
    load_steps: tuple[float, ...] = LOAD_STEPS  # × the reference load
    windows: int = 2  # paired windows per point
    warmup_queries: int = 300  # per window, replayed and not measured
    measured_queries: int = 1000  # per window: windows × this ≥ 2,000 per point
    prime_ttls: float = 1.0  # primed part of each window, in entry TTLs of trace time
    hbm_budget_mb: float = 256.0  # per instance
    dram_budget_mb: float = 1024.0
    entry_ttl_ms: float = 120_000.0  # of the reference device (× K)
    dram_ttl_ms: float = 600_000.0
    preinfer_compute_share: float = TriggerPolicy().preinfer_compute_share
    max_preinfer_inflight: int = TriggerPolicy().max_preinfer_inflight
    ablations: bool = True  # measure the ablations' SLO throughput at the headline cap
    # The max-sequence-length sweeps (baseline, relay); off needs headline_cap, and then only the modes
    # asked for are measured (an ablation's figure without the full run).
    seq_len_sweeps: bool = True
    cap_sweep: bool = False  # measure SLO throughput at every throughput cap (baseline and relay)
    sim_guided: bool = True  # start each sweep at the simulator's predicted crossing
    refine_crossings: bool = True  # one more point per sweep, between its crossing's pair (sweeps.refine_crossing)
    max_redo: int = 2  # a point whose host was busy is measured again, at most this often
    busy_other_share: float = 0.05  # other processes' mean CPU use over a point (share of the machine)
    busy_window_share: float = 0.25  # … or in any 2-second window
    busy_steal_share: float = 0.02  # hypervisor steal, share of the machine
    overhead_queries: int = 24
    overhead_repeats: int = 5
    profile_repeats: int = 3
    with_timestamps: bool = False
    bootstrap_replicates: int = 1000
    seed: int = 0
    model: ModelConfig = field(default_factory=ModelConfig)

    @property
    def measured_per_point(self) -> int:
        return self.windows * self.measured_queries


def quick_settings(base: BenchSettings) -> BenchSettings:
    """A small model and short points: the whole run in a few minutes (the smoke test's size). Its
    points rest on fewer than 2,000 requests: a smoke run, not a measurement."""
    return replace(
        base, time_scale=base.time_scale or 1.0, ref_qps=20.0, caps=(256, 1024, 4096), throughput_caps=(256, 1024),
        load_steps=(0.5, 1.0, 2.0, 4.0), windows=1, warmup_queries=20, measured_queries=60, prime_ttls=0.05,
        hbm_budget_mb=16.0, dram_budget_mb=64.0, overhead_queries=6, overhead_repeats=3, profile_repeats=1,
        bootstrap_replicates=200, model=ModelConfig(embed_dim=64, num_layers=2, num_heads=2, head_dim=32),
        ablations=True, cap_sweep=False, max_redo=0, refine_crossings=False,
    )
