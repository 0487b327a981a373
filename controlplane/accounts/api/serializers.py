from drf_spectacular.utils import extend_schema_field
from rest_framework import serializers

from controlplane.common.fields import StrictBooleanField, StrictCharField, StrictSerializer

from ..models import ApiToken
from ..roles import ROLE_NAMES, role_of


class MeSerializer(serializers.Serializer):
    username = serializers.CharField()
    role = serializers.ChoiceField(choices=ROLE_NAMES, allow_null=True)
    read_only_token = serializers.BooleanField()


class UserSerializer(serializers.Serializer):
    username = serializers.CharField()
    role = serializers.SerializerMethodField()
    is_active = serializers.BooleanField()

    @extend_schema_field(serializers.ChoiceField(choices=ROLE_NAMES, allow_null=True))
    def get_role(self, user):
        role = role_of(user)
        return role.label if role else None


class UserCreateInputSerializer(StrictSerializer):
    username = serializers.RegexField(r"^[\w.@+-]{1,150}$", error_messages={
        "invalid": "must be 1-150 letters, digits and @/./+/-/_"})
    role = serializers.ChoiceField(choices=ROLE_NAMES)
    password = StrictCharField(required=False, min_length=12, max_length=256, write_only=True)


class TokenSerializer(serializers.ModelSerializer):
    user = serializers.CharField(source="user.username")
    active = serializers.BooleanField(source="is_active")

    class Meta:
        model = ApiToken
        fields = ["id", "user", "name", "key_prefix", "read_only", "active", "created_at", "revoked_at"]


class TokenIssuedSerializer(TokenSerializer):
    key = serializers.CharField(help_text="The secret; shown only in this response.")

    class Meta(TokenSerializer.Meta):
        fields = [*TokenSerializer.Meta.fields, "key"]


class TokenCreateInputSerializer(StrictSerializer):
    username = StrictCharField(max_length=150)
    name = StrictCharField(max_length=100, required=False, allow_blank=True, default="")
    read_only = StrictBooleanField(required=False, default=False)
