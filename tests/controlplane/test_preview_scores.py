"""The prediction scorecard, on the real database and Redis: a previewed revision published (all at
once or a canary promoted) is measured over the window after the fleet ran it, and every preview's
``model_error`` comes from those records.

The preview scored is a done ``Preview`` row holding what the simulator returned (its ``proposed``
figures); the capture of the window after the publish is written as the workers write it (entry ids
at their own times); the scoring pass runs in-process (``scoring.score_tick``) at a chosen time.
"""

from __future__ import annotations

import time
from datetime import timedelta

import pytest
from django.utils import timezone

from controlplane.policies import services as policy_services
from controlplane.previews import scoring, services
from controlplane.previews.models import Preview, PreviewScore
from controlplane.rollouts.models import Rollout
from relay_engine.core.capture import CaptureRecord, user_hash
from relay_engine.core.wire import PoolKeys
from tests.controlplane.fleet_helpers import snapshot
from tests.controlplane.test_previews import KEY, stricter, write_capture

pytestmark = pytest.mark.integration
BASE = "/api/v1/pools/ranking-a"
PREDICTED = {"p99_ms": 110.0, "p50_ms": 45.0, "within_slo_share": 0.55, "hit_ratio": 0.70, "preinfer_admitted": 30,
             "requests": 100}


def previewed(pool, at_risk_seq_len: int = 4096, window_s: int = 60, proposed: dict | None = None) -> Preview:
    """A new generation and a done preview of it, as the simulator reports one."""
    generation = stricter(pool, at_risk_seq_len)
    return Preview.objects.create(
        pool=pool, generation=generation, live_generation=pool.desired_generation, sha256=f"{generation:064x}",
        live_sha256="0" * 64, window_s=window_s, window_end=timezone.now(), status=Preview.Status.DONE,
        requested_by="operator", result={"proposed": proposed or PREDICTED, "live": PREDICTED})


def publish(client, generation: int, capture) -> None:
    with capture(execute=True):
        response = client.post(f"{BASE}/revisions/{generation}/publish/")
    assert response.status_code == 200, response.content


def write_window(client, pool: str, start_s: float, end_s: float) -> None:
    """100 requests spread over [start, end]: latencies 1..100 ms, every fourth a miss."""
    pipe = client.pipeline(transaction=False)
    for i in range(100):
        ts_ms = (start_s + (end_s - start_s) * (i + 0.5) / 100) * 1000
        record = CaptureRecord(ts_ms=ts_ms, user=user_hash(KEY, f"user-{i % 30}"), prefix_len=1200, short_len=8,
                               candidates=64, gap_ms=30.0, outcome="miss" if i % 4 == 0 else "hbm",
                               latency_ms=float(i + 1))
        pipe.xadd(PoolKeys(pool).traffic, record.to_fields(), id=f"{int(ts_ms)}-{i}")
    pipe.execute()


def score_of(generation: int) -> PreviewScore:
    return PreviewScore.objects.get(generation=generation)


def test_publishing_a_previewed_generation_opens_a_waiting_score(operator, pool, redis_client,
                                                                 django_capture_on_commit_callbacks):
    preview = previewed(pool)
    publish(operator, preview.generation, django_capture_on_commit_callbacks)
    score = score_of(preview.generation)
    pool.refresh_from_db()
    assert (score.status, score.preview_id, score.window_s, score.published_via) == ("waiting", preview.pk, 60,
                                                                                      "publish")
    assert score.published_at == pool.desired_at
    # no live instance can say when it converged: the publish plus the settle, as long as the preview's window
    assert score.measure_from == score.published_at + timedelta(seconds=scoring.SETTLE_S)
    assert score.measure_to - score.measure_from == timedelta(seconds=60)
    assert score.predicted == {"p99_ms": 110.0, "p50_ms": 45.0, "within_slo_share": 0.55, "hit_ratio": 0.70,
                               "admissions": 30, "requests": 100, "admitted_per_request": 0.3}
    # a generation never previewed is published unscored
    unpreviewed = stricter(pool, 3000)
    publish(operator, unpreviewed, django_capture_on_commit_callbacks)
    assert not PreviewScore.objects.filter(generation=unpreviewed).exists()


def test_a_failing_receiver_never_breaks_the_publish(operator, pool, redis_client, django_capture_on_commit_callbacks,
                                                     monkeypatch):
    preview = previewed(pool)

    def broken(**kwargs):
        raise RuntimeError("the scorecard is down")

    monkeypatch.setattr(scoring, "score_open", broken)
    publish(operator, preview.generation, django_capture_on_commit_callbacks)
    pool.refresh_from_db()
    assert pool.desired_generation == preview.generation and not PreviewScore.objects.exists()


def test_the_window_after_the_publish_is_measured_against_the_prediction(operator, pool, redis_client,
                                                                         django_capture_on_commit_callbacks):
    preview = previewed(pool)
    publish(operator, preview.generation, django_capture_on_commit_callbacks)
    score = score_of(preview.generation)
    start_s, end_s = score.measure_from.timestamp(), score.measure_to.timestamp()
    write_capture(redis_client, pool.name, n=50, qps=5, end_s=start_s - 1)  # before the window: not measured
    write_window(redis_client, pool.name, start_s, end_s)
    assert scoring.score_tick(now_s=end_s - 5) == {"waiting": 1, "done": 0, "failed": 0}  # not ended yet
    assert scoring.score_tick(now_s=end_s + scoring.CAPTURE_LAG_S + 1)["done"] == 1
    score.refresh_from_db()
    assert score.status == "done" and score.reason == ""
    measured = score.measured
    assert (measured["requests"], measured["p99_ms"], measured["p50_ms"]) == (100, 99.0, 50.0)
    assert measured["within_slo_share"] == 0.5 and measured["hit_ratio"] == 0.75  # SLO 50 ms; a quarter missed
    assert measured["admissions"] is None and "no instance reported telemetry" in measured["admissions_note"]
    assert measured["p99_interval_ms"] is None  # 100 requests are too few for the P99's interval
    assert score.errors == {"p99": pytest.approx(11 / 99, abs=1e-4), "p99_in_interval": None, "p50": -0.1,
                            "within_slo_points": 5.0, "hit_ratio_points": -5.0, "admissions": None}
    # idempotent: a second pass changes nothing
    scored_at = score.scored_at
    assert scoring.score_tick(now_s=end_s + 600) == {"waiting": 0, "done": 0, "failed": 0}
    score.refresh_from_db()
    assert score.scored_at == scored_at and score.measured == measured


def test_a_window_without_traffic_fails_saying_so(operator, pool, redis_client, django_capture_on_commit_callbacks):
    preview = previewed(pool)
    publish(operator, preview.generation, django_capture_on_commit_callbacks)
    score = score_of(preview.generation)
    redis_client.xadd(PoolKeys(pool.name).traffic, {"t": "yesterday", "u": "x"},
                      id=f"{int(score.measure_from.timestamp() * 1000) + 5}-0")  # off-contract: skipped
    scoring.score_tick(now_s=score.measure_to.timestamp() + 60)
    score.refresh_from_db()
    assert score.status == "failed" and score.measured is None
    assert score.reason.startswith("no traffic: the capture holds no ranking request of pool 'ranking-a' from ")
    assert "1 records there break the capture's contract" in score.reason


def test_a_score_superseded_before_its_window_ended_fails_naming_the_generation(operator, pool, redis_client,
                                                                               django_capture_on_commit_callbacks):
    first = previewed(pool)
    publish(operator, first.generation, django_capture_on_commit_callbacks)
    second = previewed(pool, at_risk_seq_len=2048)
    publish(operator, second.generation, django_capture_on_commit_callbacks)
    superseded = score_of(first.generation)
    assert superseded.status == "failed"
    assert f"superseded by generation {second.generation}" in superseded.reason and "before its window ended" in \
        superseded.reason
    assert score_of(second.generation).status == "waiting"


def test_the_tick_fails_a_score_whose_generation_was_replaced_in_its_window(operator, pool, redis_client,
                                                                           django_capture_on_commit_callbacks):
    """Without the receiver (a publish from a process that missed it): the pass itself notices."""
    preview = previewed(pool)
    publish(operator, preview.generation, django_capture_on_commit_callbacks)
    later = stricter(pool, 2500)
    assert operator.post(f"{BASE}/revisions/{later}/publish/").status_code == 200  # on_commit not run: no receiver
    score = score_of(preview.generation)
    assert score.status == "waiting"
    scoring.score_tick(now_s=score.measure_to.timestamp() + 60)
    score.refresh_from_db()
    assert score.status == "failed" and f"superseded by generation {later}" in score.reason


def test_the_window_starts_when_the_fleet_has_converged(operator, pool, redis_client, worker_factory,
                                                        django_capture_on_commit_callbacks):
    policy_services.desired_push(pool=pool)
    workers = [worker_factory(pool.name, i) for i in range(2)]
    for worker in workers:
        worker.reconcile()
    preview = previewed(pool)
    publish(operator, preview.generation, django_capture_on_commit_callbacks)
    score = score_of(preview.generation)
    now = time.time()
    for worker in workers:
        worker.heartbeat(now + 5)
    scoring.score_tick(now_s=now + 5)  # live instances still on the old generation: the window waits
    score.refresh_from_db()
    assert score.status == "waiting" and score.converged_at is None
    assert score.measure_from.timestamp() == pytest.approx(now + 5)
    for worker in workers:
        worker.reconcile(now + 20)
    scoring.score_tick(now_s=now + 20)
    score.refresh_from_db()
    assert score.converged_at is not None and score.measure_from.timestamp() == pytest.approx(now + 20)
    assert score.measure_to.timestamp() == pytest.approx(now + 80)


def test_a_promoted_canary_is_scored(operator, pool, redis_client, worker_factory, django_capture_on_commit_callbacks):
    policy_services.desired_push(pool=pool)
    workers = [worker_factory(pool.name, i) for i in range(2)]
    for worker in workers:
        worker.reconcile()
    preview = previewed(pool)
    canary = {"strategy": "canary", "canary_instances": 1, "bake_s": 30, "max_burn": 1.0}
    started = operator.post(f"{BASE}/revisions/{preview.generation}/publish/", canary, format="json")
    assert started.status_code == 201, started.content
    assert not PreviewScore.objects.exists()  # a canary baking is not the pool's revision yet
    with django_capture_on_commit_callbacks(execute=True):
        promoted = operator.post(f"{BASE}/rollout/promote/")
    assert promoted.status_code == 200, promoted.content
    assert Rollout.objects.get().state == "promoted"
    score = score_of(preview.generation)
    assert (score.status, score.published_via) == ("waiting", "canary")


def _scored(pool, p99_error: float, generation: int) -> None:
    """A done score of generation ``generation`` with the given P99 error."""
    preview = previewed(pool, at_risk_seq_len=1000 + generation)
    now = timezone.now()
    PreviewScore.objects.create(
        preview=preview, pool=pool, generation=preview.generation, published_at=now, window_s=60,
        measure_from=now, measure_to=now + timedelta(seconds=60 + generation), status=PreviewScore.Status.DONE,
        predicted=PREDICTED, measured={"p99_ms": 100.0},
        errors={"p99": p99_error, "p99_in_interval": abs(p99_error) <= 0.1, "p50": 0.05,
                "within_slo_points": -2.0 * generation, "hit_ratio_points": 1.0, "admissions": None})


def test_the_scores_endpoint_is_for_viewers_and_summarises_the_last_five(clients, pool, redis_on):
    url = f"{BASE}/previews/scores/"
    assert clients["anonymous"].get(url).status_code == 401
    assert clients["norole"].get(url).status_code == 403
    empty = clients["viewer"].get(url).json()
    assert empty["scores"] == [] and empty["summary"]["source"] == "none"
    assert "no preview of this pool has been scored yet" in empty["summary"]["note"]
    for i, error in enumerate((0.30, -0.11, 0.05, -0.08, 0.02, 0.01)):  # the oldest (30 %) falls out
        _scored(pool, error, i + 1)
    body = clients["viewer"].get(url).json()
    summary = body["summary"]
    assert (summary["source"], summary["scores"]) == ("scorecard", 5)
    assert summary["p99_within_pct"] == 11.0 and summary["p99_median_abs_pct"] == 5.0
    assert summary["within_slo_within_points"] == 12.0 and summary["p50_within_pct"] == 5.0
    assert summary["note"].startswith("last 5 scored previews of this pool: P99 within ±11 %")
    assert summary["p99_in_interval"] == {"inside": 4, "of": 5}  # the −11 % one fell outside
    assert "P99 within ±11 % (inside the measured P99's 95 % interval in 4 of 5)" in summary["note"]
    assert len(body["scores"]) == 6
    row = body["scores"][0]
    assert {"generation", "status", "reason", "predicted", "measured", "errors", "measure_from", "measure_to",
            "window", "preview", "published_via"} <= set(row)
    assert row["preview"]["url"].startswith(f"{BASE}/previews/")
    assert clients["viewer"].get("/api/v1/pools/nope/previews/scores/").status_code == 404


def test_a_previews_model_error_comes_from_the_pools_scorecard(operator, pool, redis_client):
    write_capture(redis_client, pool.name, n=300, qps=5, end_s=time.time() - 61)
    first = services.preview_execute(preview_id=operator.post(f"{BASE}/revisions/1/preview/").json()["id"])
    assert first.status == "done", first.error
    assert first.result["model_error"] is None and first.result["scorecard"]["source"] == "none"
    assert "no preview of this pool has been scored yet" in first.result["model_error_note"]
    assert "note" in first.result["sim_validation"]  # the simulator's offline figure, kept apart
    _scored(pool, -0.12, 1)
    again = services.preview_execute(preview_id=operator.post(f"{BASE}/revisions/1/preview/",
                                                              {"window": "5m"}, format="json").json()["id"])
    assert again.status == "done", again.error
    assert again.result["model_error"] == 0.12 and again.result["scorecard"]["scores"] == 1
    assert again.result["model_error_note"].startswith("last 1 scored preview of this pool: P99 within ±12 %")


def test_admissions_are_measured_from_the_pools_telemetry(operator, pool, redis_client, worker_factory,
                                                          django_capture_on_commit_callbacks):
    preview = previewed(pool)
    publish(operator, preview.generation, django_capture_on_commit_callbacks)
    score = score_of(preview.generation)
    start_s, end_s = score.measure_from.timestamp(), score.measure_to.timestamp()
    write_window(redis_client, pool.name, start_s, end_s)
    worker = worker_factory(pool.name, 0)  # reports telemetry, no heartbeat: convergence cannot be told
    worker.publish_snapshot(snapshot(worker.name, start_s + 20, start_s - 100, rank_requests=200,
                                     preinfer_admitted=50), tier="10s")
    scoring.score_tick(now_s=end_s + 60)
    score.refresh_from_db()
    assert score.status == "done", score.reason
    assert (score.measured["admissions"], score.measured["admitted_per_request"]) == (50, 0.25)
    assert score.errors["admissions"] == pytest.approx(0.2)  # 0.3 predicted per request against 0.25


def test_the_p99_is_judged_against_its_own_interval_and_the_summary_counts_the_predictions_inside():
    predicted = {"p99_ms": 120.0, "p50_ms": 10.0}
    measured = {"p99_ms": 100.0, "p50_ms": 10.0, "p99_interval_ms": [85.0, 125.0]}
    assert scoring.errors_of(predicted, measured)["p99_in_interval"] is True
    assert scoring.errors_of({**predicted, "p99_ms": 130.0}, measured)["p99_in_interval"] is False
    assert scoring.errors_of({**predicted, "p99_ms": None}, measured)["p99_in_interval"] is None
