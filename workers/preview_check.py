"""How far to trust a what-if preview: predict a change on captured traffic, publish it, measure it.

    python -m workers.preview_check [--window 5m] [--change trigger|hbm|ttl|live|curve] [--windows N] [--at-risk-seq-len N] [--out F]
        [--keep DIR]                                   # each preview's inputs, for ``sim decompose``
        [--url URL --token KEY --pool NAME]          # a running stack (an operator's token)
        [--instances 2] [--rate 8] [--model default] [--device auto] [--warmup-s 60]   # else one started here

Against a running stack (or one it starts with ``workers.stack``, steady replayed traffic): waits
until the capture holds a full window of steady traffic, creates a revision with one change
(``--change``: ``trigger``, a stricter ``at_risk_seq_len``, twice the live one unless given; ``hbm``,
half the live HBM budget; ``ttl``, a quarter of the live cache entries' TTL), previews it on that window
(``POST …/revisions/{g}/preview/``), measures the same window from the capture (what the instances
recorded: P99, within-SLO share, hit ratio), publishes the revision, waits for the fleet to converge,
lets a whole window of traffic pass under it and measures that window the same way. Prints predicted
vs measured for the live and the proposed revision and writes them as JSON with ``--out``.
``--change live`` changes nothing: it previews the live revision on each of ``--windows`` successive
windows and measures each of them (how far the preview is from what the pool did, window by window).
``--change curve`` publishes nothing: it reads the pool's cache curve of one window
(``GET …/cache-curves/``) and sets it against the hit ratio the instances measured at the live budget,
and against the simulator's replay of the same window at half and twice the live HBM budget.

Measured figures are the instances' own ranking latencies (``engine.rank``, as the capture records
them) — the quantity the simulator predicts. The machine is shared: read the figures with that in mind.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

from relay_engine.core.config import parse_policy
from relay_engine.core.fields import argument
from relay_engine.core.lifetime import die_with_parent
from workers.embedded_redis import free_port

ROOT = Path(__file__).resolve().parent.parent
FIGURES = (("p99_ms", "P99 (ms)"), ("p50_ms", "P50 (ms)"), ("within_slo_share", "within SLO"),
           ("hit_ratio", "hit ratio"))
WINDOWS = {"1m": 60, "3m": 180, "5m": 300, "10m": 600, "15m": 900}


class Api:
    def __init__(self, url: str, token: str):
        self.url = url.rstrip("/")
        self.token = token

    def __call__(self, method: str, path: str, body: dict | None = None) -> dict:
        request = urllib.request.Request(
            self.url + path, method=method, data=None if body is None else json.dumps(body).encode(),
            headers={"Authorization": f"Token {self.token}", "Content-Type": "application/json",
                     "Accept": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=30) as response:
                return json.loads(response.read())
        except urllib.error.HTTPError as exc:
            raise SystemExit(f"{method} {path}: HTTP {exc.code}: {exc.read().decode(errors='replace')[:500]}") from None


stack_prefix = f"check-{os.getpid()}"  # the key prefix of a stack started here


def start_stack(args: argparse.Namespace, workdir: Path) -> tuple[subprocess.Popen, dict]:
    status = workdir / "status.json"
    log = (workdir / "stack.log").open("ab")
    process = subprocess.Popen(
        [sys.executable, "-m", "workers.stack", "--instances", str(args.instances), "--rate", repr(args.rate),
         "--model", args.model, "--device", args.device, "--port", str(free_port()), "--pool", "check",
         "--data-dir", str(workdir), "--status-file", str(status)],
        cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, process_group=0,
        preexec_fn=die_with_parent(),
        env={**os.environ, "RELAYGR_KEY_PREFIX": stack_prefix,
             **({"RELAYGR_PREVIEW_KEEP_DIR": str(args.keep.resolve())} if args.keep else {})})
    deadline = time.monotonic() + 600
    while not status.exists():
        if process.poll() is not None or time.monotonic() > deadline:
            raise SystemExit(f"the stack did not start; see {workdir / 'stack.log'}")
        time.sleep(1)
    return process, json.loads(status.read_text())


def stop_stack(process: subprocess.Popen) -> None:
    if process.poll() is None:
        os.killpg(process.pid, signal.SIGTERM)
        try:
            process.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()


def say(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def wait_converged(api: Api, pool: str, generation: int, timeout_s: float = 180.0) -> float:
    started = time.monotonic()
    while time.monotonic() - started < timeout_s:
        status = api("GET", f"/api/v1/pools/{pool}/status/")
        if status["converged"] and status["desired_generation"] == generation:
            return time.monotonic() - started
        time.sleep(1)
    raise SystemExit(f"the pool did not converge on generation {generation} within {timeout_s:.0f} s")


def measured_on(api: Api, pool: str, window: str, preview: dict) -> dict:
    """What the instances measured on the very window a preview replayed (its end is rounded down)."""
    return measured(api("GET", f"/api/v1/pools/{pool}/traffic/?window={window}&end={preview['result']['window_to']}"))


def measured(summary: dict) -> dict:
    return {"p99_ms": summary["latency_ms"]["p99"], "p99_interval_ms": summary["latency_ms"].get("p99_interval"),
            "p50_ms": summary["latency_ms"]["p50"], "within_slo_share": summary["within_slo_share"],
            "hit_ratio": summary["hit_ratio"], "requests": summary["requests"], "from": summary["from"],
            "to": summary["to"]}


CHANGES = ("trigger", "hbm", "ttl", "live", "curve")
CURVE_FACTORS = (0.5, 2.0)  # the HBM budgets, × the live one, at which the curve is checked against the simulator


def changed(spec: dict, change: str, at_risk_seq_len: int | None) -> tuple[dict, str, dict]:
    """The live spec with one change; the change in words; the changed field's value before and after."""
    policy = parse_policy(spec)
    if change == "trigger":
        field, section, before = "at_risk_seq_len", "trigger", policy.trigger.at_risk_seq_len
        after = at_risk_seq_len or 2 * before
    elif change == "hbm":
        field, section, before = "hbm_budget_mb", "cache", policy.cache.hbm_budget_mb
        after = before / 2
    else:
        field, section, before = "entry_ttl_ms", "cache", policy.cache.entry_ttl_ms
        after = max(1, before // 4)
    new = {**spec, section: {**(spec.get(section) or {}), field: after}}
    return new, f"{section}.{field} {before:g} → {after:g}", {"field": f"{section}.{field}", "live": before,
                                                               "proposed": after}


def previewed(api: Api, pool: str, generation: int, window: str) -> tuple[dict, float]:
    """The finished preview of ``generation`` on the window ending now, and the seconds it took."""
    preview = api("POST", f"/api/v1/pools/{pool}/revisions/{generation}/preview/", {"window": window})
    started = time.monotonic()
    while preview["status"] in ("queued", "running"):
        if time.monotonic() - started > 600:
            raise SystemExit(f"the preview did not finish in 10 min: {preview['url']}")
        time.sleep(2)
        preview = api("GET", preview["url"])
    if preview["status"] != "done":
        raise SystemExit(f"the preview failed: {preview['error']}")
    return preview, time.monotonic() - started


def check_live(api: Api, pool: str, window: str, windows: int) -> dict:
    """The live revision previewed on each of ``windows`` successive windows, beside what each measured."""
    window_s = WINDOWS[window]
    generation = api("GET", f"/api/v1/pools/{pool}/")["desired_generation"]
    rows = []
    for i in range(windows):
        say(f"window {i + 1} of {windows}: letting {window} of traffic into the capture")
        time.sleep(window_s + (end_step_s(window_s) + 1 if i == 0 else 0))
        preview, preview_s = previewed(api, pool, generation, window)
        measured_now = measured_on(api, pool, window, preview)
        live = preview["result"]["live"]
        rows.append({"predicted": {k: live[k] for k, _ in FIGURES} | {
                         "requests": live["requests"], "replicates": live.get("replicates", 1),
                         "p99_range_ms": live.get("p99_range_ms")},
                     "measured": measured_now, "preview_s": round(preview_s, 1), "preview_id": preview["id"],
                     "window_from": preview["result"]["window_from"], "window_to": preview["result"]["window_to"],
                     "profile": preview["result"]["profile"]["note"]})
        say(f"window {i + 1}: P99 predicted {live['p99_ms']} ms, measured {measured_now['p99_ms']} ms")
    return {"pool": pool, "window": window, "generation": generation, "windows": rows}


def _at(points: list[dict], budget_mb: float) -> float | None:
    """The curve's hit ratio at ``budget_mb``, interpolated linearly between its points; None outside them."""
    for a, b in zip(points, points[1:], strict=False):
        if a["budget_mb"] <= budget_mb <= b["budget_mb"]:
            span = b["budget_mb"] - a["budget_mb"]
            w = 0.0 if span == 0 else (budget_mb - a["budget_mb"]) / span
            return a["hit_ratio"] + w * (b["hit_ratio"] - a["hit_ratio"])
    return None


def save_capture(redis_url: str, prefix: str, pool: str, start_s: float, end_s: float, path: Path) -> int:
    """The captured records of [start_s, end_s] as they are in the stream (``CaptureRecord`` fields, with
    outcome and miss reason), one JSON object a line: for working out offline where a curve or a
    preview departs from what the instances did. Returns how many."""
    import redis

    from relay_engine.core.wire import PoolKeys

    client = redis.Redis.from_url(redis_url, decode_responses=True)
    entries = client.xrange(PoolKeys(pool, prefix=prefix).traffic, min=str(int(start_s * 1000)),
                            max=str(int(end_s * 1000)))
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as out:
        for entry_id, fields in entries:
            out.write(json.dumps({"id": entry_id, **fields}) + "\n")
    return len(entries)


def check_curve(api: Api, pool: str, window: str, keep: tuple[dict, Path] | None = None) -> dict:
    """The miss-ratio curve of one window against what the instances measured (at the live budget) and
    against the simulator's replay of the same window (at half and twice the live HBM budget). ``keep``:
    the stack's status and a file for the window's captured records."""
    say(f"letting a full {window} window of traffic into the capture")
    time.sleep(WINDOWS[window] + end_step_s(WINDOWS[window]) + 1)
    state = api("GET", f"/api/v1/pools/{pool}/")
    live = api("GET", f"/api/v1/pools/{pool}/revisions/{state['desired_generation']}/")
    live_mb = parse_policy(live["spec"]).cache.hbm_budget_mb
    previews = []
    for factor in CURVE_FACTORS:
        spec = {**live["spec"], "cache": {**(live["spec"].get("cache") or {}), "hbm_budget_mb": live_mb * factor}}
        revision = api("POST", f"/api/v1/pools/{pool}/revisions/", {
            "parent_generation": api("GET", f"/api/v1/pools/{pool}/")["latest_generation"], "spec": spec,
            "comment": f"preview_check: the cache curve at {factor:g}× the HBM budget"})
        previews.append((factor, previewed(api, pool, revision["generation"], window)[0]))
    # The curve, the instances' figures and the simulator's replays on one window: the first preview's.
    end = previews[0][1]["result"]["window_to"]
    curves = api("GET", f"/api/v1/pools/{pool}/cache-curves/?window={window}&end={end}")
    if keep is not None:
        status, path = keep
        n = save_capture(status["redis_url"], status["key_prefix"], pool, curves["from"], curves["to"], path)
        say(f"{n} captured records of the window written to {path}")
    measured_now = measured_on(api, pool, window, previews[0][1])
    rows = [{"factor": 1.0, "hbm_budget_mb": live_mb, "curve": curves["live"]["hit_ratio"],
             "measured": curves["measured_hit_ratio"], "simulated": None}]
    live_previews = []  # each preview's prediction for the live revision, on the same window
    for factor, preview in previews:
        if preview["result"]["window_to"] != end:
            say(f"note: the {factor:g}× preview replayed the window ending {preview['result']['window_to']}, not {end}")
        rows.append({"factor": factor, "hbm_budget_mb": live_mb * factor,
                     "curve": _at(curves["axes"]["hbm"], live_mb * factor), "measured": None,
                     "simulated": preview["result"]["proposed"]["hit_ratio"],
                     "simulated_live": preview["result"]["live"]["hit_ratio"]})
        say(f"{factor:g}× HBM: curve {rows[-1]['curve']}, simulator {rows[-1]['simulated']}")
        live_previews.append({k: preview["result"]["live"][k] for k, _ in FIGURES})
    return {"pool": pool, "window": window, "requests": curves["requests"], "sampling_rate": curves["sampling_rate"],
            "elapsed_ms": curves["elapsed_ms"], "error_points": curves["error_points"], "rows": rows,
            "measured": measured_now, "live_previews": live_previews}


def curve_table(report: dict) -> str:
    lines = [f"Cache curve of pool {report['pool']} on one {report['window']} window ({report['requests']} requests, "
             f"sampling rate {report['sampling_rate']:g}, computed in {report['elapsed_ms']:.0f} ms)",
             "| HBM budget | curve | measured | simulator | curve − other (points) |", "|---:|---:|---:|---:|---:|"]
    for row in report["rows"]:
        other = row["measured"] if row["measured"] is not None else row["simulated"]
        gap = None if other is None or row["curve"] is None else 100 * (row["curve"] - other)
        lines.append(f"| {row['hbm_budget_mb']:g} MiB ({row['factor']:g}×) | {_share(row['curve'])} | "
                     f"{_share(row['measured'])} | {_share(row['simulated'])} | "
                     f"{'–' if gap is None else f'{gap:+.2f}'} |")
    m = report.get("measured")
    seen = []
    for p in report.get("live_previews", []):
        if p in seen:  # each preview replays the live revision on the same window: usually the same figures
            continue
        seen.append(p)
        error = (p["p99_ms"] - m["p99_ms"]) / m["p99_ms"] if p["p99_ms"] is not None and m["p99_ms"] else None
        lines.append(f"\nThe live revision previewed on the same window: P99 {_ms(p['p99_ms'])} ms predicted, "
                     f"{_ms(m['p99_ms'])} measured ({'–' if error is None else f'{100 * error:+.0f} %'}); within SLO "
                     f"{_share(p['within_slo_share'])} / {_share(m['within_slo_share'])}; hit ratio "
                     f"{_share(p['hit_ratio'])} / {_share(m['hit_ratio'])}")
    return "\n".join(lines)


def within(predicted: float | None, measured: float | None, tolerance: float) -> bool:
    return predicted is not None and bool(measured) and abs(predicted - measured) / measured <= tolerance


def live_table(report: dict, tolerance: float = 0.25) -> str:
    lines = [f"Preview of the live revision (generation {report['generation']}) on pool {report['pool']}, "
             f"{len(report['windows'])} successive {report['window']} windows",
             "| window | requests | P99 predicted / measured (ms) | P99 error | replays (P99 range) | "
             "P50 predicted / measured | within SLO | hit ratio |",
             "|---:|---:|---:|---:|---:|---:|---:|---:|"]
    hits = 0
    for i, row in enumerate(report["windows"], 1):
        p, m = row["predicted"], row["measured"]
        error = (p["p99_ms"] - m["p99_ms"]) / m["p99_ms"] if p["p99_ms"] is not None and m["p99_ms"] else None
        hits += within(p["p99_ms"], m["p99_ms"], tolerance)
        spread = p.get("p99_range_ms")
        lines.append(
            f"| {i} | {m['requests']} | {_ms(p['p99_ms'])} / {_ms(m['p99_ms'])} | "
            f"{'–' if error is None else f'{100 * error:+.0f} %'} | {p['replicates']}"
            f"{'' if not spread else f' ({spread[0]:.1f}–{spread[1]:.1f})'} | "
            f"{_ms(p['p50_ms'])} / {_ms(m['p50_ms'])} | {_share(p['within_slo_share'])} / "
            f"{_share(m['within_slo_share'])} | {_share(p['hit_ratio'])} / {_share(m['hit_ratio'])} |")
    lines.append(f"\nP99 within ±{100 * tolerance:.0f} % of the measured in {hits} of {len(report['windows'])} windows.")
    intervals = [(i, row["measured"]) for i, row in enumerate(report["windows"], 1)
                 if row["measured"].get("p99_interval_ms")]
    if intervals:
        lines.append("Measured P99s' own 95 % intervals (the window's requests alone): " + "; ".join(
            f"window {i} {m['p99_interval_ms'][0]:.1f}–{m['p99_interval_ms'][1]:.1f}" for i, m in intervals) + ".")
    return "\n".join(lines)


def _ms(value: float | None) -> str:
    return "–" if value is None else f"{value:.1f}"


def _share(value: float | None) -> str:
    return "–" if value is None else f"{100 * value:.2f} %"


def check(api: Api, pool: str, window: str, at_risk_seq_len: int | None, change: str = "trigger") -> dict:
    window_s = WINDOWS[window]
    say(f"letting a full {window} window of traffic into the capture")
    time.sleep(window_s + end_step_s(window_s) + 1)
    state = api("GET", f"/api/v1/pools/{pool}/")
    live = api("GET", f"/api/v1/pools/{pool}/revisions/{state['desired_generation']}/")
    spec, words, values = changed(live["spec"], change, at_risk_seq_len)
    revision = api("POST", f"/api/v1/pools/{pool}/revisions/", {
        "parent_generation": state["latest_generation"], "spec": spec, "comment": f"preview_check: {words}"})
    say(f"previewing generation {revision['generation']} ({words}) against generation {live['generation']}")
    preview, preview_s = previewed(api, pool, revision["generation"], window)
    live_measured = measured_on(api, pool, window, preview)
    say(f"preview done in {preview_s:.1f} s; publishing generation {revision['generation']}")
    api("POST", f"/api/v1/pools/{pool}/revisions/{revision['generation']}/publish/")
    converged_s = wait_converged(api, pool, revision["generation"])
    # The next window is the last whole one once the control plane rounds its end down, so it
    # starts after convergence; the proposed revision is then previewed on it as well ("hindsight"),
    # which splits the error into the simulator's own and the change of traffic between windows.
    wait_s = window_s + end_step_s(window_s) + 1
    say(f"converged in {converged_s:.1f} s; measuring the next {window} under it ({wait_s} s)")
    time.sleep(wait_s)
    say(f"previewing generation {revision['generation']} on the window it was measured on")
    hindsight, hindsight_s = previewed(api, pool, revision["generation"], window)
    proposed_measured = measured_on(api, pool, window, hindsight)
    score = score_of(api, pool, preview["id"])
    result = preview["result"]
    replayed = hindsight["result"]["live"]  # the published revision is the live one now
    return {
        "pool": pool, "window": window, "live_generation": live["generation"], "generation": revision["generation"],
        "change": {"words": words, **values},
        "predicted": {side: {k: result[side][k] for k, _ in FIGURES} | {"requests": result[side]["requests"]}
                      for side in ("live", "proposed")},
        "measured": {"live": live_measured, "proposed": proposed_measured},
        "preview": {"id": preview["id"], "wall_s": round(preview_s, 1), "requests": result["requests"],
                    "sampling": result["sampling"], "model_error": result["model_error"],
                    "model_error_note": result["model_error_note"], "profile": result["profile"],
                    "host_background": result.get("host_background"),
                    "instances": result["instances"]},
        "hindsight": {"id": hindsight["id"], "wall_s": round(hindsight_s, 1),
                      "window_from": hindsight["result"]["window_from"], "window_to": hindsight["result"]["window_to"],
                      "predicted": {k: replayed[k] for k, _ in FIGURES} | {"requests": replayed["requests"]}},
        "score": score,
        "converged_s": round(converged_s, 1),
    }


def end_step_s(window_s: int) -> int:
    """The control plane's rounding of a window's end: a fifteenth of the window, 1 s to 60 s."""
    return max(1, min(60, window_s // 15))


def score_of(api: Api, pool: str, preview_id: int, timeout_s: float = 180.0) -> dict | None:
    """The control plane's own score of the preview (its scorecard row) once it is no longer
    waiting, or None when it is not there within ``timeout_s``."""
    started = time.monotonic()
    while time.monotonic() - started < timeout_s:
        scores = api("GET", f"/api/v1/pools/{pool}/previews/scores/")["scores"]
        row = next((s for s in scores if s["preview"]["id"] == preview_id), None)
        if row is not None and row["status"] != "waiting":
            return {k: row[k] for k in ("status", "reason", "measure_from", "measure_to", "predicted", "measured",
                                        "errors")}
        time.sleep(5)
    say(f"the scorecard had no finished score of preview {preview_id} within {timeout_s:.0f} s")
    return None


def table(report: dict) -> str:
    def show(key: str, value) -> str:
        if value is None:
            return "–"
        return f"{value:.1f}" if key.endswith("_ms") else f"{100 * value:.2f} %"

    def error(key: str, predicted, measured) -> str:
        if predicted is None or measured is None:
            return "–"
        if key.endswith("_ms"):
            return "–" if not measured else f"{100 * (predicted - measured) / measured:+.1f} %"
        return f"{100 * (predicted - measured):+.2f} pt"

    p, m = report["predicted"], report["measured"]
    hindsight = (report.get("hindsight") or {}).get("predicted")
    lines = [f"Preview accuracy on pool {report['pool']}, {report['window']} windows "
             f"({report['change']['words']}; "
             f"profile: {report['preview']['profile']['note']}"
             + (f"; on the host, {background['note']}" if (background := report["preview"].get("host_background"))
                else "") + ")",
             "| figure | live predicted | live measured | proposed predicted | proposed measured | error | "
             "proposed replayed on the measured window | its error |",
             "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for key, label in FIGURES:
        replayed = hindsight[key] if hindsight else None
        lines.append(f"| {label} | {show(key, p['live'][key])} | {show(key, m['live'][key])} | "
                     f"{show(key, p['proposed'][key])} | {show(key, m['proposed'][key])} | "
                     f"{error(key, p['proposed'][key], m['proposed'][key])} | {show(key, replayed)} | "
                     f"{error(key, replayed, m['proposed'][key])} |")
    lines.append(f"| requests | {p['live']['requests']} | {m['live']['requests']} | {p['proposed']['requests']} | "
                 f"{m['proposed']['requests']} | | {hindsight['requests'] if hindsight else '–'} | |")
    for side in ("live", "proposed"):
        interval = m[side].get("p99_interval_ms")
        if interval:
            inside = interval[0] <= p[side]["p99_ms"] <= interval[1] if p[side]["p99_ms"] is not None else None
            lines.append(f"\nMeasured P99 of the {side} revision: {m[side]['p99_ms']:.1f} ms, 95 % interval "
                         f"{interval[0]:.1f}–{interval[1]:.1f} from the window's requests alone; the prediction is "
                         f"{'inside' if inside else 'outside'} it.")
    error_ = report["preview"]["model_error"]
    lines.append(f"\nSimulator's validation error: {'unknown' if error_ is None else f'{100 * error_:.1f} %'} "
                 f"({report['preview']['model_error_note']}). Preview took {report['preview']['wall_s']} s.")
    lines.append("The error column is the preview's against the next window (the simulator's error and the change "
                 "of traffic between the windows); the last column replays the published revision on the measured "
                 "window itself (the simulator's error alone).")
    score = report.get("score")
    if score is None:
        lines.append("Scorecard: no score of this preview was read back.")
    elif score["status"] != "done":
        lines.append(f"Scorecard: {score['status']}: {score['reason']}")
    else:
        e = score["errors"]
        lines.append(f"Scorecard (the control plane's own score, {score['measure_from']} → {score['measure_to']}): "
                     f"P99 {_pct(e.get('p99'))}, P50 {_pct(e.get('p50'))}, within SLO "
                     f"{_pt(e.get('within_slo_points'))}, hit ratio {_pt(e.get('hit_ratio_points'))}")
    return "\n".join(lines)


def _pct(value: float | None) -> str:
    return "–" if value is None else f"{100 * value:+.1f} %"


def _pt(value: float | None) -> str:
    return "–" if value is None else f"{value:+.2f} pt"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m workers.preview_check", description=__doc__.split("\n\n")[0])
    parser.add_argument("--window", default="5m", choices=sorted(WINDOWS, key=WINDOWS.get))
    parser.add_argument("--change", choices=CHANGES, default="trigger",
                        help="trigger: a stricter at_risk_seq_len; hbm: half the HBM budget; ttl: a quarter of the TTL; "
                             "live: no change, the live revision previewed on --windows successive windows; "
                             "curve: the cache curve against the measured hit ratio and the simulator at "
                             "half and twice the HBM budget (nothing is published)")
    parser.add_argument("--windows", type=argument(1, 100, as_int=True), default=5, help="with --change live: successive windows (default 5)")
    parser.add_argument("--at-risk-seq-len", type=argument(1, 1 << 20, as_int=True), help="with --change trigger: the proposed threshold "
                        "(default: twice the live one)")
    parser.add_argument("--out", type=Path, help="JSON file for the figures")
    parser.add_argument("--save-capture", type=Path, help="with --change curve on a stack started here: the "
                        "window's captured records (outcome and miss reason included) as JSON lines")
    parser.add_argument("--keep", type=Path, help="on a stack started here: each preview keeps what it replayed in "
                        "KEEP/preview-<id>/ (RELAYGR_PREVIEW_KEEP_DIR), for python -m relay_engine.sim decompose")
    parser.add_argument("--url", help="a running control plane (default: start a stack here)")
    parser.add_argument("--token", help="an operator's API token (with --url)")
    parser.add_argument("--pool", default="main", help="the pool (with --url)")
    parser.add_argument("--instances", type=int, default=2)
    parser.add_argument("--rate", type=float, default=8.0, help="replayed queries per second")
    parser.add_argument("--model", default="default")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--warmup-s", type=float, default=60.0, help="steady traffic before the captured window")
    args = parser.parse_args(argv)
    if args.url and not args.token:
        parser.error("--url needs --token (an operator's API token)")
    process = None
    with tempfile.TemporaryDirectory(prefix="relaygr-preview-check-") as tmp:
        try:
            if args.url:
                api, pool = Api(args.url, args.token), args.pool
            else:
                say("starting a stack (workers.stack)")
                process, status = start_stack(args, Path(tmp))
                api, pool = Api(status["url"], status["token"]), status["pool"]
            say(f"warming up for {args.warmup_s:.0f} s")
            time.sleep(args.warmup_s)
            if args.change == "live":
                report = check_live(api, pool, args.window, args.windows)
            elif args.change == "curve":
                keep = None
                if args.save_capture and process is not None:
                    keep = (status | {"key_prefix": stack_prefix}, args.save_capture)
                report = check_curve(api, pool, args.window, keep)
            else:
                report = check(api, pool, args.window, args.at_risk_seq_len, args.change)
        finally:
            if process is not None:
                stop_stack(process)
    print({"live": live_table, "curve": curve_table}.get(args.change, table)(report))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
