"""A preview replayed request by request against what the pool's instances measured.

    python -m relay_engine.sim decompose KEPT_DIR [--seed 0] [--out F]

A preview run with ``RELAYGR_PREVIEW_KEEP_DIR`` set keeps what it replayed (``preview-<id>/``: the
trace, the specs, the pool's forward times, the simulator's command, and ``capture.jsonl``, the
captured records in the trace's order with each request's outcome, latency and instance). This
replays the live spec on that trace as the preview did, and sets every measured request beside its
captured record: where the two disagree on the outcome (a hit in one, a miss or a deadline in the
other), how their latencies compare by outcome and by prefix length, which requests make each side's
tail, and where the simulated time went — queued before a rank thread, the forwards' own time, the
time lost sharing the compute, and the waits on computations in flight. The captured latency starts
when a rank thread took the request (``engine.rank``); the simulated one when it reached the
instance, so its queueing is shown apart.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from relay_engine.core.capture import SERVED_OUTCOMES, CaptureError, CaptureRecord
from relay_engine.core.config import PolicySpec
from relay_engine.core.trace import TraceQuery
from relay_engine.lab.bench.stats import RANKED, quantile
from relay_engine.lab.costmodel import CostModel
from relay_engine.lab.sim.fleet import instance_names
from relay_engine.lab.sim.preview import (
    HostBackground,
    host_background,
    preview_fleet,
    preview_routing,
    replay_plan,
    replay_trace,
)

LENGTH_BUCKETS = (0, 512, 1024, 2048, 4096)
SIM_DEADLINE = "deadline"


class KeptError(ValueError):
    pass


@dataclass(frozen=True)
class Row:
    """One measured ranking request: as captured, and as the simulator replayed it."""

    query: int  # index in the kept trace (and line of capture.jsonl)
    prefix_len: int
    real_outcome: str
    real_ms: float
    real_instance: str
    sim_outcome: str
    sim_ms: float
    sim_instance: str
    queued_ms: float  # simulated: before a rank thread took it
    work_ms: float  # simulated: its forwards' own time (alone on a core)
    forward_ms: float  # simulated: the time its forwards took on the shared compute
    real_reason: str = ""  # a miss's reason, as captured
    sim_reason: str = ""  # a miss's reason, as simulated
    real_cpu_ms: float | None = None  # captured: the rank's own CPU time, where the instance recorded it
    real_signal_delay_ms: float | None = None  # captured: its signal's sender → the trigger's decision

    @property
    def real_served(self) -> bool:
        return self.real_outcome in SERVED_OUTCOMES

    @property
    def sim_served(self) -> bool:
        return self.sim_outcome in RANKED

    @property
    def shared_ms(self) -> float:  # time lost to other work on the compute
        return max(0.0, self.forward_ms - self.work_ms)

    @property
    def waited_ms(self) -> float:  # the rest: waits on a computation in flight, the ranking gate
        return max(0.0, self.sim_ms - self.queued_ms - self.forward_ms)


def read_capture(path: Path) -> list[CaptureRecord]:
    records = []
    with path.open(encoding="utf-8") as lines:
        for n, line in enumerate(lines, 1):
            try:
                records.append(CaptureRecord.from_fields(json.loads(line)))
            except (CaptureError, json.JSONDecodeError, TypeError, AttributeError) as exc:
                raise KeptError(f"{path}, line {n}: {exc}") from None
    return records


def replay_rows(queries: Sequence[TraceQuery], records: Sequence[CaptureRecord], live: PolicySpec, cost: CostModel,
                *, instances: int, rank_threads: int, host: tuple[int, float], max_requests: int,
                warmup_requests: int, seed: int = 0, routing: str | None = None,
                pool_sharing: float | None = None) -> tuple[list[Row], HostBackground]:
    """The live spec replayed as its preview replays it (``routing``: as a preview routes, unless given:
    ``FleetSpec.routing``; the host's other processes as ``host_background`` finds them from
    ``pool_sharing``); a row per measured request, and the background it was replayed with."""
    if len(queries) != len(records) or any((q.user_id, q.seq_len) != (r.user, r.prefix_len)
                                           for q, r in zip(queries, records, strict=False)):
        raise KeptError(f"the trace holds {len(queries)} queries and the capture {len(records)} records: "
                        f"they must be the same requests in the same order")
    plan = replay_plan(queries, cost, max_requests=max_requests, warmup_requests=warmup_requests)
    offset = len(queries) - len(plan.replayed)
    background = host_background(plan.replayed, live, instances, cost, pool_sharing=pool_sharing,
                                 rank_threads=rank_threads, host=host, cap=plan.cap, shares=plan.shares)
    fleet = preview_fleet(live, instances, cost, slo_ms=live.trigger.ranking_p99_slo_ms, rank_threads=rank_threads,
                          host=host, routing=routing or preview_routing(plan.replayed, instances)[0],
                          background=background.share)
    reports = replay_trace(plan.replayed, fleet, cost, cap=plan.cap, prime_share=plan.shares[0],
                           warmup_share=plan.shares[1], seed=seed)
    rows = []
    for name, report in zip(instance_names(instances), reports, strict=True):
        for (query, ms, outcome, measured), (_, queued, work, forward, reason) in zip(report.ranks, report.detail,
                                                                                      strict=True):
            if not measured:
                continue
            record = records[offset + query]
            rows.append(Row(offset + query, record.prefix_len, record.outcome, record.latency_ms, record.instance,
                            outcome, ms, name, queued, work, forward, record.miss_reason, reason, record.cpu_ms,
                            record.signal_delay_ms))
    return sorted(rows, key=lambda r: r.query), background


def _figures(latencies: np.ndarray, served: np.ndarray, slo_ms: float, hits: int, deadline: int, n: int) -> dict:
    return {"requests": n, "served": int(served.size), "p50_ms": quantile(served, 0.5), "p90_ms": quantile(served, 0.9),
            "p99_ms": quantile(served, 0.99), "max_ms": float(served.max()) if served.size else None,
            "within_slo_share": float((served <= slo_ms).sum() / n) if n else None,
            "hit_ratio": hits / served.size if served.size else None, "deadline_missed": deadline,
            "all_p99_ms": quantile(latencies, 0.99)}


def summarize(rows: Sequence[Row], slo_ms: float, slowest: int = 15) -> dict:
    """The figures of both sides, their outcomes against each other, latency by outcome and by length,
    the simulated time's parts, each side's slowest requests, and the load per instance."""
    real_served = np.array([r.real_ms for r in rows if r.real_served])
    sim_served = np.array([r.sim_ms for r in rows if r.sim_served])
    real = _figures(np.array([r.real_ms for r in rows]), real_served, slo_ms,
                    sum(r.real_served and r.real_outcome != "miss" for r in rows),
                    sum(not r.real_served for r in rows), len(rows))
    sim = _figures(np.array([r.sim_ms for r in rows]), sim_served, slo_ms,
                   sum(r.sim_served and r.sim_outcome != "miss" for r in rows),
                   sum(r.sim_outcome == SIM_DEADLINE for r in rows), len(rows))
    outcomes = Counter((_labelled(r.real_outcome, r.real_reason), _labelled(r.sim_outcome, r.sim_reason)) for r in rows)

    def side_by_side(group: list[Row]) -> dict:
        a = np.array([r.real_ms for r in group if r.real_served])
        b = np.array([r.sim_ms for r in group if r.sim_served])
        return {"requests": len(group), "real_p50_ms": quantile(a, 0.5), "sim_p50_ms": quantile(b, 0.5),
                "real_p99_ms": quantile(a, 0.99), "sim_p99_ms": quantile(b, 0.99)}

    by_outcome = {o: side_by_side([r for r in rows if r.real_outcome == o])
                  for o in sorted({r.real_outcome for r in rows})}
    by_length = {}
    for lo, hi in zip(LENGTH_BUCKETS, (*LENGTH_BUCKETS[1:], None), strict=True):
        group = [r for r in rows if r.prefix_len >= lo and (hi is None or r.prefix_len < hi)]
        if group:
            by_length[f"{lo}–{hi - 1}" if hi else f"≥{lo}"] = side_by_side(group)

    def parts(group: list[Row]) -> dict:
        if not group:
            return {"requests": 0}
        return {"requests": len(group), "latency_ms": float(np.mean([r.sim_ms for r in group])),
                "queued_ms": float(np.mean([r.queued_ms for r in group])),
                "work_ms": float(np.mean([r.work_ms for r in group])),
                "shared_ms": float(np.mean([r.shared_ms for r in group])),
                "waited_ms": float(np.mean([r.waited_ms for r in group]))}

    served = [r for r in rows if r.sim_served]
    sim_p99 = sim["p99_ms"]
    real_p99 = real["p99_ms"]
    real_tail = [r for r in rows if real_p99 is not None and r.real_served and r.real_ms >= real_p99]
    decomposition = {"all": parts(served),
                     "sim_tail": parts([r for r in served if sim_p99 is not None and r.sim_ms >= sim_p99]),
                     "real_tail": parts([r for r in real_tail if r.sim_served])}

    def captured_parts(group: list[Row]) -> dict:
        timed = [r for r in group if r.real_cpu_ms is not None]
        if not timed:
            return {"requests": 0}
        return {"requests": len(timed), "latency_ms": float(np.mean([r.real_ms for r in timed])),
                "work_ms": float(np.mean([r.real_cpu_ms for r in timed])),
                "waited_ms": float(np.mean([max(0.0, r.real_ms - r.real_cpu_ms) for r in timed]))}

    delays = np.array([r.real_signal_delay_ms for r in rows if r.real_signal_delay_ms is not None])
    captured_time = {"all": captured_parts([r for r in rows if r.real_served]), "real_tail": captured_parts(real_tail),
                     "signal_delay_ms": {"requests": int(delays.size), "p50": quantile(delays, 0.5),
                                         "p99": quantile(delays, 0.99),
                                         "max": float(delays.max()) if delays.size else None}}
    instances = {"real": _per_instance([(r.real_instance, r.real_ms, r.real_served) for r in rows]),
                 "sim": _per_instance([(r.sim_instance, r.sim_ms, r.sim_served) for r in rows])}
    return {"slo_ms": slo_ms, "real": real, "sim": sim,
            "outcomes": [{"real": a, "sim": b, "requests": n} for (a, b), n in sorted(outcomes.items())],
            "by_real_outcome": by_outcome, "by_prefix_len": by_length, "sim_time": decomposition,
            "captured_time": captured_time,
            "instances": instances,
            "slowest_real": [asdict(r) for r in sorted((r for r in rows if r.real_served), key=lambda r: -r.real_ms)[:slowest]],
            "slowest_sim": [asdict(r) for r in sorted((r for r in rows if r.sim_served), key=lambda r: -r.sim_ms)[:slowest]]}


def _labelled(outcome: str, reason: str) -> str:
    return f"{outcome} ({reason})" if reason else outcome


def _per_instance(triples: list[tuple[str, float, bool]]) -> dict:
    out = {}
    for name in sorted({t[0] for t in triples}):
        served = np.array([ms for n, ms, ok in triples if n == name and ok])
        out[name or "?"] = {"requests": sum(1 for t in triples if t[0] == name), "p99_ms": quantile(served, 0.99)}
    return out


def _ms(v: float | None) -> str:
    return "–" if v is None else f"{v:.1f}"


def _pct(v: float | None) -> str:
    return "–" if v is None else f"{100 * v:.2f} %"


def table(report: dict) -> str:
    real, sim = report["real"], report["sim"]
    lines = [f"{real['requests']} measured requests (SLO {report['slo_ms']:g} ms)", "",
             "| figure | captured | simulated |", "|---|---:|---:|"]
    for key, label, show in (("p50_ms", "P50 served (ms)", _ms), ("p90_ms", "P90 served", _ms),
                             ("p99_ms", "P99 served", _ms), ("max_ms", "max served", _ms),
                             ("within_slo_share", "within SLO", _pct), ("hit_ratio", "hit ratio", _pct),
                             ("deadline_missed", "past the deadline", str)):
        lines.append(f"| {label} | {show(real[key])} | {show(sim[key])} |")
    lines += ["", "Outcomes, captured → simulated:", "| captured | simulated | requests |", "|---|---|---:|"]
    lines += [f"| {o['real']} | {o['sim']} | {o['requests']} |" for o in report["outcomes"]]
    for title, key, label in (("By the captured outcome", "by_real_outcome", "outcome"),
                              ("By prefix length", "by_prefix_len", "tokens")):
        lines += ["", f"{title} (served requests' latency, ms):",
                  f"| {label} | requests | P50 captured / simulated | P99 captured / simulated |", "|---|---:|---:|---:|"]
        for name, g in report[key].items():
            lines.append(f"| {name} | {g['requests']} | {_ms(g['real_p50_ms'])} / {_ms(g['sim_p50_ms'])} | "
                         f"{_ms(g['real_p99_ms'])} / {_ms(g['sim_p99_ms'])} |")
    lines += ["", "Where the simulated time went (means, ms):",
              "| requests | n | latency | queued | forwards alone | lost sharing | waits in flight |",
              "|---|---:|---:|---:|---:|---:|---:|"]
    for name, label in (("all", "every served"), ("sim_tail", "the simulated tail (≥ its P99)"),
                        ("real_tail", "the captured tail (≥ its P99)")):
        p = report["sim_time"][name]
        if p["requests"]:
            lines.append(f"| {label} | {p['requests']} | {_ms(p['latency_ms'])} | {_ms(p['queued_ms'])} | "
                         f"{_ms(p['work_ms'])} | {_ms(p['shared_ms'])} | {_ms(p['waited_ms'])} |")
    captured = report.get("captured_time") or {}
    if (captured.get("all") or {}).get("requests"):
        lines += ["", "Where the captured time went (means, ms; the rank's own CPU time, the rest waiting):",
                  "| requests | n | latency | CPU | waits |", "|---|---:|---:|---:|---:|"]
        for name, label in (("all", "every served"), ("real_tail", "the captured tail (≥ its P99)")):
            p = captured[name]
            if p["requests"]:
                lines.append(f"| {label} | {p['requests']} | {_ms(p['latency_ms'])} | {_ms(p['work_ms'])} | "
                             f"{_ms(p['waited_ms'])} |")
    delay = captured.get("signal_delay_ms") or {}
    if delay.get("requests"):
        lines.append(f"\nPre-infer signals, sender → the trigger's decision ({delay['requests']} requests): "
                     f"P50 {_ms(delay['p50'])} ms, P99 {_ms(delay['p99'])} ms, max {_ms(delay['max'])} ms.")
    lines += ["", "Per instance (requests, P99 served ms): captured "
              + ", ".join(f"{n} {v['requests']} / {_ms(v['p99_ms'])}" for n, v in report["instances"]["real"].items())
              + "; simulated "
              + ", ".join(f"{n} {v['requests']} / {_ms(v['p99_ms'])}" for n, v in report["instances"]["sim"].items())]
    for key, title in (("slowest_real", "The captured side's slowest"), ("slowest_sim", "The simulated side's slowest")):
        lines += ["", f"{title}:", "| query | tokens | captured | simulated | queued | alone | sharing | waits |",
                  "|---:|---:|---|---|---:|---:|---:|---:|"]
        for r in report[key]:
            row = Row(**r)
            cpu = "" if row.real_cpu_ms is None else f" (CPU {_ms(row.real_cpu_ms)})"
            lines.append(f"| {row.query} | {row.prefix_len} | {_labelled(row.real_outcome, row.real_reason)} "
                         f"{_ms(row.real_ms)}{cpu} | {_labelled(row.sim_outcome, row.sim_reason)} {_ms(row.sim_ms)} | "
                         f"{_ms(row.queued_ms)} | {_ms(row.work_ms)} | "
                         f"{_ms(row.shared_ms)} | {_ms(row.waited_ms)} |")
    return "\n".join(lines)
