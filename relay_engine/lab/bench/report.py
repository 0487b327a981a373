"""The benchmark's report: a Markdown table per mode with intervals, PNG plots, the JSON file."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from relay_engine.lab.bench.stats import TIER_OUTCOMES

MiB = 2**20


def _fmt(x, spec: str = ".1f") -> str:
    return "–" if x is None else format(x, spec)


_END_MARKS = {"exact": "", "at most": "≤", "at least": "≥"}


def _ci(ci, spec: str = ".1f", ends=None) -> str:
    """An interval; an end that is a bound (replicates that never crossed) is marked ≤ or ≥."""
    if not ci:
        return ""
    lo, hi = (_END_MARKS[e] for e in ends) if ends else ("", "")
    return f" [{lo}{format(ci[0], spec)}, {hi}{format(ci[1], spec)}]"


def _pct(x) -> str:
    return "–" if x is None else f"{100 * x:.0f} %"


def markdown(result: dict) -> str:
    reg, ts, k = result["regime"], result["time_scale"], result["time_scale"]["time_scale"]
    cap = result["common_cap"]
    lines = [
        f"Measured on {result.get('fleet_what', 'the lab fleet')}.",
        "",
        f"Time scale K = {k:g} ({ts['how']}). On this machine: SLO {reg['slo_ms']:.0f} ms "
        f"(reference {reg['slo_ms_unscaled']:g} ms), deadline {reg['deadline_ms']:.0f} ms, reference load "
        f"{reg['ref_qps']:g} QPS here (= {reg['ref_qps_unscaled']:g} QPS on the reference device). "
        f"Each point: {result['windows']['measured_per_point']} measured ranking requests over "
        f"{result['windows']['count']} paired windows; P99 with a bootstrap 95 % interval.",
        "",
        f"| mode | max seq len @ SLO | SLO throughput @ cap {cap} (QPS here / reference) | P99 there (ms) [95 % CI] "
        f"| P99 unscaled (ms) | hit ratio ({' / '.join(t.upper() for t in TIER_OUTCOMES)} / in flight) | miss "
        "| pre-infer admitted / refused "
        + "".join(f"| peak {t.upper()} / budget (MiB) " for t in TIER_OUTCOMES) + "|",
        "|---|---:|---:|---:|---:|---|---:|---|" + "---:|" * len(TIER_OUTCOMES),
    ]
    # The product path's tier peaks stay in the workers' telemetry: not 0, unknown here. (Its admissions
    # are read back from the workers' counters: ``product.ProductFleet.admissions_between``.)
    from_workers = result.get("fleet") == "product"
    for name, m in result["modes"].items():
        r = m.get("reference") or {}
        pre = r.get("preinfer", {})
        refused = ", ".join(f"{key} {v}" for key, v in sorted(pre.get("refused", {}).items())) or "0"
        admissions = f"{pre.get('admitted', 0)} / {refused}"
        thr = "–" if m["slo_throughput_qps"] is None else \
            f"{m['slo_throughput_qps']:g} / {m['slo_throughput_qps_unscaled']:g}"
        lines.append(
            f"| {name} | {_fmt(m['max_seq_len_at_slo'], 'd') if m['max_seq_len_at_slo'] is not None else '–'} "
            f"| {thr} | {_fmt(r.get('p99_ms'))}{_ci(r.get('p99_ci_ms'))} | {_fmt(r.get('p99_ms_unscaled'), '.2f')} "
            f"| {' / '.join(_pct(r.get(f'{t}_hit_rate')) for t in TIER_OUTCOMES)} / {_pct(r.get('inflight_join_rate'))} "
            f"| {_pct(r.get('miss_rate'))} | {admissions} "
            + "".join("| – " if from_workers else
                      f"| {r.get(f'{t}_peak_bytes', 0) / MiB:.0f} / {r.get(f'{t}_budget_bytes', 0) / MiB:.0f} "
                      for t in TIER_OUTCOMES) + "|")
    ratios, overhead = result["ratios"], result["overhead"]
    lines += [
        "",
        f"relay ÷ baseline: SLO throughput {_ratio(ratios, 'slo_throughput')} (at cap {cap}), "
        f"max sequence length {_ratio(ratios, 'max_seq_len')} "
        f"(crossings interpolated between the last passing and first failing point; grid values "
        f"×{_fmt(ratios.get('slo_throughput_grid'), '.2f')} and ×{_fmt(ratios.get('max_seq_len_grid'), '.2f')}). "
        f"Engine rank ÷ bare cached forward: {_fmt(overhead['engine_over_bare_ratio'], '.3f')}.",
    ]
    if ratios.get("bound") is not None:
        head = ratios["by_cap"][str(cap)]
        lines.append(
            f"Compute bound at cap {cap}: ×{head['bound']:.2f} (full rank {head['full_ms']:.1f} ms ÷ (cached rank "
            f"{head['cached_ms']:.1f} ms + {100 * head['prefill_share']:.0f} % of requests × prefill "
            f"{head['prefill_ms']:.1f} ms)); the measured ratio is {_pct(ratios.get('efficiency'))} of it.")
    for name, m in result["modes"].items():
        vs = m.get("throughput_vs")
        if vs:
            lines.append(f"{name} ÷ {vs['mode']}: SLO throughput ×{_fmt(vs['ratio'], '.2f')}"
                         f"{_ci(vs['ci'], '.2f', vs['ci_ends'])} "
                         f"(at cap {cap}, the same windows).")
    busy = [(name, p) for name, m in result["modes"].items() for sw in m["sweeps"].values() for p in sw["points"]
            if p["host"].get("busy")]
    redone = sum(p["redone"] for m in result["modes"].values() for sw in m["sweeps"].values() for p in sw["points"])
    lines.append(f"Contention: {redone} point(s) measured again because the host was busy; "
                 f"{len(busy)} still busy after {result['settings']['max_redo']} retries"
                 + (" (their figures are inflated)." if busy else "."))
    by_cap = result["modes"].get("relay", {}).get("throughput_by_cap", {})
    if len(by_cap) > 1:
        lines += ["", "| cap | baseline SLO throughput (QPS) | relay SLO throughput (QPS) | relay ÷ baseline "
                  "| compute bound | efficiency |", "|---:|---:|---:|---:|---:|---:|"]
        base = result["modes"]["baseline"]["throughput_by_cap"]
        for c in sorted(by_cap, key=int):
            b, r, q = base.get(c, {}), by_cap[c], ratios.get("by_cap", {}).get(c, {})
            lines.append(f"| {c} | {_fmt(b.get('best_passing'), 'g')} (crossing {_fmt(b.get('crossing'), '.1f')}"
                         f"{_ci(b.get('crossing_ci'))}) | {_fmt(r.get('best_passing'), 'g')} (crossing "
                         f"{_fmt(r.get('crossing'), '.1f')}{_ci(r.get('crossing_ci'))}) "
                         f"| ×{_fmt(q.get('ratio'), '.2f')}{_ci(q.get('ci'), '.2f', q.get('ci_ends'))} "
                         f"| ×{_fmt(q.get('bound'), '.2f')} "
                         f"| {_pct(q.get('efficiency'))} |")
    if "fleets" in result:
        lines += ["", "Both fleets, side by side on the same windows (the product path's ratio is the headline):", "",
                  "| fleet | relay ÷ baseline SLO throughput | at cap | relay ÷ baseline max seq len | compute bound "
                  "| efficiency |", "|---|---:|---:|---:|---:|---:|"]
        for name, f in result["fleets"].items():
            r = f["ratios"]
            lines.append(f"| {name}{' (headline)' if f['headline'] else ''} | {_ratio(r, 'slo_throughput')} "
                         f"| {f['common_cap']} | {_ratio(r, 'max_seq_len')} | ×{_fmt(r.get('bound'), '.2f')} "
                         f"| {_pct(r.get('efficiency'))} |")
    return "\n".join(lines)


def _ratio(ratios: dict, key: str) -> str:
    """A relay ÷ baseline ratio of ``ratios`` with its interval (``slo_throughput``, ``max_seq_len``)."""
    return f"×{_fmt(ratios.get(key), '.2f')}{_ci(ratios.get(f'{key}_ci'), '.2f', ratios.get(f'{key}_ci_ends'))}"


def plots(result: dict, directory: Path) -> list[str]:
    """P99 against offered load (at the headline cap) and against the prefix cap (at the reference
    load), every measured point with its interval and the SLO line. Returns the files written."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    directory.mkdir(parents=True, exist_ok=True)
    slo, k = result["regime"]["slo_ms"], result["time_scale"]["time_scale"]
    cap = result["common_cap"]
    written = []
    for key, xlabel, name, title in (
        (f"qps@{cap}", "offered load (QPS on this machine)", "bench-p99-vs-load.png",
         f"ranking P99 against offered load, prefix cap {cap} (K = {k:.3g})"),
        ("cap", "prefix cap (tokens)", "bench-p99-vs-cap.png",
         f"ranking P99 against prefix cap at {result['regime']['ref_qps']:g} QPS (K = {k:.3g})"),
    ):
        fig, ax = plt.subplots(figsize=(7, 4.5))
        drawn = False
        for mode, m in result["modes"].items():
            sw = m["sweeps"].get(key)
            if not sw or not sw["points"]:
                continue
            pts = [p for p in sw["points"] if p["p99_ms"] is not None]
            xs = np.array([p["qps"] if key != "cap" else p["cap"] for p in pts], dtype=float)
            ys = np.array([p["p99_ms"] for p in pts])
            lo = np.array([(p["p99_ci_ms"] or [p["p99_ms"]] * 2)[0] for p in pts])
            hi = np.array([(p["p99_ci_ms"] or [p["p99_ms"]] * 2)[1] for p in pts])
            ax.errorbar(xs, ys, yerr=[np.maximum(0, ys - lo), np.maximum(0, hi - ys)], marker="o", capsize=3, label=mode)
            drawn = True
        if not drawn:
            plt.close(fig)
            continue
        ax.axhline(slo, color="k", linestyle="--", linewidth=1, label=f"SLO {slo:.0f} ms")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel(xlabel)
        ax.set_ylabel("P99 ranking latency (ms, this machine)")
        ax.set_title(title, fontsize=10)
        ax.legend(fontsize=8)
        fig.tight_layout()
        path = directory / name
        fig.savefig(path, dpi=120)
        plt.close(fig)
        written.append(str(path))
    return written


def write_json(path: Path, result: dict) -> None:
    path.write_text(json.dumps(result, indent=2, default=_plain) + "\n", encoding="utf-8")


def _plain(value):
    if isinstance(value, np.generic):
        return value.item()
    raise TypeError(f"not JSON serialisable: {type(value).__name__}")
