"""Grafana dashboards as code: the pool view and the fleet view over ``/metrics``, built with Grafana's
own SDK (grafana-foundation-sdk, the ``dashboards`` extra) and committed as JSON under
``deploy/grafana/dashboards/``.

    python -m controlplane.telemetry.grafana            # rewrite the committed JSON
    python -m controlplane.telemetry.grafana --check    # exit 1 when the committed JSON is stale

Every expression reads the raw series of ``controlplane/telemetry/prometheus.py`` (no recording rule
needed, so a Prometheus without ``deploy/prometheus/relaygr-rules.yml`` still draws them). Per-tier
figures go through the generic ``tier`` label and lookup outcomes through ``OUTCOME_COUNTERS``, so a
new tier or outcome shows with no change here. Stdlib, the SDK and the core's words only: no Django.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from grafana_foundation_sdk.builders import dashboard as gd
from grafana_foundation_sdk.builders import prometheus, stat, timeseries
from grafana_foundation_sdk.cog.encoder import JSONEncoder
from grafana_foundation_sdk.models.dashboard import (
    DashboardCursorSync,
    DataSourceRef,
    Threshold,
    ThresholdsMode,
    VariableRefresh,
    VariableSort,
)

from relay_engine.core.outcomes import OUTCOME_COUNTERS
from relay_engine.core.telemetry import RefusalReason

OUT_DIR = Path(__file__).resolve().parents[2] / "deploy" / "grafana" / "dashboards"
DATASOURCE = DataSourceRef(type_val="prometheus", uid="${datasource}")
RATE = "$__rate_interval"
POOL = 'pool="$pool"'
# Burn rates of the multi-window alerts (deploy/prometheus/relaygr-rules.yml): fast 14.4x, slow 6x.
FAST_BURN, SLOW_BURN = 14.4, 6.0
NOT_A_REFUSAL = [reason.value for reason in RefusalReason if not reason.is_refusal]


def _query(expr: str, legend: str, ref: str) -> prometheus.Dataquery:
    return prometheus.Dataquery().expr(expr).legend_format(legend).ref_id(ref).datasource(DATASOURCE)


def _chart(title: str, unit: str, queries: list[tuple[str, str]], *, description: str = "",
           width: int = 12) -> timeseries.Panel:
    panel = timeseries.Panel().title(title).unit(unit).datasource(DATASOURCE).height(8).span(width)
    if description:
        panel = panel.description(description)
    for i, (expr, legend) in enumerate(queries):
        panel = panel.with_target(_query(expr, legend, chr(ord("A") + i)))
    return panel


def _rate(metric: str, selector: str, by: str = "") -> str:
    grouping = f" by ({by})" if by else ""
    return f"sum{grouping} (rate({metric}{{{selector}}}[{RATE}]))"


def _p(quantile: float, selector: str, by: str = "") -> str:
    group = f"{by}, le" if by else "le"
    return f"histogram_quantile({quantile}, {_rate('relaygr_rank_latency_seconds_bucket', selector, group)})"


def _bad_share(selector: str, window: str, by: str) -> str:
    return (f"(1 - sum by ({by}) (rate(relaygr_rank_within_slo_total{{{selector}}}[{window}]))"
            f" / sum by ({by}) (rate(relaygr_rank_requests_total{{{selector}}}[{window}])))")


def _variables(*, with_pool: bool) -> list:
    variables = [gd.DatasourceVariable("datasource").label("Prometheus").type("prometheus")]
    if with_pool:
        variables.append(
            gd.QueryVariable("pool").label("Pool").datasource(DATASOURCE)
            .query("label_values(relaygr_pool_desired_generation, pool)")
            .refresh(VariableRefresh.ON_TIME_RANGE_CHANGED).sort(VariableSort.ALPHABETICAL_ASC))
        variables.append(
            gd.QueryVariable("tier").label("Cache tier").datasource(DATASOURCE)
            .query(f"label_values(relaygr_tier_budget_bytes{{{POOL}}}, tier)")
            .refresh(VariableRefresh.ON_TIME_RANGE_CHANGED).multi(True).include_all(True))
    return variables


def _rollout_annotations(selector: str) -> list[gd.AnnotationQuery]:
    """Publishes, canaries baking and canary decisions, drawn on every chart."""
    marks = (
        ("Publishes", "#5794F2", f"changes(relaygr_pool_desired_generation{{{selector}}}[2m]) > 0"),
        ("Canary baking", "#FADE2A", f"relaygr_pool_rollout_baking{{{selector}}} == 1"),
        ("Canary decided", "#F2495C", f"increase(relaygr_pool_rollouts_decided_total{{{selector}}}[2m]) > 0"),
    )
    return [gd.AnnotationQuery().name(name).datasource(DATASOURCE).enable(True).icon_color(color).expr(expr)
            for name, color, expr in marks]


def pool_dashboard() -> gd.Dashboard:
    lookups = " + ".join(_rate(f"relaygr_{counter}_total", POOL) for counter in OUTCOME_COUNTERS.values())
    refused = POOL + "".join(f',reason!="{value}"' for value in NOT_A_REFUSAL)
    resident = POOL + f',reason=~"{"|".join(NOT_A_REFUSAL)}"'
    burn_thresholds = (gd.ThresholdsConfig().mode(ThresholdsMode.ABSOLUTE)
                       .steps([Threshold(value=None, color="green"), Threshold(value=SLOW_BURN, color="orange"),
                               Threshold(value=FAST_BURN, color="red")]))
    budget = f"(1 - max(relaygr_pool_slo_target_ratio{{{POOL}}}))"
    burns = [(f"max({_bad_share(POOL, window, 'pool')}) / {budget}", f"burn {window}")
             for window in ("5m", "30m", "1h", "6h")]
    return (
        gd.Dashboard("RelayGR pool").uid("relaygr-pool").tags(["relaygr"]).refresh("30s").time("now-6h", "now")
        .tooltip(DashboardCursorSync.CROSSHAIR).timezone("browser").readonly()
        .description("One pool: latency against its SLO, the error budget, throughput, cache tiers, "
                     "lookups and pre-inference. Generated by controlplane/telemetry/grafana.py.")
        .variables(_variables(with_pool=True))
        .annotations(_rollout_annotations(POOL))
        .with_row(gd.Row("SLO"))
        .with_panel(_chart("Ranking latency against the SLO", "s", [
            (_p(0.99, POOL), "P99"), (_p(0.5, POOL), "P50"),
            (f"max(relaygr_pool_slo_seconds{{{POOL}}})", "SLO (P99)"),
        ], description="Quantiles of the instances' buckets summed, never an average of their quantiles."))
        .with_panel(_chart("Requests within the SLO", "percentunit", [
            (f"{_rate('relaygr_rank_within_slo_total', POOL)} / {_rate('relaygr_rank_requests_total', POOL)}",
             "within SLO"),
            (f"max(relaygr_pool_slo_target_ratio{{{POOL}}})", "target"),
        ]))
        .with_panel(_chart("Error budget burn rate", "x", burns, description=(
            f"Bad share over each window divided by the budget (1 - target). The alerts page at {FAST_BURN:g}x "
            f"on 1 h and 5 m, and at {SLOW_BURN:g}x on 6 h and 30 m.")).thresholds(burn_thresholds))
        .with_panel(_chart("Throughput", "reqps", [
            (_rate("relaygr_rank_requests_total", POOL), "requests"),
            (_rate("relaygr_rank_within_slo_total", POOL), "within SLO"),
            (_rate("relaygr_rank_errors_total", POOL), "errors"),
            (_rate("relaygr_rank_deadline_exceeded_total", POOL), "past deadline (failed fast)"),
        ]))
        .with_row(gd.Row("Cache tiers"))
        .with_panel(_chart("$tier: bytes against budget", "bytes", [
            ('sum by (tier) (relaygr_tier_bytes{pool="$pool",tier=~"$tier"})', "{{tier}} resident"),
            ('sum by (tier) (relaygr_tier_budget_bytes{pool="$pool",tier=~"$tier"})', "{{tier}} budget"),
        ], width=8, description="One chart per tier the pool's instances run (the tier variable)."
        ).repeat("tier").repeat_direction("h").max_per_row(3))
        .with_row(gd.Row("Lookups"))
        .with_panel(_chart("Lookups served, by outcome", "percentunit", [
            (f"{_rate(f'relaygr_{counter}_total', POOL)} / ({lookups})", outcome.label)
            for outcome, counter in OUTCOME_COUNTERS.items()
        ], description="Where each ranking request's prefix came from; the shares add up to 1."))
        .with_panel(_chart("Tier hits, by tier", "ops", [
            (_rate("relaygr_tier_hits_total", POOL, "tier"), "{{tier}}"),
            (_rate("relaygr_tier_evictions_total", POOL, "tier"), "{{tier}} evictions"),
        ]))
        .with_row(gd.Row("Pre-inference"))
        .with_panel(_chart("Pre-infer signals admitted and refused", "ops", [
            (_rate("relaygr_preinfer_signals_total", POOL), "signals"),
            (_rate("relaygr_preinfer_admitted_total", POOL), "admitted"),
            (_rate("relaygr_preinfer_refusals_total", refused, "reason"), "refused: {{reason}}"),
            (_rate("relaygr_preinfer_refusals_total", resident), "already resident (not a refusal)"),
        ]))
        .with_panel(_chart("Worst instances by P99", "s", [
            (f"topk(5, {_p(0.99, POOL, 'instance')})", "{{instance}}"),
            (f"max(relaygr_pool_slo_seconds{{{POOL}}})", "SLO (P99)"),
        ]))
    )


def fleet_dashboard() -> gd.Dashboard:
    everything = 'pool=~".+"'
    return (
        gd.Dashboard("RelayGR fleet").uid("relaygr-fleet").tags(["relaygr"]).refresh("30s").time("now-6h", "now")
        .tooltip(DashboardCursorSync.CROSSHAIR).timezone("browser").readonly()
        .description("Every pool side by side: SLO, instances, configuration and rollouts. Generated by "
                     "controlplane/telemetry/grafana.py.")
        .variables(_variables(with_pool=False))
        .annotations(_rollout_annotations(everything))
        .with_panel(stat.Panel().title("Control plane reaches Redis").datasource(DATASOURCE).height(4).span(6)
                    .with_target(_query("min(relaygr_redis_up)", "Redis", "A")))
        .with_panel(stat.Panel().title("Canaries baking").datasource(DATASOURCE).height(4).span(6)
                    .with_target(_query("sum(max by (pool) (relaygr_pool_rollout_baking))", "baking", "A")))
        .with_panel(stat.Panel().title("Instances NACKing").datasource(DATASOURCE).height(4).span(6)
                    .with_target(_query("sum(relaygr_instance_config_nacked)", "NACK", "A")))
        .with_panel(stat.Panel().title("Pools not converged").datasource(DATASOURCE).height(4).span(6)
                    .with_target(_query("count(min by (pool) (relaygr_pool_converged) == 0) or vector(0)",
                                        "unconverged", "A")))
        .with_panel(_chart("P99 by pool", "s", [
            (_p(0.99, everything, "pool"), "{{pool}}"),
            ("max by (pool) (relaygr_pool_slo_seconds)", "{{pool}} SLO"),
        ]))
        .with_panel(_chart("Requests within the SLO, by pool", "percentunit", [
            (f"{_rate('relaygr_rank_within_slo_total', everything, 'pool')} / "
             f"{_rate('relaygr_rank_requests_total', everything, 'pool')}", "{{pool}}"),
        ]))
        .with_panel(_chart("Requests by pool", "reqps", [
            (_rate("relaygr_rank_requests_total", everything, "pool"), "{{pool}}"),
        ]))
        .with_panel(_chart("Error budget burn (1 h), by pool", "x", [
            (f"{_bad_share(everything, '1h', 'pool')} / on (pool) "
             "(1 - max by (pool) (relaygr_pool_slo_target_ratio))", "{{pool}}"),
        ]))
        .with_panel(_chart("Live instances against expected", "short", [
            ("max by (pool) (relaygr_pool_live_instances)", "{{pool}} live"),
            ("max by (pool) (relaygr_pool_expected_instances)", "{{pool}} expected"),
        ]))
        .with_panel(_chart("Generations: desired, published, applied", "short", [
            ("max by (pool) (relaygr_pool_desired_generation)", "{{pool}} desired"),
            ("max by (pool) (relaygr_pool_published_generation)", "{{pool}} published"),
            ("min by (pool) (relaygr_instance_applied_generation)", "{{pool}} lowest applied"),
        ]))
        .with_panel(_chart("HBM occupancy against budget, by pool", "percentunit", [
            ("sum by (pool) (relaygr_instance_hbm_bytes) / sum by (pool) (relaygr_instance_hbm_budget_bytes)",
             "{{pool}} HBM"),
            ("sum by (pool) (relaygr_instance_dram_bytes) / sum by (pool) (relaygr_instance_dram_budget_bytes)",
             "{{pool}} DRAM"),
        ]))
        .with_panel(_chart("Heartbeat age, oldest instance", "s", [
            ("max by (pool) (relaygr_instance_heartbeat_age_seconds)", "{{pool}}"),
        ]))
    )


DASHBOARDS = {"relaygr-pool.json": pool_dashboard, "relaygr-fleet.json": fleet_dashboard}


def expressions(dashboard: dict) -> dict[str, str]:
    """Every PromQL expression a rendered dashboard runs, by where it is: panels' queries, variables'
    ``label_values`` selectors and annotations."""
    found = {}
    for panel in dashboard.get("panels", []):
        for target in panel.get("targets", []):
            found[f"panel {panel['title']!r} query {target['refId']}"] = target["expr"]
    for variable in dashboard.get("templating", {}).get("list", []):
        if variable.get("type") == "query":
            query = variable["query"]
            found[f"variable {variable['name']}"] = query[len("label_values("):query.rindex(",")]
    for annotation in dashboard.get("annotations", {}).get("list", []):
        if annotation.get("expr"):
            found[f"annotation {annotation['name']!r}"] = annotation["expr"]
    return found


def render(build) -> str:
    """A dashboard as committed: the SDK's JSON, keys sorted, two-space indent, a final newline."""
    return json.dumps(build().build(), cls=JSONEncoder, indent=2, sort_keys=True) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=OUT_DIR, help="folder of the dashboards' JSON")
    parser.add_argument("--check", action="store_true", help="exit 1 when a committed file differs")
    args = parser.parse_args(argv)
    stale = []
    for name, build in DASHBOARDS.items():
        path, text = args.out / name, render(build)
        if args.check:
            if not path.exists() or path.read_text() != text:
                stale.append(str(path))
            continue
        args.out.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
        print(f"wrote {path}")
    if stale:
        print("stale (run python -m controlplane.telemetry.grafana): " + ", ".join(stale), file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
