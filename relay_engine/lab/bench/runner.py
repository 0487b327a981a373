"""The benchmark's runner: instances, the driver, the sweeps and the report (see the package doc)."""

from __future__ import annotations

import argparse
import json
import math
import multiprocessing as mp
import os
import queue
import random
import sys
import threading
import time
from collections import Counter, deque
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

from relay_engine.core.config import CacheBudget, LatencyModel, PolicySpec, TriggerPolicy
from relay_engine.core.engine import DeadlineExceeded, PreInferRequest, RankRequest, RelayEngine
from relay_engine.core.features import SyntheticFeatures
from relay_engine.core.model import History, HSTUModel, ModelConfig
from relay_engine.core.router import AffinityRouter
from relay_engine.core.trace import TraceError, TraceQuery, read_trace
from relay_engine.lab.traffic import TraceSpec, describe, generate_trace

PREINFER_NICE = 10  # pre-inference threads yield the core to ranking
SLO_QUANTILE = 0.99
LOAD_WINDOW_S = 1.0  # the router's bounded-load fallback counts requests routed in this window
START_MARGIN_S = 0.05  # between the start signal and a probe's first arrival


@dataclass(frozen=True)
class Mode:
    name: str
    relay: bool = True
    dram: bool = True
    affinity: bool = True
    admit_all: bool = False
    what: str = ""


MODES: tuple[Mode, ...] = (
    Mode("baseline", relay=False, what="no pre-inference; ranking runs rank_full"),
    Mode("relay", what="trigger + affinity router + HBM tier + DRAM expander"),
    Mode("relay_no_dram", dram=False, what="relay without the DRAM tier"),
    Mode("relay_random_route", affinity=False, what="relay, pre-infer and rank routed at random"),
    Mode("relay_preinfer_all", admit_all=True, what="relay, the trigger admits every prefix"),
)


@dataclass(frozen=True)
class BenchSettings:
    slo_ms: float = 50.0
    instances: int = 2
    threads_per_instance: int = 1
    ref_qps: float = 20.0
    deadline_ms: float = 100.0  # a ranking request fails fast this long after its arrival
    caps: tuple[int, ...] = (64, 128, 192, 256, 384, 512, 768, 1024, 1536, 2048, 3072, 4096, 6144, 8192)
    qps_steps: tuple[float, ...] = tuple(2 ** (k / 2) for k in range(-4, 9))  # × ref_qps
    measured_queries: int = 240  # per probe
    warmup_queries: int = 60  # per probe, unmeasured, just before the measured part
    initial_warmup_queries: int = 300  # relay modes, once, at the reference QPS
    at_risk_fraction: float = 0.5  # at risk: full inference predicted above this share of the SLO
    hbm_budget_mb: float = CacheBudget().hbm_budget_mb
    dram_budget_mb: float = CacheBudget().dram_budget_mb
    with_timestamps: bool = False
    overhead_queries: int = 24
    overhead_repeats: int = 5
    seed: int = 0
    model: ModelConfig = field(default_factory=ModelConfig)


def quick_settings(base: BenchSettings) -> BenchSettings:
    """A small model and short probes: the whole run in about a minute (the smoke test's size)."""
    return replace(
        base, ref_qps=40.0, caps=(64, 256, 1024, 4096), qps_steps=(0.5, 1.0, 2.0, 4.0),
        measured_queries=40, warmup_queries=10, initial_warmup_queries=40,
        hbm_budget_mb=16.0, dram_budget_mb=64.0, overhead_queries=6, overhead_repeats=3,
        model=ModelConfig(embed_dim=64, num_layers=2, num_heads=2, head_dim=32),
    )


# --- what a probe sends to an instance and gets back ------------------------------------------


@dataclass(frozen=True)
class Event:
    at_s: float  # scheduled time, from the probe's start
    kind: str  # "preinfer" | "rank"
    query: int  # index in the trace
    user_id: str
    seq_len: int  # the user's long-term prefix length in the trace
    cap: int  # prefixes are truncated to their most recent `cap` tokens
    short_len: int
    n_candidates: int
    measured: bool


@dataclass(frozen=True)
class ProbePlan:
    events: tuple[Event, ...]
    slo_ms: float
    deadline_ms: float
    abort_after: int  # measured requests over the SLO, fleet-wide, beyond which P99 has failed


@dataclass
class InstanceReport:
    ranks: list[tuple[int, float, str, bool]]  # (query, latency ms, outcome, measured)
    preinfers: list[tuple[int, bool, str | None, bool]]  # (query, admitted, refusal reason, measured)
    hbm_peak_bytes: int = 0
    hbm_budget_bytes: int = 0
    dram_peak_bytes: int = 0
    dram_budget_bytes: int = 0


class _FullInference:
    """The baseline's ranking: ``rank_full`` with the engine's deadline semantics, no cache."""

    def __init__(self, model: HSTUModel):
        self.model = model

    def rank(self, request: RankRequest) -> str:
        if time.monotonic() > request.deadline_s:
            raise DeadlineExceeded("on arrival")
        scores = self.model.rank_full(request.prefix, request.short_term, request.candidates)
        scores.tolist()
        if time.monotonic() > request.deadline_s:
            raise DeadlineExceeded("after scoring")
        return "full"


class _Instance:
    """One engine instance inside its own process: replays the events routed to it."""

    def __init__(self, name: str, model: HSTUModel, features: SyntheticFeatures):
        self.name = name
        self.model = model
        self.features = features
        self.engine: RelayEngine | None = None
        self.full = _FullInference(model)
        self._prefixes: dict[tuple[str, int, int], History] = {}

    def set_mode(self, policy: PolicySpec | None) -> None:
        # Deadlines are time.monotonic() instants, shared by the driver and every instance.
        self.engine = None if policy is None else RelayEngine(
            model=self.model, device=self.model.device, policy=policy, name=self.name,
            wall_clock=time.monotonic)
        self._prefixes.clear()

    def prefix(self, ev: Event) -> History:
        key = (ev.user_id, ev.seq_len, ev.cap)
        if key not in self._prefixes:
            full = self.features.prefix(ev.user_id, ev.seq_len)
            keep = min(ev.seq_len, ev.cap)
            ts = None if full.timestamps is None else full.timestamps[-keep:]
            self._prefixes[key] = History(full.items[-keep:], full.actions[-keep:], ts)
        return self._prefixes[key]

    def prepare(self, plan: ProbePlan) -> dict[int, tuple]:
        """Token ids of every request, derived before the probe's clock starts."""
        inputs = {}
        for ev in plan.events:
            if ev.kind == "rank":
                inputs[ev.query] = (self.prefix(ev), self.features.short_term(ev.user_id, ev.query, ev.short_len),
                                    self.features.candidates(ev.query, ev.n_candidates))
            else:
                self.prefix(ev)
        return inputs

    def run(self, plan: ProbePlan, inputs: dict[int, tuple], start_s: float, over_slo,
            abort: threading.Event) -> InstanceReport:
        """Replay the plan from start_s, a time.monotonic() instant (CLOCK_MONOTONIC is system-wide)."""
        report = InstanceReport([], [])
        ranks: queue.SimpleQueue[Event | None] = queue.SimpleQueue()
        rank_thread = threading.Thread(target=self._rank_loop,
                                       args=(plan, start_s, ranks, inputs, report, over_slo, abort))
        rank_thread.start()
        preinfer_threads = []
        for ev in plan.events:
            if abort.is_set():
                break
            delay = start_s + ev.at_s - time.monotonic()
            if delay > 0:
                time.sleep(delay)
            if ev.kind == "rank":
                ranks.put(ev)
            elif self.engine is not None:
                t = threading.Thread(target=self._preinfer, args=(ev, report))
                t.start()
                preinfer_threads.append(t)
        ranks.put(None)
        rank_thread.join()
        for t in preinfer_threads:
            t.join()
        if self.engine is not None:
            st = self.engine.stats()
            report.hbm_peak_bytes, report.hbm_budget_bytes = st.hbm_peak_bytes, st.hbm_budget_bytes
            report.dram_peak_bytes, report.dram_budget_bytes = st.dram_peak_bytes, st.dram_budget_bytes
        return report

    def _preinfer(self, ev: Event, report: InstanceReport) -> None:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), PREINFER_NICE)
        result = self.engine.pre_infer(PreInferRequest(ev.user_id, self.prefix(ev)))
        report.preinfers.append((ev.query, result.admitted, result.reason, ev.measured))

    def _rank_loop(self, plan: ProbePlan, start_s: float, ranks: queue.SimpleQueue, inputs: dict,
                   report: InstanceReport, over_slo, abort: threading.Event) -> None:
        ranker = self.engine if self.engine is not None else self.full
        while (ev := ranks.get()) is not None:
            if abort.is_set():
                continue
            arrival = start_s + ev.at_s
            prefix, short_term, candidates = inputs[ev.query]
            request = RankRequest(ev.user_id, prefix, short_term, candidates,
                                  deadline_s=arrival + plan.deadline_ms / 1000)
            try:
                result = ranker.rank(request)
                outcome = result if isinstance(result, str) else result.source
            except DeadlineExceeded:
                outcome = "deadline"
            latency_ms = (time.monotonic() - arrival) * 1000
            report.ranks.append((ev.query, latency_ms, outcome, ev.measured))
            if ev.measured and latency_ms > plan.slo_ms:
                with over_slo.get_lock():
                    over_slo.value += 1
                    if over_slo.value > plan.abort_after:
                        abort.set()


def _instance_main(conn, name: str, settings: BenchSettings, over_slo, abort) -> None:
    torch.set_num_threads(settings.threads_per_instance)
    model = HSTUModel(settings.model)
    features = SyntheticFeatures(settings.model, with_timestamps=settings.with_timestamps, seed=settings.seed)
    instance = _Instance(name, model, features)
    conn.send(model.version)
    while True:
        command, arg = conn.recv()
        if command == "mode":
            instance.set_mode(arg)
            conn.send("ok")
        elif command == "probe":
            inputs = instance.prepare(arg)
            conn.send("ready")
            conn.send(instance.run(arg, inputs, conn.recv(), over_slo, abort))
        else:
            break


# --- the driver --------------------------------------------------------------------------------


@dataclass
class ProbeResult:
    mode: str
    cap: int
    qps: float
    passed: bool
    aborted: bool
    measured: int
    over_slo: int
    p50_ms: float | None
    p99_ms: float | None
    p999_ms: float | None
    outcomes: dict[str, int]
    preinfer_signals: int
    preinfer_admitted: int
    preinfer_refused: dict[str, int]
    hbm_peak_bytes: int
    hbm_budget_bytes: int
    dram_peak_bytes: int
    dram_budget_bytes: int
    wall_s: float

    def summary(self) -> dict:
        ranked = sum(n for k, n in self.outcomes.items() if k in ("hbm", "dram", "inflight", "miss"))

        def rate(kind: str) -> float | None:
            return None if not ranked else round(self.outcomes.get(kind, 0) / ranked, 4)

        return {
            "qps": round(self.qps, 3), "cap": self.cap, "passed": self.passed, "aborted": self.aborted,
            "requests": self.measured, "over_slo": self.over_slo,
            "p50_ms": _round(self.p50_ms), "p99_ms": _round(self.p99_ms), "p999_ms": _round(self.p999_ms),
            "deadline_missed": self.outcomes.get("deadline", 0),
            "hbm_hit_rate": rate("hbm"), "dram_hit_rate": rate("dram"),
            "inflight_join_rate": rate("inflight"), "miss_rate": rate("miss"),
            "outcomes": dict(self.outcomes),
            "preinfer": {"signals": self.preinfer_signals, "admitted": self.preinfer_admitted,
                         "refused": dict(self.preinfer_refused)},
            "hbm_peak_bytes": self.hbm_peak_bytes, "hbm_budget_bytes": self.hbm_budget_bytes,
            "dram_peak_bytes": self.dram_peak_bytes, "dram_budget_bytes": self.dram_budget_bytes,
            "within_budget": self.hbm_peak_bytes <= self.hbm_budget_bytes
            and self.dram_peak_bytes <= self.dram_budget_bytes,
            "wall_s": round(self.wall_s, 2),
        }


def _round(x: float | None, nd: int = 2) -> float | None:
    return None if x is None else round(x, nd)


class Fleet:
    """N instance processes with the same weights; a mode is installed on all of them at once."""

    def __init__(self, settings: BenchSettings):
        self.settings = settings
        self.names = [f"instance-{i}" for i in range(settings.instances)]
        ctx = mp.get_context("spawn")
        self.over_slo = ctx.Value("i", 0)
        self.abort = ctx.Event()
        self._conns, self._procs = [], []
        os.environ["OMP_NUM_THREADS"] = str(settings.threads_per_instance)
        for name in self.names:
            parent, child = ctx.Pipe()
            proc = ctx.Process(target=_instance_main, args=(child, name, settings, self.over_slo, self.abort),
                               daemon=True)
            proc.start()
            self._conns.append(parent)
            self._procs.append(proc)
        versions = {conn.recv() for conn in self._conns}
        if len(versions) != 1:
            raise RuntimeError(f"instances disagree on the model version: {sorted(versions)}")
        self.model_version = versions.pop()

    def set_mode(self, policy: PolicySpec | None) -> None:
        for conn in self._conns:
            conn.send(("mode", policy))
        for conn in self._conns:
            conn.recv()

    def probe(self, mode: Mode, queries: Sequence[TraceQuery], first_measured: int, cap: int, qps: float,
              trace_qps: float, rng: random.Random) -> ProbeResult:
        """Replay queries open-loop at the offered qps; those from index first_measured on are measured."""
        s = self.settings
        n_measured = len(queries) - first_measured
        self.over_slo.value = 0
        self.abort.clear()
        events = _schedule(queries, first_measured, cap, trace_qps / qps, mode.relay)
        per_instance = _route(events, self.names, mode.affinity, rng)
        abort_after = math.floor((1 - SLO_QUANTILE) * n_measured + 1e-9)
        for conn, name in zip(self._conns, self.names, strict=True):
            conn.send(("probe", ProbePlan(tuple(per_instance[name]), s.slo_ms, s.deadline_ms, abort_after)))
        for conn in self._conns:
            conn.recv()  # "ready": inputs derived
        start = time.monotonic() + START_MARGIN_S
        for conn in self._conns:
            conn.send(start)
        reports: list[InstanceReport] = [conn.recv() for conn in self._conns]
        return _result(mode.name, cap, qps, reports, s.slo_ms, n_measured, self.abort.is_set(),
                       time.monotonic() - start)

    def close(self) -> None:
        for conn in self._conns:
            conn.send(("stop", None))
        for proc in self._procs:
            proc.join(10)


def _schedule(queries: Sequence[TraceQuery], first_measured: int, cap: int, time_scale: float,
              with_preinfer: bool) -> list[Event]:
    """The window's events on its own clock: arrivals scaled to the offered load, delays unscaled."""
    t0 = queries[0].t_ms
    events = []
    for i, q in enumerate(queries):
        at_s = (q.t_ms - t0) * time_scale / 1000
        common = dict(query=q.index, user_id=q.user_id, seq_len=q.seq_len, cap=cap, short_len=q.short_len,
                      n_candidates=q.n_candidates, measured=i >= first_measured)
        if with_preinfer:
            events.append(Event(at_s=at_s, kind="preinfer", **common))
        events.append(Event(at_s=at_s + q.rank_delay_ms / 1000, kind="rank", **common))
    events.sort(key=lambda e: e.at_s)
    return events


def _route(events: list[Event], names: list[str], affinity: bool, rng: random.Random) -> dict[str, list[Event]]:
    """Affinity: the rendezvous router with its bounded-load fallback, loads being the requests routed
    to each instance in the last LOAD_WINDOW_S; pre-infer signal and ranking are routed separately
    and meet because the router is deterministic. Random: each one to any instance, uniformly."""
    router = AffinityRouter(names)
    out: dict[str, list[Event]] = {n: [] for n in names}
    recent: deque[tuple[float, str]] = deque()
    loads: Counter[str] = Counter()
    for ev in events:
        while recent and recent[0][0] < ev.at_s - LOAD_WINDOW_S:
            loads[recent.popleft()[1]] -= 1
        name = router.route(ev.user_id, loads) if affinity else rng.choice(names)
        if ev.kind == "rank":
            recent.append((ev.at_s, name))
            loads[name] += 1
        out[name].append(ev)
    return out


def _result(mode: str, cap: int, qps: float, reports: list[InstanceReport], slo_ms: float, n_measured: int,
            aborted: bool, wall_s: float) -> ProbeResult:
    latencies = np.array([lat for r in reports for (_, lat, _, m) in r.ranks if m], dtype=np.float64)
    outcomes = Counter(o for r in reports for (_, _, o, m) in r.ranks if m)
    over = int((latencies > slo_ms).sum())

    def pct(q: float) -> float | None:
        return float(np.percentile(latencies, q, method="inverted_cdf")) if latencies.size else None

    complete = latencies.size == n_measured
    passed = complete and not aborted and over <= math.floor((1 - SLO_QUANTILE) * n_measured + 1e-9)
    pre = [(a, reason) for r in reports for (_, a, reason, m) in r.preinfers if m]
    return ProbeResult(
        mode, cap, qps, passed, aborted or not complete, int(latencies.size), over, pct(50), pct(99), pct(99.9),
        dict(outcomes), len(pre), sum(1 for a, _ in pre if a), dict(Counter(reason for a, reason in pre if not a)),
        sum(r.hbm_peak_bytes for r in reports), sum(r.hbm_budget_bytes for r in reports),
        sum(r.dram_peak_bytes for r in reports), sum(r.dram_budget_bytes for r in reports), wall_s,
    )


@dataclass(frozen=True)
class IndexedQuery(TraceQuery):
    index: int = 0


class TraceWalk:
    """Consecutive windows of the trace; wraps around (and says so) if the sweep outlasts it."""

    def __init__(self, queries: Sequence[TraceQuery]):
        self.queries = [IndexedQuery(**asdict(q), index=i) for i, q in enumerate(queries)]
        self.pos = 0
        self.wrapped = False

    def take(self, n: int) -> list[IndexedQuery]:
        out = []
        while len(out) < n:
            if self.pos >= len(self.queries):
                self.pos, self.wrapped = 0, True
            out.append(self.queries[self.pos])
            self.pos += 1
        return out


def trace_qps(queries: Sequence[TraceQuery]) -> float:
    span_s = (queries[-1].t_ms - queries[0].t_ms) / 1000
    return (len(queries) - 1) / span_s if span_s > 0 else 1.0


# --- policies and calibration ------------------------------------------------------------------


def fit_latency_model(model: HSTUModel, lengths: Sequence[int], short_len: int, n_candidates: int,
                      seed: int) -> tuple[LatencyModel, dict[int, float]]:
    """Measure rank_full at a few prefix lengths and fit base + a·n + b·n² by least squares.

    CPU time of the calling thread, best of 3: the model's own cost, not the machine's load."""
    features = SyntheticFeatures(model.config, seed=seed)
    measured = {}
    for n in lengths:
        prefix, short = features.prefix("calibration", n), features.short_term("calibration", 0, short_len)
        cands = features.candidates(0, n_candidates)
        model.rank_full(prefix, short, cands)
        best = math.inf
        for _ in range(3):
            t0 = time.thread_time()
            model.rank_full(prefix, short, cands)
            best = min(best, (time.thread_time() - t0) * 1000)
        measured[n] = best
    x = np.array(lengths, dtype=np.float64)
    coef, *_ = np.linalg.lstsq(np.stack([np.ones_like(x), x, x * x], 1), np.array(list(measured.values())),
                               rcond=None)
    base, per_token, per_token_sq = (max(0.0, float(c)) for c in coef)
    return LatencyModel(base, per_token, per_token_sq), measured


def mode_policy(mode: Mode, settings: BenchSettings, at_risk_seq_len: int) -> PolicySpec | None:
    if not mode.relay:
        return None
    trigger = TriggerPolicy(at_risk_seq_len=at_risk_seq_len, admit_all=mode.admit_all,
                            ranking_p99_slo_ms=settings.slo_ms)
    cache = CacheBudget(hbm_budget_mb=settings.hbm_budget_mb,
                        dram_budget_mb=settings.dram_budget_mb if mode.dram else 0.0)
    return PolicySpec(trigger=trigger, cache=cache)


# --- sweeps ------------------------------------------------------------------------------------


def bisect_grid(grid: Sequence, passes: Callable[[object], bool], known: dict[int, bool] | None = None) -> int:
    """Index of the last grid value that passes, assuming passing is monotone (-1 if none does)."""
    lo, hi = -1, len(grid)
    for i, ok in sorted((known or {}).items()):
        if ok:
            lo = max(lo, i)
        else:
            hi = min(hi, i)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if passes(grid[mid]):
            lo = mid
        else:
            hi = mid
    return lo


class Runner:
    def __init__(self, settings: BenchSettings, queries: list[TraceQuery], fleet: Fleet,
                 progress: tqdm, at_risk_seq_len: int):
        self.s = settings
        self.queries = queries
        self.trace_qps = trace_qps(queries)
        self.fleet = fleet
        self.progress = progress
        self.at_risk_seq_len = at_risk_seq_len
        self.wrapped = False

    def run_mode(self, mode: Mode) -> dict:
        """Fresh instances in this mode, then the max-sequence-length sweep at the reference QPS."""
        s = self.s
        self.fleet.set_mode(mode_policy(mode, s, self.at_risk_seq_len))
        self._walk = TraceWalk(self.queries)
        self._rng = random.Random(s.seed)
        self._probes: list[ProbeResult] = []
        if mode.relay and s.initial_warmup_queries:
            self._probe(mode, s.caps[len(s.caps) // 2], s.ref_qps, measured=0, warmup=s.initial_warmup_queries)
        cap_index = bisect_grid(s.caps, lambda cap: self._probe(mode, cap, s.ref_qps).passed)
        return {"what": mode.what, "max_seq_len_at_slo": s.caps[cap_index] if cap_index >= 0 else 0}

    def run_throughput(self, mode: Mode, result: dict, cap: int) -> dict:
        """Continue the mode's walk: the SLO-throughput sweep at the common cap; its first probe, at the
        reference QPS, is the reference load."""
        s = self.s
        qps_grid = [s.ref_qps * k for k in s.qps_steps]
        ref_index = min(range(len(qps_grid)), key=lambda i: abs(qps_grid[i] - s.ref_qps))
        reference = self._probe(mode, cap, qps_grid[ref_index])
        qps_index = bisect_grid(qps_grid, lambda qps: self._probe(mode, cap, qps).passed,
                                {ref_index: reference.passed})
        self.wrapped |= self._walk.wrapped
        probes = self._probes
        return {
            **result,
            "slo_throughput_qps": round(qps_grid[qps_index], 3) if qps_index >= 0 else 0.0,
            "throughput_cap": cap,
            "reference": reference.summary(),
            "peak_hbm_bytes": max((p.hbm_peak_bytes for p in probes), default=0),
            "peak_dram_bytes": max((p.dram_peak_bytes for p in probes), default=0),
            "hbm_budget_bytes": max((p.hbm_budget_bytes for p in probes), default=0),
            "dram_budget_bytes": max((p.dram_budget_bytes for p in probes), default=0),
            "within_budget": all(p.hbm_peak_bytes <= p.hbm_budget_bytes and p.dram_peak_bytes <= p.dram_budget_bytes
                                 for p in probes),
            "probes": [p.summary() for p in probes],
        }

    def _probe(self, mode: Mode, cap: int, qps: float, measured: int | None = None,
               warmup: int | None = None) -> ProbeResult:
        s = self.s
        warmup = s.warmup_queries if warmup is None else warmup
        measured = s.measured_queries if measured is None else measured
        self.progress.set_description(f"{mode.name:<19} cap {cap:>5} @ {qps:6.1f} qps")
        r = self.fleet.probe(mode, self._walk.take(warmup + measured), warmup, cap, qps, self.trace_qps, self._rng)
        self.progress.update(1)
        if measured:
            self._probes.append(r)
        return r


# --- engine overhead ---------------------------------------------------------------------------


def measure_overhead(settings: BenchSettings, queries: Sequence[TraceQuery], cap: int,
                     at_risk_seq_len: int) -> dict:
    """``RelayEngine.rank`` (HBM hit) against ``HSTUModel.rank`` on the same cached prefix: CPU time
    of this thread, best of `overhead_repeats` for each, summed over a sample of the trace's queries
    at the given cap."""
    s = settings
    model = HSTUModel(s.model)
    policy = mode_policy(MODES[1], s, at_risk_seq_len)
    engine = RelayEngine(model=model, device=model.device, policy=policy, name="overhead")
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
        engine.hbm.insert(engine.cache_key(q.user_id, prefix), kv)
        request = RankRequest(q.user_id, prefix, short, cands)
        best_engine = best_bare = math.inf
        for _ in range(s.overhead_repeats):
            t0 = time.thread_time()
            result = engine.rank(request)
            t1 = time.thread_time()
            model.rank(kv, short, cands)
            t2 = time.thread_time()
            if result.source != "hbm":
                raise RuntimeError(f"overhead measurement expected an HBM hit, got {result.source}")
            best_engine, best_bare = min(best_engine, t1 - t0), min(best_bare, t2 - t1)
        engine_ms += best_engine * 1000
        bare_ms += best_bare * 1000
    return {
        "queries": len(sample), "cap": cap,
        "engine_rank_ms": round(engine_ms, 3), "bare_cached_forward_ms": round(bare_ms, 3),
        "engine_over_bare_ratio": round(engine_ms / bare_ms, 4) if bare_ms else None,
    }


# --- report ------------------------------------------------------------------------------------


def _ratio(a: float, b: float) -> float | None:
    return round(a / b, 3) if b > 0 else None


def markdown_table(result: dict) -> str:
    s = result["settings"]
    lines = [
        f"SLO: ranking P99 ≤ {s['slo_ms']:g} ms; {s['instances']} instance(s) × {s['threads_per_instance']} "
        f"thread(s); reference load {s['ref_qps']:g} QPS; throughput measured at prefix cap "
        f"{result['common_cap']} (baseline's max sequence length).",
        "",
        "| mode | max seq len @ SLO | SLO throughput (QPS) | P50 ms | P99 ms | P999 ms | HBM hit | DRAM hit "
        "| in-flight join | miss | pre-infer admitted / refused | missed deadline | peak HBM / budget (MB) "
        "| peak DRAM / budget (MB) |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|---:|---:|---:|",
    ]

    def fmt(x, spec=".1f"):
        return "–" if x is None else format(x, spec)

    def pct(x):
        return "–" if x is None else f"{100 * x:.0f} %"

    mb = 2 ** 20
    for name, m in result["modes"].items():
        r = m["reference"] or {}
        refused = r.get("preinfer", {}).get("refused", {})
        refused_text = ", ".join(f"{k} {v}" for k, v in sorted(refused.items())) or "0"
        pre = r.get("preinfer", {})
        lines.append(
            f"| {name} | {m['max_seq_len_at_slo']} | {m['slo_throughput_qps']:g} | {fmt(r.get('p50_ms'))} "
            f"| {fmt(r.get('p99_ms'))} | {fmt(r.get('p999_ms'))} | {pct(r.get('hbm_hit_rate'))} "
            f"| {pct(r.get('dram_hit_rate'))} | {pct(r.get('inflight_join_rate'))} | {pct(r.get('miss_rate'))} "
            f"| {pre.get('admitted', 0)} / {refused_text} | {r.get('deadline_missed', 0)} "
            f"| {m['peak_hbm_bytes'] / mb:.0f} / {m['hbm_budget_bytes'] / mb:.0f} "
            f"| {m['peak_dram_bytes'] / mb:.0f} / {m['dram_budget_bytes'] / mb:.0f} |"
        )
    ratios, overhead, host = result["ratios"], result["overhead"], result["host"]
    lines += [
        "",
        f"relay ÷ baseline: SLO throughput ×{fmt(ratios['slo_throughput'], '.2f')}, "
        f"max sequence length ×{fmt(ratios['max_seq_len'], '.2f')}. "
        f"Engine rank ÷ bare cached forward: {fmt(overhead['engine_over_bare_ratio'], '.3f')}.",
        f"Host: {host['cpus']} cores, load average {host['load_avg_start'][0]:.1f} → {host['load_avg_end'][0]:.1f}; "
        f"a busy thread got {host['cpu_share_start']:.0%} → {host['cpu_share_end']:.0%} of a core"
        + (" (contended: other work shared the cores, latencies are inflated)"
           if min(host["cpu_share_start"], host["cpu_share_end"]) < 0.8 else "") + ".",
    ]
    return "\n".join(lines)


def cpu_share(seconds: float = 0.5) -> float:
    """Share of one core this thread gets while busy (CPU time ÷ wall time): near 1 on an idle
    machine; well below it when other work competes for the cores and the figures are not clean."""
    a = torch.randn(256, 256)
    wall0, cpu0 = time.perf_counter(), time.thread_time()
    while time.perf_counter() - wall0 < seconds:
        a = torch.tanh(a @ a)
    return round((time.thread_time() - cpu0) / (time.perf_counter() - wall0), 3)


def run(settings: BenchSettings, queries: list[TraceQuery], trace_name: str, out: Path,
        modes: Sequence[Mode] = MODES) -> dict:
    started = time.monotonic()
    load_start = os.getloadavg()
    torch.set_num_threads(settings.threads_per_instance)
    share_start = cpu_share()
    calib_model = HSTUModel(settings.model)
    short_len = int(np.median([q.short_len for q in queries]))
    n_cands = int(np.median([q.n_candidates for q in queries]))
    latency_model, calibration = fit_latency_model(calib_model, (128, 256, 512, 1024), short_len, n_cands,
                                                   settings.seed)
    at_risk = latency_model.at_risk_seq_len(settings.slo_ms * settings.at_risk_fraction)
    fleet = Fleet(settings)
    per_mode = (2 if settings.initial_warmup_queries else 1) + math.ceil(math.log2(len(settings.caps) + 1)) \
        + 1 + math.ceil(math.log2(len(settings.qps_steps) + 1))
    progress = tqdm(total=per_mode * len(modes), unit="probe", file=sys.stderr, dynamic_ncols=True)
    runner = Runner(settings, queries, fleet, progress, at_risk)
    results: dict[str, dict] = {}
    try:
        baseline = next(m for m in modes if not m.relay)
        results[baseline.name] = runner.run_mode(baseline)
        # Throughput compares at the baseline's max sequence length (its smallest cap if none passed).
        common_cap = results[baseline.name]["max_seq_len_at_slo"] or settings.caps[0]
        results[baseline.name] = runner.run_throughput(baseline, results[baseline.name], common_cap)
        for mode in modes:
            if mode.relay:
                results[mode.name] = runner.run_throughput(mode, runner.run_mode(mode), common_cap)
    finally:
        progress.close()
        fleet.close()
    overhead = measure_overhead(settings, queries, common_cap, at_risk)
    base, relay = results["baseline"], results.get("relay")
    result = {
        "settings": {**{k: v for k, v in asdict(settings).items() if k != "model"},
                     "model": asdict(settings.model), "model_version": fleet.model_version},
        "trace": {"source": trace_name, "queries": len(queries), "qps": round(trace_qps(queries), 3),
                  "summary": describe(queries, trace_name), "wrapped": runner.wrapped},
        "host": {"cpus": os.cpu_count(), "load_avg_start": [round(x, 2) for x in load_start],
                 "load_avg_end": [round(x, 2) for x in os.getloadavg()], "torch": torch.__version__,
                 "cpu_share_start": share_start, "cpu_share_end": cpu_share()},
        "calibration": {"rank_full_ms": {str(k): round(v, 2) for k, v in calibration.items()},
                        "latency_model": asdict(latency_model), "at_risk_seq_len": at_risk},
        "common_cap": common_cap,
        "modes": results,
        "ratios": {
            "slo_throughput": None if relay is None else _ratio(relay["slo_throughput_qps"],
                                                                base["slo_throughput_qps"]),
            "max_seq_len": None if relay is None else _ratio(relay["max_seq_len_at_slo"],
                                                             base["max_seq_len_at_slo"]),
        },
        "overhead": overhead,
        "runtime_s": 0.0,
    }
    result["runtime_s"] = round(time.monotonic() - started, 1)
    result["markdown"] = markdown_table(result)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m relay_engine.bench", description=__doc__.split("\n\n")[0])
    parser.add_argument("--trace", help="trace file (JSON Lines); default: the default generated trace")
    parser.add_argument("--slo-ms", type=float, default=BenchSettings.slo_ms, help="ranking P99 SLO")
    parser.add_argument("--instances", type=int, default=None,
                        help="engine instances (processes); default 2, or 1 on a single core")
    parser.add_argument("--ref-qps", type=float, default=None, help="reference load for the sequence-length sweep")
    parser.add_argument("--deadline-ms", type=float, default=None, help="ranking deadline after arrival "
                                                                       "(default: twice the SLO)")
    parser.add_argument("--timestamps", action="store_true", help="give tokens timestamps (time-bucket bias)")
    parser.add_argument("--out", default="artifacts/bench.json", help="output JSON")
    parser.add_argument("--quick", action="store_true", help="small model, short probes (about a minute)")
    args = parser.parse_args(argv)

    cores = os.cpu_count() or 1
    instances = args.instances if args.instances is not None else min(2, cores)
    if instances < 1 or instances > cores:
        parser.error(f"--instances must be between 1 and the machine's {cores} cores, got {instances}")
    if not (args.slo_ms > 0 and math.isfinite(args.slo_ms)):
        parser.error(f"--slo-ms must be a positive number, got {args.slo_ms}")
    settings = BenchSettings(slo_ms=args.slo_ms, instances=instances, threads_per_instance=max(1, cores // instances),
                             deadline_ms=args.deadline_ms or 2 * args.slo_ms, with_timestamps=args.timestamps)
    if args.quick:
        settings = quick_settings(settings)
    if args.ref_qps is not None:
        settings = replace(settings, ref_qps=args.ref_qps)
    if args.trace:
        try:
            queries = read_trace(args.trace)
        except (TraceError, OSError) as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
        if len(queries) < 2:
            print(f"error: {args.trace}: a trace needs at least 2 queries, got {len(queries)}", file=sys.stderr)
            return 2
        name = args.trace
    else:
        spec = TraceSpec(queries=3_000) if args.quick else TraceSpec()
        queries, name = generate_trace(spec), f"generated: {spec}"
    result = run(settings, queries, name, Path(args.out))
    print(result["markdown"])
    print(f"\nwrote {args.out} in {result['runtime_s']:.0f} s")
    return 0
