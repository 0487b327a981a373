from drf_spectacular.types import OpenApiTypes
from drf_spectacular.utils import OpenApiResponse, extend_schema
from rest_framework.renderers import BaseRenderer
from rest_framework.response import Response
from rest_framework.views import APIView

from controlplane.common.views import INSTANCE_PARAM, POOL_PARAM, error_responses, instance_of, validated
from controlplane.policies import selectors as policy_selectors

from .. import forwards, prometheus, selectors
from ..history import redis_reads
from .serializers import (
    ForwardTimesQuerySerializer,
    ForwardTimesSerializer,
    InstanceMetricsSerializer,
    InstanceTableQuerySerializer,
    InstanceTableSerializer,
    MetricsQuerySerializer,
    PoolMetricsQuerySerializer,
    PoolMetricsSerializer,
)


class PoolMetricsView(APIView):
    @extend_schema(
        parameters=[POOL_PARAM, PoolMetricsQuerySerializer],
        responses={200: OpenApiResponse(PoolMetricsSerializer, description=(
            "Aligned series of the pool, from the pool rollups: `timestamps` (point starts, unix s, from "
            "`from`: the whole window, or from `since` on an incremental poll); `fleet` with p50_ms/p99_ms "
            "(from merged histogram buckets), rank_per_s, rank_within_slo_per_s, slo_compliance_ratio, "
            "hbm_hit_ratio, hit_ratio (served without a recompute), lookup_ratio by outcome (every outcome the core "
            "knows), misses_per_s by miss reason, preinfer_admitted_per_s, "
            "preinfer_refused_per_s by reason, every cache tier's `<tier>_bytes` and `<tier>_budget_bytes` "
            "summed over the instances reporting (`instances`), `totals` for "
            "the whole window (misses_by_reason among them); `top`: the `n` worst instances by `by`, worst first, each with its ranking "
            "`value` and its series from `from`; `annotations`: publishes in the window.")),
            **error_responses(400, 401, 403, 404, 503)},
    )
    def get(self, request, pool):
        query = validated(PoolMetricsQuerySerializer, request.query_params)
        pool_obj = policy_selectors.pool_get(name=pool)
        return Response(selectors.pool_metrics(pool=pool_obj, **query))


class InstanceTableView(APIView):
    @extend_schema(
        operation_id="pool_instances_list", parameters=[POOL_PARAM, InstanceTableQuerySerializer],
        responses={200: OpenApiResponse(InstanceTableSerializer, description=(
            "Every instance that reported in the window, with its window figures (requests, P50/P99 from "
            "its merged buckets, share within the SLO, HBM hit and miss ratios, pre-infers admitted) and "
            "its newest HBM bytes, budget, pressure and applied generation; sorted by `sort`, paged by "
            "`limit`/`offset`; `count` is the number of instances.")),
            **error_responses(400, 401, 403, 404, 503)},
    )
    def get(self, request, pool):
        query = validated(InstanceTableQuerySerializer, request.query_params)
        pool_obj = policy_selectors.pool_get(name=pool)
        return Response(selectors.instance_table(pool=pool_obj, **query))


class InstanceMetricsView(APIView):
    @extend_schema(
        operation_id="pool_instance_metrics", parameters=[POOL_PARAM, INSTANCE_PARAM, MetricsQuerySerializer],
        responses={200: OpenApiResponse(InstanceMetricsSerializer, description=(
            "One instance's series over the window (every figure of the pool view, and its gauges), "
            "its window `totals` and the publishes; incremental with `since` like the pool's.")),
            **error_responses(400, 401, 403, 404, 503)},
    )
    def get(self, request, pool, instance):
        query = validated(MetricsQuerySerializer, request.query_params)
        pool_obj = policy_selectors.pool_get(name=pool)
        return Response(selectors.instance_metrics(pool=pool_obj, instance=instance_of(pool, instance),
                                                   **query))


class PoolForwardTimesView(APIView):
    @extend_schema(
        operation_id="pool_forward_times", parameters=[POOL_PARAM, ForwardTimesQuerySerializer],
        responses={200: OpenApiResponse(ForwardTimesSerializer, description=(
            "How long the pool's own forward passes took over the last `window_s` seconds, by operation "
            "(`prefill`, `rank` against a cached prefix, `rank_full`) and prefix length (quarter-octave "
            "buckets): `summary` rows (forwards, mean tokens, short-term tokens and candidates, mean ms, "
            "coefficient of variation) and `ops`, the mergeable sums (count, sum_ms, sum_sq_ms, sum_n, "
            "sum_s, sum_c per bucket) that `python -m relay_engine.sim fit --forward-times` fits the pool's "
            "cost model from, as previews do. On a CPU each time is the thread's CPU time (`clock`: "
            "`thread_cpu`), on an accelerator the call's wall time. `instances`: those counted (the model "
            "most of them run, `model_version`); `other_models`, `unreadable`: those left out and why.")),
            **error_responses(400, 401, 403, 404, 503)},
    )
    def get(self, request, pool):
        query = validated(ForwardTimesQuerySerializer, request.query_params)
        pool_obj = policy_selectors.pool_get(name=pool)
        return Response(_forward_times(pool=pool_obj.name, window_s=query["window_s"]))


@redis_reads
def _forward_times(client, *, pool: str, window_s: int) -> dict:
    return forwards.pool_forward_times(client, pool=pool, window_s=window_s)


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
