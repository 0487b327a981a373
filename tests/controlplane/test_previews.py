"""Traffic capture's read side and what-if previews, through the API, on the real Redis.

Capture records are written as the workers write them (``CaptureRecord`` fields in the pool's
stream), with entry ids at their own times so a window can hold the past. The preview's task runs
in-process here (``services.preview_execute``: the real simulator subprocess); the real control-plane
Celery worker runs it in tests/frontend.
"""

from __future__ import annotations

import json
import random
import time
from datetime import timedelta

import pytest
from django.utils import timezone

from controlplane.audit.models import AuditEntry
from controlplane.policies import selectors as policy_selectors
from controlplane.policies import services as policy_services
from controlplane.previews import services
from controlplane.previews.models import Preview
from relay_engine.core.capture import CaptureRecord, capture_key, user_hash
from relay_engine.core.config import default_policy, to_plain
from relay_engine.core.trace import read_trace
from relay_engine.core.wire import PoolKeys

pytestmark = pytest.mark.integration
KEY = capture_key("a capture secret of the preview tests, not a real one", "ranking-a")


def write_capture(client, pool: str, *, n: int, qps: float, end_s: float, users: int = 40, seed: int = 0) -> None:
    """n requests at ``qps`` ending ``end_s``: users repeat, half of them with long (at-risk) prefixes."""
    rng = random.Random(seed)
    keys = PoolKeys(pool)
    pipe = client.pipeline(transaction=False)
    for i in range(n):
        ts_ms = (end_s - (n - i) / qps) * 1000
        user = rng.randrange(users)
        record = CaptureRecord(ts_ms=ts_ms, user=user_hash(KEY, f"user-{user}"),
                               prefix_len=1500 + 20 * (user % 40) if user % 2 == 0 else 100 + user % 400, short_len=8,
                               candidates=64, gap_ms=30.0 + i % 20 if i % 4 else None,
                               outcome=("hbm", "miss", "dram")[i % 3], latency_ms=5.0)
        # A full explicit id (ms-seq): Redis before 7 (the embedded one) has no "ms-*".
        pipe.xadd(keys.traffic, record.to_fields(), id=f"{int(ts_ms)}-{i}")
    pipe.execute()


def stricter(pool, at_risk_seq_len: int) -> int:
    spec = to_plain(default_policy())
    spec["trigger"]["at_risk_seq_len"] = at_risk_seq_len
    latest = policy_selectors.revision_latest_generation(pool=pool)
    return policy_services.revision_create(pool=pool, spec=spec, parent_generation=latest, author="test").generation


def test_traffic_summary_of_the_window(operator, viewer, pool, redis_client):
    write_capture(redis_client, pool.name, n=600, qps=5, end_s=time.time() - 1)
    response = viewer.get(f"/api/v1/pools/{pool.name}/traffic/?window=15m")
    assert response.status_code == 200, response.content
    body = response.json()
    assert body["requests"] == 600 and body["window"] == "15m"
    assert body["rate_qps"] == pytest.approx(600 / 900, abs=1e-3)
    assert body["prefix_len"]["p50"] <= body["prefix_len"]["p90"] <= body["prefix_len"]["p99"]
    assert body["short_len_median"] == 8 and body["candidates_median"] == 64
    assert 0.9 < body["repeat_user_share"] <= 1.0  # 40 users, 600 requests
    assert body["outcomes"] == {"dram": 200, "hbm": 200, "miss": 200}
    assert body["to"] - body["from"] == 900
    assert body["latency_ms"]["p99"] == 5.0 and body["slo_ms"] == 50.0 and body["within_slo_share"] == 1.0
    assert body["hit_ratio"] == pytest.approx(400 / 600, abs=1e-3)  # hbm and dram are hits, miss is not


def test_a_past_window_is_summarised_by_its_end_and_an_end_outside_the_capture_is_a_400(viewer, pool, redis_client):
    now = time.time()
    write_capture(redis_client, pool.name, n=600, qps=1, end_s=now - 1)  # one a second for the last 10 min
    body = viewer.get(f"/api/v1/pools/{pool.name}/traffic/?window=1m&end={now - 300}").json()
    assert body["to"] == pytest.approx(now - 300) and body["to"] - body["from"] == 60
    assert 59 <= body["requests"] <= 61
    curves = viewer.get(f"/api/v1/pools/{pool.name}/cache-curves/?window=1m&end={now - 300}")
    assert curves.status_code == 200 and curves.json()["to"] == pytest.approx(now - 300)
    for end in (now - 7200, now + 3600, "noon"):
        response = viewer.get(f"/api/v1/pools/{pool.name}/traffic/?window=1m&end={end}")
        assert response.status_code == 400 and "end" in response.json()["errors"], response.content
        assert response.json()["detail"].startswith("end: ")


def test_a_pool_without_traffic_summarises_to_zero(viewer, pool, redis_on):
    body = viewer.get(f"/api/v1/pools/{pool.name}/traffic/").json()
    assert body["requests"] == 0 and body["repeat_user_share"] is None and body["window"] == "15m"


@pytest.mark.parametrize("window", ["2h", "30s", "abc", "0m"])
def test_a_window_out_of_range_is_a_400_naming_the_field(viewer, pool, redis_on, window):
    response = viewer.get(f"/api/v1/pools/{pool.name}/traffic/?window={window}")
    assert response.status_code == 400
    assert "window" in response.json()["errors"]
    assert "1m" in response.json()["detail"] and "1h" in response.json()["detail"]


def test_a_broken_record_in_the_capture_is_skipped_and_counted(viewer, pool, redis_client):
    write_capture(redis_client, pool.name, n=10, qps=5, end_s=time.time() - 5)
    redis_client.xadd(PoolKeys(pool.name).traffic, {"t": "yesterday", "u": "x"})
    body = viewer.get(f"/api/v1/pools/{pool.name}/traffic/?window=1m").json()
    assert body["requests"] == 10 and body["skipped_records"] == 1


def test_an_abandoned_preview_fails_and_is_not_reused(operator, pool, redis_client):
    write_capture(redis_client, pool.name, n=100, qps=5, end_s=time.time() - 61)
    first = operator.post(f"/api/v1/pools/{pool.name}/revisions/1/preview/").json()
    Preview.objects.filter(pk=first["id"]).update(created_at=timezone.now() - timedelta(hours=1))
    again = operator.post(f"/api/v1/pools/{pool.name}/revisions/1/preview/").json()
    assert again["id"] != first["id"]
    abandoned = operator.get(first["url"]).json()
    assert abandoned["status"] == "failed" and "Celery worker" in abandoned["error"]


def test_the_jsonl_export_round_trips_through_read_trace(viewer, pool, redis_client, tmp_path):
    write_capture(redis_client, pool.name, n=300, qps=10, end_s=time.time() - 1)
    response = viewer.get(f"/api/v1/pools/{pool.name}/traffic/?window=5m&format=jsonl")
    assert response.status_code == 200
    assert response["Content-Type"].startswith("application/x-ndjson")
    assert "attachment" in response["Content-Disposition"]
    path = tmp_path / "trace.jsonl"
    path.write_bytes(b"".join(response.streaming_content))
    queries = read_trace(path)
    assert len(queries) == 300 and queries[0].t_ms == 0
    assert not any(q.user_id.startswith("user-") for q in queries)
    assert len({q.user_id for q in queries}) == 40
    assert {q.rank_delay_ms for q in queries} <= {30.0 + k for k in range(20)} | {39.5}  # unknown: the median


def test_a_preview_is_queued_then_reused(operator, pool, redis_client):
    write_capture(redis_client, pool.name, n=300, qps=5, end_s=time.time() - 61)
    generation = stricter(pool, 4096)
    first = operator.post(f"/api/v1/pools/{pool.name}/revisions/{generation}/preview/", {"window": "15m"},
                          format="json")
    assert first.status_code == 202, first.content
    assert first.json()["status"] == "queued" and first.json()["live_generation"] == 1
    again = operator.post(f"/api/v1/pools/{pool.name}/revisions/{generation}/preview/", {"window": "15m"},
                          format="json")
    assert again.status_code == 202 and again.json()["id"] == first.json()["id"]
    assert Preview.objects.count() == 1
    other_window = operator.post(f"/api/v1/pools/{pool.name}/revisions/{generation}/preview/", {"window": "30m"},
                                 format="json")
    assert other_window.json()["id"] != first.json()["id"]


def test_a_preview_of_an_unknown_generation_is_a_404(operator, pool, redis_on):
    response = operator.post(f"/api/v1/pools/{pool.name}/revisions/9/preview/")
    assert response.status_code == 404
    assert "generation 9" in response.json()["detail"]


def test_a_preview_without_captured_traffic_is_a_409_naming_the_window(operator, pool, redis_client):
    write_capture(redis_client, pool.name, n=50, qps=5, end_s=time.time() - 1800)  # 30 min ago
    response = operator.post(f"/api/v1/pools/{pool.name}/revisions/1/preview/", {"window": "5m"}, format="json")
    assert response.status_code == 409
    detail = response.json()["detail"]
    assert "last 5m" in detail and "holds 50 requests" in detail


def test_previews_are_for_operators_and_readable_by_viewers(clients, pool, redis_client):
    write_capture(redis_client, pool.name, n=100, qps=5, end_s=time.time() - 61)
    assert clients["viewer"].post(f"/api/v1/pools/{pool.name}/revisions/1/preview/").status_code == 403
    created = clients["admin"].post(f"/api/v1/pools/{pool.name}/revisions/1/preview/")
    assert created.status_code == 202
    read = clients["viewer"].get(created.json()["url"])
    assert read.status_code == 200 and read.json()["status"] == "queued"
    assert clients["viewer"].get(f"/api/v1/pools/{pool.name}/previews/999/").status_code == 404


def test_a_stricter_at_risk_seq_len_predicts_fewer_admissions(operator, pool, redis_client):
    write_capture(redis_client, pool.name, n=1500, qps=10, end_s=time.time() - 61)
    generation = stricter(pool, 2000)  # live: 512 (every long prefix is at risk); 2000: only the longest
    created = operator.post(f"/api/v1/pools/{pool.name}/revisions/{generation}/preview/").json()
    preview = services.preview_execute(preview_id=created["id"])
    assert preview.status == "done", preview.error
    body = operator.get(created["url"]).json()
    live, proposed = body["result"]["live"], body["result"]["proposed"]
    assert 0 < proposed["preinfer_admitted"] < live["preinfer_admitted"]
    assert proposed["preinfer_refused"].get("not_at_risk", 0) > live["preinfer_refused"].get("not_at_risk", 0)
    for figures in (live, proposed):
        assert {"p99_ms", "p50_ms", "within_slo_share", "slo_throughput_qps", "hbm_peak_bytes", "dram_peak_bytes",
                "hit_ratio", "preinfer_admitted", "preinfer_refused"} <= set(figures)
    result = body["result"]
    assert result["requests"] == 1500 and result["window"] == "15m"
    assert "model_error" in result and result["model_error_note"]
    assert "reference profile" in result["profile"]["note"]  # no worker reported a device
    assert result["instances"] == 2  # none live: the pool's expected count, said so
    assert "expected" in result["instances_note"]
    assert result["sim_nice"] == 19  # background work: never a core taken from a pool's ranking on the host
    assert result["routing"].startswith("by rendezvous hashing")  # the capture here names no instance


def test_the_traffic_before_the_window_warms_the_caches_unmeasured(operator, pool, redis_client):
    """A preview replays first the minutes before its window (the live spec's longest TTL, at most
    5 min), so its caches start as the instances' did; only the window is measured."""
    write_capture(redis_client, pool.name, n=1200, qps=2, end_s=time.time() - 61)  # the last 10 minutes
    response = operator.post(f"/api/v1/pools/{pool.name}/revisions/1/preview/", {"window": "3m"}, format="json")
    assert response.status_code == 202, response.content
    preview = services.preview_execute(preview_id=response.json()["id"])
    assert preview.status == "done", preview.error
    result = preview.result
    assert result["warmup_lead_s"] == 180  # the window's own length bounds the lead
    assert result["warmup_requests"] == pytest.approx(360, abs=8)  # the 3 min before the window, at 2 QPS
    assert 200 <= result["requests"] <= 300  # the window's last minute holds none (the capture ends 61 s ago)
    assert result["requests_captured"] == result["requests"]
    assert result["live"]["requests"] > 0.9 * result["requests"]  # the window measured, the lead not


def test_a_kept_preview_replays_request_by_request_against_its_capture(operator, pool, redis_client, settings,
                                                                       tmp_path, capsys):
    """With RELAYGR_PREVIEW_KEEP_DIR the preview keeps what it replayed, the captured records in the
    trace's order beside it: ``sim decompose`` sets each replayed request against its own record."""
    settings.RELAYGR_PREVIEW_KEEP_DIR = str(tmp_path / "kept")
    write_capture(redis_client, pool.name, n=600, qps=2, end_s=time.time() - 61)
    response = operator.post(f"/api/v1/pools/{pool.name}/revisions/1/preview/", {"window": "3m"}, format="json")
    preview = services.preview_execute(preview_id=response.json()["id"])
    assert preview.status == "done", preview.error
    folder = tmp_path / "kept" / f"preview-{preview.pk}"
    assert {p.name for p in folder.iterdir()} == {"trace.jsonl", "capture.jsonl", "live.json", "proposed.json",
                                                  "forwards.json", "out.json", "command.json", "profile.json"}
    trace = read_trace(folder / "trace.jsonl")
    captured = [CaptureRecord.from_fields(json.loads(line)) for line in (folder / "capture.jsonl").open()]
    assert len(trace) == len(captured) == preview.result["warmup_requests"] + preview.result["requests"]
    assert [(q.user_id, q.seq_len) for q in trace] == [(r.user, r.prefix_len) for r in captured]
    from relay_engine.lab.sim import cli  # the lab: tests and the command line only

    out = tmp_path / "decomposed.json"
    assert cli.main(["decompose", str(folder), "--out", str(out)]) == 0
    decomposed = json.loads(out.read_text())
    assert decomposed["real"]["requests"] == preview.result["live"]["requests"]
    assert decomposed["sim"]["p99_ms"] == pytest.approx(preview.result["live"]["p99_ms"])  # the preview's replay
    assert "Outcomes, captured → simulated" in capsys.readouterr().out


def test_a_failing_simulation_fails_the_preview_with_a_sentence(operator, pool, redis_client, settings):
    settings.RELAYGR_PREVIEW_MAX_REQUESTS = 5  # the simulator refuses it
    write_capture(redis_client, pool.name, n=50, qps=5, end_s=time.time() - 61)
    created = operator.post(f"/api/v1/pools/{pool.name}/revisions/1/preview/").json()
    preview = services.preview_execute(preview_id=created["id"])
    assert preview.status == "failed"
    assert "--max-requests must be at least 100" in preview.error and "Traceback" not in preview.error
    # a failed preview is not reused: asking again queues a new one
    again = operator.post(f"/api/v1/pools/{pool.name}/revisions/1/preview/").json()
    assert again["id"] != created["id"]


def test_the_jsonl_export_is_served_whatever_the_accept_header(viewer, pool, redis_client):
    """``?format=jsonl`` is the caller's explicit choice: a script sending ``Accept: application/json``
    to every URL still gets the download, not a 406."""
    write_capture(redis_client, pool.name, n=20, qps=10, end_s=time.time() - 1)
    response = viewer.get(f"/api/v1/pools/{pool.name}/traffic/?window=5m&format=jsonl",
                          HTTP_ACCEPT="application/json")
    assert response.status_code == 200
    assert response["Content-Type"].startswith("application/x-ndjson")
    assert len(b"".join(response.streaming_content).splitlines()) == 20


# --- limits: previews queued or running, per user and per pool ---------------------------------------

def _ask(client, pool, generation: int):
    return client.post(f"/api/v1/pools/{pool.name}/revisions/{generation}/preview/", {"window": "15m"}, format="json")


def test_a_user_past_the_previews_per_user_gets_a_429_naming_the_limit_and_the_previews(operator, pool, redis_client,
                                                                                       settings):
    settings.RELAYGR_PREVIEW_MAX_PER_USER = 2
    write_capture(redis_client, pool.name, n=100, qps=5, end_s=time.time() - 61)
    generations = [stricter(pool, 1000 + i) for i in range(3)]
    held = [_ask(operator, pool, g).json()["id"] for g in generations[:2]]
    refused = _ask(operator, pool, generations[2])
    assert refused.status_code == 429 and refused["Retry-After"] == str(services.RETRY_AFTER_S)
    detail = refused.json()["detail"]
    assert "User 'operator'" in detail and "RELAYGR_PREVIEW_MAX_PER_USER allows (2)" in detail
    assert all(f"preview {pk} of ranking-a generation" in detail for pk in held) and "queued" in detail
    assert Preview.objects.count() == 2
    # asking again for one it already has reuses it: no new work, no refusal
    assert _ask(operator, pool, generations[0]).json()["id"] == held[0]
    Preview.objects.filter(pk=held[0]).update(status=Preview.Status.DONE)
    assert _ask(operator, pool, generations[2]).status_code == 202  # one finished: room again


def test_a_pool_past_its_previews_gets_a_429_naming_the_pool_limit_whoever_asks(clients, pool, redis_client, settings):
    settings.RELAYGR_PREVIEW_MAX_PER_POOL = 3
    write_capture(redis_client, pool.name, n=100, qps=5, end_s=time.time() - 61)
    generations = [stricter(pool, 1000 + i) for i in range(4)]
    for client, generation in zip(("operator", "operator", "admin"), generations, strict=False):
        assert _ask(clients[client], pool, generation).status_code == 202
    refused = _ask(clients["admin"], pool, generations[3])
    assert refused.status_code == 429 and refused.has_header("Retry-After")
    detail = refused.json()["detail"]
    assert "Pool 'ranking-a' already has 3 previews queued or running" in detail
    assert "RELAYGR_PREVIEW_MAX_PER_POOL allows (3)" in detail and "by admin" in detail and "by operator" in detail


def test_an_abandoned_preview_no_longer_counts_against_a_limit(operator, pool, redis_client, settings):
    settings.RELAYGR_PREVIEW_MAX_PER_USER = 1
    write_capture(redis_client, pool.name, n=100, qps=5, end_s=time.time() - 61)
    first = _ask(operator, pool, stricter(pool, 1000)).json()
    Preview.objects.filter(pk=first["id"]).update(created_at=timezone.now() - timedelta(hours=1))
    assert _ask(operator, pool, stricter(pool, 1001)).status_code == 202


# --- audit: who starts previews, who takes captured traffic away --------------------------------------

def test_starting_a_preview_is_audited_once_reusing_it_is_not(operator, pool, redis_client):
    write_capture(redis_client, pool.name, n=100, qps=5, end_s=time.time() - 61)
    generation = stricter(pool, 3000)
    created = _ask(operator, pool, generation).json()
    _ask(operator, pool, generation)
    [entry] = AuditEntry.objects.filter(action=AuditEntry.Action.PREVIEW_START)
    assert (entry.actor, entry.pool, entry.object_type, entry.object_id) == ("operator", pool.name, "preview",
                                                                             str(created["id"]))
    assert entry.after["generation"] == generation and entry.after["live_generation"] == 1
    assert entry.after["window"] == "15m" and entry.request_id


def test_downloading_captured_traffic_is_audited_and_the_summary_is_not(viewer, pool, redis_client):
    write_capture(redis_client, pool.name, n=120, qps=10, end_s=time.time() - 1)
    assert viewer.get(f"/api/v1/pools/{pool.name}/traffic/?window=5m").status_code == 200
    assert not AuditEntry.objects.filter(action=AuditEntry.Action.TRAFFIC_DOWNLOAD).exists()
    response = viewer.get(f"/api/v1/pools/{pool.name}/traffic/?window=5m&format=jsonl")
    assert response.status_code == 200 and b"".join(response.streaming_content).count(b"\n") == 120
    [entry] = AuditEntry.objects.filter(action=AuditEntry.Action.TRAFFIC_DOWNLOAD)
    assert (entry.actor, entry.pool, entry.object_id) == ("viewer", pool.name, f"{pool.name}:5m")
    assert entry.after["requests"] == 120 and entry.after["to"] - entry.after["from"] == 300


def test_the_summary_names_the_live_instances_that_capture_nothing_and_why(viewer, pool, redis_client,
                                                                           worker_factory):
    capturing, blind = worker_factory(pool.name, 0), worker_factory(pool.name, 1)
    blind.status.capture_off = "no capture secret (RELAYGR_CAPTURE_SECRET is not set): this instance records no traffic"
    capturing.heartbeat()
    blind.heartbeat()
    body = viewer.get(f"/api/v1/pools/{pool.name}/traffic/").json()
    assert body["capture_off"] == {blind.name: blind.status.capture_off}
    shown = viewer.get(f"/api/v1/pools/{pool.name}/instances/{blind.name}/").json()
    assert shown["capture_off"] == blind.status.capture_off


def test_the_p99s_interval_is_the_order_statistics_around_its_rank():
    from controlplane.previews.traffic import _percentile_interval
    values = [float(i) for i in range(1, 10_001)]  # n q = 9,900, half-width 1.96 √99 = 19.5 ranks
    assert _percentile_interval(values, 0.99) == [9880.0, 9920.0]
    assert _percentile_interval(values[:100], 0.99) is None  # its upper rank falls past the sample
    assert _percentile_interval([], 0.99) is None
