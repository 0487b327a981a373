"""Thin views: validate input, call one service or selector, serialize the result."""

from __future__ import annotations

from drf_spectacular.utils import OpenApiParameter, extend_schema
from rest_framework import status
from rest_framework.generics import GenericAPIView
from rest_framework.response import Response
from rest_framework.views import APIView

from controlplane.accounts.roles import Role
from controlplane.common.views import GENERATION_PARAM, POOL_PARAM, actor_name, error_responses, validated
from controlplane.rollouts import selectors as rollout_selectors
from controlplane.rollouts import services as rollout_services
from controlplane.rollouts.api.serializers import PublishInputSerializer, RolloutSerializer

from .. import selectors, services
from ..diff import spec_diff
from .serializers import (
    DiffQuerySerializer,
    DiffSerializer,
    PoolCreateInputSerializer,
    PoolSerializer,
    PublishResultSerializer,
    RevisionCreateInputSerializer,
    RevisionSerializer,
    RollbackInputSerializer,
)

READ_ERRORS = error_responses(401, 403, 404)
WRITE_ERRORS = error_responses(400, 401, 403, 404, 409, 413, 429)


class PoolListView(GenericAPIView):
    write_role = Role.ADMIN
    serializer_class = PoolSerializer

    def get_queryset(self):  # the browsable API asks for it too
        return selectors.pool_list()

    @extend_schema(responses={200: PoolSerializer(many=True), **error_responses(401, 403)})
    def get(self, request):
        page = self.paginate_queryset(self.get_queryset())
        return self.get_paginated_response(PoolSerializer(page, many=True).data)

    @extend_schema(request=PoolCreateInputSerializer, responses={201: PoolSerializer, **WRITE_ERRORS})
    def post(self, request):
        data = validated(PoolCreateInputSerializer, request.data)
        pool = services.pool_create(**data, actor=actor_name(request))
        pool = selectors.pool_get(name=pool.name)
        return Response(PoolSerializer(pool).data, status=status.HTTP_201_CREATED)


class PoolDetailView(APIView):
    @extend_schema(parameters=[POOL_PARAM], responses={200: PoolSerializer, **READ_ERRORS})
    def get(self, request, pool):
        return Response(PoolSerializer(selectors.pool_get(name=pool)).data)


class RevisionListView(GenericAPIView):
    serializer_class = RevisionSerializer

    def get_queryset(self):
        return selectors.revision_list(pool=selectors.pool_get(name=self.kwargs["pool"])).select_related("pool")

    @extend_schema(parameters=[POOL_PARAM], responses={200: RevisionSerializer(many=True), **READ_ERRORS})
    def get(self, request, pool):
        page = self.paginate_queryset(self.get_queryset())
        return self.get_paginated_response(RevisionSerializer(page, many=True).data)

    @extend_schema(
        parameters=[POOL_PARAM], request=RevisionCreateInputSerializer,
        responses={201: RevisionSerializer, **WRITE_ERRORS},
        description="Create a revision on top of `parent_generation`, which must be the pool's latest "
        "generation (409 otherwise). The spec is validated by the engine's schema; every error is "
        "reported by field path. Creating does not publish.",
    )
    def post(self, request, pool):
        pool_obj = selectors.pool_get(name=pool)
        data = validated(RevisionCreateInputSerializer, request.data)
        revision = services.revision_create(pool=pool_obj, author=actor_name(request), **data)
        revision = selectors.revision_get(pool=pool_obj, generation=revision.generation)  # with its past
        return Response(RevisionSerializer(revision).data, status=status.HTTP_201_CREATED)


class RevisionDetailView(APIView):
    @extend_schema(parameters=[POOL_PARAM, GENERATION_PARAM], responses={200: RevisionSerializer, **READ_ERRORS})
    def get(self, request, pool, generation):
        revision = selectors.revision_get(pool=selectors.pool_get(name=pool), generation=generation)
        return Response(RevisionSerializer(revision).data)


class RevisionDiffView(APIView):
    @extend_schema(
        parameters=[
            POOL_PARAM, GENERATION_PARAM,
            OpenApiParameter("against", int, description="Generation to compare with (default: the parent)"),
        ],
        responses={200: DiffSerializer, **error_responses(400, 401, 403, 404)},
    )
    def get(self, request, pool, generation):
        query = validated(DiffQuerySerializer, request.query_params)
        pool_obj = selectors.pool_get(name=pool)
        revision = selectors.revision_get(pool=pool_obj, generation=generation)
        against_generation = query.get("against") or revision.parent_generation or generation
        against = selectors.revision_get(pool=pool_obj, generation=against_generation)
        return Response(DiffSerializer({
            "pool": pool_obj.name, "generation": generation, "against": against_generation,
            "changes": spec_diff(against.spec, revision.spec),
        }).data)


class RevisionPublishView(APIView):
    @extend_schema(
        parameters=[POOL_PARAM, GENERATION_PARAM], request=PublishInputSerializer,
        responses={200: PublishResultSerializer, 201: RolloutSerializer, **WRITE_ERRORS, **error_responses(503)},
        description="Make this generation desired, write it to Redis and poke the pool. 503 means the "
        "database recorded the publish but Redis could not be reached: `relaygr_sync` (or retrying "
        "this call) delivers it.\n\nThe body is optional. Without one (or with `strategy: \"all\"`) "
        "every instance gets the generation at once (200). With `strategy: \"canary\"` the generation "
        "goes to `canary_instances` of the live instances first (a count, or a fraction in (0, 1); the "
        "lowest indexes; at least one stable instance must remain) and bakes for `bake_s` seconds; the "
        "control plane promotes it, or rolls it back when its error-budget burn exceeds `max_burn` "
        "(201, the rollout: `GET .../rollout/`). While a canary bakes, any publish is a 409.",
    )
    def post(self, request, pool, generation):
        pool_obj = selectors.pool_get(name=pool)
        if request.data:
            body = validated(PublishInputSerializer, request.data)
            options = dict(body)
            if options.pop("strategy") == "canary":
                rollout_services.rollout_start(pool=pool_obj, generation=generation, actor=actor_name(request),
                                               **options)
                return Response(RolloutSerializer(rollout_selectors.rollout_summary(pool=pool_obj)).data,
                                status=status.HTTP_201_CREATED)
        result = services.revision_publish(pool=pool_obj, generation=generation, actor=actor_name(request))
        return Response(PublishResultSerializer(result).data)


class PoolRollbackView(APIView):
    @extend_schema(
        parameters=[POOL_PARAM], request=RollbackInputSerializer,
        responses={201: PublishResultSerializer, 200: PublishResultSerializer, **WRITE_ERRORS,
                   **error_responses(503)},
        description="Publish the spec of `to_generation` again as a new generation (201) on top of "
        "`parent_generation`, which must be the pool's latest generation (409 otherwise, nothing written). "
        "Repeating the same request (same `parent_generation` and `to_generation`) creates nothing new: "
        "it answers 200 with the revision the first one created and `changed: false`.",
    )
    def post(self, request, pool):
        pool_obj = selectors.pool_get(name=pool)
        data = validated(RollbackInputSerializer, request.data)
        result = services.pool_roll_back(pool=pool_obj, actor=actor_name(request), **data)
        return Response(PublishResultSerializer(result).data,
                        status=status.HTTP_201_CREATED if result.changed else status.HTTP_200_OK)
