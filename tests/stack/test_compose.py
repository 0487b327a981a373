"""docker-compose.yml refers only to things that exist: modules, management commands, settings, the files
Prometheus and Grafana mount (and the Prometheus configuration passes ``promtool check config``)."""

from __future__ import annotations

import ast
import importlib.util
import re
import shlex
from pathlib import Path

import pytest
import yaml
from django.core.management import get_commands

from relay_engine.core.wire import CONTROLPLANE_QUEUES, controlplane_queue
from tests.promtool import promtool

ROOT = Path(__file__).resolve().parents[2]
PROJECT_DIRS = ("relay_engine", "workers", "controlplane", "frontend")


@pytest.fixture(scope="module")
def compose() -> dict:
    return yaml.safe_load((ROOT / "docker-compose.yml").read_text())


def project_services(compose: dict) -> dict[str, dict]:
    return {name: svc for name, svc in compose["services"].items() if svc.get("image") == "relaygr:latest"}


def command_words(service: dict) -> list[str]:
    command = service["command"]
    text = command if isinstance(command, str) else shlex.join(command)
    if text.startswith("sh -c "):
        text = shlex.split(text)[2]
    return [w for part in re.split(r"&&|;", text) for w in shlex.split(part)]


def env_names_read_by_the_project() -> set[str]:
    """Every upper-case string constant in a module that reads the environment."""
    names: set[str] = set()
    files = [ROOT / "manage.py"] + [p for d in PROJECT_DIRS for p in (ROOT / d).rglob("*.py")]
    for path in files:
        source = path.read_text()
        if "environ" not in source and "getenv" not in source:
            continue
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and re.fullmatch(r"[A-Z][A-Z0-9_]{2,}",
                                                                                                node.value):
                names.add(node.value)
    return names


def test_the_expected_services_are_there(compose):
    assert {"redis", "postgres", "web", "worker", "beat", "controlplane-bake", "controlplane-previews",
            "traffic"} <= set(compose["services"])
    assert "traffic" in compose["services"]["traffic"]["profiles"]
    for name in ("redis", "postgres", "web", "worker"):
        assert "healthcheck" in compose["services"][name], name
    assert "pgdata" in compose["volumes"]


def test_every_command_names_a_real_module_or_management_command(compose):
    commands = get_commands()
    checked = 0
    for name, service in project_services(compose).items():
        words = command_words(service)
        for i, word in enumerate(words):
            if word == "-m":
                module = words[i + 1]
                assert importlib.util.find_spec(module) is not None, f"{name}: no module {module}"
                checked += 1
            elif word == "manage.py":
                assert words[i + 1] in commands, f"{name}: no management command {words[i + 1]}"
                checked += 1
            elif word == "-A":  # a Celery app: celery -A module worker
                assert importlib.util.find_spec(words[i + 1]) is not None, f"{name}: no Celery app {words[i + 1]}"
                checked += 1
            elif ":application" in word:
                module = word.split(":")[0]
                assert importlib.util.find_spec(module) is not None, f"{name}: no WSGI module {module}"
                checked += 1
    assert checked >= 7


def test_every_variable_set_for_the_project_is_one_it_reads(compose):
    read = env_names_read_by_the_project()
    for name, service in project_services(compose).items():
        for variable in service.get("environment", {}):
            assert variable in read, f"{name} sets {variable}, which nothing in the project reads"


def test_workers_claim_their_own_index_when_scaled(compose):
    assert command_words(compose["services"]["worker"])[-2:] == ["--index", "auto"]


def test_the_bake_and_the_previews_have_a_control_plane_worker_each(compose):
    """Each consumes one of the control plane's queues (named for the compose file's key prefix), so no
    preview can hold the bake's evaluation; the bake's carries the one beat."""
    prefix = compose["x-app"]["environment"]["RELAYGR_KEY_PREFIX"]
    consumed = {}
    for name in ("controlplane-bake", "controlplane-previews"):
        words = command_words(compose["services"][name])
        assert words[:4] == ["celery", "-A", "controlplane.celery_app", "worker"] and words.count("--queues") == 1
        consumed[name] = (words[words.index("--queues") + 1], "--beat" in words)
    assert consumed == {"controlplane-bake": (controlplane_queue("periodic", prefix), True),
                        "controlplane-previews": (controlplane_queue("previews", prefix), False)}
    assert {queue for queue, _ in consumed.values()} == {controlplane_queue(kind, prefix) for kind in CONTROLPLANE_QUEUES}


# --- Prometheus and Grafana beside the stack (not run here: the files they read are checked) -------------------

def _mounts(service: dict) -> dict[str, str]:
    """Mount target → source (a named volume, or a path relative to the repository) of a service."""
    return {target: source for source, target, *_ in (volume.split(":") for volume in service.get("volumes", []))}


def test_every_bind_mount_names_a_path_in_the_repository(compose):
    checked = 0
    for name, service in compose["services"].items():
        for source in _mounts(service).values():
            if source.startswith("./"):
                assert (ROOT / source).exists(), f"{name} mounts {source}, which the repository does not have"
                checked += 1
            else:
                assert source in compose["volumes"], f"{name} mounts an undeclared volume {source}"
    assert checked >= 3


def test_prometheus_scrapes_web_with_the_token_its_volume_holds(compose, tmp_path):
    services = compose["services"]
    prometheus = services["prometheus"]
    config_path = next(arg.split("=", 1)[1] for arg in prometheus["command"] if arg.startswith("--config.file="))
    config_dir, config_name = config_path.rsplit("/", 1)
    config = yaml.safe_load((ROOT / _mounts(prometheus)[config_dir] / config_name).read_text())
    (job,) = config["scrape_configs"]
    example = yaml.safe_load((ROOT / "deploy" / "prometheus" / "prometheus.yml").read_text())["scrape_configs"][0]
    # The example's job but for where the control plane and the token are.
    differs = ("static_configs", "authorization")
    assert {k: v for k, v in job.items() if k not in differs} == {k: v for k, v in example.items() if k not in differs}
    assert job["authorization"]["type"] == example["authorization"]["type"]
    assert job["static_configs"] == [{"targets": ["web:8000"]}]
    assert "web" in compose["x-app"]["environment"]["DJANGO_ALLOWED_HOSTS"]
    assert services["web"]["environment"]["RELAYGR_METRICS_PLAIN_HTTP"] == "1"
    # The token file is the one the prometheus-token service writes into the volume both mount.
    token_dir, token_name = job["authorization"]["credentials_file"].rsplit("/", 1)
    volume = _mounts(prometheus)[token_dir]
    writer = services["prometheus-token"]
    written_in = next(target for target, source in _mounts(writer).items() if source == volume)
    assert f"> {written_in}/{token_name}" in writer["command"] and "--read-only" in writer["command"]
    assert prometheus["depends_on"]["prometheus-token"]["condition"] == "service_completed_successfully"

    # promtool checks the configuration with the rules beside it and a token where the volume would be.
    for path in (ROOT / _mounts(prometheus)[config_dir]).glob("*.yml"):
        (tmp_path / path.name).write_text(path.read_text())
    (tmp_path / "prometheus.token").write_text("rgr_example\n")
    job["authorization"]["credentials_file"] = str(tmp_path / "prometheus.token")
    (tmp_path / config_name).write_text(yaml.safe_dump(config))
    result = promtool("check", "config", str(tmp_path / config_name))
    assert result.returncode == 0, result.stdout.decode() + result.stderr.decode()
    # The alerting rules and the history's recording rules, both loaded.
    assert b"SUCCESS: 2 rule files found" in result.stdout + result.stderr
    assert b"relaygr-rules.yml" in result.stdout and b"relaygr-history-rules.yml" in result.stdout


def test_grafana_provisions_the_compose_prometheus_and_the_committed_dashboards(compose):
    grafana = compose["services"]["grafana"]
    mounts = _mounts(grafana)
    provisioning = ROOT / mounts["/etc/grafana/provisioning"]
    (source,) = yaml.safe_load((provisioning / "datasources" / "relaygr.yml").read_text())["datasources"]
    assert (source["type"], source["url"], source["isDefault"]) == ("prometheus", "http://prometheus:9090", True)
    assert "127.0.0.1:9090:9090" in compose["services"]["prometheus"]["ports"]
    (provider,) = yaml.safe_load((provisioning / "dashboards" / "relaygr.yml").read_text())["providers"]
    dashboards = ROOT / mounts[provider["options"]["path"]]
    assert dashboards == ROOT / "deploy" / "grafana" / "dashboards"
    assert sorted(p.name for p in dashboards.glob("*.json")) == ["relaygr-fleet.json", "relaygr-pool.json"]
    assert grafana["depends_on"]["prometheus"]["condition"] == "service_started"
