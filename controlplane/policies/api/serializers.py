from __future__ import annotations

from drf_spectacular.types import OpenApiTypes
from drf_spectacular.utils import extend_schema_field
from rest_framework import serializers

from controlplane.common.fields import StrictCharField, StrictIntegerField, StrictSerializer
from controlplane.common.urls import POOL_NAME_PATTERN
from controlplane.rollouts.models import Rollout

from ..models import DEVICE_KINDS, MAX_EXPECTED_INSTANCES, ConfigRevision, Pool


@extend_schema_field(OpenApiTypes.OBJECT)
class SpecField(serializers.JSONField):
    """Any JSON here; the engine's validate_policy judges it and names every bad field."""


class PoolCreateInputSerializer(StrictSerializer):
    name = serializers.RegexField(
        rf"^{POOL_NAME_PATTERN}$", max_length=63,
        error_messages={"invalid": "must be 1-63 of a-z, 0-9, '-', '_', starting with a letter or digit"},
    )
    description = StrictCharField(max_length=500, allow_blank=True, required=False, default="")
    device_kind = serializers.ChoiceField(choices=DEVICE_KINDS, required=False, default="auto")
    expected_instances = StrictIntegerField(min_value=1, max_value=MAX_EXPECTED_INSTANCES, required=False, default=1)


class SloSerializer(serializers.Serializer):
    ranking_p99_slo_ms = serializers.FloatField()
    target_ratio = serializers.FloatField()


class PoolSerializer(serializers.ModelSerializer):
    latest_generation = serializers.IntegerField()
    slo = serializers.SerializerMethodField()

    class Meta:
        model = Pool
        fields = [
            "name", "description", "device_kind", "expected_instances", "desired_generation",
            "published_generation", "latest_generation", "slo", "desired_at", "desired_by", "created_at",
            "created_by",
        ]

    @extend_schema_field(SloSerializer)
    def get_slo(self, pool: Pool) -> dict:
        slo = pool.slo
        return {"ranking_p99_slo_ms": slo.p99_ms, "target_ratio": slo.target_ratio}


class RevisionSerializer(serializers.ModelSerializer):
    pool = serializers.CharField(source="pool.name")
    spec = SpecField()
    was_desired = serializers.BooleanField(help_text=(
        "Whether this generation was once the whole pool's desired generation (the first one, or published: "
        "a promotion and a rollback publish too). Only such a generation is offered for rollback in the editor; "
        "one that never was is a what-if (made for a preview) or a canary that did not get promoted."))
    rollout_state = serializers.ChoiceField(
        choices=Rollout.State.values, allow_null=True,
        help_text="The state of this generation's latest canary rollout; null when it was never canaried.")

    class Meta:
        model = ConfigRevision
        fields = ["pool", "generation", "parent_generation", "sha256", "spec", "author", "comment",
                  "restored_from", "created_at", "was_desired", "rollout_state"]


class RevisionCreateInputSerializer(StrictSerializer):
    parent_generation = StrictIntegerField(min_value=1)
    spec = SpecField()
    comment = StrictCharField(max_length=1000, allow_blank=True, required=False, default="")


class RollbackInputSerializer(StrictSerializer):
    to_generation = StrictIntegerField(min_value=1, help_text="The generation whose spec to publish again.")
    parent_generation = StrictIntegerField(
        min_value=1, help_text="The pool's latest generation as the caller saw it (as for a create): "
        "stale when another revision came first, and the rollback is then a 409 that writes nothing.")
    comment = StrictCharField(max_length=1000, allow_blank=True, required=False, default="")


class PublishResultSerializer(serializers.Serializer):
    pool = serializers.CharField(source="pool.name")
    generation = serializers.IntegerField(source="revision.generation")
    sha256 = serializers.CharField(source="revision.sha256")
    desired_generation = serializers.IntegerField(source="pool.desired_generation")
    published_generation = serializers.IntegerField(source="pool.published_generation")
    changed = serializers.BooleanField()


class DiffQuerySerializer(serializers.Serializer):
    against = serializers.IntegerField(min_value=1, max_value=999_999_999, required=False)


class SpecChangeSerializer(serializers.Serializer):
    path = serializers.CharField()
    op = serializers.ChoiceField(choices=["added", "removed", "changed"])
    before = serializers.JSONField(allow_null=True)
    after = serializers.JSONField(allow_null=True)


class DiffSerializer(serializers.Serializer):
    pool = serializers.CharField()
    generation = serializers.IntegerField()
    against = serializers.IntegerField()
    changes = SpecChangeSerializer(many=True)
