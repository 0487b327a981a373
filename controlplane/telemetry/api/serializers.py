from rest_framework import serializers

from ..selectors import WINDOWS


class MetricsQuerySerializer(serializers.Serializer):
    window = serializers.ChoiceField(
        choices=list(WINDOWS), required=False, default="1h",
        error_messages={"invalid_choice": f"must be one of {', '.join(WINDOWS)}; got {{input!r}}."},
    )
