"""Benchmark of the history reads from Prometheus at fleet scale: the windows longer than the live one.

    python -m controlplane.telemetry.bench_prometheus [--instances 8,256] [--hours 24] [--requests 30]
                                                      [--json PATH]

For each instance count: ``--hours`` of the control plane's ``/metrics`` as Prometheus would have scraped
it (one scrape every ``scrape_interval`` of deploy/prometheus/prometheus.yml, 15 s), rendered by the
exporter itself (``prometheus.FleetCollector``: the same names, labels, buckets and series per instance)
from the snapshots the Redis benchmark generates (``bench._snapshot``), written as OpenMetrics text with
timestamps, one file per 2-hour block, and backfilled with ``promtool tsdb create-blocks-from openmetrics``
(a process per block, as many as there are CPUs) into a temporary data directory; then the scrapes the
backfill's own minutes would have added, again until less than a minute is missing (``catch_up``: a server
that scraped all along has no hole at the newest end of its day, and a day's window read over one would
hold a ten-minute block too few for its rolled sum, as it did before 2026-12-06 20:30). The history recording
rules (deploy/prometheus/relaygr-history-rules.yml) are then backfilled from those raw series as a
production server would have recorded them: ``promtool tsdb create-blocks-from rules`` against the real
``prometheus`` serving the raw blocks, its blocks moved beside them, the server restarted, and the
overlapping blocks merged (the server's own vertical compaction) before any read. The real ``prometheus``
then serves that directory on a loopback port with every shipped rules file (evaluated as in production:
the load a real server carries). Before the timings the server compacts the history as any server holding
it would have by then, with its default block durations (a day: an 18 h block, a 6 h one, a few of 2 h),
and the bench waits until its blocks have not changed for ``COMPACTED_AFTER_S``, so no compaction runs under
the timings; ``--blocks-2h`` keeps every block 2 h wide instead (a server's first hours, or one told not to
compact: each series then sits in twelve blocks a day, which costs long windows). Redis holds only the live tier, as workers with
``RELAYGR_HISTORY=prometheus`` write it, and the control plane reads with ``PROMETHEUS_URL`` set.

Then for each window longer than ``LIVE_WINDOW_S`` (1h, 6h, 24h), the views ``bench`` times: the live
view's request (pool series and the 8 worst instances), the overview's (no instances), a page of the
instance table, and the instance page (the worst instance), each ``--colds`` times cold (the process
cache emptied before each: 5 by default, since one sample of a shared machine is a coin toss near the
target), then ``--requests`` times as the pages poll (``since``, ``known``). Printed: milliseconds (wall, and
this process's CPU), bytes per answer, and each view against the targets: warm P95 < 100 ms, the cold reads'
median < 1 s (their first, on a server that has answered nothing of the window yet, and slowest beside it).
Every answer must carry data (a view whose series are empty fails, whatever its time): ``--json`` writes
each view's figures and how many values its cold answer held.

The backfill is most of the run: at 256 instances (183 series each) 2 h of scrapes is 22.5 M samples,
~3 min on a busy 2-core machine, so 24 h (``--hours 24``, 270 M samples) is ~35 min there; the default is
6 h, and a window longer than ``--hours`` reads only what there is (the table says so). Uses REDIS_URL if set (under a throwaway key prefix, deleted afterwards), otherwise an
embedded Redis; a throwaway SQLite database; ``prometheus`` and ``promtool`` on PATH (Debian's package
``prometheus``, ``make promtool``).
"""

from __future__ import annotations

import argparse
import cProfile
import http.server
import json
import multiprocessing
import os
import pstats
import random
import re
import shutil
import statistics
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import yaml

from relay_engine.core.lifetime import die_with_parent, free_port

from .bench import (
    REPO,
    TARGET_COLD_MS,
    TARGET_WARM_P95_MS,
    Writer,
    _counts,
    _percentile,
    _snapshot,
    throwaway_stack,
)
from .recording import BLOCK_GROUP, GROUP, RECORDED_STEP_S, RULES_PATH, SUMS_GROUP, group_rules, rolled

PROMETHEUS_DIR = REPO / "deploy" / "prometheus"
RULES = PROMETHEUS_DIR / "relaygr-rules.yml"
HISTORY_RULES = RULES_PATH
# How often each page polls (frontend/static/frontend: live.js, overview.js, fleet.js's table, instance.js).
PAGE_POLL_S = {"live": 1.0, "overview": 2.0, "table": 1.0, "instance": 1.0}
BLOCK_S = 2 * 3600  # promtool's block: each file one aligned block, so each is parsed once
READY_TIMEOUT_S = 120.0
MERGE_TIMEOUT_S = 1800.0
COMPACTED_AFTER_S = 75.0  # blocks unchanged this long: the server's compaction (planned every minute) is done
CAUGHT_UP_S = 60.0  # the backfill's scrapes go on until less than this is missing (``catch_up``)


def scrape_interval_s() -> int:
    """The shipped configuration's ``scrape_interval`` (``15s``, ``1m``) in seconds."""
    raw = yaml.safe_load((PROMETHEUS_DIR / "prometheus.yml").read_text())["global"]["scrape_interval"]
    match = re.fullmatch(r"(\d+)([sm])", raw)
    if match is None:
        raise ValueError(f"deploy/prometheus/prometheus.yml: scrape_interval {raw!r} is not <n>s or <n>m")
    return int(match[1]) * (60 if match[2] == "m" else 1)


@dataclass(frozen=True)
class Fleet:
    """What every scrape of the benchmark's pool renders: its instances, each one's run, their status."""
    pool: str
    names: list[str]
    started_at: float
    status: object  # fleet.selectors.PoolStatus, taken once from Redis: a healthy fleet's, every scrape


def render_scrape(fleet: Fleet, ts: float, rng: random.Random) -> str:
    """The exposition a scrape at ``ts`` reads, rendered by the exporter, as OpenMetrics (no ``# EOF``)."""
    from prometheus_client.openmetrics.exposition import generate_latest
    from prometheus_client.registry import CollectorRegistry

    from .prometheus import FleetCollector

    def state(pool, now):
        snapshots = [_snapshot(name, now, fleet.started_at, rng) for name in fleet.names] \
            if pool.name == fleet.pool else []
        return fleet.status, snapshots

    registry = CollectorRegistry(auto_describe=False)
    registry.register(FleetCollector(ts, state=state))
    return generate_latest(registry).decode().removesuffix("# EOF\n")


class Scrapes:
    """Every scrape between two the exporter rendered (the first and the last), each sample's value drawn
    on the line between its two: counters grow at their rate, gauges stay within what they were, every
    series, label and bucket is the exporter's. (Rendering each of 256 instances' scrapes through the
    exporter takes ~1 s a scrape, ~1.5 h for a day; this takes ~20 ms.)"""

    def __init__(self, first: str, first_ts: float, last: str, last_ts: float):
        self.first_ts, self.last_ts, self.span_s = first_ts, last_ts, max(last_ts - first_ts, 1e-9)
        self.comments, self.prefixes, start, end = [], [], [], []
        # A scrape: its comment block (HELP, TYPE) then its samples, family by family; kept in that order.
        self.layout: list[tuple[int, int]] = []  # (index into comments or -1, index into samples)
        for line, other in zip(first.splitlines(), last.splitlines(), strict=True):
            if line.startswith("#"):
                self.layout.append((len(self.comments), -1))
                self.comments.append(line + "\n")
                continue
            series, value = line.rsplit(" ", 1)
            other_series, other_value = other.rsplit(" ", 1)
            if series != other_series:
                raise RuntimeError(f"the exporter rendered {series} then {other_series} at one place")
            self.layout.append((-1, len(self.prefixes)))
            self.prefixes.append(series + " ")
            start.append(float(value))
            end.append(float(other_value))
        self.start, self.end = np.array(start), np.array(end)
        self.integral = np.array([a.is_integer() and b.is_integer() for a, b in zip(start, end, strict=True)])

    @property
    def samples(self) -> int:
        return len(self.prefixes)

    def render(self, ts: float) -> str:
        """The scrape at ``ts``: every sample stamped with it."""
        share = (ts - self.first_ts) / self.span_s
        values = self.start + (self.end - self.start) * share
        texts = [str(int(v)) if whole else repr(v)
                 for v, whole in zip(np.where(self.integral, np.rint(values), values).tolist(),
                                     self.integral.tolist(), strict=True)]
        stamp = f" {ts:.3f}\n"
        return "".join(self.comments[c] if c >= 0 else self.prefixes[i] + texts[i] + stamp
                       for c, i in self.layout)


def _backfill_block(args: tuple[Scrapes, list[float], str]) -> tuple[float, float]:
    """One block's scrapes into a file, promtool over it into ``out``; (render s, promtool s)."""
    scrapes, times, out = args
    path = Path(out) / "block.om"
    started = time.perf_counter()
    with path.open("w") as file:
        for ts in times:
            file.write(scrapes.render(ts))
        file.write("# EOF\n")
    rendered = time.perf_counter()
    result = subprocess.run([shutil.which("promtool"), "tsdb", "create-blocks-from", "openmetrics", "--quiet",
                             str(path), str(Path(out) / "blocks")], capture_output=True, text=True, check=False,
                            preexec_fn=die_with_parent())
    path.unlink()
    if result.returncode != 0:
        raise RuntimeError(f"promtool create-blocks-from openmetrics failed: {result.stderr[-2000:]}")
    return rendered - started, time.perf_counter() - rendered


def backfill(fleet: Fleet, now: float, hours: float, data_dir: Path, work_dir: Path) -> Scrapes:
    """``hours`` of scrapes up to ``now`` into ``data_dir`` as TSDB blocks, a process per block; the scrapes
    (``live_exporter`` goes on from them)."""
    step_s = scrape_interval_s()
    first = now - hours * 3600
    times = [first + k * step_s for k in range(int(hours * 3600 // step_s) + 1)]
    started = time.perf_counter()
    rng = random.Random(7)
    scrapes = Scrapes(render_scrape(fleet, times[0], rng), times[0], render_scrape(fleet, times[-1], rng), times[-1])
    workers, done = _backfill_times(scrapes, times, data_dir, work_dir)
    samples = scrapes.samples * len(times)
    print(f"backfilled {len(times)} scrapes every {step_s} s ({hours:g} h), {samples / 1e6:.1f} M samples "
          f"({samples / len(times) / len(fleet.names):.0f} series per instance) in {len(done)} blocks: "
          f"{time.perf_counter() - started:.0f} s on {workers} processes (render {sum(r for r, _ in done):.0f} s, "
          f"promtool {sum(p for _, p in done):.0f} s, summed over the processes)", flush=True)
    return scrapes


def catch_up(scrapes: Scrapes, last: float, data_dir: Path, work_dir: Path) -> float:
    """The scrapes after ``last`` (the newest backfilled) up to now, on the same grid, backfilled the same
    way, again until less than ``CAUGHT_UP_S`` is missing; the newest scrape's time. A day's backfill takes
    minutes, and a server started on it would hold none of them: a hole at the newest end of its history
    that a server scraping all along does not have (where a day's window then holds one ten-minute block
    too few for a rolled sum, ``recording.ROLLED_BLOCKS``, and sums ~140 blocks instead)."""
    step_s = scrape_interval_s()
    started, rounds, added = time.perf_counter(), 0, 0
    while time.time() - last >= CAUGHT_UP_S:
        times = [last + k * step_s for k in range(1, int((time.time() - last) // step_s) + 1)]
        _backfill_times(scrapes, times, data_dir, work_dir, tag=f"catch-up-{rounds}")
        last, rounds, added = times[-1], rounds + 1, added + len(times)
    print(f"caught up: {added} more scrapes ({added * step_s / 60:.1f} min) in {rounds} rounds, "
          f"{time.perf_counter() - started:.0f} s", flush=True)
    return last


def _backfill_times(scrapes: Scrapes, times: list[float], data_dir: Path, work_dir: Path,
                    tag: str = "block") -> tuple[int, list[tuple[float, float]]]:
    """The scrapes at ``times``, each 2-hour block's through promtool in a process of its own, the blocks it
    wrote moved into ``data_dir``; (processes, each block's (render s, promtool s))."""
    blocks: dict[int, list[float]] = {}
    for ts in times:
        blocks.setdefault(int(ts // BLOCK_S), []).append(ts)
    jobs = []
    for block, block_times in sorted(blocks.items()):
        out = work_dir / f"{tag}-{block}"
        out.mkdir()
        jobs.append((scrapes, block_times, str(out)))
    workers = min(len(jobs), os.cpu_count() or 1)
    with multiprocessing.get_context("fork").Pool(workers) as pool:
        done = pool.map(_backfill_block, jobs, chunksize=1)
    for *_, out in jobs:
        for block in (Path(out) / "blocks").iterdir():
            block.rename(data_dir / block.name)
        shutil.rmtree(out)
    return workers, done


@contextmanager
def live_exporter(scrapes: Scrapes) -> Iterator[str]:
    """An exporter on a loopback port going on from the backfill: each scrape of ``/metrics`` the samples of
    ``scrapes`` at the moment it is asked (counters growing at their rate), as OpenMetrics. Prometheus
    scraping it ingests what a fleet's scrape is, and its rules record new minutes, as in production.
    Yields the target (``host:port``)."""

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 - the http.server's name
            body = (scrapes.render(time.time()) + "# EOF\n").encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/openmetrics-text; version=1.0.0; charset=utf-8")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, name="bench-exporter", daemon=True)
    thread.start()
    try:
        yield f"127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


@contextmanager
def prometheus_server(data_dir: Path, port: int, log_path: Path, scrape: str | None = None,
                      compact: bool = False) -> Iterator[str]:
    """The real ``prometheus`` on ``data_dir`` at 127.0.0.1:``port`` (the shipped rules; scraping ``scrape``, a
    ``host:port``, at the shipped interval, the exposition's own labels kept), killed on exit; its URL once
    ready. Its blocks stay 2 h wide unless ``compact``: then the server compacts them as it would any history,
    with its default block durations (2 h blocks into 6 h, 6 h into 18 h, ...)."""
    binary = shutil.which("prometheus")
    if binary is None:
        raise RuntimeError("prometheus is missing: `make promtool` (Debian: apt-get install prometheus)")
    config = data_dir.parent / "prometheus.yml"
    settings: dict = {"global": {"evaluation_interval": "1m", "scrape_interval": f"{scrape_interval_s()}s"},
                      "rule_files": [str(RULES), str(HISTORY_RULES)]}
    if scrape is not None:
        settings["scrape_configs"] = [{"job_name": "relaygr-bench", "honor_labels": True,
                                       "static_configs": [{"targets": [scrape]}]}]
    config.write_text(yaml.safe_dump(settings))
    url = f"http://127.0.0.1:{port}"
    with log_path.open("wb") as log:
        process = subprocess.Popen(
            [binary, f"--config.file={config}", f"--storage.tsdb.path={data_dir}",
             f"--web.listen-address=127.0.0.1:{port}", "--storage.tsdb.retention.time=30d",
             # Hidden flags: blocks stay the backfill's 2 h, so no compaction runs under the timings.
             *(() if compact else ("--storage.tsdb.min-block-duration=2h", "--storage.tsdb.max-block-duration=2h"))],
            stdout=log, stderr=subprocess.STDOUT, preexec_fn=die_with_parent())
    try:
        deadline = time.monotonic() + READY_TIMEOUT_S
        while not _ready(url):
            if process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"prometheus did not become ready (exit {process.poll()}):\n"
                                   f"{log_path.read_text(errors='replace')[-3000:]}")
            time.sleep(0.2)
        yield url
    finally:
        process.terminate()
        try:
            process.wait(timeout=20)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def backfill_recorded(data_dir: Path, first: float, now: float, port: int, work_dir: Path,
                      groups: tuple[str, ...] = (GROUP, BLOCK_GROUP, SUMS_GROUP)) -> None:
    """The history rules (those of ``groups``) over the raw blocks of ``data_dir`` from ``first`` to ``now``, as
    blocks beside them (promtool asks a server on the raw blocks), then merged with them by the server's
    vertical compaction.

    Both groups are read from the shipped rules file itself, so each group's evaluation phase (Prometheus
    hashes the group's name and file path) is the live server's and its own records go on from the
    backfill's without a doubled or missing minute. The backfill starts at ``first``'s two-hour TSDB block
    boundary: promtool evaluates a group block by block from its first aligned time in each, and stops at the
    first block that has none, so a ``first`` in the last interval of a block before the group's phase would
    leave the whole backfill without a sample of that group (a ten-minute group: one start in twelve).

    The summed blocks (``SUMS_GROUP``) read the first group's records, and its rolled sums its own blocks, so
    they are backfilled in two more passes, each against a server that holds what it reads (from a rules file
    of their own, the same path and group for both: their phase is then not the live server's, whose own
    blocks go on after the backfill's as a second run of blocks, ``promql.block_runs``)."""
    others = tuple(name for name in groups if name != SUMS_GROUP)
    if others:
        _backfill_pass(data_dir, first, now, port, work_dir, others)
    if SUMS_GROUP in groups:
        _backfill_pass(data_dir, first, now, port, work_dir, (SUMS_GROUP,), lambda rule: not rolled(rule))
        _backfill_pass(data_dir, first, now, port, work_dir, (SUMS_GROUP,), rolled)


def _backfill_pass(data_dir: Path, first: float, now: float, port: int, work_dir: Path, groups: tuple[str, ...],
                   keep: Callable[[dict], bool] | None = None) -> None:
    """One promtool backfill of ``groups`` (only the rules ``keep`` says yes to, where given)."""
    out = work_dir / "recorded-blocks"
    shipped = set(groups) == {GROUP, BLOCK_GROUP} and keep is None
    rules_file = HISTORY_RULES if shipped else work_dir / "history-rules.yml"
    if not shipped:
        rules_file.write_text(yaml.safe_dump({"groups": [group for name in groups
                                                         for group in group_rules(name, keep)["groups"]]},
                                             sort_keys=False))
    start = int(first) // BLOCK_S * BLOCK_S  # before ``first`` the rules read nothing and record nothing
    started = time.perf_counter()
    with prometheus_server(data_dir, port, work_dir / "prometheus-raw.log") as url:
        result = subprocess.run([shutil.which("promtool"), "tsdb", "create-blocks-from", "rules", "--quiet",
                                 f"--start={start}", f"--end={int(now)}", f"--url={url}",
                                 f"--output-dir={out}", str(rules_file)],
                                capture_output=True, text=True, check=False, preexec_fn=die_with_parent())
    if not shipped:
        rules_file.unlink()
    if result.returncode != 0:
        raise RuntimeError(f"promtool create-blocks-from rules failed: {result.stderr[-2000:]}")
    blocks = [block for block in out.iterdir() if block.is_dir()] if out.exists() else []
    for block in blocks:
        block.rename(data_dir / block.name)
    shutil.rmtree(out, ignore_errors=True)
    print(f"backfilled the history rules ({', '.join(groups)}{'' if keep is None else ', in part'}) in "
          f"{len(blocks)} blocks: "
          f"{time.perf_counter() - started:.0f} s", flush=True)


def _overlapping(data_dir: Path) -> bool:
    spans = _blocks(data_dir)
    return any(later[0] < earlier[1] for earlier, later in zip(spans, spans[1:], strict=False))


def _blocks(data_dir: Path) -> list[tuple[int, int]]:
    return sorted((meta["minTime"], meta["maxTime"]) for meta in
                  (json.loads(path.read_text()) for path in data_dir.glob("*/meta.json")))


def layout(data_dir: Path) -> str:
    """The data directory's blocks by width, widest first: ``1 x 18.0 h, 2 x 2.0 h``."""
    widths: dict[float, int] = {}
    for first, last in _blocks(data_dir):
        width = round((last - first) / 3.6e6, 1)
        widths[width] = widths.get(width, 0) + 1
    return ", ".join(f"{count} x {width:g} h" for width, count in sorted(widths.items(), reverse=True))


def wait_for_merged_blocks(data_dir: Path, timeout_s: float, settled_s: float = 0.0) -> None:
    """Until no two blocks of ``data_dir`` overlap (the server compacts every minute), so no merge runs
    under the timings; with ``settled_s``, also until its blocks have not changed for that long (a server
    compacting its history: it plans again every minute, so longer than a minute says it is done)."""
    started = time.perf_counter()
    seen, since = _blocks(data_dir), time.perf_counter()
    while _overlapping(data_dir) or time.perf_counter() - since < settled_s:
        if time.perf_counter() - started > timeout_s:
            raise RuntimeError(f"prometheus did not merge the recorded blocks with the raw ones in {timeout_s:g} s")
        time.sleep(1.0)
        if (now_seen := _blocks(data_dir)) != seen:
            seen, since = now_seen, time.perf_counter()
    print(f"blocks merged{' and compacted' if settled_s else ''} {time.perf_counter() - started:.0f} s after the "
          f"server started: {layout(data_dir)}", flush=True)


def day_parts(pool: str) -> str:
    """What a 24 h window's counts are read from now (``promql.Span.parts``): ``edge 6.2 min, rolled, edge 8.0
    min``; a run of blocks is ``blocks ×n``."""
    from controlplane.telemetry.promql import PrometheusHistory
    from controlplane.telemetry.recording import BLOCK_S as TEN_MINUTES

    history = PrometheusHistory(os.environ["PROMETHEUS_URL"], timeout_s=10)
    now = time.time()
    at = history._newest_recorded_minute(pool, now)
    span = history._summed_span(pool, now - 24 * 3600, at) if at is not None else None
    if span is None:
        return "the minutes alone (no whole ten-minute block in it)"
    words = []
    for kind, selected in span.parts():
        width_ms = int(selected[1:selected.index("ms]")]) if selected.startswith("[") else 0
        words.append({"edge": f"edge {width_ms / 60000:.1f} min", "rolled": "rolled",
                      "blocks": f"blocks x{round(width_ms / 1000 / TEN_MINUTES) + 1}"}[kind])
    return ", ".join(words)


def _ready(url: str) -> bool:
    try:
        with urllib.request.urlopen(f"{url}/-/ready", timeout=2) as response:
            return response.status == 200
    except OSError:
        return False


@dataclass
class Reading:
    window: str
    view: str
    cold_ms: float  # the median of the cold reads (``colds``)
    cold_bytes: int
    p50_ms: float
    p95_ms: float
    cpu_p95_ms: float
    poll_bytes_p95: float
    values: int  # non-null numbers in the cold answer's series (0: the answer carried no data)
    error: str = ""  # a read that did not answer 200 (a Prometheus slower than PROMETHEUS_TIMEOUT_S: a 503)
    turn_ms: list[float] = field(default_factory=list)  # the first poll after each new recorded minute
    walls: list[float] = field(default_factory=list, repr=False)  # the warm polls, ms
    colds: list[float] = field(default_factory=list)  # every cold read, ms, in order (the first on a server
    # that has answered nothing of this window yet)

    @property
    def cold_first_ms(self) -> float:
        return self.colds[0] if self.colds else self.cold_ms

    @property
    def cold_max_ms(self) -> float:
        return max(self.colds) if self.colds else self.cold_ms

    @property
    def turn_max_ms(self) -> float:
        return max(self.turn_ms) if self.turn_ms else float("nan")

    @property
    def page_p95_ms(self) -> float:
        """The P95 of a page's polls over a minute at its own interval (``PAGE_POLL_S``): one poll in
        60 / interval is the first after a new minute (``turn_ms``), the others are as ``walls``. Without
        turn polls, the warm P95."""
        if not self.turn_ms or not self.walls:
            return self.p95_ms if not self.turn_ms else self.turn_max_ms
        turn_share = PAGE_POLL_S[self.view] / RECORDED_STEP_S
        weighted = sorted([(ms, (1 - turn_share) / len(self.walls)) for ms in self.walls] +
                          [(ms, turn_share / len(self.turn_ms)) for ms in self.turn_ms])
        seen = 0.0
        for ms, weight in weighted:
            seen += weight
            if seen >= 0.95 - 1e-12:
                return ms
        return weighted[-1][0]

    @property
    def passed(self) -> bool:
        return (not self.error and self.p95_ms < TARGET_WARM_P95_MS and self.page_p95_ms < TARGET_WARM_P95_MS
                and self.cold_ms < TARGET_COLD_MS and self.values > 0)


class ReadFailed(Exception):
    pass


def _values(node) -> int:
    """Non-null numbers in an answer's series (lists of values, however nested)."""
    if isinstance(node, dict):
        return sum(_values(child) for child in node.values())
    if isinstance(node, list):
        return sum(_values(child) if isinstance(child, dict | list) else child is not None for child in node)
    return 0


def _data_of(view: str, body: dict) -> int:
    if view == "table":
        return sum(1 for row in body["results"] if row.get("rank_requests"))
    if view == "instance":
        return _values(body["series"])
    fleet = {key: value for key, value in body["fleet"].items() if key != "totals"}
    return _values(fleet) + sum(_values(top) for top in body.get("top", {}).get("instances", []))


def _poll_url(view: str, url: str, body: dict) -> str:
    """The request a page that holds ``body`` polls with: the last point it holds (``since``) and, for the
    live view, the instances it shows (``known``); the table reads its page whole."""
    if view == "table":
        return url
    poll = url + (f"&since={body['timestamps'][-1]}" if body["timestamps"] else "")
    if view == "live":
        poll += "&known=" + ",".join(t["instance"] for t in body["top"]["instances"])
    return poll


def _views(base: str, window: str, names: list[str]) -> dict[str, str]:
    from controlplane.telemetry.selectors import TOP_DEFAULT

    return {
        "live": f"{base}/metrics/?window={window}&top={TOP_DEFAULT}",
        "overview": f"{base}/metrics/?window={window}&top=0",
        "table": f"{base}/instances/?window={window}&sort=-p99_ms&limit=25",
        "instance": f"{base}/instances/{names[-1]}/metrics/?window={window}",
    }


def _get(client, url: str) -> tuple[float, float, dict, int]:
    t0, c0 = time.perf_counter(), time.process_time()
    response = client.get(url)
    wall, cpu = (time.perf_counter() - t0) * 1000, (time.process_time() - c0) * 1000
    if response.status_code != 200:
        raise ReadFailed(f"HTTP {response.status_code} after {wall:.0f} ms: {response.content[:200].decode()}")
    return wall, cpu, response.json(), len(response.content)


def measure_reads(pool: str, names: list[str], client, requests: int, hours: float,
                  profile_dir: Path | None = None, colds: int = 1) -> list[Reading]:
    """Every view of every window longer than the live one: ``colds`` times cold (the process cache emptied
    before each), then ``requests`` polls (with ``profile_dir``, the control plane's side of the first cold
    read and of the warm polls of each view, as cProfile stats there)."""
    from controlplane.telemetry.cache import telemetry_cache
    from controlplane.telemetry.selectors import WINDOWS
    from controlplane.telemetry.sources import LIVE_WINDOW_S

    base = f"/api/v1/pools/{pool}"
    # "Cold" is an empty process cache, not a process that has served nothing: one live-window read first.
    _get(client, f"{base}/metrics/?window={min(WINDOWS, key=lambda w: WINDOWS[w][0])}&top=0")
    readings = []
    profiles: dict[tuple[str, str], list[cProfile.Profile]] = {}
    _header()
    for window, (window_s, _) in WINDOWS.items():
        if window_s <= LIVE_WINDOW_S:
            continue
        if window_s > hours * 3600:
            print(f"{window:>6} holds only the {hours:g} h backfilled (--hours)")
        for view, url in _views(base, window, names).items():
            walls, cpus, sizes, cold_walls = [], [], [], []
            try:
                for attempt in range(colds):
                    telemetry_cache.clear()
                    if profile_dir is None or attempt:
                        cold_ms, _, body, cold_bytes = _get(client, url)
                    else:
                        with cProfile.Profile() as prof:
                            cold_ms, _, body, cold_bytes = _get(client, url)
                        prof.dump_stats(profile_dir / f"{pool}-{window}-{view}-cold.prof")
                    cold_walls.append(cold_ms)
                for _ in range(requests):
                    poll = _poll_url(view, url, body)
                    if profile_dir is None:
                        wall, cpu, _, size = _get(client, poll)
                    else:
                        with cProfile.Profile() as prof:
                            wall, cpu, _, size = _get(client, poll)
                        profiles.setdefault((window, view), []).append(prof)
                    walls.append(wall)
                    cpus.append(cpu)
                    sizes.append(size)
            except ReadFailed as exc:
                print(f"{window:>6} {view:>9} failed: {exc}")
                readings.append(Reading(window, view, float("nan"), 0, float("nan"), float("nan"), float("nan"),
                                        float("nan"), 0, str(exc)))
                continue
            readings.append(Reading(window, view, statistics.median(cold_walls), cold_bytes,
                                    statistics.median(walls) if walls else 0.0, _percentile(walls, 95),
                                    _percentile(cpus, 95), _percentile(sizes, 95), _data_of(view, body),
                                    walls=walls, colds=cold_walls))
            _row(readings[-1])
    for (window, view), runs in profiles.items():
        assert profile_dir is not None
        stats = pstats.Stats(runs[0])
        for run in runs[1:]:
            stats.add(run)
        stats.dump_stats(profile_dir / f"{pool}-{window}-{view}.prof")
    if profiles:
        print(f"profiles of the warm polls in {profile_dir} (python -m pstats FILE; sort cumtime; stats 30)")
    return readings


def measure_turns(pool: str, names: list[str], client, readings: list[Reading], turns: int) -> None:
    """Every page of every history window open at once in one web process, polling: at each of ``turns`` new
    recorded minutes (the rules' evaluation on the live scrapes), each page's first poll after it, timed
    (``Reading.turn_ms``). That poll is the one a minute's new answers fall on; a page polling every 5 s
    meets one in 12."""
    from controlplane.telemetry.promql import PrometheusHistory

    def newest() -> float | None:
        return PrometheusHistory(os.environ["PROMETHEUS_URL"], timeout_s=10)._newest_recorded_minute(pool, time.time())

    base = f"/api/v1/pools/{pool}"
    pages = {(r.window, r.view): _views(base, r.window, names)[r.view] for r in readings if not r.error}
    bodies = {key: _get(client, url)[2] for key, url in pages.items()}
    by_key = {(r.window, r.view): r for r in readings}
    for turn in range(turns):
        seen, deadline = newest(), time.monotonic() + 3 * 60
        while newest() == seen:
            if time.monotonic() > deadline:
                print(f"no new minute recorded in 3 min (turn {turn + 1}): the rules do not run on live scrapes")
                return
            time.sleep(0.1)
        for key, url in pages.items():
            wall, _, bodies[key], _ = _get(client, _poll_url(key[1], url, bodies[key]))
            by_key[key].turn_ms.append(wall)
    from controlplane.telemetry.promql import _refresher

    _refresher.submit(lambda: None).result()  # the refreshes the last minute set off, done while the server is up
    print(f"\nthe first poll of every page after each of {turns} new recorded minutes, and the P95 of a page's "
          f"polls over a minute at its own interval (one in 60 / interval after a new minute; ms, target < "
          f"{TARGET_WARM_P95_MS:g}):")
    for r in readings:
        if r.turn_ms:
            print(f"{r.window:>6} {r.view:>9} {' '.join(f'{ms:6.1f}' for ms in r.turn_ms)}  max {r.turn_max_ms:6.1f}  "
                  f"every {PAGE_POLL_S[r.view]:g} s: P95 {r.page_p95_ms:6.1f}  {'PASS' if r.passed else 'FAIL'}",
                  flush=True)


def _header() -> None:
    print(f"{'window':>6} {'view':>9} {'cold ms':>8} {'first':>7} {'max':>7} {'cold B':>9} {'p50 ms':>7} {'p95 ms':>7} "
          f"{'cpu p95':>8} {'poll B p95':>10} {'values':>7}  verdict (warm P95 < {TARGET_WARM_P95_MS:g} ms, "
          f"cold median < {TARGET_COLD_MS:g} ms, data)")


def _row(r: Reading) -> None:
    print(f"{r.window:>6} {r.view:>9} {r.cold_ms:8.1f} {r.cold_first_ms:7.1f} {r.cold_max_ms:7.1f} {r.cold_bytes:9d} "
          f"{r.p50_ms:7.1f} {r.p95_ms:7.1f} {r.cpu_p95_ms:8.1f} {r.poll_bytes_p95:10.0f} {r.values:7d}  {'PASS' if r.passed else 'FAIL'}",
          flush=True)


def bench_history_reads(instances: int, hours: float, requests: int, redis_client, work_dir: Path,
                        profile_dir: Path | None = None, turns: int = 0, merge_wait: bool = True,
                        compact: bool = True, colds: int = 1) -> list[Reading]:
    """One instance count: backfill, Prometheus up, the live tier in Redis, every history view timed."""
    from django.test import Client

    from controlplane.accounts import services as account_services
    from controlplane.accounts.roles import Role
    from controlplane.fleet.selectors import pool_status
    from controlplane.policies import services as policy_services
    from relay_engine.core.wire import HISTORY_TIERS, instance_name

    pool = f"bench{instances}"
    pool_obj = policy_services.pool_create(name=pool, actor="bench", expected_instances=instances)
    user = account_services.user_create(username=f"bench{instances}", role=Role.VIEWER, actor="bench")
    client = Client(HTTP_AUTHORIZATION=f"Token {account_services.token_create(user=user, actor='bench').key}")
    names = [instance_name(pool, i) for i in range(instances)]
    writer = Writer(redis_client, pool)
    now = time.time()
    writer.started_at = now - (hours + 1) * 3600  # one run per instance, begun before the history
    writer.statuses(names, now)
    fleet = Fleet(pool, names, writer.started_at, pool_status(pool=pool_obj, now=now))
    print(f"\n== {instances} instances, {hours:g} h of history in Prometheus", flush=True)
    data_dir = work_dir / f"data-{instances}"
    data_dir.mkdir()
    started = time.perf_counter()
    scrapes = backfill(fleet, now, hours, data_dir, work_dir)
    newest = catch_up(scrapes, scrapes.last_ts, data_dir, work_dir)
    writer.fill(names, time.time(), random.Random(7), HISTORY_TIERS["prometheus"])
    writer.statuses(names, time.time())
    url = os.environ["PROMETHEUS_URL"]
    port = int(url.rsplit(":", 1)[1])
    backfill_recorded(data_dir, now - hours * 3600, newest, port, work_dir)
    with live_exporter(scrapes) as target, \
            prometheus_server(data_dir, port, work_dir / f"prometheus-{instances}.log", scrape=target,
                              compact=compact):
        if merge_wait:
            wait_for_merged_blocks(data_dir, MERGE_TIMEOUT_S, COMPACTED_AFTER_S if compact else 0.0)
        print(f"prometheus ready {time.perf_counter() - started:.0f} s after the backfill began, scraping the "
              f"fleet's exporter at {target} every {scrape_interval_s()} s", flush=True)
        if hours >= 12:
            print(f"a day's window reads, newest first: {day_parts(pool)}", flush=True)
        readings = measure_reads(pool, names, client, requests, hours, profile_dir, colds)
        if turns:
            measure_turns(pool, names, client, readings, turns)
    shutil.rmtree(data_dir)
    return readings


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--instances", type=_counts, default=[8], help="instance counts (8,256)")
    parser.add_argument("--hours", type=float, default=6.0,
                        help="history backfilled, up to now (hours; 24 fills the 24h window, ~12x the 2 h backfill)")
    parser.add_argument("--requests", type=int, default=30, help="warm polls per window and view")
    parser.add_argument("--colds", type=int, default=5,
                        help="cold reads per window and view, the process cache emptied before each; the verdict "
                             "is on their median, the first and the slowest are printed too (default 5)")
    parser.add_argument("--turns", type=int, default=3,
                        help="new recorded minutes at which every page's first poll is timed (0: none)")
    parser.add_argument("--json", type=Path, help="write every reading here (a list per instance count)")
    parser.add_argument("--no-merge-wait", action="store_true",
                        help="read at once instead of waiting for the server to merge the backfilled blocks (up to "
                             "a minute): a check that every view answers, whose timings may include the merge")
    parser.add_argument("--blocks-2h", action="store_true",
                        help="keep every block 2 h wide (the server's first hours, or one told not to compact) instead "
                             "of letting the server compact its history as it does by default (a day: 18 h, 6 h and "
                             "2 h blocks) before the timings")
    parser.add_argument("--profile", type=Path, metavar="DIR",
                        help="profile the control plane's side of the cold read and of the warm polls (cProfile; slows "
                             "them: not for the figures) and write stats files per window and view into DIR")
    args = parser.parse_args(argv)
    if args.colds < 1:
        parser.error(f"--colds must be at least 1, got {args.colds}")
    if not 0 < args.hours <= 24 * 30:
        parser.error(f"--hours must be in (0, 720], got {args.hours:g}")
    if args.profile is not None:  # made before the backfill's minutes, not found missing after them
        try:
            args.profile.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            parser.error(f"--profile {args.profile}: cannot make that directory ({exc.strerror})")

    os.environ["PROMETHEUS_URL"] = f"http://127.0.0.1:{free_port()}"  # read by the settings django.setup loads
    results: dict[str, list[dict]] = {}
    ok = True
    started = time.perf_counter()
    with throwaway_stack("relaygr-bench-prometheus-") as (redis_client, _, _, tmp):
        for count in args.instances:
            readings = bench_history_reads(count, args.hours, args.requests, redis_client, tmp, args.profile,
                                           args.turns, merge_wait=not args.no_merge_wait, compact=not args.blocks_2h,
                                           colds=args.colds)
            results[str(count)] = [{**asdict(r), "turn_max_ms": r.turn_max_ms, "page_p95_ms": r.page_p95_ms,
                                    "passed": r.passed} for r in readings]
            ok &= bool(readings) and all(r.passed for r in readings)
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))
    print(f"{'every target met' if ok else 'a target was missed (see above)'} "
          f"({time.perf_counter() - started:.0f} s end to end)")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
