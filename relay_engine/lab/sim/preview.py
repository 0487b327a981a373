"""Replaying a whole trace through the simulated fleet, and the what-if preview built on it.

``simulate_trace`` replays every query of a trace (a captured traffic window, a generated trace) at
its own times — or at an offered load — on N simulated instances under one policy, after priming the
caches with its first part. ``preview`` is the one call a configuration preview needs: the same
traffic under a given ``PolicySpec`` (run it for the live spec and for the proposed one), returning
the figures an operator compares. ``run_preview`` is the control plane's what-if preview (live and
proposed spec on one captured window), with the choice of cost profile (``profile_for``) and the
simulator's last validation error (``model_error_of``) it reports beside the figures.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import statistics
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from relay_engine.core.config import PolicySpec
from relay_engine.core.lifetime import follow_parent
from relay_engine.core.model import HSTUModel, ModelConfig
from relay_engine.core.trace import TraceQuery
from relay_engine.lab.bench.stats import PointResult, per_tier, point_result, quantile
from relay_engine.lab.bench.workload import (
    InstanceReport,
    Window,
    captured_names,
    schedule,
    trace_qps,
    window_rng,
)
from relay_engine.lab.costmodel import CostModel
from relay_engine.lab.sim.fleet import FleetSpec, Tokens, instance_names, replay_window

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
    started = time.monotonic()
    reports = replay_trace(queries, spec, cost, cap=cap, qps=qps, prime_share=prime_share,
                           warmup_share=warmup_share, seed=seed, model=model, progress=progress)
    return point_result(name, cap, qps or rate / spec.time_scale, spec.time_scale, slo_ms, [reports],
                        time.monotonic() - started)


def replay_trace(queries: Sequence[TraceQuery], spec: FleetSpec, cost: CostModel, *, cap: int,
                 qps: float | None = None, prime_share: float = 0.0, warmup_share: float = 0.05, seed: int = 0,
                 model: HSTUModel | None = None,
                 progress: Callable[[float], None] | None = None) -> list[InstanceReport]:
    """``simulate_trace``'s replay, each instance's report as it is (request by request)."""
    model = model or shared_model(model_config_of(cost))
    rate = trace_qps(queries)
    window = whole_trace_window(len(queries), prime_share, warmup_share)
    events = schedule(queries, window, cap=cap, qps=qps or rate / spec.time_scale, trace_rate=rate,
                      time_scale=spec.time_scale, with_preinfer=spec.preinfer)
    return replay_window(queries, window, events, cap=cap, spec=spec, model=model, cost=cost,
                         rng=window_rng(seed, window), tokens=Tokens(), progress=progress, forward_seed=seed)


@dataclass(frozen=True)
class PreviewFigures:
    # P99 and P50 of the requests served, as the dashboards and the traffic summary measure them (a
    # request past its deadline is failed, counted in ``deadline_missed`` and against the SLO share).
    # Over several replays (``replicates``, each drawing its own forward times): each figure is their
    # median, and ``p99_range_ms`` the lowest and highest P99 of one replay.
    p99_ms: float | None
    p50_ms: float | None
    within_slo_share: float | None  # of every measured request
    slo_throughput_qps: float  # ranking requests answered within the SLO per second of the window
    # Each cache tier's largest peak of any one instance (budgets are per instance), by tier name; in the
    # plain form one figure per tier, ``<tier>_peak_bytes`` (``hbm_peak_bytes``).
    peak_bytes: dict[str, int]
    hit_ratio: float | None  # ranked requests whose prefix was cached (HBM, DRAM or in flight)
    preinfer_admitted: int
    preinfer_refused: dict[str, int]  # by the trigger's reason
    requests: int  # measured ranking requests
    deadline_missed: int  # of them, failed past their deadline
    window_s: float  # the measured traffic's span
    sim_wall_s: float
    replicates: int = 1
    p99_range_ms: tuple[float, float] | None = None

    def to_dict(self) -> dict:
        out = asdict(self)
        out.update(per_tier(out.pop("peak_bytes"), "peak_bytes"))
        return out


def _median(values: list) -> float | None:
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def combined(replays: Sequence[PreviewFigures]) -> PreviewFigures:
    """One set of figures from replays of the same traffic: each figure's median over them, and the
    range of their P99."""
    if len(replays) == 1:
        return replays[0]

    def count(values: list[int]) -> int:
        return round(statistics.median(values))

    p99s = [f.p99_ms for f in replays if f.p99_ms is not None]
    reasons = sorted({k for f in replays for k in f.preinfer_refused})
    first = replays[0]
    return PreviewFigures(
        p99_ms=_median(p99s), p50_ms=_median([f.p50_ms for f in replays]),
        within_slo_share=_median([f.within_slo_share for f in replays]),
        slo_throughput_qps=statistics.median(f.slo_throughput_qps for f in replays),
        peak_bytes={tier: count([f.peak_bytes.get(tier, 0) for f in replays]) for tier in first.peak_bytes},
        hit_ratio=_median([f.hit_ratio for f in replays]),
        preinfer_admitted=count([f.preinfer_admitted for f in replays]),
        preinfer_refused={k: count([f.preinfer_refused.get(k, 0) for f in replays]) for k in reasons},
        requests=first.requests, deadline_missed=count([f.deadline_missed for f in replays]),
        window_s=first.window_s, sim_wall_s=round(sum(f.sim_wall_s for f in replays), 3),
        replicates=len(replays), p99_range_ms=(min(p99s), max(p99s)) if p99s else None)


def preview_routing(queries: Sequence[TraceQuery], instances: int) -> tuple[str, str]:
    """How a preview sends requests to instances (``FleetSpec.routing``), and why, in words: where the
    capture says the pool's router sent each one, when the window names as many instances as the
    preview simulates; else by the product's router (rendezvous hashing on the captured user ids,
    which are salted hashes: consistent per user, not the pool's own assignment)."""
    named = {q.instance for q in queries if q.instance}
    if captured_names(queries, instance_names(instances)) is not None:
        return "captured", f"each to the instance that served it ({len(named)} named in the capture)"
    why = ("the capture names no instance" if not named else
           f"the capture names {len(named)} instances, the preview simulates {instances}")
    return "rendezvous", f"by rendezvous hashing of the users, as the pool's router does ({why})"


def preview_fleet(spec: PolicySpec | None, instances: int, cost: CostModel, *, slo_ms: float, rank_threads: int = 4,
                  host: tuple[int, float] = (1, 1.0), routing: str = "rendezvous",
                  background: float = 0.0) -> FleetSpec:
    """The simulated fleet a preview replays ``spec`` on (None: the relay off; deadlines at 2 × the SLO).
    ``background``: the share of each core other processes of the host take (``host_background``)."""
    return FleetSpec(spec, instances, deadline_ms=2 * slo_ms, rank_threads=rank_threads,
                     preinfer=spec is not None, instances_per_host=host[0], host_cores=host[1],
                     device_type=cost.device if cost.device in ("cpu", "cuda", "npu") else "accelerator",
                     routing=routing, background_share=background)


# The most of a core a preview lets other processes take: past it the pool's wall clock says something
# the simulator does not model at all, and a preview that doubled every forward would only hide it.
MAX_BACKGROUND = 0.5


@dataclass(frozen=True)
class HostBackground:
    """What the CPU instances' other processes took from them, as a preview models it: ``share`` of every
    core, from ``pool_sharing`` (the pool's own ranking forwards' wall time ÷ their CPU time, over the
    window its forward times cover) against ``simulated_sharing`` (the same ratio in a replay of the live
    spec on the window with nothing else on the host: the wait the simulator explains itself, its own
    instances' forwards taking turns). A forward alone then runs at 1 − share of a core:
    share = 1 − simulated ÷ pool, within [0, ``MAX_BACKGROUND``]."""

    share: float
    pool_sharing: float | None
    simulated_sharing: float | None

    def to_dict(self) -> dict:
        return {"share": round(self.share, 4), "pool_sharing": _rounded(self.pool_sharing),
                "simulated_sharing": _rounded(self.simulated_sharing), "note": self.sentence()}

    def sentence(self) -> str:
        if self.pool_sharing is None:
            return "no other processes modelled (the pool's forwards have no CPU and wall time both)"
        return (f"other processes took {100 * self.share:.1f} % of each core (the pool's ranking forwards took "
                f"{self.pool_sharing:.3f}× their CPU time in wall time, the simulator's own instances explain "
                f"{self.simulated_sharing:.3f}×)")


def _rounded(value: float | None) -> float | None:
    return None if value is None else round(value, 4)


def simulated_sharing(reports: Sequence[InstanceReport]) -> float | None:
    """The ranking forwards' time on the shared compute ÷ their time alone, over every rank of a replay."""
    alone = sum(d[2] for r in reports for d in r.detail)
    elapsed = sum(d[3] for r in reports for d in r.detail)
    return elapsed / alone if alone > 0 else None


def host_background(queries: Sequence[TraceQuery], live: PolicySpec, instances: int, cost: CostModel, *,
                    pool_sharing: float | None, rank_threads: int = 4, host: tuple[int, float] = (1, 1.0),
                    cap: int | None = None, shares: tuple[float, float] = (0.1, 0.05),
                    seed: int = 0) -> HostBackground:
    """``HostBackground`` of a window: the live spec replayed once with nothing else on the host, its
    ranking forwards' sharing set against the pool's (None: none modelled)."""
    if pool_sharing is None or pool_sharing <= 0:
        return HostBackground(0.0, None, None)
    fleet = preview_fleet(live, instances, cost, slo_ms=live.trigger.ranking_p99_slo_ms, rank_threads=rank_threads,
                          host=host, routing=preview_routing(queries, instances)[0])
    cap = cap or prefix_cap(queries, cost)
    reports = replay_trace(queries, fleet, cost, cap=cap, prime_share=shares[0], warmup_share=shares[1], seed=seed)
    simulated = simulated_sharing(reports) or 1.0
    share = min(MAX_BACKGROUND, max(0.0, 1.0 - simulated / pool_sharing))
    return HostBackground(share, pool_sharing, simulated)


def preview(queries: Sequence[TraceQuery], spec: PolicySpec | None, instances: int, cost: CostModel, *,
            rank_threads: int = 4, prime_share: float = 0.1, warmup_share: float = 0.05,
            seed: int = 0, cap: int | None = None, slo_ms: float | None = None,
            host: tuple[int, float] = (1, 1.0), replicates: int = 1, background: float = 0.0) -> PreviewFigures:
    """The figures of one policy on one traffic window (the what-if preview calls this for the live
    spec, the proposed one and the relay off, on the same captured queries and cost model). ``spec``
    None: the relay off — every ranking request runs the whole history (no pre-inference, no cache),
    judged on ``slo_ms``. ``host``: (instances to a host, its cores) for CPU instances that share one
    (``FleetSpec.instances_per_host``). ``replicates``: replays with seeds ``seed``, ``seed`` + 1, …
    (forward times drawn anew where the cost model states their dispersion), combined by median.
    ``background``: the share of each core the host's other processes take (``host_background``)."""
    slo_ms = spec.trigger.ranking_p99_slo_ms if spec is not None else slo_ms
    if slo_ms is None:
        raise ValueError("the relay off needs the SLO it is judged on (slo_ms)")
    if replicates < 1:
        raise ValueError(f"replicates must be ≥ 1, got {replicates}")
    fleet = preview_fleet(spec, instances, cost, slo_ms=slo_ms, rank_threads=rank_threads, host=host,
                          routing=preview_routing(queries, instances)[0], background=background)
    window = whole_trace_window(len(queries), prime_share, warmup_share)
    span_s = max(1e-9, (queries[-1].t_ms - queries[window.first_measured].t_ms) / 1000)
    replays = []
    for r in range(replicates):
        point = simulate_trace(queries, fleet, cost, slo_ms=slo_ms, cap=cap,
                               prime_share=prime_share, warmup_share=warmup_share, seed=seed + r)
        within = int((point.latencies_ms <= point.slo_ms).sum())
        replays.append(PreviewFigures(
            p99_ms=quantile(point.served_ms, 0.99), p50_ms=quantile(point.served_ms, 0.5),
            within_slo_share=point.within_slo_share,
            slo_throughput_qps=within / span_s, peak_bytes=point.instance_peak_bytes,
            hit_ratio=point.hit_ratio, preinfer_admitted=point.preinfer_admitted,
            preinfer_refused=dict(point.preinfer_refused), requests=point.n,
            deadline_missed=point.outcomes.get("deadline", 0), window_s=span_s, sim_wall_s=point.wall_s))
    return combined(replays)


def replicates_for(requests: int, cost: CostModel, max_requests: int) -> int:
    """Replays a preview makes of ``requests``: one where every forward takes its mean (the replays
    would be alike); else as many as fit ``max_requests`` replayed, at most ``MAX_REPLICATES``."""
    if not any(cv > 0 for cv in cost.dispersion.values()):
        return 1
    return max(1, min(MAX_REPLICATES, max_requests // max(1, requests)))


# --- the what-if preview of the control plane (``python -m relay_engine.sim preview``) -------------

PROFILES_DIR = Path(__file__).resolve().parents[1] / "profiles"
REPO_ROOT = Path(__file__).resolve().parents[3]
# Where ``python -m relay_engine.sim validate --out …`` should write for previews to show its error.
DEFAULT_VALIDATION = REPO_ROOT / "artifacts" / "sim-validation.json"
DEVICE_KINDS = ("cpu", "cuda", "npu")
# Queries replayed per spec at most: two replays of this many fit the 60 s a preview may take on a
# CPU shared with other work (the simulator replays ~1,000 queries/s there).
DEFAULT_MAX_REQUESTS = 15_000
# Replays of a short window at most (each draws its own forward times; their median is the figure).
MAX_REPLICATES = 9


def profile_for(device_kind: str) -> tuple[Path, str]:
    """The cost profile of a pool's device: the one its stack measured at start (``$RELAYGR_PROFILE_DIR``,
    ``python -m relay_engine.calibrate``), else one measured on this machine
    (``artifacts/profile-<kind>.json``, ``python -m relay_engine.profile --fit``), else shipped
    (``profiles/<kind>.json``), else the reference profile. Returns the file and a sentence saying
    which and why."""
    if device_kind in DEVICE_KINDS:
        started = os.environ.get("RELAYGR_PROFILE_DIR")
        for path, how in (*(((Path(started) / f"profile-{device_kind}.json",
                              "measured on this machine when the stack started"),) if started else ()),
                          (REPO_ROOT / "artifacts" / f"profile-{device_kind}.json", "measured on this machine"),
                          (PROFILES_DIR / f"{device_kind}.json", "shipped")):
            if path.is_file():
                return path, f"the {device_kind} profile ({how})"
        why = f"no {device_kind} profile measured here or shipped"
    else:
        why = f"the pool's device kind is {device_kind!r}, no instance reported its device"
    return PROFILES_DIR / "reference.json", f"the reference profile ({why})"


def model_error_of(path: Path) -> tuple[float | None, str]:
    """The simulator's last measured validation error (largest |P99 error| over the validated points)."""
    if not path.is_file():
        return None, (f"not validated on this machine (no {path}; run python -m relay_engine.sim validate "
                      f"--out {path})")
    try:
        data = json.loads(path.read_text())
        error = data["max_abs_p99_error"]
        points = len(data["points"])
        fewest = min((p["n"] for p in data["points"] if isinstance(p, dict) and isinstance(p.get("n"), int)),
                     default=None)
    except (OSError, ValueError, KeyError, TypeError) as exc:
        return None, f"the validation file {path} cannot be read ({type(exc).__name__}: {exc})"
    if error is None:
        return None, f"the validation in {path} measured no P99 error"
    when = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime(path.stat().st_mtime))
    measured = "" if fewest is None else f" of at least {fewest} requests each"
    return float(error), f"largest |P99 error| over {points} validated points{measured} ({path.name}, {when})"


def recent_share(queries: Sequence[TraceQuery], max_requests: int) -> tuple[list[TraceQuery], str | None]:
    """The most recent ``max_requests`` queries of a window (times from the first of them): the same
    rate, users and lengths as the whole window, over a shorter span; a note when it cut."""
    if len(queries) <= max_requests:
        return list(queries), None
    tail = queries[-max_requests:]
    start = tail[0].t_ms
    kept = [replace(q, t_ms=q.t_ms - start) for q in tail]
    span_s = (kept[-1].t_ms - kept[0].t_ms) / 1000
    return kept, (f"replayed the most recent {max_requests} of {len(queries)} captured requests "
                  f"({span_s:.0f} s of the window) to finish in time")


def _figures(args: tuple) -> dict:
    queries, spec, instances, cost, rank_threads, cap, slo_ms, host, replicates, shares, background = args
    prime_share, warmup_share = shares
    return preview(queries, spec, instances, cost, rank_threads=rank_threads, cap=cap, slo_ms=slo_ms,
                   host=host, replicates=replicates, prime_share=prime_share, warmup_share=warmup_share,
                   background=background).to_dict()


def warmup_shares(requests: int, warmup_requests: int) -> tuple[float, float]:
    """(prime share, warm-up share) of a replay: the traffic before the window replayed unmeasured
    when there is some; else the window's first tenth primes the caches and the next 5 % warms up."""
    if warmup_requests <= 0:
        return 0.1, 0.05
    return 0.0, min(warmup_requests, requests - 1) / requests


def prefix_cap(queries: Sequence[TraceQuery], cost: CostModel) -> int:
    """The longest prefix the simulated model takes beside the window's longest short-term history."""
    max_seq_len = model_config_of(cost).max_seq_len
    return max(1, max_seq_len - max(q.short_len for q in queries))


@dataclass(frozen=True)
class ReplayPlan:
    """Which of a preview's queries it replays and how: ``replayed`` (the last ``len(replayed)`` of the
    queries given, times from the first of them), of which the first ``warm`` warm the caches up and
    ``measured`` count; the prefix ``cap``; (prime, warm-up) ``shares``; ``note`` when it cut."""

    replayed: list[TraceQuery]
    lead: int
    warm: int
    measured: int
    cap: int
    shares: tuple[float, float]
    note: str | None


def replay_plan(queries: Sequence[TraceQuery], cost: CostModel, *, max_requests: int = DEFAULT_MAX_REQUESTS,
                warmup_requests: int = 0) -> ReplayPlan:
    lead = max(0, min(warmup_requests, len(queries) - 2))
    measured = min(len(queries) - lead, max_requests)
    # Warm up on the traffic just before the measured requests: the lead, or the part of a window too
    # long to replay whole (as much of it as the lead); none given, the window's first tenth primes.
    warm = min(len(queries) - measured, lead)
    replayed, _ = recent_share(queries, measured + warm)
    return ReplayPlan(replayed, lead, warm, measured, prefix_cap(replayed, cost),
                      warmup_shares(len(replayed), warm), recent_share(queries[lead:], max_requests)[1])


def run_preview(queries: Sequence[TraceQuery], live: PolicySpec, proposed: PolicySpec, *, instances: int,
                cost: CostModel, rank_threads: int = 4, max_requests: int = DEFAULT_MAX_REQUESTS,
                jobs: int = 2, host: tuple[int, float] = (1, 1.0), warmup_requests: int = 0,
                pool_sharing: float | None = None) -> dict:
    """Live and proposed spec on the same (most recent) captured queries, and the relay off on them
    (judged on the live SLO: what the relay is worth on this traffic); the replays in parallel
    processes when ``jobs`` > 1. ``warmup_requests``: the first ones are the traffic before the
    window, replayed to warm the caches and not measured. ``pool_sharing``: the pool's ranking
    forwards' wall time ÷ CPU time, where its instances measure both: the host's other processes are
    then modelled (``host_background``, one replay more)."""
    plan = replay_plan(queries, cost, max_requests=max_requests, warmup_requests=warmup_requests)
    replayed, warm, measured, cap, shares, note = (plan.replayed, plan.warm, plan.measured, plan.cap, plan.shares,
                                                   plan.note)
    lead = plan.lead
    cut = sum(q.seq_len > cap for q in replayed)
    slo_ms = live.trigger.ranking_p99_slo_ms
    replicates = replicates_for(len(replayed), cost, max_requests)
    started = time.monotonic()
    background = host_background(replayed, live, instances, cost, pool_sharing=pool_sharing,
                                 rank_threads=rank_threads, host=host, cap=cap, shares=shares)
    work = [(replayed, spec, instances, cost, rank_threads, cap, slo_ms, host, replicates, shares, background.share)
            for spec in (live, proposed, None)]
    if jobs > 1:
        with ProcessPoolExecutor(max_workers=2, mp_context=multiprocessing.get_context("fork"),
                                 initializer=follow_parent, initargs=(os.getpid(),)) as pool:
            live_figures, proposed_figures, relay_off = pool.map(_figures, work)
    else:
        live_figures, proposed_figures, relay_off = map(_figures, work)
    return {"live": live_figures, "proposed": proposed_figures, "relay_off": relay_off, "requests": measured,
            "routing": preview_routing(replayed, instances)[1],
            "requests_captured": len(queries) - lead, "warmup_requests": warm, "sampling": note, "instances": instances,
            "rank_threads": rank_threads, "instances_per_host": host[0], "host_cores": host[1], "prefix_cap": cap, "prefixes_cut": cut,
            "replicates": replicates, "host_background": background.to_dict(), "sim_nice": os.nice(0),
            "sim_wall_s": round(time.monotonic() - started, 2)}
