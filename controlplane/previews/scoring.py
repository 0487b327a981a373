"""Writes of the prediction scorecard: a previewed revision, once published, is measured as it ran.

When a generation that had a done preview becomes desired (``policies.signals.revision_published``:
a publish, a rollback, a canary's promotion) a waiting ``PreviewScore`` is recorded with what the
preview predicted for it. The beat's ``score_tick`` (every ``RELAYGR_PREVIEW_SCORE_S``) then waits
for the fleet to converge on the generation (the window starts there; where no live instance can say,
at the publish plus ``SETTLE_S``), lets a window as long as the preview's pass, and measures it from
the pool's traffic capture (and the admissions from the pool's telemetry), as the traffic summary
does. A score that cannot be taken fails with the reason (no traffic, superseded, never converged):
the tick never raises over one score, and a score already decided is left as it is.
"""

from __future__ import annotations

import logging
import time
from datetime import UTC, datetime, timedelta

from django.db import IntegrityError
from django.utils import timezone

from controlplane.common.errors import Unavailable
from controlplane.fleet import selectors as fleet_selectors
from controlplane.policies import selectors as policy_selectors
from controlplane.policies.models import Pool
from controlplane.rollouts.models import Rollout
from controlplane.telemetry import selectors as telemetry_selectors
from relay_engine.core.config import slo_of

from . import traffic
from .models import Preview, PreviewScore

log = logging.getLogger(__name__)

SCORE_TASK = "relaygr.controlplane.score_previews"
# Where the fleet cannot tell when it converged (no live instance): the window starts this long
# after the publish, time enough for a poked instance to apply a revision.
SETTLE_S = 30
# Capture records land moments after their request (the capture's batches): a window is read this
# long after its end, so its last seconds are in.
CAPTURE_LAG_S = 10
# A fleet with live instances that has not converged this long after the publish is not scored.
CONVERGE_TIMEOUT_S = 600
# A window that could not be read (Redis unreachable) this long after its end is given up.
GIVE_UP_S = 600


def _at(unix_s: float) -> datetime:
    return datetime.fromtimestamp(unix_s, tz=UTC)


def _clock(when: datetime) -> str:
    return f"{when.astimezone(UTC):%H:%M:%S} UTC"


def predicted_of(preview: Preview) -> dict:
    """The preview's figures for the revision it proposed (its result's ``proposed`` side)."""
    proposed = (preview.result or {}).get("proposed") or {}
    admitted, requests = proposed.get("preinfer_admitted"), proposed.get("requests")
    return {"p99_ms": proposed.get("p99_ms"), "p50_ms": proposed.get("p50_ms"),
            "within_slo_share": proposed.get("within_slo_share"), "hit_ratio": proposed.get("hit_ratio"),
            "admissions": admitted, "requests": requests,
            "admitted_per_request": (round(admitted / requests, 4)
                                     if isinstance(admitted, int) and isinstance(requests, int) and requests else None)}


def score_preview_of(*, pool: Pool, generation: int) -> Preview | None:
    """The preview a publish of ``generation`` is scored against: its latest done one."""
    return (Preview.objects.filter(pool=pool, generation=generation, status=Preview.Status.DONE)
            .order_by("-window_end", "-finished_at", "-id").first())


def score_open(*, pool: Pool, generation: int, published_at: datetime, via: str = "publish") -> PreviewScore | None:
    """A waiting score for a publish of ``generation``, if it had a done preview (None otherwise, or
    when this generation already has one). Earlier waiting scores whose window had not ended are
    superseded by it: their window would measure this generation's traffic."""
    superseded = PreviewScore.objects.filter(pool=pool, status=PreviewScore.Status.WAITING,
                                             generation__lt=generation, measure_to__gt=published_at)
    for earlier in superseded:
        _fail(earlier, f"superseded by generation {generation} (published {_clock(published_at)}) before its "
                       f"window ended ({_clock(earlier.measure_to)}): the window would measure another revision")
    preview = score_preview_of(pool=pool, generation=generation)
    if preview is None:
        return None
    measure_from = published_at + timedelta(seconds=SETTLE_S)
    try:
        return PreviewScore.objects.create(
            preview=preview, pool=pool, generation=generation, published_at=published_at, published_via=via,
            window_s=preview.window_s, measure_from=measure_from,
            measure_to=measure_from + timedelta(seconds=preview.window_s), predicted=predicted_of(preview))
    except IntegrityError:  # this generation is scored already (the same publish announced twice)
        return None


def on_revision_published(sender, *, pool: Pool, generation: int, published_at: datetime, via: str = "publish",
                          **kwargs) -> PreviewScore | None:
    """The receiver of ``revision_published`` (connected in ``apps.PreviewsConfig.ready``)."""
    return score_open(pool=pool, generation=generation, published_at=published_at or timezone.now(), via=via)


def _fail(score: PreviewScore, reason: str) -> None:
    PreviewScore.objects.filter(pk=score.pk, status=PreviewScore.Status.WAITING).update(
        status=PreviewScore.Status.FAILED, reason=reason[:2000], scored_at=timezone.now())


def score_tick(*, now_s: float | None = None) -> dict[str, int]:
    """One pass over the waiting scores: follow convergence, measure the windows that ended, fail
    what cannot be scored. Idempotent; one score's trouble never stops the others."""
    now_s = time.time() if now_s is None else now_s
    counts = {"waiting": 0, "done": 0, "failed": 0}
    for score in PreviewScore.objects.filter(status=PreviewScore.Status.WAITING).select_related("pool"):
        try:
            _advance(score, now_s)
        except Exception as exc:  # noqa: BLE001 — a score fails with a sentence, the tick goes on
            log.exception("scoring %s failed", score)
            _fail(score, f"the scoring failed unexpectedly ({type(exc).__name__}: {exc})")
        score.refresh_from_db(fields=["status"])
        counts[score.status] += 1
    return counts


def _superseded(score: PreviewScore, pool: Pool) -> str:
    """Why another revision ran in the score's window (empty when none did)."""
    if pool.desired_generation != score.generation and pool.desired_at and pool.desired_at < score.measure_to:
        return (f"superseded by generation {pool.desired_generation} (published {_clock(pool.desired_at)}) "
                f"before its window ended ({_clock(score.measure_to)}): the window would measure another revision")
    canary = (Rollout.objects.filter(pool=pool, started_at__gt=score.published_at, started_at__lt=score.measure_to)
              .order_by("started_at").first())
    if canary is not None:
        return (f"a canary of generation {canary.generation} started at {_clock(canary.started_at)}, before its "
                f"window ended ({_clock(score.measure_to)}): the window's traffic is not this revision's alone")
    return ""


def _advance(score: PreviewScore, now_s: float) -> None:
    pool = Pool.objects.get(pk=score.pool_id)
    why = _superseded(score, pool)
    if why:
        _fail(score, why)
        return
    now = _at(now_s)
    if score.converged_at is None and now < score.measure_to and not _follow_convergence(score, pool, now):
        return
    if now_s < score.measure_to.timestamp() + CAPTURE_LAG_S:
        return
    try:
        figures = measure(score)
    except Unavailable as exc:  # Redis: the next tick tries again, until the window is given up
        if now_s > score.measure_to.timestamp() + GIVE_UP_S:
            _fail(score, f"the pool's capture could not be read within {GIVE_UP_S // 60} min of the window's "
                         f"end: {exc}")
        return
    except ScoreFailed as exc:
        _fail(score, str(exc))
        return
    PreviewScore.objects.filter(pk=score.pk, status=PreviewScore.Status.WAITING).update(
        status=PreviewScore.Status.DONE, measured=figures, errors=errors_of(score.predicted, figures),
        scored_at=timezone.now())


def _follow_convergence(score: PreviewScore, pool: Pool, now: datetime) -> bool:
    """While the fleet has not converged on the generation the window cannot start: it moves on to
    now. True when the window may be measured as it stands (converged, or no instance can say)."""
    try:
        status = fleet_selectors.pool_status(pool=pool, now=now.timestamp())
    except Unavailable:
        return False  # Redis: judged on the next tick
    if status.live_instances == 0:
        return True  # nobody to ask: the publish plus SETTLE_S stands
    window = timedelta(seconds=score.window_s)
    if status.converged and status.desired_generation == score.generation:
        PreviewScore.objects.filter(pk=score.pk).update(converged_at=now, measure_from=now, measure_to=now + window)
        score.refresh_from_db()
        return True
    if (now - score.published_at).total_seconds() > CONVERGE_TIMEOUT_S:
        counts = status.counts
        _fail(score, f"the fleet did not converge on generation {score.generation} within "
                     f"{CONVERGE_TIMEOUT_S // 60} min of the publish ({counts.acked} of {status.live_instances} live "
                     f"instances on it, {counts.nacked} refused it, {counts.waiting} still applying)")
        return False
    PreviewScore.objects.filter(pk=score.pk).update(measure_from=now, measure_to=now + window)
    return False


class ScoreFailed(Exception):
    pass


def measure(score: PreviewScore) -> dict:
    """What the pool measured over the score's window, with the same names as ``predicted``;
    ScoreFailed saying why when the capture holds nothing to measure."""
    start_s, end_s = score.measure_from.timestamp(), score.measure_to.timestamp()
    window = traffic.read_window(pool=score.pool.name, window_s=score.window_s, end_s=end_s)
    span = f"from {_clock(score.measure_from)} to {_clock(score.measure_to)}"
    if not window.records:
        skipped = f"; {window.bad} records there break the capture's contract" if window.bad else ""
        raise ScoreFailed(f"no traffic: the capture holds no ranking request of pool {score.pool.name!r} {span}"
                          f"{skipped}. A score needs the published revision's own traffic")
    revision = policy_selectors.revision_get(pool=score.pool, generation=score.generation)
    summary = traffic.summary(window, score.window_s, slo_ms=slo_of(revision.spec).p99_ms)
    if summary["latency_ms"]["p99"] is None:
        raise ScoreFailed(f"none of the {summary['requests']} requests captured {span} was served "
                          f"(outcomes: {summary['outcomes']}): there is no latency to score")
    counts = telemetry_selectors.pool_counts(pool=score.pool, start_s=start_s, end_s=end_s)
    admitted = counts["preinfer_admitted"] if counts else None
    return {"p99_ms": summary["latency_ms"]["p99"], "p99_interval_ms": summary["latency_ms"]["p99_interval"],
            "p50_ms": summary["latency_ms"]["p50"], "within_slo_share": summary["within_slo_share"], "hit_ratio": summary["hit_ratio"],
            "requests": summary["requests"], "skipped_records": window.bad, "admissions": admitted,
            "admitted_per_request": (round(admitted / counts["rank_requests"], 4)
                                     if counts and counts["rank_requests"] else None),
            "admissions_note": ("the pool's telemetry, ranking requests and pre-infers admitted" if counts else
                                "no instance reported telemetry in the window")}


def _number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _relative(predicted, measured) -> float | None:
    if not (_number(predicted) and _number(measured)) or measured == 0:
        return None
    return round((predicted - measured) / measured, 4)


def _points(predicted, measured) -> float | None:
    if not (_number(predicted) and _number(measured)):
        return None
    return round(100 * (predicted - measured), 2)


def errors_of(predicted: dict, measured: dict) -> dict:
    """Predicted against measured: relative errors for P99, P50 and admissions per request
    ((predicted − measured) / measured), point differences for the within-SLO share and hit ratio."""
    interval = measured.get("p99_interval_ms")
    return {"p99": _relative(predicted.get("p99_ms"), measured.get("p99_ms")),
            # inside the measured P99's own 95 % interval (the window's sampling error); None without one
            "p99_in_interval": (interval[0] <= predicted["p99_ms"] <= interval[1]
                                if interval and _number(predicted.get("p99_ms")) else None),
            "p50": _relative(predicted.get("p50_ms"), measured.get("p50_ms")),
            "within_slo_points": _points(predicted.get("within_slo_share"), measured.get("within_slo_share")),
            "hit_ratio_points": _points(predicted.get("hit_ratio"), measured.get("hit_ratio")),
            "admissions": _relative(predicted.get("admitted_per_request"), measured.get("admitted_per_request"))}
