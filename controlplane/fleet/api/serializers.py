from rest_framework import serializers

from controlplane.common.fields import QueryIntegerField
from relay_engine.core.wire import CONFIG_STATES


class TierLevelsSerializer(serializers.Serializer):
    bytes = serializers.IntegerField(help_text="KV cache bytes the tier holds")
    budget_bytes = serializers.IntegerField()


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
    desired_generation = serializers.IntegerField(
        help_text="the generation this instance should run: the pool's, or a baking canary's")
    canary = serializers.BooleanField(help_text="a canary instance of the rollout baking on the pool")
    tiers = serializers.DictField(child=TierLevelsSerializer(), help_text="every cache tier the instance runs, "
                                  "by name, in lookup order (the names: the core's tiers, as the pages get them)")
    device_memory_bytes = serializers.IntegerField()
    started_at = serializers.FloatField(allow_null=True)
    capture_off = serializers.CharField(allow_blank=True, help_text="why this instance records no traffic "
                                        "(empty while it captures)")
    model_num_layers = serializers.IntegerField(help_text="the model it serves, which an edit must target "
                                                "(0: not said)")
    model_num_heads = serializers.IntegerField()
    model_head_dim = serializers.IntegerField()


class StateCountsSerializer(serializers.Serializer):
    acked = serializers.IntegerField(help_text="live and on the desired generation")
    nacked = serializers.IntegerField(help_text="live and refused the desired generation")
    waiting = serializers.IntegerField(help_text="live, neither yet")
    gone = serializers.IntegerField(help_text="heartbeat stale")


class PoolStatusQuerySerializer(serializers.Serializer):
    order = serializers.ChoiceField(choices=["name", "problems"], required=False, default="name",
                                    help_text="`problems`: NACKed first, then waiting, gone, ACKed")
    limit = QueryIntegerField(lo=1, hi=10_000, required=False, default=None,
                              help_text="a page of `instances` (default: all)")
    offset = QueryIntegerField(lo=0, hi=100_000, required=False, default=0)


class PoolStatusSerializer(serializers.Serializer):
    pool = serializers.CharField()
    desired_generation = serializers.IntegerField()
    published_generation = serializers.IntegerField()
    expected_instances = serializers.IntegerField()
    live_instances = serializers.IntegerField()
    converged = serializers.BooleanField()
    checked_at = serializers.FloatField()
    counts = StateCountsSerializer()
    total_instances = serializers.IntegerField()
    tiers = serializers.ListField(child=serializers.CharField(), help_text="every cache tier an instance of the "
                                  "pool runs, in lookup order: the keys of the instances' `tiers`")
    instances = InstanceStatusSerializer(many=True)
