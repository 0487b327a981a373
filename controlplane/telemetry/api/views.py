from drf_spectacular.types import OpenApiTypes
from drf_spectacular.utils import OpenApiResponse, extend_schema
from rest_framework.renderers import BaseRenderer
from rest_framework.response import Response
from rest_framework.views import APIView

from controlplane.common.views import POOL_PARAM, error_responses
from controlplane.policies import selectors as policy_selectors

from .. import prometheus, selectors
from .serializers import MetricsQuerySerializer


class PoolMetricsView(APIView):
    @extend_schema(
        parameters=[POOL_PARAM, MetricsQuerySerializer],
        responses={200: OpenApiResponse(OpenApiTypes.OBJECT, description=(
            "Aligned series: `timestamps` (bucket starts, unix s); `fleet` and `instances[<name>]` each "
            "with p50_ms/p99_ms (from merged histogram buckets), rank_per_s, rank_within_slo_per_s, "
            "slo_compliance_ratio, hbm/dram/inflight_join/miss ratios, preinfer_admitted_per_s, "
            "preinfer_refused_per_s by reason, and (instances) hbm_bytes vs hbm_budget_bytes; "
            "`totals` for the whole window; `annotations`: publishes in the window.")),
            **error_responses(400, 401, 403, 404, 503)},
    )
    def get(self, request, pool):
        query = MetricsQuerySerializer(data=request.query_params)
        query.is_valid(raise_exception=True)
        pool_obj = policy_selectors.pool_get(name=pool)
        return Response(selectors.pool_metrics(pool=pool_obj, window=query.validated_data["window"]))


class PrometheusTextRenderer(BaseRenderer):
    media_type = "text/plain"
    format = "prometheus"
    charset = "utf-8"

    def render(self, data, accepted_media_type=None, renderer_context=None):
        if isinstance(data, bytes):
            return data
        detail = data.get("detail", data) if isinstance(data, dict) else data
        return f"# {detail}\n".encode()


class PrometheusMetricsView(APIView):
    renderer_classes = [PrometheusTextRenderer]

    @extend_schema(
        responses={(200, "text/plain"): OpenApiResponse(OpenApiTypes.STR, description="Prometheus text format 0.0.4"),
                   **error_responses(401, 403)},
        description="Fleet figures in Prometheus text exposition format (scrape with "
        "`authorization: {type: Token, credentials: <key>}`).",
    )
    def get(self, request):
        response = Response(prometheus.exposition())
        response["Content-Type"] = "text/plain; version=0.0.4; charset=utf-8"
        return response
