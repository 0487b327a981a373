"""Serializer pieces that refuse what DRF would quietly coerce: "3" for 3, true for 1, unknown keys."""

from __future__ import annotations

from drf_spectacular.types import OpenApiTypes
from drf_spectacular.utils import extend_schema_field
from rest_framework import serializers

from relay_engine.core.fields import FieldValueError, number_text

MAX_DB_INT = 2**31 - 1


class StrictIntegerField(serializers.IntegerField):
    """A JSON integer only: no strings, no booleans, no floats."""

    def __init__(self, **kwargs):
        kwargs.setdefault("max_value", MAX_DB_INT)
        super().__init__(**kwargs)

    def to_internal_value(self, data):
        if isinstance(data, bool) or not isinstance(data, int):
            self.fail("invalid")
        return super().to_internal_value(data)


class StrictCharField(serializers.CharField):
    """A JSON string only (DRF would turn 12 into "12")."""

    def to_internal_value(self, data):
        if not isinstance(data, str):
            self.fail("invalid")
        return super().to_internal_value(data)


class StrictBooleanField(serializers.BooleanField):
    def to_internal_value(self, data):
        if not isinstance(data, bool):
            self.fail("invalid")
        return data


class StrictSerializer(serializers.Serializer):
    """Input serializer that names unknown fields instead of ignoring them."""

    def to_internal_value(self, data):
        if not isinstance(data, dict):
            raise serializers.ValidationError(
                {"non_field_errors": [f"Expected a JSON object, got {type(data).__name__}."]}
            )
        unknown = sorted(set(data) - set(self.fields))
        if unknown:
            allowed = ", ".join(sorted(self.fields))
            raise serializers.ValidationError({key: [f"Unknown field; allowed: {allowed}."] for key in unknown})
        return super().to_internal_value(data)


@extend_schema_field(OpenApiTypes.NUMBER)
class QueryNumberField(serializers.Field):
    """A number from a query string, checked by the schema's one field helper (``number_text``):
    finite, in [lo, hi]; a 400-digit value is a 400, never an overflow."""

    default_error_messages = {"invalid": "must be a number written as text."}
    as_int = False

    def __init__(self, *, lo: float, hi: float, **kwargs):
        self.lo, self.hi = lo, hi
        super().__init__(**kwargs)

    def to_internal_value(self, data):
        if not isinstance(data, str):
            self.fail("invalid")
        try:
            return number_text(data, self.lo, self.hi, as_int=self.as_int)
        except FieldValueError as exc:
            raise serializers.ValidationError(str(exc)) from None

    def to_representation(self, value):
        return value


@extend_schema_field(OpenApiTypes.INT)
class QueryIntegerField(QueryNumberField):
    """An integer from a query string, in [lo, hi]."""

    as_int = True
