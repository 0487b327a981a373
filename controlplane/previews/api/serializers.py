from rest_framework import serializers

from ..models import Preview, PreviewScore
from ..traffic import DEFAULT_WINDOW, window_label


class PreviewRequestSerializer(serializers.Serializer):
    window = serializers.CharField(required=False, default=DEFAULT_WINDOW, max_length=16, help_text=(
        "The captured window to replay, ending now: a duration from 1m to 1h (e.g. 15m, 90s, 1h)."))


class TrafficQuerySerializer(serializers.Serializer):
    window = serializers.CharField(required=False, default=DEFAULT_WINDOW, max_length=16,
                                   help_text="A duration from 1m to 1h (e.g. 15m, 90s, 1h), ending now.")


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

