import re

from rest_framework import serializers

from controlplane.common.fields import QueryIntegerField, QueryNumberField
from controlplane.common.urls import INSTANCE_NAME_PATTERN

from ..forwards import DEFAULT_WINDOW_S, MAX_WINDOW_S
from ..selectors import RANKINGS, TABLE_COLUMNS, TABLE_DEFAULT_SORT, TOP_DEFAULT, TOP_MAX, WINDOWS

_INSTANCE_RE = re.compile(f"^{INSTANCE_NAME_PATTERN}$")
# Any time a poll may name; checked for range so no value overflows on its way in.
_SINCE = {"lo": 0, "hi": 1e11}


def _window_field() -> serializers.ChoiceField:
    return serializers.ChoiceField(
        choices=list(WINDOWS), required=False, default="1h",
        error_messages={"invalid_choice": f"must be one of {', '.join(WINDOWS)}; got {{input!r}}."},
    )


class MetricsQuerySerializer(serializers.Serializer):
    window = _window_field()
    since = QueryNumberField(**_SINCE, required=False, default=None, help_text=(
        "Incremental poll: the start (unix s) of the last point the client holds; only points from "
        "there on are sent (that one again, as it may have grown)."))


class PoolMetricsQuerySerializer(MetricsQuerySerializer):
    top = QueryIntegerField(lo=0, hi=TOP_MAX, required=False, default=TOP_DEFAULT,
                           help_text=f"How many worst instances to send series of (0 to {TOP_MAX}).")
    rank_by = serializers.ChoiceField(
        choices=list(RANKINGS), required=False, default="p99",
        help_text="What makes an instance worst: `p99` (window P99) or `hbm` (HBM bytes / HBM budget).",
        error_messages={"invalid_choice": f"must be one of {', '.join(RANKINGS)}; got {{input!r}}."},
    )
    known = serializers.CharField(required=False, default="", allow_blank=True, max_length=TOP_MAX * 80,
                                  help_text="Comma-separated top instances whose series the client holds up "
                                            "to `since`: they get only the newer points.")

    def validate_known(self, value: str) -> tuple[str, ...]:
        names = tuple(name for name in value.split(",") if name)
        bad = [name for name in names if not _INSTANCE_RE.match(name)]
        if bad:
            raise serializers.ValidationError(f"{bad[0][:80]!r} is not an instance name (<pool>.<index>).")
        if len(names) > TOP_MAX:
            raise serializers.ValidationError(f"names at most {TOP_MAX} instances, got {len(names)}.")
        return names


_SORTS = [f"{direction}{column}" for column in TABLE_COLUMNS for direction in ("", "-")]


class InstanceTableQuerySerializer(serializers.Serializer):
    window = _window_field()
    sort = serializers.ChoiceField(
        choices=_SORTS, required=False, default=TABLE_DEFAULT_SORT,
        help_text="A column, `-` first for descending; instances without a value sort last either way.",
        error_messages={"invalid_choice": f"must be a column ({', '.join(TABLE_COLUMNS)}), `-` first for "
                                          f"descending; got {{input!r}}."},
    )
    limit = QueryIntegerField(lo=1, hi=500, required=False, default=25)
    offset = QueryIntegerField(lo=0, hi=100_000, required=False, default=0)


class ForwardTimesQuerySerializer(serializers.Serializer):
    window_s = QueryIntegerField(lo=30, hi=MAX_WINDOW_S, required=False, default=DEFAULT_WINDOW_S, help_text=(
        f"The window, seconds back from now ({DEFAULT_WINDOW_S} by default; at most {MAX_WINDOW_S}, what the "
        "instances' streams keep)."))
