"""The recording rules the history reads from Prometheus: one table of the series they pre-aggregate, the
names they record, and the rules file written from it (deploy/prometheus/relaygr-history-rules.yml).

    python -m controlplane.telemetry.recording           # regenerate the rules file
    python -m controlplane.telemetry.recording --check   # exit 1 when the committed file is stale

Every minute (``RECORDED_STEP_S``, the group's own ``interval``, whatever the server's
``evaluation_interval``) the rules record the ``increase()`` over that minute of every counter column of
``history``'s layout (the counters, refusals and misses by reason, the latency buckets by ``le``, the
latency sum), summed per pool and per instance, and the pool gauges ``promql.gauges_query`` reads (tier
levels summed by tier, the applied generation's max, the count of instances present). A read of a point
``step_s`` wide (a multiple of the minute) sums or takes the last of the minutes recorded in it, so it
reads ``step_s / 60`` samples of one series per column instead of every raw series of every instance.

How close that is to the raw ``increase()`` over the point: each minute's increase is extrapolated to the
minute's edges as Prometheus does within any range (counter resets within the minute handled), so the
minutes sum to the growth across their joints too; a point counts the minutes whose evaluation fell in
it, shifted earlier than the point by the group's evaluation phase (< 1 minute; ``promtool tsdb
create-blocks-from rules`` backfills at the same phase); and the newest minute is counted once it is evaluated (up to a
minute plus the evaluation's lag behind the raw series). A window's totals are its points' sums.

A window's newest gauges of every instance (the table's gauge columns, who reported at all) would read
every raw scrape of the window: a day of 15 s scrapes is 5,760 samples a series. A second group therefore
records, every ten minutes (``BLOCK_S``), each raw gauge's last value in the ten minutes before it, one
minute back (``BLOCK_LAG_S``: a scrape is written a moment after its time), every label kept, and per
pool how many instances reported in them (the record whose samples say which blocks exist). An
instance's newest gauge in a window is the newest of the raw samples after the window's last block, of
its blocks, and of the raw samples before its first (``promql.Span``).

A window's totals per instance (the table's columns, the ranking's latency quantile) likewise sum a day of
minutes, 1,440 samples a series for each of 256 instances' ~60 count series. A third group records, at
the same ten-minute blocks, each instance's minutes of every count summed over the block: the window's
totals are the sums of its blocks and of the minutes at its two edges, the same minutes counted once.

A day still sums ~140 blocks a series, read from every TSDB block the day spans. The same group therefore
also records, after each block, the last ``ROLLED_BLOCKS`` blocks summed (``rolled_record``: 23 h 40 min,
the most a 24 h window always holds whole): a day's totals are then one sample a series and the minutes
at the window's two edges (``promql.Span``). The rules of a group run in order at one evaluation time, so
each rolled sum holds the block written just before it.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path

import yaml

from relay_engine.core.telemetry import COUNTERS, TIER_LEVEL_GAUGES

RULES_PATH = Path(__file__).resolve().parents[2] / "deploy" / "prometheus" / "relaygr-history-rules.yml"
RECORDED_STEP_S = 60  # the rules' interval: the narrowest point a recorded read answers
GROUP = "relaygr-history"
BLOCK_S = 600  # a block's width: the blocks group's interval, ten recorded minutes
BLOCK_LAG_S = 60  # how far back of its evaluation a block ends
BLOCK_GROUP = "relaygr-history-blocks"
SUMS_GROUP = "relaygr-history-sums"
ROLLED_BLOCKS = 142  # blocks a rolled sum holds: a 24 h window holds 142 or 143 whole, whatever its phase
POOL, INSTANCE = ("pool",), ("pool", "instance")  # the levels the counts are recorded at
# Every count of ``history``'s layout as /metrics exports it: (series, the label it splits by, the
# ``column`` tag ``promql`` reads it back by).
COUNTED: tuple[tuple[str, str | None, str], ...] = (
    *((f"relaygr_{name}_total", None, f"counter:{name}") for name in COUNTERS),
    ("relaygr_preinfer_refusals_total", "reason", "refused"),
    ("relaygr_rank_misses_total", "reason", "missed"),
    ("relaygr_rank_latency_seconds_bucket", "le", "bucket"),
    ("relaygr_rank_latency_seconds_sum", None, "sum"),
)
# The pool gauges: (series, how instances combine, the label it splits by, ``column`` tag). ``present``
# counts the instances with a sample (a pool's ``instances``).
PRESENT = "present"
GAUGED: tuple[tuple[str, str, str | None, str], ...] = (
    *((f"relaygr_tier_{level}", "sum", "tier", f"level:{level}")
      for level in sorted({level for _, level in TIER_LEVEL_GAUGES.values()})),
    ("relaygr_instance_applied_generation", "max", None, "gauge:applied_generation"),
    ("relaygr_rank_requests_total", "count", None, PRESENT),
)


def _level(by: tuple[str, ...], split: str | None) -> str:
    """The record's level, Prometheus's way: the labels it keeps (``pool_reason``), the pool implied."""
    return "_".join((by[-1], *((split,) if split else ())))


def counted_record(series: str, split: str | None, by: tuple[str, ...]) -> str:
    """``pool:relaygr_rank_requests:increase1m``, ``instance_le:relaygr_rank_latency_seconds_bucket:increase1m``."""
    return f"{_level(by, split)}:{series.removesuffix('_total')}:increase1m"


def gauged_record(series: str, combine: str, split: str | None) -> str:
    """``pool_tier:relaygr_tier_bytes:last1m``, ``pool:relaygr_instance_applied_generation:max_last1m``;
    the instances present: ``pool:relaygr_instances:count_last1m``."""
    if combine == "count":
        return f"{_level(POOL, split)}:relaygr_instances:count_last1m"
    return f"{_level(POOL, split)}:{series}:{'last1m' if combine == 'sum' else f'{combine}_last1m'}"


def last_block_record(series: str) -> str:
    """``instance:relaygr_tier_bytes:last10m``: a raw gauge's last value in a block, every label kept (the
    instances' newest gauges over a window read these between its edges)."""
    return f"instance:{series}:last{BLOCK_S // 60}m"


def block_sum_record(series: str, split: str | None) -> str:
    """``instance_le:relaygr_rank_latency_seconds_bucket:increase10m``: an instance's recorded minutes of one
    count summed over a block (a window's totals read these between its edges)."""
    return f"{_level(INSTANCE, split)}:{series.removesuffix('_total')}:increase{BLOCK_S // 60}m"


def rolled_record(series: str, split: str | None) -> str:
    """``instance_le:relaygr_rank_latency_seconds_bucket:increase1420m``: an instance's last ``ROLLED_BLOCKS``
    blocks of one count summed (a day's totals read one of these and the minutes at its edges)."""
    return f"{_level(INSTANCE, split)}:{series.removesuffix('_total')}:increase{ROLLED_BLOCKS * BLOCK_S // 60}m"


# The record whose presence says the rules run on a server (``promql`` checks for it once in a while).
PROBE_RECORD = counted_record("relaygr_rank_requests_total", None, POOL)
# The record whose samples say which blocks a pool has (one series a pool): the instances reporting in each.
BLOCK_PROBE_RECORD = f"pool:relaygr_instances:count_last{BLOCK_S // 60}m"
# The same for the blocks of summed minutes (one series a pool: its requests in each block).
SUMS_PROBE_RECORD = f"pool:relaygr_rank_requests:increase{BLOCK_S // 60}m"
# The same for the rolled sums (one series a pool: its requests in the blocks each one holds).
ROLLED_PROBE_RECORD = f"pool:relaygr_rank_requests:increase{ROLLED_BLOCKS * BLOCK_S // 60}m"


def rules() -> dict:
    def by(labels: tuple[str, ...], split: str | None) -> str:
        return ", ".join((*labels, *((split,) if split else ())))

    recorded = [{"record": counted_record(series, split, level),
                 "expr": f"sum by ({by(level, split)}) (increase({series}[1m]))"}
                for level in (POOL, INSTANCE) for series, split, _ in COUNTED]
    recorded += [{"record": gauged_record(series, combine, split),
                  "expr": f"{combine} by ({by(POOL, split)}) (last_over_time({series}[1m]))"}
                 for series, combine, split, _ in GAUGED]
    # A block at t holds the scrapes in (t - BLOCK_LAG_S - BLOCK_S, t - BLOCK_LAG_S]: the range is a millisecond
    # short of the block so that a scrape on its edge counts in one block only.
    block = f"[{BLOCK_S * 1000 - 1}ms] offset {BLOCK_LAG_S}s"
    blocks = [{"record": last_block_record(series), "expr": f"last_over_time({series}{block})"}
              for series in dict.fromkeys(series for series, _, _, _ in GAUGED)]
    blocks.append({"record": BLOCK_PROBE_RECORD,
                   "expr": f"count by (pool) (last_over_time(relaygr_rank_requests_total{block}))"})
    # The minutes of the same block summed per instance, from the first group's records: a group of its own,
    # since a backfill of it must read the first group's records from a server that already holds them.
    sums = [{"record": block_sum_record(series, split),
             "expr": f"sum_over_time({counted_record(series, split, INSTANCE)}{block})"}
            for series, split, _ in COUNTED]
    sums.append({"record": SUMS_PROBE_RECORD, "expr": f"sum_over_time({PROBE_RECORD}{block})"})
    # The last ROLLED_BLOCKS blocks (this one's included) summed: a range a millisecond short of them, so the
    # block ROLLED_BLOCKS back is not in it.
    rolled = f"[{ROLLED_BLOCKS * BLOCK_S * 1000 - 1}ms]"
    sums += [{"record": rolled_record(series, split), "expr": f"sum_over_time({block_sum_record(series, split)}{rolled})"}
             for series, split, _ in COUNTED]
    sums.append({"record": ROLLED_PROBE_RECORD, "expr": f"sum_over_time({SUMS_PROBE_RECORD}{rolled})"})
    return {"groups": [{"name": GROUP, "interval": f"{RECORDED_STEP_S}s", "rules": recorded},
                       {"name": BLOCK_GROUP, "interval": f"{BLOCK_S}s", "rules": blocks},
                       {"name": SUMS_GROUP, "interval": f"{BLOCK_S}s", "rules": sums}]}


def rolled(rule: dict) -> bool:
    """Whether ``rule`` records a rolled sum (it reads the block sums its group records before it)."""
    return rule["record"] == ROLLED_PROBE_RECORD or rule["record"] in {rolled_record(series, split)
                                                                        for series, split, _ in COUNTED}


def group_rules(name: str, keep: Callable[[dict], bool] | None = None) -> dict:
    """One group of ``rules()`` as a rules file of its own (a backfill of that group alone), or only its rules
    ``keep`` says yes to (a backfill pass of the rules that read what an earlier pass wrote)."""
    groups = [group for group in rules()["groups"] if group["name"] == name]
    if not groups:
        raise ValueError(f"no rules group {name!r}: {GROUP!r}, {BLOCK_GROUP!r} or {SUMS_GROUP!r}")
    if keep is not None:
        groups = [{**group, "rules": [rule for rule in group["rules"] if keep(rule)]} for group in groups]
    return {"groups": groups}


HEADER = """\
# RelayGR's history recording rules, generated by `python -m controlplane.telemetry.recording` from the
# table in controlplane/telemetry/recording.py (edit that, not this). The control plane reads them for
# windows longer than the live one (PROMETHEUS_URL): per pool and per instance, each minute's increase
# of every count its history views need, and the pool's gauges. Without them it reads the raw series,
# slower at fleet scale. After loading them into a Prometheus that already holds history, backfill them:
#   promtool tsdb create-blocks-from rules --start <first day> --end <now> \\
#     --url http://prometheus:9090 deploy/prometheus/relaygr-history-rules.yml
# then move the blocks it writes (./data/) into the server's --storage.tsdb.path, restart it, and run the
# same command twice more, moving the blocks and restarting after each: the relaygr-history-sums group sums
# the first group's minutes, then its own blocks (the rolled sums), so each of its records is written only
# once the server holds what it reads (what a later run writes again is the same samples, merged away by
# the server's compaction).
"""


def rendered() -> str:
    return HEADER + yaml.safe_dump(rules(), sort_keys=False, width=200)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--check", action="store_true", help="exit 1 when the committed rules file is stale")
    args = parser.parse_args(argv)
    text = rendered()
    if args.check:
        if not RULES_PATH.exists() or RULES_PATH.read_text() != text:
            print(f"{RULES_PATH} is stale: run python -m controlplane.telemetry.recording", file=sys.stderr)
            return 1
        return 0
    RULES_PATH.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
