from drf_spectacular.utils import extend_schema
from rest_framework.response import Response
from rest_framework.views import APIView

from controlplane.common.views import POOL_PARAM, error_responses
from controlplane.policies import selectors as policy_selectors

from .. import selectors
from .serializers import PoolStatusSerializer


class PoolStatusView(APIView):
    @extend_schema(
        parameters=[POOL_PARAM], responses={200: PoolStatusSerializer, **error_responses(401, 403, 404, 503)},
        description="Desired generation and, per instance, applied generation, ACK/NACK and error, "
        "heartbeat age, device and memory; `converged` is true when every live instance has ACKed the "
        "desired generation (and there is at least one).",
    )
    def get(self, request, pool):
        status = selectors.pool_status(pool=policy_selectors.pool_get(name=pool))
        return Response(PoolStatusSerializer(status.to_dict()).data)
