from drf_spectacular.utils import extend_schema
from rest_framework.response import Response
from rest_framework.views import APIView

from controlplane.common.views import INSTANCE_PARAM, POOL_PARAM, error_responses, instance_of, validated
from controlplane.policies import selectors as policy_selectors

from .. import selectors
from .serializers import InstanceStatusSerializer, PoolStatusQuerySerializer, PoolStatusSerializer


class PoolStatusView(APIView):
    @extend_schema(
        parameters=[POOL_PARAM, PoolStatusQuerySerializer],
        responses={200: PoolStatusSerializer, **error_responses(400, 401, 403, 404, 503)},
        description="Desired generation and, per instance, applied generation, ACK/NACK and error, "
        "heartbeat age, device and memory; `converged` is true when every live instance has ACKed the "
        "desired generation (and there is at least one). `counts` tallies the states over the whole pool; "
        "`instances` is every instance, or a page of them with `limit`/`offset` in `order`.",
    )
    def get(self, request, pool):
        query = validated(PoolStatusQuerySerializer, request.query_params)
        status = selectors.pool_status(pool=policy_selectors.pool_get(name=pool), **query)
        return Response(PoolStatusSerializer(status.to_dict()).data)


class InstanceStatusView(APIView):
    @extend_schema(
        operation_id="pool_instance_status", parameters=[POOL_PARAM, INSTANCE_PARAM], responses={200: InstanceStatusSerializer,
                                                           **error_responses(401, 403, 404, 503)},
        description="One instance's status as the pool status reports it: liveness, heartbeat age, applied "
        "generation, ACK/NACK and error, device and memory.",
    )
    def get(self, request, pool, instance):
        pool_obj = policy_selectors.pool_get(name=pool)
        view = selectors.instance_status(pool=pool_obj, instance=instance_of(pool, instance))
        return Response(InstanceStatusSerializer(view.to_dict()).data)
