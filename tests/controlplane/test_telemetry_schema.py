"""The OpenAPI schema types the telemetry answers (objects with their properties, not a bare object),
and what the telemetry endpoints answer from real Redis conforms to it: no key the schema does not
name, none it requires missing, every value of its type."""

from __future__ import annotations

import time

import pytest

from relay_engine.core.telemetry import REFUSAL_REASONS

from .fleet_helpers import snapshot
from .test_forward_times import plant, times

POOL = "ranking-a"
BASE = f"/api/v1/pools/{POOL}"
TELEMETRY = {  # path in the schema → a request of it with data behind it
    "/api/v1/pools/{pool}/metrics/": f"{BASE}/metrics/?window=5m",
    "/api/v1/pools/{pool}/instances/": f"{BASE}/instances/?window=5m",
    "/api/v1/pools/{pool}/instances/{instance}/metrics/": f"{BASE}/instances/{POOL}.1/metrics/?window=5m",
    "/api/v1/pools/{pool}/forwards/": f"{BASE}/forwards/",
}


@pytest.fixture
def schema(viewer) -> dict:
    return viewer.get("/api/schema/?format=json").json()


def _resolved(schema: dict, node: dict) -> dict:
    while "$ref" in node:
        node = schema["components"]["schemas"][node["$ref"].rsplit("/", 1)[1]]
    return node


def _answer_schema(schema: dict, path: str) -> dict:
    return schema["paths"][path]["get"]["responses"]["200"]["content"]["application/json"]["schema"]


def _bare_objects(schema: dict, node: dict, where: str) -> list[str]:
    """Where an object is described without its properties (or its values' type, for a map)."""
    node = _resolved(schema, node)
    found = []
    if node.get("type") == "object" and not node.get("properties") and not isinstance(
            node.get("additionalProperties"), dict):
        found.append(where)
    for name, child in node.get("properties", {}).items():
        found += _bare_objects(schema, child, f"{where}.{name}")
    for key in ("items", "additionalProperties"):
        if isinstance(node.get(key), dict):
            found += _bare_objects(schema, node[key], f"{where}[]")
    return found


def _mismatches(schema: dict, value, node: dict, where: str = "$") -> list[str]:
    """How ``value`` breaks the schema ``node`` (OpenAPI 3.0: ``nullable``); a key it does not name is one."""
    node = _resolved(schema, node)
    if value is None:
        return [] if node.get("nullable") else [f"{where}: null, but not nullable"]
    if "oneOf" in node:
        return [] if any(not _mismatches(schema, value, option, where) for option in node["oneOf"]) else [
            f"{where}: {value!r} matches none of its forms"]
    if "enum" in node and value not in node["enum"]:
        return [f"{where}: {value!r} is not one of {node['enum']}"]
    kind = node.get("type", "object" if "properties" in node else None)
    python = {"object": dict, "array": list, "string": str, "integer": int, "number": (int, float), "boolean": bool}
    if kind in python and (not isinstance(value, python[kind]) or (kind in ("integer", "number")
                                                                    and isinstance(value, bool))):
        return [f"{where}: {type(value).__name__}, the schema says {kind}"]
    found = []
    if kind == "object":
        properties, others = node.get("properties", {}), node.get("additionalProperties")
        found += [f"{where}.{name}: missing" for name in node.get("required", []) if name not in value]
        for name, item in value.items():
            if name in properties:
                found += _mismatches(schema, item, properties[name], f"{where}.{name}")
            elif isinstance(others, dict):
                found += _mismatches(schema, item, others, f"{where}.{name}")
            else:
                found.append(f"{where}.{name}: not in the schema")
    elif kind == "array":
        for i, item in enumerate(value):
            found += _mismatches(schema, item, node["items"], f"{where}[{i}]")
    return found


def test_the_schema_describes_every_telemetry_answer_by_its_properties(schema):
    for path in TELEMETRY:
        answer = _resolved(schema, _answer_schema(schema, path))
        assert answer.get("type") == "object" and len(answer["properties"]) >= 8, path
        assert _bare_objects(schema, answer, path) == []
    refused = _resolved(schema, _resolved(schema, _answer_schema(schema, "/api/v1/pools/{pool}/metrics/"))[
        "properties"]["fleet"])["properties"]["preinfer_refused_per_s"]
    assert sorted(_resolved(schema, refused)["properties"]) == sorted(REFUSAL_REASONS)


def _publish(worker_factory, redis_client, now: float) -> None:
    """Two instances for 30 one-second samples, and forward times of one."""
    for index in (0, 1):
        worker = worker_factory(POOL, index)
        for i in range(31):
            n = 10 * (index + 1) * i
            worker.publish_snapshot(snapshot(
                worker.name, now - 30 + i, now - 40, latencies_ms=[5.0 * (index + 1)] * i, rank_requests=n,
                rank_within_slo=n, hbm_hits=n, misses=i, preinfer_admitted=i, refusals={"inflight_limit": i},
                hbm_bytes=1000 * i, hbm_budget_bytes=50_000, applied_generation=1))
    plant(redis_client, f"{POOL}.0", now - 5, now - 200, times("rank", 1000, 5.0, 4))


def test_the_telemetry_answers_conform_to_the_schema(viewer, schema, pool, worker_factory, redis_client):
    now = time.time()
    _publish(worker_factory, redis_client, now)
    for path, url in TELEMETRY.items():
        response = viewer.get(url)
        assert response.status_code == 200, (url, response.content[:300])
        assert _mismatches(schema, response.json(), _answer_schema(schema, path)) == [], url
    pool_view = viewer.get(TELEMETRY["/api/v1/pools/{pool}/metrics/"]).json()
    assert pool_view["fleet"]["totals"]["rank_requests"] > 0 and len(pool_view["top"]["instances"]) == 2
    assert viewer.get(TELEMETRY["/api/v1/pools/{pool}/forwards/"]).json()["forwards"] == 4
    # An incremental poll, and one without the worst instances, are the same shape.
    metrics = _answer_schema(schema, "/api/v1/pools/{pool}/metrics/")
    for query in (f"&since={pool_view['timestamps'][-3]}&known={POOL}.1", "&top=0"):
        assert _mismatches(schema, viewer.get(f"{BASE}/metrics/?window=5m{query}").json(), metrics) == [], query


def test_the_conformance_check_finds_a_key_the_schema_does_not_name(viewer, schema, pool, redis_on):
    answer = viewer.get(TELEMETRY["/api/v1/pools/{pool}/instances/"]).json()
    path_schema = _answer_schema(schema, "/api/v1/pools/{pool}/instances/")
    assert _mismatches(schema, answer, path_schema) == []
    assert _mismatches(schema, {**answer, "surprise": 1, "count": "many"}, path_schema) == [
        "$.count: str, the schema says integer", "$.surprise: not in the schema"]
