"""Thin views: the pool's captured traffic (summary or trace), and what-if previews of a revision."""

from __future__ import annotations

import json
import time

from django.http import StreamingHttpResponse
from drf_spectacular.types import OpenApiTypes
from drf_spectacular.utils import OpenApiParameter, OpenApiResponse, extend_schema
from rest_framework import status
from rest_framework.renderers import BaseRenderer, BrowsableAPIRenderer, JSONRenderer
from rest_framework.response import Response
from rest_framework.views import APIView

from controlplane.common.errors import InvalidInput
from controlplane.common.views import GENERATION_PARAM, POOL_PARAM, actor_name, error_responses
from controlplane.policies import selectors as policy_selectors

from .. import cache_curves, selectors, services, traffic
from .serializers import (
    CacheCurvesSerializer,
    CurveQuerySerializer,
    PreviewRequestSerializer,
    PreviewScoreSerializer,
    PreviewSerializer,
    TrafficQuerySerializer,
    TrafficSummaryQuerySerializer,
)


class JsonLinesRenderer(BaseRenderer):
    """``?format=jsonl``: the trace itself is streamed by the view; this renders its errors."""

    media_type = "application/x-ndjson"
    format = "jsonl"
    charset = "utf-8"

    def render(self, data, accepted_media_type=None, renderer_context=None):
        return (json.dumps(data) + "\n").encode()


def _window_end(data: dict) -> float | None:
    """``end`` (unix s), the end of a window of the capture's last hour (a minute ahead allowed for
    clocks); None when not given: now."""
    query = TrafficSummaryQuerySerializer(data=data)
    if query.is_valid():
        end = query.validated_data.get("end")
        if end is None:
            return None
        now = time.time()
        if now - traffic.MAX_WINDOW_S <= end <= now + 60:
            return end
        message = (f"must be a time of the capture's last hour (unix seconds from {now - traffic.MAX_WINDOW_S:.0f} "
                   f"to {now:.0f}), got {end:g}")
    else:
        message = " ".join(str(m) for m in query.errors.get("end", ["is invalid"]))
    raise InvalidInput(f"end: {message}", {"end": [message]})


def _window(data: dict) -> int:
    query = TrafficQuerySerializer(data=data)
    if not query.is_valid():
        raise InvalidInput("window: " + " ".join(str(m) for m in query.errors.get("window", ["is invalid"])),
                           {"window": [str(m) for m in query.errors.get("window", ["is invalid"])]})
    return traffic.parse_window(query.validated_data["window"])


class PoolTrafficView(APIView):
    renderer_classes = [JSONRenderer, BrowsableAPIRenderer, JsonLinesRenderer]

    @extend_schema(
        parameters=[POOL_PARAM, TrafficSummaryQuerySerializer,
                    OpenApiParameter("format", OpenApiTypes.STR, enum=["json", "jsonl"],
                                     description="`jsonl`: the captured window in the trace format (a download)")],
        responses={200: OpenApiTypes.OBJECT, (200, "application/x-ndjson"): OpenApiResponse(OpenApiTypes.STR),
                   **error_responses(400, 401, 403, 404, 503)},
        description="The shape of the pool's captured ranking traffic over the window ending now (or at `end`): "
        "`requests`, "
        "`rate_qps`, prefix-length percentiles, short-length and candidates medians, `repeat_user_share` "
        "(requests of users seen more than once in the window), `outcomes`; what the instances measured: "
        "`latency_ms` p50/p99, `within_slo_share` (against the live revision's SLO, failures outside it), "
        "`hit_ratio`. No traffic is `requests: 0`. What Redis held that broke the capture's contract: "
        "`skipped_records` (records), `dropped_unreadable` (instance → why its dropped count is unreadable). "
        "`capture_off`: live instances that record no traffic, and why (no capture secret). "
        "`?format=jsonl` streams the window in the benchmark's trace format (user ids are the capture's "
        "keyed hashes), replayable by `relay_engine.bench --trace` and `relay_engine.sim run --trace`; "
        "each download is audited (`traffic.download`).",
    )
    def get(self, request, pool):
        pool_obj = policy_selectors.pool_get(name=pool)
        window_s = _window(request.query_params)
        end_s = _window_end(request.query_params)
        if request.accepted_renderer.format == "jsonl":
            lines = services.traffic_download(pool=pool_obj, window_s=window_s, actor=actor_name(request), end_s=end_s)
            response = StreamingHttpResponse(lines, content_type="application/x-ndjson")
            response["Content-Disposition"] = (f'attachment; filename="{pool_obj.name}-traffic-'
                                               f'{traffic.window_label(window_s)}.jsonl"')
            return response
        window = traffic.read_window(pool=pool_obj.name, window_s=window_s, end_s=end_s)
        return Response(traffic.summary(window, window_s, traffic.capture_extent(pool=pool_obj.name),
                                        slo_ms=pool_obj.slo.p99_ms, off=traffic.capture_off(pool=pool_obj)))


class RevisionPreviewView(APIView):
    @extend_schema(
        parameters=[POOL_PARAM, GENERATION_PARAM], request=PreviewRequestSerializer,
        responses={202: PreviewSerializer, 200: PreviewSerializer,
                   **error_responses(400, 401, 403, 404, 409, 429, 503)},
        description="Replay the pool's captured traffic of the window (default 15m, ending now rounded down "
        "to a fifteenth of the window, at most 1 min) through the fleet simulator, under the live revision "
        "and under revision `generation`: same requests, the pool's live instance count, the cost profile "
        "of its device. 202 with a queued preview; poll `url`. The same specs and window again reuse the "
        "existing preview (200 when it is done, 202 otherwise; same id). 409 when the window holds no "
        "captured traffic. 429 (with `Retry-After`) when the pool or the caller already has as many previews "
        "queued or running as `RELAYGR_PREVIEW_MAX_PER_POOL` / `RELAYGR_PREVIEW_MAX_PER_USER` allow; the "
        "message lists them. A started preview is audited (`preview.start`).",
    )
    def post(self, request, pool, generation):
        pool_obj = policy_selectors.pool_get(name=pool)
        window_s = _window(request.data if isinstance(request.data, dict) else {})
        preview, _ = services.preview_request(pool=pool_obj, generation=generation, window_s=window_s,
                                              actor=actor_name(request))
        done = preview.status in (preview.Status.DONE, preview.Status.FAILED)
        return Response(PreviewSerializer(preview).data,
                        status=status.HTTP_200_OK if done else status.HTTP_202_ACCEPTED)


class PreviewDetailView(APIView):
    @extend_schema(
        parameters=[POOL_PARAM, OpenApiParameter("preview", OpenApiTypes.INT, OpenApiParameter.PATH)],
        responses={200: PreviewSerializer, **error_responses(401, 403, 404)},
        description="A preview: `status` queued | running | done | failed, `error` (a sentence when failed), "
        "`result` when done: `live` and `proposed` figures (p99_ms, p50_ms, within_slo_share, "
        "slo_throughput_qps, `<tier>_peak_bytes` for each cache tier (hbm_peak_bytes, …), hit_ratio, preinfer_admitted, "
        "preinfer_refused by reason), `requests` replayed, `window`, the profile used, and `model_error`: the "
        "largest |P99 error| of the pool's last 5 scored previews (`scorecard`; null with a note while none was "
        "scored; see `GET …/previews/scores/`), the simulator's offline figure apart in `sim_validation`.",
    )
    def get(self, request, pool, preview):
        pool_obj = policy_selectors.pool_get(name=pool)
        return Response(PreviewSerializer(selectors.preview_get(pool=pool_obj, preview_id=preview)).data)


class PreviewScoresView(APIView):
    @extend_schema(
        parameters=[POOL_PARAM], responses={200: OpenApiTypes.OBJECT, **error_responses(401, 403, 404)},
        description="The pool's prediction scorecard: each previewed revision that was published (all at once "
        "or a canary promoted) measured over a window as long as its preview's, from the fleet's convergence on "
        "it. `scores`: the last 20, newest first: `status` waiting | done | failed (`reason`, a sentence), "
        "`predicted` and `measured` (p99_ms, p50_ms, within_slo_share, hit_ratio, admissions, "
        "admitted_per_request, requests; measured also p99_interval_ms, the measured P99's own 95 % interval "
        "from the window's requests), `errors` (p99, p50 and admissions relative: (predicted − measured) "
        "/ measured; within_slo_points and hit_ratio_points; p99_in_interval). `summary`: over the last 5 done, "
        "`p99_within_pct` (the largest |P99 error|), `p99_median_abs_pct`, `p50_within_pct`, `p99_in_interval` "
        "({inside, of}), "
        "`within_slo_within_points`, `hit_ratio_within_points` and a `note`; `source` \"none\" while no preview "
        "of the pool was scored. Every preview's `model_error` is this summary's `p99_within_pct`.",
    )
    def get(self, request, pool):
        pool_obj = policy_selectors.pool_get(name=pool)
        return Response({"pool": pool_obj.name, "summary": selectors.scorecard(pool=pool_obj),
                         "scores": PreviewScoreSerializer(selectors.score_list(pool=pool_obj), many=True).data})


class PoolCacheCurvesView(APIView):
    @extend_schema(
        parameters=[POOL_PARAM, CurveQuerySerializer],
        responses={200: CacheCurvesSerializer, **error_responses(400, 401, 403, 404, 409, 503)},
        description="Miss-ratio curves from the pool's captured traffic of the window (default 15m, ending now or "
        "at `end`): "
        "the hit ratio the pool would have had, and its split by tier, as a function of the HBM budget per "
        "instance (`axes.hbm`), of each lower tier's budget under the live HBM (`axes.dram`, …) and of HBM's "
        "entry TTL (`axes.entry_ttl`), the other values live; requests grouped by the instance that served them. "
        "`live`: the prediction at the live revision's budgets; `measured_hit_ratio`: what the instances served "
        "from a tier over the same requests; `error_points`: predicted minus measured. A window of more than "
        "1,000,000 requests is sampled: the most requested entries kept whole (`entries_whole`), the others "
        "spatially at `sampling_rate` < 1. 409 when the window holds no captured "
        "traffic. The model and its assumptions: `relay_engine/core/curves.py`.",
    )
    def get(self, request, pool):
        pool_obj = policy_selectors.pool_get(name=pool)
        window_s = _window(request.query_params)
        end_s = _window_end(request.query_params)
        return Response(CacheCurvesSerializer(cache_curves.pool_cache_curves(pool=pool_obj, window_s=window_s,
                                                                             now_s=end_s)).data)
