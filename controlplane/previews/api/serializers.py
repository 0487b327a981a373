from rest_framework import serializers

from ..models import Preview, PreviewScore
from ..traffic import DEFAULT_WINDOW, window_label


class PreviewRequestSerializer(serializers.Serializer):
    window = serializers.CharField(required=False, default=DEFAULT_WINDOW, max_length=16, help_text=(
        "The captured window to replay, ending now: a duration from 1m to 1h (e.g. 15m, 90s, 1h)."))


class TrafficQuerySerializer(serializers.Serializer):
    window = serializers.CharField(required=False, default=DEFAULT_WINDOW, max_length=16,
                                   help_text="A duration from 1m to 1h (e.g. 15m, 90s, 1h), ending now.")


class TrafficSummaryQuerySerializer(TrafficQuerySerializer):
    end = serializers.FloatField(required=False, help_text="Where the window ends, unix seconds (default now): "
                                 "within the capture's last hour, e.g. a preview's `window_to` to measure what "
                                 "the pool did on the very requests it replayed.")


def preview_url(pool: str, preview_id: int) -> str:
    return f"/api/v1/pools/{pool}/previews/{preview_id}/"


class WindowLabelMixin:
    """A ``window`` field: the window's length as people write it (``15m``), from ``window_s``."""

    def get_window(self, obj: Preview | PreviewScore) -> str:
        return window_label(obj.window_s)


class PreviewSerializer(WindowLabelMixin, serializers.ModelSerializer):
    pool = serializers.CharField(source="pool.name")
    window = serializers.SerializerMethodField()
    url = serializers.SerializerMethodField()

    class Meta:
        model = Preview
        fields = ["id", "pool", "generation", "live_generation", "sha256", "live_sha256", "window", "window_s",
                  "window_end", "status", "error", "result", "requested_by", "created_at", "started_at",
                  "finished_at", "url"]

    def get_url(self, obj: Preview) -> str:
        return preview_url(obj.pool.name, obj.pk)


class PreviewScoreSerializer(WindowLabelMixin, serializers.ModelSerializer):
    pool = serializers.CharField(source="pool.name")
    preview = serializers.SerializerMethodField()
    window = serializers.SerializerMethodField()

    class Meta:
        model = PreviewScore
        fields = ["id", "pool", "generation", "preview", "published_at", "published_via", "window", "window_s",
                  "measure_from", "measure_to", "converged_at", "status", "reason", "predicted", "measured",
                  "errors", "scored_at"]

    def get_preview(self, obj: PreviewScore) -> dict:
        return {"id": obj.preview_id, "url": preview_url(obj.pool.name, obj.preview_id)}



class CurveQuerySerializer(serializers.Serializer):
    window = serializers.CharField(required=False, default=DEFAULT_WINDOW, max_length=16,
                                   help_text="The captured window, ending now: a duration from 1m to 1h (e.g. 15m, 1h).")
    end = serializers.FloatField(required=False, help_text="Where the window ends, unix seconds (default now): "
                                 "within the capture's last hour, e.g. a preview's `window_to`.")


class CurvePointSerializer(serializers.Serializer):
    budget_mb = serializers.FloatField(required=False, help_text="The tier's budget per instance (a budget axis).")
    ttl_ms = serializers.IntegerField(required=False, help_text="HBM's entry TTL (the `entry_ttl` axis).")
    hit_ratio = serializers.FloatField(help_text="Predicted share of requests served from any tier.")
    tiers = serializers.DictField(child=serializers.FloatField(), help_text="Predicted share served by each tier.")


class CurveTierSerializer(serializers.Serializer):
    name = serializers.CharField()
    label = serializers.CharField()


class CurveLowerLiveSerializer(serializers.Serializer):
    budget_mb = serializers.FloatField()
    ttl_ms = serializers.FloatField()


class CurveLiveSerializer(serializers.Serializer):
    hbm_budget_mb = serializers.FloatField()
    entry_ttl_ms = serializers.IntegerField()
    lower = serializers.DictField(child=CurveLowerLiveSerializer(), help_text="Each lower tier's live budget and TTL.")
    hit_ratio = serializers.FloatField(help_text="Predicted at the live budgets.")
    tiers = serializers.DictField(child=serializers.FloatField())


class CurveModelSerializer(serializers.Serializer):
    num_layers = serializers.IntegerField()
    num_heads = serializers.IntegerField()
    head_dim = serializers.IntegerField()
    reported = serializers.BooleanField(help_text="False: no live instance reports its model; the defaults sized entries.")


class CacheCurvesSerializer(serializers.Serializer):
    pool = serializers.CharField()
    window = serializers.CharField()
    to = serializers.FloatField()
    requests = serializers.IntegerField(help_text="Served, replayable requests in the window.")
    requests_used = serializers.IntegerField(help_text="Those the curve was computed from (fewer when sampled).")
    sampling_rate = serializers.FloatField(help_text=(
        "SHARDS spatial sampling rate of the entries not kept whole (each kept one stands for 1 / rate); 1.0: exact."))
    entries_whole = serializers.IntegerField(help_text=(
        "The most requested entries, kept with every request when sampled (0 when exact)."))
    without_instance = serializers.IntegerField(help_text="Requests whose record names no instance (one shared stack).")
    tiers = CurveTierSerializer(many=True)
    live = CurveLiveSerializer()
    axes = serializers.DictField(child=CurvePointSerializer(many=True), help_text=(
        "`hbm`, each lower tier by name (its budget under the live HBM), `entry_ttl`: points in increasing order."))
    measured_hit_ratio = serializers.FloatField(help_text="What the instances served from any tier in the window.")
    error_points = serializers.FloatField(help_text="Predicted at the live budgets minus measured, in points.")
    model = CurveModelSerializer()
    elapsed_ms = serializers.FloatField()


CacheCurvesSerializer._declared_fields["from"] = serializers.FloatField()
