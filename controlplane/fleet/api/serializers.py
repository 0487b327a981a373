from rest_framework import serializers

from relay_engine.core.wire import CONFIG_STATES


class InstanceStatusSerializer(serializers.Serializer):
    instance = serializers.CharField()
    live = serializers.BooleanField()
    heartbeat_age_s = serializers.FloatField(allow_null=True)
    device = serializers.CharField()
    pid = serializers.IntegerField()
    applied_generation = serializers.IntegerField()
    applied_sha256 = serializers.CharField(allow_blank=True)
    config_state = serializers.ChoiceField(choices=CONFIG_STATES)
    nacked_generation = serializers.IntegerField()
    error = serializers.CharField(allow_blank=True)
    up_to_date = serializers.BooleanField()
    hbm_bytes = serializers.IntegerField()
    hbm_budget_bytes = serializers.IntegerField()
    dram_bytes = serializers.IntegerField()
    dram_budget_bytes = serializers.IntegerField()
    device_memory_bytes = serializers.IntegerField()
    started_at = serializers.FloatField(allow_null=True)


class PoolStatusSerializer(serializers.Serializer):
    pool = serializers.CharField()
    desired_generation = serializers.IntegerField()
    published_generation = serializers.IntegerField()
    expected_instances = serializers.IntegerField()
    live_instances = serializers.IntegerField()
    converged = serializers.BooleanField()
    checked_at = serializers.FloatField()
    instances = InstanceStatusSerializer(many=True)
