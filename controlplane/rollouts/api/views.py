"""Thin views: the pool's rollout, and promoting or aborting it by hand."""

from __future__ import annotations

from drf_spectacular.utils import extend_schema
from rest_framework.response import Response
from rest_framework.views import APIView

from controlplane.common.errors import Conflict
from controlplane.common.views import POOL_PARAM, actor_name, error_responses
from controlplane.policies import selectors as policy_selectors

from .. import selectors, services
from ..models import Rollout
from .serializers import RolloutSerializer

ACTION_ERRORS = error_responses(401, 403, 404, 409, 429, 503)


def _baking(pool):
    rollout = selectors.rollout_baking(pool=pool)
    if rollout is None:
        raise Conflict(f"no canary is baking on pool {pool.name!r}: nothing to promote or abort "
                       f"(GET /api/v1/pools/{pool.name}/rollout/ shows the last rollout).")
    return rollout


class RolloutView(APIView):
    @extend_schema(
        parameters=[POOL_PARAM], responses={200: RolloutSerializer, **error_responses(401, 403, 404)},
        description="The pool's latest canary rollout: its state (`none` when there never was one), the "
        "canary instances, the bake's end and the figures of the last evaluation (requests, bad requests, "
        "error-budget burn and its 95% Wilson bounds, P99, for the canary and the stable instances), with "
        "their series over the bake.",
    )
    def get(self, request, pool):
        return Response(RolloutSerializer(selectors.rollout_summary(pool=policy_selectors.pool_get(name=pool))).data)


class RolloutPromoteView(APIView):
    @extend_schema(
        parameters=[POOL_PARAM], request=None, responses={200: RolloutSerializer, **ACTION_ERRORS},
        description="Promote the baking canary now: its generation is published to every instance (audited). "
        "409 when no canary bakes.",
    )
    def post(self, request, pool):
        pool_obj = policy_selectors.pool_get(name=pool)
        actor = actor_name(request)
        services.rollout_promote(rollout=_baking(pool_obj), actor=actor, reason=f"promoted by hand by {actor}")
        return Response(RolloutSerializer(selectors.rollout_summary(pool=pool_obj)).data)


class RolloutAbortView(APIView):
    @extend_schema(
        parameters=[POOL_PARAM], request=None, responses={200: RolloutSerializer, **ACTION_ERRORS},
        description="Abort the baking canary: the canary instances return to the stable generation (a "
        "rollback by hand, state `aborted`, audited). 409 when no canary bakes.",
    )
    def post(self, request, pool):
        pool_obj = policy_selectors.pool_get(name=pool)
        actor = actor_name(request)
        services.rollout_roll_back(rollout=_baking(pool_obj), actor=actor, reason=f"aborted by {actor}",
                                   state=Rollout.State.ABORTED)
        return Response(RolloutSerializer(selectors.rollout_summary(pool=pool_obj)).data)
