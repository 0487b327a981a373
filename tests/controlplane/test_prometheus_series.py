"""/metrics as Prometheus takes it: the real exposition of a small fleet (two instances, every cache
tier, a rollout rolled back) parsed by prometheus_client and checked by ``promtool check metrics``;
label sets stable and bounded by the fleet's shape; counters restart-safe through ``_created``;
buckets that resolve the SLO; and every series the shipped rules and dashboards read is one the
exposition has."""

from __future__ import annotations

import re
import time
from datetime import UTC, datetime
from pathlib import Path

import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from controlplane.rollouts.models import Rollout
from controlplane.telemetry import grafana
from relay_engine.core.config import PolicySpec
from relay_engine.core.outcomes import TIERS
from relay_engine.core.telemetry import LATENCY_BUCKETS_MS, MISS_REASONS, REFUSAL_REASONS, MissReason
from tests.deploy.test_grafana_dashboards import concrete, rendered
from tests.promtool import promtool

from .fleet_helpers import snapshot
from .test_telemetry import POOL, _publish_two_instances

ROOT = Path(__file__).resolve().parents[2]
RULES = ROOT / "deploy" / "prometheus" / "relaygr-rules.yml"
# The labels a series may carry: each bounded by the fleet (pools, instances, tiers, reasons,
# rollout states), none by its users or requests.
FLEET_LABELS = {"pool", "instance", "tier", "reason", "state"}


# The misses of the tiered instance, by reason (they sum to its 3 misses).
TIERED_MISSES = {MissReason.EVICTED_DRAM: 2, MissReason.NOT_ADMITTED_NOT_AT_RISK: 1}


@pytest.fixture
def exposition(viewer, pool, worker_factory) -> str:
    now = time.time()
    fast, _ = _publish_two_instances(worker_factory, now)
    fast.reconcile()
    fast.status.tiers = {tier.value: {"bytes": 300, "budget_bytes": 1000} for tier in TIERS}  # as a running engine says
    fast.heartbeat()
    tiered = worker_factory(POOL, 2)
    snap = snapshot(tiered.name, now, now - 10, rank_requests=6, disk_hits=2, evictions=1, misses=3)
    snap.misses = dict(TIERED_MISSES)
    snap.tiers = {tier.value: {"bytes": 700, "budget_bytes": 1000, "hits": 5} for tier in TIERS}
    tiered.publish_snapshot(snap)
    started = datetime.fromtimestamp(now - 60, tz=UTC)
    Rollout.objects.create(pool=pool, generation=2, stable_generation=1, canary_instances=[fast.name], bake_s=30,
                           max_burn=1.0, state=Rollout.State.ROLLED_BACK, started_by="fixture", started_at=started,
                           bake_ends_at=started, decided_at=started, decided_by="fixture")
    response = viewer.get("/metrics")
    assert response.status_code == 200
    return response.content.decode()


def _families(text: str) -> dict:
    return {family.name: family for family in text_string_to_metric_families(text)}


def test_promtool_check_metrics_reports_no_problem(exposition):
    result = promtool("check", "metrics", stdin=exposition.encode())
    assert (result.returncode, result.stdout + result.stderr) == (0, b"")


def test_the_exposition_has_every_kind_of_series(exposition):
    families = _families(exposition)
    assert len(families) > 35
    kinds = {family.type for family in families.values()}
    assert {"counter", "gauge", "histogram"} <= kinds
    assert all(family.samples for name, family in families.items()
               if name.startswith(("relaygr_tier_", "relaygr_preinfer_", "relaygr_rank_", "relaygr_pool_"))), \
        "a family without a sample: the fixture does not exercise it"


def test_each_family_keeps_one_label_set_of_fleet_labels(exposition):
    for name, family in _families(exposition).items():
        label_sets = {frozenset(set(s.labels) - {"le"}) for s in family.samples}
        assert len(label_sets) <= 1, f"{name} mixes label sets {label_sets}"
        for labels in label_sets:
            assert labels <= FLEET_LABELS, f"{name} carries {set(labels) - FLEET_LABELS}"


def test_reason_tier_and_state_values_are_the_cores_words(exposition):
    values: dict[str, set[str]] = {"reason": set(), "tier": set(), "state": set()}
    for family in _families(exposition).values():
        for sample in family.samples:
            for label, seen in values.items():
                if label in sample.labels:
                    seen.add(sample.labels[label])
    assert values["reason"] == {reason.value for reason in (*REFUSAL_REASONS, *MISS_REASONS)}
    assert values["tier"] == {tier.value for tier in TIERS}
    assert values["state"] == set(Rollout.State.values) - {Rollout.State.BAKING}


def test_misses_by_reason_are_one_counter_per_reason_summing_to_the_misses(exposition):
    families = _families(exposition)
    tiered = {s.labels["reason"]: s.value for s in families["relaygr_rank_misses"].samples
              if s.name == "relaygr_rank_misses_total" and s.labels["instance"].endswith(".2")}
    assert set(tiered) == {reason.value for reason in MISS_REASONS}
    assert {reason: n for reason, n in tiered.items() if n} == TIERED_MISSES
    misses = {s.labels["instance"]: s.value for s in families["relaygr_misses"].samples if s.name.endswith("_total")}
    assert sum(tiered.values()) == next(n for instance, n in misses.items() if instance.endswith(".2")) == 3


def test_every_counter_and_the_histogram_carry_their_runs_start_as_created(exposition):
    families = _families(exposition)
    starts = {s.labels["instance"]: s.value for s in families["relaygr_instance_start_time_seconds"].samples}
    checked = 0
    for name, family in families.items():
        if family.type not in ("counter", "histogram") or not family.samples:
            continue
        created = families.get(f"{name}_created")
        assert created is not None, f"{name} has no _created"
        counted = {frozenset(s.labels.items()) for s in family.samples if "le" not in s.labels
                   and s.name in (f"{name}_total", f"{name}_count")}
        assert {frozenset(s.labels.items()) for s in created.samples} == counted, name
        for sample in created.samples:
            if "instance" in sample.labels:
                assert sample.value == starts[sample.labels["instance"]], name
        checked += 1
    assert checked > 20


def test_the_latency_buckets_resolve_the_slo(exposition):
    latency = _families(exposition)["relaygr_rank_latency_seconds"]
    bounds = sorted({float(s.labels["le"]) for s in latency.samples if "le" in s.labels} - {float("inf")})
    assert bounds == pytest.approx([b / 1000 for b in LATENCY_BUCKETS_MS])
    default_slo_s = PolicySpec().trigger.ranking_p99_slo_ms / 1000
    assert default_slo_s == pytest.approx(min(bounds, key=lambda b: abs(b - default_slo_s)))
    # Any objective from 1 ms to 10 s lies in a bucket at most a third wider than its lower bound.
    widths = [upper / lower for lower, upper in zip(bounds, bounds[1:], strict=False) if 1e-3 <= lower <= 10]
    assert widths and max(widths) < 1.34


# --- the rules and dashboards read only what the exposition has ---------------------------------------------------

_NAME = re.compile(r"[a-zA-Z_:][a-zA-Z0-9_:]*")
_GROUPING = re.compile(r"\b(?:by|on|without|ignoring|group_left|group_right)\s*\(([^)]*)\)")
_MATCHER = re.compile(r"([a-zA-Z_][a-zA-Z0-9_]*)\s*(?:=~|!~|!=|=)\s*\"")


def series_names(expr: str) -> set[str]:
    """The series an expression reads: ours (``relaygr_…``) and recorded ones (``level:metric:op``)."""
    bare = re.sub(r'"[^"]*"', '""', expr)
    return {n for n in _NAME.findall(bare) if n.startswith("relaygr_") or n.count(":") == 2}


def label_names(expr: str) -> set[str]:
    bare = re.sub(r'"[^"]*"', '""', expr)
    grouped = {label.strip() for labels in _GROUPING.findall(bare) for label in labels.split(",") if label.strip()}
    return grouped | set(_MATCHER.findall(re.sub(r'(?<==)"[^"]*"', '""', expr)))


def exposed(text: str) -> tuple[set[str], set[str]]:
    """Sample names and label names of an exposition."""
    samples = [s for family in text_string_to_metric_families(text) for s in family.samples]
    return {s.name for s in samples}, {label for s in samples for label in s.labels}


def check_reads(exprs: dict[str, str], names: set[str], labels: set[str], recorded: set[str]) -> list[str]:
    """Each expression's series and labels that neither the exposition nor a recording rule has."""
    problems = []
    for where, expr in exprs.items():
        problems += [f"{where}: series {n}" for n in sorted(series_names(expr) - names - recorded)]
        problems += [f"{where}: label {lb}" for lb in sorted(label_names(expr) - labels)]
    return problems


def rules() -> list[dict]:
    return [rule for group in yaml.safe_load(RULES.read_text())["groups"] for rule in group["rules"]]


def test_every_rule_reads_only_series_and_labels_the_exposition_has(exposition):
    names, labels = exposed(exposition)
    recorded = {rule["record"] for rule in rules() if "record" in rule}
    exprs = {rule.get("record") or rule["alert"]: rule["expr"] for rule in rules()}
    assert len(exprs) > 20
    assert check_reads(exprs, names, labels, recorded) == []


def test_every_dashboard_query_reads_only_series_and_labels_the_exposition_has(exposition):
    names, labels = exposed(exposition)
    recorded = {rule["record"] for rule in rules() if "record" in rule}
    exprs = {f"{name} {where}": concrete(expr) for name, dashboard in rendered().items()
             for where, expr in grafana.expressions(dashboard).items()}
    assert len(exprs) > 30
    assert check_reads(exprs, names, labels, recorded) == []


def test_the_read_check_catches_a_series_and_a_label_that_are_not_there(exposition):
    names, labels = exposed(exposition)
    assert check_reads({"x": 'sum by (user) (rate(relaygr_rank_request_total{pool="a"}[5m]))'}, names, labels,
                       set()) == ["x: series relaygr_rank_request_total", "x: label user"]
