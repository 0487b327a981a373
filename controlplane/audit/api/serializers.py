from rest_framework import serializers

from ..models import AuditEntry


class AuditQuerySerializer(serializers.Serializer):
    pool = serializers.CharField(required=False, max_length=63)
    actor = serializers.CharField(required=False, max_length=150)
    action = serializers.ChoiceField(choices=AuditEntry.Action.choices, required=False)
    since = serializers.DateTimeField(required=False)
    until = serializers.DateTimeField(required=False)


class AuditEntrySerializer(serializers.ModelSerializer):
    before = serializers.JSONField(allow_null=True)
    after = serializers.JSONField(allow_null=True)

    class Meta:
        model = AuditEntry
        fields = ["id", "time", "actor", "request_id", "action", "object_type", "object_id", "pool",
                  "before", "after"]
