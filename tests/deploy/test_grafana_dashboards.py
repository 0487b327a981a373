"""The committed Grafana dashboards (deploy/grafana/dashboards/) are the generator's output, every
query in them parses as PromQL, and the panels fit Grafana's 24-column grid. That they read only
series /metrics has: tests/controlplane/test_prometheus_series.py."""

from __future__ import annotations

import json

import pytest
import yaml

from controlplane.telemetry import grafana
from tests.promtool import promtool

# What Grafana puts in place of its variables before Prometheus sees a query.
GRAFANA_VARIABLES = {"$__rate_interval": "5m", "${datasource}": "prometheus", "$pool": "ranking-a", "$tier": ".*"}


def concrete(expr: str) -> str:
    for variable, value in GRAFANA_VARIABLES.items():
        expr = expr.replace(variable, value)
    return expr


def rendered() -> dict[str, dict]:
    return {name: json.loads(grafana.render(build)) for name, build in grafana.DASHBOARDS.items()}


@pytest.mark.parametrize("name", grafana.DASHBOARDS)
def test_the_committed_json_is_the_generators_output(name):
    committed = grafana.OUT_DIR / name
    assert committed.exists(), f"{committed} missing: python -m controlplane.telemetry.grafana"
    assert committed.read_text() == grafana.render(grafana.DASHBOARDS[name]), \
        f"{committed} is stale: python -m controlplane.telemetry.grafana"


def test_the_check_flag_fails_on_a_stale_file(tmp_path, capsys):
    assert grafana.main(["--out", str(tmp_path)]) == 0
    assert grafana.main(["--out", str(tmp_path), "--check"]) == 0
    (tmp_path / "relaygr-pool.json").write_text("{}\n")
    assert grafana.main(["--out", str(tmp_path), "--check"]) == 1
    assert "relaygr-pool.json" in capsys.readouterr().err


def test_every_query_parses_as_promql(tmp_path):
    """promtool parses each expression as the body of a recording rule."""
    rules = [{"record": f"relaygr_dashboard:query_{i}", "expr": concrete(expr)}
             for i, expr in enumerate(expr for dashboard in rendered().values()
                                      for expr in grafana.expressions(dashboard).values())]
    assert len(rules) > 30
    path = tmp_path / "dashboard-queries.yml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "dashboards", "rules": rules}]}))
    result = promtool("check", "rules", str(path))
    assert result.returncode == 0, result.stdout.decode() + result.stderr.decode()


def test_the_pool_view_draws_what_an_sre_asks_of_it():
    pool = rendered()["relaygr-pool.json"]
    titles = {panel["title"] for panel in pool["panels"]}
    assert {"Ranking latency against the SLO", "Requests within the SLO", "Throughput", "$tier: bytes against budget",
            "Lookups served, by outcome", "Pre-infer signals admitted and refused"} <= titles
    assert {a["name"] for a in pool["annotations"]["list"]} == {"Publishes", "Canary baking", "Canary decided"}
    queries = " ".join(grafana.expressions(pool).values())
    assert "relaygr_pool_slo_seconds" in queries and "by (reason)" in queries and "by (tier)" in queries


@pytest.mark.parametrize("name", grafana.DASHBOARDS)
def test_panels_fit_the_grid_without_overlapping(name):
    taken = set()
    for panel in rendered()[name]["panels"]:
        box = panel["gridPos"]
        assert box["x"] + box["w"] <= 24, panel["title"]
        cells = {(x, y) for x in range(box["x"], box["x"] + box["w"]) for y in range(box["y"], box["y"] + box["h"])}
        assert not cells & taken, f"{panel['title']} overlaps another panel"
        taken |= cells
