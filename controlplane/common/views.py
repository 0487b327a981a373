"""Shared view pieces: who is acting, validated input, OpenAPI parameters for pool and generation
paths."""

from __future__ import annotations

from drf_spectacular.types import OpenApiTypes
from drf_spectacular.utils import OpenApiParameter, OpenApiResponse
from rest_framework import serializers

from relay_engine.core import wire

from .errors import NotFound
from .urls import INSTANCE_NAME_PATTERN, POOL_NAME_PATTERN

POOL_PARAM = OpenApiParameter(
    "pool", OpenApiTypes.STR, OpenApiParameter.PATH, description="Pool name",
    pattern=f"^{POOL_NAME_PATTERN}$",
)
INSTANCE_PARAM = OpenApiParameter(
    "instance", OpenApiTypes.STR, OpenApiParameter.PATH, description="Instance name, `<pool>.<index>`",
    pattern=f"^{INSTANCE_NAME_PATTERN}$",
)
GENERATION_PARAM = OpenApiParameter(
    "generation", OpenApiTypes.INT, OpenApiParameter.PATH, description="Revision generation (1, 2, …)",
)


class ErrorSerializer(serializers.Serializer):
    detail = serializers.CharField()
    errors = serializers.DictField(child=serializers.ListField(child=serializers.CharField()), required=False)


def error_responses(*codes: int) -> dict[int, OpenApiResponse]:
    return {code: OpenApiResponse(ErrorSerializer) for code in codes}


def validated(serializer_class: type[serializers.Serializer], data) -> dict:
    """``data`` (a request's body or query parameters) validated by ``serializer_class``: a 400 naming each
    bad field, else the validated data."""
    serializer = serializer_class(data=data)
    serializer.is_valid(raise_exception=True)
    return serializer.validated_data


def actor_name(request) -> str:
    return request.user.get_username()



def is_instance_of(pool: str, instance: str) -> bool:
    """Whether ``instance`` is named as one of ``pool``'s (``<pool>.<index>``, the wire's rule)."""
    try:
        wire.instance_index(instance, pool)
    except wire.WireError:
        return False
    return True


def instance_of(pool: str, instance: str) -> str:
    """``instance`` when it is named as one of ``pool``'s (``<pool>.<index>``), else a 404."""
    if not is_instance_of(pool, instance):
        raise NotFound(f"{instance!r} is not an instance of pool {pool!r} (names are {pool}.<index>, "
                       f"index 0–{wire.MAX_INSTANCE_INDEX}).")
    return instance
