from __future__ import annotations

import statistics

from controlplane.common.errors import NotFound
from controlplane.policies.models import Pool

from .models import Preview, PreviewScore

# The scorecard's summary, and so every preview's ``model_error``: the pool's last scores done.
SCORECARD_LAST = 5
# The most score records the API lists, newest first.
SCORES_LISTED = 20
NO_SCORE_NOTE = ("no preview of this pool has been scored yet: a preview is scored when its revision is "
                 "published and a window as long as the preview's has been measured under it")


def preview_get(*, pool: Pool, preview_id: int) -> Preview:
    preview = Preview.objects.filter(pool=pool, pk=preview_id).first()
    if preview is None:
        raise NotFound(f"Pool {pool.name!r} has no preview {preview_id}.")
    return preview


def score_list(*, pool: Pool, limit: int = SCORES_LISTED) -> list[PreviewScore]:
    return list(PreviewScore.objects.filter(pool=pool).select_related("pool").order_by("-published_at", "-id")[:limit])


def _abs(scores: list[PreviewScore], key: str) -> list[float]:
    return [abs(s.errors[key]) for s in scores if isinstance(s.errors, dict) and s.errors.get(key) is not None]


def scorecard(*, pool: Pool, last: int = SCORECARD_LAST) -> dict:
    """How far the pool's last ``last`` scored previews were from what the pool measured: the largest
    and the median |P99 error| (%), the largest |P50 error| (%), the largest within-SLO and hit-ratio
    differences (points). ``source`` "none", with a note saying so, while the pool has no score."""
    done = list(PreviewScore.objects.filter(pool=pool, status=PreviewScore.Status.DONE)
                .order_by("-measure_to", "-id")[:last])
    if not done:
        return {"source": "none", "scores": 0, "note": NO_SCORE_NOTE}
    p99, p50 = _abs(done, "p99"), _abs(done, "p50")
    slo, hits = _abs(done, "within_slo_points"), _abs(done, "hit_ratio_points")

    def pct(values: list[float], pick) -> float | None:
        return round(100 * pick(values), 1) if values else None

    def points(values: list[float]) -> float | None:
        return round(max(values), 2) if values else None

    out = {"source": "scorecard", "scores": len(done), "generations": [s.generation for s in done],
           "p99_within_pct": pct(p99, max), "p99_median_abs_pct": pct(p99, statistics.median),
           "p50_within_pct": pct(p50, max), "within_slo_within_points": points(slo),
           "hit_ratio_within_points": points(hits)}
    inside = [s.errors["p99_in_interval"] for s in done
              if isinstance(s.errors, dict) and isinstance(s.errors.get("p99_in_interval"), bool)]
    # how many predictions fell inside the measured P99's own 95 % interval (its sampling error)
    out["p99_in_interval"] = {"inside": sum(inside), "of": len(inside)}
    figures = [f"P99 within ±{out['p99_within_pct']:.0f} %" if p99 else "P99 not measured"]
    if inside:
        figures[0] += f" (inside the measured P99's 95 % interval in {sum(inside)} of {len(inside)})"
    if slo:
        figures.append(f"within-SLO share within ±{out['within_slo_within_points']:.1f} points")
    out["note"] = (f"last {len(done)} scored preview{'s' if len(done) > 1 else ''} of this pool: "
                   f"{', '.join(figures)} of what the pool measured after publishing them")
    return out
