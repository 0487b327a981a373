"""JSON request bodies, bounded: what the size limit lets through must still parse into plain data.

Two inputs parse in Python yet fail later with a 500: JSON nested thousands of levels deep (the
decoder, or whatever walks the result, runs out of recursion) and strings holding a lone UTF-16
surrogate escape (``"\\ud800"``: valid JSON, not encodable as UTF-8, so the database or the response
fails on it). Both are refused here, at the edge, as a 400 that says what is wrong.
"""

from __future__ import annotations

import json
from typing import Any

from rest_framework.exceptions import ParseError
from rest_framework.parsers import JSONParser

# The deepest legitimate body is a spec with editing entries: five levels. Far below the recursion limit.
MAX_JSON_DEPTH = 32


def _reject_constant(name: str) -> None:
    raise ValueError(f"{name} is not valid JSON (use a finite number)")


def check_json_value(value: Any) -> None:
    """ValueError when ``value`` (parsed JSON) nests deeper than MAX_JSON_DEPTH or holds text that
    is not valid Unicode. Iterative: the check itself never recurses."""
    todo: list[tuple[Any, int]] = [(value, 1)]
    while todo:
        item, depth = todo.pop()
        if isinstance(item, (dict, list)):
            if depth > MAX_JSON_DEPTH:
                raise ValueError(f"nested deeper than {MAX_JSON_DEPTH} levels")
            children = [*item.keys(), *item.values()] if isinstance(item, dict) else item
            todo.extend((child, depth + 1) for child in children)
        elif isinstance(item, str):
            try:
                item.encode("utf-8")
            except UnicodeEncodeError:
                raise ValueError("a string holds an unpaired UTF-16 surrogate (\\ud800-\\udfff)") from None


def loads_bounded(text: str | bytes) -> Any:
    """``json.loads`` with NaN/Infinity refused and the limits of ``check_json_value``; ValueError otherwise."""
    try:
        value = json.loads(text, parse_constant=_reject_constant)
    except RecursionError:
        raise ValueError(f"nested deeper than {MAX_JSON_DEPTH} levels") from None
    check_json_value(value)
    return value


class BoundedJSONParser(JSONParser):
    """DRF's JSON parser (strict: no NaN/Infinity) with the limits of ``check_json_value``."""

    def parse(self, stream, media_type=None, parser_context=None):
        try:
            data = super().parse(stream, media_type, parser_context)
        except RecursionError:
            raise ParseError(f"JSON parse error - nested deeper than {MAX_JSON_DEPTH} levels") from None
        try:
            check_json_value(data)
        except ValueError as exc:
            raise ParseError(f"JSON parse error - {exc}") from None
        return data
