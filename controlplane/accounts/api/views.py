from drf_spectacular.utils import extend_schema
from rest_framework import status
from rest_framework.generics import GenericAPIView
from rest_framework.response import Response
from rest_framework.views import APIView

from controlplane.common.views import actor_name, error_responses, validated

from .. import selectors, services
from ..models import ApiToken
from ..roles import Role, role_of
from .serializers import (
    MeSerializer,
    TokenCreateInputSerializer,
    TokenIssuedSerializer,
    TokenSerializer,
    UserCreateInputSerializer,
    UserSerializer,
)

ADMIN_READ_ERRORS = error_responses(401, 403)
ADMIN_WRITE_ERRORS = error_responses(400, 401, 403, 404, 409, 413, 429)


class MeView(APIView):
    @extend_schema(responses={200: MeSerializer, **error_responses(401, 403)})
    def get(self, request):
        role = role_of(request.user)
        read_only = isinstance(request.auth, ApiToken) and request.auth.read_only
        return Response(MeSerializer({"username": request.user.get_username(), "role": role.label if role else None,
                                      "read_only_token": read_only}).data)


class UserListView(GenericAPIView):
    read_role = Role.ADMIN
    write_role = Role.ADMIN
    serializer_class = UserSerializer

    def get_queryset(self):  # the browsable API asks for it too
        return selectors.user_list()

    @extend_schema(responses={200: UserSerializer(many=True), **ADMIN_READ_ERRORS})
    def get(self, request):
        page = self.paginate_queryset(self.get_queryset())
        return self.get_paginated_response(UserSerializer(page, many=True).data)

    @extend_schema(request=UserCreateInputSerializer, responses={201: UserSerializer, **ADMIN_WRITE_ERRORS})
    def post(self, request):
        data = validated(UserCreateInputSerializer, request.data)
        user = services.user_create(
            username=data["username"], role=Role.parse(data["role"]),
            password=data.get("password"), actor=actor_name(request),
        )
        return Response(UserSerializer(user).data, status=status.HTTP_201_CREATED)


class TokenListView(GenericAPIView):
    read_role = Role.ADMIN
    write_role = Role.ADMIN
    serializer_class = TokenSerializer

    def get_queryset(self):
        return selectors.token_list()

    @extend_schema(responses={200: TokenSerializer(many=True), **ADMIN_READ_ERRORS})
    def get(self, request):
        page = self.paginate_queryset(self.get_queryset())
        return self.get_paginated_response(TokenSerializer(page, many=True).data)

    @extend_schema(request=TokenCreateInputSerializer, responses={201: TokenIssuedSerializer, **ADMIN_WRITE_ERRORS})
    def post(self, request):
        data = validated(TokenCreateInputSerializer, request.data)
        issued = services.token_create(
            user=selectors.user_get(username=data["username"]), name=data["name"],
            read_only=data["read_only"], actor=actor_name(request),
        )
        body = TokenSerializer(issued.token).data
        return Response({**body, "key": issued.key}, status=status.HTTP_201_CREATED)


class TokenDetailView(APIView):
    read_role = Role.ADMIN
    write_role = Role.ADMIN

    @extend_schema(request=None, responses={200: TokenSerializer, **error_responses(401, 403, 404, 429)})
    def delete(self, request, token_id):
        token = services.token_revoke(token_id=token_id, actor=actor_name(request))
        return Response(TokenSerializer(token).data)
