"""Shared view pieces: who is acting, OpenAPI parameters for pool and generation paths."""

from __future__ import annotations

from drf_spectacular.types import OpenApiTypes
from drf_spectacular.utils import OpenApiParameter, OpenApiResponse
from rest_framework import serializers

from .urls import POOL_NAME_PATTERN

POOL_PARAM = OpenApiParameter(
    "pool", OpenApiTypes.STR, OpenApiParameter.PATH, description="Pool name",
    pattern=f"^{POOL_NAME_PATTERN}$",
)
GENERATION_PARAM = OpenApiParameter(
    "generation", OpenApiTypes.INT, OpenApiParameter.PATH, description="Revision generation (1, 2, …)",
)


class ErrorSerializer(serializers.Serializer):
    detail = serializers.CharField()
    errors = serializers.DictField(child=serializers.ListField(child=serializers.CharField()), required=False)


def error_responses(*codes: int) -> dict[int, OpenApiResponse]:
    return {code: OpenApiResponse(ErrorSerializer) for code in codes}


def actor_name(request) -> str:
    return request.user.get_username()

