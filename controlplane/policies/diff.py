"""Field-by-field difference of two specs, by the same paths validation errors use."""

from __future__ import annotations

from typing import Any

_MISSING = object()


def _leaves(value: Any, path: str, out: dict[str, Any]) -> None:
    if isinstance(value, dict) and value:
        for key in sorted(value):
            _leaves(value[key], f"{path}.{key}" if path else str(key), out)
    elif isinstance(value, list) and value and all(isinstance(v, dict) for v in value):
        for i, item in enumerate(value):
            _leaves(item, f"{path}[{i}]", out)
    else:
        # Scalars, empty containers and numeric vectors (edit directions) compare as one value.
        out[path] = value


def spec_diff(before: dict[str, Any], after: dict[str, Any]) -> list[dict[str, Any]]:
    old: dict[str, Any] = {}
    new: dict[str, Any] = {}
    _leaves(before, "", old)
    _leaves(after, "", new)
    changes = []
    for path in sorted(set(old) | set(new)):
        a, b = old.get(path, _MISSING), new.get(path, _MISSING)
        if a == b:
            continue
        if a is _MISSING:
            changes.append({"path": path, "op": "added", "before": None, "after": b})
        elif b is _MISSING:
            changes.append({"path": path, "op": "removed", "before": a, "after": None})
        else:
            changes.append({"path": path, "op": "changed", "before": a, "after": b})
    return changes
