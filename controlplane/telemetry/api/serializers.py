"""Query serializers of the telemetry reads, and the serializers that type their answers.

The answers are built by the selectors as plain dicts (the dashboards poll them every second, and
series hold up to thousands of points), so the output serializers describe them for the OpenAPI
schema rather than convert them; the names they list come from the selectors and the core, so the
schema cannot name a figure the answer lacks (``tests/controlplane/test_schema.py`` compares them).
"""

import re

from drf_spectacular.utils import extend_schema_field
from rest_framework import serializers

from controlplane.common.fields import QueryIntegerField, QueryNumberField
from controlplane.common.urls import INSTANCE_NAME_PATTERN
from relay_engine.core.forward_times import DRIFT_SUMS, OPS, PAIR_SUMS, SUMS
from relay_engine.core.outcomes import Outcome
from relay_engine.core.telemetry import MISS_REASONS, REFUSAL_REASONS

from ..forwards import DEFAULT_WINDOW_S, MAX_WINDOW_S
from ..history import GAUGES
from ..rollups import POOL_GAUGES
from ..selectors import (
    RANKINGS,
    SERIES_FIGURES,
    TABLE_COLUMNS,
    TABLE_COUNT_COLUMNS,
    TABLE_DEFAULT_SORT,
    TOP_DEFAULT,
    TOP_FIGURES,
    TOP_GAUGES,
    TOP_MAX,
    WINDOWS,
)

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


# --- answers -------------------------------------------------------------------------------------


def _serializer(name: str, doc: str, fields: dict[str, serializers.Field]) -> type[serializers.Serializer]:
    """A serializer class of ``fields`` (names that are no Python identifiers, such as ``from``, too)."""
    return type(name, (serializers.Serializer,), {"__doc__": doc, "__module__": __name__, **fields})


def _series(help_text: str = "") -> serializers.ListField:
    return serializers.ListField(child=serializers.FloatField(allow_null=True), help_text=help_text or
                                 "One value per point of `timestamps` (from `from`); null where there is no data.")


def _level_series() -> serializers.ListField:
    return serializers.ListField(child=serializers.IntegerField(allow_null=True), help_text=(
        "The newest level in each point of `timestamps` (from `from`); null where none was reported."))


def _figure_series(names: tuple[str, ...]) -> dict[str, serializers.Field]:
    return {name: _series() for name in names}


RefusalSeriesSerializer = _serializer(
    "RefusalSeriesSerializer", "Refused pre-infers per second, by reason.",
    {reason.value: _series() for reason in REFUSAL_REASONS})

MissSeriesSerializer = _serializer(
    "MissSeriesSerializer", "Misses (ranking requests whose prefix was in no cache tier) per second, by reason; "
    "each miss is counted under exactly one.",
    {reason.value: _series(f"{reason.label}: one value per point of `timestamps` (from `from`); null where there "
                           f"is no data.") for reason in MISS_REASONS})

LookupRatioSeriesSerializer = _serializer(
    "LookupRatioSeriesSerializer", "The share of cache lookups served each way, by outcome (every one the core "
    "knows; each lookup is counted once, in one of them).",
    {outcome.value: _series() for outcome in Outcome})

RefusalCountsSerializer = _serializer(
    "RefusalCountsSerializer", "Pre-infers refused over the window, by reason.",
    {reason.value: serializers.IntegerField() for reason in REFUSAL_REASONS})

MissCountsSerializer = _serializer(
    "MissCountsSerializer", "Misses over the window, by reason: they sum to `misses` where every snapshot carried "
    "its reasons (those from before miss reasons count under none).",
    {reason.value: serializers.IntegerField(help_text=reason.label) for reason in MISS_REASONS})


class WindowTotalsSerializer(serializers.Serializer):
    """The whole window's figures: counts summed, quantiles of the merged buckets."""

    rank_requests = serializers.IntegerField()
    rank_within_slo = serializers.IntegerField()
    p50_ms = serializers.FloatField(allow_null=True)
    p99_ms = serializers.FloatField(allow_null=True)
    slo_compliance_ratio = serializers.FloatField(allow_null=True)
    hbm_hit_ratio = serializers.FloatField(allow_null=True)
    hit_ratio = serializers.FloatField(allow_null=True, help_text="The share of lookups served without a "
                                                                  "recompute (every tier, a computation joined).")
    preinfer_admitted = serializers.IntegerField()
    preinfer_refused = RefusalCountsSerializer()
    misses = serializers.IntegerField(help_text="Lookups that found the prefix in no tier (recomputed).")
    misses_by_reason = MissCountsSerializer()


class AnnotationSerializer(serializers.Serializer):
    """A configuration change drawn on every time chart."""

    ts = serializers.FloatField(help_text="When (unix s).")
    generation = serializers.IntegerField(help_text="The generation it is about.")
    kind = serializers.ChoiceField(choices=["created", "publish", "rollback", "canary", "promoted", "rolled_back",
                                            "aborted"])
    actor = serializers.CharField()
    sha256 = serializers.CharField(allow_null=True)
    label = serializers.CharField(help_text="Short, for the chart.")
    detail = serializers.CharField(help_text="The hover text.")


def _window_frame() -> dict[str, serializers.Field]:
    """What every answer about a window says (``selectors._frame``) and its incremental part."""
    return {
        "pool": serializers.CharField(),
        "window": serializers.ChoiceField(choices=list(WINDOWS)),
        "tier": serializers.CharField(help_text="The telemetry tier read (its step, e.g. `10s`)."),
        "step_s": serializers.IntegerField(help_text="Seconds per point."),
        "start": serializers.FloatField(help_text="The window's first point (unix s)."),
        "end": serializers.FloatField(help_text="The end of its last point (unix s)."),
        "slo_ms": serializers.FloatField(help_text="The ranking P99 SLO of the desired revision."),
        "slo_target_ratio": serializers.FloatField(),
        "annotations": AnnotationSerializer(many=True),
        "from": serializers.FloatField(help_text="The first point sent: `start`, or the one at `since`."),
        "timestamps": serializers.ListField(child=serializers.FloatField(), help_text="Point starts (unix s)."),
    }


FleetSeriesSerializer = _serializer(
    "FleetSeriesSerializer", "The pool's series (the pool rollups) and its window totals; levels are sums over "
    "the instances reporting (`instances`).",
    {**_figure_series(SERIES_FIGURES), "preinfer_refused_per_s": RefusalSeriesSerializer(),
     "misses_per_s": MissSeriesSerializer(), "lookup_ratio": LookupRatioSeriesSerializer(),
     **{name: _level_series() for name in POOL_GAUGES}, "totals": WindowTotalsSerializer()})

TopInstanceSerializer = _serializer(
    "TopInstanceSerializer", "One of the worst instances, with its own series.",
    {"instance": serializers.CharField(), "value": serializers.FloatField(
        allow_null=True, help_text="What ranks it (`by`): its window P99 (ms) or HBM bytes / budget."),
     "from": serializers.FloatField(help_text="Its first point sent (the whole window for one the client does "
                                              "not hold)."),
     **_figure_series(TOP_FIGURES), **{name: _level_series() for name in TOP_GAUGES}})


class TopInstancesSerializer(serializers.Serializer):
    by = serializers.ChoiceField(choices=list(RANKINGS))
    n = serializers.IntegerField(help_text="How many were asked for (`top`).")
    reporting = serializers.IntegerField(help_text="Instances that reported in the window.")
    instances = TopInstanceSerializer(many=True, help_text="Worst first.")


PoolMetricsSerializer = _serializer(
    "PoolMetricsSerializer", "A pool's series over a window, its worst instances and the publishes.",
    {**_window_frame(), "fleet": FleetSeriesSerializer(),
     "top": TopInstancesSerializer(required=False, help_text="Absent with `top=0`.")})

InstanceSeriesSerializer = _serializer(
    "InstanceSeriesSerializer", "One instance's series: every figure, and its gauges.",
    {**_figure_series(SERIES_FIGURES), "preinfer_refused_per_s": RefusalSeriesSerializer(),
     "misses_per_s": MissSeriesSerializer(), "lookup_ratio": LookupRatioSeriesSerializer(),
     **{name: _level_series() for name in GAUGES}})

InstanceMetricsSerializer = _serializer(
    "InstanceMetricsSerializer", "One instance's series over a window, its totals and the publishes.",
    {**_window_frame(), "instance": serializers.CharField(), "series": InstanceSeriesSerializer(),
     "totals": WindowTotalsSerializer()})

InstanceRowSerializer = _serializer(
    "InstanceRowSerializer", "One instance's window figures and newest gauges; null where it has no value.",
    {"instance": serializers.CharField(),
     **{column: serializers.IntegerField(allow_null=True) if column in TABLE_COUNT_COLUMNS
        else serializers.FloatField(allow_null=True) for column in TABLE_COLUMNS[1:]}})


class InstanceTableSerializer(serializers.Serializer):
    pool = serializers.CharField()
    window = serializers.ChoiceField(choices=list(WINDOWS))
    start = serializers.FloatField(help_text="The window's start (unix s).")
    sort = serializers.CharField()
    count = serializers.IntegerField(help_text="Instances that reported in the window.")
    limit = serializers.IntegerField()
    offset = serializers.IntegerField()
    results = InstanceRowSerializer(many=True)


@extend_schema_field({"oneOf": [{"type": "string"}, {"type": "array", "items": {"type": "string"}}],
                      "nullable": True})
class ClockField(serializers.Field):
    """The clock the forwards were timed with: one name, several when the instances differ, null for none."""


ForwardOpsSerializer = _serializer(
    "ForwardOpsSerializer", f"The mergeable sums by operation and prefix-length bucket: each bucket's row is "
    f"({', '.join(SUMS)}).",
    {op: serializers.DictField(child=serializers.ListField(child=serializers.FloatField()), required=False)
     for op in OPS})


class ForwardSummarySerializer(serializers.Serializer):
    op = serializers.ChoiceField(choices=list(OPS))
    tokens_from = serializers.IntegerField(help_text="The bucket's prefix lengths: from (inclusive) …")
    tokens_to = serializers.IntegerField(help_text="… to (exclusive).")
    forwards = serializers.IntegerField()
    mean_tokens = serializers.FloatField()
    mean_short = serializers.FloatField()
    mean_candidates = serializers.FloatField()
    mean_ms = serializers.FloatField()
    cv = serializers.FloatField(help_text="Standard deviation ÷ mean.")
    mean_wall_ms = serializers.FloatField()


class ForwardDriftSerializer(serializers.Serializer):
    lag_edges_s = serializers.ListField(child=serializers.FloatField(), help_text="The lag bins' edges (s).")
    dev = serializers.ListField(child=serializers.FloatField(), help_text=(
        f"({', '.join(DRIFT_SUMS)}) of each forward's log deviation from its bucket's mean so far."))
    pairs = serializers.ListField(child=serializers.ListField(child=serializers.FloatField()), help_text=(
        f"One row per lag bin: ({', '.join(PAIR_SUMS)}) of the pairs of one instance's forwards that far "
        f"apart. A bin's covariance is sum_product ÷ pairs less the mean deviation squared: how long the "
        f"instance's speed stays off its mean (what the simulator draws its forward times with)."))


class ForwardTimesSerializer(serializers.Serializer):
    pool = serializers.CharField()
    window_s = serializers.IntegerField()
    to = serializers.FloatField(help_text="The window's end (unix s).")
    instances = serializers.ListField(child=serializers.CharField(), help_text="The instances counted.")
    model_version = serializers.CharField(allow_null=True, help_text="The model most instances run.")
    device_kind = serializers.CharField(allow_null=True)
    clock = ClockField()
    other_models = serializers.ListField(child=serializers.CharField(),
                                         help_text="Instances left out: they run another model.")
    unreadable = serializers.DictField(child=serializers.CharField(),
                                       help_text="Instances left out: why their record could not be read.")
    forwards = serializers.IntegerField()
    ops = ForwardOpsSerializer()
    drift = ForwardDriftSerializer()
    summary = ForwardSummarySerializer(many=True)


ForwardTimesSerializer._declared_fields["from"] = serializers.FloatField(help_text=(
    "Where the counted forwards begin (unix s): the earliest instance's record before the window (the "
    "streams keep one every 30 s for 2.5 min, then one every 10 min for an hour), or the start of a run begun "
    "in it. At or before `to − window_s`: a long window is counted to the nearest 10 min."))
