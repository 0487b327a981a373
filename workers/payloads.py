"""Task payloads: plain JSON data in, validated dataclasses out, and the result shapes.

A payload names its tokens either by length (``seq_len``, ``short_len``, ``n_candidates`` plus
``query_index``: the worker derives them with ``SyntheticFeatures``, the project's feature store)
or explicitly (``prefix_items``/``prefix_actions``[/``prefix_timestamps``], ``short_*``,
``candidates``). Validation is strict and reports every bad field, so a malformed payload yields an
error result that says what to fix; it never reaches the engine and never crashes the worker.

Results are JSON objects: ``{"ok": true, ...}`` or ``{"ok": false, "error": KIND, "message": ...,
"field": ..., "errors": {field: message}}`` with KIND one of ``ERROR_KINDS``.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

import torch

from relay_engine.core import fields
from relay_engine.core.engine import PreInferRequest, RankRequest
from relay_engine.core.features import SyntheticFeatures
from relay_engine.core.model import History
from relay_engine.core.trace import MAX_CANDIDATES, MAX_TRACE_SEQ_LEN

MAX_USER_ID_LEN = 256
MAX_QUERY_INDEX = 2**62
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
MAX_UNIX_S = 1e11  # year ~5138: any real deadline is far below

INVALID_INPUT = "invalid_input"
DEADLINE_EXCEEDED = "deadline_exceeded"
REFUSED = "refused"
INTERNAL = "internal"
ERROR_KINDS = (INVALID_INPUT, DEADLINE_EXCEEDED, REFUSED, INTERNAL)


class PayloadError(ValueError):
    """A malformed payload; ``errors`` maps each bad field to what is wrong with it."""

    def __init__(self, errors: dict[str, str]):
        self.errors = errors
        self.field = next(iter(errors))
        super().__init__("; ".join(f"{name}: {message}" for name, message in errors.items()))


def error_result(kind: str, message: str, *, field: str | None = None,
                 errors: dict[str, str] | None = None, **extra: Any) -> dict[str, Any]:
    result = {"ok": False, "error": kind, "message": message, **extra}
    if field is not None:
        result["field"] = field
        result["errors"] = errors or {field: message}
    return result


# --- field checks ----------------------------------------------------------------------------


class _Fields:
    def __init__(self, data: Any, allowed: set[str]):
        self.errors: dict[str, str] = {}
        if not isinstance(data, dict):
            self.data: dict[str, Any] = {}
            self.errors["payload"] = f"must be a JSON object, got {type(data).__name__}"
            return
        self.data = data
        for key in sorted(set(data) - allowed, key=str):
            self.errors[str(key)] = f"unknown field; allowed: {', '.join(sorted(allowed))}"

    def has(self, key: str) -> bool:
        return self.data.get(key) is not None

    def user_id(self) -> str:
        value = self.data.get("user_id")
        if isinstance(value, bool) or not isinstance(value, (str, int)) or str(value) == "":
            self.errors["user_id"] = f"is required: a non-empty string, got {value!r}"
            return ""
        if len(str(value)) > MAX_USER_ID_LEN:
            self.errors["user_id"] = f"is longer than {MAX_USER_ID_LEN} characters"
        return str(value)

    def integer(self, key: str, lo: int, hi: int, default: int | None = None) -> int | None:
        if not self.has(key):
            return default
        try:
            return fields.integer(self.data[key], lo, hi)
        except fields.FieldValueError as exc:
            self.errors[key] = str(exc)
            return default

    def number(self, key: str) -> float | None:
        """A finite number (unix seconds); a value beyond float's range is an error, not an overflow."""
        if not self.has(key):
            return None
        try:
            return fields.number(self.data[key], -MAX_UNIX_S, MAX_UNIX_S)
        except fields.FieldValueError as exc:
            self.errors[key] = f"{exc} (unix seconds)"
            return None

    def int_list(self, key: str, max_len: int) -> list[int] | None:
        if not self.has(key):
            return None
        try:
            return fields.int_list(self.data[key], max_len, INT64_MIN, INT64_MAX)
        except fields.FieldValueError as exc:
            self.errors[key] = str(exc)
            return None

    def tokens(self, name: str, length_key: str, *, min_len: int) -> tuple[int | None, dict[str, list[int]] | None]:
        """A run of tokens given by length (``length_key``) or explicitly (``{name}_items`` …)."""
        explicit_keys = [f"{name}_{part}" for part in ("items", "actions", "timestamps")]
        explicit = any(self.has(k) for k in explicit_keys)
        if explicit and self.has(length_key):
            self.errors[length_key] = f"give either {length_key} or {name}_items/{name}_actions, not both"
            return None, None
        if not explicit:
            if not self.has(length_key):
                self.errors[length_key] = f"is required (or explicit {name}_items and {name}_actions)"
            return self.integer(length_key, min_len, MAX_TRACE_SEQ_LEN), None
        lists = {part: self.int_list(f"{name}_{part}", MAX_TRACE_SEQ_LEN) for part in ("items", "actions")}
        for part, values in lists.items():
            if values is None and f"{name}_{part}" not in self.errors:
                self.errors[f"{name}_{part}"] = f"is required with {name}_items/{name}_actions"
        if self.has(f"{name}_timestamps"):
            lists["timestamps"] = self.int_list(f"{name}_timestamps", MAX_TRACE_SEQ_LEN)
        if any(v is None for v in lists.values()):
            return None, None
        lengths = {len(v) for v in lists.values()}
        if len(lengths) != 1:
            self.errors[f"{name}_actions"] = (f"{name}_items, _actions (and _timestamps) must have one length, got "
                                              f"{', '.join(f'{p}={len(v)}' for p, v in lists.items())}")
            return None, None
        if len(lists["items"]) < min_len:
            self.errors[f"{name}_items"] = f"must have at least {min_len} token(s)"
        return None, lists

    def raise_if_any(self) -> None:
        if self.errors:
            raise PayloadError(self.errors)


def _history(payload: Any, name: str) -> History | None:
    """The explicit token lists ``{name}_items`` … of a payload as a History, or None if not given."""
    items = getattr(payload, f"{name}_items")
    if items is None:
        return None
    return History.from_lists(items, getattr(payload, f"{name}_actions"), getattr(payload, f"{name}_timestamps"))


# --- payloads --------------------------------------------------------------------------------

_PREFIX_FIELDS = {"seq_len", "prefix_items", "prefix_actions", "prefix_timestamps"}


@dataclass(frozen=True)
class PreInferPayload:
    user_id: str
    seq_len: int | None = None
    prefix_items: list[int] | None = None
    prefix_actions: list[int] | None = None
    prefix_timestamps: list[int] | None = None

    @classmethod
    def parse(cls, data: Any) -> PreInferPayload:
        f = _Fields(data, {"user_id"} | _PREFIX_FIELDS)
        user_id = f.user_id()
        seq_len, prefix = f.tokens("prefix", "seq_len", min_len=1)
        f.raise_if_any()
        return cls(user_id, seq_len, **_prefixed("prefix", prefix))

    def to_dict(self) -> dict[str, Any]:
        return {k: v for k, v in asdict(self).items() if v is not None}

    def request(self, features: SyntheticFeatures) -> PreInferRequest:
        prefix = _history(self, "prefix")
        return PreInferRequest(self.user_id, prefix if prefix is not None else
                               features.prefix(self.user_id, self.seq_len))


@dataclass(frozen=True)
class RankPayload:
    user_id: str
    deadline_s: float | None = None
    query_index: int = 0
    query_timestamp: int | None = None
    seq_len: int | None = None
    short_len: int | None = None
    n_candidates: int | None = None
    prefix_items: list[int] | None = None
    prefix_actions: list[int] | None = None
    prefix_timestamps: list[int] | None = None
    short_items: list[int] | None = None
    short_actions: list[int] | None = None
    short_timestamps: list[int] | None = None
    candidates: list[int] | None = None

    @classmethod
    def parse(cls, data: Any) -> RankPayload:
        allowed = {"user_id", "deadline_s", "query_index", "query_timestamp", "short_len", "n_candidates",
                   "short_items", "short_actions", "short_timestamps", "candidates"} | _PREFIX_FIELDS
        f = _Fields(data, allowed)
        user_id = f.user_id()
        deadline_s = f.number("deadline_s")
        query_index = f.integer("query_index", 0, MAX_QUERY_INDEX, 0)
        query_timestamp = f.integer("query_timestamp", 0, 2**62)
        seq_len, prefix = f.tokens("prefix", "seq_len", min_len=1)
        short_len, short = f.tokens("short", "short_len", min_len=0)
        candidates = None
        if f.has("candidates") and f.has("n_candidates"):
            f.errors["n_candidates"] = "give either n_candidates or candidates, not both"
        elif f.has("candidates"):
            candidates = f.int_list("candidates", MAX_CANDIDATES)
        elif not f.has("n_candidates"):
            f.errors["n_candidates"] = "is required (or an explicit candidates list)"
        n_candidates = f.integer("n_candidates", 1, MAX_CANDIDATES)
        f.raise_if_any()
        return cls(user_id, deadline_s, query_index, query_timestamp, seq_len, short_len, n_candidates,
                   **_prefixed("prefix", prefix), **_prefixed("short", short), candidates=candidates)

    def to_dict(self) -> dict[str, Any]:
        return {k: v for k, v in asdict(self).items() if v is not None}

    def shape(self) -> tuple[int, int, int]:
        """(prefix tokens, short-term tokens, candidates), without building any tensor."""
        prefix = self.seq_len if self.seq_len is not None else len(self.prefix_items or ())
        short = self.short_len if self.short_len is not None else len(self.short_items or ())
        candidates = self.n_candidates if self.n_candidates is not None else len(self.candidates or ())
        return prefix, short, candidates

    def request(self, features: SyntheticFeatures) -> RankRequest:
        prefix = _history(self, "prefix")
        if prefix is None:
            prefix = features.prefix(self.user_id, self.seq_len)
        short = _history(self, "short")
        if short is None:
            short = features.short_term(self.user_id, self.query_index, self.short_len)
        candidates = torch.as_tensor(self.candidates, dtype=torch.int64) if self.candidates is not None \
            else features.candidates(self.query_index, self.n_candidates)
        return RankRequest(self.user_id, prefix, short, candidates, self.deadline_s, self.query_timestamp)


def _prefixed(name: str, lists: dict[str, list[int]] | None) -> dict[str, list[int] | None]:
    lists = lists or {}
    return {f"{name}_{part}": lists.get(part) for part in ("items", "actions", "timestamps")}

