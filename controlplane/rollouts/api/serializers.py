from __future__ import annotations

from drf_spectacular.types import OpenApiTypes
from drf_spectacular.utils import extend_schema_field
from rest_framework import serializers

from controlplane.common.fields import StrictIntegerField, StrictSerializer
from controlplane.policies.models import MAX_EXPECTED_INSTANCES
from relay_engine.core import fields

from ..models import Rollout

MIN_BAKE_S, MAX_BAKE_S = 5, 86_400
MAX_BURN_LIMIT = 100.0


@extend_schema_field(OpenApiTypes.NUMBER)
class StrictNumberField(serializers.Field):
    """A finite JSON number in (lo, hi] (no strings, no booleans)."""

    def __init__(self, *, lo: float, hi: float, **kwargs):
        self.lo, self.hi = lo, hi
        super().__init__(**kwargs)

    def to_internal_value(self, data):
        try:  # the schema's one number check: a 401-digit integer is out of range, never an OverflowError
            return fields.number(data, self.lo, self.hi, lo_open=True)
        except fields.FieldValueError:
            raise serializers.ValidationError(f"must be a number above {self.lo:g} and at most {self.hi:g}, "
                                              f"got {fields.show(data)}.") from None

    def to_representation(self, value):
        return value


@extend_schema_field(OpenApiTypes.NUMBER)
class CanaryInstancesField(serializers.Field):
    """How many live instances get the canary: a count (1, 2, …) or a fraction in (0, 1)."""

    def to_internal_value(self, data):
        if isinstance(data, float) and 0 < data < 1:
            return data
        try:
            return fields.integer(data, 1, MAX_EXPECTED_INSTANCES - 1)
        except fields.FieldValueError:
            raise serializers.ValidationError(
                f"must be a count of instances (an integer from 1 to {MAX_EXPECTED_INSTANCES - 1}) or a fraction "
                f"of the live instances (a number above 0 and below 1), got {fields.show(data)}.") from None

    def to_representation(self, value):
        return value


class PublishInputSerializer(StrictSerializer):
    """The optional body of a publish. Without one, or with ``strategy: "all"``, every instance gets the
    generation at once."""

    strategy = serializers.ChoiceField(choices=["all", "canary"], help_text="`canary`: to a few instances first")
    canary_instances = CanaryInstancesField(required=False, default=1,
                                            help_text="a count (1) or a fraction of the live instances (0.25)")
    bake_s = StrictIntegerField(min_value=MIN_BAKE_S, max_value=MAX_BAKE_S, required=False, default=300,
                                help_text="how long the canary bakes before it is promoted")
    max_burn = StrictNumberField(lo=0.0, hi=MAX_BURN_LIMIT, required=False, default=1.0,
                                 help_text="the highest error-budget burn the canary may show (1.0: the budget's pace)")

    def validate(self, attrs):
        if attrs["strategy"] == "all":
            extra = sorted(set(self.initial_data) & {"canary_instances", "bake_s", "max_burn"})
            if extra:
                raise serializers.ValidationError({key: ['only with strategy "canary".'] for key in extra})
        return attrs


class GroupFiguresSerializer(serializers.Serializer):
    requests = serializers.IntegerField()
    bad = serializers.IntegerField()
    bad_share = serializers.FloatField(allow_null=True)
    burn = serializers.FloatField(allow_null=True)
    bad_low = serializers.FloatField()
    bad_high = serializers.FloatField()
    burn_low = serializers.FloatField()
    burn_high = serializers.FloatField()
    p99_ms = serializers.FloatField(allow_null=True)


class SeriesPointSerializer(serializers.Serializer):
    t = serializers.FloatField()
    canary_p99_ms = serializers.FloatField(allow_null=True)
    stable_p99_ms = serializers.FloatField(allow_null=True)
    canary_burn = serializers.FloatField(allow_null=True)
    stable_burn = serializers.FloatField(allow_null=True)


class RolloutSerializer(serializers.Serializer):
    pool = serializers.CharField()
    state = serializers.ChoiceField(choices=["none", *Rollout.State.values])
    generation = serializers.IntegerField(allow_null=True)
    stable_generation = serializers.IntegerField(allow_null=True)
    canary = serializers.ListField(child=serializers.CharField())
    bake_s = serializers.IntegerField(allow_null=True)
    max_burn = serializers.FloatField(allow_null=True)
    started_at = serializers.DateTimeField(allow_null=True)
    started_by = serializers.CharField(allow_blank=True)
    bake_ends_at = serializers.DateTimeField(allow_null=True)
    bake_left_s = serializers.FloatField(allow_null=True, help_text="seconds to bake end while baking")
    decided_at = serializers.DateTimeField(allow_null=True)
    decided_by = serializers.CharField(allow_blank=True, help_text="a user, or rollout-evaluator")
    reason = serializers.CharField(allow_blank=True)
    canary_burn = serializers.FloatField(allow_null=True)
    stable_burn = serializers.FloatField(allow_null=True)
    canary_figures = GroupFiguresSerializer(allow_null=True)
    stable_figures = GroupFiguresSerializer(allow_null=True)
    series = SeriesPointSerializer(many=True)
