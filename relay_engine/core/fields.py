"""Field checks shared by every schema: policies, task payloads, trace lines, settings, uploads.

One rule for numbers everywhere: booleans are not numbers; integers are compared exactly (a
400-digit integer is out of range, never an ``OverflowError``); floats must be finite; a float
that is a whole number is accepted where an integer is asked for. Values come back in one canonical
form per value (an int where an integer is asked for, a float with -0.0 as 0.0 where a number is),
so two inputs equal by value hash equal. Each check returns the value or
raises ``FieldValueError`` whose message says what is allowed, and ``FieldErrors`` collects such
messages by field path so a caller can report every bad field at once.
"""

from __future__ import annotations

import argparse
import json
import math
import zlib
from collections.abc import Callable
from typing import Any

# Longest rendering of a bad value inside a message: a huge integer or string is cut, not echoed.
_SHOW_CHARS = 40


class FieldValueError(ValueError):
    """A value that a field does not allow; the message says what is allowed (no field name)."""


class FieldErrors:
    """Error messages by field path (``trigger.at_risk_seq_len``, ``edits[2].alpha``)."""

    def __init__(self) -> None:
        self.by_path: dict[str, list[str]] = {}

    def add(self, path: str, message: str) -> None:
        self.by_path.setdefault(path or "(root)", []).append(message)

    def __bool__(self) -> bool:
        return bool(self.by_path)

    def __contains__(self, path: str) -> bool:
        return path in self.by_path

    def flat(self) -> dict[str, str]:
        """One message per path (several joined), for shapes that carry a string per field."""
        return {path: "; ".join(messages) for path, messages in self.by_path.items()}

    def summary(self) -> str:
        return "; ".join(f"{path}: {' '.join(msgs)}" for path, msgs in sorted(self.by_path.items()))


def json_value(raw: str | bytes, what: str, error: type[Exception] = FieldValueError) -> Any:
    """The JSON value of raw, or ``error`` saying that ``what`` is not JSON (a line of thousands of nested
    brackets included: ``RecursionError`` is caught, so a bad entry never crashes its decoder)."""
    try:
        return json.loads(raw)
    except (ValueError, RecursionError) as exc:  # UnicodeDecodeError is a ValueError
        raise error(f"{what} is not JSON: {exc}") from None


def inflated(packed: bytes, max_bytes: int, *, wbits: int = -15, zdict: bytes | None = None) -> bytes:
    """Raw-deflated ``packed`` inflated, refused (ValueError saying why) when it is corrupt, truncated,
    followed by other bytes, or would inflate past ``max_bytes`` (a bomb costs this much, not more)."""
    try:
        inflater = zlib.decompressobj(wbits, zdict=zdict) if zdict is not None else zlib.decompressobj(wbits)
        text = inflater.decompress(packed, max_bytes)
    except zlib.error as exc:
        raise ValueError(str(exc)) from None
    if inflater.unconsumed_tail:
        raise ValueError(f"inflates past {max_bytes} bytes")
    if not inflater.eof or inflater.unused_data:
        raise ValueError("truncated or followed by other bytes")
    return text


def join(path: str, key: str | int) -> str:
    """``a.b`` for a key, ``a[3]`` for an index."""
    if isinstance(key, int):
        return f"{path}[{key}]"
    return f"{path}.{key}" if path else key


def show(value: Any) -> str:
    """A bad value for a message, cut to a readable length."""
    text = repr(value)
    return text if len(text) <= _SHOW_CHARS else f"{text[:_SHOW_CHARS]}… ({len(text)} characters)"


def _bound(x: float) -> str:
    """A range bound as people write it: 16777216 not 1.67772e+07, 0.5 as 0.5."""
    return str(int(x)) if float(x).is_integer() and abs(x) < 1e16 else repr(float(x))


def _bounds(lo: float, hi: float, lo_open: bool) -> str:
    return f"{'(' if lo_open else '['}{_bound(lo)}, {_bound(hi)}]"


def is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def number(value: Any, lo: float, hi: float, *, lo_open: bool = False) -> float:
    """A finite number in [lo, hi] (or (lo, hi]), as a float."""
    if not is_number(value):
        raise FieldValueError(f"must be a number in {_bounds(lo, hi, lo_open)}, got {show(value)}")
    if isinstance(value, float) and not math.isfinite(value):
        raise FieldValueError(f"must be finite, got {value}")
    # int against float compares exactly in Python, so a huge int is simply out of range here
    if value < lo or value > hi or (lo_open and value == lo):
        raise FieldValueError(f"must be in {_bounds(lo, hi, lo_open)}, got {show(value)}")
    return canonical_float(value)


def canonical_float(value: int | float) -> float:
    """A float with one spelling per value: -0.0 is 0.0 (so equal policies hash equal)."""
    return float(value) + 0.0


def integer(value: Any, lo: int, hi: int) -> int:
    """An integer in [lo, hi]; a float with no fractional part counts as one."""
    if isinstance(value, float) and math.isfinite(value) and value.is_integer():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int):
        raise FieldValueError(f"must be an integer in [{lo}, {hi}], got {show(value)}")
    if not lo <= value <= hi:
        raise FieldValueError(f"must be in [{lo}, {hi}], got {show(value)}")
    return value


def number_text(text: str, lo: float, hi: float, *, as_int: bool = False) -> int | float:
    """A number written as text (an environment variable, a form field), checked like ``number``."""
    raw = text.strip()
    try:
        value: int | float = int(raw)
    except ValueError:
        if as_int:
            raise FieldValueError(f"must be an integer in [{lo}, {hi}], got {show(text)}") from None
        try:
            value = float(raw)
        except ValueError:
            raise FieldValueError(f"must be a number in {_bounds(lo, hi, False)}, got {show(text)}") from None
    return integer(value, int(lo), int(hi)) if as_int else number(value, lo, hi)


def argument(lo: float, hi: float, *, as_int: bool = False) -> Callable[[str], int | float]:
    """An argparse ``type``: a command-line number checked like ``number_text``, so a bad one is refused
    with what is allowed (``argument --threads: must be in [1, 256], got 0``)."""

    def parse(text: str) -> int | float:
        try:
            return number_text(text, lo, hi, as_int=as_int)
        except FieldValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None

    return parse


def text_number(text: str) -> int | float | None:
    """A form value as a number when it reads as one (integers stay integers); else None."""
    raw = text.strip()
    try:
        return int(raw)
    except ValueError:
        pass
    try:
        return float(raw)
    except ValueError:
        return None


def int_list(value: Any, max_len: int, lo: int, hi: int) -> list[int]:
    """A list of at most max_len integers, each in [lo, hi]; the message lists the first bad indices."""
    if not isinstance(value, list):
        raise FieldValueError(f"must be a list of integers, got {type(value).__name__}")
    if len(value) > max_len:
        raise FieldValueError(f"has {len(value)} entries; at most {max_len}")
    bad = [i for i, v in enumerate(value)
           if isinstance(v, bool) or not isinstance(v, int) or not lo <= v <= hi]
    if bad:
        raise FieldValueError(f"must hold integers in [{lo}, {hi}]; bad entries at indices {bad[:10]}")
    return value


def finite_list(value: Any, length: int | None = None) -> list[float]:
    """A list of finite numbers (of ``length`` entries when given), as floats."""
    if not isinstance(value, list):
        raise FieldValueError(f"must be a list of numbers, got {type(value).__name__}")
    if length is not None and len(value) != length:
        raise FieldValueError(f"has {len(value)} values; expected {length}")
    bad = [i for i, v in enumerate(value) if not is_number(v) or not is_finite(v)]
    if bad:
        raise FieldValueError(f"must hold finite numbers; bad values at indices {bad[:10]}")
    return [canonical_float(v) for v in value]


def is_finite(v: int | float) -> bool:
    """A number usable as a float: finite, and an integer only within float's range (no OverflowError)."""
    if isinstance(v, int):
        return -1e308 < v < 1e308  # an int beyond float's range cannot be used as a float
    return math.isfinite(v)
